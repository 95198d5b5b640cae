"""watch_stop: a server's stop that runs past its drain's grace says where it hangs.

Each case runs in a process of its own, since the thread dump is written to the process's
stderr (under uvloop faulthandler's C watchdog, used before, once crashed it: SIGSEGV)."""
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import asyncio, logging, sys
    from specdec.grpc_server import watch_stop

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)

    async def deregister_forever():
        await asyncio.Event().wait()

    async def stopping():
        await deregister_forever()

    async def main(stop_after):
        end = watch_stop(0.1, slack=0.1)
        step = asyncio.create_task(stopping(), name="deregistering")
        await asyncio.sleep(stop_after)
        end()
        step.cancel()
        await asyncio.sleep(0.4)  # past the watch's time, had it not ended

    if sys.argv[2] == "uvloop":
        import uvloop
        uvloop.run(main(float(sys.argv[1])))
    else:
        asyncio.run(main(float(sys.argv[1])))
""")


def run(stop_after: float, loop: str = "asyncio") -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(stop_after), loop], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_stop_past_its_grace_writes_the_threads_and_the_tasks_it_waits_on(loop):
    err = run(stop_after=0.5, loop=loop)
    assert "MainThread, most recent call first" in err  # the dump of the threads
    assert "still waits on task deregistering" in err
    # the task's whole await chain, outermost first, down to what it waits on
    assert err.index("in stopping") < err.index("in deregister_forever") < err.index("in wait")
    assert "awaiting" in err
    assert "Traceback" not in err  # the dump itself did not fail (under uvloop it once did)


def test_a_stop_within_its_grace_writes_nothing():
    err = run(stop_after=0.05)
    assert "most recent call first" not in err
    assert "still waits on" not in err
