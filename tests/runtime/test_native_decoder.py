"""The C decode path (runtime/models/native_decoder.py) against the module path it stands
in for: the same hidden states up to the activation's exp/tanh and the norms' sum order,
the same greedy tokens through the engine (plain, batched, speculative verify chunks, FP8
and bf16 KV), Llama, Gemma 3, Qwen 3 and Qwen 2, the layer structure taken from the forward, and
the cases it must leave to the modules."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from qserve.kernels import cpu_linear, native_bf16_gemv, native_fp8_gemv
from qserve.quantize.pipeline import quantize
from qserve.quantize.recipe import recipe_from_dict
from qserve.runtime.engine import EngineConfig
from qserve.runtime.llm import LLM
from qserve.runtime.loaded_model import load
from qserve.runtime.models.native_decoder import NativeDecoder
from qserve.runtime.sampling_params import SamplingParams
from qserve.runtime.spec.proposer import make_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import (write_tiny_deepseek, write_tiny_gemma3, write_tiny_llama,  # noqa: E402
                         write_tiny_qwen)

pytestmark = pytest.mark.skipif(not native_fp8_gemv.available(), reason="no C compiler")
RECIPE = {"calibration": {"num_samples": 4, "seq_len": 64}}
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


WRITERS = {
    "llama": lambda root: write_tiny_llama(root, num_hidden_layers=3),
    "gemma3": lambda root: write_tiny_gemma3(root, sliding_window=8),
    "qwen3": write_tiny_qwen,
    "qwen2": lambda root: write_tiny_qwen(root, version=2),
    # weight-only (W8A16) down and o projections beside static W8A8 ones
    "llama-w8a16": lambda root: write_tiny_llama(root, num_hidden_layers=3),
    # a mixed artifact as a quality budget writes one: layer 1 wholly bf16, weight-only
    # down projections, static W8A8 elsewhere
    "llama-mixed": lambda root: write_tiny_llama(root, num_hidden_layers=3),
    # int8 weight-only (W8A16 int) linears, FP8 KV
    "llama-int8": lambda root: write_tiny_llama(root, num_hidden_layers=3),
    # W8A8 int8 (int8 inputs per row, exact int32 sums) with an int8 weight-only head
    "llama-w8a8-int8": lambda root: write_tiny_llama(root, num_hidden_layers=3),
    # ... and Qwen 2's q/k/v biases on fused W8A8 int8 projections
    "qwen2-w8a8-int8": lambda root: write_tiny_qwen(root, version=2),
    # latent attention: DeepSeek-V3 with query compression, RoPE on interleaved pairs (its
    # default), dense MLPs
    "deepseek-mla": lambda root: write_tiny_deepseek(root, 3, first_k_dense_replace=3,
                                                     q_lora_rank=24),
    # DeepSeek-V3 as its checkpoints come: layer 0 dense, layers 1 and 2 mixtures of 8
    # experts and a shared one (torch runs them between stretches of C calls)
    "deepseek-moe": lambda root: write_tiny_deepseek(root, 3),
    # a Llama converted to latent attention, RoPE in halves kept on two kv heads (rope_heads 2)
    "llama-mla": lambda root: write_tiny_llama(root, num_hidden_layers=3),
    # ... and with RoPE kept on one kv head's worth of (frequency pair, mixed head) slots
    # chosen per layer: a RoPE table per layer
    "llama-mla-pairs": lambda root: write_tiny_llama(root, num_hidden_layers=3),
}
RECIPES = {"llama-w8a16": {**RECIPE, "weight_only": ["re:.*down_proj", "re:.*[02]\\.self_attn\\.o_proj"]},
           "llama-mixed": {**RECIPE, "ignore": ["lm_head", "re:.*layers\\.1\\..*"],
                           "weight_only": ["re:.*[02]\\.mlp\\.down_proj"]},
           "llama-int8": {**RECIPE, "weights": {"type": "int8"}},
           "llama-w8a8-int8": {**RECIPE, "weights": {"type": "int8"},
                               "activations": {"dynamic": True}, "lm_head": "int8"},
           "qwen2-w8a8-int8": {**RECIPE, "weights": {"type": "int8"},
                               "activations": {"dynamic": True}},
           "llama-mla": {**RECIPE, "mla": {"rank": 15, "rope_heads": 2, "num_samples": 4,
                                           "seq_len": 32}},
           "llama-mla-pairs": {**RECIPE, "mla": {"rank": 15, "rope_select": "pairs",
                                                 "num_samples": 4, "seq_len": 32}}}


@pytest.fixture(scope="module", params=list(WRITERS))
def artifact(request, tmp_path_factory):
    """A tiny FP8 artifact: Llama (3 layers), Gemma 3 (sliding and global layers, local
    RoPE, q/k norms, four norms a block, GELU-tanh, scaled embeddings), Qwen 3 (q/k
    RMSNorms in a Llama block), Qwen 2 (q/k/v biases), DeepSeek-V3 or a Llama converted to
    latent attention (MLA over one FP8 latent pool): each lowered from its own layer
    forward."""
    root = tmp_path_factory.mktemp(f"native-decoder-{request.param}")
    ckpt = WRITERS[request.param](root / "ckpt")
    quantize(str(ckpt), root / "art", recipe_from_dict(RECIPES.get(request.param, RECIPE)),
             dtype=torch.float32)
    if request.param == "llama-w8a16":  # 3 down and 2 o projections are weight-only
        qc = json.loads((root / "art" / "config.json").read_text())["quantization_config"]
        assert len(qc["config_groups"]["group_1"]["targets"]) == 5
    if request.param == "llama-mixed":  # layer 1's 7 linears and the LM head stay bf16
        qc = json.loads((root / "art" / "config.json").read_text())["quantization_config"]
        assert len(qc["ignore"]) == 8 and len(qc["config_groups"]["group_1"]["targets"]) == 2
    if "-mla" in request.param:
        config = json.loads((root / "art" / "config.json").read_text())
        assert config["kv_lora_rank"] in (15 + 1, 32)  # converted: rank + the constant
    if request.param == "llama-mla-pairs":  # its own frequency pairs per layer
        assert len({tuple(p) for p in config["rope_pairs"]}) > 1
    if request.param == "llama-int8":
        qc = json.loads((root / "art" / "config.json").read_text())["quantization_config"]
        assert qc["format"] == "pack-quantized"
        assert qc["config_groups"]["group_0"]["weights"]["type"] == "int"
    if request.param.endswith("w8a8-int8"):
        qc = json.loads((root / "art" / "config.json").read_text())["quantization_config"]
        group = qc["config_groups"]["group_0"]
        assert group.get("format", qc["format"]) == "int-quantized"
        assert group["input_activations"]["type"] == "int"
    return root / "art"


def _llm(path, **config) -> LLM:
    config = {"num_kv_blocks": 64, "max_num_batched_tokens": 32, **config}
    return LLM(str(path), dtype=torch.bfloat16, config=EngineConfig(**config))


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 300, (n,), generator=g).tolist() for n in (5, 17, 9, 30)] + \
        [[7, 8, 9, 10] * 5]  # repetitive: n-gram drafts get accepted


def _count_native_steps(runner) -> list[int]:
    """Rows of each step the C path ran (it returns None for steps it leaves)."""
    rows = []
    real = runner.native.forward

    def counted(ids, positions, meta, taps=None):
        out = real(ids, positions, meta, taps)
        if out is not None:
            rows.append(ids.shape[0])
        return out

    runner.native.forward = counted
    return rows


def _tokens(llm, prompts, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_greedy_tokens_equal_the_module_path(artifact, kv_dtype):
    # no prefix reuse: a second run of a prompt would prefill only its tail, another kernel
    llm = _llm(artifact, kv_dtype=kv_dtype, enable_prefix_caching=False)
    runner = llm.engine.runner
    assert runner.native is not None
    # decode-sized steps here (prefill steps of more rows, which the AVX2 build also runs
    # natively, are compared by hidden states below: greedy tokens of a tiny random model
    # flip on near-ties between two sum orders)
    runner.native.max_rows = native_fp8_gemv.MAX_ROWS
    calls = _count_native_steps(runner)
    prompts = _prompts()
    native_one = [_tokens(llm, [p])[0] for p in prompts]  # decode steps of one row
    native_batch = _tokens(llm, prompts[:4])  # 4 rows a step, then fewer
    assert 1 in calls and 4 in calls and max(calls) <= native_fp8_gemv.MAX_ROWS
    runner.native = None
    modules = [_tokens(llm, [p])[0] for p in prompts]
    assert native_one == modules and native_batch == modules[:4]


def test_speculative_verify_chunks_run_native_and_keep_greedy(artifact):
    spec = make_config("ngram", 3, min_n=1)  # the tiny model repeats tokens, not bigrams
    llm = _llm(artifact, speculative=spec)
    rows = _count_native_steps(llm.engine.runner)
    with_spec = _tokens(llm, _prompts())
    rows.clear()
    _tokens(_llm(artifact, speculative=spec), _prompts()[4:])  # one (repetitive) prompt
    rows = _count_native_steps(llm.engine.runner)
    _tokens(llm, [_prompts()[4][:-1] + [11]])
    assert 4 in rows  # one token and 3 drafts verified in one native step
    assert with_spec == _tokens(_llm(artifact), _prompts())


def test_hidden_states_match_the_modules_within_bf16_noise(artifact):
    """... the final hidden states, and the residual stream after tapped layers (what a
    draft head reads) against the decoder layers' outputs."""
    llm = _llm(artifact, kv_dtype="bf16")
    runner = llm.engine.runner
    layers = runner.model.backbone.layers
    tapped = (0, len(layers) - 2)
    prompt = _prompts()[1]
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))  # cache the prompt
    seen, module_taps = {}, {}
    for i in tapped:
        layers[i].register_forward_hook(lambda _m, _a, out, i=i: module_taps.__setitem__(i, out))

    def both(ids, positions, meta, taps=None):
        native_taps = dict.fromkeys(tapped)
        native = NativeDecoder.forward(runner.native, ids, positions, meta, native_taps)
        modules = runner.model(ids, positions, meta, runner.backend)  # rewrites the same KV
        seen["pair"] = (native, modules)
        seen["taps"] = native_taps
        return native

    runner.native.forward = both
    llm.generate([prompt + [5]], SamplingParams(max_tokens=2, temperature=0.0))
    native, modules = seen["pair"]
    assert native.dtype == modules.dtype == torch.bfloat16 and native.shape == modules.shape
    torch.testing.assert_close(native.float(), modules.float(), rtol=0.03, atol=0.03)
    for i in tapped:
        got, want = seen["taps"][i], module_taps[i]
        assert got.shape == want.shape == native.shape
        scale = float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), rtol=0.03, atol=0.03 * scale)


