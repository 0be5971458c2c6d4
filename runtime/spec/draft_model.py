"""Draft with a separate small model that shares the target's tokenizer (for instance a
smaller model of the same family, quantized with the same recipe into the artifact's
`draft/` directory by `qserve quantize --draft model:SOURCE`).

Options: path (a qserve artifact, HF checkpoint directory, .gguf or built-in name).
Its KV cache holds as many tokens as the target's, FP8 when the draft is an artifact with
k/v scales and the target's cache is FP8, else bf16.
"""

from __future__ import annotations

from ..kv_cache import KVCache, KVCacheSpec
from .model_proposer import ModelDraftProposer
from .proposer import SpeculativeConfig, register_proposer


def check_same_tokenizer(target_tok, draft_tok) -> None:
    """Raise ValueError unless both tokenizers map the same strings to the same ids."""
    a, b = target_tok.hf.get_vocab(with_added_tokens=True), draft_tok.hf.get_vocab(
        with_added_tokens=True)
    if a != b:
        diff = len(set(a.items()) ^ set(b.items()))
        raise ValueError(f"the draft model's tokenizer differs from the target's ({len(b)} vs "
                         f"{len(a)} tokens, {diff} entries differ); a draft model must share "
                         "the target's tokenizer.")


@register_proposer("draft_model")
def build(config: SpeculativeConfig, target, kv_cache: KVCache, decode_impl=None,
          execution=None, **_) -> ModelDraftProposer:
    """`execution`: the engine's ExecutionBackend (None: the CPU torch backend); off the
    CPU backend the draft is placed on its device like the target."""
    from ..loaded_model import LoadedModel, load

    src = config.options.get("path") or config.options.get("model")
    if isinstance(src, LoadedModel):
        draft = src
    elif src:
        draft = load(str(src), target.dtype)
    else:
        raise ValueError("the draft_model proposer needs a draft model: `--speculative "
                         "draft_model:PATH`, or an artifact quantized with `--draft model:SOURCE`.")
    check_same_tokenizer(target.tokenizer, draft.tokenizer)
    if draft.model.config.vocab_size != target.model.config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.model.config.vocab_size}) differs "
                         f"from the target's ({target.model.config.vocab_size}).")
    cfg = draft.model.config
    dtype = "fp8" if kv_cache.spec.dtype == "fp8" and draft.kv_scales else "bf16"
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_cache.block_size, dtype,
                       values_in_keys=getattr(cfg, "mla", None) is not None)
    if execution is not None and not execution.cpu_native:
        from ..layers.placement import place_on_device

        place_on_device(draft.model, execution)
    cache = KVCache(spec, kv_cache.blocks_per_group, draft.kv_scales if dtype == "fp8" else None,
                    kv_cache.device)
    return ModelDraftProposer(draft.model, cache, decode_impl,
                              kernels=None if execution is None else execution.kernels)
