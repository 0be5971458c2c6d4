"""GQA -> MLA conversion (`qserve quantize --mla`): exact at full rank with RoPE kept on
every kv head, DeepSeek-V3's layout read by transformers with our logits, the FP8 artifact
served on the latent cache, and the refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qserve.quantize.mla_convert import (MLAConversionError, build_converted, check_convertible,
                                         choose_rope_slots, convert_state, converted_config,
                                         has_q_bias, input_covariances, layer_factors,
                                         rope_pairs_of, rope_slot_scores)
from qserve.quantize.mla_distill import distill_attention, distill_model, mean_kl
from qserve.quantize.mla_stage import convert_source, rope_slots, rows_not_in
from qserve.quantize.pipeline import quantize
from qserve.quantize.recipe import MLAScheme, RecipeError, recipe_from_dict
from qserve.runtime.attention import AttentionMetadata, ContiguousCacheAttention, DenseAttention
from qserve.runtime.formats.checkpoint import open_checkpoint
from qserve.runtime.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama, write_tiny_qwen  # noqa: E402

transformers = pytest.importorskip("transformers")
TOL = 1e-4


def _source(root: Path, family: str):
    """A tiny Llama or Qwen 2 (q/k/v biases) — 4 heads, 2 kv heads of 16 — with weights
    large enough that attention is far from uniform, and calibration rows."""
    torch.set_num_threads(1)
    path = (write_tiny_llama(root / "src") if family == "llama"
            else write_tiny_qwen(root / "src", version=2))
    model = load_model(open_checkpoint(path), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2, generator=g)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(path / "model.safetensors"))  # the checkpoint the stage reads
    rows = torch.randint(2, 300, (6, 48), generator=g)
    return path, model, rows


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return _source(tmp_path_factory.mktemp("mla"), "llama")


@pytest.fixture(scope="module")
def qwen2_source(tmp_path_factory):
    return _source(tmp_path_factory.mktemp("mla-qwen2"), "qwen2")


@pytest.fixture(params=["llama", "qwen2"])
def any_source(request):
    return request.getfixturevalue("source" if request.param == "llama" else "qwen2_source")


def _logits(model, ids, attn):
    meta = AttentionMetadata.from_lengths([ids.numel()], seq_ids=(0,))
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(ids.numel()), meta, attn))


def _convert(path, model, rows, rank, rope_heads, select="heads"):
    cfg = model.config
    sigmas = input_covariances(model, rows)
    slots = rope_slots(model, sigmas, MLAScheme(rope_heads=rope_heads, rope_select=select))
    factors = [layer_factors(layer, s, cfg, rope_heads, slots=slot)
               for layer, s, slot in zip(model.backbone.layers, sigmas, slots)]
    rank = rank or factors[0].wz.shape[0]
    state, _ = convert_state(model, factors, rank)
    config = converted_config(json.loads((path / "config.json").read_text()), cfg, rank,
                              rope_heads, has_q_bias(factors[0]), rope_pairs_of(factors))
    return build_converted(config, state, torch.float32), config


def test_full_rank_with_rope_on_every_kv_head_is_exact(any_source):
    """RoPE kept on both (mixed) kv heads and the latent at full rank: the converted model's
    logits equal the source's, in the expanded and the absorbed (cached) form — the head
    mixing commutes with RoPE and the latent norm is linear through its constant (Qwen 2:
    its q/k/v biases too, the q bias through q_a_proj)."""
    path, model, rows = any_source
    converted, config = _convert(path, model, rows, None, 2)
    assert config["architectures"] == ["QserveMLAForCausalLM"]  # DeepSeek cannot say it
    ids = rows[0, :30]
    want = _logits(model, ids, DenseAttention())
    for attn in (DenseAttention(), ContiguousCacheAttention()):
        assert (_logits(converted, ids, attn) - want).abs().max().item() < TOL


def test_rope_on_every_pair_slot_at_full_rank_is_exact(any_source):
    """RoPE kept on every (frequency pair, mixed head) slot, as one table of the slots'
    frequencies per layer: the same function as the source, in both attention forms — the
    slots' order in the RoPE key, the queries' and the q bias path's follow the table."""
    path, model, rows = any_source
    converted, config = _convert(path, model, rows, None, 2, "pairs")
    assert config["architectures"] == ["QserveMLAForCausalLM"]
    assert config["rope_pair_dim"] == 16 and all(sorted(p) == sorted(list(range(8)) * 2)
                                                 for p in config["rope_pairs"])
    ids = rows[0, :30]
    want = _logits(model, ids, DenseAttention())
    for attn in (DenseAttention(), ContiguousCacheAttention()):
        assert (_logits(converted, ids, attn) - want).abs().max().item() < TOL
    # layer-local distillation reads each layer's own table: every layer already matches
    fits = distill_attention(model, converted, rows[:2, :24], 0, 1e-4)
    assert max(f.before for f in fits) < 1e-9


