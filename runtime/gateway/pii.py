"""PII detection: e-mail addresses, phone numbers, payment cards, IBANs, IP addresses and
national identity numbers, found in free text with exact character offsets.

    find_pii("mail bob@example.com or call +1 415 555 0123")
    -> [PiiMatch("email", 5, 20, "bob@example.com"), PiiMatch("phone", 29, 44, "+1 415 555 0123")]

How: a conservative regex per format finds *candidate* spans, and a library decides whether a
candidate is the real thing:

- phone: `phonenumbers.PhoneNumberMatcher` (libphonenumber's metadata) at `Leniency.VALID`,
  run on each candidate. Numbers without a country code are read in the default region;
  "+..." numbers in any region.
- card: `stdnum.luhn` (13 to 19 digits, written contiguously or in the usual 4-4-4-4(-3)
  and 4-6-5 groups).
- iban: `stdnum.iban` (ISO 13616: the country's length and format, and mod-97).
- ip: the standard library's `ipaddress` (IPv4 and IPv6).
- national_id: a few formats with a fixed shape that python-stdnum validates cheaply:
  US SSN written 123-45-6789 (`stdnum.us.ssn`: no 000/666/9xx area, no 00 group, no 0000
  serial, not a known advertised number), Brazilian CPF written 123.456.789-09
  (`stdnum.br.cpf`, two check digits), Spanish DNI/NIE (`stdnum.es.dni`, `stdnum.es.nie`,
  a check letter) and Italian codice fiscale (`stdnum.it.codicefiscale`, a check letter).
- email: the regex alone, then the RFC 5321 length limits and label rules.

Why libraries rather than patterns alone: numbering plans change (new area codes, new
lengths, new IBAN countries), and libphonenumber and python-stdnum keep that metadata and
the check-digit algorithms current and tested, offline. A pattern alone cannot tell a card
from an order number (only Luhn can), a phone number from a date or a timestamp
(libphonenumber's VALID leniency rejects those, and numbers whose area code does not exist),
or 999.1.1.1 from an address (`ipaddress` can).

Choices worth knowing:
- "version 1.2.3.4" is an IP address here: any four dotted octets that `ipaddress` accepts
  are, unless glued to a word ("v1.2.3.4") or to a fifth part ("1.2.3.4.5"). Three-part
  versions never are.
- Overlaps between entities are settled by length (the longer match wins, e.g. an e-mail
  address over an SSN-like local part), then by specificity: card, IBAN and national id
  over e-mail, over IP, over phone. Detection always looks for every entity, so asking for
  phone numbers alone never reports one inside a card number.
- Text that is not PII is never touched; offsets are Python string (code point) offsets.

Known gaps: e-mail addresses with a non-ASCII local part or a Unicode (not punycode)
domain, and spelled-out ones ("bob at example dot com"); phone numbers glued to letters
("4155550123x"), vanity numbers ("1-800-FLOWERS"), extensions (the number is masked, " ext.
12" is not), national numbers of another region than the configured one and its IDD prefix
("0044 ..." in region US; "+44 ..." is found), and numbers written right after another
number ("I have 2 415 555 0123": libphonenumber rejects the 11-digit whole); cards in other
groupings; IBANs in lower case; IPv6 addresses without a decimal digit ("dead::beef") and
zone ids; identity numbers of other countries or in other layouts (an SSN without dashes).
A Luhn-valid 16-digit order number is masked as a card, and a valid 10-digit US number as a
phone: nothing tells them apart.

Streaming. `find_settled_pii` answers "which part of this unfinished text is decided?": it
returns an offset up to which the items are final whatever text follows, and those items.
Beyond that offset lies the shortest tail that could still be the beginning of an item, per
format: a trailing run of the characters the format is made of (e-mail: ASCII letters,
digits and `._%+-@`; phone: digits, `+`, brackets and separators, and one trailing colon;
card: digits, spaces, dashes; IBAN: the `CC00` head, then capitals, digits and spaces; IP:
digits and dots, or hex digits, colons and dots; national ids: their own characters),
starting where an item may start and no longer than the longest text the format's pattern
reads; then moved back to the start of any item it would cut. So "Hello world. " holds
nothing, "call me at +1 415" holds "+1 415", "write to bob@" holds "bob@", and "I am 25. "
holds "25. " (numbers are written in space-separated groups, so one followed by a space may
go on). Each pattern reads one character before its match and a bounded number after it,
which makes the answer exact: the settled pieces, concatenated, scan as the whole text does.
"""

