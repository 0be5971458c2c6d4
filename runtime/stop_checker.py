"""Stop conditions for one request: stop strings, stop / EOS tokens, max_tokens.

Fed one (token id, text delta) pair per generated token, it returns the text that is
safe to stream. A stop string may be split over any number of tokens and deltas, so the
longest suffix of the text that is a proper prefix of some stop string is held back
until it either completes a stop string (then it and everything after it are dropped)
or stops being a possible prefix (then it is released). Nothing else is held.

finish_reason is "stop" (stop string, stop token or EOS) or "length" (max_tokens);
stop_reason says which stop string or token id ended the request (None for EOS and
length, as in vLLM). The text of a stop token or EOS token is not emitted.
Checks run in vLLM's order: EOS, stop token ids, stop strings, then length.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple


class StopUpdate(NamedTuple):
    text: str  # newly releasable text (may be "")
    finish_reason: str | None  # None while the request runs; "stop" | "length"
    stop_reason: str | int | None  # the stop string or stop token id that matched


class StopChecker:
    def __init__(self, stop_strings: Iterable[str] = (), stop_token_ids: Iterable[int] = (),
                 eos_token_ids: Iterable[int] = (), ignore_eos: bool = False,
                 max_tokens: int | None = None):
        self.stop_strings = tuple(stop_strings)
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop_strings!r}.")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}.")
        self.stop_token_ids = frozenset(stop_token_ids)
        self.eos_token_ids = frozenset(() if ignore_eos else eos_token_ids)
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self.text = ""  # everything released so far
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._held = ""  # suffix that may still grow into a stop string
        # longest stop string minus one bounds what can be held
        self._max_hold = max((len(s) - 1 for s in self.stop_strings), default=0)

    @classmethod
    def from_params(cls, params, eos_token_ids: Iterable[int]) -> "StopChecker":
        """From a SamplingParams and the tokenizer's EOS ids."""
        return cls(params.stop, params.stop_token_ids, eos_token_ids, params.ignore_eos,
                   params.max_tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def held_text(self) -> str:
        """Text generated but not yet released (a possible stop-string prefix)."""
        return self._held

    def update(self, token_id: int, text_delta: str) -> StopUpdate:
        """Account for one generated token and its text delta. Mutates state."""
        if self.finished:
            raise RuntimeError(f"the request already finished ({self.finish_reason}); "
                               f"no more tokens may be fed.")
        self.num_tokens += 1
        if token_id in self.eos_token_ids:
            return self._finish(self._release_all(), "stop", None)
        if token_id in self.stop_token_ids:
            return self._finish(self._release_all(), "stop", token_id)
        buffer = self._held + text_delta
        match = self._earliest_stop(buffer)
        if match is not None:
            pos, stop = match
            self._held = ""
            return self._finish(self._emit(buffer[:pos]), "stop", stop)
        hold = self._hold_length(buffer)
        self._held = buffer[len(buffer) - hold:] if hold else ""
        text = self._emit(buffer[:len(buffer) - hold])
        if self.max_tokens is not None and self.num_tokens >= self.max_tokens:
            return self._finish(text + self._release_all(), "length", None)
        return StopUpdate(text, None, None)

    def finish_grammar(self) -> StopUpdate:
        """End the request because its grammar is complete (structured outputs): "stop",
        with the held text released. Mutates state."""
        return self._finish(self._release_all(), "stop", None)

    def flush(self) -> str:
        """Release the held text when the request ends for another reason (abort, context
        full). Mutates state."""
        return self._release_all()

    # ------------------------------------------------------------------ internals
    def _finish(self, text: str, reason: str, stop_reason) -> StopUpdate:
        self.finish_reason, self.stop_reason = reason, stop_reason
        return StopUpdate(text, reason, stop_reason)

    def _emit(self, text: str) -> str:
        self.text += text
        return text

    def _release_all(self) -> str:
        held, self._held = self._held, ""
        return self._emit(held)

    def _earliest_stop(self, buffer: str) -> tuple[int, str] | None:
        best = None
        for stop in self.stop_strings:
            pos = buffer.find(stop)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def _hold_length(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        for n in range(min(self._max_hold, len(buffer)), 0, -1):
            suffix = buffer[-n:]
            if any(stop.startswith(suffix) for stop in self.stop_strings):
                return n
        return 0
