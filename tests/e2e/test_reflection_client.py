"""Call Generate exactly as ghz or grpcurl do: descriptors from server reflection,
no generated stubs, a JSON-like request built from field names."""
from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

pytestmark = pytest.mark.e2e


def fetch_pool(channel, symbol: str) -> descriptor_pool.DescriptorPool:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    pool = descriptor_pool.DescriptorPool()
    pending = [reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)]
    seen: set[str] = set()
    protos = {}
    while pending:
        req = pending.pop()
        resp = next(stub.ServerReflectionInfo(iter([req])))
        for raw in resp.file_descriptor_response.file_descriptor_proto:
            fd = descriptor_pb2.FileDescriptorProto.FromString(raw)
            if fd.name in seen:
                continue
            seen.add(fd.name)
            protos[fd.name] = fd
            for dep in fd.dependency:
                if dep not in seen:
                    pending.append(reflection_pb2.ServerReflectionRequest(file_by_filename=dep))
    added: set[str] = set()

    def add(name):
        if name in added:
            return
        for dep in protos[name].dependency:
            add(dep)
        pool.Add(protos[name])
        added.add(name)

    for name in protos:
        add(name)
    return pool


def test_generate_through_reflection_alone(local_stack):
    channel = grpc.insecure_channel(local_stack.orchestrator_address)
    pool = fetch_pool(channel, "specdec.v1.Orchestrator")
    service = pool.FindServiceByName("specdec.v1.Orchestrator")
    method = service.methods_by_name["Generate"]
    Request = message_factory.GetMessageClass(method.input_type)
    Response = message_factory.GetMessageClass(method.output_type)
    request = json_format.ParseDict({"prompt": "def main():\n", "max_new_tokens": 8, "temperature": 0}, Request())
    call = channel.unary_unary(f"/{service.full_name}/{method.name}",
                               request_serializer=Request.SerializeToString,
                               response_deserializer=Response.FromString)
    response = json_format.MessageToDict(call(request, timeout=120))
    assert len(response["tokenIds"]) == 8
    assert response["stats"]["generatedTokens"] == 8
