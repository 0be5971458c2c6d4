"""The C prototypes are the one declaration of each kernel entry point: the loaded functions
carry the argtypes and restype read from them, every exported prototype is read, and the
wrappers' keyword calls are put into the prototype's order at import, so a C function
whose parameters of one kind swap places, or are renamed, moves or refuses the arguments
instead of receiving them in the wrong places (which a check of argument kinds alone
does not see)."""

from __future__ import annotations

import ast
import ctypes
import importlib
import inspect
import re

import pytest
import torch

from qserve.kernels import native_attention, native_build
from qserve.kernels.c_source import (CSourceError, c_kind, library_signatures, read,
                                     signatures)
from qserve.kernels.native_call import keyword_calls, positional

# every module that declares a kernel library (importing it registers its bindings)
BINDING_MODULES = ["qserve.kernels.native_attention", "qserve.kernels.native_bf16_gemv",
                   "qserve.kernels.native_fp8", "qserve.kernels.native_fp8_gemv",
                   "qserve.kernels.native_kv_store", "qserve.kernels.native_norm",
                   "qserve.kernels.native_rotary", "qserve.kernels.native_elementwise",
                   "qserve.kernels.native_step_program",
                   "qserve.kernels.native_prefill_attention",
                   "qserve.kernels.native_token_bitmask"]
LIBRARIES = sorted(p.stem for p in native_build.SOURCE_DIR.glob("*.c"))


@pytest.fixture(scope="module")
def bindings():
    for module in BINDING_MODULES:
        importlib.import_module(module)
    return native_build.BINDINGS


def test_every_library_with_exported_functions_is_bound(bindings):
    exported = {name for name in LIBRARIES if library_signatures(name)}
    assert exported == set(bindings)


@pytest.mark.parametrize("library", LIBRARIES)
def test_every_exported_prototype_is_read(library):
    """Counted without the parser: each line that starts a non-static qserve_* definition."""
    text = read(library)
    starts = set(re.findall(r"^(?!static)[A-Za-z][\w \t*]*?\b(qserve_\w+)\s*\([^;]*?\)\s*\{",
                            text, re.M | re.S))
    assert set(library_signatures(library)) == starts


@pytest.mark.parametrize("library", LIBRARIES)
def test_loaded_functions_carry_the_c_prototypes(bindings, library):
    if library not in bindings:
        pytest.skip(f"{library} exports nothing")
    lib = native_build.cached_library(library)()
    if lib is None:
        pytest.skip(f"{library} does not build here")
    for name, signature in library_signatures(library).items():
        function = getattr(lib, name)
        assert function.argtypes == signature.argtypes, name
        assert function.restype is signature.restype, name


def test_the_parser_reads_a_prototype():
    """A prototype split over lines, const pointers, comments, and a static helper skipped."""
    sigs = signatures("static int helper(int a) {\n}\n"
                      "int qserve_f(const uint16_t *x, int64_t m, /* rows */\n"
                      "             float s, int32_t *out) {\n}\n")
    f = sigs["qserve_f"]
    assert list(sigs) == ["qserve_f"] and f.names == ("x", "m", "s", "out")
    assert f.argtypes == [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p]
    assert f.restype is ctypes.c_int and f.params[0].ctype == "const uint16_t *"
    assert signatures("void qserve_g(void) {")["qserve_g"].params == ()
    assert c_kind("void") is None and c_kind("const float *") is ctypes.c_void_p


@pytest.mark.parametrize("source, error", [
    ("void qserve_f(size_t n) {", "size_t"),
    ("void qserve_f(int64_t) {", "needs a type and a name"),
    ("void qserve_f(int n, float n) {", "share a name"),
])
def test_a_prototype_it_cannot_bind_is_refused(source, error):
    with pytest.raises(CSourceError, match=error):
        signatures(source)


def with_swapped_params(text: str, function: str, first: str, second: str) -> str:
    """The source with two adjacent parameters `TYPE first, TYPE second` of `function`'s
    prototype in the other order."""
    start = text.index(f"{function}(")
    end = text.index(")", start)
    params, count = re.subn(rf"(\w+) {first},(\s*)(\w+) {second},",
                            rf"\3 {second},\2\1 {first},", text[start:end])
    assert count == 1
    return text[:start] + params + text[end:]


