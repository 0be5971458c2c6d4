"""The engine on its device path (what runs on CUDA) without a GPU: the Triton kernels on
CPU tensors under the Triton interpreter, FP8 linears through torch._scaled_mm (the
CUDA default where the device has FP8), the weights placed by place_on_device and the
step inputs moved as the device path moves them. Against the CPU engine with its own
kernels, on a real tiny FP8 artifact (FP8 KV cache) in fp32: the same greedy tokens
through chunked prompts, prefix-cache hits and preemptions, which the run must show."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from qserve.kernels.fp8 import FP8_DTYPE  # noqa: E402
from qserve.runtime.engine import EngineConfig, LLMEngine  # noqa: E402
from qserve.runtime.layers.fp8_linear import Fp8Linear  # noqa: E402
from qserve.runtime.loaded_model import load  # noqa: E402
from qserve.runtime.sampling_params import SamplingParams  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 20, 21], list(range(30, 70)),
           [5, 6, 7, 8, 9, 10, 11, 12, 13]]


def _run(path, prompts=PROMPTS, max_tokens=12, num_kv_blocks=16, **device_config):
    """Greedy tokens of `prompts` through an engine on `path` (fp32): the engine and
    {request id: tokens}. The defaults: 16 blocks of 4 tokens, so the four PROMPTS cannot
    all hold their context (preemption); a 16-token step budget, so the 40-token prompt
    is chunked; the shared [5, 6, 7, 8] block, a prefix hit."""
    lm = load(str(path), torch.float32)
    engine = LLMEngine.from_model(lm, EngineConfig(
        num_kv_blocks=num_kv_blocks, block_size=4, max_num_batched_tokens=16,
        decode_impl="eager", **device_config))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
    return engine, outs


def test_device_path_gives_the_cpu_engines_greedy_tokens(tiny_fp8_artifact, monkeypatch):
    monkeypatch.delenv("QSERVE_KERNELS", raising=False)
    cpu, want = _run(tiny_fp8_artifact, device="cpu")
    assert cpu.execution.cpu_native
    dev, got = _run(tiny_fp8_artifact, device="cpu", kernels="triton", fp8_gemm="scaled_mm")
    assert (dev.execution.kernels, dev.execution.fp8_gemm) == ("triton", "scaled_mm")
    assert dev.runner.native is None  # no CPU C decode step on the device path
    linears = [m for m in dev.model.modules() if isinstance(m, Fp8Linear)]
    assert linears and all(m.gemm == "scaled_mm" and m.weight.dtype == FP8_DTYPE
                           and not m.packed for m in linears)  # one byte a weight
    assert dev.kv_cache.spec.dtype == "fp8"
    assert got == want
    assert all(len(v) == 12 for v in got.values()) and len(got) == len(PROMPTS)
    s_cpu, s_dev = cpu.stats(), dev.stats()
    assert s_dev.num_preemptions > 0 and s_dev.tokens_cached > 0
    assert (s_dev.num_preemptions, s_dev.tokens_cached, s_dev.tokens_computed) == \
        (s_cpu.num_preemptions, s_cpu.tokens_cached, s_cpu.tokens_computed)
    assert dev.runner.graphs is None  # decode graphs are CUDA's default, off here


def test_decode_graph_inputs_give_the_cpu_engines_greedy_tokens(tiny_fp8_artifact,
                                                                monkeypatch):
    """Decode steps on the fixed buffers a CUDA graph replays (padded to captured sizes,
    metadata never read on the host), run eagerly under the interpreter: the CPU
    engine's tokens, through preemption and prefix hits, with padded steps among them."""
    monkeypatch.delenv("QSERVE_KERNELS", raising=False)
    _, want = _run(tiny_fp8_artifact, device="cpu")
    dev, got = _run(tiny_fp8_artifact, device="cpu", kernels="triton", fp8_gemm="scaled_mm",
                    decode_graphs="padded", max_num_seqs=8)
    assert dev.execution.decode_graphs == "padded" and dev.runner.graphs.sizes == (1, 2, 4, 8)
    assert "decode on fixed buffers" in dev.execution.line()
    assert got == want
    assert dev.runner.graphs.replays > 0 and dev.runner.graphs.padding_rows > 0
    assert dev.stats().num_preemptions > 0