from __future__ import annotations

import bisect
import functools
import ipaddress
import re
from dataclasses import dataclass
from typing import Callable, Iterable

import phonenumbers
from phonenumbers import Leniency, PhoneNumberMatcher
from stdnum import iban as std_iban
from stdnum import luhn
from stdnum.br import cpf
from stdnum.es import dni, nie
from stdnum.it import codicefiscale
from stdnum.us import ssn

ENTITIES: tuple[str, ...] = ("email", "phone", "card", "iban", "ip", "national_id")

# overlap tie-break after length: the checksummed formats first, phone numbers last
_RANK = {"card": 0, "iban": 0, "national_id": 0, "email": 1, "ip": 2, "phone": 3}

# every pattern's lookbehind is one character wide: a streaming scan keeps this many
# characters of already-settled text in front of what it still has to decide
LOOKBEHIND = 1


@dataclass(frozen=True)
class PiiMatch:
    """One PII item: its entity (one of ENTITIES) and where it is in the scanned text."""

    entity: str
    start: int
    end: int
    text: str


Spans = list[tuple[int, int]]


@dataclass(frozen=True)
class _Detector:
    """One format: candidate spans, how to validate one, and what an unfinished one can be.

    `candidate` is tried at every position. With `overlapping` its matches may overlap (a
    candidate that fails validation does not hide one starting inside it); without, each
    is consumed whole, for a validator that searches inside a candidate itself. `tail`
    matches, anchored at the end of the text, every suffix that a candidate attempt
    starting there could still read past the end (a superset is safe: it only holds back
    more); `reach` bounds how many characters one attempt reads from where it starts,
    lookaheads included. `validate(candidate, region)` gives the item spans in a candidate.
    """

    entity: str
    candidate: re.Pattern[str]  # the span is its group "cand"
    tail: re.Pattern[str]
    reach: int
    validate: Callable[[str, str], Spans]
    overlapping: bool


def _whole(check: Callable[[str], bool]) -> Callable[[str, str], Spans]:
    return lambda text, region: [(0, len(text))] if check(text) else []


# --- payment cards -------------------------------------------------------------------------

def _card(text: str, region: str) -> Spans:
    """The whole candidate, else its longest prefix ending at a group break (a 4-4-4-4 card
    followed by a 3-digit group reads as one 19-digit candidate)."""
    for end in [len(text)] + [m.start() for m in re.finditer("[ -]", text)][::-1]:
        digits = re.sub("[ -]", "", text[:end])
        # MII 0 is no card issuer; that also keeps zero-padded ids (all Luhn-valid) out
        if 13 <= len(digits) <= 19 and digits[0] != "0" and luhn.is_valid(digits):
            return [(0, end)]
    return []


_CARD = re.compile(
    r"(?<![\w.,\-])"
    r"(?:[0-9]{13,19}"
    r"|[0-9]{4}(?P<s>[ \-])[0-9]{4}(?P=s)[0-9]{4}(?P=s)(?:[0-9]{4}(?P=s)[0-9]{3}|[0-9]{1,4})"
    r"|[0-9]{4}(?P<t>[ \-])[0-9]{6}(?P=t)[0-9]{4,5})"  # 4-6-5 (Amex), 4-6-4 (Diners)
    r"(?![0-9])")


# --- IBAN ----------------------------------------------------------------------------------

