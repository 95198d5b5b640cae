"""The public servicer's request handling, on the real tokenizer."""
from __future__ import annotations

import asyncio
import threading

from orchestrator.generation import Generator
from orchestrator.server import INLINE_PROMPT_CHARS, OrchestratorServicer
from specdec.v1 import orchestrator_pb2 as pb


class ThreadNoting:
    """The real tokenizer, noting which thread each call ran on."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.threads: list[int] = []

    def __call__(self, text, *args, **kwargs):
        self.threads.append(threading.get_ident())
        return self.tokenizer(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_long_prompt_is_tokenized_off_the_event_loop(tokenizer):
    """Other generations' rounds run on the loop meanwhile; a short prompt stays inline."""
    noting = ThreadNoting(tokenizer)
    servicer = OrchestratorServicer(Generator(None, None, noting, 2048), len(tokenizer), 64, 4)
    short, long = "def area(r):\n", "total = total + 1\n" * 100
    assert len(short) <= INLINE_PROMPT_CHARS < len(long)

    async def requests():
        got = [await servicer._request(pb.GenerateRequest(prompt=p, max_new_tokens=8)) for p in (short, long)]
        return threading.get_ident(), got

    loop_thread, (got_short, got_long) = asyncio.run(requests())
    assert noting.threads[0] == loop_thread and noting.threads[1] != loop_thread
    assert got_short.prompt_ids == tokenizer(short)["input_ids"]
    assert got_long.prompt_ids == tokenizer(long)["input_ids"]
