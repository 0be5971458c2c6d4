"""Building and loading the C kernels: cached per source, atomic, failures fall back or raise."""

from __future__ import annotations

import logging
import platform

import pytest

from qserve.kernels import native_build


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty library cache and no loaded libraries."""
    monkeypatch.setenv("QSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native_build, "_loaded", {})
    return tmp_path / "native"


def test_builds_once_then_reuses(fresh, monkeypatch):
    first = native_build.build("paged_attention_cpu")
    assert first.parent == fresh and first.suffix == ".so"
    assert [p.name for p in fresh.iterdir()] == [first.name]  # no temp files left behind
    calls = []
    real_run = native_build.subprocess.run
    monkeypatch.setattr(native_build.subprocess, "run",
                        lambda cmd, **kw: calls.append(cmd) or real_run(cmd, **kw))
    assert native_build.build("paged_attention_cpu") == first
    assert all("--version" in c for c in calls)  # the compiler was asked its version only
    lib = native_build.load_library("paged_attention_cpu")
    assert lib is not None and hasattr(lib, "qserve_paged_attention_cpu")


def test_a_changed_source_builds_a_new_library(fresh, monkeypatch, tmp_path):
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "k.c").write_text("int qserve_k(void) { return 1; }\n")
    monkeypatch.setattr(native_build, "SOURCE_DIR", src)
    one = native_build.build("k")
    (src / "k.c").write_text("int qserve_k(void) { return 2; }\n")
    two = native_build.build("k")
    assert one != two and one.exists() and two.exists()
    assert native_build.load_library("k").qserve_k() == 2


def test_compile_errors_are_reported(fresh, monkeypatch, tmp_path):
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "bad.c").write_text("this is not C\n")
    monkeypatch.setattr(native_build, "SOURCE_DIR", src)
    with pytest.raises(native_build.NativeBuildError, match="compiling bad.c failed"):
        native_build.build("bad")
    assert not any(fresh.iterdir())  # nothing half-written stays
    with pytest.raises(native_build.NativeBuildError, match="no kernel source"):
        native_build.build("missing")


@pytest.mark.skipif("avx" not in native_build.read_cpuinfo().split(), reason="needs AVX")
def test_a_failed_build_for_this_cpu_falls_back_to_portable_or_raises(fresh, monkeypatch,
                                                                       tmp_path):
    """A source that compiles only without this CPU's features (as a kernel whose fast
    path includes a missing header): the portable build loads, unless
    QSERVE_REQUIRE_COMPILE is set, where the failure of the fast build is an error."""
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "fast.c").write_text("#ifdef __AVX__\n#include \"no_such_header.h\"\n#endif\n"
                                "int qserve_fast(void) { return 1; }\n")
    monkeypatch.setattr(native_build, "SOURCE_DIR", src)
    monkeypatch.delenv("QSERVE_REQUIRE_COMPILE", raising=False)
    assert native_build.load_library("fast").qserve_fast() == 1
    monkeypatch.setattr(native_build, "_loaded", {})
    monkeypatch.setenv("QSERVE_REQUIRE_COMPILE", "1")
    with pytest.raises(native_build.NativeBuildError, match="no_such_header"):
        native_build.load_library("fast")


def test_no_compiler_falls_back_or_raises(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", "no-such-compiler-qserve")
    monkeypatch.delenv("QSERVE_REQUIRE_COMPILE", raising=False)
    with caplog.at_level(logging.WARNING, logger=native_build.__name__):
        assert native_build.load_library("paged_attention_cpu") is None
    assert "no C compiler" in caplog.text and "torch path" in caplog.text
    monkeypatch.setattr(native_build, "_loaded", {})
    monkeypatch.setenv("QSERVE_REQUIRE_COMPILE", "1")
    with pytest.raises(native_build.NativeBuildError, match="no C compiler"):
        native_build.load_library("paged_attention_cpu")


def test_attention_falls_back_to_inductor_without_the_kernel(monkeypatch):
    from qserve.kernels import native_attention, paged_attention as pa

    monkeypatch.setattr(native_attention, "_library", lambda: None)
    assert pa.default_decode_impl(True) == "compiled"
    with pytest.raises(RuntimeError, match="not available"):
        native_attention.native_attention(*[None] * 10)
    with pytest.raises(RuntimeError, match="not available"):
        native_attention.gather_context_native(None, None, 0, 0, None)


def test_native_attention_refuses_pools_it_cannot_read():
    import torch

    from qserve.kernels.native_attention import gather_context_native, native_attention

    pool = torch.zeros(2, 4, 1, 8, dtype=torch.float16)
    q, bt = torch.zeros(1, 1, 8), torch.zeros(1, 1, dtype=torch.int64)
    one = torch.ones(1)
    with pytest.raises(ValueError, match="pools, got torch.float16"):
        native_attention(q, pool, pool, bt, torch.tensor([0, 1]), one.long(), one, one, None,
                         None)
    strided = torch.zeros(2, 4, 2, 8)[:, :, :1]
    with pytest.raises(ValueError, match="contiguous K/V pools"):
        native_attention(q, strided, strided, bt, torch.tensor([0, 1]), one.long(), one, one,
                         None, None)
    with pytest.raises(ValueError, match="got torch.float16 -> torch.bfloat16"):
        gather_context_native(pool, bt[0], 0, 1, torch.bfloat16)
    with pytest.raises(ValueError, match="got torch.float32 -> torch.float16"):
        gather_context_native(pool.float(), bt[0], 0, 1, torch.float16)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 only")
@pytest.mark.parametrize("source", sorted(p.stem for p in native_build.SOURCE_DIR.glob("*.c")))
def test_every_kernel_builds_for_avx2_and_portable(fresh, monkeypatch, source):
    """Each C kernel compiles and loads as an x86-64-v3 (AVX2 + FMA + F16C) build and as a
    portable one, whatever this CPU has beyond them: an AVX-512 machine checks the AVX2
    builds of the decode path too (the linears' bits are checked in their own tests)."""
    for flags in (native_build.flags_for("x86-64-v3"), native_build.flags_for(None)):
        monkeypatch.setattr(native_build, "FLAG_SETS", (flags,))
        monkeypatch.setattr(native_build, "_loaded", {})
        assert native_build.load_library(source) is not None, (source, flags)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 only")
def test_attention_gives_the_same_bits_built_for_avx2(fresh, monkeypatch):
    """Without AVX-512 the attention kernel runs its 16-key blocks as two 8-lane halves;
    the x86-64-v3 build gives this CPU's build's bits on prefill chunks (the causal rows
    that skip blocks) and decode rows. (A portable build, without FMA, rounds each
    multiply-add twice: close, not equal.)"""
    import torch

    from qserve.kernels import native_attention

    g = torch.Generator().manual_seed(0)
    hq, hkv, d, bs = 6, 2, 64, 16
    k = (torch.randn(12, bs, hkv, d, generator=g) * 0.5).to(torch.float8_e4m3fn)
    v = (torch.randn(12, bs, hkv, d, generator=g) * 0.5).to(torch.float8_e4m3fn)
    tables = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])
    qsl, lens = torch.tensor([0, 50, 51]), torch.tensor([70, 83])  # a chunk after a prefix; a decode row
    q = torch.randn(51, hq, d, generator=g).bfloat16()
    args = (q, k, v, tables, qsl, lens, torch.tensor([0.125, 0.1]), torch.tensor([1.0, 0.5]))

    def run():
        native_attention._library.cache_clear()
        try:
            return [native_attention.native_attention(*args, window, None)
                    for window in (None, 20)]
        finally:
            native_attention._library.cache_clear()

    here = run()
    monkeypatch.setattr(native_build, "FLAG_SETS", (native_build.flags_for("x86-64-v3"),))
    monkeypatch.setattr(native_build, "_loaded", {})
    for want, got in zip(here, run()):
        assert torch.equal(got, want)
