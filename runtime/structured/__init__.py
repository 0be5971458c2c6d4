"""Structured outputs: grammar-constrained decoding.

    spec = GrammarSpec.json_schema(schema)          # what a request asks for (spec.py)
    compiled = compiler.compile(spec)               # cached by digest, off the engine loop
    state = GrammarState(compiled)                  # one per request (grammar_state.py)
    state.fill(bitmask, row); state.accept(token)   # the sampler masks, the engine advances

The grammar engine is xgrammar (docs/structured-outputs.md says why).
"""

from .spec import GrammarSpec, GrammarError  # noqa: F401
