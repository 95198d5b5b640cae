"""The orchestrator's process runs without torch (orchestrator/__main__.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import api, request

ORCHESTRATOR = Path(__file__).resolve().parents[2] / "orchestrator"


def test_every_orchestrator_module_imports_with_torch_absent():
    """A module that came to import torch (or a torch-bound specdec module) would fail here
    before it took the orchestrator's start back to three seconds."""
    modules = sorted(f"orchestrator.{p.stem}" for p in ORCHESTRATOR.glob("*.py")
                     if p.stem not in ("__init__", "__main__"))
    code = "import sys; sys.modules['torch'] = None\n" + "".join(f"import {m}\n" for m in modules)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ORCHESTRATOR.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(modules) >= 20  # every one of them, not a glob gone astray


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.e2e
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc")
def test_a_serving_orchestrator_has_not_loaded_torch_and_its_replicas_have(local_stack):
    answer = api(local_stack.orchestrator_address).Generate(request(max_new_tokens=6), timeout=60)
    assert answer.token_ids and answer.text
    assert local_stack.orchestrators and not any(_maps_torch(rep.proc.pid) for rep in local_stack.orchestrators)
    assert all(_maps_torch(rep.proc.pid) for rep in local_stack.replicas)  # the check sees torch where it is
