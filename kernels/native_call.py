"""Keyword calls of C entry points in a wrapper's code, made positional once, at import.

    @keyword_calls("rms_norm_cpu")
    def rms_norm_bf16(x, weight, eps, kind):
        ...
        _library().qserve_rms_norm_bf16(x=rows.data_ptr(), rows=rows.shape[0], ...)

Inside the decorated function, a call of a `qserve_*` entry point of the library (any
`<expr>.qserve_name(...)`) names every argument as the C source names its parameter
(c_source.Signature). The decorator compiles the function again from its source with
each such call's arguments moved into the C order and passed positionally: a call then
costs what a positional ctypes call costs (a keyword call of a Python function with ~20
arguments costs more than the ctypes call itself), and a C function whose parameters are
reordered or renamed moves or refuses the arguments instead of receiving them in the
wrong places. A name the C function does not have, a parameter left out, or a positional
argument is a TypeError at import, naming it and the function's line.

The arguments are evaluated in the C order rather than the order they are written (the
wrappers pass expressions without side effects). The function is compiled in its own
module's globals, with its file and line numbers, so tracebacks point at its source.
"""

from __future__ import annotations

import __future__

import ast
import inspect
import textwrap
from typing import Callable, Mapping, TypeVar

from .c_source import Signature, library_signatures

F = TypeVar("F", bound=Callable)
_FUTURE_FLAGS = __future__.annotations.compiler_flag


class _Positional(ast.NodeTransformer):
    """Rewrites the keyword calls of `signatures`' entry points to positional ones."""

    def __init__(self, signatures: Mapping[str, Signature], where: str, first_line: int):
        self.signatures, self.where, self.first_line = signatures, where, first_line
        self.calls = 0

    def visit_Call(self, node: ast.Call) -> ast.Call:
        self.generic_visit(node)
        name = node.func.attr if isinstance(node.func, ast.Attribute) else ""
        if not name.startswith("qserve_") or not (node.args or node.keywords):
            return node
        at = f"{self.where}:{node.lineno + self.first_line - 1}"
        signature = self.signatures.get(name)
        if signature is None:
            raise TypeError(f"{at}: {name} is not an entry point of this library "
                            f"({', '.join(sorted(self.signatures))}).")
        if node.args or any(k.arg is None for k in node.keywords):
            raise TypeError(f"{at}: pass every argument of {name} by its C parameter name.")
        try:
            node.args = list(signature.order({k.arg: k.value for k in node.keywords}))
        except TypeError as exc:
            raise TypeError(f"{at}: {exc}") from None
        node.keywords = []
        self.calls += 1
        return node


def positional(func: F, signatures: Mapping[str, Signature]) -> F:
    """`func` compiled again with its keyword calls of `signatures`' entry points passed
    positionally in the C order."""
    code = func.__code__
    if code.co_freevars:
        raise TypeError(f"{func.__qualname__}: keyword_calls takes module-level functions "
                        f"(this one closes over {', '.join(code.co_freevars)}).")
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except OSError as exc:
        raise RuntimeError(f"{func.__qualname__}: keyword_calls compiles the function from "
                           f"its module's source, which cannot be read ({exc}).") from exc
    definition = tree.body[0]
    definition.decorator_list = []  # the decorators run on the original only
    rewrite = _Positional(signatures, code.co_filename, code.co_firstlineno)
    rewrite.visit(tree)
    if not rewrite.calls:
        raise TypeError(f"{func.__qualname__} makes no keyword call of "
                        f"{', '.join(sorted(signatures))}.")
    ast.increment_lineno(tree, code.co_firstlineno - 1)
    compiled = compile(tree, code.co_filename, "exec", dont_inherit=True,
                       flags=code.co_flags & _FUTURE_FLAGS)
    namespace: dict = {}
    exec(compiled, func.__globals__, namespace)
    out = namespace[definition.name]
    out.__qualname__ = func.__qualname__
    return out


def keyword_calls(library: str) -> Callable[[F], F]:
    """A decorator: `positional(func, ...)` with the entry points csrc/LIBRARY.c exports."""
    def decorate(func: F) -> F:
        return positional(func, library_signatures(library))
    return decorate


__all__ = ["keyword_calls", "positional"]
