"""Tiny random checkpoints with a real (tiny) tokenizer, built inside tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch


class Bf16KV:
    """Reference attention that rounds K/V to bf16, as the engine's bf16 KV pool stores
    them (an fp32 model otherwise keeps fp32 K/V, and near-ties may flip)."""

    def __init__(self, inner):
        self.inner = inner

    def forward(self, spec, q, k, v, meta):
        k, v = (t.to(torch.bfloat16).to(t.dtype) for t in (k, v))
        return self.inner.forward(spec, q, k, v, meta)


def write_tiny_tokenizer(root: Path, vocab_size: int = 300) -> None:
    """A byte-level BPE trained on a few sentences, with <s>/</s> special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. " * 4,
                             "Python is a programming language; def f(x): return x"] * 10, trainer)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))


def write_tiny_llama(root: Path, seed: int = 0, **overrides) -> Path:
    """A 2-layer Llama with GQA, random weights, saved as an HF checkpoint directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    cfg = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.save_pretrained(root, safe_serialization=True)
    write_tiny_tokenizer(root, cfg["vocab_size"])
    return root


def write_tiny_fp8_artifact(root: Path, seed: int = 0) -> Path:
    """A tiny Llama quantized by `qserve quantize` (4 calibration rows of 64 tokens, fp32):
    a real FP8 artifact at `root` for tests that serve one. Its source is beside it."""
    from qserve.quantize.pipeline import quantize
    from qserve.quantize.recipe import recipe_from_dict

    src = write_tiny_llama(root.parent / f"{root.name}-source", seed=seed)
    quantize(str(src), root, recipe_from_dict({"calibration": {"num_samples": 4,
                                                               "seq_len": 64}}),
             dtype=torch.float32)
    return root


def write_tiny_qwen(root: Path, version: int = 3, seed: int = 0) -> Path:
    """A 2-layer Qwen 3 (per-head q/k RMSNorm, no biases) or Qwen 2 (q/k/v biases) with
    random weights."""
    import transformers

    root.mkdir(parents=True, exist_ok=True)
    config_cls = getattr(transformers, f"Qwen{version}Config")
    model_cls = getattr(transformers, f"Qwen{version}ForCausalLM")
    cfg = config_cls(vocab_size=300, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=512, tie_word_embeddings=False,
                     bos_token_id=0, eos_token_id=1, **({"head_dim": 16} if version == 3 else {}))
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # visible biases (transformers starts them at zero)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(root, safe_serialization=True)
    write_tiny_tokenizer(root, 300)
    return root


def write_tiny_gemma3(root: Path, seed: int = 0, sliding_window: int = 20,
                      max_position_embeddings: int = 512) -> Path:
    """A 3-layer Gemma 3 text model (sliding, global, sliding) with random weights."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    root.mkdir(parents=True, exist_ok=True)
    cfg = Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=sliding_window, max_position_embeddings=max_position_embeddings,
        bos_token_id=0,
        eos_token_id=1, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    torch.manual_seed(seed)
    Gemma3ForCausalLM(cfg).eval().save_pretrained(root, safe_serialization=True)
    write_tiny_tokenizer(root, 300)
    return root


def write_tiny_hidden_draft_head(path: Path, lm, num_tokens: int | None = None,
                                 seed: int = 0, tap_layers: tuple[int, ...] = ()) -> Path:
    """An untrained hidden-state draft head (runtime/spec/hidden_draft.py) for a loaded
    model: random weights, its LM head rows copied from the model's for the first
    `num_tokens` token ids (default: all); `tap_layers`: the target layers it also reads
    (a random, non-zero fusion). Its drafts are mostly wrong: tests of what happens to
    drafts, not of how good they are."""
    from safetensors.torch import save_file

    from qserve.runtime.spec.hidden_draft import HiddenDraftHead

    cfg = lm.model.config
    n = num_tokens or cfg.vocab_size
    torch.manual_seed(seed)
    head = HiddenDraftHead(cfg.hidden_size, 2 * cfg.hidden_size, torch.arange(n), tap_layers)
    head.lm_head.weight.data.copy_(lm.model.lm_head.weight.detach()[:n].float())
    if head.taps is not None:
        torch.nn.init.normal_(head.taps.fc.weight, std=0.1)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(path))
    return path


def spec_engine_config(spec=None, **overrides):
    """The engine the speculative-decoding tests compare (fp32 tiny model, bf16 KV, eager
    attention, 8-token steps so prompts are chunked); `spec`: a SpeculativeConfig or None."""
    from qserve.runtime.engine import EngineConfig

    base = dict(num_kv_blocks=64, max_num_batched_tokens=8, kv_dtype="bf16", decode_impl="eager",
                speculative=spec)
    base.update(overrides)
    return EngineConfig(**base)


def spec_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n random prompts for a 300-token tiny model, every other one starting with the same
    20 tokens (prefix hits), then one repetitive prompt (n-gram drafts get accepted)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(2, 300, (20,), generator=g).tolist()
    out = []
    for i in range(n):
        tail = torch.randint(2, 300, (int(torch.randint(1, 30, (1,), generator=g)),),
                             generator=g).tolist()
        out.append((shared if i % 2 == 0 else []) + tail)
    out.append([7, 8, 9, 10] * 5)
    return out


def write_tiny_deepseek(root: Path, version: int = 3, seed: int = 0, **overrides) -> Path:
    """A 3-layer DeepSeek-V2/V3 (latent attention; layer 0 dense, then mixtures of 8
    experts with a shared one) with random weights, as transformers writes it."""
    import transformers

    root.mkdir(parents=True, exist_ok=True)
    cfg = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
               n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
               first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8,
               qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=None,
               max_position_embeddings=512, bos_token_id=0, eos_token_id=1)
    if version == 3:
        cfg.update(n_group=4, topk_group=2, norm_topk_prob=True)
    cfg.update(overrides)
    config = getattr(transformers, f"DeepseekV{version}Config")(**cfg)
    torch.manual_seed(seed)
    model = getattr(transformers, f"DeepseekV{version}ForCausalLM")(config).eval()
    with torch.no_grad():  # larger than the init's 0.02 std: routing and attention matter
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(root, safe_serialization=True)
    write_tiny_tokenizer(root, cfg["vocab_size"])
    return root
