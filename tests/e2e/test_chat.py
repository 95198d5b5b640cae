"""GenerateRequest.messages through a real stack: an orchestrator whose --tokenizer has a
chat template renders a conversation into the prompt it would get as token ids; one
without a template refuses it and goes on serving. And a chat model's end tokens: the
orchestrator ends answers at every end-of-sequence id of the model's generation config."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import grpc
import pytest

from specdec.models import load_tokenizer
from specdec.v1 import orchestrator_pb2 as pb
from tests.chat_tokenizer import chat_tokenizer_dir
from tests.e2e.helpers import api, request

pytestmark = pytest.mark.e2e
TURNS = [("system", "Answer in Python."), ("user", "def fibonacci(n):")]


END_PROMPT = "def main(argv):\n"


@pytest.fixture(scope="module")
def plain_answer(local_stack) -> list[int]:
    """The bundled target's greedy answer to END_PROMPT, from the stack's own orchestrator."""
    reply = api(local_stack.orchestrator_address).Generate(request(END_PROMPT, 24, ignore_eos=True), timeout=120)
    return list(reply.token_ids)


@pytest.fixture(scope="module")
def end_at(plain_answer) -> int:
    """A position of that answer whose token comes there first (from the fourth on), with no
    EOS up to it."""
    return next(i for i in range(3, len(plain_answer))
                if plain_answer[i] not in plain_answer[:i] and 0 not in plain_answer[:i + 1])


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, plain_answer, end_at):
    """The chat copy of the tokenizer, its generation config ending answers at EOS (0) and
    at the token of `end_at` too, as a chat model's lists its end of turn."""
    into = chat_tokenizer_dir(tmp_path_factory.mktemp("chat"))
    config = json.loads((into / "generation_config.json").read_text())
    config["eos_token_id"] = [0, plain_answer[end_at]]
    (into / "generation_config.json").write_text(json.dumps(config))
    return into


@pytest.fixture(scope="module")
def chat_orchestrator(local_stack, chat_dir):
    """A second orchestrator on the shared stack, its tokenizer the chat copy; stopped and
    dropped from the stack when the module ends."""
    rep = local_stack.start_orchestrator(extra=["--tokenizer", str(chat_dir)])
    try:
        local_stack.wait_serving(rep)
        yield rep.address
    finally:
        local_stack.kill(rep, sig=signal.SIGTERM)
        local_stack.orchestrators.remove(rep)


def chat_request(turns=TURNS, **fields) -> pb.GenerateRequest:
    req = request(prompt="", max_new_tokens=24, ignore_eos=True, **fields)
    for role, content in turns:
        req.messages.add(role=role, content=content)
    return req


def test_a_conversation_is_answered_as_its_rendered_prompt(chat_orchestrator, chat_dir):
    tokenizer = load_tokenizer(chat_dir)
    text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in TURNS], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stub = api(chat_orchestrator)
    as_ids = stub.Generate(request(prompt="", prompt_token_ids=ids, max_new_tokens=24, ignore_eos=True), timeout=120)
    chat = stub.Generate(chat_request(), timeout=120)
    assert chat.stats.prompt_tokens == len(ids)
    assert list(chat.token_ids) == list(as_ids.token_ids) and len(chat.token_ids) == 24  # greedy: the same answer
    streamed = [t for part in stub.GenerateStream(chat_request(), timeout=120) for t in part.token_ids]
    assert streamed == list(chat.token_ids)
    turns = [arg for role, content in TURNS for arg in ("--message", f"{role}:{content}")]
    cli = subprocess.run([sys.executable, "-m", "orchestrator.client", "--address", chat_orchestrator, "--json",
                          "--max-new-tokens", "24", "--ignore-eos", *turns], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["token_ids"] == list(chat.token_ids)


def test_the_templates_refusal_reaches_the_client_and_the_server_serves_on(chat_orchestrator):
    stub = api(chat_orchestrator)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(chat_request([("assistant", "Hello.")]), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "a conversation opens with a system or user turn" in refused.value.details()
    assert len(stub.Generate(chat_request(), timeout=120).token_ids) == 24


def test_an_orchestrator_whose_tokenizer_has_no_template_refuses_messages(local_stack):
    stub = api(local_stack.orchestrator_address)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(chat_request(), timeout=60)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no chat template" in refused.value.details()
    assert stub.Generate(request("def f(", 4), timeout=60).token_ids


def test_an_answer_ends_at_every_end_token_of_the_generation_config(chat_orchestrator, plain_answer, end_at):
    stub = api(chat_orchestrator)
    ended = stub.Generate(request(END_PROMPT, 24), timeout=120)
    assert list(ended.token_ids) == plain_answer[:end_at + 1]  # the end token kept, as EOS is
    assert ended.finish_reason == pb.FINISH_REASON_EOS
    assert list(stub.Generate(request(END_PROMPT, 24, ignore_eos=True), timeout=120).token_ids) == plain_answer
