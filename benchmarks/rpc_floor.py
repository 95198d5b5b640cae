"""What one internal call costs beyond the engine's work: `python -m benchmarks.rpc_floor`.

The distributed pipeline (d) differs from the in-process loop (c) of `make bench` by two
internal calls a round (Propose, Verify) and the orchestrator's work around them. This
measures the floor under the first part on the machine at hand, side by side:

- echo: a bare `grpc.aio` unary call carrying ~250 bytes between two processes;
- verify: a target-only Verify call straight to a target replica (real server, real
  model, no orchestrator), its wall time minus the compute_ms the replica reports;
- verify over a stream: the same requests as messages of one VerifyStream, as the
  orchestrator sends a generation's rounds (saves the unary call's set-up);
- verify over the shared multiplexed stream (`--internal-calls mux`, VerifyMux over gRPC)
  and over the replica's frame link (`--internal-calls frames`: the same messages over a
  plain TCP connection, specdec/frames.py);

each back to back and after an idle gap before every call, as a replica sees while the
other pool works on the round (on a shared VM an idle vCPU is slow to wake). The verify
overhead over echo is the replica's own request handling (decode, batcher, encode).

A last row per gap is no call at all: the same one-token target step in this process,
over a cache that grows as the replica's session does, after the same idle gap.

The rows are timed one after another, and on this machine the speed drifts by 10–30 %
within a minute, so a last table pairs them call by call, by unary gRPC and over the
frame link: each call, then the same verification here by the same engine code
(`TargetEngine.verify`, whose time the replica reports as its compute) over a cache of the
same length (this process idled while the replica worked, as a replica idles while the
other pool works), then one more right after it.
Before that table existed, the unpaired rows were read as a replica computing a third
slower than this process (2026-12-01 17:45 UTC: 7.7–8.1 ms of replica compute against a
5.5 ms step here back to back, a minute apart); paired in the same run, the replica's
compute was 8.73 ms, the step here 8.91 ms after idling meanwhile and 8.26 ms back to
back: the replica is not slower by itself, and idling costs a few per cent.
"""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import grpc

from benchmarks.runs import percentile
from specdec.models import BUNDLED_TARGET

ECHO = "/specdec.bench.Echo/Echo"
PROMPT = [1, 500, 600, 700, 42]  # the session every verify row and the in-process row decode from