def _iban(text: str, region: str) -> Spans:
    """The whole candidate, else its longest prefix ending at a group break ("... 00 BIC")."""
    ends = [len(text)] + [m.start() for m in re.finditer(" ", text)][::-1]
    for end in ends:
        if std_iban.is_valid(text[:end]):
            return [(0, end)]
    return []


_IBAN = re.compile(r"(?<!\w)[A-Z]{2}[0-9]{2}(?: ?[A-Z0-9]){11,30}(?!\w)")


# --- national ids --------------------------------------------------------------------------

def _cpf(text: str) -> bool:
    digits = re.sub(r"[.\-]", "", text)
    # stdnum accepts one digit repeated (111.111.111-11), which is never issued
    return len(set(digits)) > 1 and cpf.is_valid(text)


_SSN = re.compile(r"(?<![\w\-])[0-9]{3}-[0-9]{2}-[0-9]{4}(?![\w\-])")
_CPF = re.compile(r"(?<![\w.\-])[0-9]{3}\.[0-9]{3}\.[0-9]{3}-[0-9]{2}(?![\w\-]|\.[0-9])")
_DNI = re.compile(r"(?<![\w\-])[0-9]{8}-?[A-Z](?![\w\-])")
_NIE = re.compile(r"(?<![\w\-])[XYZ]-?[0-9]{7}-?[A-Z](?![\w\-])")
_OMO = "[0-9LMNPQRSTUV]"  # codice fiscale digits, or the letters that stand in for them
_CF = re.compile(rf"(?<!\w)[A-Z]{{6}}{_OMO}{{2}}[A-Z]{_OMO}{{2}}[A-Z]{_OMO}{{3}}[A-Z](?!\w)")


# --- e-mail --------------------------------------------------------------------------------

_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?")


def _email(text: str, region: str) -> Spans:
    """local@domain, the domain without a trailing '.' or '-' (the end of a sentence)."""
    local, _, domain = text.partition("@")
    domain = domain.rstrip(".-")
    if (local.startswith(".") or local.endswith(".") or ".." in local
            or len(local) + 1 + len(domain) > 254):
        return []
    labels = domain.split(".")
    tld = labels[-1]
    if len(labels) < 2 or not all(_LABEL.fullmatch(label) for label in labels):
        return []
    if not ((tld.isalpha() and len(tld) >= 2) or tld.lower().startswith("xn--")):
        return []
    return [(0, len(local) + 1 + len(domain))]


_EMAIL = re.compile(r"(?<![\w.%+\-@])[A-Za-z0-9_.%+\-]{1,64}@[A-Za-z0-9.\-]{1,253}")


# --- IP addresses --------------------------------------------------------------------------

def _ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)  # octets <= 255, no leading zeros
    except ValueError:
        return False
    return True


def _ipv6(text: str, region: str) -> Spans:
    if text.endswith(":") and not text.endswith("::"):
        text = text[:-1]  # a single colon is punctuation ("::1: loopback")
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return []
    # a decimal digit keeps C++ names ("Bad::Add") and a bare "::" out
    return [(0, len(text))] if any(c.isdigit() for c in text) else []


_IPV4 = re.compile(r"(?<![\w.])[0-9]{1,3}(?:\.[0-9]{1,3}){3}(?!\w|\.[0-9])")
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{1,4}|(?=::))(?::[0-9A-Fa-f]{0,4}){2,7}"
                   r"(?:\.[0-9]{1,3}){0,3}(?![\w:])")


# --- phone numbers -------------------------------------------------------------------------

