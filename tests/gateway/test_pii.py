"""PII detection: exact spans per entity, the classic look-alikes that are not PII, overlaps,
and what an unfinished text holds back."""

import random

import pytest

from qserve.runtime.gateway.pii import ENTITIES, PiiMatch, find_pii, find_settled_pii


def spans(text, **kw):
    return [(m.entity, m.text) for m in find_pii(text, **kw)]


@pytest.mark.parametrize("text, entity, item", [
    ("mail bob.smith+tag@mail.example.co.uk today", "email", "bob.smith+tag@mail.example.co.uk"),
    ("write to first_last@example.com.", "email", "first_last@example.com"),
    ("call (415) 555-0123 now", "phone", "(415) 555-0123"),
    ("call 415.555.0123 now", "phone", "415.555.0123"),
    ("call +1 415 555 0123 now", "phone", "+1 415 555 0123"),
    ("ring +44 20 7946 0958, thanks", "phone", "+44 20 7946 0958"),
    ("Tel +49 (0)30 1234567", "phone", "+49 (0)30 1234567"),
    ("toll free 1-800-555-0199.", "phone", "1-800-555-0199"),
    ("card 4111 1111 1111 1111 exp 12/29", "card", "4111 1111 1111 1111"),
    ("card 4111-1111-1111-1111", "card", "4111-1111-1111-1111"),
    ("card 5500000000000004;", "card", "5500000000000004"),
    ("Amex 3782 822463 10005 ok", "card", "3782 822463 10005"),
    ("pay DE89 3704 0044 0532 0130 00 BIC COBADEFFXXX", "iban", "DE89 3704 0044 0532 0130 00"),
    ("pay GB82WEST12345698765432.", "iban", "GB82WEST12345698765432"),
    ("pay FR14 2004 1010 0505 0001 3M02 606", "iban", "FR14 2004 1010 0505 0001 3M02 606"),
    ("host 192.168.1.1.", "ip", "192.168.1.1"),
    ("host 127.0.0.1:8080", "ip", "127.0.0.1"),
    ("host 2001:db8::8a2e:370:7334 up", "ip", "2001:db8::8a2e:370:7334"),
    ("mapped ::ffff:192.0.2.1 here", "ip", "::ffff:192.0.2.1"),
    ("loopback ::1: local", "ip", "::1"),
    ("SSN 123-45-6789.", "national_id", "123-45-6789"),
    ("CPF 390.533.447-05", "national_id", "390.533.447-05"),
    ("DNI 12345678Z", "national_id", "12345678Z"),
    ("NIE X1234567L", "national_id", "X1234567L"),
    ("CF RSSMRA85T10A562S", "national_id", "RSSMRA85T10A562S"),
])
def test_each_entity_with_its_span(text, entity, item):
    start = text.index(item)
    assert find_pii(text) == [PiiMatch(entity, start, start + len(item), item)]


@pytest.mark.parametrize("text", [
    "card 4111 1111 1111 1112",             # 16 digits that fail Luhn
    "ref 4111111111111112",
    "zeros 0000 0000 0000 0000",            # Luhn-valid, but no issuer starts with 0
    "pay DE88 3704 0044 0532 0130 00",      # IBAN with a wrong check digit
    "pay DE89 3704 0044 0532 0130 0",       # one digit short for Germany
    "host 999.1.1.1",                       # octet over 255
    "host 01.2.3.4",                        # leading zero
    "build v1.2.3.4",                       # glued to a word
    "parts 1.2.3.4.5",                      # a fifth part
    "at 10:30:45",                          # a time, not IPv6
    "C++ Bad::Add and std::vector",
    "MAC 00:1A:2B:3C:4D:5E",
    "on 2024-01-15",                        # dates and order numbers are no phones
    "on 12/25/2024",
    "order #123456789",
    "at 2012-01-02 08:00",
    "pi 3.14159265358979",
    "call 4155550123x",                     # glued to a word
    "SSN 000-12-3456, 666-12-3456, 078-05-1120",  # impossible or advertised SSNs
    "CPF 111.111.111-11",
    "DNI 12345678A",                        # wrong check letter
    "ISBN 978-3-16-148410-0",
    "mail bob@localhost or x@y.c",
    "email josé@example.com",               # non-ASCII local part: not detected
])
def test_look_alikes_are_not_pii(text):
    assert find_pii(text) == []


def test_dotted_four_part_version_is_an_ip():
    # indistinguishable from an address; documented in the module
    assert spans("version 1.2.3.4 released") == [("ip", "1.2.3.4")]


def test_region_reads_national_numbers():
    assert spans("call 020 7946 0958", region="GB") == [("phone", "020 7946 0958")]
    assert spans("call 020 7946 0958") == []  # not a US number
    assert spans("call +44 20 7946 0958") == [("phone", "+44 20 7946 0958")]


def test_several_items_sorted_and_exact():
    text = "mail bob@example.com or call +1 415 555 0123, card 4111111111111111"
    assert find_pii(text) == [
        PiiMatch("email", 5, 20, "bob@example.com"),
        PiiMatch("phone", 29, 44, "+1 415 555 0123"),
        PiiMatch("card", 51, 67, "4111111111111111"),
    ]