@pytest.mark.parametrize("proposer", ["ngram", "early_exit:1"])
def test_device_path_speculates_like_the_cpu_engine(proposer, tiny_fp8_artifact, monkeypatch):
    """The n-gram proposer (host-side lookups) and a draft model (here the target's first
    layer, over its own KV cache on the engine's device and kernels) verify on the device
    path and give the CPU engine's tokens and draft counts."""
    from qserve.runtime.spec.options import resolve_speculative

    monkeypatch.delenv("QSERVE_KERNELS", raising=False)
    spec = resolve_speculative(proposer, 3, None)

    def run(**device_config):  # the 40-token prompt's continuation loops: n-gram drafts
        return _run(tiny_fp8_artifact, PROMPTS[2:3], max_tokens=16, num_kv_blocks=32,
                    speculative=spec, **device_config)

    cpu, want = run(device="cpu")
    dev, got = run(device="cpu", kernels="triton", fp8_gemm="scaled_mm")
    assert got == want and len(got["r0"]) == 16
    assert dev.stats().spec.proposed > 0  # drafts were verified on the device path
    assert dev.stats().spec == cpu.stats().spec
    if proposer != "ngram":
        assert dev.spec.proposer.backend.kernels == "triton"


def test_device_path_refuses_the_hidden_state_draft_by_name(tiny_fp8_artifact, tmp_path,
                                                            monkeypatch):
    """The hidden-state draft head is packed for the CPU: refused beside a device engine,
    naming the proposers that do run there."""
    import sys
    from pathlib import Path

    from qserve.runtime.device import DeviceError
    from qserve.runtime.spec.options import resolve_speculative

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_models import write_tiny_hidden_draft_head

    monkeypatch.delenv("QSERVE_KERNELS", raising=False)
    lm = load(str(tiny_fp8_artifact), torch.float32)
    head = write_tiny_hidden_draft_head(tmp_path / "head.safetensors", lm, num_tokens=64)
    spec = resolve_speculative(f"hidden_draft:{head}", 3, None)
    with pytest.raises(DeviceError, match="the hidden_draft proposer runs its draft on the "
                                          "CPU torch backend only.*ngram, draft_model or "
                                          "early_exit"):
        LLMEngine.from_model(lm, EngineConfig(device="cpu", kernels="triton", speculative=spec,
                                              num_kv_blocks=8))


