"""Incremental detokenizer: turns a growing list of token ids into text deltas.

Byte-level tokenizers split multi-byte UTF-8 characters across tokens, and decoding a
lone token can give U+FFFD or drop a leading space that only appears in context. So
each step decodes a short window of recent tokens twice: up to the previous read point
and up to now, and emits the difference. If the new text ends in U+FFFD the character
is incomplete and nothing is emitted until the next token completes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
# Tokens of context kept before the read point: enough for any tokenizer's merges of
# leading spaces and for the longest UTF-8 sequence (4 bytes) split over byte tokens.
CONTEXT_TOKENS = 6


@dataclass
class IncrementalDetokenizer:
    tokenizer: Tokenizer
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0  # start of the decode window
    read_offset: int = 0  # tokens before this have been emitted as text
    text: str = ""  # everything emitted so far

    @classmethod
    def after_prompt(cls, tokenizer: Tokenizer, prompt_ids: list[int],
                     skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        """Start after a prompt, so the first output token decodes in its context."""
        n = len(prompt_ids)
        return cls(tokenizer, skip_special_tokens, list(prompt_ids),
                   prefix_offset=max(0, n - CONTEXT_TOKENS), read_offset=n)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (may be "")."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            # nothing new, or an incomplete UTF-8 character: wait for more tokens
            return ""
        if not full.startswith(prefix):
            # the window re-tokenised differently; fall back to the common prefix
            common = 0
            while common < min(len(prefix), len(full)) and prefix[common] == full[common]:
                common += 1
            delta = full[common:]
        else:
            delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a sequence, emit whatever is left (even an incomplete char)."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        delta = full[len(prefix):] if full.startswith(prefix) else ""
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
