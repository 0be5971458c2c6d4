"""KVCache memory layout, and PagedAttentionBackend against the contiguous-cache backend.

The backend runs chunked prefill then decode of two sequences through a tiny Llama and
must give the logits of ContiguousCacheAttention: bf16 pools in an fp32 model within 1e-5
(bf16 storage of fp32 K/V is the only difference, so the model's K/V are first rounded to
bf16 on both sides), FP8 pools within 1e-5 of Fp8KVAttention(ContiguousCacheAttention).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from qserve.kernels.fp8 import FP8_DTYPE
from qserve.runtime.attention import AttentionSpec, ContiguousCacheAttention
from qserve.runtime.fp8_kv_attention import Fp8KVAttention
from qserve.runtime.kv_cache import KVCache, KVCacheSpec
from qserve.runtime.paged_attention_backend import PagedAttentionBackend, PagedAttentionMetadata


def test_spec_sizes():
    spec = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M
    assert spec.bytes_per_token == 11_520
    assert KVCacheSpec(30, 3, 64, dtype="bf16").bytes_per_token == 23_040
    assert spec.bytes_per_block == 11_520 * 16
    assert spec.num_blocks_for(11_520 * 16 * 7 + 5) == 7 and spec.num_blocks_for(0) == 0
    for bad in (dict(dtype="fp16"), dict(block_size=0), dict(num_layers=-1)):
        with pytest.raises(ValueError):
            KVCacheSpec(**{**dict(num_layers=2, num_kv_heads=1, head_dim=4), **bad})


def test_cache_allocation_and_scales():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=8, block_size=4)
    scales = {0: (torch.tensor([0.1]), torch.tensor(0.2)),
              1: (torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.3]))}
    cache = KVCache.for_budget(spec, spec.bytes_per_block * 5, scales)
    assert cache.num_blocks == 5 and cache.nbytes == spec.bytes_per_block * 5
    layer = cache.layer(1)
    assert layer.k_pool.shape == (5, 4, 3, 8) and layer.k_pool.dtype == FP8_DTYPE
    assert layer.k_pool.element_size() == 1 and layer.k_scale.shape == (3,)
    assert cache.layer(0).v_scale.shape == (1,) and cache.layer(0).v_scale.dtype == torch.float32
    assert layer.k_pool.data_ptr() != layer.v_pool.data_ptr()
    bf = KVCache(KVCacheSpec(2, 3, 8, 4, "bf16"), 3)
    assert bf.layer(0).k_pool.dtype == torch.bfloat16 and bf.layer(0).k_scale is None
    with pytest.raises(ValueError, match="missing layers"):
        KVCache(spec, 5, {0: scales[0]})
    with pytest.raises(ValueError, match="FP8 KV cache only"):
        KVCache(KVCacheSpec(2, 3, 8, 4, "bf16"), 3, scales)
    with pytest.raises(ValueError, match="per kv head"):
        KVCache(spec, 5, {0: scales[0], 1: (torch.ones(2), torch.ones(1))})
    with pytest.raises(ValueError, match="> 0"):
        KVCache(spec, 5, {0: scales[0], 1: (torch.zeros(1), torch.ones(1))})
    with pytest.raises(ValueError, match="positive"):
        KVCache.for_budget(spec, 10, scales)
    with pytest.raises(ValueError, match="out of range"):
        cache.layer(2)


class _Blocks:
    """Hands out shuffled block ids per sequence (stand-in for the block manager)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.free = torch.randperm(num_blocks).tolist()
        self.bs = block_size
        self.tables: dict[int, list[int]] = {}

    def meta(self, steps: list[tuple[int, int, int]]) -> PagedAttentionMetadata:
        """steps: (seq_id, context_len, query_len) per sequence of this step."""
        tables = []
        for sid, ctx, n in steps:
            table = self.tables.setdefault(sid, [])
            while len(table) * self.bs < ctx + n:
                table.append(self.free.pop())
            tables.append(table)
        return PagedAttentionMetadata.build([n for _, _, n in steps], [c for _, c, _ in steps],
                                            tables, self.bs, tuple(s for s, _, _ in steps))


