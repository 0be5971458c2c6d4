"""PII guardrails: what to do with each PII entity on the way in and on the way out.

    policy = GuardrailPolicy.from_config({"input": {"email": "mask", "card": "block"},
                                          "output": {"card": "mask"}, "reversible": True})
    guard = RequestGuard(policy)                 # one per request
    prompt = guard.check_input(prompt)           # "[EMAIL_1]" where the address was
    scanner = guard.output_scanner()             # one per response choice
    for delta in deltas:
        send(scanner.feed(delta))
    send(scanner.flush())

Per entity an action: "mask" replaces the item with its label ("[EMAIL]"), "block" refuses
the request or stops the response (GuardrailBlocked, whose message names the entity type
and never the value), "allow" lets it through; entities a policy does not name are allowed.
Every entity is still looked for, so an allowed card number is not masked as a phone number
found inside it.

Reversible masking: input items are replaced by a placeholder per value ("[EMAIL_1]", the
same value the same placeholder throughout the request), and the placeholders the model
writes back are restored in the response. The backend never sees the values; the client
gets them back. Restored values are the client's own, so the output policy does not apply
to them: output scanning runs on what the model wrote, and restoring comes after it.

Streaming: OutputScanner.feed returns what is safe to send now and holds back only the
shortest tail that could still be the beginning of a PII item (see `pii.find_settled_pii`)
or of a placeholder, so the concatenation of everything it returns equals scanning the
whole response at once, however the response was split.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

import phonenumbers

from .pii import ENTITIES, LOOKBEHIND, PiiMatch, find_pii, find_settled_pii

ACTIONS = ("mask", "block", "allow")
_KEYS = ("input", "output", "reversible", "region")
_LABELS = {entity: entity.upper() for entity in ENTITIES}  # "[NATIONAL_ID]"
_NAMES = {"email": "an e-mail address", "phone": "a phone number",
          "card": "a payment card number", "iban": "an IBAN (bank account number)",
          "ip": "an IP address", "national_id": "a national identity number"}
_PLACEHOLDER = re.compile(r"\[(?:%s)_[0-9]+\]" % "|".join(_LABELS.values()))


class GuardrailConfigError(ValueError):
    """A guardrails configuration that does not validate; the message names the key path."""


class GuardrailBlocked(Exception):
    """PII of an entity whose action is "block". The message is meant for the client: it
    names the entity type and the direction, never the value."""

    def __init__(self, entity: str, direction: str) -> None:
        self.entity = entity
        self.direction = direction  # "input" | "output"
        if direction == "input":
            message = (f"the request contains {_NAMES[entity]} (PII entity '{entity}'), "
                       "which this gateway's guardrails do not let reach the model")
        else:
            message = (f"the response contained {_NAMES[entity]} (PII entity '{entity}'), "
                       "which this gateway's guardrails do not let through")
        super().__init__(message)


def _actions(raw: object, path: str) -> dict[str, str]:
    """An entity -> action mapping, checked; None (an empty YAML section) is no entity."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise GuardrailConfigError(f"{path}: expected a mapping of entity to action, "
                                   "e.g. {email: mask}")
    for entity, action in raw.items():
        if entity not in ENTITIES:
            raise GuardrailConfigError(f"{path}.{entity}: unknown entity; expected one of "
                                       f"{', '.join(ENTITIES)}")
        if not isinstance(action, str) or action not in ACTIONS:
            raise GuardrailConfigError(f"{path}.{entity}: unknown action {action!r}; "
                                       f"expected one of {', '.join(ACTIONS)}")
    return dict(raw)


def _region(raw: object, path: str) -> str:
    if not isinstance(raw, str) or raw.upper() not in phonenumbers.SUPPORTED_REGIONS:
        raise GuardrailConfigError(f"{path}: unknown region {raw!r}; expected a region code "
                                   "that libphonenumber knows, such as US, GB or DE")
    return raw.upper()


@dataclass(frozen=True)
class GuardrailPolicy:
    """The action per entity for requests (`input`) and responses (`output`).

    `reversible`: masked input items become placeholders that are restored in the response.
    `region`: the region phone numbers without a country code are read in.
    """

    input: Mapping[str, str]
    output: Mapping[str, str]
    reversible: bool = False
    region: str = "US"

    def __post_init__(self) -> None:
        object.__setattr__(self, "input", MappingProxyType(_actions(self.input, "input")))
        object.__setattr__(self, "output", MappingProxyType(_actions(self.output, "output")))
        if not isinstance(self.reversible, bool):
            raise GuardrailConfigError(f"reversible: expected true or false, "
                                       f"got {self.reversible!r}")
        object.__setattr__(self, "region", _region(self.region, "region"))

    @classmethod
    def from_config(cls, raw: dict, where: str = "guardrails") -> "GuardrailPolicy":
        """The policy a config section describes, e.g. (YAML)

            guardrails:
              input: {email: mask, card: block}
              output: {card: mask}
              reversible: true
              region: US

        Anything unknown is a GuardrailConfigError naming its key path under `where`.
        """
        if not isinstance(raw, Mapping):
            raise GuardrailConfigError(f"{where}: expected a mapping with the keys "
                                       f"{', '.join(_KEYS)}")
        for key in raw:
            if key not in _KEYS:
                raise GuardrailConfigError(f"{where}.{key}: unknown key; expected one of "
                                           f"{', '.join(_KEYS)}")
        reversible = raw.get("reversible", False)
        if not isinstance(reversible, bool):
            raise GuardrailConfigError(f"{where}.reversible: expected true or false, "
                                       f"got {reversible!r}")
        return cls(input=_actions(raw.get("input"), f"{where}.input"),
                   output=_actions(raw.get("output"), f"{where}.output"),
                   reversible=reversible,
                   region=_region(raw.get("region", "US"), f"{where}.region"))


