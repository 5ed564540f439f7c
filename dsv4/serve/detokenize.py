"""Incremental detokenization: text as tokens arrive, never a split UTF-8 character.

A byte-level tokenizer can spread one character over several tokens, and a SentencePiece-style decoder writes a
token's leading space only in context, so decoding each token alone is wrong. `IncrementalDetokenizer` decodes the
ids cumulatively — over a window that starts a few tokens back, so the cost of a step does not grow with the output
— and hands out only the new text once it is stable: longer than before and not ending in U+FFFD (the replacement
character of an incomplete UTF-8 sequence). `flush` at the end of a request hands out what is left, replacement
characters included. The concatenation of every piece equals `decode(all ids)` for byte-level and WordPiece-style
tokenizers (the scheme of Hugging Face's text-generation-inference and vLLM).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.token_ids: list[int] = []
        self._prefix = 0  # window start: tokens before it are already text
        self._read = 0  # tokens up to here have been handed out as text
        self.text = ""
        """Everything handed out so far."""

    def add(self, token_ids: Iterable[int]) -> str:
        """Takes new tokens; returns the text that became stable (often "", e.g. mid-character)."""
        self.token_ids.extend(int(t) for t in token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The rest at the end of the stream, an incomplete character as U+FFFD."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read == len(self.token_ids):
            return ""
        before = self._decode(self.token_ids[self._prefix : self._read])
        after = self._decode(self.token_ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith(REPLACEMENT) and not final):
            return ""
        piece = after[len(before) :]
        self._prefix, self._read = self._read, len(self.token_ids)
        self.text += piece
        return piece
