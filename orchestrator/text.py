"""Incremental detokenization and stop strings, without re-decoding the whole text
per round: only the generated tokens are decoded, and only new text is emitted."""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.emitted = 0  # characters of text already sent
        self.stopped = False

    def _text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def push(self, new_tokens: list[int]) -> tuple[str, int]:
        """Add tokens; return (text to emit now, how many of new_tokens to keep).

        Text that could still become a stop string, or that ends in an incomplete UTF-8
        sequence, is held back until the next round decides it."""
        self.tokens.extend(new_tokens)
        text = self._text()
        for s in self.stop:
            idx = text.find(s, max(0, self.emitted - len(s)))
            if idx != -1:
                self.stopped = True
                keep = self._tokens_covering(idx + len(s), len(new_tokens))
                out = text[self.emitted: idx]
                self.emitted = idx
                return out, keep
        safe = len(text)
        if text.endswith("\ufffd"):
            safe = len(text.rstrip("\ufffd"))
        for s in self.stop:  # hold back a suffix that is a prefix of a stop string
            for k in range(min(len(s) - 1, safe - self.emitted), 0, -1):
                if text[safe - k: safe] == s[:k]:
                    safe -= k
                    break
        out = text[self.emitted: safe]
        self.emitted = safe
        return out, len(new_tokens)

    def flush(self) -> str:
        if self.stopped:
            return ""
        text = self._text()
        out = text[self.emitted:]
        self.emitted = len(text)
        return out

    def _tokens_covering(self, chars: int, n_new: int) -> int:
        """How many of the newest n_new tokens are needed to produce `chars` characters."""
        base = len(self.tokens) - n_new
        for k in range(0, n_new + 1):
            if len(self.tokenizer.decode(self.tokens[: base + k], skip_special_tokens=True)) >= chars:
                del self.tokens[base + max(k, 1):]
                return max(k, 1)
        return n_new