def _acting(actions: Mapping[str, str]) -> dict[str, str]:
    return {entity: action for entity, action in actions.items() if action != "allow"}


class RequestGuard:
    """The guardrails of one request: masks or blocks its input, hands out one output
    scanner per response choice, remembers reversible placeholders and counts actions."""

    def __init__(self, policy: GuardrailPolicy) -> None:
        self.policy = policy
        self._counts: Counter[str] = Counter()
        self._placeholders: dict[tuple[str, str], str] = {}  # (entity, value) -> placeholder
        self._values: dict[str, str] = {}  # placeholder -> value
        self._issued: Counter[str] = Counter()  # entity -> placeholders issued

    def check_input(self, text: str) -> str:
        """`text` with the items the input policy masks replaced; raises GuardrailBlocked
        for an entity it blocks."""
        acting = _acting(self.policy.input)
        if not acting:
            return text
        items = find_pii(text, acting, region=self.policy.region)
        for item in items:  # a refused request masks nothing
            if acting[item.entity] == "block":
                self._counts[f"input.{item.entity}.block"] += 1
                raise GuardrailBlocked(item.entity, "input")
        return _apply(text, 0, len(text), items, acting, "input", self._counts,
                      lambda item: self._mask(item, text))

    def output_scanner(self) -> "OutputScanner":
        """A scanner for one response choice (they share this request's placeholders and
        action counts)."""
        return OutputScanner(self.policy.output, region=self.policy.region,
                             placeholders=self._values if self.policy.reversible else None,
                             counts=self._counts)

    @property
    def actions(self) -> dict[str, int]:
        """How often each action was taken, by "direction.entity.action", e.g.
        {"input.email.mask": 2, "output.card.block": 1}; allowed items are not counted."""
        return dict(self._counts)

    def _mask(self, item: PiiMatch, text: str) -> str:
        label = _LABELS[item.entity]
        if not self.policy.reversible:
            return f"[{label}]"
        key = (item.entity, item.text)
        if key not in self._placeholders:
            placeholder = ""
            # a placeholder the client wrote itself would be "restored" too: skip those
            while not placeholder or placeholder in text:
                self._issued[item.entity] += 1
                placeholder = f"[{label}_{self._issued[item.entity]}]"
            self._placeholders[key] = placeholder
            self._values[placeholder] = item.text
        return self._placeholders[key]


def _apply(text: str, start: int, end: int, items: list[PiiMatch], acting: Mapping[str, str],
           direction: str, counts: Counter[str], mask: Callable[[PiiMatch], str]) -> str:
    """text[start:end] with the acting items masked (by `mask(item)`), in order; the first
    blocked one raises GuardrailBlocked."""
    pieces = []
    last = start
    for item in items:
        action = acting.get(item.entity)
        if action is None:
            continue
        counts[f"{direction}.{item.entity}.{action}"] += 1
        if action == "block":
            raise GuardrailBlocked(item.entity, direction)
        pieces += [text[last:item.start], mask(item)]
        last = item.end
    pieces.append(text[last:end])
    return "".join(pieces)


class OutputScanner:
    """Masks (or blocks) PII in one streamed response, and restores reversible placeholders.

    `feed` returns the text that is safe to send now and holds back the shortest tail that
    could still be the beginning of a PII item or of a placeholder; `flush` returns that
    tail, scanned, at the end of the stream. After GuardrailBlocked, every call raises it
    again: nothing after a blocked item is ever returned.
    """

    def __init__(self, actions: Mapping[str, str], *, region: str = "US",
                 placeholders: Mapping[str, str] | None = None,
                 counts: Counter[str] | None = None) -> None:
        self._acting = _acting(actions)
        self._region = region
        self._placeholders = placeholders if placeholders is not None else {}
        self._counts = counts if counts is not None else Counter()
        self._raw = ""  # LOOKBEHIND characters of sent text, then the undecided text
        self._start = 0  # where the undecided text begins in _raw
        self._unrestored = ""  # scanned text that may still be the beginning of a placeholder
        self._blocked: GuardrailBlocked | None = None

    def feed(self, chunk: str) -> str:
        """The part of everything fed so far that is safe to send now, and not sent yet."""
        return self._step(chunk, final=False)

    def flush(self) -> str:
        """End of stream: the held tail, scanned."""
        return self._step("", final=True)

    def _step(self, chunk: str, final: bool) -> str:
        if self._blocked is not None:
            raise self._blocked
        try:
            scanned = self._scan(chunk, final)
        except GuardrailBlocked as blocked:
            self._blocked = blocked
            raise
        return self._restore(scanned, final)

    def _scan(self, chunk: str, final: bool) -> str:
        if not self._acting:
            return chunk
        raw = self._raw + chunk
        end, items = find_settled_pii(raw, self._start, region=self._region, final=final)
        out = _apply(raw, self._start, end, items, self._acting, "output", self._counts,
                     lambda item: f"[{_LABELS[item.entity]}]")
        keep = max(0, end - LOOKBEHIND)
        self._raw, self._start = raw[keep:], end - keep
        return out

    def _restore(self, text: str, final: bool) -> str:
        if not self._placeholders:
            return text
        text = self._unrestored + text
        cut = len(text)
        # placeholders are "[" ... "]" with no other bracket, so only the tail from the last
        # "[" can be an unfinished one, and no two can overlap
        bracket = text.rfind("[")
        if not final and bracket >= 0:
            tail = text[bracket:]
            if any(p.startswith(tail) and p != tail for p in self._placeholders):
                cut = bracket
        self._unrestored = text[cut:]
        return _PLACEHOLDER.sub(lambda m: self._placeholders.get(m.group(), m.group()),
                                text[:cut])
