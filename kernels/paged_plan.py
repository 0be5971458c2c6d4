"""The layout of one engine step over a paged KV cache, validated once and shared by all
layers (torch path).

Every layer of a step stores its new K/V into the same slots and attends over the same
block tables; only q/k/v, the pools and the scales differ per layer. `PagedStepPlan`
checks the step's slot mapping, block tables, query starts and sequence lengths once
(those checks read tensor values, so each costs a host sync) and keeps the derived index
tensors, so `store_kv(..., plan=)` and `paged_attention(..., plan=)` do only per-layer
work. Without a plan both kernels build one themselves, so their contract is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedStepPlan:
    num_tokens: int  # T, rows of q/k/v
    num_blocks: int  # pool blocks the plan was checked against
    block_size: int
    # store: the tokens that are written (slot != -1) and their slots
    store_rows: torch.Tensor | None  # [T'] bool mask over T, None when every token is stored
    store_slots: torch.Tensor  # [T'] int64, distinct, < num_blocks * block_size
    # attention
    query_start_loc: torch.Tensor  # [B + 1] int64
    query_lens: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, context incl. the new tokens
    block_tables: torch.Tensor  # [B, max_need] int64, unused entries -> block 0
    decode_rows: torch.Tensor  # [Bd] int64 rows of q that are one-token sequences
    decode_block_tables: torch.Tensor  # [Bd, nb] int64 contiguous, nb = blocks the longest reads
    decode_seq_lens: torch.Tensor  # [Bd] int64
    all_decode: bool  # every sequence brings exactly one token, in row order
    prefills: tuple[tuple[int, int, int, int], ...]  # (sequence, first row, rows, seq_len)

    @classmethod
    def build(cls, num_tokens: int, num_blocks: int, block_size: int,
              slot_mapping: torch.Tensor | None = None,
              block_tables: torch.Tensor | None = None,
              query_start_loc: torch.Tensor | None = None,
              seq_lens: torch.Tensor | None = None) -> "PagedStepPlan":
        """Checks the slots (store) when given, and the layout (attention) when given."""
        store_rows, store_slots = _check_slots(slot_mapping, num_tokens, num_blocks, block_size)
        if block_tables is None:  # a store-only plan: no sequences to attend for
            none = torch.zeros(0, dtype=torch.int64)
            return cls(num_tokens, num_blocks, block_size, store_rows, store_slots,
                       torch.zeros(1, dtype=torch.int64), none, none,
                       torch.zeros(0, 0, dtype=torch.int64), none,
                       torch.zeros(0, 0, dtype=torch.int64), none, all_decode=False,
                       prefills=())
        qsl, qlens, seq, bt = _check_layout(num_tokens, num_blocks, block_size, block_tables,
                                            query_start_loc, seq_lens)
        decode = (qlens == 1).nonzero().flatten()
        nb = int(((seq[decode] + block_size - 1) // block_size).max()) if decode.numel() else 0
        starts, lens, seqs = qsl.tolist(), qlens.tolist(), seq.tolist()
        prefills = tuple((b, starts[b], n, seqs[b]) for b, n in enumerate(lens) if n > 1)
        return cls(
            num_tokens, num_blocks, block_size, store_rows, store_slots, qsl, qlens, seq, bt,
            qsl[decode], bt[decode][:, :nb].contiguous(), seq[decode],
            all_decode=decode.numel() == num_tokens == len(lens), prefills=prefills)

    def check_for(self, num_tokens: int, num_blocks: int, block_size: int) -> None:
        """The plan must describe this call's flat batch and pool geometry."""
        if (num_tokens, num_blocks, block_size) != (self.num_tokens, self.num_blocks,
                                                    self.block_size):
            raise ValueError(
                f"the step plan was built for {self.num_tokens} tokens over {self.num_blocks} "
                f"blocks of {self.block_size}; this call has {num_tokens} tokens over "
                f"{num_blocks} blocks of {block_size}. Build the plan for this step's pools.")


def _check_slots(slot_mapping, num_tokens, num_blocks, block_size):
    if slot_mapping is None:
        return None, torch.empty(0, dtype=torch.int64)
    if slot_mapping.dtype not in (torch.int64, torch.int32) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be int64 of shape [{num_tokens}], got "
                         f"{slot_mapping.dtype} {list(slot_mapping.shape)}.")
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    rows = None
    if not bool(keep.all()):
        if bool((slots < -1).any()):
            raise ValueError("slot_mapping holds values below -1; use -1 to skip a token.")
        rows, slots = keep, slots[keep]
    if slots.numel() and int(slots.max()) >= num_blocks * block_size:
        raise ValueError(f"slot_mapping holds slot {int(slots.max())}, beyond the pool's "
                         f"{num_blocks} blocks x {block_size} = {num_blocks * block_size} slots.")
    if torch.unique(slots).numel() != slots.numel():
        raise ValueError("slot_mapping writes the same slot twice; each token needs its own slot.")
    return rows, slots


def _check_layout(num_tokens, num_blocks, block_size, block_tables, query_start_loc, seq_lens):
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc),
                    ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}.")
    if block_tables.dim() != 2 or seq_lens.dim() != 1 or query_start_loc.dim() != 1:
        raise ValueError("expected block_tables [B, max_blocks], query_start_loc [B + 1] and "
                         f"seq_lens [B]; got {list(block_tables.shape)}, "
                         f"{list(query_start_loc.shape)}, {list(seq_lens.shape)}.")
    b = seq_lens.shape[0]
    if query_start_loc.shape[0] != b + 1 or block_tables.shape[0] != b:
        raise ValueError(f"batch sizes disagree: seq_lens has {b} sequences, query_start_loc "
                         f"{query_start_loc.shape[0]} entries (want B + 1), block_tables "
                         f"{block_tables.shape[0]} rows.")
    qsl = query_start_loc.to(torch.int64)
    qlens = qsl[1:] - qsl[:-1]
    if b and (int(qsl[0]) != 0 or int(qsl[-1]) != num_tokens or bool((qlens < 0).any())):
        raise ValueError(f"query_start_loc must rise from 0 to num_tokens={num_tokens}, got "
                         f"{query_start_loc.tolist()}.")
    seq = seq_lens.to(torch.int64)
    if bool((seq < qlens).any()):
        raise ValueError("seq_lens must include the new tokens (seq_lens >= query lengths); got "
                         f"seq_lens {seq.tolist()}, query lengths {qlens.tolist()}.")
    need = (seq + block_size - 1) // block_size  # [B] blocks each sequence reads
    max_need = int(need.max()) if b else 0
    if max_need > block_tables.shape[1]:
        raise ValueError(f"block_tables has {block_tables.shape[1]} columns but a sequence of "
                         f"{int(seq.max())} tokens needs {max_need} blocks of {block_size}.")
    used = block_tables[:, :max_need].to(torch.int64)
    in_use = torch.arange(max_need) < need[:, None]
    if bool((in_use & ((used < 0) | (used >= num_blocks))).any()):
        raise ValueError(f"block_tables holds block ids outside [0, {num_blocks}) in the blocks "
                         f"a sequence reads.")
    return qsl, qlens, seq, torch.where(in_use, used, 0)  # padding -> block 0 (masked out)
