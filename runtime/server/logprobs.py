"""Logprobs in the two OpenAI shapes.

completions (legacy):  {"tokens": [...], "token_logprobs": [...], "top_logprobs":
                        [{token: logprob}, ...], "text_offset": [...]}
    The first prompt token (with echo) has no logprob: None in both lists, as OpenAI and
    vLLM return it. Each top_logprobs entry holds the chosen token and its alternatives.
chat:                  {"content": [{"token", "logprob", "bytes", "top_logprobs":
                        [{"token", "logprob", "bytes"}]}]}
"""

from __future__ import annotations

from ..sampler import TokenLogprobs
from ..tokenizer import Tokenizer


def token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


class CompletionLogprobs:
    """Accumulates the legacy completions logprobs object, entry by entry."""

    def __init__(self, tok: Tokenizer, text_offset: int = 0) -> None:
        self.tok = tok
        self.offset = text_offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_id: int, lp: TokenLogprobs | None) -> None:
        s = token_text(self.tok, token_id)
        self.tokens.append(s)
        self.text_offset.append(self.offset)
        self.offset += len(s)
        if lp is None:
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
            return
        self.token_logprobs.append(lp.logprob)
        top = {s: lp.logprob}
        for tid, value in lp.top:
            top.setdefault(token_text(self.tok, tid), value)
        self.top_logprobs.append(top)

    def add_prompt(self, prompt_ids: list[int], lps: list[TokenLogprobs | None]) -> None:
        for tid, lp in zip(prompt_ids, lps):
            self.add(tid, lp)

    def take(self) -> dict:
        """The object so far, then start empty (for streaming deltas)."""
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
               "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


def _entry(tok: Tokenizer, token_id: int, logprob: float) -> dict:
    s = token_text(tok, token_id)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(tok: Tokenizer, lps: list[TokenLogprobs], num_top: int) -> list[dict]:
    """Entries for `logprobs.content`."""
    content = []
    for lp in lps:
        e = _entry(tok, lp.token_id, lp.logprob)
        e["top_logprobs"] = [_entry(tok, t, v) for t, v in lp.top[:num_top]]
        content.append(e)
    return content