async def serve_echo(port: int) -> None:
    server = grpc.aio.server()

    async def echo(request: bytes, context) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler(
        "specdec.bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def summary(values: list[float]) -> tuple[float, float]:
    """→ (median, p90), nearest rank as everywhere in the benchmarks."""
    return percentile(values, 50), percentile(values, 90)


async def time_echo(address: str, calls: int, gap_s: float) -> list[float]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(ECHO)
        payload = b"x" * 250
        for _ in range(20):  # connection and first-call set-up are not the floor
            await call(payload, timeout=10)
        out = []
        for _ in range(calls):
            if gap_s:
                time.sleep(gap_s)  # the process idles, as it does between rounds
            t0 = time.perf_counter()
            await call(payload, timeout=10)
            out.append((time.perf_counter() - t0) * 1000)
        return out


async def _decode_session(send, calls: int, gap_s: float, session: str, after=None) -> list[tuple[float, object]]:
    """Greedy target-only decoding of session `session` from PROMPT, one `send`(request) per
    token: → (wall ms, response) per call past the prefill. `after()` runs after each
    call, outside its timing."""
    from specdec.internal.v1 import replica_pb2

    sampling = replica_pb2.SamplingParams(temperature=0.0, top_p=1.0)
    committed, cached, out = list(PROMPT), 0, []
    for i in range(calls + 5):
        ref = replica_pb2.CacheRef(session_id=session, epoch=1, start=cached, tokens=committed[cached:])
        request = replica_pb2.VerifyRequest(cache=ref, sampling=sampling)
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        resp = await send(request)
        wall = (time.perf_counter() - t0) * 1000
        if i >= 5:  # past the prefill
            out.append((wall, resp))
        cached = resp.cache_length
        committed.append(resp.next_token)
        if after is not None:
            after(i >= 5)
    return out


VIAS = {"unary": "Verify", "stream": "VerifyStream message", "mux": "VerifyMux call over gRPC",
        "frames": "VerifyMux call over the frame link"}


def _sender(stub, channel_address: str, via: str, frame_port: int):
    """→ (link or None, send(request) → answer) for one way of calling: unary calls, one
    stream, or the shared multiplexed stream by gRPC or by the replica's frame link, as the
    orchestrator's --internal-calls unary, stream, mux and frames send a round's calls."""
    from orchestrator.frame_stream import FrameStream
    from orchestrator.mux_link import MuxLink
    from orchestrator.round_stream import RoundStream
    from specdec.internal.v1 import replica_pb2

    name = f"target replica {channel_address}"
    if via == "unary":
        return None, (lambda req: stub.Verify(req, timeout=10))
    if via == "stream":
        link = RoundStream(stub.VerifyStream, name, "target")
        return link, (lambda req: link.call(req, 10))
    opener = (stub.VerifyMux if via == "mux" else
              lambda: FrameStream("127.0.0.1", frame_port, "VerifyMux", replica_pb2.VerifyAnswers, name))
    link = MuxLink(opener, name, "target", replica_pb2.VerifyCall, replica_pb2.VerifyCalls)
    return link, (lambda req: link.call(req, 10))


async def _close_link(link) -> None:
    from orchestrator.round_stream import RoundStream

    if isinstance(link, RoundStream):
        await link.close()
    elif link is not None:
        link.close()


async def time_verify(address: str, calls: int, gap_s: float, tag: str, via: str = "unary",
                      frame_port: int = 0) -> tuple[list[float], list[float]]:
    """One way of calling (`_sender`): → (wall − compute ms, compute ms) per call."""
    from specdec.internal.v1 import replica_pb2, replica_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = replica_pb2_grpc.TargetStub(channel)
        link, send = _sender(stub, address, via, frame_port)
        session = f"rpc-floor-{tag}"
        calls_made = await _decode_session(send, calls, gap_s, session)
        await _close_link(link)
        await stub.Release(replica_pb2.ReleaseRequest(session_id=session))
        return [wall - resp.compute_ms for wall, resp in calls_made], [resp.compute_ms for _, resp in calls_made]


async def time_paired(address: str, runner, calls: int, via: str = "unary",
                      frame_port: int = 0) -> tuple[list[float], list[float], list[float]]:
    """Each Verify call (by `via`), then the same verification in this process, by the same
    engine code (`TargetEngine.verify`, whose compute_ms the replica reports), over a cache of
    the same length, then one more right after it: → (the replica's compute, this process's
    after idling while the replica worked, back to back) in ms. Paired call by call, so the
    machine's drift weighs on all three alike, where the rows of `measure` are timed one
    after another."""
    from specdec.internal.v1 import replica_pb2, replica_pb2_grpc
    from specdec.sampling import SamplingParams
    from specdec.sessions import CacheRef
    from target_service.engine import TargetEngine, VerifyJob

    engine, greedy = TargetEngine(runner), SamplingParams(temperature=0.0)
    lengths = {sid: engine.verify([VerifyJob(CacheRef(sid, 1, 0, PROMPT), [], None, greedy)])[0].cache_length
               for sid in ("after-idle", "back-to-back")}  # each grows one position a call, as the replica's
    after_idle, back_to_back = [], []

    def step(sid: str) -> float:
        verdict = engine.verify([VerifyJob(CacheRef(sid, 1, lengths[sid], [7]), [], None, greedy)])[0]
        lengths[sid] = verdict.cache_length
        return verdict.compute_ms

    def steps(keep: bool) -> None:
        idle, b2b = step("after-idle"), step("back-to-back")
        if keep:
            after_idle.append(idle)
            back_to_back.append(b2b)

    async with grpc.aio.insecure_channel(address) as channel:
        stub = replica_pb2_grpc.TargetStub(channel)
        link, send = _sender(stub, address, via, frame_port)
        session = f"rpc-floor-paired-{via}"
        calls_made = await _decode_session(send, calls, 0.0, session, steps)
        await _close_link(link)
        await stub.Release(replica_pb2.ReleaseRequest(session_id=session))
    return [resp.compute_ms for _, resp in calls_made], after_idle, back_to_back


def time_step(runner, calls: int, gap_s: float) -> list[float]:
    """ms of one in-process target step after `gap_s` idle, over a cache that grows one
    position a step from the same five-token prompt as `time_verify`'s session, so that
    the n-th step here attends over as many positions as the replica's n-th call (a step
    over 512 cached positions costs about 30 % more than over 32 here)."""
    import torch

    from specdec.model_runner import ForwardItem

    cache = runner.new_cache()
    runner.forward([ForwardItem(cache, torch.tensor(PROMPT), 1)])
    token = torch.tensor([7])
    out = []
    for i in range(calls + 5):
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        runner.forward([ForwardItem(cache, token, 1)])
        if i >= 5:
            out.append((time.perf_counter() - t0) * 1000)
    return out


async def measure(echo_address: str, target_address: str, calls: int, gaps_ms: list[float],
                  runner=None, frame_port: int = 0) -> list[str]:
    rows = ["| call | idle gap before each | median ms | p90 ms | replica compute, median ms |",
            "|---|---|---|---|---|"]
    for gap in gaps_ms:
        med, p90 = summary(await time_echo(echo_address, calls, gap / 1000))
        rows.append(f"| echo (bare gRPC, 250 B) | {gap:g} ms | {med:.3f} | {p90:.3f} | — |")
        for via, name in VIAS.items():
            if via == "frames" and not frame_port:
                continue
            overhead, compute = await time_verify(target_address, calls, gap / 1000, f"{gap:g}-{via}", via, frame_port)
            med, p90 = summary(overhead)
            rows.append(f"| {name}, target only: wall − compute | {gap:g} ms | {med:.3f} | {p90:.3f} | "
                        f"{summary(compute)[0]:.3f} |")
        if runner is not None:
            med, p90 = summary(time_step(runner, calls, gap / 1000))
            rows.append(f"| no call: target step in this process | {gap:g} ms | {med:.3f} | {p90:.3f} | {med:.3f} |")
    if runner is not None:
        rows += ["", "| paired, call by call | median ms | p90 ms |", "|---|---|---|"]
        for via in ("unary", "frames") if frame_port else ("unary",):
            names = (f"replica's compute of a {VIAS[via]}", "the same verification here, after idling meanwhile",
                     "the same verification here, back to back")
            for name, values in zip(names, await time_paired(target_address, runner, calls, via, frame_port)):
                med, p90 = summary(values)
                rows.append(f"| {name} | {med:.3f} | {p90:.3f} |")
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.rpc_floor",
                                 description="The cost of one internal gRPC call beyond the engine's work, "
                                             "back to back and after an idle gap (see the module docstring).")
    ap.add_argument("--target", default=str(BUNDLED_TARGET), help="target model directory (default: bundled)")
    ap.add_argument("--calls", type=int, default=200, help="timed calls per row (default 200)")
    ap.add_argument("--gaps-ms", default="0,5", help="idle gaps before each call, comma-separated (default 0,5)")
    ap.add_argument("--serve-echo", type=int, metavar="PORT", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.serve_echo:
        asyncio.run(serve_echo(args.serve_echo))
        return 0
    if args.calls < 1:
        raise SystemExit(f"--calls must be at least 1, got {args.calls}")
    try:
        gaps = [float(g) for g in args.gaps_ms.split(",") if g.strip()]
    except ValueError:
        raise SystemExit(f"--gaps-ms takes numbers separated by commas, got {args.gaps_ms!r}") from None
    if not gaps or min(gaps) < 0:
        raise SystemExit("--gaps-ms needs at least one gap of 0 ms or more")
    import torch

    from localstack.leash import leashed
    from localstack.stack import LocalStack, free_port
    from specdec.model_runner import ModelRunner
    from specdec.models import load_model, pick_device, pick_dtype

    torch.set_num_threads(1)  # as the replicas run
    device = pick_device("auto")
    runner = ModelRunner(load_model(args.target, device, pick_dtype("auto", device)))
    stack = LocalStack(target_model=args.target, threads=1)
    port = free_port()
    echo = subprocess.Popen(leashed([sys.executable, "-m", "benchmarks.rpc_floor", "--serve-echo", str(port)]))
    try:
        stack.start_redis()
        target = stack.start_replica("target")
        wait_serving_echo(f"127.0.0.1:{port}", echo)
        frame_port = asyncio.run(registered_frame_port(stack.redis_url, target.address))
        print("\n".join(asyncio.run(measure(f"127.0.0.1:{port}", target.address, args.calls, gaps, runner,
                                             frame_port))))
    finally:
        echo.terminate()
        echo.wait(10)
        stack.stop()
    return 0


async def registered_frame_port(redis_url: str, address: str) -> int:
    """The replica's frame-link port as its registry entry gives it (0: none)."""
    import redis.asyncio as aioredis

    from specdec.registry import Registry

    client = aioredis.from_url(redis_url)
    try:
        return next((r.frame_port for r in await Registry(client).live("target") if r.address == address), 0)
    finally:
        await client.aclose()


def wait_serving_echo(address: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """The echo server has no health service: wait until a call goes through."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError("the echo server exited")
        try:
            asyncio.run(time_echo(address, 1, 0.0))
            return
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
