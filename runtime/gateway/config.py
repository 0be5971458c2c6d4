"""The gateway's YAML config, validated into small frozen dataclasses.

    backends:                       # any OpenAI-compatible server
      - name: small-a
        url: http://127.0.0.1:8001
        api_key_env: SMALL_KEY      # optional: the backend's key, read from this variable
        models: [smollm2-135m]      # the model ids it serves
        max_concurrency: 16         # requests in flight to it, at most
        weight: 1
        timeouts: {connect: 2, first_token: 30, total: 300}   # seconds
    groups:                         # the model names clients ask for
      - name: small
        aliases: [fast]
        backends: [small-a, small-b]
        model: smollm2-135m         # the id sent upstream (default: the group's name)
        fallbacks: [large]          # groups tried, in order, when this one fails
    routing:
      auto: {small: small, large: large, threshold: 0.3}   # model "auto"
    retries: {max_attempts: 3, base_delay: 0.05, max_delay: 2.0, max_retry_after: 5}
    circuit: {failures: 5, window: 30, cooldown: 10}
    keys:                           # none: the gateway is open
      - name: team-a
        key_env: TEAM_A_KEY
        models: [small, auto]       # default: every group
        limits: {requests_per_minute: 60, tokens_per_minute: 50000, concurrent: 4}
    guardrails: {input: {email: mask, card: block}, output: {email: mask}, reversible: true}
    cache: {enabled: true, max_entries: 1024, ttl: 600,
            semantic: {enabled: true, threshold: 0.90, groups: {small: 0.95}}}
    trace: {path: traces.jsonl, zero_retention: false, sample: 1.0}
    limits: {max_body_mib: 8, default_max_tokens: 256}

Every key is checked: an unknown key, a wrong type or a bad value raises ConfigError
naming the key's path (`backends[1].timeouts.first_token: ...`), so a typo never passes
silently. Secrets are never in the file: keys come from environment variables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import yaml

from .guardrails import GuardrailConfigError, GuardrailPolicy


class ConfigError(ValueError):
    """The config is invalid; the message names the key and says how to fix it."""


@dataclass(frozen=True)
class Timeouts:
    connect: float = 2.0       # s to open the connection
    first_token: float = 60.0  # s from sending the request to the response head / first event
    total: float = 600.0       # s for the whole response


@dataclass(frozen=True)
class BackendConfig:
    name: str
    url: str                   # base URL without /v1
    models: tuple[str, ...]
    api_key: str | None = None
    max_concurrency: int = 64
    weight: float = 1.0
    timeouts: Timeouts = field(default_factory=Timeouts)


@dataclass(frozen=True)
class GroupConfig:
    name: str
    backends: tuple[str, ...]
    model: str                 # the model id sent upstream
    aliases: tuple[str, ...] = ()
    fallbacks: tuple[str, ...] = ()


@dataclass(frozen=True)
class AutoRoute:
    small: str                 # group for easy requests
    large: str                 # group for the rest
    # difficulty score below it -> small; 0.3: the best trade measured (gateway-routing.md)
    threshold: float = 0.3
    model_path: str | None = None  # a trained difficulty model; None: the shipped one


@dataclass(frozen=True)
class RetryConfig:
    max_attempts: int = 3      # upstream attempts per request, over every backend
    base_delay: float = 0.05   # s; full jitter: sleep U(0, min(max_delay, base * 2**n))
    max_delay: float = 2.0
    max_retry_after: float = 5.0  # a longer Retry-After moves on to the next backend


@dataclass(frozen=True)
class CircuitConfig:
    failures: int = 5          # failures within `window` s that open the circuit
    window: float = 30.0
    cooldown: float = 10.0     # s open before one trial request (half-open)


@dataclass(frozen=True)
class KeyLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrent: int | None = None


@dataclass(frozen=True)
class ApiKey:
    name: str
    key: str
    models: tuple[str, ...] | None = None   # None: every model
    limits: KeyLimits = field(default_factory=KeyLimits)


@dataclass(frozen=True)
class SemanticCacheConfig:
    enabled: bool = False
    # cosine similarity of the questions' embeddings at or above which an answer is reused
    # (the labelled set chose 0.88; 0.90 leaves a margin over the nearest near miss:
    # docs/gateway-semantic-cache.md)
    threshold: float = 0.90
    max_entries: int = 1024
    ttl: float = 600.0
    allow_sampled: bool = False   # reuse answers to requests with temperature > 0 too
    group_thresholds: tuple[tuple[str, float], ...] = ()   # per model group

    def threshold_for(self, group: str) -> float:
        return dict(self.group_thresholds).get(group, self.threshold)


@dataclass(frozen=True)
class CacheConfig:
    enabled: bool = False
    max_entries: int = 1024
    ttl: float = 600.0
    semantic: SemanticCacheConfig = field(default_factory=SemanticCacheConfig)


@dataclass(frozen=True)
class TraceConfig:
    path: str | None = None
    zero_retention: bool = False  # no prompt or completion text anywhere
    sample: float = 1.0           # share of requests traced (failures always are)


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 8 << 20
    default_max_tokens: int = 256   # for token rate limits when a request sets none


@dataclass(frozen=True)
class GatewayConfig:
    backends: tuple[BackendConfig, ...]
    groups: tuple[GroupConfig, ...]
    auto: AutoRoute | None = None
    retries: RetryConfig = field(default_factory=RetryConfig)
    circuit: CircuitConfig = field(default_factory=CircuitConfig)
    keys: tuple[ApiKey, ...] = ()
    guardrails: GuardrailPolicy | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    limits: Limits = field(default_factory=Limits)

    def group_names(self) -> dict[str, str]:
        """Every name a client may send (group names and aliases) -> its group."""
        names = {}
        for g in self.groups:
            names[g.name] = g.name
            for a in g.aliases:
                names[a] = g.name
        return names


def load_config(path: str, environ: dict[str, str] | None = None) -> GatewayConfig:
    """The config in `path`, validated (ConfigError on any problem)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read the gateway config {path}: {e.strerror}.") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    return parse_config(raw, os.environ if environ is None else environ)


