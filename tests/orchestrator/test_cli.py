"""The orchestrator's command line refuses out-of-range tuning flags before it serves."""
import pytest

from orchestrator.server import main


@pytest.mark.parametrize("flags, words", [
    (["--overlap-min-use", "1.5"], "--overlap-min-use must lie in [0, 1], got 1.5"),
    (["--overlap-min-use", "-0.1"], "--overlap-min-use must lie in [0, 1]"),
    (["--stop-below-greedy", "1"], "--stop-below-greedy must lie in [0, 1), got 1.0"),
    (["--stop-below-sampled", "-1"], "--stop-below-sampled must lie in [0, 1)"),
    (["--draft-wait-ms", "-5"], "--draft-wait-ms must be a finite number of milliseconds, 0 or more, got -5.0"),
    (["--draft-wait-ms", "nan"], "--draft-wait-ms must be a finite number of milliseconds"),
    (["--log-level", "loud"], "argument --log-level: invalid choice: 'LOUD'"),
    (["--log-format", "xml"], "argument --log-format: invalid choice: 'xml'"),
    (["--prefill-chunk", "-1"], "--prefill-chunk must be 0 (off) or a number of tokens, got -1"),
    (["--call-timeout", "0"], "--call-timeout must be a finite number of seconds above 0, got 0.0"),
    (["--session-lease", "0"], "--session-lease must be a finite number of seconds above 0, got 0.0"),
    (["--session-lease", "inf"], "--session-lease must be a finite number of seconds above 0, got inf"),
    (["--session-ttl", "0"], "--session-ttl must be at least 1 second, got 0"),
    (["--retry-window", "0"], "--retry-window must be at least 1 second, got 0"),
    (["--reap-interval", "-1"], "--reap-interval must be a finite number of seconds, 0 (off) or more, got -1.0"),
    (["--prompt-lookup", "sampled"], "argument --prompt-lookup: invalid choice: 'sampled'"),
    (["--access-log", "yes"], "argument --access-log: invalid choice: 'yes'"),
    (["--overlap-min-hit", "nan"], "--overlap-min-hit must be a finite chance, 0 or more (above 1: never), got nan"),
    (["--load-governor-margin", "2"], "--load-governor-margin must lie in [0, 1), got 2.0"),
    (["--max-context", "-1"], "--max-context must be 0 or more, got -1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be 1 or more, got 0"),
    (["--max-concurrent", "0"], "--max-concurrent must be 1 or more, got 0"),
    (["--metrics-port", "-1"], "--metrics-port must be a port number, 0 (off) to 65535, got -1"),
    (["--drain-seconds", "nan"], "--drain-seconds must be a finite number of seconds, 0 or more, got nan"),
])
def test_out_of_range_flags_are_refused_with_a_message(flags, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(flags)
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


def test_a_setting_from_the_environment_is_checked_like_its_flag(monkeypatch, capsys):
    """argparse checks choices on the command line only; a mistyped SPECDEC_ variable must
    be a usage error too, naming the variable."""
    monkeypatch.setenv("SPECDEC_INTERNAL_CALLS", "carrier-pigeon")
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2
    assert "SPECDEC_INTERNAL_CALLS='carrier-pigeon' is not a choice of --internal-calls (frames, mux, stream, unary)" \
        in capsys.readouterr().err


@pytest.mark.parametrize("flags, words", [
    (["--tokenizer", "./no/such/tokenizer"], "orchestrator: cannot start: no tokenizer directory at './no/such/tokenizer'"),
    (["--api-token-file", "/no/such/token"], "orchestrator: cannot start: [Errno 2] No such file or directory"),
    (["--pool-ca-file", __file__], f"orchestrator: cannot start: the TLS CA file {__file__} holds no PEM certificate"),
    (["--pool-ca-file", __file__, "--internal-calls", "mux"],
     f"orchestrator: cannot start: the TLS CA file {__file__} holds no PEM certificate"),
])
def test_an_orchestrator_that_cannot_start_says_why_in_one_line(flags, words):
    from tests.draft_service.test_cli import _start

    done = _start("orchestrator", *flags)
    assert done.returncode == 1
    assert words in done.stderr and "Traceback" not in done.stderr
