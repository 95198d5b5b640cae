"""Request ids' records on a session: where each request's answer lies, and when it is done."""
from orchestrator import request_ids as rq
from orchestrator.request_ids import RequestMark
from specdec.rounds import Ends


def test_a_request_without_a_session_gets_the_same_session_id_every_attempt():
    assert rq.session_for("abc") == rq.session_for("abc")
    assert rq.session_for("abc") != rq.session_for("abd")
    assert rq.session_for("abc").startswith(rq.SESSION_PREFIX)


def test_the_previous_answer_ends_where_the_next_prompt_begins():
    marks = rq.record([], "a", "fa", 0, 5)  # prompt of 5 tokens, answer from 5
    marks = rq.record(marks, "b", "fb", 12, 15)  # a's answer 5..12, b's prompt 12..15
    assert marks == [RequestMark("a", "fa", 5, 12), RequestMark("b", "fb", 15)]
    committed = list(range(20))
    assert rq.answer(committed, rq.find(marks, "a")) == list(range(5, 12))
    assert rq.answer(committed, rq.find(marks, "b")) == list(range(15, 20))
    assert rq.find(marks, "c") is None


def test_a_request_without_an_id_still_closes_the_previous_answer():
    marks = rq.record(rq.record([], "a", "fa", 0, 5), "", "", 9, 11)
    assert marks == [RequestMark("a", "fa", 5, 9)]


def test_a_session_keeps_the_latest_records_only():
    marks = []
    for i in range(rq.MAX_KEPT + 3):
        marks = rq.record(marks, f"r{i}", "f", 10 * i, 10 * i + 2)
    assert len(marks) == rq.MAX_KEPT
    assert rq.find(marks, "r0") is None and rq.find(marks, f"r{rq.MAX_KEPT + 2}").end == -1


def test_the_last_id_wins_where_one_was_used_twice():
    marks = rq.record(rq.record([], "a", "f1", 0, 3), "a", "f2", 8, 10)
    assert rq.find(marks, "a") == RequestMark("a", "f2", 10)


def test_records_survive_their_stored_form():
    mark = RequestMark("a", "f", 3, 9)
    assert RequestMark.from_list(mark.to_list()) == mark


def test_an_answer_is_done_by_eos_length_or_context_only():
    eos = Ends(eos_ids=frozenset({2}))
    assert rq.finished([4, 5, 2], 10, eos, 50, 100) == "eos"
    assert rq.finished([4, 5, 6], 3, eos, 50, 100) == "length"
    assert rq.finished([4, 5, 6], 10, eos, 100, 100) == "context"
    assert rq.finished([4, 2, 6], 10, eos, 50, 100) is None  # EOS only ends an answer at its end
    assert rq.finished([], 10, eos, 50, 100) is None
    assert rq.finished([4], 10, Ends(), 50, 100) is None
    # a stop token ends it too; an ignored EOS does not
    assert rq.finished([4, 7], 10, Ends(eos_ids=frozenset({2}), stop_ids=frozenset({7})), 50, 100) == "stop"
    assert rq.finished([4, 2], 10, Ends(stop_ids=frozenset({7})), 50, 100) is None


def test_fingerprints_tell_requests_apart():
    assert rq.fingerprint(b"x") == rq.fingerprint(b"x") != rq.fingerprint(b"y")
