"""Guardrails: config validation, mask / block / allow per entity on input and output,
reversible masking, and streaming that equals scanning the whole text at once."""

import random

import pytest

from qserve.runtime.gateway.guardrails import (ACTIONS, GuardrailBlocked, GuardrailConfigError,
                                               GuardrailPolicy, OutputScanner, RequestGuard)
from qserve.runtime.gateway.pii import ENTITIES, find_pii

SAMPLES = {  # entity -> (text, the item in it)
    "email": ("reach me at bob@example.com please", "bob@example.com"),
    "phone": ("reach me at +1 415 555 0123 please", "+1 415 555 0123"),
    "card": ("my card is 4111 1111 1111 1111 thanks", "4111 1111 1111 1111"),
    "iban": ("send it to DE89 3704 0044 0532 0130 00 today", "DE89 3704 0044 0532 0130 00"),
    "ip": ("the server is 192.168.1.10 here", "192.168.1.10"),
    "national_id": ("my SSN is 123-45-6789 ok", "123-45-6789"),
}
LABELS = {"email": "[EMAIL]", "phone": "[PHONE]", "card": "[CARD]", "iban": "[IBAN]",
          "ip": "[IP]", "national_id": "[NATIONAL_ID]"}
ALL_MASK = {entity: "mask" for entity in ENTITIES}


def guard(input=None, output=None, **kw):
    return RequestGuard(GuardrailPolicy(input or {}, output or {}, **kw))


def stream(scanner, chunks):
    return "".join(scanner.feed(chunk) for chunk in chunks) + scanner.flush()


def reference_mask(text):
    """Masking computed from find_pii directly, independent of the scanner."""
    out, last = [], 0
    for m in find_pii(text):
        out += [text[last:m.start], LABELS[m.entity]]
        last = m.end
    return "".join(out + [text[last:]])


# --- configuration -------------------------------------------------------------------------

def test_from_config_reads_a_full_section():
    policy = GuardrailPolicy.from_config({"input": {"email": "mask", "card": "block"},
                                          "output": {"card": "mask", "ip": "allow"},
                                          "reversible": True, "region": "gb"})
    assert dict(policy.input) == {"email": "mask", "card": "block"}
    assert dict(policy.output) == {"card": "mask", "ip": "allow"}
    assert (policy.reversible, policy.region) == (True, "GB")
    empty = GuardrailPolicy.from_config({"input": None})
    assert (dict(empty.input), dict(empty.output), empty.reversible, empty.region) == (
        {}, {}, False, "US")
    with pytest.raises(TypeError):
        policy.input["phone"] = "mask"
    assert ACTIONS == ("mask", "block", "allow")


@pytest.mark.parametrize("raw, message", [
    ({"input": {"emial": "mask"}},
     "guardrails.input.emial: unknown entity; expected one of email, phone, card, iban, ip, "
     "national_id"),
    ({"output": {"card": "hide"}},
     "guardrails.output.card: unknown action 'hide'; expected one of mask, block, allow"),
    ({"output": {"card": None}}, "guardrails.output.card: unknown action None"),
    ({"inputs": {}}, "guardrails.inputs: unknown key; expected one of input, output, "
                     "reversible, region"),
    ({"input": ["email"]}, "guardrails.input: expected a mapping of entity to action"),
    ({"reversible": "yes"}, "guardrails.reversible: expected true or false, got 'yes'"),
    ({"region": "XX"}, "guardrails.region: unknown region 'XX'"),
    ({"region": 1}, "guardrails.region: unknown region 1"),
    (["input"], "guardrails: expected a mapping"),
])
def test_config_errors_name_the_key(raw, message):
    with pytest.raises(GuardrailConfigError) as err:
        GuardrailPolicy.from_config(raw)
    assert str(err.value).startswith(message)
    assert isinstance(err.value, ValueError)


def test_config_error_path_starts_at_where():
    with pytest.raises(GuardrailConfigError, match=r"^gateway\.pii\.input\.emial: "):
        GuardrailPolicy.from_config({"input": {"emial": "mask"}}, where="gateway.pii")


