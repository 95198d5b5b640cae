"""A ghz-like load generator for specdec.v1.Orchestrator, for machines without ghz.

    python -m deploy.loadtest.loadgen --concurrency 4 --total 100 --max-new-tokens 32
    python -m deploy.loadtest.loadgen --stream --duration 30s --rps 5
    python -m deploy.loadtest.loadgen --config deploy/loadtest/ghz/generate-c4.json

Every run is bounded: by --total and/or --duration, never more than 100000 calls or
3600 s, and each call by --timeout. Targets are loopback only unless --allow-remote is
given (a port-forwarded cluster is loopback too). Exit status 1 if any call failed.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass

import grpc
from google.protobuf import json_format

MAX_TOTAL = 100_000
MAX_DURATION_S = 3600.0
DEFAULT_TOTAL = 200  # as ghz, when neither a total nor a duration is given
PERCENTILES = (10, 25, 50, 75, 90, 95, 99)


@dataclass(frozen=True)
class CallResult:
    latency_s: float
    code: str  # grpc.StatusCode name, "OK" on success
    error: str | None = None
    first_message_s: float | None = None  # streams: time to the first chunk
    tokens: int = 0
    stats: dict | None = None  # the server's GenerationStats, as speculation_stats() keeps them


def speculation_stats(stats) -> dict:
    """The GenerationStats fields that capacity planning needs (README.md)."""
    return {
        "rounds": stats.rounds,
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "generated_tokens": stats.generated_tokens,
        "target_forward_passes": stats.target_forward_passes,
        "gamma_sum": stats.mean_gamma * stats.rounds,
        "draft_ms": stats.times.draft_ms,
        "verify_ms": stats.times.verify_ms,
        "network_ms": stats.times.network_ms,
    }


@dataclass(frozen=True)
class Plan:
    total: int | None  # calls to send, None = until the duration ends
    duration_s: float  # stop sending after this long
    concurrency: int
    rps: float | None

    @classmethod
    def bounded(cls, total: int | None, duration_s: float | None, concurrency: int, rps: float | None) -> "Plan":
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if rps is not None and rps <= 0:
            raise ValueError("rps must be > 0")
        if total is None and duration_s is None:
            total = DEFAULT_TOTAL
        if total is not None and not 1 <= total <= MAX_TOTAL:
            raise ValueError(f"total must lie in 1..{MAX_TOTAL}")
        if duration_s is not None and not 0 < duration_s <= MAX_DURATION_S:
            raise ValueError(f"duration must lie in (0, {MAX_DURATION_S:.0f}] seconds")
        return cls(total, duration_s or MAX_DURATION_S, concurrency, rps)


def check_loopback(target: str) -> None:
    """Refuse targets off this machine: a load test must not hit a shared server by accident."""
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 or target.startswith("[") else target
    host = host.strip("[]")
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"{target} is not a loopback address; pass allow_remote=True (--allow-remote) to load it")


def parse_duration(text: str) -> float:
    """'30s', '2m', '500ms' or plain seconds -> seconds."""
    text = text.strip()
    for suffix, scale in (("ms", 1e-3), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if text.endswith(suffix) and text[: -len(suffix)].replace(".", "", 1).isdigit():
            return float(text[: -len(suffix)]) * scale
    return float(text)


def request_data(prompt: str, max_new_tokens: int, temperature: float | None,
                 gamma: int | None = None, seed: int | None = None, ignore_eos: bool = False) -> dict:
    """The GenerateRequest as ghz's --data JSON."""
    data: dict = {"prompt": prompt, "max_new_tokens": max_new_tokens}
    if ignore_eos:  # every call generates max_new_tokens: runs compare like with like
        data["ignore_eos"] = True
    if temperature is not None:
        data["temperature"] = temperature
    if gamma is not None:
        data["num_speculative_tokens"] = gamma
    if seed is not None:
        data["seed"] = seed
    return data


