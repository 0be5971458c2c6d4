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
        decode = [b for b, n in enumerate(qlens) if n == 1]
        nb = max([(seq[b] + block_size - 1) // block_size for b in decode], default=0)
        prefills = tuple((b, qsl[b], n, seq[b]) for b, n in enumerate(qlens) if n > 1)
        return cls(
            num_tokens, num_blocks, block_size, store_rows, store_slots, _i64(qsl),
            _i64(qlens), _i64(seq), _i64(bt, (len(bt), len(bt[0]) if bt else 0)),
            _i64([qsl[b] for b in decode]),
            _i64([bt[b][:nb] for b in decode], (len(decode), nb)),
            _i64([seq[b] for b in decode]),
            all_decode=len(decode) == num_tokens == len(qlens), prefills=prefills)

    def check_for(self, num_tokens: int, num_blocks: int, block_size: int) -> None:
        """The plan must describe this call's flat batch and pool geometry."""
        if (num_tokens, num_blocks, block_size) != (self.num_tokens, self.num_blocks,
                                                    self.block_size):
            raise ValueError(
                f"the step plan was built for {self.num_tokens} tokens over {self.num_blocks} "
                f"blocks of {self.block_size}; this call has {num_tokens} tokens over "
                f"{num_blocks} blocks of {block_size}. Build the plan for this step's pools.")


def _i64(values: list, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """An int64 tensor of a host list (nested for 2-D; `shape` keeps empty dimensions)."""
    t = torch.tensor(values, dtype=torch.int64)
    return t if shape is None else t.reshape(shape)


# The checks read the step's small index tensors once as host lists: a decode step's plan
# is then a few tensor conversions, not dozens of tiny torch ops each with its dispatch.
def _check_slots(slot_mapping, num_tokens, num_blocks, block_size):
    if slot_mapping is None:
        return None, torch.empty(0, dtype=torch.int64)
    if slot_mapping.dtype not in (torch.int64, torch.int32) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be int64 of shape [{num_tokens}], got "
                         f"{slot_mapping.dtype} {list(slot_mapping.shape)}.")
    slots = slot_mapping.tolist()
    rows = None
    if slots and min(slots) < 0:
        if min(slots) < -1:
            raise ValueError("slot_mapping holds values below -1; use -1 to skip a token.")
        rows = slot_mapping >= 0
        slots = [s for s in slots if s >= 0]
    if slots and max(slots) >= num_blocks * block_size:
        raise ValueError(f"slot_mapping holds slot {max(slots)}, beyond the pool's "
                         f"{num_blocks} blocks x {block_size} = {num_blocks * block_size} slots.")
    if len(set(slots)) != len(slots):
        raise ValueError("slot_mapping writes the same slot twice; each token needs its own slot.")
    return rows, _i64(slots)


def _check_layout(num_tokens, num_blocks, block_size, block_tables, query_start_loc, seq_lens):
    """(query starts [B + 1], query lengths [B], sequence lengths [B], block tables [B][need]
    with the entries past each sequence's blocks set to block 0), all host lists."""
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
    qsl = query_start_loc.tolist()
    qlens = [hi - lo for lo, hi in zip(qsl, qsl[1:])]
    if b and (qsl[0] != 0 or qsl[-1] != num_tokens or min(qlens) < 0):
        raise ValueError(f"query_start_loc must rise from 0 to num_tokens={num_tokens}, got "
                         f"{qsl}.")
    seq = seq_lens.tolist()
    if any(s < n for s, n in zip(seq, qlens)):
        raise ValueError("seq_lens must include the new tokens (seq_lens >= query lengths); got "
                         f"seq_lens {seq}, query lengths {qlens}.")
    need = [(s + block_size - 1) // block_size for s in seq]  # blocks each sequence reads
    max_need = max(need, default=0)
    if max_need > block_tables.shape[1]:
        raise ValueError(f"block_tables has {block_tables.shape[1]} columns but a sequence of "
                         f"{max(seq)} tokens needs {max_need} blocks of {block_size}.")
    tables = []
    for row, n in zip(block_tables[:, :max_need].tolist(), need):
        used = row[:n]
        if used and (min(used) < 0 or max(used) >= num_blocks):
            raise ValueError(f"block_tables holds block ids outside [0, {num_blocks}) in the "
                             "blocks a sequence reads.")
        tables.append(used + [0] * (max_need - n))  # padding -> block 0 (masked out)
    return qsl, qlens, seq, tables
