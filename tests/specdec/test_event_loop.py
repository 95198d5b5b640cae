"""The servers' event loop (specdec/event_loop.py): uvloop's by default where installed (it is
pinned in requirements.txt), asyncio's on request, a clear refusal otherwise."""
import asyncio
import subprocess
import sys

import pytest
import uvloop

from specdec import event_loop


def test_auto_is_uvloop_where_installed_and_asyncio_stays_available():
    assert event_loop.resolve("auto") == "uvloop"
    assert event_loop.resolve("uvloop") == "uvloop"
    assert event_loop.resolve("asyncio") == "asyncio"
    with pytest.raises(ValueError, match="must be one of auto, uvloop, asyncio"):
        event_loop.resolve("trio")


@pytest.mark.parametrize("name, loop_type", [("uvloop", uvloop.Loop), ("asyncio", asyncio.BaseEventLoop)])
def test_run_runs_the_coroutine_on_the_chosen_loop(name, loop_type):
    seen = []

    async def main():
        await asyncio.sleep(0)
        seen.append(asyncio.get_running_loop())
        return 42

    assert event_loop.run(main(), name) == 42  # the coroutine's result comes back
    assert isinstance(seen[0], loop_type)
    assert (type(seen[0]).__module__.split(".")[0] == "uvloop") == (name == "uvloop")


def test_a_server_refuses_an_unknown_loop_by_name():
    out = subprocess.run([sys.executable, "-m", "orchestrator"], env={"SPECDEC_EVENT_LOOP": "trio", "PATH": ""},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "SPECDEC_EVENT_LOOP='trio' is not a choice of --event-loop (auto, uvloop, asyncio)" in out.stderr
