"""Incremental detokenisation and stop strings with the bundled tokenizer."""
import pytest

from orchestrator.text import TextStream

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
