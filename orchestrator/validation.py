"""Turns a public GenerateRequest into a checked GenerationRequest, or says clearly why not."""
from __future__ import annotations

import math
import random
import re

from jinja2 import TemplateError

from orchestrator import request_ids
from orchestrator.gamma_policy import MAX_GAMMA
from orchestrator.generation import GenerationRequest
from specdec.errors import InvalidRequest, PreconditionFailed
from specdec.logprob_records import MAX_TOP
from specdec.sampling_params import MAX_BIAS, MAX_BIASED, SamplingParams

SESSION_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
MAX_PROMPT_CHARS = 200_000
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKENS = 16
MAX_REPETITION = 10.0
MAX_MESSAGES = 256
MAX_ROLE_CHARS = 64


def validate(pb, tokenizer, vocab_size: int, max_len: int, max_new_tokens_limit: int) -> GenerationRequest:
    """A public request → the loop's request, or InvalidRequest naming the first field that is
    out of range: a bad request is refused before any replica or Redis does work for it."""
    ids = _prompt_ids(pb, tokenizer, vocab_size, max_len)
    if not 1 <= pb.max_new_tokens <= max_new_tokens_limit:
        raise InvalidRequest(f"max_new_tokens must lie in 1..{max_new_tokens_limit}, got {pb.max_new_tokens}")
    params = _sampling_params(pb, vocab_size)
    if not 0 <= pb.min_tokens <= pb.max_new_tokens:
        raise InvalidRequest(f"min_tokens must lie in 0..max_new_tokens ({pb.max_new_tokens}), got {pb.min_tokens}")
    if len(pb.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in pb.stop):
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters")
    gamma, lookup = _speculation(pb, params.temperature)
    if not 0 <= pb.top_logprobs <= MAX_TOP:
        raise InvalidRequest(f"top_logprobs must lie in 0..{MAX_TOP}, got {pb.top_logprobs}")
    if pb.top_logprobs and not (pb.logprobs or pb.prompt_logprobs):
        raise InvalidRequest("top_logprobs needs logprobs or prompt_logprobs: set one of them to true as well")
    if pb.processed_logprobs and not (pb.logprobs or pb.prompt_logprobs):
        raise InvalidRequest("processed_logprobs needs logprobs or prompt_logprobs: set one of them to true as well")
    return GenerationRequest(prompt_ids=ids, max_new_tokens=pb.max_new_tokens, params=params,
                             stop=list(pb.stop), session_id=pb.session_id, gamma=gamma,
                             keep_session=pb.keep_session, seeded=pb.HasField("seed"),
                             request_id=pb.request_id, fingerprint=_fingerprint(pb) if pb.request_id else "",
                             logprobs=pb.logprobs, top_logprobs=pb.top_logprobs, prompt_logprobs=pb.prompt_logprobs,
                             stop_token_ids=_stop_token_ids(pb, vocab_size), ignore_eos=pb.ignore_eos,
                             processed_logprobs=pb.processed_logprobs, min_tokens=pb.min_tokens, lookup=lookup)


