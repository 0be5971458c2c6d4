"""Distil a small early-exit head on calibration text (CPU, minutes).

The early exit runs the target's first N layers and final norm; the head (a residual MLP,
runtime/spec/early_exit.DraftHead) maps that hidden state so that the target's own LM head
predicts the token the full target would pick (cross-entropy against the target's argmax
over the calibration tokens). The target here is the source checkpoint in fp32.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch


@torch.no_grad()
def _features(model, early, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Early-exit hidden states [T, H] fp32 and the target's argmax next tokens [T] int64."""
    from ..runtime.attention import AttentionMetadata, DenseAttention

    hs, ys = [], []
    for ids in samples:
        pos = torch.arange(len(ids))
        meta = AttentionMetadata.single(len(ids))
        hs.append(early.hidden_states(ids, pos, meta, DenseAttention()).float())
        ys.append(model.compute_logits(model(ids, pos, meta, DenseAttention())).argmax(-1))
    return torch.cat(hs), torch.cat(ys)


def _agreement(model, head, h: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model.compute_logits(head(h)).argmax(-1) == y).float().mean())


def train_head(target_dir: Path, num_layers: int, samples: torch.Tensor, out_path: Path, *,
               rank: int = 256, max_tokens: int = 8192, epochs: int = 4, batch: int = 256,
               lr: float = 2e-3, seed: int = 0,
               progress: Callable[[str], None] = lambda m: None) -> dict:
    """Train a head on up to `max_tokens` calibration tokens ([S, L] int64 `samples`), 1/8 of
    the sequences held out for the before/after agreement; write it to `out_path`."""
    from safetensors.torch import save_file

    from ..runtime.models.loader import load_model
    from ..runtime.spec.early_exit import DraftHead, EarlyExitModel
    from ..runtime.formats.checkpoint import open_checkpoint

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = load_model(open_checkpoint(target_dir), dtype=torch.float32).eval()
    early = EarlyExitModel(model, num_layers)
    rows = max(2, min(samples.shape[0], max_tokens // samples.shape[1]))
    h, y = _features(model, early, samples[:rows])
    cut = (rows - max(1, rows // 8)) * samples.shape[1]
    h_train, y_train, h_test, y_test = h[:cut], y[:cut], h[cut:], y[cut:]
    head = DraftHead(h.shape[1], rank)
    before = _agreement(model, head, h_test, y_test)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    steps = 0
    for epoch in range(epochs):
        order = torch.randperm(len(y_train))
        total = 0.0
        for start in range(0, len(order), batch):
            idx = order[start:start + batch]
            loss = torch.nn.functional.cross_entropy(model.compute_logits(head(h_train[idx])),
                                                     y_train[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
            steps += 1
        progress(f"draft head epoch {epoch + 1}/{epochs}: loss {total / len(order):.3f}")
    after = _agreement(model, head, h_test, y_test)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(out_path))
    return {"num_layers": num_layers, "rank": rank, "train_tokens": int(len(y_train)),
            "heldout_tokens": int(len(y_test)), "steps": steps,
            "heldout_top1_agreement_before": round(before, 4),
            "heldout_top1_agreement_after": round(after, 4),
            "seconds": round(time.perf_counter() - t0, 1)}