def test_prefill_steps_are_as_close_to_fp32_as_the_modules(artifact):
    """A batch-invariant engine (the default) runs prefill steps of any number of rows on
    the C path, on every build. A 30-token prompt's step, native and through the bf16
    modules, against the fp32 modules (the oracle): the two bf16 paths differ from each
    other by bf16 noise grown over the layers, so what is checked is that the native one
    is no further from fp32."""
    probe = LLM(str(artifact), dtype=torch.bfloat16, config=EngineConfig(
        num_kv_blocks=64, max_num_batched_tokens=32, kv_dtype="bf16"))
    assert probe.engine.runner.native.max_rows >= 30
    prompt = _prompts()[3]  # 30 tokens
    del probe

    def first_step(dtype, native: bool):
        llm = LLM(str(artifact), dtype=dtype, config=EngineConfig(
            num_kv_blocks=64, max_num_batched_tokens=32, kv_dtype="bf16",
            enable_prefix_caching=False))
        runner, seen = llm.engine.runner, []
        if not native:
            runner.native = None
        model_forward = runner.model.forward

        def modules(*a, **k):
            seen.append(model_forward(*a, **k))
            return seen[-1]

        runner.model.forward = modules
        if native:
            native_forward = runner.native.forward
            runner.native.forward = lambda *a, **k: seen.append(native_forward(*a, **k)) or seen[-1]
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        assert seen[0] is not None and seen[0].shape[0] == len(prompt) > 4  # past 4 rows
        return seen[0].float()

    oracle = first_step(torch.float32, native=False)
    native = first_step(torch.bfloat16, native=True)
    modules = first_step(torch.bfloat16, native=False)
    err_native = float((native - oracle).norm() / oracle.norm())
    err_modules = float((modules - oracle).norm() / oracle.norm())
    assert err_native <= 1.5 * err_modules + 1e-3, (err_native, err_modules)


