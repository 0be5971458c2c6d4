"""Which group a request goes to, and which backend serves each attempt.

    route = router.resolve("fast", messages)       # RouteChoice: group chain and why
    backend = router.pick(group, tried, now)        # least outstanding, weighted; or None

A model name resolves through aliases to a group; `auto` asks the difficulty router for
the small or the large group. The chain is the group and then its fallbacks, transitively,
each once. Within a group the backend with the smallest (in flight + 1) / weight is chosen
among those whose circuit lets a request through and that are under their concurrency
cap, preferring ones this request has not tried yet; ties are broken at random in
proportion to the weights.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .backend import Backend
from .config import GatewayConfig, GroupConfig
from .difficulty import DifficultyDecision, DifficultyRouter


class UnknownModel(LookupError):
    """The model name is neither a group, an alias nor `auto`."""


@dataclass(frozen=True)
class RouteChoice:
    requested: str                      # the model the client sent
    chain: tuple[str, ...]              # groups to try, in order
    reason: str                         # "alias fast -> small", "auto: score=0.12<0.50 ..."
    difficulty: DifficultyDecision | None = None


class Router:
    def __init__(self, config: GatewayConfig, backends: dict[str, Backend],
                 rng: random.Random | None = None) -> None:
        self.config = config
        self.backends = backends
        self.groups: dict[str, GroupConfig] = {g.name: g for g in config.groups}
        self.names = config.group_names()
        self.rng = rng or random.Random()
        self.difficulty = None
        if config.auto is not None:
            self.difficulty = DifficultyRouter.load(config.auto.model_path)

    def model_names(self) -> list[str]:
        return sorted(self.names) + (["auto"] if self.config.auto else [])

    def resolve(self, model: str | None, messages: list[dict] | None = None,
                prompt: str | None = None) -> RouteChoice:
        """The group chain for `model` (UnknownModel when it names none)."""
        decision = None
        if model == "auto" and self.config.auto is not None:
            auto = self.config.auto
            if messages is None:
                messages = [{"role": "user", "content": prompt or ""}]
            decision = self.difficulty.decide(messages, auto.threshold)
            group = auto.small if decision.target == "small" else auto.large
            reason = f"auto -> {group}: {decision.reason}"
        elif model is None and len(self.groups) == 1:
            group = next(iter(self.groups))
            reason = f"default -> {group}"
        elif model in self.names:
            group = self.names[model]
            reason = f"model {model}" if group == model else f"alias {model} -> {group}"
        else:
            raise UnknownModel(model)
        return RouteChoice(model or group, self._chain(group), reason, decision)

    def _chain(self, group: str) -> tuple[str, ...]:
        chain, todo = [], [group]
        while todo:
            g = todo.pop(0)
            if g not in chain:
                chain.append(g)
                todo.extend(self.groups[g].fallbacks)
        return tuple(chain)

    def pick(self, group: str, tried: set[str], skip: set[str], now: float) -> Backend | None:
        """The backend for the next attempt in `group`, or None when none may take it.
        `tried`: backends this request already used (preferred last); `skip`: never."""
        ready = [b for b in (self.backends[n] for n in self.groups[group].backends)
                 if b.name not in skip and not b.saturated() and b.breaker.available(now)]
        if not ready:
            return None
        fresh = [b for b in ready if b.name not in tried] or ready
        best = min(b.load() for b in fresh)
        ties = [b for b in fresh if b.load() <= best * (1 + 1e-9)]
        if len(ties) == 1:
            return ties[0]
        return self.rng.choices(ties, weights=[b.config.weight for b in ties])[0]
