"""Our model implementations against transformers, on tiny random checkpoints.

Each case builds a tiny HF model from a config (never downloaded), randomises every
weight (norm weights too, so Gemma's 1 + w matters), saves it as safetensors, loads it
with open_checkpoint + load_model, and checks our fp32 logits against transformers':
on a flat batch of sequences of different lengths (DenseAttention) and by incremental
decoding through ContiguousCacheAttention.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from qserve.runtime.formats.checkpoint import open_checkpoint
from qserve.runtime.formats.errors import CheckpointError, UnsupportedArchitectureError
from qserve.runtime.attention import AttentionMetadata, ContiguousCacheAttention, DenseAttention
from qserve.runtime.models.config import ModelConfig
from qserve.runtime.models.loader import load_model
from qserve.runtime.models.registry import config_from_hf, get_model_class, supported_architectures

transformers = pytest.importorskip("transformers")

TOL = 1e-4
VOCAB = 96
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6)
GEMMA3_TEXT = {**TINY, "num_hidden_layers": 3, "sliding_window": 4, "query_pre_attn_scalar": 8,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}

# name -> (HF config class, kwargs); each covers something the others do not.
CASES = {
    "llama": ("LlamaConfig", {**TINY, "rope_parameters": LLAMA3_ROPE}),
    "llama_tied": ("LlamaConfig", {**TINY, "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {**TINY, "sliding_window": 4}),
    "qwen2": ("Qwen2Config", {**TINY, "num_hidden_layers": 3, "use_sliding_window": True,
                              "sliding_window": 4, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {**TINY, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                          "rope_theta": 5000.0}}),
    "gemma3": ("Gemma3TextConfig", GEMMA3_TEXT),
    "gemma3_multimodal": ("Gemma3Config", dict(
        text_config=GEMMA3_TEXT, mm_tokens_per_image=4, image_token_index=VOCAB - 1,
        boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
        vision_config=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, image_size=28,
                           patch_size=14))),
}
LENGTHS = (11, 6, 1)  # a flat batch of sequences of different lengths, longer than the window


def _make_hf(case: str):
    config_cls, kwargs = CASES[case]
    config = getattr(transformers, config_cls)(**kwargs)
    multimodal = case == "gemma3_multimodal"
    auto = "AutoModelForImageTextToText" if multimodal else "AutoModelForCausalLM"
    model_cls = getattr(transformers, auto)
    torch.manual_seed(0)
    model = model_cls.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.25)
            if name.endswith("norm.weight") and not case.startswith("gemma3"):
                p.add_(1.0)  # Llama-style norms scale by w; Gemma by 1 + w
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (checkpoint dir, HF model); built once per module."""
    out = {}
    for case in CASES:
        model = _make_hf(case)
        path = tmp_path_factory.mktemp(case)
        model.save_pretrained(path, safe_serialization=True)
        out[case] = (path, model)
    return out


def _prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB - 4, (n,), generator=g) for n in LENGTHS]


def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:  # [L] -> [L, vocab] fp32
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0].float()


@pytest.mark.parametrize("case", list(CASES))
def test_flat_batch_matches_transformers(checkpoints, case):
    path, hf = checkpoints[case]
    model = load_model(open_checkpoint(path), dtype=torch.float32)
    prompts = _prompts()
    ids = torch.cat(prompts)  # [T] int64
    positions = torch.cat([torch.arange(len(p)) for p in prompts])  # [T] int64
    meta = AttentionMetadata.from_lengths([len(p) for p in prompts])
    with torch.no_grad():
        hidden = model(ids, positions, meta, DenseAttention())
        logits = model.compute_logits(hidden)
    assert hidden.shape == (ids.numel(), 32) and logits.dtype == torch.float32
    expected = torch.cat([_hf_logits(hf, p) for p in prompts])
    assert (logits - expected).abs().max().item() < TOL