def test_steps_and_models_it_leaves_to_the_modules(artifact, tmp_path):
    llm = _llm(artifact)
    native = llm.engine.runner.native
    native.max_rows = native_fp8_gemv.MAX_ROWS  # as the AMX and AVX512-BF16 builds
    big = torch.zeros(native_fp8_gemv.MAX_ROWS + 1, dtype=torch.int64)
    assert native.forward(big, big, object()) is None  # too many rows: modules
    assert _llm(artifact, decode_impl="compiled").engine.runner.native is None
    assert _llm(artifact, keep_fp8_weights=False).engine.runner.native is None
    unpacked = load(str(artifact), torch.bfloat16)  # no fuse/pack: plain modules
    assert NativeDecoder.build(unpacked.model, llm.engine.kv_cache, None) is None
    bf16 = _llm(write_tiny_llama(tmp_path / "plain"), kv_dtype="bf16")
    if cpu_linear.strategy() == "fp32" and native_bf16_gemv.vectorized():
        # AVX2: a plain bf16 model's linears keep their bf16 rows for the C kernel, so its
        # decode steps lower too, up to that kernel's rows
        assert bf16.engine.runner.native.max_rows == native_bf16_gemv.MAX_ROWS
    else:  # oneDNN bf16 linears have no C form: no FP8 linears, no C path
        assert bf16.engine.runner.native is None