# --- validation helpers: each names the key path in its error ---------------------------

def _mapping(raw: Any, where: str, allowed: set[str], required: set[str] = frozenset()) -> dict:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}.")
    unknown = sorted(set(map(str, raw)) - allowed)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key; expected one of "
                          f"{', '.join(sorted(allowed))}.")
    missing = sorted(required - set(raw))
    if missing:
        raise ConfigError(f"{where}.{missing[0]}: required key is missing.")
    return raw


def _number(raw: dict, key: str, where: str, default, *, minimum=None, integer=False,
            exclusive=False, maximum=None):
    value = raw.get(key, default)
    if value is None:
        return None
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        want = "an integer" if integer else "a number"
        raise ConfigError(f"{where}.{key}: expected {want}, got {value!r}.")
    if minimum is not None and (value <= minimum if exclusive else value < minimum):
        op = ">" if exclusive else ">="
        raise ConfigError(f"{where}.{key}: must be {op} {minimum}, got {value!r}.")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{where}.{key}: must be <= {maximum}, got {value!r}.")
    return float(value) if not integer else int(value)


def _string(raw: dict, key: str, where: str, default=None) -> str | None:
    value = raw.get(key, default)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{where}.{key}: expected a non-empty string, got {value!r}.")
    return value


def _bool(raw: dict, key: str, where: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{key}: expected true or false, got {value!r}.")
    return value


def _names(raw: dict, key: str, where: str, default=()) -> tuple[str, ...]:
    value = raw.get(key, default)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}.{key}: expected a list of names, got {value!r}.")
    return tuple(value)


def _list(raw: Any, where: str) -> list:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: expected a list, got {type(raw).__name__}.")
    return raw


def _secret(raw: dict, key: str, where: str, environ) -> str | None:
    var = _string(raw, key, where)
    if var is None:
        return None
    value = environ.get(var)
    if not value:
        raise ConfigError(f"{where}.{key}: the environment variable {var} is not set; export "
                          f"it before starting the gateway.")
    return value


# --- sections ----------------------------------------------------------------------------

_TOP = {"backends", "groups", "routing", "retries", "circuit", "keys", "guardrails", "cache",
        "trace", "limits"}