def test_direct_construction_is_validated_too():
    with pytest.raises(GuardrailConfigError, match=r"^input\.emial: unknown entity"):
        GuardrailPolicy({"emial": "mask"}, {})
    with pytest.raises(GuardrailConfigError, match=r"^region: "):
        GuardrailPolicy({}, {}, region="Narnia")


# --- input -------------------------------------------------------------------------------

@pytest.mark.parametrize("entity", ENTITIES)
def test_input_mask(entity):
    text, item = SAMPLES[entity]
    g = guard(input={entity: "mask"})
    assert g.check_input(text) == text.replace(item, LABELS[entity])
    assert g.actions == {f"input.{entity}.mask": 1}


@pytest.mark.parametrize("entity", ENTITIES)
def test_input_block_names_the_entity_never_the_value(entity):
    text, item = SAMPLES[entity]
    g = guard(input={entity: "block"})
    with pytest.raises(GuardrailBlocked) as err:
        g.check_input(text)
    assert (err.value.entity, err.value.direction) == (entity, "input")
    assert f"'{entity}'" in str(err.value) and "request" in str(err.value)
    assert item not in str(err.value)
    assert item.replace(" ", "") not in str(err.value).replace(" ", "")
    assert g.actions == {f"input.{entity}.block": 1}


@pytest.mark.parametrize("entity", ENTITIES)
def test_input_allow_and_unlisted_pass_through(entity):
    text, _ = SAMPLES[entity]
    assert guard(input={entity: "allow"}).check_input(text) == text
    others = {e: "block" for e in ENTITIES if e != entity}
    g = guard(input=others)
    assert g.check_input(text) == text
    assert g.actions == {}


def test_a_blocked_request_masks_nothing():
    g = guard(input={"email": "mask", "card": "block"}, reversible=True)
    with pytest.raises(GuardrailBlocked, match="'card'"):
        g.check_input("a@x.com and 4111 1111 1111 1111")
    assert g.actions == {"input.card.block": 1}
    assert g.check_input("b@x.com") == "[EMAIL_1]"


def test_an_allowed_card_is_not_masked_as_a_phone():
    text = "card 4111 1111 1111 1111"
    assert guard(input={"phone": "mask", "card": "allow"}).check_input(text) == text


def test_text_that_is_not_pii_stays_byte_identical():
    text = "Ünïcödé\u00a0text\r\n\twith  spaces, e\u0301, 😀 and 42 — ok [x] (y)"
    assert guard(input=ALL_MASK).check_input(text) == text
    assert stream(guard(output=ALL_MASK).output_scanner(), list(text)) == text
    masked = guard(input=ALL_MASK).check_input("é😀 bob@example.com\u00a0 😀")
    assert masked == "é😀 [EMAIL]\u00a0 😀"


# --- reversible masking ----------------------------------------------------------------------

def test_reversible_placeholders_per_value():
    g = guard(input={"email": "mask", "phone": "mask"}, reversible=True)
    assert g.check_input("a@x.com, b@x.com, a@x.com, +1 415 555 0123") == \
        "[EMAIL_1], [EMAIL_2], [EMAIL_1], [PHONE_1]"
    assert g.check_input("again b@x.com") == "again [EMAIL_2]"  # a later message
    assert g.actions == {"input.email.mask": 4, "input.phone.mask": 1}


def test_reversible_restores_values_in_the_response():
    g = guard(input={"email": "mask", "phone": "mask"}, reversible=True)
    g.check_input("I am a@x.com, call +1 415 555 0123, cc b@x.com")
    reply = "Sure [EMAIL_1], I will call [PHONE_1] and not [EMAIL_9] or [EMAIL]."
    expected = "Sure a@x.com, I will call +1 415 555 0123 and not [EMAIL_9] or [EMAIL]."
    scanner = g.output_scanner()
    assert scanner.feed(reply) + scanner.flush() == expected
    for i in range(len(reply) + 1):  # a placeholder split anywhere
        assert stream(g.output_scanner(), [reply[:i], reply[i:]]) == expected
    assert stream(g.output_scanner(), list(reply)) == expected


