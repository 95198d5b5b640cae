"""Soak: N concurrent streaming clients against a local stack for a while.

Each client loops — one GenerateStream at a time — until the time is up (or the request
budget is spent). The report counts requests and errors by status code, gives latency
percentiles of whole requests and of the first chunk, and each process's resident
memory (VmRSS) at the start, after the first minute and at the end: after warm-up the
memory should stay flat.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import grpc

from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc as pb_grpc

PROMPTS = ["def parse_args(argv):\n", "class LRUCache:\n    def __init__(self, capacity):\n",
           "import json\n\ndef load_config(path):\n", "def binary_search(items, target):\n",
           "for line in open(path):\n", "async def fetch(session, url):\n"]
WARMUP_SECONDS = 60.0


def resident_mib(pid: int) -> float | None:
    """VmRSS of a process in MiB, None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def processes(stack) -> dict[str, int]:
    procs = {f"{r.kind}@{r.port}": r.proc.pid for r in stack.replicas + stack.orchestrators}
    if stack.redis_proc is not None:
        procs[f"redis@{stack.redis_port}"] = stack.redis_proc.pid
    return procs


def percentiles(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)

    def rank(q: float) -> float | None:  # nearest rank
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None

    return {"p50": rank(0.50), "p90": rank(0.90), "p99": rank(0.99)}


def request_for(i: int) -> pb.GenerateRequest:
    """Alternate greedy and seeded sampling over the prompts."""
    req = pb.GenerateRequest(prompt=PROMPTS[i % len(PROMPTS)])
    if i % 2:
        req.temperature, req.seed = 0.8, i
    else:
        req.temperature = 0.0
    return req


async def soak(stack, streams: int, seconds: float, max_new_tokens: int,
               max_requests: int | None = None) -> dict:
    """Run the soak against `stack` (a started LocalStack); print and return the report."""
    procs = processes(stack)
    memory = {name: {"start": resident_mib(pid)} for name, pid in procs.items()}
    latency, first_chunk, errors, tokens = [], [], Counter(), 0
    issued = 0
    t_start = time.monotonic()
    t_end = t_start + seconds

    async def client(stub, worker: int) -> None:
        nonlocal issued, tokens
        while time.monotonic() < t_end and (max_requests is None or issued < max_requests):
            req = request_for(issued + worker)
            req.max_new_tokens = max_new_tokens
            issued += 1
            t0, first = time.perf_counter(), None
            try:
                async for chunk in stub.GenerateStream(req, timeout=max(30.0, 2 * seconds)):
                    if first is None and chunk.token_ids:
                        first = time.perf_counter() - t0
                    tokens += len(chunk.token_ids)
                latency.append(time.perf_counter() - t0)
                if first is not None:
                    first_chunk.append(first)
            except grpc.aio.AioRpcError as exc:
                errors[exc.code().name] += 1

    async def sample_after_warmup() -> None:
        await asyncio.sleep(WARMUP_SECONDS)
        for name, pid in procs.items():
            memory[name]["after_first_minute"] = resident_mib(pid)

    async with grpc.aio.insecure_channel(stack.orchestrator_address) as channel:
        stub = pb_grpc.OrchestratorStub(channel)
        sampler = asyncio.create_task(sample_after_warmup()) if seconds >= WARMUP_SECONDS else None
        await asyncio.gather(*(client(stub, w) for w in range(streams)))
        if sampler is not None and not sampler.done():
            sampler.cancel()
    elapsed = time.monotonic() - t_start
    for name, pid in procs.items():
        memory[name].setdefault("after_first_minute", None)
        memory[name]["end"] = resident_mib(pid)

    report = {
        "streams": streams, "seconds": round(elapsed, 1), "max_new_tokens": max_new_tokens,
        "requests": len(latency) + sum(errors.values()), "ok": len(latency),
        "errors": sum(errors.values()), "errors_by_code": dict(errors), "tokens": tokens,
        "latency_s": {"request": percentiles(latency), "first_chunk": percentiles(first_chunk)},
        "memory_mib": memory,
    }
    print(format_report(report), flush=True)
    return report


def format_report(r: dict) -> str:
    def sec(v):
        return "    -" if v is None else f"{v:6.3f}"

    def mib(v):
        return "      -" if v is None else f"{v:7.1f}"

    lines = [f"soak: {r['streams']} streams for {r['seconds']:.0f} s, max_new_tokens {r['max_new_tokens']}",
             f"requests  {r['requests']} ({r['requests'] / max(r['seconds'], 1e-9):.2f}/s), "
             f"ok {r['ok']}, errors {r['errors']}" + (f" {r['errors_by_code']}" if r["errors"] else ""),
             f"tokens    {r['tokens']} ({r['tokens'] / max(r['seconds'], 1e-9):.1f}/s)",
             "",
             "latency (s)      p50     p90     p99"]
    for name, key in (("request", "request"), ("first chunk", "first_chunk")):
        p = r["latency_s"][key]
        lines.append(f"{name:<14} {sec(p['p50'])}  {sec(p['p90'])}  {sec(p['p99'])}")
    lines += ["", "resident memory (MiB)   start   1 min     end   change since 1 min (or start)"]
    for name, m in r["memory_mib"].items():
        base = m["after_first_minute"] if m["after_first_minute"] is not None else m["start"]
        change = "" if base is None or m["end"] is None else f"{m['end'] - base:+.1f}"
        lines.append(f"{name:<22} {mib(m['start'])} {mib(m['after_first_minute'])} {mib(m['end'])}   {change}")
    return "\n".join(lines)
