"""What a request constrains its output to: a JSON schema, any JSON object, a regex, one of
several strings, an EBNF / Lark grammar, or a structural tag (tool calls).

A GrammarSpec is small, frozen and hashable; `digest` keys the compile cache, so two
requests with the same schema (whatever the key order of its JSON) share one compiled
grammar. Schemas are checked here, before any compilation: a schema that is not valid
JSON Schema, or that uses a keyword the grammar engine would not enforce, is refused with
a GrammarError naming the keyword and where it is, rather than served with a constraint
that silently does less than the schema says.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")

# Keywords the grammar engine enforces (probed one by one against a violating instance),
# and annotations that constrain nothing. Anything else in a schema is refused.
ENFORCED = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "items",
    "prefixItems", "minItems", "maxItems", "minProperties", "maxProperties",
    "patternProperties", "propertyNames", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern", "format",
    "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "unevaluatedItems",
})
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
    "deprecated", "readOnly", "writeOnly", "discriminator", "contentMediaType",
    "contentEncoding", "$anchor",
})
# keywords whose value is a map of names to schemas / a list of schemas / one schema
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "propertyNames", "unevaluatedItems")
# the most nesting a schema may have (deeper ones are refused, not compiled)
MAX_DEPTH = 64
MAX_SOURCE_CHARS = 256 * 1024


class GrammarError(ValueError):
    """A constraint that cannot be served: invalid, unsupported, or failed to compile.
    The message says what is wrong and how to fix it; `param` names the request field
    (set by whoever knows which field it came from)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    source: str  # canonical text: JSON for schemas, choices and tags; the regex / grammar
    strict: bool = True  # json_schema: no properties beyond those the schema allows

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"unknown constraint kind {self.kind!r}; one of {KINDS}.")
        if not isinstance(self.source, str):
            raise GrammarError(f"a {self.kind} constraint needs its text, got "
                               f"{type(self.source).__name__}.")
        if len(self.source) > MAX_SOURCE_CHARS:
            raise GrammarError(f"the {self.kind} constraint has {len(self.source)} "
                               f"characters, more than {MAX_SOURCE_CHARS}; send a smaller one.")

    @property
    def digest(self) -> str:
        h = hashlib.sha256(f"{self.kind}\x00{int(self.strict)}\x00".encode())
        h.update(self.source.encode("utf-8", "surrogatepass"))
        return h.hexdigest()

    # -- constructors, each validating its input ------------------------------------------
    @classmethod
    def json_schema(cls, schema: Any, strict: bool = True) -> "GrammarSpec":
        """A JSON Schema (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not valid JSON ({e}).") from None
        if isinstance(schema, bool):
            schema = {} if schema else None
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be an object, got "
                               f"{type(schema).__name__}.")
        check_schema(schema)
        return cls("json_schema", _canonical(schema), bool(strict))

    @classmethod
    def json_object(cls) -> "GrammarSpec":
        """Any JSON object (OpenAI's `json_object` response format)."""
        return cls("json_object", '{"type": "object"}', strict=False)

    @classmethod
    def regex(cls, pattern: Any) -> "GrammarSpec":
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError("a regex constraint needs a non-empty pattern string.")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Any) -> "GrammarSpec":
        """Exactly one of these strings."""
        if (not isinstance(options, list) or not options
                or not all(isinstance(o, str) and o for o in options)):
            raise GrammarError("a choice constraint needs a non-empty list of non-empty "
                               "strings.")
        return cls("choice", json.dumps(options, ensure_ascii=False))

    @classmethod
    def grammar(cls, text: Any) -> "GrammarSpec":
        """An EBNF grammar (GBNF style, `root ::= ...`) or a Lark grammar (`start: ...`)."""
        if not isinstance(text, str) or not text.strip():
            raise GrammarError("a grammar constraint needs the grammar's text (EBNF with a "
                               "`root ::= ...` rule, or Lark with `start: ...`).")
        return cls("grammar", text)

    @classmethod
    def structural_tag(cls, tag: dict) -> "GrammarSpec":
        """An xgrammar structural tag (a dict in its JSON form; tool calls use these)."""
        if not isinstance(tag, dict):
            raise GrammarError("a structural tag must be a JSON object.")
        return cls("structural_tag", _canonical(tag))

    def loads(self) -> Any:
        """The JSON value of a schema, choice list or structural tag."""
        return json.loads(self.source)


def _canonical(value: Any) -> str:
    """Compact JSON, keys in the order given: a schema's property order is the order its
    output is written in."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def check_schema(schema: dict) -> None:
    """Raise GrammarError unless `schema` is valid JSON Schema (Draft 2020-12, checked by
    the `jsonschema` package) using only keywords the grammar engine enforces."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise GrammarError(f"the JSON schema is invalid at {where}: {e.message}.") from None
    except RecursionError:
        raise GrammarError(f"the JSON schema nests too deeply (more than {MAX_DEPTH}).") from None
    _check_keywords(schema, "#", 0)


def _check_keywords(node: Any, path: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise GrammarError(f"the JSON schema nests more than {MAX_DEPTH} levels at {path}.")
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise GrammarError(f"the JSON schema has a non-schema value at {path}.")
    for key, value in node.items():
        if key in ANNOTATIONS:
            continue
        if key not in ENFORCED:
            raise GrammarError(
                f"the JSON schema uses '{key}' at {path}, which structured outputs cannot "
                f"enforce; remove it (or express it with enum, anyOf, pattern or bounds). "
                f"Supported keywords: {', '.join(sorted(ENFORCED))}.")
        if key in ("minLength", "maxLength") and ("pattern" in node or "format" in node):
            raise GrammarError(
                f"the JSON schema bounds a string's length ('{key}') beside a "
                f"{'pattern' if 'pattern' in node else 'format'} at {path}; structured "
                f"outputs enforce only the pattern or format there: put the length in a "
                f"pattern instead (e.g. ^[a-z]{{1,20}}$), or drop one of them.")
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise GrammarError(f"the JSON schema combines {len(value)} schemas with allOf at "
                               f"{path}; only a single-entry allOf can be enforced: merge them "
                               f"into one schema.")
        if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise GrammarError(f"the JSON schema refers to {value!r} at {path}; only local "
                               f"references (#/$defs/...) can be resolved.")
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                _check_keywords(sub, f"{path}/{key}/{name}", depth + 1)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                _check_keywords(sub, f"{path}/{key}/{i}", depth + 1)
        elif key in _SCHEMA_ONE:
            _check_keywords(value, f"{path}/{key}", depth + 1)