def test_reversible_holds_an_unfinished_placeholder():
    for output in ({}, ALL_MASK):
        g = guard(input={"email": "mask"}, output=output, reversible=True)
        g.check_input("a@x.com")
        scanner = g.output_scanner()
        assert scanner.feed("Write to [EMAIL_") == "Write to "
        assert scanner.feed("1") == ""
        assert scanner.feed("] now") + scanner.flush() == "a@x.com now"
        plain = g.output_scanner()
        assert plain.feed("Write to [EMAIL]. ") == "Write to [EMAIL]. "


def test_restored_values_are_not_masked_again_but_new_pii_is():
    g = guard(input={"email": "mask"}, output={"email": "mask"}, reversible=True)
    g.check_input("me: a@x.com")
    scanner = g.output_scanner()
    assert stream(scanner, ["[EMAIL_1] and c@", "x.com"]) == "a@x.com and [EMAIL]"
    assert g.actions == {"input.email.mask": 1, "output.email.mask": 1}


def test_reversible_skips_placeholders_the_client_wrote():
    g = guard(input={"email": "mask"}, reversible=True)
    assert g.check_input("literal [EMAIL_1] and a@x.com") == "literal [EMAIL_1] and [EMAIL_2]"


def test_plain_masking_restores_nothing():
    g = guard(input={"email": "mask"})
    assert g.check_input("a@x.com") == "[EMAIL]"
    assert stream(g.output_scanner(), ["[EMAIL]", " [EMAIL_1]"]) == "[EMAIL] [EMAIL_1]"


# --- output ------------------------------------------------------------------------------

@pytest.mark.parametrize("entity", ENTITIES)
def test_output_mask_block_allow(entity):
    text, item = SAMPLES[entity]
    g = guard(output={entity: "mask"})
    assert stream(g.output_scanner(), list(text)) == text.replace(item, LABELS[entity])
    assert g.actions == {f"output.{entity}.mask": 1}
    assert stream(guard(output={entity: "allow"}).output_scanner(), list(text)) == text

    g = guard(output={entity: "block"})
    scanner = g.output_scanner()
    sent = ""
    with pytest.raises(GuardrailBlocked) as err:
        for ch in text:
            sent += scanner.feed(ch)
        sent += scanner.flush()
    assert (err.value.entity, err.value.direction) == (entity, "output")
    assert item not in str(err.value) and f"'{entity}'" in str(err.value)
    assert text.startswith(sent) and len(sent) <= text.index(item)  # the item never left
    assert g.actions == {f"output.{entity}.block": 1}
    with pytest.raises(GuardrailBlocked):  # the scanner stays closed
        scanner.feed("more")
    with pytest.raises(GuardrailBlocked):
        scanner.flush()


def test_block_at_the_end_of_the_stream():
    scanner = guard(output={"card": "block"}).output_scanner()
    assert scanner.feed("card 4111111111111111") == "card "
    with pytest.raises(GuardrailBlocked, match="payment card"):
        scanner.flush()


def test_without_output_rules_nothing_is_held():
    scanner = guard(input=ALL_MASK).output_scanner()
    assert scanner.feed("write to bob@") == "write to bob@"


@pytest.mark.parametrize("chunks, sent", [
    (["Hello world. "], ["Hello world. "]),
    (["call me at +1 415"], ["call me at "]),
    (["write to bob@"], ["write to "]),
    (["write to bob@", "example.com "], ["write to ", "[EMAIL] "]),
    (["call +1 415", " 555 0123", "\n"], ["call ", "", "[PHONE]\n"]),
    (["I am 25. ", "Years"], ["I am ", "25. "]),
    (["host 10.0.0", ".1 up"], ["host ", "[IP] "]),
])
def test_scanner_holds_the_shortest_tail(chunks, sent):
    scanner = guard(output=ALL_MASK).output_scanner()
    assert [scanner.feed(chunk) for chunk in chunks] == sent


