"""The proposer interface, its registry, and the speculative-decoding config.

Each engine step, every running request that is decoding (all its known tokens but the
last are in the KV cache) may get up to k draft tokens from a proposer. The target then
scores the last token and the drafts in one forward pass (a chunk of 1 + k tokens) and
the rejection sampler decides how many drafts to keep.

    @register_proposer("ngram")
    class NgramProposer(Proposer): ...
    proposer = build_proposer(SpeculativeConfig("ngram", 4), target_model)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch

from ..request import Request


@dataclass(frozen=True)
class SpeculativeConfig:
    proposer: str  # a registered proposer name: "ngram", "early_exit", "hidden_draft", ...
    num_speculative_tokens: int = 4  # k: drafts per request and step (at most)
    options: dict = field(default_factory=dict)  # proposer-specific (see each proposer)
    # no drafts in a step while more requests than this are running (None: always draft);
    # a verifying step costs more than a plain one, which stops paying as batches grow
    disable_by_batch_size: int | None = None
    # the drafts of greedy and unseeded requests cut, step by step, to the number whose
    # expected tokens pay for the verification's measured cost (runtime/spec/
    # draft_budget.py); False: every proposed draft is verified
    adaptive: bool = True

    def __post_init__(self):
        if self.proposer not in _REGISTRY:
            raise ValueError(f"unknown proposer {self.proposer!r}; choose one of "
                             f"{', '.join(sorted(_REGISTRY))}.")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 32:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 32], got {k!r}.")
        n = self.disable_by_batch_size
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"disable_by_batch_size must be a positive integer or None, "
                             f"got {n!r}.")


class Proposal(NamedTuple):
    """Drafts for one request. `probs` is the draft distribution q each draft was sampled
    from ([len(token_ids), vocab] fp32); None means deterministic drafts (q one-hot)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


class ProposeRequest(NamedTuple):
    request: Request  # read-only: its committed tokens and sampling parameters
    num_drafts: int  # at most this many drafts (>= 1)


class Proposer(ABC):
    """Drafts tokens for decoding requests. Called from the engine loop only."""

    # True: the engine calls observe() after every step with the target's final hidden
    # state at each running request's last computed position
    uses_hidden = False
    # target layers whose output (residual stream [n, H]) observe() also gets
    tap_layers: tuple[int, ...] = ()
    # True: it runs no model of its own, so it serves an engine on any device (a draft
    # model's weights and KV cache live on the CPU, beside the CPU engine only)
    any_device = False
    # True: each draft costs a forward pass of a model of its own, so the draft budget
    # decides how many to make before it runs (DraftBudget.plan), not only which to verify
    runs_model = False

    def observe(self, request_id: str, position: int, feature: torch.Tensor,
                taps: torch.Tensor | None = None) -> None:
        """The target's final hidden state [H] at `position` of the request, and its
        residual stream after each of `tap_layers` there [n, H]."""

    @abstractmethod
    def propose(self, batch: Sequence[ProposeRequest]) -> list[Proposal]:
        """One Proposal per entry (possibly with no tokens). May mutate the proposer's own
        per-request state (e.g. a draft model's KV cache); never mutates the requests."""

    def release(self, request_id: str) -> None:
        """Forget a request (finished, aborted or preempted). Mutates proposer state."""


_REGISTRY: dict[str, Callable[..., Proposer]] = {}


def register_proposer(name: str):
    """Class (or factory) decorator: `factory(config, target)` builds the proposer, where
    `target` is the engine's LoadedModel-like object (model, tokenizer, path)."""

    def decorate(factory):
        _REGISTRY[name] = factory
        return factory

    return decorate


def proposer_names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def build_proposer(config: SpeculativeConfig, target, **kwargs) -> Proposer:
    _load_builtin()
    return _REGISTRY[config.proposer](config, target, **kwargs)


def _load_builtin() -> None:
    from . import draft_model, early_exit, hidden_draft, ngram  # noqa: F401  (registration side effect)


def make_config(proposer: str, num_speculative_tokens: int = 4, *,
                disable_by_batch_size: int | None = None, adaptive: bool = True,
                **options) -> SpeculativeConfig:
    """SpeculativeConfig with the built-in proposers registered first; `options` are the
    proposer's own."""
    _load_builtin()
    return SpeculativeConfig(proposer, num_speculative_tokens, dict(options),
                             disable_by_batch_size, adaptive)