@pytest.mark.parametrize("case", list(CASES))
def test_incremental_decode_matches_full_forward(checkpoints, case):
    """Chunked prefill then one token per step, sequences batched together, through a
    KV cache: every step's logits equal transformers' full-sequence logits."""
    path, hf = checkpoints[case]
    model = load_model(open_checkpoint(path), dtype=torch.float32)
    prompts = _prompts()
    expected = [_hf_logits(hf, p) for p in prompts]
    cache = ContiguousCacheAttention()
    done = [0] * len(prompts)
    step = 0
    while any(d < len(p) for d, p in zip(done, prompts)):
        # first step: a chunk of up to 3 tokens per sequence; afterwards one token each
        take = [min(3 if step == 0 else 1, len(p) - d) for d, p in zip(done, prompts)]
        live = [b for b, n in enumerate(take) if n > 0]
        ids = torch.cat([prompts[b][done[b]:done[b] + take[b]] for b in live])
        positions = torch.cat([torch.arange(done[b], done[b] + take[b]) for b in live])
        meta = AttentionMetadata.from_lengths([take[b] for b in live], [done[b] for b in live],
                                              seq_ids=tuple(live))
        with torch.no_grad():
            logits = model.compute_logits(model(ids, positions, meta, cache))
        want = torch.cat([expected[b][done[b]:done[b] + take[b]] for b in live])
        assert (logits - want).abs().max().item() < TOL, f"step {step}"
        for b in live:
            done[b] += take[b]
        step += 1
    assert [cache.cached_len(b, layer_idx=1) for b in range(len(prompts))] == list(LENGTHS)


def test_specs_and_names(checkpoints):
    gemma = load_model(open_checkpoint(checkpoints["gemma3"][0]), dtype=torch.float32)
    specs = gemma.attention_specs
    assert [s.sliding_window for s in specs] == [4, None, 4]
    assert [s.layer_idx for s in specs] == [0, 1, 2]
    assert specs[0].scale == 8 ** -0.5
    assert gemma.lm_head.weight is gemma.model.embed_tokens.weight  # tied
    assert gemma.model.rotary_emb.rope.theta == 1_000_000.0
    assert gemma.model.rotary_emb_local.rope.theta == 10_000.0
    qwen2 = load_model(open_checkpoint(checkpoints["qwen2"][0]), dtype=torch.float32)
    assert [s.sliding_window for s in qwen2.attention_specs] == [None, 4, 4]
    names = {n for n, _ in qwen2.named_parameters()}
    assert {"model.layers.0.self_attn.q_proj.bias", "lm_head.weight"} <= names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    assert isinstance(qwen2.model.layers[0].mlp.gate_proj, torch.nn.Linear)


def test_bf16_load(checkpoints):
    path, hf = checkpoints["gemma3"]
    model = load_model(open_checkpoint(path))  # default dtype bf16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = _prompts()[0]
    with torch.no_grad():
        logits = model.compute_logits(
            model(ids, torch.arange(len(ids)), AttentionMetadata.single(len(ids)), DenseAttention()))
    assert logits.dtype == torch.float32
    assert (logits - _hf_logits(hf, ids)).abs().max().item() < 0.5  # bf16 rounding only


# --- errors -------------------------------------------------------------------------------