def channel_credentials(cacert: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials:
    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()
    return grpc.ssl_channel_credentials(read(cacert), read(key), read(cert))


class Caller:
    """Sends one request and turns the outcome into a CallResult."""

    def __init__(self, rpc, request, stream: bool, metadata: tuple, timeout_s: float):
        self.rpc, self.request, self.stream = rpc, request, stream
        self.metadata, self.timeout_s = metadata, timeout_s

    async def __call__(self) -> CallResult:
        start = time.perf_counter()
        try:
            if self.stream:
                first, tokens, stats = await self._stream(start)
            else:
                reply = await self.rpc(self.request, timeout=self.timeout_s, metadata=self.metadata)
                first, tokens = None, reply.stats.generated_tokens or len(reply.token_ids)
                stats = speculation_stats(reply.stats) if reply.HasField("stats") else None
        except grpc.aio.AioRpcError as e:
            return CallResult(time.perf_counter() - start, e.code().name, e.details() or e.code().name)
        except Exception as e:  # transport or client failure: counted, never raised
            return CallResult(time.perf_counter() - start, "UNKNOWN", f"{type(e).__name__}: {e}")
        return CallResult(time.perf_counter() - start, "OK", None, first, tokens, stats)

    async def _stream(self, start: float) -> tuple[float | None, int, dict | None]:
        first, tokens, stats = None, 0, None
        async for chunk in self.rpc(self.request, timeout=self.timeout_s, metadata=self.metadata):
            if first is None:
                first = time.perf_counter() - start
            tokens += len(chunk.token_ids)
            if chunk.HasField("stats"):
                stats = speculation_stats(chunk.stats)
        return first, (stats or {}).get("generated_tokens") or tokens, stats


async def drive(plan: Plan, callers: list[Caller]) -> tuple[list[CallResult], float]:
    """Run `plan` with one worker per concurrency slot; callers are used round-robin."""
    results: list[CallResult] = []
    issued = 0
    start = time.perf_counter()
    stop_at = start + plan.duration_s

    def claim() -> int | None:
        nonlocal issued
        if (plan.total is not None and issued >= plan.total) or time.perf_counter() >= stop_at:
            return None
        issued += 1
        return issued - 1

    async def worker(w: int) -> None:
        call = callers[w % len(callers)]
        while (i := claim()) is not None:
            if plan.rps:
                delay = start + i / plan.rps - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if time.perf_counter() >= stop_at:
                    return
            results.append(await call())

    await asyncio.gather(*(worker(w) for w in range(plan.concurrency)))
    return results, time.perf_counter() - start


def percentile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def summarize(results: list[CallResult], total_s: float, name: str = "") -> dict:
    """ghz's summary fields (count, rps, latency percentiles, histogram, status codes and
    errors) of the calls, with the tokens they generated and the speculation's per-round
    averages beside them."""
    latencies = sorted(r.latency_s * 1000 for r in results)
    ok = [r for r in results if r.code == "OK"]
    errors = Counter(r.error for r in results if r.code != "OK")
    summary = {
        "name": name,
        "count": len(results),
        "total_s": total_s,
        "rps": len(results) / total_s if total_s > 0 else 0.0,
        "average_ms": sum(latencies) / len(latencies) if latencies else 0.0,
        "fastest_ms": latencies[0] if latencies else 0.0,
        "slowest_ms": latencies[-1] if latencies else 0.0,
        "latency_percentiles_ms": {f"p{p}": percentile(latencies, p) for p in PERCENTILES} if latencies else {},
        "histogram": histogram(latencies),
        "status_codes": dict(Counter(r.code for r in results)),
        "errors": dict(errors),
        "error_count": sum(errors.values()),
        "tokens": sum(r.tokens for r in ok),
        "tokens_per_s": sum(r.tokens for r in ok) / total_s if total_s > 0 else 0.0,
    }
    firsts = sorted(r.first_message_s * 1000 for r in ok if r.first_message_s is not None)
    if firsts:
        summary["first_message_percentiles_ms"] = {f"p{p}": percentile(firsts, p) for p in PERCENTILES}
    speculation = summarize_speculation([r.stats for r in ok if r.stats])
    if speculation:
        summary["speculation"] = speculation
    return summary


def summarize_speculation(stats: list[dict]) -> dict:
    """Per-round averages over all calls: the inputs of the capacity formula (README.md)."""
    total = {k: sum(s[k] for s in stats) for k in stats[0]} if stats else {}
    rounds = total.get("rounds", 0)
    if not rounds:
        return {}
    return {
        "rounds": rounds,
        "acceptance_rate": total["accepted_tokens"] / total["drafted_tokens"] if total["drafted_tokens"] else 0.0,
        "mean_gamma": total["gamma_sum"] / rounds,
        "tokens_per_round": total["generated_tokens"] / rounds,
        "tokens_per_target_pass": total["generated_tokens"] / max(1, total["target_forward_passes"]),
        "draft_ms_per_round": total["draft_ms"] / rounds,
        "verify_ms_per_round": total["verify_ms"] / rounds,
        "network_ms_per_round": total["network_ms"] / rounds,
    }


def histogram(sorted_ms: list[float], buckets: int = 10) -> list[dict]:
    """ghz's response-time histogram: how many latencies fall in (previous mark, mark], for
    `buckets` + 1 evenly spaced marks from the fastest to the slowest."""
    if not sorted_ms:
        return []
    lo, hi = sorted_ms[0], sorted_ms[-1]
    step = (hi - lo) / buckets
    marks = [lo + step * i for i in range(buckets)] + [hi] if step > 0 else [hi]
    counts, j = [], 0
    for mark in marks:
        n = 0
        while j < len(sorted_ms) and sorted_ms[j] <= mark:
            n, j = n + 1, j + 1
        counts.append({"mark_ms": mark, "count": n})
    return counts


def format_summary(s: dict) -> str:
    lines = ["", "Summary:"]
    if s["name"]:
        lines.append(f"  Name:\t{s['name']}")
    lines += [
        f"  Count:\t{s['count']}",
        f"  Total:\t{s['total_s']:.2f} s",
        f"  Slowest:\t{s['slowest_ms']:.2f} ms",
        f"  Fastest:\t{s['fastest_ms']:.2f} ms",
        f"  Average:\t{s['average_ms']:.2f} ms",
        f"  Requests/sec:\t{s['rps']:.2f}",
        f"  Tokens/sec:\t{s['tokens_per_s']:.2f}",
        "",
        "Response time histogram:",
    ]
    most = max((b["count"] for b in s["histogram"]), default=0)
    for b in s["histogram"]:
        bar = "∎" * (round(40 * b["count"] / most) if most else 0)
        lines.append(f"  {b['mark_ms']:.3f} [{b['count']}]\t|{bar}")
    lines += ["", "Latency distribution:"]
    lines += [f"  {k[1:]} % in {v:.2f} ms" for k, v in s["latency_percentiles_ms"].items()]
    if "first_message_percentiles_ms" in s:
        lines += ["", "First message (stream) distribution:"]
        lines += [f"  {k[1:]} % in {v:.2f} ms" for k, v in s["first_message_percentiles_ms"].items()]
    if "speculation" in s:
        sp = s["speculation"]
        lines += ["", "Speculation (per round, all calls):",
                  f"  Rounds:\t{sp['rounds']}",
                  f"  Mean gamma:\t{sp['mean_gamma']:.2f}",
                  f"  Acceptance:\t{sp['acceptance_rate']:.3f}",
                  f"  Tokens/round:\t{sp['tokens_per_round']:.2f}",
                  f"  Draft:\t{sp['draft_ms_per_round']:.2f} ms",
                  f"  Verify:\t{sp['verify_ms_per_round']:.2f} ms",
                  f"  Network:\t{sp['network_ms_per_round']:.2f} ms"]
    lines += ["", "Status code distribution:"]
    lines += [f"  [{code}]\t{n} responses" for code, n in sorted(s["status_codes"].items())]
    if s["errors"]:
        lines += ["", "Error distribution:"]
        lines += [f"  [{n}]\t{msg}" for msg, n in sorted(s["errors"].items(), key=lambda kv: -kv[1])]
    return "\n".join(lines) + "\n"


async def run_load_async(
    target: str = "127.0.0.1:50051",
    concurrency: int = 1,
    total: int | None = None,
    duration: float | None = None,
    rps: float | None = None,
    stream: bool = False,
    max_new_tokens: int = 16,
    temperature: float | None = None,
    prompt: str = "The quick brown fox",
    gamma: int | None = None,
    seed: int | None = None,
    ignore_eos: bool = False,
    insecure: bool = True,
    cacert: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    server_name: str | None = None,
    token: str | None = None,
    timeout: float = 60.0,
    connections: int = 1,
    reflection: bool = False,
    allow_remote: bool = False,
    print_summary: bool = True,
) -> dict:
    """Send the planned calls to `target`, print the ghz-style summary, and return it (see summarize)."""
    if not allow_remote:
        check_loopback(target)
    if connections < 1:
        raise ValueError("connections must be >= 1")
    if not 0 < timeout < float("inf"):
        # ghz reads 0 as no deadline; here a call without one could hold the run for ever
        raise ValueError("timeout must be a finite duration above 0, such as 60s")
    plan = Plan.bounded(total, duration, concurrency, rps)
    call = "specdec.v1.Orchestrator/" + ("GenerateStream" if stream else "Generate")
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    creds = None if insecure else channel_credentials(cacert, cert, key)
    data = request_data(prompt, max_new_tokens, temperature, gamma, seed, ignore_eos)

    if reflection:  # types from the server, as ghz: no generated code involved
        request_class, make_rpc = _reflection_factory(target, call, creds, options, metadata)
    else:
        request_class, make_rpc = _stub_factory(stream)
    request = json_format.ParseDict(data, request_class())

    channels = [grpc.aio.secure_channel(target, creds, options) if creds else grpc.aio.insecure_channel(target, options)
                for _ in range(connections)]
    try:
        callers = [Caller(make_rpc(ch), request, stream, metadata, timeout) for ch in channels]
        # Hard stop: the planned window plus one call timeout for the calls in flight.
        results, elapsed = await asyncio.wait_for(drive(plan, callers), plan.duration_s + timeout + 5)
    finally:
        for ch in channels:
            await ch.close()
    summary = summarize(results, elapsed, call)
    if print_summary:
        print(format_summary(summary), flush=True)
    return summary


def run_load(**kwargs) -> dict:
    """Blocking run_load_async (same keyword arguments); returns the summary dict."""
    return asyncio.run(run_load_async(**kwargs))


def _stub_factory(stream: bool):
    from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

    def make(channel):
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        return stub.GenerateStream if stream else stub.Generate
    return orchestrator_pb2.GenerateRequest, make


def _reflection_factory(target, call, creds, options, metadata):
    from deploy.loadtest.reflection import aio_callable, reflect_method

    sync = grpc.secure_channel(target, creds, options) if creds else grpc.insecure_channel(target, options)
    with sync:
        method = reflect_method(sync, call, metadata)
    return method.request_class, lambda channel: aio_callable(channel, method)


def from_ghz_config(path: str) -> dict:
    """run_load keyword arguments from a ghz JSON config (deploy/loadtest/ghz/*.json)."""
    with open(path) as f:
        cfg = json.load(f)
    data = cfg.get("data", {})
    kwargs = {
        "target": cfg.get("host"),
        "stream": cfg.get("call", "").endswith("/GenerateStream"),
        "concurrency": cfg.get("concurrency"),
        "total": cfg.get("total"),
        "rps": cfg.get("rps"),
        "duration": parse_duration(cfg.get("duration") or cfg.get("max-duration") or "0") or None,
        "timeout": parse_duration(cfg["timeout"]) if "timeout" in cfg else None,
        "connections": cfg.get("connections"),
        "cacert": cfg.get("cacert"), "cert": cfg.get("cert"), "key": cfg.get("key"),
        "server_name": cfg.get("cname"),
        "prompt": data.get("prompt"),
        "max_new_tokens": data.get("max_new_tokens", data.get("maxNewTokens")),
        "temperature": data.get("temperature"),
        "gamma": data.get("num_speculative_tokens", data.get("numSpeculativeTokens")),
        "seed": data.get("seed"),
        "ignore_eos": data.get("ignore_eos", data.get("ignoreEos")),
    }
    auth = (cfg.get("metadata") or {}).get("authorization", "")
    if auth.startswith("Bearer "):
        kwargs["token"] = auth[len("Bearer "):]
    return {k: v for k, v in kwargs.items() if v is not None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deploy.loadtest.loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="a ghz JSON config (deploy/loadtest/ghz/); flags given as well override it")
    p.add_argument("--target", help="orchestrator host:port (default 127.0.0.1:50051)")
    p.add_argument("-c", "--concurrency", type=int, help="concurrent workers (default 1)")
    p.add_argument("-n", "--total", type=int, help=f"calls to send (default {DEFAULT_TOTAL} when no --duration)")
    p.add_argument("-z", "--duration", type=parse_duration, help="stop sending after this long, e.g. 30s, 2m")
    p.add_argument("--rps", type=float, help="overall rate limit, calls per second (default: none)")
    p.add_argument("--stream", action="store_true", default=None, help="call GenerateStream instead of Generate")
    p.add_argument("--max-new-tokens", type=int, help="default 16")
    p.add_argument("--temperature", type=float, help="0 = greedy (default: the server's, 1.0)")
    p.add_argument("--prompt", help='default "The quick brown fox"')
    p.add_argument("--gamma", type=int, help="num_speculative_tokens (default: the server's adaptive policy)")
    p.add_argument("--seed", type=int, help="the requests' sampling seed (default: none, each call its own)")
    p.add_argument("--ignore-eos", action="store_true", default=None,
                   help="go on past the end-of-sequence token: every call generates --max-new-tokens")
    p.add_argument("--insecure", action="store_true", help="plaintext (the default unless --cacert)")
    p.add_argument("--cacert", help="CA bundle to verify the server; enables TLS")
    p.add_argument("--cert", help="client certificate (mutual TLS)")
    p.add_argument("--key", help="client key (mutual TLS)")
    p.add_argument("--cname", dest="server_name", help="server name to verify instead of the target host")
    p.add_argument("--token", help="bearer token for the public API")
    p.add_argument("--token-file", help="file holding the bearer token")
    p.add_argument("-t", "--timeout", type=parse_duration, help="per-call timeout (default 60s)")
    p.add_argument("--connections", type=int, help="gRPC connections, shared by the workers (default 1)")
    p.add_argument("--reflection", action="store_true", default=None,
                   help="resolve the method by server reflection, as ghz does")
    p.add_argument("--allow-remote", action="store_true", default=None, help="allow a non-loopback target")
    p.add_argument("--format", choices=("summary", "json"), default="summary",
                   help="a readable summary (default) or one JSON object")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


RUN_LOAD_FLAGS = ("target", "concurrency", "total", "duration", "rps", "stream", "max_new_tokens", "temperature",
                  "prompt", "gamma", "seed", "ignore_eos", "cacert", "cert", "key", "server_name", "token", "timeout",
                  "connections", "reflection", "allow_remote")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kwargs = from_ghz_config(args.config) if args.config else {}
    if args.token_file:
        with open(args.token_file) as f:
            args.token = f.read().strip()
    kwargs.update({k: getattr(args, k) for k in RUN_LOAD_FLAGS if getattr(args, k) is not None})
    kwargs["insecure"] = kwargs.get("cacert") is None
    kwargs["print_summary"] = False
    try:
        summary = run_load(**kwargs)
    except (ValueError, LookupError, grpc.RpcError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2) if args.format == "json" else format_summary(summary))
    return 1 if summary["error_count"] else 0


if __name__ == "__main__":
    sys.exit(main())
