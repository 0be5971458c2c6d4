"""KV of a prompt's last, partial block, computed elsewhere and written into a request's
own block at admission (prefill/decode disaggregation).

Full blocks travel through the prefix cache (hashed, shared). The tokens past the last
full block have no hash and no cache entry, so without this the decode engine would
compute up to block_size - 1 prompt tokens itself, in a step that also decodes every
running stream. With a tail, the scheduler admits the request with those positions
already computed: the engine writes the tail's bytes into the request's fresh block
before the step runs, and the request computes only its last prompt token.

    tail = KVTail(start=32, token_ids=(17, 4, 9), k=(...), v=(...))   # positions 32..34
    engine.add_request(rid, prompt, params, kv_tail=tail)

A tail is used only when the prefix cache covers exactly `start` tokens at admission
(the transfer's full blocks are still there); otherwise the request computes those
tokens itself, with the same result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True, eq=False)
class KVTail:
    start: int  # first position: the end of the prompt's last full block
    token_ids: tuple[int, ...]  # [t] prompt tokens at start .. start + t - 1, t < block_size
    k: tuple[torch.Tensor, ...]  # per layer [t, Hkv, D] in the pool's dtype
    v: tuple[torch.Tensor, ...]  # per layer; a latent cache's are its k tensors

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def check(self, prompt: Sequence[int], block_size: int, num_layers: int,
              values_in_keys: bool = False) -> None:
        """Raise ValueError unless this tail fits a request of `prompt` in a pool of this
        block size and depth: it starts on a block boundary, stays inside one block, names
        the prompt's own tokens there, and leaves the last prompt token to compute (its
        logits choose the first output token)."""
        t = self.num_tokens
        if self.start % block_size or not 0 < t < block_size:
            raise ValueError(f"a KV tail covers 1..{block_size - 1} tokens from a block "
                             f"boundary; got {t} tokens from position {self.start}.")
        if self.start + t > len(prompt) - 1:
            raise ValueError(f"the KV tail ends at position {self.start + t}, past the "
                             f"{len(prompt)}-token prompt's last token, which the engine "
                             f"computes itself.")
        if tuple(prompt[self.start:self.start + t]) != self.token_ids:
            raise ValueError(f"the KV tail's tokens are not the prompt's at positions "
                             f"{self.start}..{self.start + t - 1}: it belongs to another "
                             f"prompt.")
        if len(self.k) != num_layers or len(self.v) != num_layers:
            raise ValueError(f"the KV tail has {len(self.k)} layers of keys and "
                             f"{len(self.v)} of values; the model has {num_layers}.")
        if values_in_keys and any(k is not v for k, v in zip(self.k, self.v)):
            raise ValueError("a latent KV tail carries one tensor per layer (values are "
                             "its keys).")

    def write(self, kv_cache, tables: Sequence[Sequence[int]]) -> None:
        """Write the tail into the block that holds position `start` in each layer's
        group table (`tables`: a request's block table per KV group). Bit-exact."""
        bs = kv_cache.spec.block_size
        rows = torch.arange(self.num_tokens)
        for layer, kv in enumerate(kv_cache.layers):
            block = tables[kv_cache.group_of(layer)][self.start // bs]
            kv.write((block, rows), self.k[layer], self.v[layer])  # [t, Hkv, D] each
