"""The frame link's wire: ProposeMux and VerifyMux messages over a plain TCP (or TLS)
connection, each message a 4-byte little-endian length and its serialized bytes.

Why: gRPC's Python server hands each message from its poller thread to the event loop,
where an asyncio socket is read by the event loop itself. A target-only VerifyMux call
cost 0.575 ms beyond the replica's compute over gRPC and 0.314 ms over this link, back to
back, and 0.736 against 0.497 ms after a 5 ms idle gap (`python -m benchmarks.rpc_floor
--calls 200 --gaps-ms 0,5`, 2026-12-04 20:15 UTC); a round makes two such calls. The
messages are replica.proto's, unchanged; only the transport differs, and the gRPC
services (with health and reflection) stay for everything else.

A connection opens with a hello, the multiplexed method it wants ("ProposeMux" or
"VerifyMux"), and the replica answers with a status frame: code 0 to go on, else a gRPC
status code and why (the wrong pool, a stopping replica), after which it closes.
"""
from __future__ import annotations

import asyncio
import socket
import ssl
import struct

from specdec.grpc_server import KEEPALIVE_MS, MAX_MESSAGE_BYTES

MAGIC = b"SPDF1"  # protocol and version: a client of another version is refused at hello
LENGTH = struct.Struct("<I")
HELLO_TIMEOUT_S = 10.0


class FrameError(Exception):
    """The peer broke the protocol: a bad hello, a frame over the limit, a cut connection."""


KEEPALIVE_PROBES = 3  # unanswered probes, KEEPALIVE_MS // 3 apart, before the kernel drops the link


def keep_alive(writer: asyncio.StreamWriter) -> None:
    """TCP keepalive on the link's socket, as gRPC pings its channels (KEEPALIVE_MS): a
    peer that vanished without closing (a node lost, a partition) fails the link within
    about twice that, rather than at the next call's timeout, and an idle link's entry in
    a NAT or conntrack table stays fresh."""
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, KEEPALIVE_MS // 1000)
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", max(1, idle // 3)),
                        ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, name):  # Linux; elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def frame(payload: bytes) -> bytes:
    return LENGTH.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_MESSAGE_BYTES) -> bytes | None:
    """The next frame's payload; None where the peer closed cleanly between two frames."""
    try:
        head = await reader.readexactly(LENGTH.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise FrameError("the connection was cut inside a frame's length") from None
    (size,) = LENGTH.unpack(head)
    if size > limit:
        raise FrameError(f"a frame of {size} bytes is over the {limit}-byte limit")
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise FrameError(f"the connection was cut inside a frame of {size} bytes") from None


def hello(method: str) -> bytes:
    return frame(MAGIC + method.encode())


async def read_hello(reader: asyncio.StreamReader) -> str:
    """The method a new connection asks for. (asyncio.timeout, not wait_for: on Python 3.11
    wait_for drops a cancellation that lands as its read completes, and a stopping server's
    cancellation must end the connection.)"""
    async with asyncio.timeout(HELLO_TIMEOUT_S):
        payload = await read_frame(reader, limit=256)
    if payload is None or not payload.startswith(MAGIC):
        raise FrameError("not a frame-link hello (expected a client of protocol " + MAGIC.decode() + ")")
    return payload[len(MAGIC):].decode(errors="replace")


def status_frame(code: int = 0, details: str = "") -> bytes:
    return frame(bytes([code]) + details.encode())


def parse_status(payload: bytes | None) -> tuple[int, str]:
    if not payload:
        raise FrameError("the replica closed the connection at hello")
    return payload[0], payload[1:].decode(errors="replace")


def server_ssl_context(cert_file: str | None, key_file: str | None, ca_file: str | None) -> ssl.SSLContext | None:
    """TLS as the replica's gRPC port has it: its certificate, and where a CA is given,
    clients must show a certificate that CA signed (mutual TLS)."""
    if not cert_file:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_file, key_file)
    if ca_file:
        ctx.load_verify_locations(ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_ssl_context(ca_file: str | None, cert_file: str | None = None,
                       key_file: str | None = None) -> ssl.SSLContext | None:
    """TLS as the orchestrator's gRPC channels have it: the pools' CA, and its own
    certificate where it has one."""
    if not ca_file:
        return None
    ctx = ssl.create_default_context(cafile=ca_file)
    if cert_file:
        ctx.load_cert_chain(cert_file, key_file)
    return ctx