def _prompt_ids(pb, tokenizer, vocab_size: int, max_len: int) -> list[int]:
    """The request's prompt as token ids (given, tokenized, or a conversation through the chat
    template), refused where it is ambiguous, empty or leaves the context no room."""
    if pb.prompt and pb.prompt_token_ids:
        raise InvalidRequest("give either prompt or prompt_token_ids, not both")
    if pb.messages and (pb.prompt or pb.prompt_token_ids):
        raise InvalidRequest(f"give messages or {'prompt' if pb.prompt else 'prompt_token_ids'}, not both")
    if pb.messages and pb.session_id:
        raise InvalidRequest("messages are a whole conversation and go without session_id: to continue one, "
                             "send it whole again (the replicas reuse the part they have seen)")
    if pb.session_id and not SESSION_ID.match(pb.session_id):
        raise InvalidRequest("session_id must be 1..128 characters of letters, digits, '_', '-', '.', ':'")
    if pb.request_id and not SESSION_ID.match(pb.request_id):
        raise InvalidRequest("request_id must be 1..128 characters of letters, digits, '_', '-', '.', ':'")
    if not pb.prompt and not pb.prompt_token_ids and not pb.messages and not pb.session_id:
        raise InvalidRequest("the prompt is empty: give prompt text, prompt_token_ids or messages")
    if len(pb.prompt) > MAX_PROMPT_CHARS:
        raise InvalidRequest(f"the prompt has {len(pb.prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
    if pb.prompt_token_ids:
        ids = list(pb.prompt_token_ids)
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        if bad:
            raise InvalidRequest(f"prompt_token_ids must lie in 0..{vocab_size - 1}; got {bad[0]}")
    elif pb.messages:
        ids = chat_prompt_ids(tokenizer, pb.messages)
    else:
        ids = tokenizer(pb.prompt)["input_ids"] if pb.prompt else []
    if len(ids) >= max_len:
        raise InvalidRequest(f"the prompt has {len(ids)} tokens; the model context is {max_len} tokens "
                             "and at least one must be left to generate")
    return ids


def _sampling_params(pb, vocab_size: int) -> SamplingParams:
    """The law the replicas sample from, each field checked against its range; unset fields
    take their off values, and a request without a seed gets a drawn one (its answer says it)."""
    temperature = pb.temperature if pb.HasField("temperature") else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequest(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    top_p = pb.top_p if pb.HasField("top_p") else 1.0
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise InvalidRequest(f"top_p must lie in (0, 1], got {top_p}")
    if pb.top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0 (0 = no truncation), got {pb.top_k}")
    if not math.isfinite(pb.min_p) or not 0 <= pb.min_p <= 1:
        raise InvalidRequest(f"min_p must lie in [0, 1] (0 = no truncation), got {pb.min_p}")
    repetition = pb.repetition_penalty if pb.HasField("repetition_penalty") else 1.0
    if not math.isfinite(repetition) or not 0 < repetition <= MAX_REPETITION:
        raise InvalidRequest(f"repetition_penalty must lie in (0, {MAX_REPETITION:g}] (1 = off), got {repetition}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not math.isfinite(getattr(pb, name)) or not -2 <= getattr(pb, name) <= 2:
            raise InvalidRequest(f"{name} must lie in [-2, 2] (0 = off), got {getattr(pb, name)}")
    seed = pb.seed if pb.HasField("seed") else random.getrandbits(63)
    return SamplingParams(temperature=float(temperature), top_k=min(pb.top_k, vocab_size), top_p=float(top_p),
                          seed=seed, min_p=float(pb.min_p), repetition_penalty=float(repetition),
                          presence_penalty=float(pb.presence_penalty), frequency_penalty=float(pb.frequency_penalty),
                          logit_bias=_logit_bias(pb, vocab_size))


def _speculation(pb, temperature: float) -> tuple[int | None, bool | None]:
    """→ (the fixed γ, or None for the adaptive policy; prompt lookup as asked, or None where
    unset), refused where they contradict each other or a seeded sampled request."""
    gamma = None
    if pb.HasField("num_speculative_tokens"):
        gamma = pb.num_speculative_tokens
        if not 0 <= gamma <= MAX_GAMMA:
            raise InvalidRequest(f"num_speculative_tokens must lie in 0..{MAX_GAMMA} (or be unset for "
                                 f"the adaptive policy), got {gamma}")
    lookup = pb.prompt_lookup if pb.HasField("prompt_lookup") else None
    if lookup and gamma == 0:
        raise InvalidRequest("prompt_lookup asks for drafted rounds and num_speculative_tokens 0 for none: "
                             "leave one of them unset")
    if lookup and pb.HasField("seed") and temperature > 0:
        raise InvalidRequest("prompt_lookup cannot go with a seed at temperature > 0: a seeded request must "
                             "reproduce, and where its rounds look up depends on the load")
    return gamma, lookup


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    """A conversation → its prompt: the tokenizer's chat template over the turns, then the
    template's generation prompt (the opening of the assistant's turn), tokenised without
    special tokens of the tokenizer's own, since the template writes those it wants (a BOS)."""
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"at most {MAX_MESSAGES} messages, got {len(messages)}")
    for i, m in enumerate(messages):
        if not m.role or len(m.role) > MAX_ROLE_CHARS:
            raise InvalidRequest(f"messages[{i}].role must be 1..{MAX_ROLE_CHARS} characters, got {len(m.role)}")
    chars = sum(len(m.content) for m in messages)
    if chars > MAX_PROMPT_CHARS:
        raise InvalidRequest(f"the messages have {chars} characters; the limit is {MAX_PROMPT_CHARS}")
    if not getattr(tokenizer, "chat_template", None):
        raise PreconditionFailed("this model's tokenizer (the orchestrator's --tokenizer) has no chat template: "
                                 "send prompt or prompt_token_ids instead of messages")
    turns = [{"role": m.role, "content": m.content} for m in messages]
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except TemplateError as exc:  # what a template raises for turns it does not take (roles out of order)
        raise InvalidRequest(f"the model's chat template refused the messages: {exc}") from exc
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _logit_bias(pb, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if len(pb.logit_bias) > MAX_BIASED:
        raise InvalidRequest(f"logit_bias takes at most {MAX_BIASED} tokens, got {len(pb.logit_bias)}")
    for token, bias in pb.logit_bias.items():
        if not 0 <= token < vocab_size:
            raise InvalidRequest(f"logit_bias token ids must lie in 0..{vocab_size - 1}; got {token}")
        if not math.isfinite(bias) or abs(bias) > MAX_BIAS:
            raise InvalidRequest(f"logit_bias values must lie in [-{MAX_BIAS:g}, {MAX_BIAS:g}]; got {bias} for {token}")
    return tuple(sorted((t, float(b)) for t, b in pb.logit_bias.items()))


def _stop_token_ids(pb, vocab_size: int) -> frozenset[int]:
    if len(pb.stop_token_ids) > MAX_STOP_TOKENS:
        raise InvalidRequest(f"at most {MAX_STOP_TOKENS} stop_token_ids, got {len(pb.stop_token_ids)}")
    bad = [t for t in pb.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"stop_token_ids must lie in 0..{vocab_size - 1}; got {bad[0]}")
    return frozenset(pb.stop_token_ids)


def _fingerprint(pb) -> str:
    """The request's fields but its id: what a retry must repeat to continue it."""
    fields = type(pb)()
    fields.CopyFrom(pb)
    fields.ClearField("request_id")
    return request_ids.fingerprint(fields.SerializeToString(deterministic=True))
