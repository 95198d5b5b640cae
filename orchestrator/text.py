"""Incremental detokenisation and stop strings.

Each token is decoded against a short window of the tokens before it (the prefix/read
offsets of Hugging Face's TGI), so a round costs a few small decodes however long the
output is. Text that ends in an incomplete UTF-8 sequence, or that could still grow into a
stop string, is held back until a later token decides it.

A request's `min_tokens` holds stop strings off as it holds EOS and stop tokens off (vLLM's
semantics): only an occurrence that a token at or past the min_tokens-th completes ends the
text, whether it began before that token or not.
"""
from __future__ import annotations

from functools import partial
from typing import Callable


def plain_decoder(tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, as cheap as it can be had: a
    stream decodes two short windows a token, on every round of every generation. Where
    the tokenizer is Hugging Face's plain `TokenizersBackend` (its `_decode` not
    overridden) and cleans up no spaces, that decode is its Rust tokenizer's with the
    wrapper's argument conversions around it, and the Rust call alone gives the same text
    (1.5 against 4.3 µs a call for the bundled tokenizer here; tests/orchestrator/test_text.py
    compares the two). Any other tokenizer keeps its own decode."""
    decode = partial(tokenizer.decode, skip_special_tokens=True)
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # a transformers without it: the wrapper is all there is
        return decode
    backend = getattr(tokenizer, "_tokenizer", None)
    if (isinstance(tokenizer, TokenizersBackend) and type(tokenizer)._decode is TokenizersBackend._decode
            and not tokenizer.clean_up_tokenization_spaces and callable(getattr(backend, "decode", None))):
        return partial(backend.decode, skip_special_tokens=True)
    return decode


class TextStream:
    def __init__(self, tokenizer, stop: list[str], min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self._decode = plain_decoder(tokenizer)
        self.stop = [s for s in stop if s]
        self.min_tokens = min_tokens
        self.early = 0  # held[:early] came from tokens before min_tokens: no stop string may end there
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.held = ""  # decoded, not yet emitted
        self.stopped = False

    def _next_piece(self) -> str:
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        text = self._decode(self.tokens[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return text[len(prefix):]
        return ""

    def push(self, new_tokens: list[int]) -> tuple[str, int]:
        """Add a round's tokens; return (text to emit now, how many of the tokens to keep).
        After a stop string, the tokens past the one that completed it are dropped."""
        for i, token in enumerate(new_tokens):
            self.tokens.append(token)
            self.held += self._next_piece()
            if len(self.tokens) < self.min_tokens:
                self.early = len(self.held)
                continue
            for s in self.stop:
                idx = self.held.find(s, max(0, self.early - len(s) + 1))  # one that ends past the early text
                if idx != -1:
                    self.stopped = True
                    out, self.held = self.held[:idx], ""
                    return out, i + 1
        keep_back = 0
        for s in self.stop:  # the longest tail of held that starts a stop string
            for k in range(min(len(s) - 1, len(self.held)), keep_back, -1):
                if self.held.endswith(s[:k]):
                    keep_back = k
                    break
        cut = len(self.held) - keep_back
        out, self.held = self.held[:cut], self.held[cut:]
        self.early = max(0, self.early - cut)
        return out, len(new_tokens)

    def flush(self) -> str:
        """At the end: whatever was held back (a partial stop string, a partial character)."""
        if self.stopped:
            return ""
        rest = self._decode(self.tokens[self.prefix_offset:])[len(self._decode(self.tokens[self.prefix_offset:self.read_offset])):]
        out, self.held = self.held + rest, ""
        self.prefix_offset = self.read_offset = len(self.tokens)
        return out
