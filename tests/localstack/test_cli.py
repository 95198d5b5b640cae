"""`python -m localstack soak`'s usage errors: said before any server starts."""
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
