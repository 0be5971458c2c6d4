"""Every ctypes binding of a C kernel matches the C prototype it calls: the same number of
arguments and, position by position, the same kind (pointer, 64-bit integer, int, float),
and the same return kind. A binding that drifts from its C function would otherwise
crash or read garbage at run time instead of failing here."""

from __future__ import annotations

import ctypes
import importlib
import re

import pytest

from qserve.kernels import native_build

# every module that declares a kernel library (importing it registers its bindings)
BINDING_MODULES = ["qserve.kernels.native_attention", "qserve.kernels.native_bf16_gemv",
                   "qserve.kernels.native_fp8", "qserve.kernels.native_fp8_gemv",
                   "qserve.kernels.native_kv_store", "qserve.kernels.native_norm",
                   "qserve.kernels.native_rotary", "qserve.kernels.native_elementwise",
                   "qserve.kernels.native_step_program",
                   "qserve.kernels.native_prefill_attention",
                   "qserve.kernels.native_token_bitmask"]

PROTOTYPE = re.compile(r"^(?!static)([A-Za-z_][\w ]*?[\w*])\s*\b(qserve_\w+)\s*\(([^)]*)\)\s*\{",
                       re.M)
SCALARS = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "int": ctypes.c_int, "float": ctypes.c_float,
           "double": ctypes.c_double}


def c_kind(decl: str):
    """A C parameter or return type as the ctypes type it must be bound with."""
    decl = decl.strip()
    if "*" in decl:
        return ctypes.c_void_p
    if decl == "void":
        return None
    words = [w for w in decl.replace("const", " ").split() if w]
    return SCALARS[words[0]]  # KeyError: a type this test does not know yet


def prototypes(library: str) -> dict[str, tuple[list, object]]:
    """The exported qserve_* functions of csrc/LIBRARY.c: name -> (argtypes, restype)."""
    text = (native_build.SOURCE_DIR / f"{library}.c").read_text("utf-8")
    out = {}
    for ret, name, params in PROTOTYPE.findall(text):
        params = " ".join(params.split())
        args = [] if params in ("", "void") else [c_kind(p) for p in params.split(",")]
        out[name] = (args, c_kind(ret))
    return out


def bound_kind(t):
    """ctypes pointer types of any kind are void pointers to the C side."""
    if t is None:
        return None
    return ctypes.c_void_p if t is ctypes.c_void_p or issubclass(t, ctypes._Pointer) else t


@pytest.fixture(scope="module")
def bindings():
    for module in BINDING_MODULES:
        importlib.import_module(module)
    return native_build.BINDINGS


def test_every_library_with_exported_functions_is_bound(bindings):
    exported = {p.stem for p in native_build.SOURCE_DIR.glob("*.c") if prototypes(p.stem)}
    assert exported == set(bindings)


@pytest.mark.parametrize("library", sorted(p.stem for p in native_build.SOURCE_DIR.glob("*.c")))
def test_bindings_match_the_c_prototypes(bindings, library):
    c_side = prototypes(library)
    for name, (argtypes, restype) in bindings.get(library, {}).items():
        assert name in c_side, f"{library}: {name} is bound but not defined in csrc/{library}.c"
        want_args, want_ret = c_side[name]
        got = [bound_kind(t) for t in argtypes]
        assert len(got) == len(want_args), (
            f"{name}: bound with {len(got)} arguments, the C function takes {len(want_args)}")
        for i, (g, w) in enumerate(zip(got, want_args)):
            assert g is w, f"{name}: argument {i} bound as {g}, the C function takes {w}"
        assert bound_kind(restype) is want_ret, f"{name}: returns {want_ret}, bound {restype}"


def test_the_parser_reads_a_prototype():
    """The check itself, on a prototype split over lines with const pointers."""
    assert PROTOTYPE.findall("int qserve_f(const uint16_t *x, int64_t m,\n    float s) {") == [
        ("int", "qserve_f", "const uint16_t *x, int64_t m,\n    float s")]
    assert c_kind("const float *scale") is ctypes.c_void_p and c_kind("int64_t n") is ctypes.c_int64
