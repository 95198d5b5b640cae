"""The frame link on loopback: a real FrameServer (specdec.frame_server) answering through
serve_mux, and the orchestrator's MuxLink over a real FrameStream
(orchestrator.frame_stream). The handler here is a small stand-in for a servicer's verify
(these tests are of the transport; the replicas' own frame links run in the e2e tests):
its answers name the call, a negative token is refused, token 999 waits to be cancelled,
token 500 answers after 0.2 s."""
from __future__ import annotations

import asyncio
import socket
import ssl
from contextlib import asynccontextmanager, closing

import grpc
import pytest

from orchestrator.frame_stream import FrameStream
from orchestrator.mux_link import MuxLink
from specdec.errors import InvalidRequest
from specdec.frame_server import FrameServer, MuxMethod
from specdec.frames import (KEEPALIVE_PROBES, LENGTH, MAGIC, FrameError, client_ssl_context, frame, hello,
                            read_frame, server_ssl_context)
from specdec.grpc_server import KEEPALIVE_MS
from specdec.internal.v1 import replica_pb2 as rpb
from tests.pki import write_pki

SLOW = 999
LATE = 500  # answered after 0.2 s


class Handler:
    def __init__(self) -> None:
        self.cancelled = 0
        self.started_late = asyncio.Event()

    async def __call__(self, request: rpb.VerifyRequest) -> rpb.VerifyResponse:
        if any(t < 0 for t in request.draft_tokens):
            raise InvalidRequest(f"draft token {min(request.draft_tokens)} is negative")
        if SLOW in request.draft_tokens:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if LATE in request.draft_tokens:
            self.started_late.set()
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.001)
        return rpb.VerifyResponse(next_token=sum(request.draft_tokens), cache_length=len(request.draft_tokens))


def verify_method(handler) -> dict[str, MuxMethod]:
    return {"VerifyMux": MuxMethod(handler, rpb.VerifyCalls, rpb.VerifyAnswer, rpb.VerifyAnswers)}


def link_to(port: int, method: str = "VerifyMux", ssl_context=None) -> MuxLink:
    name = f"target replica 127.0.0.1:{port}"
    return MuxLink(lambda: FrameStream("127.0.0.1", port, method, rpb.VerifyAnswers, name, ssl_context),
                   name, "target", rpb.VerifyCall, rpb.VerifyCalls, "frames")


def req(*tokens: int) -> rpb.VerifyRequest:
    return rpb.VerifyRequest(draft_tokens=list(tokens))


@asynccontextmanager
async def serving(handler, ssl_context=None, server_cls=FrameServer):
    """A frame server on a free loopback port for the block: → (its port, its stopping
    event); stopped after."""
    stopping = asyncio.Event()
    server = server_cls(verify_method(handler), stopping, ssl_context)
    try:
        yield await server.start("127.0.0.1", 0), stopping
    finally:
        stopping.set()
        await server.stop(1)


def run(coro):
    return asyncio.run(coro)


def test_concurrent_calls_share_the_link_and_each_gets_its_own_answer():
    async def go():
        async with serving(Handler()) as (port, _):
            with closing(link_to(port)) as link:
                answers = await asyncio.gather(*(link.call(req(i, i + 1), 5) for i in range(40)))
                assert [(a.next_token, a.cache_length) for a in answers] == [(2 * i + 1, 2) for i in range(40)]
                assert link.opened == 1
                assert link.messages < 40  # the calls of one moment went out together

    run(go())


def test_a_refusal_fails_only_its_call_and_the_link_keeps_serving():
    async def go():
        async with serving(Handler()) as (port, _):
            with closing(link_to(port)) as link:
                bad, good = await asyncio.gather(link.call(req(3, -1), 5), link.call(req(4), 5),
                                                 return_exceptions=True)
                assert isinstance(bad, grpc.aio.AioRpcError)
                assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "draft token -1 is negative" in bad.details()
                assert good.next_token == 4
                assert (await link.call(req(5), 5)).next_token == 5
                assert link.opened == 1

    run(go())


def test_a_call_past_its_timeout_is_deadline_exceeded_and_the_replica_drops_its_work():
    async def go():
        handler = Handler()
        async with serving(handler) as (port, _):
            with closing(link_to(port)) as link:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await link.call(req(SLOW), 0.2)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                for _ in range(100):  # the cancel travels to the replica
                    if handler.cancelled:
                        break
                    await asyncio.sleep(0.01)
                assert handler.cancelled == 1
                assert (await link.call(req(6), 5)).next_token == 6

    run(go())