@pytest.mark.parametrize("arch", ["gemma3", "deepseek"])
def test_device_path_other_architectures(arch, tmp_path, monkeypatch):
    """Gemma 3 (sliding-window layers, logit softcap: two KV groups) and DeepSeek's MLA
    (one latent KV head holding the values) on the Triton kernels, bf16 KV cache."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import tiny_models

    monkeypatch.delenv("QSERVE_KERNELS", raising=False)
    path = getattr(tiny_models, f"write_tiny_{arch}")(tmp_path / arch)

    def run(**device_config):
        return _run(path, PROMPTS[1:3], max_tokens=8, num_kv_blocks=64, **device_config)

    cpu, want = run(device="cpu")
    dev, got = run(device="cpu", kernels="triton")
    assert dev.execution.kernels == "triton" and dev.runner.backend.kernels == "triton"
    assert got == want and all(len(v) == 8 for v in got.values())
    # and on the decode graphs' fixed buffers (Gemma: one per KV group)
    dev, got = run(device="cpu", kernels="triton", decode_graphs="padded", max_num_seqs=4)
    assert got == want and dev.runner.graphs.replays > 0


def test_device_path_runs_an_int8_weight_only_artifact(tmp_path, monkeypatch):
    """An int8 W8A16 artifact (the recipe of SmolLM2 and Gemma 3: int8 linears and head,
    bf16 KV) on the device path: its weights upcast once when placed, the same greedy
    tokens as the CPU engine."""
    import sys
    from pathlib import Path

    from qserve.quantize.pipeline import quantize
    from qserve.quantize.recipe import recipe_from_dict

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_models import write_tiny_llama

    monkeypatch.delenv("QSERVE_KERNELS", raising=False)
    recipe = recipe_from_dict({"weights": {"type": "int8"}, "kv_cache": {"enabled": False},
                               "ignore": [], "calibration": {"num_samples": 4, "seq_len": 64}})
    art = tmp_path / "int8"
    quantize(str(write_tiny_llama(tmp_path / "ckpt")), art, recipe, dtype=torch.float32)
    _, want = _run(art, PROMPTS[:2], max_tokens=8, num_kv_blocks=64, device="cpu")
    dev, got = _run(art, PROMPTS[:2], max_tokens=8, num_kv_blocks=64, device="cpu",
                    kernels="triton", decode_graphs="padded")
    linears = [m for m in dev.model.modules() if isinstance(m, Fp8Linear)]
    assert linears and all(m.codes == "int8" and m.weight_only and m.weight.dtype ==
                           torch.float32 for m in linears)  # upcast once, at placement
    assert dev.kv_cache.spec.dtype == "bf16"
    assert got == want and all(len(v) == 8 for v in got.values())


def test_end_to_end_part_runs_the_device_path(tiny_fp8_artifact):
    """The check's engine part on a real (tiny) FP8 artifact, its device path under the
    interpreter: it runs, names the backend it ran, and reports the leading tokens equal
    to the CPU engine's and the decode rates at each stream count."""
    from qserve.runtime.benchmark.gpu_check_e2e import run_e2e

    res = run_e2e(str(tiny_fp8_artifact), torch.device("cpu"), ["ab cd", "The quick"],
                  max_tokens=4, streams=(1, 3), tokens=3)
    assert res["status"] == "ran", res.get("error")
    assert res["backend"].startswith("device cpu, triton kernels, FP8 linears: triton")
    assert res["kv_dtype"] == "fp8"
    assert len(res["leading_tokens_equal_to_cpu"]) == 2
    assert all(0 <= n <= 4 for n in res["leading_tokens_equal_to_cpu"])
    assert [r["streams"] for r in res["decode"]] == [1, 3]
    # every request's tokens after its first are counted: 2 each
    assert [r["tokens"] for r in res["decode"]] == [2, 6]


def test_weights_that_do_not_fit_are_a_one_line_error(tiny_fp8_artifact, monkeypatch):
    """Out of device memory while placing the weights: a DeviceError (a QserveError, so
    the command line prints it alone) naming the size and what to do; the weights moved
    back."""
    from qserve.runtime.device import DeviceError
    from qserve.runtime.formats.errors import QserveError

    def full(self, device, gemm):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    monkeypatch.setattr(Fp8Linear, "place", full)
    lm = load(str(tiny_fp8_artifact), torch.float32)
    with pytest.raises(DeviceError, match=r"the model's weights \(0\.\d\d GiB as placed\) "
                                          r"do not fit in cpu's free memory") as err:
        LLMEngine.from_model(lm, EngineConfig(device="cpu", kernels="triton", num_kv_blocks=8))
    assert isinstance(err.value, QserveError)
    assert all(p.device.type == "cpu" for p in lm.model.parameters())


def test_the_check_frees_an_engine_before_building_the_next(tiny_fp8_artifact):
    """The check builds several engines one after another on one device, each sizing its
    KV pool from the memory free then: once dropped and released, an engine is gone
    (nothing global, no kernel cache or hook, keeps it and its pool alive)."""
    import weakref

    from qserve.runtime.benchmark.gpu_check_e2e import _engine, _release

    engine, _ = _engine(str(tiny_fp8_artifact), torch.device("cpu"), "torch")
    ref = weakref.ref(engine)
    del engine
    _release(torch.device("cpu"))
    assert ref() is None
