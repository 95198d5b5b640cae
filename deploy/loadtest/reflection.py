"""Call a gRPC method knowing only its name, as ghz does: the request and response types
come from the server's reflection service, not from generated code."""
from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase


@dataclass(frozen=True)
class ReflectedMethod:
    path: str  # "/specdec.v1.Orchestrator/Generate"
    request_class: type
    response_class: type
    server_streaming: bool
    client_streaming: bool


class _MetadataInterceptor(grpc.StreamStreamClientInterceptor):
    """Adds fixed metadata (an authorization header) to the reflection stream."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self._metadata = metadata

    def intercept_stream_stream(self, continuation, details, request_iterator):
        details = details._replace(metadata=tuple(details.metadata or ()) + self._metadata)
        return continuation(details, request_iterator)


def reflect_method(channel: grpc.Channel, call: str,
                   metadata: tuple[tuple[str, str], ...] = ()) -> ReflectedMethod:
    """Resolve "package.Service/Method" (or "package.Service.Method") over a blocking channel."""
    service_name, method_name = _split_call(call)
    if metadata:
        channel = grpc.intercept_channel(channel, _MetadataInterceptor(metadata))
    pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
    service = pool.FindServiceByName(service_name)
    method = service.methods_by_name.get(method_name)
    if method is None:
        raise LookupError(f"{service_name} has no method {method_name}")
    return ReflectedMethod(
        path=f"/{service_name}/{method_name}",
        request_class=message_factory.GetMessageClass(method.input_type),
        response_class=message_factory.GetMessageClass(method.output_type),
        server_streaming=method.server_streaming,
        client_streaming=method.client_streaming,
    )


def aio_callable(channel: grpc.aio.Channel, method: ReflectedMethod):
    """The grpc.aio multicallable for a reflected unary-request method."""
    if method.client_streaming:
        raise ValueError(f"{method.path}: client streaming is not supported")
    make = channel.unary_stream if method.server_streaming else channel.unary_unary
    return make(method.path, request_serializer=method.request_class.SerializeToString,
                response_deserializer=method.response_class.FromString)


def _split_call(call: str) -> tuple[str, str]:
    if "/" in call:
        service, _, method = call.rpartition("/")
    else:
        service, _, method = call.rpartition(".")
    if not service or not method:
        raise ValueError(f"call must look like package.Service/Method, got {call!r}")
    return service, method
