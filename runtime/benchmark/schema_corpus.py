"""A corpus of JSON schemas with a request for each, for the structured-output benchmark
and tests: objects, arrays, enums, nested objects, numbers with bounds, required and
optional properties, anyOf, string patterns and formats, $defs references.

    for case in CORPUS: case.name, case.prompt, case.schema
"""

from __future__ import annotations

from typing import NamedTuple


class SchemaCase(NamedTuple):
    name: str
    prompt: str  # what to ask the model for (chat user message, or a completion prompt)
    schema: dict


def _obj(props: dict, required=None, **kw) -> dict:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required, **kw}


_STR = {"type": "string", "maxLength": 60}
# an email address of bounded length (format "email" bounds nothing: a small model can
# write its local part until max_tokens, and maxLength beside a format is not enforced)
_EMAIL = {"type": "string", "pattern": "^[a-z0-9._-]{1,24}@[a-z0-9-]{1,24}[.][a-z]{2,6}$"}
CORPUS: tuple[SchemaCase, ...] = (
    SchemaCase("person", "Describe a fictional person: name and age.",
               _obj({"name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    SchemaCase("city", "Give facts about Paris.",
               _obj({"name": _STR, "country": _STR,
                     "population_millions": {"type": "number", "minimum": 0, "maximum": 50}})),
    SchemaCase("boolean_flags", "Is the sky blue and is fire cold?",
               _obj({"sky_is_blue": {"type": "boolean"}, "fire_is_cold": {"type": "boolean"}})),
    SchemaCase("enum_color", "What color is a ripe banana?",
               _obj({"color": {"enum": ["red", "yellow", "green", "blue"]}})),
    SchemaCase("enum_sentiment", "Classify the sentiment of: 'I loved this movie!'",
               _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]},
                     "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    SchemaCase("list_of_strings", "List three fruits.",
               _obj({"fruits": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                "minItems": 3, "maxItems": 3}})),
    SchemaCase("list_of_ints", "Give the first five prime numbers.",
               _obj({"primes": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                           "maximum": 1000},
                                "minItems": 5, "maxItems": 5}})),
    SchemaCase("top_level_array", "Name two planets and their order from the sun.",
               {"type": "array", "minItems": 2, "maxItems": 2,
                "items": _obj({"planet": _STR, "order": {"type": "integer", "minimum": 1,
                                                        "maximum": 8}})}),
    SchemaCase("nested_address", "Give an address for a company in Berlin.",
               _obj({"company": _STR, "address": _obj({"street": _STR, "city": _STR,
                                                       "postcode": {"type": "string",
                                                                    "pattern": "^[0-9]{5}$"}})})),
    SchemaCase("nested_deep", "Describe a library with one book.",
               _obj({"library": _obj({"name": _STR, "books": {"type": "array", "maxItems": 1,
                     "minItems": 1, "items": _obj({"title": _STR, "author": _obj(
                         {"first": _STR, "last": _STR})})}})})),
    SchemaCase("optional_fields", "Describe a cat; the nickname is optional.",
               _obj({"name": _STR, "nickname": _STR, "lives": {"type": "integer",
                                                               "minimum": 1, "maximum": 9}},
                    required=["name", "lives"])),
    SchemaCase("all_optional", "Tell me anything about the moon.",
               _obj({"diameter_km": {"type": "number", "minimum": 0, "maximum": 10000},
                     "fact": _STR}, required=[])),
    SchemaCase("any_of_string_or_null", "Who is the king of France? Null if nobody.",
               _obj({"king": {"anyOf": [_STR, {"type": "null"}]}})),
    SchemaCase("any_of_number_or_string", "How tall is Mount Everest?",
               _obj({"height": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 10000},
                                          _STR]}})),
    SchemaCase("type_list", "What is 7 times 6?",
               _obj({"answer": {"type": ["integer", "null"], "minimum": 0, "maximum": 1000}})),
    SchemaCase("const_field", "Produce a version record for API v2.",
               _obj({"api": {"const": "v2"}, "stable": {"type": "boolean"}})),
    SchemaCase("pattern_phone", "Give a made-up US phone number.",
               _obj({"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{3}-[0-9]{4}$"}})),
    SchemaCase("pattern_code", "Give a product code of three letters, a dash, four digits.",
               _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}})),
    SchemaCase("format_date", "When did the first moon landing happen?",
               _obj({"event": _STR, "date": {"type": "string", "format": "date"}})),
    SchemaCase("pattern_email", "Make up a contact with an email address.",
               _obj({"name": _STR, "email": _EMAIL})),
    SchemaCase("format_uuid", "Create a record with a random UUID.",
               _obj({"id": {"type": "string", "format": "uuid"}, "label": _STR})),
    SchemaCase("format_datetime", "When is New Year's midnight 2030 in UTC?",
               _obj({"when": {"type": "string", "format": "date-time"}})),
    SchemaCase("format_ipv4", "Give the IP address of a local router.",
               _obj({"ip": {"type": "string", "format": "ipv4"}})),
    SchemaCase("string_lengths", "Give a short word and a longer sentence.",
               _obj({"word": {"type": "string", "minLength": 2, "maxLength": 10},
                     "sentence": {"type": "string", "minLength": 10, "maxLength": 80}})),
    SchemaCase("integer_bounds_exclusive", "Pick a number strictly between 10 and 20.",
               _obj({"n": {"type": "integer", "exclusiveMinimum": 10,
                           "exclusiveMaximum": 20}})),
    SchemaCase("number_bounds", "What is a normal body temperature in Celsius?",
               _obj({"celsius": {"type": "number", "minimum": 30, "maximum": 45}})),
    SchemaCase("multiple_of", "Pick an even number below 100.",
               _obj({"even": {"type": "integer", "multipleOf": 2, "minimum": 0,
                              "maximum": 98}})),
    SchemaCase("array_of_objects", "List two programming languages and their creators.",
               _obj({"languages": {"type": "array", "minItems": 2, "maxItems": 2,
                                   "items": _obj({"language": _STR, "creator": _STR})}})),
    SchemaCase("tuple_prefix_items", "Give a point as [x, y, label].",
               _obj({"point": {"type": "array", "prefixItems": [
                   {"type": "number", "minimum": -100, "maximum": 100},
                   {"type": "number", "minimum": -100, "maximum": 100}, _STR],
                   "minItems": 3, "maxItems": 3}})),
    SchemaCase("defs_ref", "Describe a parent and a child.",
               {"$defs": {"person": _obj({"name": _STR, "age": {"type": "integer",
                                                              "minimum": 0, "maximum": 120}})},
                "type": "object", "properties": {"parent": {"$ref": "#/$defs/person"},
                                                 "child": {"$ref": "#/$defs/person"}},
                "required": ["parent", "child"]}),
    SchemaCase("one_of_shapes", "Describe a circle of radius 2.",
               _obj({"shape": {"oneOf": [
                   _obj({"kind": {"const": "circle"}, "radius": {"type": "number",
                                                                "minimum": 0, "maximum": 100}}),
                   _obj({"kind": {"const": "square"}, "side": {"type": "number",
                                                              "minimum": 0, "maximum": 100}})]}})),
    SchemaCase("additional_properties_map", "Give the capitals of two countries as a map.",
               {"type": "object", "additionalProperties": _STR, "minProperties": 1,
                "maxProperties": 3}),
    SchemaCase("enum_mixed_types", "Rate this on a scale, or say 'unknown'.",
               _obj({"rating": {"enum": [1, 2, 3, 4, 5, "unknown"]}})),
    SchemaCase("extraction", "Extract from: 'Alice (alice@example.com) ordered 3 lamps on "
               "2024-03-01.'",
               _obj({"customer": _STR, "email": _EMAIL,
                     "quantity": {"type": "integer", "minimum": 0, "maximum": 100},
                     "item": _STR, "date": {"type": "string", "format": "date"}})),
    SchemaCase("recipe", "Give a tiny recipe with two ingredients and two steps.",
               _obj({"title": _STR, "ingredients": {"type": "array", "minItems": 2,
                     "maxItems": 2, "items": _obj({"name": _STR, "grams": {
                         "type": "integer", "minimum": 0, "maximum": 1000}})},
                     "steps": {"type": "array", "items": _STR, "minItems": 2,
                               "maxItems": 2}})),
)


def validate(instance, schema: dict) -> None:
    """Raise jsonschema.ValidationError unless `instance` is valid under `schema`, string
    formats included (Draft 2020-12's format checkers, the RFC 3339 ones among them)."""
    from jsonschema import Draft202012Validator

    Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER
                         ).validate(instance)
