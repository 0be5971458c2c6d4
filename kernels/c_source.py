"""What a C source of kernels/csrc declares to Python: the signature of each exported entry
point and the constants of its enums and #defines.

    sigs = library_signatures("paged_attention_cpu")   # {"qserve_gather_context": Signature, ...}
    sigs["qserve_gather_context"].names                # ("pool", "kind", "bs", ...)
    sigs["qserve_gather_context"].order({"pool": p, ...})   # the values in the C order
    enum_constants(read("step_program_cpu"), "OP_")    # {"OP_FP8_GEMV": 0, ...}
    define(read("step_program_cpu"), "MAX_ARGS")       # 24

The C prototypes are the one declaration of the interface: native_build binds each entry
point's ctypes argtypes and restype from its Signature, the wrappers' keyword calls
(native_call.py) and the step program's calls (native_step_program.py) are resolved to
positions from its parameter names, and the step program's op numbers are its enum's.
Entry points are the non-static definitions of functions named `qserve_*`; a parameter
is a pointer (any pointee: c_void_p) or one of SCALARS.
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

SOURCE_DIR = Path(__file__).parent / "csrc"

# a non-static definition of a qserve_* function: (return type, name, parameters)
PROTOTYPE = re.compile(r"^(?!static)([A-Za-z_][\w ]*?[\w*])\s*\b(qserve_\w+)\s*\(([^)]*)\)\s*\{",
                       re.M)
SCALARS = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "int": ctypes.c_int,
           "float": ctypes.c_float, "double": ctypes.c_double}
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)


class CSourceError(ValueError):
    """A C source declares something this module cannot read (a parameter type outside
    SCALARS, an unnamed parameter, an enum value that is not a literal)."""


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str  # as the source writes it, e.g. "const uint16_t *"
    kind: type  # the ctypes type it is bound as: c_void_p for every pointer

    @property
    def is_pointer(self) -> bool:
        return self.kind is ctypes.c_void_p


@dataclass(frozen=True)
class Signature:
    name: str  # the entry point, qserve_*
    params: tuple[Param, ...]
    restype: type | None  # None: void

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def argtypes(self) -> list[type]:
        return [p.kind for p in self.params]

    def order(self, named: Mapping[str, Any]) -> tuple:
        """The values of `named` (parameter name -> value) in the C order. TypeError naming
        an unknown or a missing parameter."""
        unknown = [n for n in named if n not in self.names]
        if unknown:
            raise TypeError(f"{self.name} has no parameter {unknown[0]!r}; it takes "
                            f"({', '.join(self.names)}).")
        missing = [n for n in self.names if n not in named]
        if missing:
            raise TypeError(f"{self.name}: missing {', '.join(map(repr, missing))} (it takes "
                            f"({', '.join(self.names)})).")
        return tuple(named[n] for n in self.names)

    def __str__(self) -> str:
        return f"{self.name}({', '.join(p.name for p in self.params)})"


def c_kind(decl: str) -> type | None:
    """A C type (a parameter's without its name, or a return type) as its ctypes type:
    c_void_p for a pointer, None for void."""
    decl = decl.strip()
    if "*" in decl:
        return ctypes.c_void_p
    words = decl.replace("const", " ").split()
    if words == ["void"]:
        return None
    if len(words) != 1 or words[0] not in SCALARS:
        raise CSourceError(f"C type {decl!r} has no ctypes kind here (pointers and "
                           f"{', '.join(SCALARS)}).")
    return SCALARS[words[0]]


def _param(text: str, function: str) -> Param:
    m = re.fullmatch(r"(.*?[\s*])(\w+)", " ".join(text.split()))
    if m is None or not m.group(1).strip() or m.group(2) in SCALARS:
        raise CSourceError(f"{function}: parameter {text.strip()!r} needs a type and a name.")
    kind = c_kind(m.group(1))
    if kind is None:
        raise CSourceError(f"{function}: parameter {text.strip()!r} is void.")
    return Param(m.group(2), m.group(1).strip(), kind)


def signatures(text: str) -> dict[str, Signature]:
    """The exported qserve_* functions a C source defines: name -> Signature."""
    out = {}
    for ret, name, params in PROTOTYPE.findall(_COMMENT.sub(" ", text)):
        params = " ".join(params.split())
        args = () if params in ("", "void") else tuple(_param(p, name)
                                                       for p in params.split(","))
        if len({p.name for p in args}) != len(args):
            raise CSourceError(f"{name}: two parameters share a name.")
        out[name] = Signature(name, args, c_kind(ret))
    return out


def enum_constants(text: str, prefix: str) -> dict[str, int]:
    """The constants named PREFIX* of the source's enums, with their values (a missing
    `= value` is the previous one plus 1, as in C)."""
    out = {}
    for body in re.findall(r"\benum\b[^{;]*\{([^}]*)\}", _COMMENT.sub(" ", text)):
        value = -1
        for item in (i.strip() for i in body.split(",")):
            if not item:
                continue
            name, _, literal = (s.strip() for s in item.partition("="))
            try:
                value = int(literal, 0) if literal else value + 1
            except ValueError:
                raise CSourceError(f"enum constant {name} = {literal!r}: only integer "
                                   f"literals are read here.") from None
            if name.startswith(prefix):
                out[name] = value
    return out


def define(text: str, name: str) -> int:
    """The integer a `#define NAME value` line of the source gives."""
    m = re.search(rf"^\s*#\s*define\s+{re.escape(name)}\s+(\w+)\s*$", _COMMENT.sub(" ", text),
                  re.M)
    if m is None:
        raise CSourceError(f"no '#define {name} <integer>' in the source.")
    return int(m.group(1), 0)


@functools.cache
def read(library: str) -> str:
    """The text of csrc/LIBRARY.c."""
    source = SOURCE_DIR / f"{library}.c"
    if not source.is_file():
        raise CSourceError(f"no kernel source {source.name} in {SOURCE_DIR.name}/.")
    return source.read_text("utf-8")


@functools.cache
def library_signatures(library: str) -> dict[str, Signature]:
    """signatures(read(library)): the entry points csrc/LIBRARY.c exports."""
    return signatures(read(library))


__all__ = ["CSourceError", "PROTOTYPE", "Param", "SCALARS", "SOURCE_DIR", "Signature", "c_kind",
           "define", "enum_constants", "library_signatures", "read", "signatures"]