# --- streaming equals one pass ----------------------------------------------------------------

TEXTS = [
    "Contact bob@example.com or +1 415 555 0123 today. ",
    "Card 4111 1111 1111 1111 123, exp 12/29; IBAN DE89 3704 0044 0532 0130 00 BIC COBADEFFXXX",
    "Servers 192.168.1.1, fe80::1 and ::ffff:192.0.2.1. Version 1.2.3.4.5, v1.2.3.4, 999.1.1.1",
    "SSN 123-45-6789, CPF 390.533.447-05, DNI 12345678Z, NIE X1234567L, CF RSSMRA85T10A562S.",
    "On 2024-01-15 at 2012-01-02 08:00 order #123456789 and 4111111111111112 shipped",
    "Tél. 😀 : +33 1 23 45 67 89 — écrivez à marie@exemple.fr",
    "(415) 555-0123/650-253-0000 and 415 555 0123 4111 1111 1111 1111",
    "write to first.last@sub.example.co.uk.\nor a.b@c.io",
    "numbers 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 4111111111111111",
    "x" * 60 + "@example.com " + "y" * 70 + "@example.org",
    "paid with $4111 1111 1111 1111, dial 415.555.0123:00 or 415.555.0123: now",
    "[EMAIL_1] wrote to [PHONE_1] at [EMAIL_2 and [EMAIL_2]",
]


def reversible_guard():
    g = guard(input={"email": "mask", "phone": "mask"}, output=ALL_MASK, reversible=True)
    g.check_input("a@x.com b@x.com +1 650 253 0000")
    return g


@pytest.mark.parametrize("text", TEXTS)
def test_any_chunking_equals_one_pass(text):
    one_pass = stream(reversible_guard().output_scanner(), [text])
    plain = stream(guard(output=ALL_MASK).output_scanner(), [text])
    assert plain == reference_mask(text)
    rng = random.Random(text)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(1, 8)))
        splits.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    for chunks in splits:
        g = reversible_guard()
        assert stream(g.output_scanner(), chunks) == one_pass, chunks
        assert stream(guard(output=ALL_MASK).output_scanner(), chunks) == plain, chunks


def test_one_pass_masks_and_restores():
    # what the chunking test compares against is itself right
    assert stream(reversible_guard().output_scanner(), [TEXTS[0]]) == \
        "Contact [EMAIL] or [PHONE] today. "
    assert stream(reversible_guard().output_scanner(), [TEXTS[-1]]) == \
        "a@x.com wrote to +1 650 253 0000 at [EMAIL_2 and b@x.com"


def test_blocking_is_the_same_however_split():
    text = "fine text, then card 4111 1111 1111 1111 and more"
    for i in range(len(text) + 1):
        g = guard(output={"card": "block", "email": "mask"})
        with pytest.raises(GuardrailBlocked):
            stream(g.output_scanner(), [text[:i], text[i:]])
        assert g.actions == {"output.card.block": 1}
    clean = "fine text, card 4111 1111 1111 1112 is no card"
    for i in range(len(clean) + 1):
        assert stream(guard(output={"card": "block"}).output_scanner(),
                      [clean[:i], clean[i:]]) == clean


def test_counts_are_the_same_however_split():
    text = TEXTS[0] + TEXTS[3]
    whole = guard(output=ALL_MASK)
    stream(whole.output_scanner(), [text])
    pieces = guard(output=ALL_MASK)
    stream(pieces.output_scanner(), list(text))
    assert whole.actions == pieces.actions == {
        "output.email.mask": 1, "output.phone.mask": 1, "output.national_id.mask": 5}


def test_scanner_alone_defaults():
    scanner = OutputScanner({"email": "mask"})
    assert scanner.feed("to bob@example.com") + scanner.flush() == "to [EMAIL]"
    assert scanner.flush() == ""
