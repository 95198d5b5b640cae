"""Generator._apply with the bundled tokenizer: where a round's tokens end, the finish reason,
and the text that reaches the client (decoded at once only where stop strings need it); and a
round's end (its commit in a real redis-server, its emit) when the next round overtakes it."""
import asyncio

import pytest
import redis.asyncio as aioredis

from orchestrator.generation import GenerationRequest, Generator
from orchestrator.loop_state import Round
from specdec.internal.v1 import replica_pb2
from specdec.sampling import SamplingParams
from specdec.session_store import SessionHandle, SessionStore

PROMPT = "def greet(name):\n"
TEXT = "    print(name)\n    return None\n"


def begin(tokenizer, stop=(), store=None):
    generator = Generator(pools=None, store=store, tokenizer=tokenizer, max_len=2048)
    prompt = tokenizer(PROMPT)["input_ids"]
    req = GenerationRequest(prompt_ids=prompt, max_new_tokens=64, params=SamplingParams(temperature=0.0),
                            stop=list(stop), gamma=4)
    return generator, generator._begin(req, SessionHandle("s", "d", "t", 1, list(prompt)), None, len(prompt))


def one_round(generator, gen, round_tokens):
    """A round whose draft was all but its last token, all kept, the last one the bonus."""
    m = len(gen.handle.committed)
    verdict = replica_pb2.VerifyResponse(accepted=len(round_tokens) - 1, next_token=round_tokens[-1],
                                         cache_length=m + len(round_tokens) - 1)
    new, text, reason = generator._apply(gen, m, len(round_tokens) - 1, round_tokens[:-1], verdict)
    if text is None:  # left to _finish_round, which decodes it as here
        text = gen.text.push(new)[0]
    return new, text, reason


def test_a_round_ends_after_eos_and_its_text_has_nothing_past_it(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    eos = tokenizer.eos_token_id
    generator, gen = begin(tokenizer)
    new, text, reason = one_round(generator, gen, ids[:3] + [eos] + ids[3:5])
    assert (new, reason) == (ids[:3] + [eos], "eos")
    assert text + gen.text.flush() == tokenizer.decode(ids[:3])
    assert gen.handle.committed[-4:] == new
    assert gen.handle.cursor.target_len == len(gen.handle.committed) - 1


def test_text_is_left_to_the_finish_without_stop_strings_and_decided_with_them(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    generator, gen = begin(tokenizer)
    _, text, _ = generator._apply(gen, len(gen.handle.committed), 3, ids[:3], replica_pb2.VerifyResponse(
        accepted=3, next_token=ids[3], cache_length=len(gen.handle.committed) + 3))
    assert text is None

    stop = tokenizer.decode(ids[4:6])
    generator, gen = begin(tokenizer, stop=[stop])
    pieces, reason = [], "length"
    for i in range(0, len(ids), 3):
        new, text, reason = one_round(generator, gen, ids[i:i + 3])
        pieces.append(text)
        if reason != "length":
            break
    assert reason == "stop"
    full = tokenizer.decode(ids)
    assert "".join(pieces) + gen.text.flush() == full[: full.index(stop)]


@pytest.mark.parametrize("stop_after_eos", [True, False])
def test_eos_before_a_stop_string_finishes_as_eos(tokenizer, stop_after_eos):
    """The tokens past an EOS are not output, so a stop string they would complete ends nothing."""
    ids = tokenizer(TEXT)["input_ids"]
    eos = tokenizer.eos_token_id
    stop = tokenizer.decode(ids[1:3]) if stop_after_eos else tokenizer.decode(ids[0:1])
    generator, gen = begin(tokenizer, stop=[stop])
    round_tokens = ids[:1] + [eos] + ids[1:3] if stop_after_eos else ids[:2] + [eos]
    new, _, reason = one_round(generator, gen, round_tokens)
    assert reason == ("eos" if stop_after_eos else "stop")
    assert new == (ids[:1] + [eos] if stop_after_eos else ids[:1])


def test_a_rounds_commit_lands_in_place_when_the_next_round_is_applied_before_it_runs(tokenizer, redis_server):
    """A round's commit runs once the next round's verification has left (Generator._end_round),
    and that verification may answer, and its round be applied to the handle, before the
    commit's turn comes. The commit must still write the round's own tokens at their own
    offset: the stored session is what later calls continue from."""
    async def go():
        client = aioredis.from_url(redis_server.url)
        store = SessionStore(client, ttl_seconds=30)
        generator, gen = begin(tokenizer, store=store)
        await store.create(gen.handle)
        ids = tokenizer(TEXT * 3)["input_ids"]
        emitted = []

        async def emit(text, tokens, scores):
            emitted.append(tokens)

        def end(new, first):
            book = Round(len(new) - 1, len(new) - 1, (), len(new), 1, True, 1, 0.01, 0.005, False, ())
            return generator._end_round(gen, book, new, None, None, emit, first=first)

        rounds = [ids[0:3], ids[3:7], ids[7:9], ids[9:12]]
        news = [one_round(generator, gen, rounds[0])[0]]
        release, pending = end(news[0], first=True)
        for tokens in rounds[1:]:
            news.append(one_round(generator, gen, tokens)[0])  # applied before the last round's commit runs
            release.set()
            await pending
            release, pending = end(news[-1], first=False)
        release.set()
        await pending
        stored = await store.load(gen.handle.session_id)
        await client.aclose()
        return stored, emitted, news

    stored, emitted, news = asyncio.run(go())
    assert emitted == news
    assert stored.committed == tokenizer(PROMPT)["input_ids"] + [t for new in news for t in new]
    assert stored.length == stored.cursor.target_len + 1


def test_a_call_cut_just_before_the_clients_deadline_was_cut_by_it():
    """Timers fire up to a millisecond early (uvloop's count whole milliseconds): a call they
    cut that close to the client's deadline is the deadline's, not a silent replica's (which
    would be marked down, and the client answered UNAVAILABLE)."""
    from orchestrator.generation import DEADLINE_SLACK_S, deadline_passed

    assert deadline_passed(10.0, 10.0) and deadline_passed(10.0, 10.5)
    assert deadline_passed(10.0, 9.9996) and DEADLINE_SLACK_S <= 0.01
    assert not deadline_passed(10.0, 9.9) and not deadline_passed(None, 10.0)
