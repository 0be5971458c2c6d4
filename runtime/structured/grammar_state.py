"""One request's place in its grammar: which tokens may come next, and advancing on the
ones that were chosen.

    state = GrammarState(compiled)
    state.fill(bitmask, row)        # bitmask [B, ceil(V / 32)] int32, row `row` <- allowed
    state.accept(token_id)          # after the sampler chose it; False: not allowed
    state.masks_along(drafts)       # each draft position's mask (speculation), unchanged
    state.terminated                # the grammar ended (its stop token was accepted)

The state follows the request's output tokens, which survive preemption by recompute
(only their KV is recomputed), so it needs no rebuilding then; a request forked for n > 1
gets a fresh state of its own.
"""

from __future__ import annotations

import torch

from ...kernels.native_token_bitmask import apply_token_bitmask
from .compiler import CompiledGrammar


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return (vocab_size + 31) // 32


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V / 32)] int32, every token allowed (all bits set)."""
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set logits [B, V] fp32 to -inf, in place, wherever bitmask [B, ceil(V/32)] int32
    (host) has a 0 bit, in the given rows only (kernels/native_token_bitmask.py on the
    CPU; on another device, the rows' masks are copied there and applied in torch)."""
    if logits.device.type == "cpu":
        apply_token_bitmask(logits, bitmask, rows)
    else:
        apply_bitmask_on_device(logits, bitmask, rows)


def apply_bitmask_on_device(logits: torch.Tensor, bitmask: torch.Tensor,
                            rows: list[int]) -> None:
    """apply_bitmask in torch ops on logits' device (any device): the rows' masks
    [R, W] copied there once, unpacked to [R, V] booleans, one masked fill."""
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)  # [R]
    words = bitmask[rows].to(logits.device, torch.int64)  # [R, W]
    shifts = torch.arange(32, dtype=torch.int64, device=logits.device)
    allowed = ((words.unsqueeze(2) >> shifts) & 1).reshape(len(rows), -1)  # [R, W * 32]
    allowed = allowed[:, :logits.shape[1]].bool()  # [R, V]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


class GrammarState:
    def __init__(self, compiled: CompiledGrammar) -> None:
        import xgrammar as xgr

        self.compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled.grammar)

    @property
    def vocab_size(self) -> int:
        return self.compiled.vocab_size

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self._matcher.is_terminated()

    @property
    def completed(self) -> bool:
        """The output so far is a complete sentence of the grammar (it may still grow)."""
        return self._matcher.is_completed()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row]. Reads the state only."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`. Returns False (state unchanged) when the grammar does
        not allow it, which a masked sampler never produces."""
        return self._matcher.accept_token(int(token_id))

    def forced_tokens(self) -> list[int]:
        """Tokens spelling the text the grammar forces next (empty when the next token is
        a choice), by the grammar engine's own tokenization of that text. Reads only."""
        return self._matcher.find_jump_forward_tokens()

    def valid_prefix(self, token_ids) -> int:
        """How many leading tokens of `token_ids` the grammar allows in a row. The state
        is left as it was."""
        n = 0
        for t in token_ids:
            if not self._matcher.accept_token(int(t)):
                break
            n += 1
        if n:
            self._matcher.rollback(n)
        return n

    def masks_along(self, token_ids) -> torch.Tensor:
        """Bitmasks [len(token_ids) + 1, ceil(V/32)] int32: row i allows what may follow
        token_ids[:i] (all of which must be allowed: see valid_prefix). The state is left
        as it was."""
        masks = new_bitmask(len(token_ids) + 1, self.vocab_size)
        for i, t in enumerate(token_ids):
            self._matcher.fill_next_token_bitmask(masks, i)
            if not self._matcher.accept_token(int(t)):
                if i:
                    self._matcher.rollback(i)
                raise ValueError(f"token {t} at draft position {i} is outside the grammar.")
        self._matcher.fill_next_token_bitmask(masks, len(token_ids))
        if token_ids:
            self._matcher.rollback(len(token_ids))
        return masks
