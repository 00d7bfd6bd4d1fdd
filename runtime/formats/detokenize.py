"""Streaming detokenization: text deltas that never split a UTF-8 character."""

from __future__ import annotations

from collections.abc import Iterable

from dspark_grpc.runtime.formats.tokenizer import TextTokenizer

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Feed ids with `add`; the deltas it returns, followed by `flush()`, concatenate to `decode(ids)`.

    Only the ids since the last emitted boundary are re-decoded, together with the previous chunk as
    context (`_prefix`), so the cost per call does not grow with the length of the text.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, ids: int | Iterable[int]) -> str:
        self.ids.extend([ids] if isinstance(ids, int) else ids)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        for end in range(len(self.ids), self._read, -1):
            text = self._decode(self.ids[self._prefix : end])
            if len(text) > len(prefix_text) and not text.endswith(REPLACEMENT):
                self._prefix, self._read = self._read, end
                return text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back (an incomplete character decodes to U+FFFD, as `decode` does)."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return text[len(prefix_text) :]