def _parallel_block(layer_cls):
    """The layer with attention and MLP side by side on one norm (GPT-J / Cohere style)."""
    class Parallel(layer_cls):
        def forward(self, hidden, rope, meta, attn):
            x = self.input_layernorm(hidden)
            return hidden + self.self_attn(x, rope, meta, attn) + self.mlp(x)
    return Parallel


def _scaled_residual(layer_cls):
    class Scaled(layer_cls):
        def forward(self, hidden, rope, meta, attn):
            return hidden * 0.5 + self.mlp(self.input_layernorm(hidden))  # `*`: no lowering
    return Scaled


def test_the_c_path_follows_the_layer_forward(artifact):
    """The C program is lowered from each layer class's traced forward, not restated: a
    layer written as a parallel block runs natively with the modules' hidden states, and a
    forward with an op that has no lowering (a scaled residual) leaves steps to the
    modules."""
    llm = _llm(artifact, kv_dtype="bf16")
    runner = llm.engine.runner
    layers = runner.model.backbone.layers
    for layer in layers:
        layer.__class__ = _parallel_block(type(layer))
    runner.native = NativeDecoder.build(runner.model, llm.engine.kv_cache, None)
    assert runner.native is not None
    # three leaves (norm, attention, MLP) and two adds into the residual, in every layer
    assert [len(p) for p in runner.native.programs] == [5] * len(layers)
    prompt = _prompts()[1]
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    seen = {}

    def both(ids, positions, meta, taps=None):
        native = NativeDecoder.forward(runner.native, ids, positions, meta)
        seen["pair"] = (native, runner.model(ids, positions, meta, runner.backend))
        return native

    runner.native.forward = both
    llm.generate([prompt + [5]], SamplingParams(max_tokens=2, temperature=0.0))
    native, modules = seen["pair"]
    torch.testing.assert_close(native.float(), modules.float(), rtol=0.03, atol=0.03)
    for layer in layers:
        layer.__class__ = _scaled_residual(type(layer).__mro__[1])
    assert NativeDecoder.build(runner.model, llm.engine.kv_cache, None) is None