# separators libphonenumber accepts between digit groups (no line breaks: a number does not
# run across lines), at most three in a row, e.g. ") " or " - "
_SEP = "[ \t\u00a0\u2009\u202f\\-\u2010-\u2015\u2212\uff0d./()\uff08\uff09]"
_PHONE_BODY = rf"(?:[+\uff0b] ?)?[(\uff08]?\d(?:{_SEP}{{0,3}}\d){{5,19}}"  # 6 to 20 digits
_PHONE_LB = r"(?<![\w+\uff0b$\u20ac\u00a3\u00a5%])"  # not glued to a word, an amount, a '+'
# the body as an atomic group (a lookahead and its backreference): a number glued to a
# word ("4155550123x") is no candidate, rather than giving up digits until one fits; nor is
# a date with a time ("2012-01-02 08:00"), which libphonenumber rejects only when it can see
# the ":00" after the candidate
_PHONE = re.compile(rf"{_PHONE_LB}(?=(?P<body>{_PHONE_BODY}))(?P=body)(?!\w|:\d)")


@functools.lru_cache(maxsize=4096)  # a stream rescans the number it is still writing
def _phone_spans(text: str, region: str) -> tuple[tuple[int, int], ...]:
    # VALID: a number the metadata says exists, not a date, a timestamp or a page range.
    # POSSIBLE would take any digit run of a plausible length (order numbers); the
    # grouping levels miss numbers written with unusual spacing, as generated text has.
    return tuple((m.start, m.end)
                 for m in PhoneNumberMatcher(text, region, leniency=Leniency.VALID))


def _phones(text: str, region: str) -> Spans:
    """libphonenumber's matches in one candidate (it looks inside the candidate itself)."""
    return list(_phone_spans(text, region))


def _detector(entity: str, candidate: re.Pattern[str], tail_lookbehind: str, tail: str, *,
              reach: int, validate: Callable[[str, str], Spans],
              overlapping: bool = True) -> _Detector:
    # overlapping: an empty match (a lookahead) at every position where the candidate matches
    wrapped = f"(?=(?P<cand>{candidate.pattern}))" if overlapping else \
        f"(?P<cand>{candidate.pattern})"
    return _Detector(entity, re.compile(wrapped), re.compile(f"{tail_lookbehind}{tail}\\Z"),
                     reach, validate, overlapping)


# tail: the characters an unfinished candidate can consist of, from where one may start.
# reach: the longest candidate plus what its lookahead reads after it.
_DETECTORS: tuple[_Detector, ...] = (
    _detector("card", _CARD, r"(?<![\w.,\-])", r"[0-9][0-9 \-]*",
              reach=19 + 4 + 1, validate=_card),
    _detector("iban", _IBAN, r"(?<!\w)", r"[A-Z](?:[A-Z](?:[0-9](?:[0-9][ A-Z0-9]*)?)?)?",
              reach=4 + 30 * 2 + 1, validate=_iban),
    _detector("national_id", _SSN, r"(?<![\w\-])", r"[0-9][0-9\-]*",
              reach=11 + 1, validate=_whole(ssn.is_valid)),
    _detector("national_id", _CPF, r"(?<![\w.\-])", r"[0-9][0-9.\-]*",
              reach=14 + 2, validate=_whole(_cpf)),
    _detector("national_id", _DNI, r"(?<![\w\-])", r"[0-9][0-9\-]*[A-Z]?",
              reach=10 + 1, validate=_whole(dni.is_valid)),
    _detector("national_id", _NIE, r"(?<![\w\-])", r"[XYZ][0-9\-]*[A-Z]?",
              reach=11 + 1, validate=_whole(nie.is_valid)),
    _detector("national_id", _CF, r"(?<!\w)", r"[A-Z][A-Z0-9]*",
              reach=16 + 1, validate=_whole(codicefiscale.is_valid)),
    _detector("email", _EMAIL, r"(?<![\w.%+\-@])",
              r"[A-Za-z0-9_.%+\-]{1,64}(?:@[A-Za-z0-9.\-]*)?",
              reach=64 + 1 + 253 + 1, validate=_email),
    _detector("ip", _IPV4, r"(?<![\w.])", r"[0-9][0-9.]*",
              reach=15 + 2, validate=_whole(_ipv4)),
    _detector("ip", _IPV6, r"(?<![\w:.])", r"[0-9A-Fa-f:][0-9A-Fa-f:.]*",
              reach=4 + 7 * 5 + 3 * 4 + 1, validate=_ipv6),
    _detector("phone", _PHONE, _PHONE_LB, rf"[+\uff0b(\uff08\d](?:\d|{_SEP})*:?",
              reach=3 + 20 + 19 * 3 + 2, validate=_phones, overlapping=False),
)