def test_the_wrong_method_or_a_closed_port_is_refused_with_a_status():
    async def go():
        async with serving(Handler()) as (port, _):
            with closing(link_to(port, "ProposeMux")) as wrong:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await wrong.call(req(1), 5)
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
                assert "serves VerifyMux" in err.value.details()
        with closing(link_to(port)) as closed:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await closed.call(req(1), 5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "cannot reach target replica" in err.value.details()

    run(go())


def test_garbage_on_the_port_is_dropped_and_the_server_keeps_serving():
    async def go():
        async with serving(Handler()) as (port, _):
            for junk in (b"GET / HTTP/1.1\r\n\r\n", frame(b"not a hello"),
                         hello("VerifyMux") + LENGTH.pack(2**31)):  # a frame over the limit
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(junk)
                await writer.drain()
                rest = await asyncio.wait_for(reader.read(), 5)  # the server closes the connection
                assert rest in (b"", frame(b"\x00"))  # at most the hello's go-ahead came first
                writer.close()
            with closing(link_to(port)) as link:
                assert (await link.call(req(7, 8), 5)).next_token == 15

    run(go())


def test_a_stopping_server_finishes_calls_in_flight_then_refuses():
    async def go():
        handler = Handler()
        async with serving(handler) as (port, stopping):
            with closing(link_to(port)) as link:
                assert (await link.call(req(1), 5)).next_token == 1
                in_flight = asyncio.ensure_future(link.call(req(LATE, 3), 5))
                await asyncio.wait_for(handler.started_late.wait(), 5)
                stopping.set()
                assert (await in_flight).next_token == LATE + 3  # answered before the link ended
                with pytest.raises(grpc.aio.AioRpcError) as err:  # then the link ended, and a new
                    await link.call(req(4), 5)  # one is refused at hello
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    run(go())


def test_both_ends_of_a_link_keep_it_alive_as_grpc_pings_its_channels():
    accepted = []

    class Watched(FrameServer):
        async def _serve(self, reader, writer):
            accepted.append(writer.get_extra_info("socket"))
            await super()._serve(reader, writer)

    async def go():
        async with serving(Handler(), server_cls=Watched) as (port, _):
            with closing(link_to(port)) as link:
                assert (await link.call(req(1), 5)).next_token == 1
                _, writer = await link._stream._connected
                for sock in (writer.get_extra_info("socket"), accepted[0]):
                    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_MS // 1000
                    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == KEEPALIVE_PROBES

    run(go())


def test_read_frame_tells_a_clean_end_from_a_cut_one():
    async def go():
        for data, expected in ((b"", None), (frame(b"abc"), b"abc")):
            reader = asyncio.StreamReader()
            reader.feed_data(data)
            reader.feed_eof()
            assert await read_frame(reader) == expected
        for data in (LENGTH.pack(10) + b"abc", b"\x01\x00"):
            reader = asyncio.StreamReader()
            reader.feed_data(data)
            reader.feed_eof()
            with pytest.raises(FrameError, match="cut"):
                await read_frame(reader)
        assert hello("VerifyMux") == frame(MAGIC + b"VerifyMux")

    run(go())


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return write_pki(tmp_path_factory.mktemp("frame-pki"), "frame link")[1]


def test_mutual_tls_admits_only_clients_with_a_certificate(certs):
    async def go():
        async with serving(Handler(), server_ssl_context(certs["server"], certs["server-key"], certs["ca"])) \
                as (port, _):
            ok = client_ssl_context(certs["ca"], certs["client"], certs["client-key"])
            with closing(link_to(port, ssl_context=ok)) as link:
                assert (await link.call(req(2, 2), 5)).next_token == 4
            for context in (client_ssl_context(certs["ca"]), None):  # no certificate; plaintext
                with closing(link_to(port, ssl_context=context)) as refused:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await refused.call(req(1), 5)
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    run(go())


def test_tls_contexts_are_built_only_where_files_are_given(certs):
    assert server_ssl_context(None, None, None) is None
    assert client_ssl_context(None) is None
    assert server_ssl_context(certs["server"], certs["server-key"], certs["ca"]).verify_mode == ssl.CERT_REQUIRED
    assert server_ssl_context(certs["server"], certs["server-key"], None).verify_mode == ssl.CERT_NONE
