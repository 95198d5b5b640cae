"""The commands the docs show use flags their CLIs have: a flag renamed or removed in the
code, and left in README.md, fails a user who copies the line. Each `python -m MODULE ...`
in a code block or an inline code span is read, and every `--flag` it passes (to the
command or to its subcommand) must be one of that parser's options; each `make TARGET
[VAR=...]` must name a target of the Makefile and variables its recipes read."""
from __future__ import annotations

import argparse
import importlib
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# `python -m NAME` runs NAME/__main__.py; where that only calls another module's main, the
# parser is that module's
PARSER_MODULES = {"orchestrator": "orchestrator.server", "draft_service": "draft_service.server",
                  "target_service": "target_service.server", "localstack": "localstack.__main__",
                  "deploy": "deploy.__main__", "training": "training.train_pair"}
# the commands of the past: benchmarks/HISTORY.md records what was run, with the flags of then
DOCS = [p for p in subprocess.run(["git", "ls-files", "*.md"], cwd=REPO_ROOT, capture_output=True, text=True,
                                   check=True).stdout.split() if p != "benchmarks/HISTORY.md"]
FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*(=.*)?$")


def code_of(text: str) -> list[str]:
    """The fenced blocks (a line continued with a backslash joined to the next) and the
    inline code spans (which may wrap) of a Markdown text."""
    fence = r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```"  # a list item's block is indented
    blocks = re.findall(fence, text, flags=re.S | re.M)
    prose = re.sub(fence, "", text, flags=re.S | re.M)
    spans = [s for paragraph in prose.split("\n\n") for s in re.findall(r"`([^`]+)`", paragraph)]
    return [b.replace("\\\n", " ") for b in blocks] + [s.replace("\n", " ") for s in spans]


def commands(text: str) -> list[tuple[str, str]]:
    """(module, the rest of its line) of each `python -m module` in the text's code."""
    found = []
    for code in code_of(text):
        found += re.findall(r"python -m ([a-z_]\w*(?:\.\w+)*)([^\n|;&#`)]*)", code)
    return found


def tokens(rest: str) -> list[str]:
    try:
        return shlex.split(rest)
    except ValueError:  # a quote the span or the line cut short
        return rest.split()


def unknown_flags(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """The flags among `args` that `parser` (or the subcommand the first argument names)
    does not have; the value after a flag that takes one is skipped, not read as a flag."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if subs and args and args[0] in subs[0].choices:
        parser, args = subs[0].choices[args[0]], args[1:]
    options = {s: a for a in parser._actions for s in a.option_strings}
    unknown, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if not FLAG.match(arg):
            continue
        name = arg.split("=", 1)[0]
        action = options.get(name)
        if action is None:
            unknown.append(name)
        elif "=" not in arg and action.nargs != 0:
            skip = True
    return unknown


@pytest.mark.parametrize("doc", DOCS)
def test_the_commands_a_doc_shows_use_flags_their_cli_has(doc):
    found = commands((REPO_ROOT / doc).read_text())
    problems = []
    for module, rest in found:
        name = PARSER_MODULES.get(module, module)
        build = getattr(importlib.import_module(name), "build_parser", None)
        if build is None:
            problems.append(f"python -m {module}: {name} has no build_parser() to check the line against")
            continue
        bad = unknown_flags(build(), tokens(rest))
        if bad:
            problems.append(f"python -m {module}{rest}: no such flag {', '.join(bad)}")
    assert not problems, "\n".join(problems)


def test_the_reader_finds_the_commands_and_a_flag_that_is_not_there():
    text = ("Run `python -m localstack soak --streams 12\n--minutes 30` or:\n\n```sh\n"
            "python -m orchestrator --port 1 \\\n  --no-such-flag 3 --draft-pool x\n"
            "python -m deploy apply --overlay cpu --timeout=5\n```\n")
    found = commands(text)
    assert [m for m, _ in found] == ["orchestrator", "deploy", "localstack"]
    orchestrator = importlib.import_module("orchestrator.server").build_parser()
    assert unknown_flags(orchestrator, tokens(found[0][1])) == ["--no-such-flag"]
    deploy = importlib.import_module("deploy.__main__").build_parser()
    assert unknown_flags(deploy, tokens(found[1][1])) == []
    assert unknown_flags(deploy, ["apply", "--overlay", "--streams"]) == []  # a value, not a flag
    assert unknown_flags(deploy, ["apply", "--streams", "1"]) == ["--streams"]


def make_calls(text: str) -> list[tuple[str, list[str]]]:
    """(target, the variables it is given) of each `make TARGET [VAR=value ...]` in the
    text's code; an optional variable may stand in brackets."""
    found = []
    for code in code_of(text):
        for m in re.finditer(r"(?<![\w/-])make ([a-z][\w-]*)((?: \[?[A-Z_]+=(?:'[^']*'|\S+?)\]?(?= |$))*)", code):
            found.append((m.group(1), re.findall(r"([A-Z_]+)=", m.group(2))))
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_the_make_targets_a_doc_names_are_the_makefiles(doc):
    makefile = (REPO_ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, flags=re.M))
    # make's own $(VAR), or the recipe's shell reading $${VAR:-default}
    variables = set(re.findall(r"\$\(([A-Z_]+)\)|\$\$\{([A-Z_]+)", makefile))
    variables = {name for pair in variables for name in pair if name}
    problems = [f"make {target}: no such target" for target, _ in make_calls((REPO_ROOT / doc).read_text())
                if target not in targets]
    problems += [f"make {target} {var}=: the Makefile reads no {var}"
                 for target, given in make_calls((REPO_ROOT / doc).read_text()) for var in given
                 if var not in variables]
    assert not problems, "\n".join(problems)


def test_the_reader_finds_make_calls_and_their_variables():
    text = "Run `make soak SOAK_STREAMS=8 [SOAK_ARGS='--chaos-signal term']` or `make test`; `cmake build`."
    assert make_calls(text) == [("soak", ["SOAK_STREAMS", "SOAK_ARGS"]), ("test", [])]