def parse_config(raw: Any, environ) -> GatewayConfig:
    top = _mapping(raw, "config", _TOP, {"backends"})
    backends = tuple(_backend(b, f"backends[{i}]", environ)
                     for i, b in enumerate(_list(top["backends"], "backends")))
    if not backends:
        raise ConfigError("backends: at least one backend is needed.")
    _unique([b.name for b in backends], "backends", "backend name")
    groups = tuple(_group(g, f"groups[{i}]")
                   for i, g in enumerate(_list(top.get("groups"), "groups")))
    if not groups:  # default: one group per model a backend serves
        models: dict[str, list[str]] = {}
        for b in backends:
            for m in b.models:
                models.setdefault(m, []).append(b.name)
        groups = tuple(GroupConfig(m, tuple(bs), m) for m, bs in models.items())
    _check_groups(groups, backends)
    routing = _mapping(top.get("routing"), "routing", {"auto"})
    auto = _auto(routing["auto"], "routing.auto", groups) if "auto" in routing else None
    keys = tuple(_key(k, f"keys[{i}]", environ)
                 for i, k in enumerate(_list(top.get("keys"), "keys")))
    _unique([k.name for k in keys], "keys", "key name")
    names = {g.name for g in groups} | {a for g in groups for a in g.aliases}
    if auto is not None:
        names.add("auto")
    for i, k in enumerate(keys):
        for m in k.models or ():
            if m not in names:
                raise ConfigError(f"keys[{i}].models: {m!r} is not a group, alias or 'auto'.")
    guard = None
    if top.get("guardrails") is not None:
        try:
            guard = GuardrailPolicy.from_config(top["guardrails"], "guardrails")
        except GuardrailConfigError as e:
            raise ConfigError(str(e)) from None
    cache, trace = _cache(top.get("cache")), _trace(top.get("trace"))
    if cache.enabled and trace.zero_retention:
        raise ConfigError("cache.enabled: the response cache keeps completion text, which "
                          "trace.zero_retention forbids; turn one of them off.")
    if cache.semantic.enabled and trace.zero_retention:
        raise ConfigError("cache.semantic.enabled: the semantic cache keeps questions and "
                          "completion text, which trace.zero_retention forbids; turn one of "
                          "them off.")
    for name, _ in cache.semantic.group_thresholds:
        if name not in {g.name for g in groups}:
            raise ConfigError(f"cache.semantic.groups: {name!r} is not a group.")
    return GatewayConfig(backends, groups, auto, _retries(top.get("retries")),
                         _circuit(top.get("circuit")), keys, guard, cache, trace,
                         _limits(top.get("limits")))


def _unique(names: list[str], where: str, what: str) -> None:
    seen = set()
    for n in names:
        if n in seen:
            raise ConfigError(f"{where}: the {what} {n!r} appears twice.")
        seen.add(n)


def _backend(raw, where: str, environ) -> BackendConfig:
    b = _mapping(raw, where, {"name", "url", "api_key_env", "models", "max_concurrency",
                              "weight", "timeouts"}, {"name", "url", "models"})
    url = _string(b, "url", where).rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{where}.url: expected http(s)://host:port, got {url!r}.")
    if url.endswith("/v1"):
        url = url[:-3]
    models = _names(b, "models", where)
    if not models:
        raise ConfigError(f"{where}.models: list the model ids this backend serves.")
    t = _mapping(b.get("timeouts"), f"{where}.timeouts", {"connect", "first_token", "total"})
    tw = f"{where}.timeouts"
    timeouts = Timeouts(_number(t, "connect", tw, 2.0, minimum=0, exclusive=True),
                        _number(t, "first_token", tw, 60.0, minimum=0, exclusive=True),
                        _number(t, "total", tw, 600.0, minimum=0, exclusive=True))
    return BackendConfig(_string(b, "name", where), url, models,
                         _secret(b, "api_key_env", where, environ),
                         _number(b, "max_concurrency", where, 64, minimum=1, integer=True),
                         _number(b, "weight", where, 1.0, minimum=0, exclusive=True), timeouts)


def _group(raw, where: str) -> GroupConfig:
    g = _mapping(raw, where, {"name", "backends", "model", "aliases", "fallbacks"},
                 {"name", "backends"})
    name = _string(g, "name", where)
    backends = _names(g, "backends", where)
    if not backends:
        raise ConfigError(f"{where}.backends: name at least one backend.")
    return GroupConfig(name, backends, _string(g, "model", where, name),
                       _names(g, "aliases", where), _names(g, "fallbacks", where))


def _check_groups(groups: tuple[GroupConfig, ...], backends) -> None:
    by_name = {b.name: b for b in backends}
    names = [g.name for g in groups] + [a for g in groups for a in g.aliases]
    _unique(names, "groups", "model name or alias")
    if "auto" in names:
        raise ConfigError("groups: 'auto' is reserved for the difficulty router "
                          "(routing.auto); rename the group or alias.")
    known = {g.name for g in groups}
    for i, g in enumerate(groups):
        for b in g.backends:
            if b not in by_name:
                raise ConfigError(f"groups[{i}].backends: no backend named {b!r}.")
            if g.model not in by_name[b].models:
                raise ConfigError(f"groups[{i}].model: backend {b!r} does not list model "
                                  f"{g.model!r} in its models.")
        for f in g.fallbacks:
            if f not in known or f == g.name:
                raise ConfigError(f"groups[{i}].fallbacks: {f!r} is not another group.")


