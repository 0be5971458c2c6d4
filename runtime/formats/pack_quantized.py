"""compressed-tensors' "pack-quantized" layout of 8-bit int weights: int8 codes packed four
to an int32, the layout llm-compressor writes for W8A16 and vLLM's WNA16 path reads.

    weight_packed  int32 [out, ceil(in / 4)]
    weight_shape   int64 [2] = (out, in)     (compressed-tensors writes torch.tensor(shape))

Each code c in -128..127 is stored as the unsigned byte c + 128; element j of a group of
four consecutive inputs sits at bits 8j..8j+7 of its int32 (element 0 in the low byte),
so the int32's value, not its bytes in memory, fixes the order (compressed-tensors'
`pack_to_int32(value, 8)`). A last partial group is padded with unsigned 0 bytes.
The writer (quantize/) and the artifact loader (runtime/) both use this module.
"""

from __future__ import annotations

import sys

import torch

CODES_PER_WORD = 4  # 8-bit codes per int32


def packed_columns(in_features: int) -> int:
    """int32 words per row of `in_features` 8-bit codes."""
    return -(-in_features // CODES_PER_WORD)


def pack_int8(codes: torch.Tensor) -> torch.Tensor:
    """codes int8 [out, in] -> weight_packed int32 [out, ceil(in / 4)]."""
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise ValueError(f"pack_int8 takes int8 [out, in] codes, got {codes.dtype} "
                         f"{list(codes.shape)}.")
    out, n_in = codes.shape
    words = packed_columns(n_in)
    u8 = torch.zeros(out, words * CODES_PER_WORD, dtype=torch.uint8, device=codes.device)
    u8[:, :n_in] = (codes.to(torch.int16) + 128).to(torch.uint8)  # [out, in] c + 128
    u8 = u8.reshape(out, words, CODES_PER_WORD)
    if sys.byteorder == "big":  # the low byte of an int32 comes last in memory there
        u8 = u8.flip(-1)
    return u8.contiguous().view(torch.int32).reshape(out, words)


def unpack_int8(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """weight_packed int32 [out, ceil(in / 4)] -> codes int8 [out, in]."""
    if packed.dtype != torch.int32 or packed.dim() != 2 or \
            packed.shape[1] != packed_columns(in_features):
        raise ValueError(f"unpack_int8 takes int32 [out, {packed_columns(in_features)}] for "
                         f"{in_features} inputs, got {packed.dtype} {list(packed.shape)}.")
    out, words = packed.shape
    u8 = packed.contiguous().view(torch.uint8).reshape(out, words, CODES_PER_WORD)
    if sys.byteorder == "big":
        u8 = u8.flip(-1)
    u8 = u8.reshape(out, words * CODES_PER_WORD)[:, :in_features]
    return (u8.to(torch.int16) - 128).to(torch.int8)


def weight_shape(codes: torch.Tensor) -> torch.Tensor:
    """The `weight_shape` tensor of [out, in] codes: int64 [2]."""
    return torch.tensor(list(codes.shape), dtype=torch.int64)
