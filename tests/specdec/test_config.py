"""The servers' shared flags: log level and format; every CLI flag described."""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.config import JsonLogFormatter


def _record(msg: str, *args, exc_info=None) -> logging.LogRecord:
    return logging.LogRecord("orchestrator.generation", logging.WARNING, __file__, 1, msg, args, exc_info)


def test_a_json_log_line_carries_level_logger_message_and_traceback():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        line = JsonLogFormatter().format(_record("replica %s failed: %d", "10.0.0.5:50061", 3, exc_info=sys.exc_info()))
    entry = json.loads(line)
    assert "\n" not in line  # one record, one line
    assert entry["level"] == "WARNING" and entry["logger"] == "orchestrator.generation"
    assert entry["message"] == "replica 10.0.0.5:50061 failed: 3"
    assert entry["time"].endswith("+00:00")
    assert "RuntimeError: boom" in entry["traceback"]


def test_a_server_logs_json_lines_when_asked():
    """A real orchestrator (it starts without Redis or replicas), stopped once serving:
    every line it wrote is one JSON record."""
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "--log-format", "json", "--port", "0",
                             "--host", "127.0.0.1", "--redis-url", "redis://127.0.0.1:1/0", "--drain-seconds", "0"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "serving on" in line:
                break
        proc.send_signal(signal.SIGTERM)
        lines += proc.stderr.readlines()
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    entries = [json.loads(line) for line in lines]  # fails on any line that is not JSON
    assert any(e["logger"] == "orchestrator.server" and "serving on 127.0.0.1" in e["message"] for e in entries)
    assert all(e["level"] in ("INFO", "WARNING") for e in entries)


def _bare_flags(parser, prefix: str = "") -> list[str]:
    """The flags of `parser` and of its subcommands whose help says nothing."""
    bare = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                bare += _bare_flags(sub, f"{prefix}{name} ")
        elif action.option_strings and not re.sub(r"\[SPECDEC_\w+\]", "", action.help or "").strip():
            bare.append(prefix + "/".join(action.option_strings))
    return bare


def _cli_modules() -> list[str]:
    """Every module of the repository that builds a command line's parser."""
    root = Path(__file__).resolve().parents[2]
    files = subprocess.run(["git", "grep", "-l", "^def build_parser(", "--", "*.py"], cwd=root,
                           capture_output=True, text=True, check=True).stdout.split()
    return sorted(f[:-3].replace("/", ".").removesuffix(".__init__") for f in files if not f.startswith("tests/"))


CLI_MODULES = _cli_modules()


def test_the_clis_are_all_found():
    assert {"orchestrator.server", "orchestrator.client", "draft_service.server", "target_service.server",
            "localstack.__main__", "deploy.__main__", "deploy.loadtest.loadgen", "training.train_pair",
            "training.distill", "training.deepen", "benchmarks.bench", "benchmarks.ab_probe",
            "specdec.native"} <= set(CLI_MODULES), CLI_MODULES


@pytest.mark.parametrize("module", CLI_MODULES)
def test_every_flag_says_what_it_does(module):
    """--help is the reference a user reads first: a flag listed with nothing but its
    environment variable (or its name) tells them nothing. Every CLI, the benchmarks' too."""
    bare = _bare_flags(importlib.import_module(module).build_parser())
    assert not bare, f"{module}: flags without a description: {bare}"


def _env_value(action: argparse.Action) -> str:
    """A value for `action`'s variable that is not its default, of its type."""
    if action.choices:
        return next(str(c) for c in action.choices if c != action.default)
    if action.type is int:
        return str((action.default or 0) + 7)
    if action.type is float:
        return str((action.default or 0.0) + 0.375)
    return "a-value-from-the-environment"


@pytest.mark.parametrize("module", ["orchestrator.server", "draft_service.server", "target_service.server"])
def test_every_server_flag_is_set_by_the_variable_its_help_names(module, monkeypatch):
    """A container is configured through SPECDEC_ variables (deploy/), and --help names each
    flag's: a variable misnamed there, or read under another name, would leave a manifest's
    setting silently unapplied. Each flag's help names SPECDEC_<FLAG>, and that variable
    alone sets its default."""
    build = importlib.import_module(module).build_parser
    for name in [k for k in os.environ if k.startswith("SPECDEC_")]:
        monkeypatch.delenv(name)
    actions = [a for a in build()._actions if a.option_strings and a.dest != "help"]
    assert actions
    for action in actions:
        named = re.findall(r"\[(SPECDEC_\w+)\]", action.help or "")
        assert named == ["SPECDEC_" + action.dest.upper()], (action.option_strings, named)
        value = _env_value(action)
        monkeypatch.setenv(named[0], value)
        default = next(a for a in build()._actions if a.dest == action.dest).default
        monkeypatch.delenv(named[0])
        assert str(default) == str(action.type(value) if action.type and not action.choices else value), \
            (action.option_strings, default, value)