def test_per_layer_pairs_run_on_each_layers_table(any_source, tmp_path):
    """One kv head's worth of slots chosen per layer: the layers' tables differ, the model
    names one RoPE table per distinct choice, and the written checkpoint loads back with
    the in-memory model's logits (in both forms). Its error is below RoPE dropped from the
    second mixed head whole, on the rows it was fitted to (the choice keeps the slots that
    cost the most)."""
    path, model, rows = any_source
    converted, config = _convert(path, model, rows, None, 1, "pairs")
    pairs = config["rope_pairs"]
    assert len(pairs) == 2 and all(len(p) == 8 for p in pairs) and pairs[0] != pairs[1]
    kinds = [layer.rope_kind for layer in converted.backbone.layers]
    assert kinds == ["pairs0", "pairs1"]
    # each layer's table: its pairs' columns (in halves) of the source head's table
    from qserve.runtime.layers.rotary import rope_inv_freq

    ropes = converted.backbone.ropes(torch.arange(5), torch.float32)
    angles = torch.arange(5.0)[:, None] * rope_inv_freq(16, model.config.rope)[pairs[1]]
    assert ropes["pairs1"][0].shape == (5, 16) and set(ropes) == {"pairs0", "pairs1"}
    assert torch.allclose(ropes["pairs1"][0], torch.cat((angles, angles), 1).cos())
    assert torch.allclose(ropes["pairs1"][1], torch.cat((angles, angles), 1).sin())
    out = tmp_path / "conv"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in converted.state_dict().items()
               if not k.endswith("inv_freq")}, str(out / "model.safetensors"))
    loaded = load_model(open_checkpoint(out), dtype=torch.float32)
    ids = rows[1, :40]
    want = _logits(model, ids, DenseAttention())
    mine = _logits(converted, ids, DenseAttention())
    for attn in (DenseAttention(), ContiguousCacheAttention()):
        assert (_logits(loaded, ids, attn) - mine).abs().max().item() < TOL
    heads, _ = _convert(path, model, rows, None, 1, "heads")
    assert (mine - want).abs().mean() < (_logits(heads, ids, DenseAttention()) - want).abs().mean()


def test_choose_rope_slots_spends_the_slots_where_dropping_rope_costs_most():
    """Per layer, that layer's top slots, sorted by (pair, mixed head)."""
    a = torch.tensor([[5.0, 4.0], [1.0, 0.0], [0.0, 0.0]])  # [pairs, mixed heads]
    b = torch.tensor([[0.0, 5.0], [4.0, 1.0], [0.0, 3.0]])
    assert choose_rope_slots([a, b], 2) == [[(0, 0), (0, 1)], [(0, 1), (1, 0)]]
    assert choose_rope_slots([a, b], 3) == [[(0, 0), (0, 1), (1, 0)], [(0, 1), (1, 0), (2, 1)]]


def test_slot_scores_follow_the_rotation_within_the_span(source):
    """rope_slot_scores: zero nowhere the keys and queries have energy, and a pair's
    score rises with the span (the rotation turns further), the fastest pair's least."""
    path, model, rows = source
    sigma = input_covariances(model, rows)[0]
    short = rope_slot_scores(model.backbone.layers[0], sigma, model.config, 4)
    long = rope_slot_scores(model.backbone.layers[0], sigma, model.config, 4096)
    assert short.shape == (8, 2) and (short > 0).all()
    growth = (long / short).sum(1)  # [pairs]
    assert (growth >= 1).all() and growth[-1] > growth[0]


