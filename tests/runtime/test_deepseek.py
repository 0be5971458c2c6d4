"""DeepSeek-V2/V3 (latent attention, experts) against transformers, and on the engine's
latent paged cache: fp32 logits within 1e-4 in both attention forms, greedy
continuations identical, the cache holding only c_kv and the RoPE key."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from qserve.runtime.attention import AttentionMetadata, ContiguousCacheAttention, DenseAttention
from qserve.runtime.engine import EngineConfig
from qserve.runtime.formats.checkpoint import open_checkpoint
from qserve.runtime.formats.errors import CheckpointError
from qserve.runtime.generate import GenerationParams, generate
from qserve.runtime.llm import LLM
from qserve.runtime.loaded_model import load
from qserve.runtime.models.loader import load_model
from qserve.runtime.models.registry import config_from_hf
from qserve.runtime.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import Bf16KV, write_tiny_deepseek  # noqa: E402

transformers = pytest.importorskip("transformers")

TOL = 1e-4
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707}
# name -> (version, overrides); each covers something the others do not
CASES = {
    "v2_greedy": (2, {}),
    "v2_group_limited": (2, dict(q_lora_rank=24, topk_method="group_limited_greedy",
                                 n_group=4, topk_group=2)),
    "v3_yarn_q_lora": (3, dict(q_lora_rank=24, rope_parameters=YARN, max_position_embeddings=64)),
    "v3_rope_halves": (3, dict(rope_interleave=False, n_group=2, topk_group=1,
                               norm_topk_prob=False)),
}
LENGTHS = (13, 6, 1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    torch.set_num_threads(1)
    out = {}
    for case, (version, overrides) in CASES.items():
        path = write_tiny_deepseek(tmp_path_factory.mktemp(case), version, **overrides)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="eager", dtype=torch.float32).eval()
        out[case] = (path, hf)
    return out


def _prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, 300, (n,), generator=g) for n in LENGTHS]


def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:  # [L] -> [L, vocab] fp32
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0].float()


@pytest.mark.parametrize("case", list(CASES))
def test_both_attention_forms_match_transformers(checkpoints, case):
    """Expanded per head (DenseAttention) and absorbed over the latent (a caching backend),
    a flat batch of three sequences."""
    path, hf = checkpoints[case]
    model = load_model(open_checkpoint(path), dtype=torch.float32)
    prompts = _prompts()
    ids = torch.cat(prompts)
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    meta = AttentionMetadata.from_lengths([len(p) for p in prompts])
    expected = torch.cat([_hf_logits(hf, p) for p in prompts])
    for attn in (DenseAttention(), ContiguousCacheAttention()):
        with torch.no_grad():
            logits = model.compute_logits(model(ids, positions, meta, attn))
        assert (logits - expected).abs().max().item() < TOL, type(attn).__name__
    assert model.model.layers[0].mlp.__class__.__name__ == "GatedMLP"  # first_k_dense_replace
    assert model.model.layers[1].mlp.__class__.__name__ == "MoE"


def test_incremental_decode_caches_only_the_latent(checkpoints):
    """Chunked prefill then one token per step through a KV cache: each step's logits
    equal transformers' full-sequence ones, and what the cache holds per token is the
    latent c_kv plus the RoPE key (kv_lora_rank + qk_rope_head_dim values), not per-head
    keys and values."""
    path, hf = checkpoints["v3_yarn_q_lora"]
    model = load_model(open_checkpoint(path), dtype=torch.float32)
    prompt = _prompts()[0]
    expected = _hf_logits(hf, prompt)
    cache = ContiguousCacheAttention()
    done = 0
    while done < len(prompt):
        n = 4 if done == 0 else 1
        meta = AttentionMetadata.from_lengths([n], [done], seq_ids=(0,))
        with torch.no_grad():
            logits = model.compute_logits(model(prompt[done:done + n],
                                                torch.arange(done, done + n), meta, cache))
        assert (logits - expected[done:done + n]).abs().max().item() < TOL
        done += n
    k, v = cache._kv[(0, 2)]
    assert tuple(k.shape) == (len(prompt), 1, 32 + 8) and torch.equal(k, v)


def test_greedy_engine_equals_transformers_with_prefix_hits_and_preemption(checkpoints):
    """Greedy continuations: our step-by-step generation (fp32, absorbed form over a
    cache) equals transformers.generate; the engine's latent paged cache (one pool per
    layer, no V pool; bf16) with chunked prefill, prefix hits and preemption equals the
    same generation with K/V rounded to bf16 as its pool stores them."""
    path, hf = checkpoints["v2_greedy"]
    lm = load(str(path), torch.float32)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(2, 300, (20,), generator=g).tolist()
    prompts = [shared + torch.randint(2, 300, (n,), generator=g).tolist() for n in (3, 9, 14)]
    n_new = 12
    with torch.no_grad():
        hf_tokens = [hf.generate(torch.tensor([p]), max_new_tokens=n_new, do_sample=False,
                                 min_new_tokens=n_new)[0, len(p):].tolist() for p in prompts]
    gen = GenerationParams(max_new_tokens=n_new)
    assert [list(generate(lm.model, p, gen)) for p in prompts] == hf_tokens
    want = [list(generate(lm.model, p, gen, Bf16KV)) for p in prompts]
    params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    for blocks in (64, 14):  # room for all; too small for all three at once
        llm = LLM(lm, config=EngineConfig(num_kv_blocks=blocks, block_size=4,
                                          max_num_batched_tokens=8, kv_dtype="bf16",
                                          decode_impl="eager"))
        spec = llm.engine.kv_cache.spec
        assert spec.values_in_keys and (spec.num_kv_heads, spec.head_dim) == (1, 40)
        assert spec.bytes_per_token == 3 * 40 * 2  # layers x (R + P) x bf16, no V
        layer = llm.engine.kv_cache.layer(0)
        assert layer.v_pool is layer.k_pool
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == want
        engine = llm.engine
        assert engine.blocks.prefix_stats[0] > 0
        if blocks == 14:
            assert engine.scheduler.num_preemptions > 0
        assert engine.blocks.num_free_blocks == blocks


def test_fp8_latent_cache_engine_equals_fp8_reference(tmp_path):
    """`qserve quantize` on a DeepSeek checkpoint (every expert calibrated, kv_b_proj's
    input observed though decode never runs it), then the engine over the FP8 latent
    pool: the same greedy tokens as the step-by-step reference through FP8 K/V."""
    from qserve.quantize.pipeline import quantize
    from qserve.quantize.recipe import recipe_from_dict
    from qserve.runtime.fp8_kv_attention import Fp8KVAttention

    src = write_tiny_deepseek(tmp_path / "src", 3)
    out = tmp_path / "fp8"
    quantize(str(src), out, recipe_from_dict({"calibration": {"num_samples": 4,
                                                              "seq_len": 32}}),
             dtype=torch.float32)
    lm = load(str(out), torch.float32)
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] \
        if (out / "model.safetensors.index.json").exists() else None
    attn = lm.model.model.layers[1].self_attn
    assert type(attn.kv_b_proj).__name__ == "Fp8Linear" and attn.kv_b_proj.input_scale > 0
    expert = lm.model.model.layers[2].mlp.experts[7].down_proj
    assert type(expert).__name__ == "Fp8Linear" and expert.input_scale > 0
    assert lm.model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert names is None or "model.layers.1.self_attn.k_scale" in names
    prompts = [list(range(2, 2 + n)) for n in (5, 21)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(lm, config=EngineConfig(num_kv_blocks=32, max_num_batched_tokens=8,
                                      decode_impl="eager"))
    assert llm.engine.kv_cache.spec.bytes_per_token == 3 * 40  # FP8: one byte per value
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        ref = generate(lm.model, p, GenerationParams(max_new_tokens=8),
                       lambda inner: Fp8KVAttention(inner, lm.kv_scales))
        assert o.token_ids == list(ref)


BASE = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
        "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "rms_norm_eps": 1e-6}


@pytest.mark.parametrize("edit, key", [
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"topk_method": "random"}, "topk_method"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"n_group": 3}, "n_group"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ({"kv_lora_rank": 0}, "kv_lora_rank"),
    # a converted model's RoPE pairs: a list per layer of qk_rope_head_dim / 2 indices
    # into a table of rope_pair_dim, with RoPE in halves
    ({"rope_pairs": [[0, 1, 2, 3]] * 3}, "rope_pair_dim"),
    ({"rope_pairs": [[0, 1, 2, 3]] * 3, "rope_pair_dim": 16}, "rope_pairs.*rope_interleave"),
    ({"rope_pairs": [[0, 1, 2, 3]] * 2, "rope_pair_dim": 16, "rope_interleave": False},
     "rope_pairs.*3 lists"),
    ({"rope_pairs": [[0, 1, 2, 8]] * 3, "rope_pair_dim": 16, "rope_interleave": False},
     r"rope_pairs.*in \[0, 8\)"),
])
def test_unsupported_deepseek_fields_are_named(edit, key):
    with pytest.raises(CheckpointError, match=key):
        config_from_hf({**BASE, **edit})


def test_config_reads_latent_layout():
    cfg = config_from_hf(BASE)
    assert (cfg.num_kv_heads, cfg.head_dim) == (1, 40)
    assert cfg.mla.rope_interleave and cfg.moe.topk_method == "noaux_tc"
    assert cfg.attn_scale == pytest.approx(24 ** -0.5)
    dense = config_from_hf({**BASE, "first_k_dense_replace": 3})
    assert dense.moe is None


@pytest.mark.parametrize("name", ["ngram", "early_exit"])
def test_speculation_on_the_latent_cache_changes_no_token(checkpoints, name):
    """Speculative decoding over the latent cache (the early-exit draft's own cache is a
    latent one too): greedy tokens equal the non-speculative engine's, blocks all back."""
    from qserve.runtime.spec.proposer import make_config

    from tiny_models import spec_engine_config, spec_prompts

    lm = load(str(checkpoints["v3_rope_halves"][0]), torch.float32)
    prompts = spec_prompts(4)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = LLM(lm, config=spec_engine_config()).generate(prompts, params)
    opts = {"ngram": {"min_n": 1}, "early_exit": {"num_layers": 1}}[name]
    llm = LLM(lm, config=spec_engine_config(make_config(name, 3, **opts)))
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    stats = llm.engine.stats()
    assert stats.spec.proposed > 0 and stats.kv_blocks_free == stats.kv_blocks_total
