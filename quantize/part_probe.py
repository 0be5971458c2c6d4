"""How far an FP8 artifact's next-token predictions are from its bf16 source, with any set
of its parts put back to what the source computes: the measurement the quality budget
(quantize/budget.py) chooses from.

    probe = PartProbe(artifact_dir, source_spec, token_rows, words)
    probe.measure(frozenset())            # the artifact as written
    probe.measure({part_a, part_b})       # with those parts restored

A part (quantize/budget.py's `Part`) is restored in memory, never on disk:
- "inputs": the part's quantized linears read their input unquantized (weight-only, W8A16:
  from static FP8 inputs, or from per-row FP8 or int8 inputs with `activations.dynamic`);
- "weights": the part's linears become the source's own linears (no FP8 at all);
- "kv": K and V skip the FP8 quantize-dequantize (a bf16 cache).
Both models compute in fp32 here, so the difference measured is the quantization's,
not bf16 rounding's.

The source's log-probabilities are computed once. `measure` returns the mean
KL(source || artifact) per predicted token and the relative increase of word perplexity
(exp of the NLL difference per word, minus 1: the unit of the eval gate
`max_relative_increase` on `word_perplexity`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.attention import AttentionMetadata, DenseAttention
from ..runtime.fp8_kv_attention import Fp8KVAttention
from ..runtime.layers.fp8_linear import Fp8Linear
from ..runtime.loaded_model import load

LOGIT_ROWS = 512  # rows of [rows, vocab] fp32 logits at a time


@dataclass(frozen=True)
class Measurement:
    kl: float  # mean KL(source || artifact) per predicted token, nats
    ppl_increase: float  # relative increase of word perplexity (0.01 = +1%)
    nll_per_word: float  # the artifact's, nats


class PartProbe:
    def __init__(self, artifact: str, source: str, rows: torch.Tensor, words: int):
        """rows: [N, L] int64 token ids (each row a sequence from its start); words: the
        number of words those tokens hold (for word perplexity)."""
        self.rows, self.words = rows, words
        self.art = load(artifact, torch.float32)
        self.src = load(source, torch.float32)
        self.ref_logp = [self._logp(self.src.model, DenseAttention(), r) for r in rows]
        self.ref_nll = sum(self._nll(lp, r) for lp, r in zip(self.ref_logp, rows))
        self._modules = dict(self.art.model.named_modules())
        self._src_modules = dict(self.src.model.named_modules())

    # -- forward passes ----------------------------------------------------------------
    @staticmethod
    @torch.inference_mode()
    def _logp(model, attention, ids: torch.Tensor) -> torch.Tensor:
        """ids [L] -> log-probabilities [L - 1, vocab] fp32 of tokens 1..L-1."""
        n = ids.shape[0]
        hidden = model(ids, torch.arange(n), AttentionMetadata.single(n), attention)
        out = [F.log_softmax(model.compute_logits(hidden[i:min(i + LOGIT_ROWS, n - 1)]).float(),
                             dim=-1) for i in range(0, n - 1, LOGIT_ROWS)]
        return torch.cat(out)

    @staticmethod
    def _nll(logp: torch.Tensor, ids: torch.Tensor) -> float:
        return -float(logp.gather(1, ids[1:].reshape(-1, 1)).sum())

    def measure(self, restored: frozenset | set = frozenset()) -> Measurement:
        with self._restored(restored) as attention:
            kl, nll = 0.0, 0.0
            for ref, ids in zip(self.ref_logp, self.rows):
                lp = self._logp(self.art.model, attention, ids)
                kl += float((ref.exp() * (ref - lp)).sum())
                nll += self._nll(lp, ids)
        tokens = sum(int(r.shape[0]) - 1 for r in self.rows)
        return Measurement(kl / tokens, math.exp((nll - self.ref_nll) / self.words) - 1,
                           nll / self.words)

    # -- restoring parts in memory -------------------------------------------------------
    def _set(self, name: str, module: nn.Module) -> None:
        parent, _, attr = name.rpartition(".")
        setattr(self._modules[parent] if parent else self.art.model, attr, module)

    @contextmanager
    def _restored(self, parts):
        """Swap the parts' modules in (yielding the attention to run with), then back."""
        originals: dict[str, nn.Module] = {}
        kv_scales = dict(self.art.kv_scales)
        try:
            for part in parts:
                for name in part.modules:
                    fp8 = originals.setdefault(name, self._modules[name])
                    if part.kind == "weights":
                        self._set(name, self._src_modules[name])
                    elif part.kind == "inputs" and isinstance(fp8, Fp8Linear) and \
                            not isinstance(self._current(name), nn.Linear):
                        # the same weight codes, the input as it comes (W8A16); the
                        # compute dtype, not the weight's: W8A8 int8 keeps int8 codes
                        self._set(name, Fp8Linear(fp8.weight.detach(), fp8.weight_scale, None,
                                                  fp8.bias, fp8.compute_dtype,
                                                  codes=fp8.codes))
                if part.kind == "kv":
                    kv_scales = {i: s for i, s in kv_scales.items() if i not in part.layers}
            inner = DenseAttention()
            yield Fp8KVAttention(inner, kv_scales) if kv_scales else inner
        finally:
            for name, module in originals.items():
                self._set(name, module)

    def _current(self, name: str) -> nn.Module:
        parent, _, attr = name.rpartition(".")
        return getattr(self._modules[parent] if parent else self.art.model, attr)