def _scan(text: str, start: int, region: str) -> tuple[Spans, list[PiiMatch]]:
    """The spans a settled end must not cut, and the validated items (overlapping ones
    included), from `start` on; characters before it are lookbehind context only.

    Not to be cut: the items, and the candidates of a detector that consumes its candidates
    (a cut inside one would start the next scan somewhere the whole-text scan never tries).
    """
    whole: Spans = []
    items: list[PiiMatch] = []
    for det in _DETECTORS:
        for m in det.candidate.finditer(text, start):
            a, b = m.span("cand")
            if not det.overlapping:
                whole.append((a, b))
            for i, j in det.validate(text[a:b], region):
                items.append(PiiMatch(det.entity, a + i, a + j, text[a + i:a + j]))
    return whole + [(m.start, m.end) for m in items], items


def _resolve(items: list[PiiMatch]) -> list[PiiMatch]:
    """Non-overlapping items, sorted by start: the longer first, then the more specific.

    Greedy in that order, so an item's fate depends only on the items linked to it by
    overlaps: text with no item across a point resolves the same as its two sides apart.
    """
    starts: list[int] = []
    chosen: list[PiiMatch] = []  # sorted by start, non-overlapping
    for item in sorted(items, key=lambda m: (m.start - m.end, _RANK[m.entity], m.start)):
        i = bisect.bisect_left(starts, item.start)
        if i > 0 and chosen[i - 1].end > item.start:
            continue
        if i < len(chosen) and chosen[i].start < item.end:
            continue
        starts.insert(i, item.start)
        chosen.insert(i, item)
    return chosen


def _check_region(region: str) -> None:
    if region not in phonenumbers.SUPPORTED_REGIONS:
        raise ValueError(f"unknown region {region!r}; expected a region code that "
                         "libphonenumber knows, such as US, GB or DE")


def find_settled_pii(text: str, start: int = 0, *, region: str = "US",
                     final: bool = False) -> tuple[int, list[PiiMatch]]:
    """The offset up to which `text` is settled, and the PII items before it.

    `text[:start]` is context that was settled before (only its last LOOKBEHIND characters
    matter); items are looked for from `start` on. With `final` the text is complete and
    everything is settled. Otherwise the settled end is where the shortest tail that could
    still be (the beginning of) an item starts, moved back to the start of any item (or
    phone candidate) it would cut: the items before it, and their spans, are the ones a
    scan of the finished text finds there, whatever comes next.
    """
    _check_region(region)
    whole, items = _scan(text, start, region)
    end = len(text)
    if not final:
        for det in _DETECTORS:
            m = det.tail.search(text, max(start, len(text) - det.reach))
            if m is not None:
                end = min(end, m.start())
        moved = True
        while moved:
            moved = False
            for a, b in whole:
                if a < end < b:
                    end, moved = a, True
    return end, _resolve([m for m in items if m.start < end])


def find_pii(text: str, entities: Iterable[str] = ENTITIES, *,
             region: str = "US") -> list[PiiMatch]:
    """The PII items in `text` of the given entities, sorted by start, non-overlapping.

    `region` is the region for phone numbers written without a country code.
    """
    wanted = set(entities)
    unknown = sorted(wanted - set(ENTITIES))
    if unknown:
        raise ValueError(f"unknown entity {unknown[0]!r}; expected one of "
                         f"{', '.join(ENTITIES)}")
    _, items = find_settled_pii(text, region=region, final=True)
    return [m for m in items if m.entity in wanted]