def test_bf16_layers_of_a_mixed_artifact_run_in_c(artifact):
    """A layer a quality budget kept in bf16 lowers to the bf16 C linear (its 4 fused
    linears), the others to FP8 ones; a batch-invariant engine runs every step there, one
    that is not caps steps at that kernel's rows per pass."""
    llm = _llm(artifact)
    native = llm.engine.runner.native
    assert native is not None
    kernels = [c.kernel for c in native.program.calls if "gemv" in c.kernel]
    if artifact.parent.name.startswith("native-decoder-llama-mixed"):
        layer1 = native.program.calls[native.layer_ends[0]:native.layer_ends[1]]
        assert [c.kernel for c in layer1 if "gemv" in c.kernel] == ["bf16_gemv"] * 4
        assert kernels.count("bf16_gemv") == 4 and kernels.count("fp8_gemv_wonly") == 2
        assert native.max_rows > 10**9  # batch-invariant: every step runs here
        lean = _llm(artifact, batch_invariant=False).engine.runner.native
        assert lean.max_rows == native_fp8_gemv.MAX_ROWS  # else up to one bf16 pass
    elif "-mla" in artifact.parent.name or "-moe" in artifact.parent.name:
        # latent attention: the per-head W_UK and W_UV
        # (all heads of one in one call)
        assert kernels.count("bf16_gemv_heads") == 2 * len(native.layer_ends)
        assert "bf16_gemv" not in kernels
        lean = _llm(artifact, batch_invariant=False).engine.runner.native
        assert lean.max_rows == native_fp8_gemv.pass_rows()  # any rows where FP8 takes them
    else:
        assert "bf16_gemv" not in kernels


@pytest.mark.parametrize("artifact", ["deepseek-moe"], indirect=True)
def test_mixtures_of_experts_run_in_torch_between_c_calls(artifact):
    """DeepSeek's expert layers (routing picks each expert's rows at run time) are the one
    op torch runs inside a C step: the program stops before each, the module maps its
    input buffer to its output buffer, the program goes on; a stop and a tapped layer may
    share a pause."""
    llm = _llm(artifact)
    native = llm.engine.runner.native
    assert native is not None
    assert [op.name for _, op, _, _ in native.stops] == ["mlp", "mlp"]  # layers 1 and 2
    assert native.source.count("torch: mlp(") == 2
    assert [i for i, *_ in native.stops] == [native.layer_ends[k] - 1 for k in (1, 2)]
    prompt = _prompts()[2]
    ran = []
    for _, op, _, _ in native.stops:
        real = op.module.forward
        op.module.forward = lambda x, real=real: ran.append(x.shape[0]) or real(x)
    taps = {1: None, 2: None}
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    seen = {}

    def tapped(ids, positions, meta, _=None):
        out = NativeDecoder.forward(native, ids, positions, meta, taps)
        seen["out"], seen["rows"] = out, ids.shape[0]
        return out

    native.forward = tapped
    llm.generate([prompt + [9]], SamplingParams(max_tokens=1, temperature=0.0))
    assert seen["out"] is not None and ran[-2:] == [seen["rows"]] * 2  # the expert layers
    assert all(t is not None and t.shape == (seen["rows"], 64) for t in taps.values())
