"""The Makefile's own help: every documented target is listed."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_help_lists_every_documented_target():
    documented = re.findall(r"^([^\s:#=]+):[^\n=]*##", (ROOT / "Makefile").read_text(), re.M)
    listed = [line.split("\t")[0] for line in subprocess.run(
        ["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()]
    assert "bench-bf16" in documented and len(documented) > 10
    assert listed == documented