class _Recorder:
    """A stand-in library that records the positional arguments of each call."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, args))


def test_swapped_parameters_move_the_arguments_of_a_keyword_call(monkeypatch):
    """qserve_gather_context with `bs` and `hkv` (both int64_t) swapped in the C source:
    the kinds stay the same, and gather_context_native compiled against it passes the
    two values in the swapped places."""
    real = library_signatures("paged_attention_cpu")
    name = "qserve_gather_context"
    changed = signatures(with_swapped_params(read("paged_attention_cpu"), name, "bs", "hkv"))
    assert changed[name].argtypes == real[name].argtypes  # a kind check passes
    assert changed[name].names != real[name].names
    recorder = _Recorder()
    monkeypatch.setattr(native_attention, "_require_library", lambda: recorder)
    pool = torch.zeros(3, 16, 2, 8, dtype=torch.bfloat16)  # bs 16, hkv 2
    table = torch.tensor([0, 1])
    native_attention.gather_context_native(pool, table, 0, 5, torch.float32)
    positional(native_attention.gather_context_native, changed)(pool, table, 0, 5,
                                                                 torch.float32)
    (_, here), (_, there) = recorder.calls
    at = real[name].names.index
    assert (here[at("bs")], here[at("hkv")]) == (16, 2)
    assert (there[at("bs")], there[at("hkv")]) == (2, 16)
    same = [i for i in range(len(here)) if i not in (at("bs"), at("hkv"), at("out"))]
    assert [here[i] for i in same] == [there[i] for i in same]  # out: a new tensor


def test_a_keyword_call_passes_every_argument_in_the_c_order():
    """A call written in another order than the prototype's, against the real prototype:
    every argument in the place the C function names it (recorded by a stand-in)."""
    recorder = _Recorder()
    call = positional(_attention_like, library_signatures("paged_attention_cpu"))
    call(recorder)
    (_, args), = recorder.calls
    assert args == library_signatures("paged_attention_cpu")[
        "qserve_paged_attention_cpu"].names


@pytest.mark.parametrize("module", BINDING_MODULES)
def test_every_keyword_call_of_a_wrapper_is_made_positional(module):
    """A function with a keyword call of a qserve_* entry point carries keyword_calls (a
    ctypes function takes no keyword arguments)."""
    tree = ast.parse(inspect.getsource(importlib.import_module(module)))
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        named = [c for c in ast.walk(function) if isinstance(c, ast.Call)
                 and isinstance(c.func, ast.Attribute) and c.func.attr.startswith("qserve_")
                 and c.keywords]
        decorated = any(isinstance(d, ast.Call) and getattr(d.func, "id", "") == "keyword_calls"
                        for d in function.decorator_list)
        assert decorated or not named, f"{module}.{function.name}"


def _attention_like(lib):  # every argument is its own parameter's name, written out of order
    lib.qserve_paged_attention_cpu(
        dv="dv", num_threads="num_threads", out="out", v_scale="v_scale", softcap="softcap",
        window="window", num_seqs="num_seqs", skip="skip", seq_lens="seq_lens",
        q_start="q_start", table_stride="table_stride", tables="tables", hkv="hkv", bs="bs",
        kind="kind", v_pool="v_pool", k_pool="k_pool", d="d", hq="hq", qk_scale="qk_scale",
        q_kind="q_kind", q="q")


def _unknown_name(lib):
    lib.qserve_add_bf16(x=1, y=2, count=3)


def _missing_name(lib):
    lib.qserve_add_bf16(x=1, y=2)


def _positional_argument(lib):
    lib.qserve_add_bf16(1, y=2, n=3)


def _another_library(lib):
    lib.qserve_rms_norm_bf16(x=1)


@pytest.mark.parametrize("function, error", [
    (_unknown_name, r"qserve_add_bf16 has no parameter 'count'; it takes \(x, y, n\)"),
    (_missing_name, r"qserve_add_bf16: missing 'n'"),
    (_positional_argument, r"pass every argument of qserve_add_bf16 by its C parameter name"),
    (_another_library, r"qserve_rms_norm_bf16 is not an entry point of this library"),
])
def test_a_keyword_call_that_does_not_match_the_prototype_is_refused(function, error):
    with pytest.raises(TypeError, match=error) as caught:
        keyword_calls("elementwise_cpu")(function)
    line = function.__code__.co_firstlineno + 1
    assert f"test_bindings.py:{line}:" in str(caught.value)  # where the call is written
