"""Exec probe: grpc.health.v1 Check over mutual TLS on 127.0.0.1:$SPECDEC_PORT.

Kubelet's native gRPC probe speaks plaintext only, so with TLS on the service port the
probe runs in the container and presents the pod's own certificate. The certificate must
carry the SAN "localhost". Exit 0 = SERVING.
"""
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def read(env: str) -> bytes:
    with open(os.environ[env], "rb") as f:
        return f.read()


def main() -> int:
    creds = grpc.ssl_channel_credentials(
        root_certificates=read("SPECDEC_TLS_CA_FILE"),
        private_key=read("SPECDEC_TLS_KEY_FILE"),
        certificate_chain=read("SPECDEC_TLS_CERT_FILE"),
    )
    address = "127.0.0.1:" + os.environ["SPECDEC_PORT"]
    options = [("grpc.ssl_target_name_override", "localhost")]
    with grpc.secure_channel(address, creds, options=options) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError as e:
            print(f"health check failed: {e.code().name}", file=sys.stderr)
            return 1
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
