"""Small clients for the e2e tests: the public API, the replicas' Load reports, Redis."""
from __future__ import annotations

import grpc
import redis

from specdec.internal.v1 import replica_pb2, replica_pb2_grpc
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc as pb_grpc


def api(address: str) -> pb_grpc.OrchestratorStub:
    return pb_grpc.OrchestratorStub(grpc.insecure_channel(address))


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


def redis_client(stack) -> redis.Redis:
    return redis.Redis(port=stack.redis_port, password=stack.redis_password)


def session_keys(stack) -> set[str]:
    keys = redis_client(stack).keys("specdec:session:*")
    return {k.decode().split(":")[2] for k in keys}
