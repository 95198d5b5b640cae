"""The local stack launcher: a stack that does not come up says why."""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys

import pytest
import redis

from localstack.stack import LocalStack, free_port

pytestmark = pytest.mark.e2e


def test_a_replica_that_cannot_register_is_reported_with_redis_state_and_its_log(bundled_paths):
    """Redis that serves reads but refuses writes (here: it asks for a replica it does not
    have; a full disk under its AOF does the same) keeps every replica out of the pool.
    The launcher's error names the refusal and shows the replica's own warning."""
    stack = LocalStack()
    try:
        stack.start_redis()
        redis.Redis(port=stack.redis_port).config_set("min-replicas-to-write", 1)
        stack.start_replica("draft")
        with pytest.raises(TimeoutError) as err:
            stack.wait_registered(drafts=1, targets=0, timeout=3.0)
    finally:
        stack.stop()
        shutil.rmtree(stack.workdir, ignore_errors=True)
    message = str(err.value)
    assert "0 and 0 registered" in message
    assert "NOREPLICAS" in message, "the diagnostics should show that Redis refuses writes"
    assert "registry: cannot register in Redis" in message, "the replica's log tail should be in the error"
    assert "--- draft on" in message and "(running)" in message


@pytest.mark.parametrize("password", [None, "theirs"])
def test_a_redis_port_another_redis_holds_is_refused_not_used(password):
    """A developer's own Redis on the port (6379 for `make run`): the stack's redis-server
    exits on the taken port, and the launcher says so instead of registering its replicas
    and sessions in the other one; that one keeps no key of the stack's."""
    from tests.conftest import RedisServer

    theirs = RedisServer(password).start()
    stack = LocalStack()
    try:
        with pytest.raises(RuntimeError) as err:
            stack.start_redis(port=theirs.port)
        assert stack.redis_proc.wait(10) is not None  # the stack's own server is gone
        keys = redis.Redis(port=theirs.port, password=password).dbsize()
    finally:
        stack.stop()
        theirs.stop()
        shutil.rmtree(stack.workdir, ignore_errors=True)
        shutil.rmtree(theirs.dir, ignore_errors=True)
    message = str(err.value)
    assert (f"port {theirs.port} is served by another Redis" in message
            or "redis-server exited at start" in message), message
    assert keys == 0


def test_run_that_cannot_start_stops_what_it_started(bundled_paths):
    """`python -m localstack run` whose orchestrator cannot bind its port exits with status
    1 and a line saying why, and leaves no Redis or replica behind on their ports."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = {name: free_port() for name in ("draft", "target", "redis")}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "localstack", "run", "--port", str(taken.getsockname()[1]),
             "--draft-port", str(ports["draft"]), "--target-port", str(ports["target"]),
             "--redis-port", str(ports["redis"]), "--metrics-port", "0"],
            capture_output=True, text=True, timeout=180)
    finally:
        taken.close()
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "the stack did not start" in proc.stderr
    for name, port in ports.items():
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, f"the {name} on port {port} outlived the launcher"


def test_a_server_that_does_not_stop_is_killed_and_its_log_shown(bundled_paths, monkeypatch, capsys):
    """A replica paused with SIGSTOP cannot act on SIGTERM: the launcher kills it after its
    wait and prints the end of the replica's log."""
    import os
    import signal

    import localstack.stack as stack_module

    monkeypatch.setattr(stack_module, "STOP_WAIT_S", 1.0)
    stack = LocalStack()
    try:
        stack.start_redis()
        replica = stack.start_replica("draft")
        os.kill(replica.proc.pid, signal.SIGSTOP)
    finally:
        stack.stop()
        shutil.rmtree(stack.workdir, ignore_errors=True)
    assert replica.proc.returncode == -signal.SIGKILL
    err = capsys.readouterr().err
    assert f"draft {replica.address} did not exit within 1s of SIGTERM and was killed" in err
    assert "replica serving on" in err  # the log's own lines


def test_the_demo_streams_its_prompts_and_reports_the_speedup(bundled_paths):
    """`make demo` (the README's run command): a whole stack on the bundled models, each
    prompt streamed with its stats and a target-only run beside it, then the mean speedup,
    and it exits 0."""
    import re

    from localstack.demo import PROMPTS

    proc = subprocess.run([sys.executable, "-m", "localstack", "demo", "--max-new-tokens", "24"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("--- speculative (adaptive γ): [24 tokens in") == len(PROMPTS), out[-3000:]
    firsts = re.findall(r"target-only through the same services: [\d.]+ tok/s, first after (\d+) ms; "
                        r"speedup ([\d.]+)x", out)
    assert len(firsts) == len(PROMPTS)
    mean = re.search(r"mean speedup over target-only decoding: ([\d.]+)x", out)
    assert mean and float(mean.group(1)) > 0


_ORPHANING_PARENT = """
import sys, time
from localstack.stack import LocalStack
stack = LocalStack()
stack.start_redis()
draft = stack.start_replica("draft")
print(stack.redis_proc.pid, draft.proc.pid, stack.workdir, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whatever init this machine has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the leash is Linux's PR_SET_PDEATHSIG")
def test_servers_end_with_a_parent_that_was_killed_outright(bundled_paths):
    """A process that starts a stack and is killed with SIGKILL (no `stop`, no finally)
    leaves no server running: its Redis and its replica get SIGTERM from the kernel
    (localstack/leash.py) and exit. Before, they served on for as long as the machine ran."""
    import os
    import signal
    import time
    from pathlib import Path

    from specdec.model_files import REPO_ROOT

    parent = subprocess.Popen([sys.executable, "-c", _ORPHANING_PARENT], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        redis_pid, draft_pid, workdir = parent.stdout.readline().split()
        children = [int(redis_pid), int(draft_pid)]
        assert all(_running(pid) for pid in children)
    finally:
        parent.kill()
        parent.wait(10)
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in children if _running(pid)]
    for pid in left:  # do not leave them to the next test
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(Path(workdir), ignore_errors=True)
    assert not left, f"servers still running after their parent was killed: {left}"
