"""The access log's lines and fields (orchestrator/access_log.py)."""
from __future__ import annotations

import json
import logging
import time

import grpc
import pytest

from orchestrator import access_log
from orchestrator.loop_state import Outcome, Stats
from specdec.config import JsonLogFormatter
from specdec.v1 import orchestrator_pb2 as pb


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def kept():
    handler = Kept()
    access_log.log.addHandler(handler)
    yield handler
    access_log.log.removeHandler(handler)
    access_log.configure(True)


def outcome() -> Outcome:
    stats = Stats(rounds=4, drafted=12, accepted=9, gamma_sum=12)
    return Outcome("s-1", [5, 6, 7, 8, 9, 10, 11, 12, 13], "eos", stats, 17, 0, "10.0.0.1:50051", "10.0.0.2:50052",
                   12.5)


def test_a_finished_call_gives_its_facts_as_text_and_as_json_fields(kept):
    access_log.configure(True)
    access_log.record("Generate", grpc.StatusCode.OK, time.perf_counter() - 0.25, pb.GenerateRequest(request_id="r-9"),
                      outcome(), "ipv4:127.0.0.1:4000")
    record = kept.records[-1]
    message = record.getMessage()
    assert message.startswith("method=Generate code=OK ms=") and "peer=ipv4:127.0.0.1:4000" in message
    assert "session=s-1 prompt_tokens=17 tokens=9 finish=eos draft=10.0.0.1:50051" in message
    assert "rounds=4 mean_gamma=3.0 acceptance=0.75 request_id=r-9" in message
    entry = json.loads(JsonLogFormatter().format(record))
    assert entry["logger"] == "specdec.access" and entry["message"] == message
    assert entry["tokens"] == 9 and entry["acceptance"] == 0.75 and 250 <= entry["ms"] < 10_000


def test_a_refused_call_names_its_session_and_quotes_its_error(kept):
    access_log.configure(True)
    access_log.record("GenerateStream", grpc.StatusCode.INVALID_ARGUMENT, time.perf_counter(),
                      pb.GenerateRequest(session_id="chat-1"), None, None, 'top_p must lie in (0, 1], got "2"')
    message = kept.records[-1].getMessage()
    assert message.startswith("method=GenerateStream code=INVALID_ARGUMENT ms=")
    assert message.endswith('peer=- session=chat-1 error="top_p must lie in (0, 1], got \\"2\\""')
    assert "tokens=" not in message


def test_a_request_that_did_not_parse_still_gets_its_line(kept):
    access_log.configure(True)
    access_log.record("Generate", grpc.StatusCode.INVALID_ARGUMENT, time.perf_counter(), object(), None, "ipv6:[::1]:1",
                      "not a valid GenerateRequest")
    assert kept.records[-1].getMessage().startswith("method=Generate code=INVALID_ARGUMENT")


def test_off_writes_nothing(kept):
    access_log.configure(False)
    access_log.record("Generate", grpc.StatusCode.OK, time.perf_counter(), pb.GenerateRequest(), outcome(), "x")
    assert not kept.records
