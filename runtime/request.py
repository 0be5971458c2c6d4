"""A generation request as the engine tracks it.

There is no prefill/decode phase flag: a request has `num_computed_tokens` (tokens whose
KV is in the cache) and `num_tokens` (prompt + outputs so far); each step the scheduler
gives it some of the difference. Preemption by recompute just sets
`num_computed_tokens` back to 0 (the outputs so far become part of the recomputed prefix).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .kv_tail import KVTail
from .sampler import SamplingState
from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule)
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # KV of the prompt past its last full block, computed elsewhere (runtime/kv_tail.py);
    # consumed at the first admission
    kv_tail: KVTail | None = None
    # keep the KV blocks when the request finishes, until the engine's release_kv (a
    # prefill worker exports them first)
    hold_kv: bool = False
    scheduled_at: float | None = None  # time.monotonic() of its first admission to a step

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt has no tokens.")
        # the sampler's penalties read the same output list (one copy of the outputs)
        self.sampling = SamplingState(self.params, self.prompt_token_ids,
                                      self.output_token_ids)
        self._all_token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs, kept as one list as tokens are appended (read it, do not
        change it: append_output does)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)  # also self.sampling's output list
        self._all_token_ids.append(token_id)