def test_deepseek_layout_is_read_by_transformers_with_our_logits(any_source, tmp_path):
    """rope_heads 1 at a reduced rank: written as DeepseekV3ForCausalLM by the quantize
    stage, transformers' DeepseekV3 loads it and gives our logits; the latent is smaller
    than the source's K/V and not exact (RoPE dropped from one mixed head). Qwen 2's q bias
    makes it use the q_lora path (q_lora_rank = 4 x 16 + 1)."""
    path, model, rows = any_source
    out = tmp_path / "converted"
    report = convert_source(path, MLAScheme(rank=31), rows, rows[:2, :32], out,
                            lambda msg: None)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    q_lora = None if model.config.architecture == "LlamaForCausalLM" else 65
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["q_lora_rank"]) \
        == (32, 16, q_lora)
    assert report.cache_values == 31 + 1 + 16 and report.full_rank == 16 + 32
    assert report.kv_bytes_per_token == 2 * 48 < report.gqa_bf16_bytes_per_token
    ours = load_model(open_checkpoint(out), dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = rows[1, :40]
    with torch.no_grad():
        theirs = hf(input_ids=ids[None]).logits[0]
    assert (_logits(ours, ids, ContiguousCacheAttention()) - theirs).abs().max().item() < TOL
    assert (_logits(ours, ids, DenseAttention()) - _logits(model, ids, DenseAttention())
            ).abs().max().item() > 1e-3


def test_distillation_lowers_each_layers_error(any_source):
    """Llama, and Qwen 2 whose q bias goes through q_a -> norm -> q_b (q_b trains)."""
    path, model, rows = any_source
    converted, _ = _convert(path, model, rows, 24, 1)
    fits = distill_attention(model, converted, rows[:4], steps=30, lr=3e-3)
    assert len(fits) == 2 and all(f.after < 0.8 * f.before for f in fits)
    meta = AttentionMetadata.from_lengths([20], seq_ids=(0,))  # absorbed form rebuilt
    ids = rows[0, :20]
    with torch.no_grad():
        a = converted(ids, torch.arange(20), meta, DenseAttention())
        b = converted(ids, torch.arange(20), meta, ContiguousCacheAttention())
    assert (a - b).abs().max().item() < 1e-4


def test_whole_model_distillation_lowers_the_kl_and_trains_only_attention(source):
    """distill_model: the next-token KL against the source falls on the training rows; only
    the attention projections move, the latent's constant row stays (its norm stays
    linear), and the absorbed form is rebuilt from the new weights. (Random weights and
    tokens have nothing to generalise: held-out text is measured on the real model, by
    runtime/benchmark/mla_quality.py.)"""
    path, model, rows = source
    converted, _ = _convert(path, model, rows, 24, 1)
    before = {k: v.clone() for k, v in converted.state_dict().items()}
    fit = distill_model(model, converted, rows[:4], steps=40, lr=3e-3)
    assert (fit.steps, fit.rows) == (40, 4)
    assert fit.kl_after < 0.8 * fit.kl_before
    assert abs(mean_kl(model, converted, rows[:4]) - fit.kl_after) < 1e-6
    after = converted.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(k.split(".")[-2] in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                              "o_proj") for k in moved), moved
    for i, layer in enumerate(converted.backbone.layers):
        w = layer.self_attn.kv_a_proj_with_mqa.weight
        constant = layer.self_attn.kv_a_layernorm.weight.shape[0] - 1
        key = [k for k in before if k.endswith(f"layers.{i}.self_attn.kv_a_proj_with_mqa.weight")]
        assert torch.equal(w[constant], before[key[0]][constant])
    assert all(not p.requires_grad for p in converted.parameters())
    meta = AttentionMetadata.from_lengths([20], seq_ids=(0,))
    ids = rows[0, :20]
    with torch.no_grad():
        a = converted(ids, torch.arange(20), meta, DenseAttention())
        b = converted(ids, torch.arange(20), meta, ContiguousCacheAttention())
    assert (a - b).abs().max().item() < 1e-4


