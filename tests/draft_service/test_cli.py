"""The draft replica's command line: its quantisation flag and environment variable are
checked before anything loads."""
import subprocess
import sys
from pathlib import Path

import pytest

from draft_service.server import build_parser, main
from specdec.config import parse_args


def test_quantize_defaults_to_auto_and_reads_its_variable(monkeypatch):
    assert parse_args(build_parser(), []).quantize == "auto"
    monkeypatch.setenv("SPECDEC_QUANTIZE", "none")
    assert parse_args(build_parser(), []).quantize == "none"
    assert parse_args(build_parser(), ["--quantize", "int8"]).quantize == "int8"
    assert parse_args(build_parser(), ["--quantize", "w8a8"]).quantize == "w8a8"


@pytest.mark.parametrize("argv, env, words", [
    (["--quantize", "int4"], None, "argument --quantize: invalid choice: 'int4'"),
    ([], "int4", "SPECDEC_QUANTIZE='int4' is not a choice of --quantize (auto, none, int8, w8a8)"),
])
def test_a_bad_quantisation_is_a_usage_error(monkeypatch, capsys, argv, env, words):
    if env is not None:
        monkeypatch.setenv("SPECDEC_QUANTIZE", env)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


def _start(module: str, *flags: str):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, "-m", module, "--port", "0", "--redis-url", "redis://127.0.0.1:1", *flags],
                          cwd=root, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("flags, words", [
    (["--model", "/no/such/model"], "draft_service: cannot start: no model directory at '/no/such/model'"),
    (["--dtype", "bfloat16", "--quantize", "w8a8"],
     "draft_service: cannot start: w8a8 cannot serve this model: it serves float32 models on a CPU"),
    (["--dtype", "bfloat16", "--linear-kernels", "half"], "draft_service: cannot start: 16-bit weights cannot serve"),
    (["--device", "gpu"], "draft_service: cannot start: unknown device 'gpu'; choose auto, cpu, cuda or cuda:N"),
])
def test_a_replica_that_cannot_start_says_why_in_one_line(flags, words):
    """Configuration met at start-up (a missing model, kernels this model cannot use) ends
    the process with status 1 and the reason, not a traceback."""
    done = _start("draft_service", *flags)
    assert done.returncode == 1
    assert words in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("flag", ["--session-idle-seconds", "--heap-trim-seconds"])
@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_interval_is_a_usage_error(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        main([flag, value])
    assert exit_.value.code == 2
    assert f"{flag} must be a finite number of seconds, 0 (never) or more" in capsys.readouterr().err


def test_a_negative_full_batch_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--batch-full-tokens", "-2"])
    assert exit_.value.code == 2
    assert "--batch-full-tokens must be a number of tokens, 0 (no limit) or -1 (by device)" in capsys.readouterr().err


def test_only_the_target_pool_stops_holding_full_batches_by_default():
    """A draft step has a row per session, whose cost grows far slower with them than the
    target's rows: its pool holds batches for company as before unless told otherwise."""
    import argparse

    from specdec.config import add_replica_args

    defaults = {}
    for pool in ("draft", "target"):
        ap = argparse.ArgumentParser()
        add_replica_args(ap, pool, "model")
        defaults[pool] = ap.parse_args([]).batch_full_tokens
    assert defaults == {"draft": 0, "target": -1}


def test_paged_attention_sizes_its_pool_from_the_cache_budget():
    from specdec.replica import build_runner

    args = parse_args(build_parser(), ["--attention", "paged", "--max-cache-mb", "8", "--device", "cpu"])
    runner = build_runner(args, "draft_service")
    assert runner.attention == "paged" and runner.pool.used == 0
    assert runner.pool.blocks == 8 * 2**20 // runner.pool.block_bytes
    unbounded = build_runner(parse_args(build_parser(), ["--attention", "paged", "--device", "cpu"]), "draft_service")
    assert unbounded.pool.blocks < runner.pool.blocks  # it grows as caches need


@pytest.mark.parametrize("module, flag, words", [
    ("orchestrator", "--port", "orchestrator: cannot start: cannot listen on "),
    ("draft_service", "--metrics-port", "draft_service: cannot start: cannot serve /metrics on port {port}"),
    ("draft_service", "--frame-port", "draft_service: cannot start: [Errno 98] error while attempting to bind"),
])
def test_a_port_another_process_holds_is_said_in_one_line(module, flag, words):
    """Two servers on one port (a second orchestrator on a host, a node exporter on 9100)
    end the second's start with one line naming the port, not grpcio's or http.server's
    traceback."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _start(module, "--host", "127.0.0.1", flag, str(port))
    assert done.returncode == 1, done.stderr[-2000:]
    assert words.format(port=port) in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("argv, words", [
    (["--threads", "-3"], "--threads must be a number of threads, 0 (torch's default) or more, got -3"),
    (["--max-batch", "0"], "--max-batch must be a number of sessions, 1 or more, got 0"),
    (["--max-sessions", "0"], "--max-sessions must be a number of sessions, 1 or more, got 0"),
    (["--batch-wait-ms", "nan"], "--batch-wait-ms must be a finite number of milliseconds"),
    (["--drain-seconds", "-1"], "--drain-seconds must be a finite number of seconds, 0 or more, got -1.0"),
    (["--max-cache-mb", "-5"], "--max-cache-mb must be a number of MiB, 0 (no limit) or more, got -5"),
    (["--port", "70000"], "--port must be a port number, 0 (a free one) to 65535, got 70000"),
    (["--frame-port", "-2"], "--frame-port must be a port number, 0 (a free one) to 65535, or -1 (none), got -2"),
])
def test_a_number_out_of_its_range_is_a_usage_error(capsys, argv, words):
    """Before, a negative thread count was torch's traceback after the model loaded, and a
    batch of at most 0 sessions a server that never ran one."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("flags, words", [
    (["--redis-url", "localhost:6379"], "draft_service: cannot start: Redis URL must specify one of the following"),
    (["--redis-password-file", "/no/such/password"], "draft_service: cannot start: [Errno 2] No such file"),
    (["--tls-cert-file", __file__, "--tls-key-file", __file__],
     "draft_service: cannot start: the TLS certificate {file} and key {file} are not a PEM certificate"),
])
def test_redis_and_tls_settings_are_checked_before_the_model_loads(flags, words):
    """A Redis URL or password file, or TLS files, that cannot serve end the start in one
    line, before the model loads (minutes for a large one; the log shows no load)."""
    done = subprocess.run([sys.executable, "-m", "draft_service", "--port", "0", *flags],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert words.format(file=__file__) in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "loaded " not in done.stderr  # refused before the model was read