class _Bf16Round:
    """Rounds K/V to bf16 (what a bf16 pool stores) before the inner backend sees them."""

    def __init__(self, inner):
        self.inner = inner

    def forward(self, spec, q, k, v, meta):
        return self.inner.forward(spec, q, k.to(torch.bfloat16).to(k.dtype),
                                  v.to(torch.bfloat16).to(v.dtype), meta)


# Two sequences: prompts 13 and 7 tokens; step 1 prefills 8 of the first and all of the
# second, step 2 finishes the first prompt beside the second's decode, then both decode.
SCHEDULE = [[(0, 0, 8), (1, 0, 7)], [(0, 8, 5), (1, 7, 1)], [(0, 13, 1), (1, 8, 1)],
            [(1, 9, 1), (0, 14, 1)], [(0, 15, 1), (1, 10, 1)]]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    pytest.importorskip("transformers")
    from qserve.runtime.formats.checkpoint import open_checkpoint
    from qserve.runtime.models.loader import load_model
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_models import write_tiny_llama

    path = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), hidden_size=96,
                            num_attention_heads=6, num_key_value_heads=2)  # GQA 3
    return load_model(open_checkpoint(path), dtype=torch.float32)


def _run(model, backend, blocks, ids):
    out = []
    for step in SCHEDULE:
        meta = blocks.meta(step)
        toks = torch.cat([ids[sid][ctx:ctx + n] for sid, ctx, n in step])
        pos = torch.cat([torch.arange(ctx, ctx + n) for _, ctx, n in step])
        with torch.inference_mode():
            out.append(model.compute_logits(model(toks, pos, meta, backend)))
    return torch.cat(out)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("impl", ["eager", "chunked"])
def test_backend_matches_contiguous_cache(tiny_model, kv_dtype, impl):
    cfg = tiny_model.config
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size=4,
                       dtype=kv_dtype)
    ids = {0: torch.randint(0, cfg.vocab_size, (16,)), 1: torch.randint(0, cfg.vocab_size, (11,))}
    if kv_dtype == "fp8":
        scales = {i: (torch.rand(cfg.num_kv_heads) * 0.02 + 0.01, torch.rand(1) * 0.02 + 0.01)
                  for i in range(cfg.num_layers)}
        cache = KVCache(spec, 16, scales)
        reference = Fp8KVAttention(ContiguousCacheAttention(), scales)
    else:
        cache = KVCache(spec, 16)
        reference = _Bf16Round(ContiguousCacheAttention())
    paged = _run(tiny_model, PagedAttentionBackend(cache, decode_impl=impl), _Blocks(16, 4), ids)
    dense = _run(tiny_model, reference, _Blocks(16, 4), ids)
    assert torch.allclose(paged, dense, atol=1e-5, rtol=0), (paged - dense).abs().max()


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_backend_sliding_window_and_softcap(kv_dtype):
    """A windowed, soft-capped layer over several steps, against ContiguousCacheAttention."""
    spec = AttentionSpec(layer_idx=0, num_heads=4, num_kv_heads=1, head_dim=8, scale=0.5,
                         sliding_window=3, logit_softcap=5.0)
    scales = {0: (torch.tensor([0.01]), torch.tensor([0.01]))} if kv_dtype == "fp8" else None
    cache = KVCache(KVCacheSpec(1, 1, 8, 4, kv_dtype), 12, scales)
    paged = PagedAttentionBackend(cache, decode_impl="eager")
    ref = ContiguousCacheAttention()
    if kv_dtype == "fp8":
        ref = Fp8KVAttention(ref, scales)
    blocks = _Blocks(12, 4)
    for step in SCHEDULE:
        meta = blocks.meta(step)
        t = int(meta.query_start_loc[-1])
        q, k, v = torch.randn(t, 4, 8), torch.randn(t, 1, 8), torch.randn(t, 1, 8)
        if kv_dtype == "bf16":
            k, v = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
        got = paged.forward(spec, q, k, v, meta)
        want = ref.forward(spec, q, k, v, meta)
        assert torch.allclose(got, want, atol=1e-5, rtol=0)


