"""Drafting with a (small) language model over its own paged KV cache.

Shared by the draft-model and early-exit proposers. Per request the proposer remembers
which tokens its cache holds; each call it rolls back to the longest prefix they share
with the request's committed tokens (drafts the target rejected are thereby dropped),
feeds the rest, and then runs k - 1 single-token steps, batching all requests in every
forward pass. Greedy requests get argmax drafts; sampled requests get drafts drawn from
the draft's sampling distribution q (same temperature/top-k/top-p/min-p as the target),
returned with q for the rejection sampler.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..block_manager import BlockManager
from ..kv_cache import KVCache
from ..paged_attention_backend import PagedAttentionBackend, PagedAttentionMetadata
from .proposer import Proposal, Proposer, ProposeRequest
from .rejection_sampler import draw, sampling_probs


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ModelDraftProposer(Proposer):
    """`model(ids [T], positions [T], meta, attn) -> hidden [T, H]` with
    `model.compute_logits(hidden) -> [T, V] fp32`, over `kv_cache` (one layer per layer
    the model runs, indexed by each attention layer's layer_idx). The draft runs where
    its KV cache is, with the engine's kernels: the model must already be there."""

    any_device = True
    runs_model = True

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, decode_impl: str | None = None,
                 seed: int = 0, kernels: str | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.blocks = BlockManager(kv_cache.num_blocks, kv_cache.block_size, namespace="draft")
        self.backend = PagedAttentionBackend(kv_cache, decode_impl, kernels)
        # drafts of sampled requests are drawn on the draft's device
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self._cached: dict[str, list[int]] = {}  # request id -> tokens whose KV we hold

    def release(self, request_id: str) -> None:
        if self.blocks.has_request(request_id):
            self.blocks.free(request_id)
        self._cached.pop(request_id, None)

    def _prepare(self, b: ProposeRequest) -> tuple[int, list[int]] | None:
        """Slots for the request's pending tokens and its drafts: (first position to feed,
        block table), or None (and the request forgotten) when the pool is full."""
        rid, toks = b.request.request_id, b.request.all_token_ids
        cover = len(toks) + b.num_drafts - 1  # committed tokens, then drafts 1..k-1
        if not self.blocks.has_request(rid):
            alloc = self.blocks.allocate(rid, toks, cover)
            if alloc is None:
                return None
            return alloc.num_cached_tokens, alloc.block_table
        start = min(common_prefix(self._cached[rid], toks), len(toks) - 1)
        table = self.blocks.append_slots(rid, toks, cover - start, start)
        if table is None:
            self.release(rid)
            return None
        return start, table

    @torch.inference_mode()
    def _forward(self, chunks: list[list[int]], starts: list[int],
                 tables: list[list[int]]) -> torch.Tensor:  # [len(chunks), V] fp32
        ids, positions, last = [], [], []
        for chunk, start in zip(chunks, starts):
            ids += chunk
            positions += range(start, start + len(chunk))
            last.append(len(ids) - 1)
        meta = PagedAttentionMetadata.build([len(c) for c in chunks], starts, tables,
                                            self.kv_cache.block_size,
                                            seq_ids=tuple(range(len(chunks))))
        hidden = self.model(torch.tensor(ids, dtype=torch.int64).to(self.device),
                            torch.tensor(positions, dtype=torch.int64).to(self.device), meta,
                            self.backend)
        return self.model.compute_logits(hidden[torch.tensor(last, device=self.device)])

    def _pick(self, logits: torch.Tensor, params) -> tuple[int, torch.Tensor | None]:
        """A draft from logits [V]: argmax for greedy, else drawn from q (returned)."""
        if params.is_greedy:
            return int(logits.argmax()), None
        q = sampling_probs(logits.unsqueeze(0), params)[0]  # [V] fp32
        return draw(q, self.generator), q

    def propose(self, batch: Sequence[ProposeRequest]) -> list[Proposal]:
        """Mutates the draft cache and the per-request record of what it holds."""
        live = []  # [batch index, request, block table, tokens to feed, first position]
        for i, b in enumerate(batch):
            prep = self._prepare(b)
            if prep is not None:
                start, table = prep
                live.append((i, b, table, b.request.all_token_ids[start:], start))
        drafts: dict[int, list[int]] = {e[0]: [] for e in live}
        probs: dict[int, list[torch.Tensor | None]] = {e[0]: [] for e in live}
        for i, b, *_ in live:
            self._cached[b.request.request_id] = list(b.request.all_token_ids)
        while live:  # step 1 feeds the pending tokens, later steps the last draft
            logits = self._forward([e[3] for e in live], [e[4] for e in live],
                                   [e[2] for e in live])
            nxt = []
            for (i, b, table, chunk, start), row in zip(live, logits):
                token, q = self._pick(row, b.request.params)
                drafts[i].append(token)
                probs[i].append(q)
                if len(drafts[i]) < b.num_drafts:
                    self._cached[b.request.request_id].append(token)  # its KV is written next
                    nxt.append((i, b, table, [token], start + len(chunk)))
            live = nxt
        out = []
        for i in range(len(batch)):
            qs = probs.get(i, [])
            stacked = torch.stack(qs) if qs and qs[0] is not None else None  # [k, V]
            out.append(Proposal(drafts.get(i, []), stacked))
        return out
