"""Incremental detokenisation and stop strings with the bundled tokenizer."""
import copy

import pytest

from orchestrator.text import TextStream, plain_decoder

TEXT = "def greet(name):\n    print(f'héllo, {name} ✓')\n    return None\n"


def feed(stream, ids, round_size):
    out, kept = [], []
    for i in range(0, len(ids), round_size):
        chunk, k = stream.push(ids[i:i + round_size])
        out.append(chunk)
        kept.append(k)
        if stream.stopped:
            break
    out.append(stream.flush())
    return "".join(out), kept


@pytest.mark.parametrize("round_size", [1, 3, 5])
def test_streamed_text_equals_the_full_decode(tokenizer, round_size):
    ids = tokenizer(TEXT)["input_ids"]
    text, _ = feed(TextStream(tokenizer, []), ids, round_size)
    assert text == tokenizer.decode(ids)


@pytest.mark.parametrize("round_size", [1, 4])
def test_stop_string_ends_the_text_before_it(tokenizer, round_size):
    ids = tokenizer(TEXT)["input_ids"]
    stream = TextStream(tokenizer, ["return"])
    text, kept = feed(stream, ids, round_size)
    assert stream.stopped
    assert text == TEXT[: TEXT.index("return")]
    # the tokens kept reach exactly the one that completed the stop string
    n_kept = sum(kept)
    assert "return" in tokenizer.decode(ids[:n_kept]) and "return" not in tokenizer.decode(ids[: n_kept - 1])


def test_a_possible_stop_prefix_is_held_back(tokenizer):
    stream = TextStream(tokenizer, ["\n\n\n"])
    ids = tokenizer("x = 1\n\n")["input_ids"]
    chunk, _ = stream.push(ids)
    assert chunk == "x = 1" and stream.flush() == "\n\n"


TWICE = "x = 1\nreturn x\ny = 2\nreturn y\n"


def _completing_count(tokenizer, ids, stop: str, after: int = 0) -> int:
    """How many tokens it takes for the text to hold `stop` ending past its first `after` tokens' text."""
    floor = len(tokenizer.decode(ids[:after]))
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n])
        if text.find(stop, max(0, floor - len(stop) + 1)) != -1:
            return n
    raise AssertionError(f"{stop!r} is not in the text")


@pytest.mark.parametrize("round_size", [1, 4])
def test_min_tokens_holds_stop_strings_off_until_a_token_past_it_completes_one(tokenizer, round_size):
    """A stop string completed by one of the first min_tokens tokens does not end the text
    (EOS and stop tokens are banned there; vLLM holds stop strings off too); the next one
    completed at or past the min_tokens-th token does, even where it began before."""
    ids = tokenizer(TWICE)["input_ids"]
    first = _completing_count(tokenizer, ids, "return")
    # min_tokens at the completing token: the first occurrence counts
    stream = TextStream(tokenizer, ["return"], min_tokens=first)
    text, kept = feed(stream, ids, round_size)
    assert stream.stopped and text == TWICE[: TWICE.index("return")] and sum(kept) == first
    # one more: the first is held off, the second ends it
    stream = TextStream(tokenizer, ["return"], min_tokens=first + 1)
    text, kept = feed(stream, ids, round_size)
    assert stream.stopped and text == TWICE[: TWICE.rindex("return")]
    assert sum(kept) == _completing_count(tokenizer, ids, "return", after=first)
    # past both: the whole text, nothing held back
    stream = TextStream(tokenizer, ["return"], min_tokens=len(ids))
    text, _ = feed(stream, ids, round_size)
    assert not stream.stopped and text == TWICE


def test_a_stop_string_begun_before_min_tokens_ends_the_text_once_a_later_token_completes_it(tokenizer):
    ids = tokenizer(TWICE)["input_ids"]
    stop = "1\nreturn"  # begins in the first tokens
    completes = _completing_count(tokenizer, ids, stop)
    for min_tokens in (completes - 1, completes):
        stream = TextStream(tokenizer, [stop], min_tokens=min_tokens)
        text, kept = feed(stream, ids, 1)
        assert stream.stopped and text == TWICE[: TWICE.index(stop)] and sum(kept) == completes
    stream = TextStream(tokenizer, [stop], min_tokens=completes + 1)
    assert feed(stream, ids, 1)[0] == TWICE and not stream.stopped


def test_the_direct_decode_gives_the_wrappers_text(tokenizer):
    """plain_decoder skips Hugging Face's decode wrapper for the bundled tokenizer; every
    window a stream may decode must read the same either way."""
    import random

    decode = plain_decoder(tokenizer)
    assert decode.func is not tokenizer.decode  # the Rust tokenizer's own call
    ids = tokenizer(TEXT + "<|endoftext|> and after")["input_ids"]
    rng = random.Random(0)
    windows = [ids[i:j] for i in range(len(ids)) for j in range(i, min(len(ids), i + 6) + 1)]
    windows += [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(0, 8))] for _ in range(3000)]
    for window in windows:
        assert decode(window) == tokenizer.decode(window, skip_special_tokens=True), window


def test_a_tokenizer_that_cleans_up_spaces_or_decodes_its_own_way_keeps_its_decode(tokenizer):
    cleaning = copy.copy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert plain_decoder(cleaning).func == cleaning.decode

    class Shouting(type(tokenizer)):
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()

    shouting = copy.copy(tokenizer)
    shouting.__class__ = Shouting
    ids = tokenizer(TEXT)["input_ids"]
    assert plain_decoder(shouting)(ids) == TEXT.upper()
