"""PromptScores (orchestrator/loop_state.py): which target calls score a prompt, and where
their fed tokens' log-probabilities land."""
import pytest

from orchestrator.loop_state import PromptScores
from specdec.errors import PreconditionFailed
from specdec.internal.v1 import replica_pb2


def answer(start: int, fed: int) -> replica_pb2.VerifyResponse:
    """A call's answer whose k-th fed log-probability is -(the position it scores)."""
    return replica_pb2.VerifyResponse(fed_logprobs=[-(start + 1 + k) for k in range(fed - 1)])


def test_calls_feeding_the_prompt_score_it_once_each_position_and_the_rest_are_not_asked():
    scores = PromptScores(first=4, end=10, top=0)
    assert not scores.wants(0, 4)  # scores positions 1..3: before the prompt
    assert not scores.wants(3, 1)  # feeds one token: scores nothing
    assert scores.wants(0, 5) and scores.wants(9, 3) is False and scores.wants(8, 3)
    scores.note(2, answer(2, 5))  # positions 3..6: 4..6 kept
    assert sorted(scores.got) == [4, 5, 6] and scores.missing(7) and not scores.missing(5)
    scores.note(6, answer(6, 6))  # 7..11: 7..9 kept
    assert not scores.wants(0, 20)
    committed = list(range(100, 120))
    assert [(t, r.logprob) for t, r in scores.result(committed, "t")] == [(100 + p, -p) for p in range(4, 10)]


def test_positions_a_replica_left_out_fail_the_call_clearly():
    scores = PromptScores(first=1, end=5, top=0)
    scores.note(0, replica_pb2.VerifyResponse())  # a replica from before fed log-probabilities
    with pytest.raises(PreconditionFailed, match="no prompt log-probabilities"):
        scores.result(list(range(6)), "127.0.0.1:1")
    assert PromptScores(first=3, end=3, top=0).result([1, 2, 3], "t") == []  # an empty prompt


def test_stored_scores_restore_whole_or_not_at_all():
    scores = PromptScores(first=2, end=5, top=0)
    scores.note(1, answer(1, 4))  # positions 2..4
    assert scores.complete
    again = PromptScores(first=2, end=5, top=0)
    assert again.restore(scores.packed()) and again.stored and again.got == scores.got
    assert not again.wants(1, 4)
    short = PromptScores(first=2, end=6, top=0)
    assert not short.restore(scores.packed()) and not short.stored and not short.got
