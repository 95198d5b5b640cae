"""GenerateRequest.messages: rendered by the tokenizer's chat template, refused clearly
where they cannot be (the rest of the request's checks: tests/e2e/test_validation.py)."""
from __future__ import annotations

import pytest

from orchestrator.validation import MAX_MESSAGES, validate
from specdec.errors import InvalidRequest, PreconditionFailed
from specdec.models import load_tokenizer
from specdec.v1 import orchestrator_pb2 as pb
from tests.chat_tokenizer import chat_tokenizer_dir


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    return load_tokenizer(chat_tokenizer_dir(tmp_path_factory.mktemp("chat")))


def conversation(*turns: tuple[str, str], **fields) -> pb.GenerateRequest:
    req = pb.GenerateRequest(max_new_tokens=8, **fields)
    for role, content in turns:
        req.messages.add(role=role, content=content)
    return req


def checked(req, tokenizer):
    return validate(req, tokenizer, tokenizer.vocab_size, 2048, 1024)


def test_messages_become_the_templates_text_with_the_assistants_opening(chat_tokenizer):
    got = checked(conversation(("system", "Answer in code."), ("user", "def add(a, b):")), chat_tokenizer)
    text = "<|system|>\nAnswer in code.\n<|user|>\ndef add(a, b):\n<|assistant|>\n"
    assert got.prompt_ids == chat_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert chat_tokenizer.decode(got.prompt_ids) == text


def test_the_templates_own_refusal_is_an_invalid_argument_with_its_words(chat_tokenizer):
    with pytest.raises(InvalidRequest, match="chat template refused the messages: a conversation opens with"):
        checked(conversation(("assistant", "Hello.")), chat_tokenizer)


def test_a_tokenizer_without_a_template_is_a_failed_precondition(tokenizer):
    assert not tokenizer.chat_template  # the bundled one
    with pytest.raises(PreconditionFailed, match="has no chat template: send prompt or prompt_token_ids"):
        checked(conversation(("user", "hi")), tokenizer)


@pytest.mark.parametrize("req, words", [
    (conversation(("user", "hi"), prompt="hi"), "give messages or prompt, not both"),
    (conversation(("user", "hi"), prompt_token_ids=[5]), "give messages or prompt_token_ids, not both"),
    (conversation(("user", "hi"), session_id="s-1"), "messages are a whole conversation and go without session_id"),
    (conversation(("", "hi")), "messages[0].role must be 1..64 characters, got 0"),
    (conversation(("user", "hi"), ("u" * 65, "hi")), "messages[1].role must be 1..64 characters, got 65"),
    (conversation(*[("user", "hi")] * (MAX_MESSAGES + 1)), f"at most {MAX_MESSAGES} messages"),
    (conversation(("user", "x" * 150_000), ("user", "y" * 60_000)), "the messages have 210000 characters"),
])
def test_malformed_conversations_are_refused_with_a_message(chat_tokenizer, req, words):
    with pytest.raises(InvalidRequest) as refused:
        checked(req, chat_tokenizer)
    assert words in str(refused.value)
