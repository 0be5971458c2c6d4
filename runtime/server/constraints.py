"""What a request constrains its output to, read from whichever field it used:

    response_format      {"type": "text" | "json_object"} or {"type": "json_schema",
                         "json_schema": {"name", "schema", "strict"}}      (OpenAI)
    structured_outputs   {"json": SCHEMA | "regex": R | "choice": [...] | "grammar": G |
                         "json_object": true}                               (vLLM)
    guided_json / guided_regex / guided_choice / guided_grammar             (vLLM, older)

At most one of them; anything malformed is a 400 naming the field. Compilation happens
in `compile_constraint`, off the event loop and the engine loop, so a request with a new
schema is checked (400 when it does not compile) before it is admitted, and the engine
finds its grammar compiled.
"""

from __future__ import annotations

from ..structured.compiler import CompiledGrammar, GrammarCompiler
from ..structured.spec import GrammarError, GrammarSpec
from .errors import ApiError, bad_request

_STRUCTURED_KEYS = {"json": GrammarSpec.json_schema, "regex": GrammarSpec.regex,
                    "choice": GrammarSpec.choice, "grammar": GrammarSpec.grammar}
_GUIDED = (("guided_json", GrammarSpec.json_schema), ("guided_regex", GrammarSpec.regex),
           ("guided_choice", GrammarSpec.choice), ("guided_grammar", GrammarSpec.grammar))


def _spec_error(e: GrammarError, field: str) -> ApiError:
    return ApiError(400, f"{field}: {e}", param=e.param or field, code="invalid_grammar")


def _response_format(rf: dict) -> GrammarSpec | None:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise bad_request("response_format json_schema needs {\"json_schema\": {\"name\": "
                              "..., \"schema\": {...}}}.", "response_format.json_schema")
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_request("response_format.json_schema.name must be a string.",
                              "response_format.json_schema.name")
        strict = js.get("strict", False)
        if not isinstance(strict, (bool, type(None))):
            raise bad_request("response_format.json_schema.strict must be true or false.",
                              "response_format.json_schema.strict")
        try:
            return GrammarSpec.json_schema(js["schema"], strict=True)
        except GrammarError as e:
            raise _spec_error(e, "response_format.json_schema.schema") from None
    raise bad_request(f"response_format type {kind!r} is not supported; send 'text', "
                      f"'json_object' or 'json_schema'.", "response_format.type")


def grammar_for(req) -> tuple[GrammarSpec | None, str]:
    """The request's output constraint (None: free text) and the field it came from (what
    a compile error names)."""
    given = [name for name in ("response_format", "structured_outputs") + tuple(
        n for n, _ in _GUIDED) if getattr(req, name, None) is not None]
    if isinstance(getattr(req, "response_format", None), dict) and \
            req.response_format.get("type") in (None, "text"):
        given.remove("response_format")  # plain text: no constraint to combine
    if len(given) > 1:
        raise bad_request(f"give one output constraint, not {len(given)} "
                          f"({', '.join(given)}).", given[1])
    if not given:
        return None, "response_format"
    field = given[0]
    value = getattr(req, field)
    try:
        if field == "response_format":
            return _response_format(value), field
        if field == "structured_outputs":
            return _structured_outputs(value), field
        return dict(_GUIDED)[field](value), field
    except GrammarError as e:
        raise _spec_error(e, field) from None


def _structured_outputs(so: dict) -> GrammarSpec:
    keys = [k for k, v in so.items() if v is not None and v is not False]
    known = set(_STRUCTURED_KEYS) | {"json_object"}
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise bad_request(f"structured_outputs.{unknown[0]} is not served; use one of "
                          f"{', '.join(sorted(known))}.", f"structured_outputs.{unknown[0]}")
    if len(keys) != 1:
        raise bad_request(f"structured_outputs needs exactly one of {', '.join(sorted(known))}"
                          f", got {len(keys)}.", "structured_outputs")
    key = keys[0]
    if key == "json_object":
        return GrammarSpec.json_object()
    try:
        return _STRUCTURED_KEYS[key](so[key])
    except GrammarError as e:
        raise _spec_error(e, f"structured_outputs.{key}") from None


async def compile_constraint(compiler: GrammarCompiler, spec: GrammarSpec | None,
                             field: str) -> CompiledGrammar | None:
    """Compile `spec` in the compiler's thread (a cache hit returns at once); a spec that
    does not compile is a 400 naming `field`."""
    if spec is None:
        return None
    try:
        return await compiler.compile_async(spec)
    except GrammarError as e:
        raise _spec_error(e, field) from None