def test_stage_runs_both_distillations_and_reports_each(source, tmp_path):
    path, _, rows = source
    report = convert_source(path, MLAScheme(rank=23, distill_steps=5, distill_model_steps=6,
                                            distill_model_rows=3, distill_model_lr=1e-3),
                            rows, rows[4:], tmp_path / "converted", lambda msg: None)
    d = report.model_distill
    assert (d["steps"], d["rows"], d["lr"]) == (6, 3, 1e-3) and d["kl_after"] < d["kl_before"]
    assert report.ppl_increase_before_distill is not None
    assert report.ppl_increase_after_layer_distill is not None
    assert "after the layer-local stage" in report.table()
    assert "whole-model distillation: 6 steps over 3 rows of 48 tokens" in report.table()


def test_stage_never_trains_on_held_out_rows():
    cal = torch.arange(24).view(6, 4)
    held = torch.stack([cal[1], torch.tensor([90, 91, 92, 93]), cal[4]])
    assert torch.equal(rows_not_in(cal, held), cal[[0, 2, 3, 5]])
    assert rows_not_in(cal, held[1:2]) is cal


def test_quantize_mla_artifact_serves_on_the_fp8_latent_cache(source, tmp_path):
    """`quantize` with mla: the artifact is DeepSeek-V3 layout FP8 with the conversion in
    its manifest; the engine caches rank + 1 + RoPE-key bytes per token and layer and its
    greedy tokens equal the step-by-step reference through FP8 K/V."""
    from qserve.runtime.engine import EngineConfig
    from qserve.runtime.fp8_kv_attention import Fp8KVAttention
    from qserve.runtime.generate import GenerationParams, generate
    from qserve.runtime.llm import LLM
    from qserve.runtime.loaded_model import load
    from qserve.runtime.sampling_params import SamplingParams

    path, _, _ = source
    out = tmp_path / "fp8"
    recipe = recipe_from_dict({"calibration": {"num_samples": 4, "seq_len": 32},
                               "mla": {"rank": 15, "num_samples": 4, "seq_len": 32}})
    report = quantize(str(path), out, recipe, dtype=torch.float32)
    manifest = json.loads((out / "qserve.json").read_text())
    assert manifest["mla"]["rank"] == 15 and manifest["source"]["architecture"] == \
        "LlamaForCausalLM"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert not list(tmp_path.glob(".fp8.mla-*"))  # the scratch checkpoint is gone
    assert report.mla.rank == 15
    lm = load(str(out), torch.float32)
    llm = LLM(lm, config=EngineConfig(num_kv_blocks=32, max_num_batched_tokens=8,
                                      decode_impl="eager"))
    assert llm.engine.kv_cache.spec.bytes_per_token == 2 * (15 + 1 + 16)
    prompts = [list(range(2, 2 + n)) for n in (5, 19)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for p, o in zip(prompts, llm.generate(prompts, params)):
        ref = generate(lm.model, p, GenerationParams(max_new_tokens=6),
                       lambda inner: Fp8KVAttention(inner, lm.kv_scales))
        assert o.token_ids == list(ref)


def test_whole_model_distillation_reads_long_rows_off_the_held_out_text(source, tmp_path,
                                                                       monkeypatch):
    """`quantize` with whole-model distillation: its rows are `distill_model_seq_len` long
    (capped at the model's context), drawn from calibration text the held-out rows do not
    cover; the manifest says how long they were."""
    import qserve.quantize.pipeline as pipeline

    drawn = []
    real = pipeline.load_calibration_set

    def recording(*args, **kwargs):
        drawn.append((kwargs.get("seed"), real(*args, **kwargs)))
        return drawn[-1][1]
    monkeypatch.setattr(pipeline, "load_calibration_set", recording)
    path, _, _ = source
    context = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    recipe = recipe_from_dict({"calibration": {"num_samples": 4, "seq_len": 32},
                               "mla": {"rank": 15, "num_samples": 4, "seq_len": 32,
                                       "distill_model_steps": 2, "distill_model_rows": 3,
                                       "distill_model_seq_len": 10 * context}})
    report = quantize(str(path), tmp_path / "fp8", recipe, dtype=torch.float32)
    assert report.mla.model_distill["row_tokens"] == context
    assert report.mla.model_distill["rows"] == 3
    held = [d for seed, d in drawn if seed == 1]
    long = [d for seed, d in drawn if d.seq_len in (context - 1, context)]  # BOS first?
    assert len(held) == 1 and len(long) == 1
    held_tokens = {t for s, e in held[0].spans for t in range(s, e)}
    assert not held_tokens & {t for s, e in long[0].spans for t in range(s, e)}


def test_refusals_name_the_problem_and_write_nothing(source, tmp_path):
    path, model, rows = source
    qwen = write_tiny_qwen(tmp_path / "qwen", version=3)
    out = tmp_path / "never"
    recipe = recipe_from_dict({"calibration": {"num_samples": 2, "seq_len": 32},
                               "mla": {"rank": 8, "num_samples": 2, "seq_len": 32}})
    with pytest.raises(MLAConversionError, match="Qwen3ForCausalLM.*q/k norms"):
        quantize(str(qwen), out, recipe, dtype=torch.float32)
    assert not out.exists() and not list(tmp_path.glob(".never*"))
    with pytest.raises(MLAConversionError, match=r"rank must be between 1 and 48"):
        check_convertible(model, 1, 49)
    with pytest.raises(MLAConversionError, match="between 1 and the model's 2 kv heads"):
        check_convertible(model, 3, 8)
    with pytest.raises(RecipeError, match="mla.rank and mla.auto"):
        recipe_from_dict({"mla": {"rank": 8, "auto": True}})
    with pytest.raises(RecipeError, match="mla.rope_heads must be >= 1"):
        recipe_from_dict({"mla": {"rank": 8, "rope_heads": 0}})
    with pytest.raises(RecipeError, match="mla.distill_model_steps must be >= 0"):
        recipe_from_dict({"mla": {"rank": 8, "distill_model_steps": -1}})
    with pytest.raises(RecipeError, match="mla.distill_model_rows must be >= 1"):
        recipe_from_dict({"mla": {"rank": 8, "distill_model_rows": 0}})
    with pytest.raises(RecipeError, match="mla.distill_model_seq_len must be >= 16"):
        recipe_from_dict({"mla": {"rank": 8, "distill_model_seq_len": 8}})
    with pytest.raises(RecipeError, match=r"mla.distill_model_lr must be in \(0, 1\)"):
        recipe_from_dict({"mla": {"rank": 8, "distill_model_lr": 2.0}})
    with pytest.raises(RecipeError, match="mla.rope_select must be one of heads, pairs"):
        recipe_from_dict({"mla": {"rank": 8, "rope_select": "some"}})
    with pytest.raises(RecipeError, match="mla.rope_span must be >= 1"):
        recipe_from_dict({"mla": {"rank": 8, "rope_select": "pairs", "rope_span": 0}})


def test_rank_search_bisects_to_the_smallest_rank_within_budget():
    """Ranks are multiples of 16 minus 1 (the latent plus its constant align), then full;
    a budget even the full rank misses names what would work."""
    from qserve.quantize.mla_stage import _search_rank

    measured = []

    def increase(rank):  # falls with the rank
        measured.append(rank)
        return 2.0 / rank

    searched = []
    assert _search_rank(increase, 100, 0.05, searched, lambda m: None) == 47
    assert [r for r, _ in searched] == sorted(measured) and 100 in measured
    assert len(measured) <= 5  # bisection over 7 candidates
    with pytest.raises(MLAConversionError, match=r"no rank meets mla.budget \+1.0%.*"
                                                 r"full rank 100 measures \+2.00%"):
        _search_rank(increase, 100, 0.01, [], lambda m: None)


@pytest.mark.parametrize("args, message", [
    (["--mla-budget", "5%"], "add --mla RANK or --mla auto"),
    (["--mla-distill-model", "50"], "add --mla RANK or --mla auto"),
    (["--mla-rope-select", "pairs"], "add --mla RANK or --mla auto"),
    (["--mla", "x"], "give a positive latent rank"),
    (["--mla", "0"], "give a positive latent rank"),
    (["--mla", "63", "--mla-budget", "5%"], "--mla-budget applies to --mla auto"),
    (["--mla", "auto", "--mla-budget", "lots"], "give a percentage"),
])
def test_cli_refuses_bad_mla_options_before_any_work(tmp_path, args, message):
    from click.testing import CliRunner

    from qserve.runtime.cli import main

    out = tmp_path / "art"
    result = CliRunner().invoke(main, ["quantize", "smollm2-135m", "--out", str(out), *args])
    assert result.exit_code != 0 and message in result.output
    assert not out.exists()