def _auto(raw, where: str, groups) -> AutoRoute:
    a = _mapping(raw, where, {"small", "large", "threshold", "model_path"}, {"small", "large"})
    known = {g.name for g in groups}
    for k in ("small", "large"):
        if a[k] not in known:
            raise ConfigError(f"{where}.{k}: {a[k]!r} is not a group.")
    return AutoRoute(a["small"], a["large"],
                     _number(a, "threshold", where, AutoRoute.threshold, minimum=0, maximum=1),
                     _string(a, "model_path", where))


def _key(raw, where: str, environ) -> ApiKey:
    k = _mapping(raw, where, {"name", "key_env", "models", "limits"}, {"name", "key_env"})
    lim = _mapping(k.get("limits"), f"{where}.limits",
                   {"requests_per_minute", "tokens_per_minute", "concurrent"})
    lw = f"{where}.limits"
    limits = KeyLimits(*(_number(lim, n, lw, None, minimum=1, integer=True)
                         for n in ("requests_per_minute", "tokens_per_minute", "concurrent")))
    models = _names(k, "models", where) if "models" in k else None
    return ApiKey(_string(k, "name", where), _secret(k, "key_env", where, environ), models,
                  limits)


def _retries(raw) -> RetryConfig:
    r = _mapping(raw, "retries", {"max_attempts", "base_delay", "max_delay", "max_retry_after"})
    return RetryConfig(_number(r, "max_attempts", "retries", 3, minimum=1, integer=True),
                       _number(r, "base_delay", "retries", 0.05, minimum=0),
                       _number(r, "max_delay", "retries", 2.0, minimum=0),
                       _number(r, "max_retry_after", "retries", 5.0, minimum=0))


def _circuit(raw) -> CircuitConfig:
    c = _mapping(raw, "circuit", {"failures", "window", "cooldown"})
    return CircuitConfig(_number(c, "failures", "circuit", 5, minimum=1, integer=True),
                         _number(c, "window", "circuit", 30.0, minimum=0, exclusive=True),
                         _number(c, "cooldown", "circuit", 10.0, minimum=0))


def _cache(raw) -> CacheConfig:
    c = _mapping(raw, "cache", {"enabled", "max_entries", "ttl", "semantic"})
    return CacheConfig(_bool(c, "enabled", "cache", False),
                       _number(c, "max_entries", "cache", 1024, minimum=1, integer=True),
                       _number(c, "ttl", "cache", 600.0, minimum=0, exclusive=True),
                       _semantic(c.get("semantic")))


def _semantic(raw) -> SemanticCacheConfig:
    where = "cache.semantic"
    s = _mapping(raw, where, {"enabled", "threshold", "max_entries", "ttl", "allow_sampled",
                              "groups"})
    groups = _mapping(s.get("groups"), f"{where}.groups", set(map(str, s.get("groups") or {})))
    per_group = tuple((str(name), _number(groups, name, f"{where}.groups", None, minimum=0,
                                          maximum=1)) for name in groups)
    return SemanticCacheConfig(
        _bool(s, "enabled", where, False),
        _number(s, "threshold", where, SemanticCacheConfig.threshold, minimum=0, maximum=1),
        _number(s, "max_entries", where, 1024, minimum=1, integer=True),
        _number(s, "ttl", where, 600.0, minimum=0, exclusive=True),
        _bool(s, "allow_sampled", where, False), per_group)


def _trace(raw) -> TraceConfig:
    t = _mapping(raw, "trace", {"path", "zero_retention", "sample"})
    return TraceConfig(_string(t, "path", "trace"), _bool(t, "zero_retention", "trace", False),
                       _number(t, "sample", "trace", 1.0, minimum=0, maximum=1))


def _limits(raw) -> Limits:
    lim = _mapping(raw, "limits", {"max_body_mib", "default_max_tokens"})
    mib = _number(lim, "max_body_mib", "limits", 8, minimum=0, exclusive=True)
    return Limits(int(mib * (1 << 20)),
                  _number(lim, "default_max_tokens", "limits", 256, minimum=1, integer=True))
