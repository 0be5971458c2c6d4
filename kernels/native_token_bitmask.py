"""Structured outputs' token mask on fp32 logits, in C on CPU (csrc/token_bitmask_cpu.c).

    apply_token_bitmask(logits, bitmask, rows)   # logits [B, V] fp32, in place
    apply_token_bitmask_reference(...)            # the same in torch, for the tests

bitmask [B, ceil(V / 32)] int32: bit t of a row (word t // 32, bit t % 32, least
significant first) is 1 where token t is allowed; the listed rows' disallowed logits
become -inf. The grammar engine's own CPU kernel writes each disallowed logit by itself:
~4 ms for 16 rows of a 49k vocabulary when a grammar allows a handful of tokens, which
is most steps of a JSON reply; here a word of zeros is one run of stores.
`available()` says whether the library is built.
"""

from __future__ import annotations

import torch

from .native_build import cached_library
from .native_call import keyword_calls

_library = cached_library("token_bitmask_cpu")


def available() -> bool:
    """True when the C library is built and loaded (builds it on first call)."""
    return _library() is not None


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1 \
            or logits.device.type != "cpu":
        raise ValueError(f"logits must be fp32 CPU rows [B, V] with unit stride, got "
                         f"{logits.dtype} {list(logits.shape)} on {logits.device}.")
    width = (logits.shape[1] + 31) // 32
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.stride(1) != 1 \
            or bitmask.shape[0] != logits.shape[0] or bitmask.shape[1] < width:
        raise ValueError(f"bitmask must be int32 [{logits.shape[0]}, >= {width}] with unit "
                         f"stride, got {bitmask.dtype} {list(bitmask.shape)}.")
    if any(not 0 <= r < logits.shape[0] for r in rows):
        raise ValueError(f"rows must index the {logits.shape[0]} rows, got {rows}.")


@keyword_calls("token_bitmask_cpu")
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[r, t] = -inf where bitmask[r] disallows t, for r in rows."""
    _check(logits, bitmask, rows)
    lib = _library()
    if lib is None:
        apply_token_bitmask_reference(logits, bitmask, rows)
        return
    index = torch.tensor(rows, dtype=torch.int64)
    lib.qserve_apply_token_bitmask(logits=logits.data_ptr(), logits_stride=logits.stride(0),
                                   bitmask=bitmask.data_ptr(), bitmask_stride=bitmask.stride(0),
                                   vocab=logits.shape[1], rows=index.data_ptr(),
                                   num_rows=len(rows))


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor,
                                  rows: list[int]) -> None:
    """The same in torch (a bool mask from the bits, then one masked fill a row)."""
    _check(logits, bitmask, rows)
    shifts = torch.arange(32, dtype=torch.int64)
    vocab = logits.shape[1]
    for r in rows:
        bits = (bitmask[r].to(torch.int64).unsqueeze(1) >> shifts) & 1  # [W, 32]
        allowed = bits.reshape(-1)[:vocab].bool()
        logits[r].masked_fill_(~allowed, float("-inf"))


__all__ = ["apply_token_bitmask", "apply_token_bitmask_reference", "available"]
