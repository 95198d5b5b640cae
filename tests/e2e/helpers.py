"""Small clients for the e2e tests: the public API, the replicas' Load reports, Redis."""
from __future__ import annotations

import subprocess
import threading
import time

import grpc
import redis

from specdec.internal.v1 import replica_pb2, replica_pb2_grpc
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc as pb_grpc


def api(address: str) -> pb_grpc.OrchestratorStub:
    return pb_grpc.OrchestratorStub(grpc.insecure_channel(address))


def exit_status(stack, server, timeout: float = 15.0) -> int:
    """A stopping server's exit status. One still running after `timeout` fails the test
    with the end of its log, where its stop watch writes where it hangs: CI keeps no logs."""
    try:
        return server.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        tail = "\n".join(stack.log_tail(server, 80))
        raise AssertionError(f"the {server.kind} on port {server.port} is still running {timeout:.0f}s on; "
                             f"its log ends:\n{tail}") from None


def request(prompt="def main(", max_new_tokens=32, temperature=0.0, gamma=None, **kw) -> pb.GenerateRequest:
    req = pb.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, **kw)
    req.temperature = temperature
    if gamma is not None:
        req.num_speculative_tokens = gamma
    return req


def stream(stub, req, timeout=120):
    chunks = list(stub.GenerateStream(req, timeout=timeout))
    tokens = [t for c in chunks for t in c.token_ids]
    text = "".join(c.text for c in chunks)
    return tokens, text, chunks[-1]


def load_report(address: str, kind: str) -> replica_pb2.LoadReport:
    channel = grpc.insecure_channel(address)
    stub = replica_pb2_grpc.DraftStub(channel) if kind == "draft" else replica_pb2_grpc.TargetStub(channel)
    try:
        return stub.Load(replica_pb2.LoadRequest(), timeout=10)
    finally:
        channel.close()


def held_sessions(stack) -> dict[str, int]:
    """Sessions each live replica of the stack holds, by address."""
    return {r.address: load_report(r.address, r.kind).sessions for r in stack.replicas if r.proc.poll() is None}


def redis_client(stack) -> redis.Redis:
    return redis.Redis(port=stack.redis_port, password=stack.redis_password)


def session_keys(stack) -> set[str]:
    keys = redis_client(stack).keys("specdec:session:*")
    return {k.decode().split(":")[2] for k in keys}


def session_handles(stack) -> dict[str, dict[str, str]]:
    """Every session handle in Redis: session id → {"draft": address, "target": address, ...}."""
    client = redis_client(stack)
    handles = {}
    for key in client.keys("specdec:session:*"):
        parts = key.decode().split(":")
        if len(parts) == 3:
            meta = client.hgetall(key)
            handles[parts[2]] = {k.decode(): v.decode() for k, v in meta.items()}
    return handles


def live_replicas(stack, kind: str) -> list:
    return [r for r in stack.replicas if r.kind == kind and r.proc.poll() is None]


class Streams:
    """Several GenerateStream calls in threads, so a test can act once each has sent its
    first chunk and collect every outcome afterwards (tokens and final chunk, or the error)."""

    def __init__(self, stub, requests, timeout: float = 300) -> None:
        self.results: list = [None] * len(requests)
        self.tokens: list[list[int]] = [[] for _ in requests]  # each stream's tokens so far, kept on an error too
        self.calls: list = [None] * len(requests)
        self.first = [threading.Event() for _ in requests]
        self.threads = [threading.Thread(target=self._run, args=(i, stub, r, timeout), daemon=True)
                        for i, r in enumerate(requests)]
        for t in self.threads:
            t.start()

    def _run(self, i, stub, req, timeout) -> None:
        tokens, last = self.tokens[i], None
        try:
            self.calls[i] = stub.GenerateStream(req, timeout=timeout)
            for chunk in self.calls[i]:
                tokens.extend(chunk.token_ids)
                last = chunk
                self.first[i].set()
            self.results[i] = (tokens, last)
        except grpc.RpcError as exc:
            self.results[i] = exc
        finally:
            self.first[i].set()

    def wait_first_chunks(self, timeout: float = 120) -> None:
        for event in self.first:
            assert event.wait(timeout), "a stream sent no chunk"

    def cancel(self) -> None:
        for call in self.calls:
            if call is not None:
                call.cancel()

    def join(self, timeout: float = 300) -> list:
        for t in self.threads:
            t.join(timeout)
            assert not t.is_alive(), "a stream did not finish"
        return self.results


def killed_mid_stream(stack, doomed, streams: Streams) -> None:
    """SIGKILL the orchestrator `doomed` a moment into its `streams` (no drain, nothing
    released or unlocked), take it off the stack, and check that the streams failed."""
    try:
        streams.wait_first_chunks()
        time.sleep(0.2)
        stack.kill(doomed)
        for result in streams.join():
            assert isinstance(result, grpc.RpcError)
    finally:
        stack.orchestrators.remove(doomed)