def test_overlaps_prefer_the_longer_then_the_more_specific():
    # an SSN-shaped local part belongs to the e-mail address
    assert spans("to 123-45-6789@example.com") == [("email", "123-45-6789@example.com")]
    # a card number is never reported as a phone number, even when only phones are asked for
    assert spans("4111 1111 1111 1111") == [("card", "4111 1111 1111 1111")]
    assert find_pii("4111 1111 1111 1111", ["phone"]) == []
    # a failed candidate does not hide a card that starts inside it
    assert spans("415 555 0123 4111 1111 1111 1111") == [("card", "4111 1111 1111 1111")]


def test_entities_filter_and_unknown_entity():
    text = "bob@example.com 192.168.1.1"
    assert spans(text, entities=["ip"]) == [("ip", "192.168.1.1")]
    with pytest.raises(ValueError, match="'emial'"):
        find_pii(text, ["emial"])
    with pytest.raises(ValueError, match="region"):
        find_pii(text, region="XX")
    assert set(ENTITIES) == {"email", "phone", "card", "iban", "ip", "national_id"}


def test_unicode_offsets_are_code_points():
    text = "Tél. 😀 : +33 1 23 45 67 89 — écrivez à marie@exemple.fr"
    found = find_pii(text)
    assert [(m.entity, text[m.start:m.end]) for m in found] == [
        ("phone", "+33 1 23 45 67 89"), ("email", "marie@exemple.fr")]
    assert spans("＋１ ４１５ ５５５ ０１２３") == [("phone", "＋１ ４１５ ５５５ ０１２３")]


@pytest.mark.parametrize("text, held", [
    ("Hello world. ", ""),
    ("Total: 42\n", ""),
    ("Hello world", "world"),                 # may become world@example.com
    ("write to bob@", "bob@"),
    ("call me at +1 415", "+1 415"),
    ("I am 25. ", "25. "),                   # numbers come in space-separated groups
    ("see 10.0.0.1", "10.0.0.1"),
    ("pay to DE89 3704", "DE89 3704"),
    ("at 2012-01-02 08:", "2012-01-02 08:"),  # ":00" would make it a timestamp
    ("dial 415.555.0123:", "415.555.0123:"),
    ("dial ＋１ ４１５ ５５５ ０１２３:", "＋１ ４１５ ５５５ ０１２３:"),
    ("HELLO WORLD ", ""),                     # capitals that cannot start an IBAN
    ("x" * 70, ""),                           # too long to be an e-mail's local part
])
def test_held_tail_is_exact(text, held):
    end, found = find_settled_pii(text)
    assert text[end:] == held
    assert found == []


def test_settled_items_and_long_runs():
    end, found = find_settled_pii("mail bob@example.com or call")
    assert end == len("mail bob@example.com or ")
    assert [m.text for m in found] == ["bob@example.com"]
    # an item is not settled while the text still runs on from it
    end, found = find_settled_pii("card 4111111111111111")
    assert (end, found) == (5, [])
    # a long run of number groups is held only about one phone number's length
    text = "1234 " * 40
    end, _ = find_settled_pii(text)
    assert 0 < len(text) - end <= 100
    assert find_settled_pii(text, final=True)[0] == len(text)


PIECES = ["bob@example.com", "+1 415 555 0123", "(415) 555-0123", "4111 1111 1111 1111",
          "$4111111111111111", "DE89 3704 0044 0532 0130 00", "192.168.1.1", "fe80::1",
          "123-45-6789", "390.533.447-05", "X1234567L", "RSSMRA85T10A562S", ":00", "@"]


def random_text(rng):
    """Text with long runs of the characters items are made of, and items among them."""
    runs = [
        lambda: rng.choice(" -./()").join(str(rng.randint(0, 9999)) for _ in range(30)),
        lambda: rng.choice([" - ", ". ", ") (", " "]).join(str(rng.randint(0, 99))
                                                           for _ in range(30)),
        lambda: "".join(rng.choice("abc.-_%+1@") for _ in range(rng.randint(10, 90))),
        lambda: "".join(rng.choice("0123456789 ") for _ in range(rng.randint(10, 90))),
        lambda: ":".join(rng.choice(["fe80", "1", "", "db8", "ab"]) for _ in range(30)),
        lambda: "".join(rng.choice("ABDEGX0123456789 ") for _ in range(rng.randint(10, 90))),
        lambda: ".".join(str(rng.randint(0, 300)) for _ in range(30)),
        lambda: rng.choice(PIECES),
        lambda: rng.choice([" ", ", ", "\n", " and "]),
    ]
    return "".join(rng.choice(runs)() for _ in range(rng.randint(1, 4)))


def test_settled_items_are_final_whatever_follows():
    rng = random.Random(1)
    for _ in range(150):
        text = random_text(rng)
        end, settled = find_settled_pii(text)
        for _ in range(3):
            more = text + random_text(rng)
            assert [m for m in find_pii(more) if m.start < end] == settled, (text, more)
            assert all(m.end <= end for m in find_pii(more) if m.start < end)