def _copy_checkpoint(src, dst, edit):
    """Copy a checkpoint dir, passing its tensors dict through `edit`."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    save_file(edit(tensors), dst / "model.safetensors")
    return dst


def test_wrong_shape_names_file_tensor_and_shapes(checkpoints, tmp_path):
    src = checkpoints["llama"][0]
    name = "model.layers.1.self_attn.k_proj.weight"

    def edit(t):
        t[name] = torch.zeros(8, 32)
        return t

    path = _copy_checkpoint(src, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as err:
        load_model(open_checkpoint(path))
    msg = str(err.value)
    assert str(path / "model.safetensors") in msg and name in msg
    assert "[8, 32]" in msg and "[16, 32]" in msg


def test_missing_tensor_is_named(checkpoints, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    path = _copy_checkpoint(checkpoints["llama"][0], tmp_path / "bad",
                            lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=rf"missing 1 tensor.*'{name}'"):
        load_model(open_checkpoint(path))


def test_untied_checkpoint_without_lm_head_is_missing_it(checkpoints, tmp_path):
    path = _copy_checkpoint(checkpoints["llama"][0], tmp_path / "bad",
                            lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    with pytest.raises(CheckpointError, match="'lm_head.weight'"):
        load_model(open_checkpoint(path))


def test_unexpected_tensor_is_an_error_but_inv_freq_is_ignored(checkpoints, tmp_path):
    src = checkpoints["llama"][0]
    extra = "model.layers.0.self_attn.rotary_emb.inv_freq"
    ok = _copy_checkpoint(src, tmp_path / "ok", lambda t: {**t, extra: torch.ones(4)})
    load_model(open_checkpoint(ok), dtype=torch.float32)
    bad = _copy_checkpoint(src, tmp_path / "bad", lambda t: {**t, "model.extra.weight": torch.ones(4)})
    with pytest.raises(CheckpointError, match="does not use: 'model.extra.weight'"):
        load_model(open_checkpoint(bad))


def test_unsupported_architecture_lists_supported(checkpoints, tmp_path):
    src = checkpoints["llama"][0]
    path = _copy_checkpoint(src, tmp_path / "bad", lambda t: t)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_model(open_checkpoint(path))
    msg = str(err.value)
    assert "'FalconForCausalLM'" in msg and str(path / "config.json") in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
        assert arch in msg and arch in supported_architectures()


# --- config.json normalisation ------------------------------------------------------------

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 16,
        "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2}


def test_missing_required_key_names_config_and_key():
    raw = {k: v for k, v in BASE.items() if k != "hidden_size"}
    with pytest.raises(CheckpointError, match=r"/ckpt/config.json: missing required key 'hidden_size'"):
        config_from_hf(raw, "/ckpt/config.json")


def test_bad_values_name_the_key():
    with pytest.raises(CheckpointError, match=r"'num_key_value_heads'.*does not divide"):
        config_from_hf({**BASE, "num_key_value_heads": 3})
    with pytest.raises(CheckpointError, match=r"config.json: key 'hidden_act'.*'relu2'"):
        config_from_hf({**BASE, "hidden_act": "relu2"})
    with pytest.raises(CheckpointError, match=r"'vocab_size': expected an integer"):
        config_from_hf({**BASE, "vocab_size": "10"})


def test_unsupported_rope_type_is_named():
    raw = {**BASE, "rope_scaling": {"type": "dynamic", "factor": 4.0}}
    with pytest.raises(CheckpointError,
                       match=r"rope type 'dynamic' is not supported.*linear, llama3, yarn"):
        config_from_hf(raw)
    raw = {**BASE, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    with pytest.raises(CheckpointError, match=r"'yarn' needs a number "
                                              r"'original_max_position_embeddings'"):
        config_from_hf(raw)


def test_legacy_config_styles():
    old_llama = config_from_hf({**BASE, "rope_theta": 500000.0, "tie_word_embeddings": True,
                                "eos_token_id": [5, 6], "rope_scaling": {
                                    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}})
    assert (old_llama.rope.type, old_llama.rope.theta, old_llama.rope.factor) == ("llama3", 500000.0, 8.0)
    assert old_llama.head_dim == 8 and old_llama.num_kv_heads == 2 and old_llama.tie_word_embeddings
    assert old_llama.eos_token_ids == (5, 6) and old_llama.sliding_windows == (None, None)
    # Gemma 3 as written by older transformers: rope_local_base_freq, sliding_window_pattern,
    # rope_scaling for the global layers only; vocab_size/head_dim left to the defaults.
    gemma = config_from_hf({**BASE, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 7,
                            "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1,
                            "sliding_window": 512, "sliding_window_pattern": 3,
                            "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert gemma.sliding_windows == (512, 512, None, 512, 512, None, 512)
    assert gemma.rope.theta == 1_000_000.0 and gemma.rope.type == "linear"
    assert gemma.rope_local.theta == 10_000.0 and gemma.rope_local.type == "default"
    assert gemma.head_dim == 256 and gemma.attn_scale == 256 ** -0.5
    assert gemma.embedding_scale == 8.0 and gemma.hidden_act == "gelu_pytorch_tanh"
    # Mistral slides every layer; Qwen only with use_sliding_window.
    mistral = config_from_hf({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4})
    assert mistral.sliding_windows == (4, 4)
    qwen = config_from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4})
    assert qwen.sliding_windows == (None, None) and qwen.qkv_bias and not qwen.o_bias


def test_multimodal_gemma_config_reads_text_config():
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
           "text_config": {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}}
    cfg = config_from_hf(raw, "/m/config.json")
    assert isinstance(cfg, ModelConfig) and cfg.eos_token_ids == (1, 106) and cfg.num_heads == 8
    with pytest.raises(CheckpointError, match=r"/m/config.json: missing required key 'text_config.hidden_size'"):
        config_from_hf({**raw, "text_config": {"intermediate_size": 96, "num_hidden_layers": 2}},
                       "/m/config.json")


def test_registry_lookup():
    assert get_model_class("Qwen3ForCausalLM").__name__ == "Qwen3ForCausalLM"
    with pytest.raises(UnsupportedArchitectureError, match="Supported architectures: DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Gemma3"):
        get_model_class("NopeForCausalLM")