def test_backend_rejects_plain_metadata():
    from qserve.runtime.attention import AttentionMetadata

    cache = KVCache(KVCacheSpec(1, 1, 8, 4, "bf16"), 2)
    spec = AttentionSpec(0, 2, 1, 8, 1.0)
    x = torch.randn(1, 1, 8)
    with pytest.raises(ValueError, match="PagedAttentionMetadata"):
        PagedAttentionBackend(cache).forward(spec, torch.randn(1, 2, 8), x, x,
                                             AttentionMetadata.single(1))
    with pytest.raises(ValueError, match="seq_lens"):
        PagedAttentionMetadata(query_start_loc=torch.tensor([0, 1]),
                               context_lens=torch.tensor([0]), slot_mapping=torch.tensor([0]),
                               block_tables=torch.zeros(1, 1, dtype=torch.int32),
                               seq_lens=torch.tensor([3]))


def test_a_latent_cache_has_one_pool_read_with_one_scale_and_refuses_two():
    """MLA (values_in_keys): one stored vector per token, so K and V are one pool and one
    scale; calibrated k and v scales that differ cannot both read it."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=40, dtype="fp8",
                       values_in_keys=True)
    same = {0: (torch.tensor([0.02]), torch.tensor([0.02])),
            1: (torch.tensor([0.05]), torch.tensor([0.05]))}
    cache = KVCache(spec, 4, same)
    assert spec.pools_per_slot == 1
    for i, scale in ((0, 0.02), (1, 0.05)):
        layer = cache.layer(i)
        assert layer.k_pool is layer.v_pool and layer.k_scale is layer.v_scale
        assert layer.k_scale.tolist() == pytest.approx([scale])
    other = {**same, 1: (torch.tensor([0.05]), torch.tensor([0.04]))}
    with pytest.raises(ValueError, match=r"layer 1: a latent KV cache stores one vector per "
                                         r"token, so k_scale .* and v_scale .* must be equal"):
        KVCache(spec, 4, other)
    # a GQA cache keeps two pools and two scales
    two = KVCache(KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=40, dtype="fp8"), 4, other)
    assert two.layer(1).k_pool is not two.layer(1).v_pool
    assert two.layer(1).v_scale.tolist() == pytest.approx([0.04])


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("block_size,heads,dim", [(4, 2, 8), (1, 1, 6), (1, 1, 3), (3, 1, 5)])
def test_whole_blocks_move_bit_exactly_whatever_their_byte_width(dtype, block_size, heads,
                                                                 dim):
    """Whole blocks are read and written as rows of the widest integer that divides a
    block's bytes (8, 4, 2 or 1); the bytes are those of byte-wise indexing, and a block
    and its slots (a transfer's tail) still move byte-wise."""
    from qserve.runtime.kv_cache import LayerKV

    g = torch.Generator().manual_seed(0)
    shape = (6, block_size, heads, dim)

    def pool(blocks=6):  # random bytes (NaN patterns included: only bytes matter here)
        last = dim * (2 if dtype == "bf16" else 1)
        raw = torch.randint(0, 256, (blocks, *shape[1:-1], last), dtype=torch.uint8,
                            generator=g)
        return raw.view(torch.bfloat16 if dtype == "bf16" else FP8_DTYPE)

    kv = LayerKV(pool(), pool(), None, None)
    idx = torch.tensor([4, 1, 3])
    k, v = kv.read(idx)
    assert k.dtype == kv.k_pool.dtype and k.shape == (3, *kv.k_pool.shape[1:])
    assert torch.equal(k.view(torch.uint8), kv.k_pool.view(torch.uint8)[idx])
    assert torch.equal(v.view(torch.uint8), kv.v_pool.view(torch.uint8)[idx])
    new_k = pool(3)
    want = kv.k_pool.view(torch.uint8).clone()
    want[idx] = new_k.view(torch.uint8)
    kv.write(idx, new_k, v)
    assert torch.equal(kv.k_pool.view(torch.uint8), want)
    tail_k, _ = kv.read((idx[0], torch.arange(block_size)))  # a block and its slots
    assert torch.equal(tail_k.view(torch.uint8), want[4, :block_size])
