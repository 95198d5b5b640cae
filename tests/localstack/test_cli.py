"""`python -m localstack`'s usage errors: said before any server starts."""
from __future__ import annotations

import pytest

from localstack.__main__ import main


@pytest.mark.parametrize("argv, message", [
    (["--target-args", "--x 'a"], "No closing quotation"),
    (["--target-args", "", "--chaos", "5"], "--target-args and --chaos do not go together"),
    (["--chaos", "0"], "--chaos must be a number of seconds above 0"),
    (["--chaos-orchestrators"], "--chaos-orchestrators needs --chaos SECONDS"),
])
def test_soak_usage_errors_are_said_before_anything_starts(argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["soak", *argv])
    assert message in str(exc.value)


@pytest.mark.parametrize("argv, flag, least", [
    (["--targets", "0"], "--targets", 1),
    (["--drafts", "-1"], "--drafts", 0),
    (["--drafts", "two"], "--drafts", 0),
])
def test_run_refuses_replica_counts_it_cannot_start(argv, flag, least, capsys):
    with pytest.raises(SystemExit):
        main(["run", *argv])
    assert f"argument {flag}: expected a whole number >= {least}" in capsys.readouterr().err


def test_run_takes_a_stack_without_draft_replicas():
    from localstack.__main__ import build_parser

    args = build_parser().parse_args(["run", "--drafts", "0", "--targets", "2"])
    assert (args.drafts, args.targets) == (0, 2)
