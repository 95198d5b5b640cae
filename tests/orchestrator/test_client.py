"""The command-line client, run as a user runs it (`python -m orchestrator.client`) against
the shared local stack: streamed text and stats, JSON for scripts, a conversation kept,
continued and ended, and failures as one line with the gRPC status and exit status 1."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from orchestrator.request_ids import session_for
from tests.e2e.helpers import api, redis_client, request, session_handles

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def client(*args: str, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.client", *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=120, env=env)


def test_the_text_streams_to_stdout_and_the_stats_to_stderr(local_stack):
    want = api(local_stack.orchestrator_address).Generate(request("def parse(line):\n", 24, 0.0), timeout=60)
    done = client("def parse(line):\n", "--address", local_stack.orchestrator_address, "--max-new-tokens", "24")
    assert done.returncode == 0, done.stderr
    assert done.stdout == want.text
    assert re.search(r"\[24 tokens in \d+ ms = [\d.]+ tok/s", done.stderr)
    assert "finish FINISH_REASON_LENGTH" in done.stderr


def test_json_output_and_a_prompt_from_stdin(local_stack):
    done = client("-", "--address", local_stack.orchestrator_address, "--max-new-tokens", "8", "--json",
                  "--temperature", "1", "--seed", "5", stdin="import os\n")
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert len(reply["token_ids"]) == 8 and reply["stats"]["seed"] == "5"
    again = json.loads(client("-", "--address", local_stack.orchestrator_address, "--max-new-tokens", "8", "--json",
                              "--temperature", "1", "--seed", "5", stdin="import os\n").stdout)
    assert again["token_ids"] == reply["token_ids"]


def test_logprobs_in_json_and_their_sum_after_a_stream(local_stack):
    want = api(local_stack.orchestrator_address).Generate(
        request("def parse(line):\n", 16, 0.0, logprobs=True), timeout=60)
    total = sum(item.logprob for item in want.logprobs)
    reply = json.loads(client("def parse(line):\n", "--address", local_stack.orchestrator_address,
                              "--max-new-tokens", "16", "--json", "--top-logprobs", "2").stdout)
    assert [item["token_id"] for item in reply["logprobs"]] == reply["token_ids"]
    assert all(len(item["top"]) == 2 for item in reply["logprobs"])
    done = client("def parse(line):\n", "--address", local_stack.orchestrator_address, "--max-new-tokens", "16",
                  "--logprobs")
    assert done.returncode == 0, done.stderr
    said = re.search(r"logprobs of 16 tokens: sum (-?[\d.]+), mean -?[\d.]+, perplexity [\d.]+", done.stderr)
    assert said and abs(float(said.group(1)) - total) < 0.01
    assert "logprobs" not in client("x", "--address", local_stack.orchestrator_address, "--max-new-tokens", "2").stderr
    bad = client("x", "--address", local_stack.orchestrator_address, "--top-logprobs", "21")
    assert bad.returncode == 2 and "--top-logprobs must lie in 0..20" in bad.stderr
    prompt = client("def parse(line):\n", "--address", local_stack.orchestrator_address, "--max-new-tokens", "4",
                    "--prompt-logprobs")
    assert re.search(r"prompt logprobs of \d+ tokens: sum -?[\d.]+", prompt.stderr) and "\nlogprobs" not in prompt.stderr


def test_a_conversation_kept_continued_and_ended(local_stack):
    address = local_stack.orchestrator_address
    first = client("class Stack:\n", "--address", address, "--max-new-tokens", "8", "--keep-session")
    assert first.returncode == 0, first.stderr
    session = re.search(r"session (\S+), finish", first.stderr).group(1)
    assert session in session_handles(local_stack)
    second = client("", "--address", address, "--max-new-tokens", "8", "--session-id", session)
    assert second.returncode == 0, second.stderr
    ended = client("--end-session", session, "--address", address)
    assert ended.returncode == 0 and f"session {session} ended" in ended.stderr
    assert session not in session_handles(local_stack)
    again = client("--end-session", session, "--address", address)
    assert again.returncode == 1
    assert "error: NOT_FOUND:" in again.stderr and "Traceback" not in again.stderr


def test_the_end_and_min_p_flags_reach_the_server(local_stack):
    address = local_stack.orchestrator_address
    full = client("class Stack:\n", "--address", address, "--max-new-tokens", "12", "--json")
    tokens = json.loads(full.stdout)["token_ids"]
    k = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    cut = client("class Stack:\n", "--address", address, "--max-new-tokens", "12", "--json",
                 "--stop-token-id", str(tokens[k]), "--stop-token-id", "5", "--ignore-eos")
    assert cut.returncode == 0, cut.stderr
    answer = json.loads(cut.stdout)
    assert answer["token_ids"] == tokens[: k + 1] and answer["finish_reason"] == "FINISH_REASON_STOP"
    sampled = client("def f(", "--address", address, "--max-new-tokens", "8", "--temperature", "1", "--min-p",
                     "0.2", "--seed", "4")
    assert sampled.returncode == 0, sampled.stderr
    processed = client("def f(", "--address", address, "--max-new-tokens", "6", "--processed-logprobs", "--json")
    assert processed.returncode == 0, processed.stderr
    assert [x.get("logprob", 0.0) for x in json.loads(processed.stdout)["logprobs"]] == [0.0] * 6  # greedy: one-hot
    penalised = client("def f(", "--address", address, "--max-new-tokens", "6", "--repetition-penalty", "1.3",
                       "--presence-penalty", "0.5", "--frequency-penalty", "0.2")
    assert penalised.returncode == 0, penalised.stderr
    steered = client("class Stack:\n", "--address", address, "--max-new-tokens", "12", "--json",
                     "--logit-bias", f"{tokens[0]}=-100", "--min-tokens", "12")
    assert steered.returncode == 0, steered.stderr
    assert json.loads(steered.stdout)["token_ids"][0] != tokens[0]
    bad_bias = client("x", "--address", address, "--logit-bias", "7")
    assert bad_bias.returncode == 2 and "expected ID=BIAS" in bad_bias.stderr
    refused = client("x", "--address", address, "--frequency-penalty", "3")
    assert refused.returncode == 1 and "error: INVALID_ARGUMENT: frequency_penalty" in refused.stderr
    bad = client("x", "--address", address, "--min-p", "1.5")
    assert bad.returncode == 1 and "error: INVALID_ARGUMENT: min_p" in bad.stderr
    seeded_lookup = client("x", "--address", address, "--prompt-lookup", "on", "--temperature", "1", "--seed", "3")
    assert seeded_lookup.returncode == 1 and "error: INVALID_ARGUMENT: prompt_lookup" in seeded_lookup.stderr
    repeats = "a = [1, 2, 3]\nb = [1, 2, 3]\nc = [1, 2, 3]\n"
    unlooked = client(repeats, "--address", address, "--max-new-tokens", "16", "--json", "--prompt-lookup", "off")
    assert unlooked.returncode == 0, unlooked.stderr
    assert int(json.loads(unlooked.stdout)["stats"].get("lookup_drafted_tokens", 0)) == 0


@pytest.mark.parametrize("args, words", [
    (["x", "--top-p", "2"], "error: INVALID_ARGUMENT: top_p"),
    (["x", "--address", "127.0.0.1:1", "--timeout", "2"], "error: UNAVAILABLE:"),
])
def test_a_failed_call_is_one_line_with_its_status(local_stack, args, words):
    if "--address" not in args:
        args = [*args, "--address", local_stack.orchestrator_address]
    done = client(*args)
    assert done.returncode == 1
    assert words in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("args, words", [
    ([], "give a prompt ('-' reads standard input), --message ROLE:TEXT, or --end-session ID"),
    (["x", "--end-session", "abc"], "--end-session takes no prompt"),
    (["--message", "no role here"], "expected ROLE:TEXT (say user:Hello), got 'no role here'"),
    (["x", "--message", "user:hi"], "--message takes no prompt, --end-session or --session-id"),
    (["x", "--timeout", "-1"], "--timeout must be a finite number of seconds above 0, got -1.0"),
    (["x", "--retries", "-2"], "--retries must be 0 or more, got -2"),
    (["x", "--ca-file", __file__], f"--ca-file: the TLS CA file {__file__} holds no PEM certificate"),
    (["x", "--ca-file", "/no/such/ca.pem"], "--ca-file: [Errno 2] No such file or directory: '/no/such/ca.pem'"),
])
def test_a_usage_error_says_what_is_missing(args, words):
    done = client(*args)
    assert done.returncode == 2 and words in done.stderr


def test_retries_ride_out_an_orchestrator_killed_mid_answer_and_show_no_text_twice(local_stack):
    """The address a load balancer would keep: the orchestrator behind it killed mid-stream
    and a new one started there. The client sends the call again with its request id, and
    what it shows is exactly the uninterrupted answer."""
    lease = ["--session-lease", "2"]
    doomed = local_stack.start_orchestrator(extra=lease)
    port, rid = doomed.port, uuid.uuid4().hex
    args = ["def main(", "--address", doomed.address, "--max-new-tokens", "512", "--gamma", "0",
            "--request-id", rid, "--retries", "8"]
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.client", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    replacement = None
    try:
        handle = redis_client(local_stack)
        key = f"specdec:session:{session_for(rid)}"
        deadline = time.monotonic() + 60
        while not int(handle.hget(key, "length") or 0) > 3:  # a round committed: the answer has begun
            assert time.monotonic() < deadline and proc.poll() is None, "the call never started"
            time.sleep(0.01)
        local_stack.kill(doomed)
        local_stack.orchestrators.remove(doomed)
        replacement = local_stack.start_orchestrator(port=port, extra=lease)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        if replacement is not None:
            local_stack.orchestrators.remove(replacement)
            local_stack.kill(replacement, signal.SIGTERM)
    assert proc.returncode == 0, err
    assert "sending it again" in err
    want = api(local_stack.orchestrator_address).Generate(request("def main(", 512, 0.0, gamma=0), timeout=120)
    assert out == want.text


def test_the_stats_line_says_how_much_prompt_lookup_drafted_only_where_it_drafted():
    from orchestrator.client import format_stats
    from specdec.v1 import orchestrator_pb2 as pb

    stats = pb.GenerationStats(rounds=10, drafted_tokens=30, accepted_tokens=24, generated_tokens=34)
    assert "prompt lookup" not in format_stats(stats)
    stats.lookup_drafted_tokens = 12
    assert "12 of 30 drafted by prompt lookup" in format_stats(stats)
