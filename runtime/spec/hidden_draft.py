"""Self-draft from the target's own last hidden state: a small head, no second model.

After each step the engine hands the proposer the target's final hidden state (the
normed features its LM head reads) at the request's last computed position p, and the
residual stream after a few middle layers there (the head's `tap_layers`: lower layers
keep more of the context than the last one, which is shaped for the next token alone; as
EAGLE-3 fuses low, middle and high features). The head takes those and the embedding of
the next token x[p+1] (already chosen, not yet computed) and predicts the feature the
target will have at p+1; a reduced LM head over the most frequent tokens turns it into
the draft x[p+2]. Further drafts feed the
predicted feature and the draft token back in (feature-level autoregression, as EAGLE
does, here with an MLP instead of an attention layer: the draft keeps no KV cache).
The head is distilled offline by `qserve quantize --draft hidden_draft`
(quantize/hidden_draft_train.py) on the target's own outputs.

A draft token costs ~2 small matmuls and a [V_sub, H] GEMV (SmolLM2-135M: 3.4M + 4.7M
weights, the first draft 0.66M more for the taps) against the target's ~135M per step.
Options:
    head      the head's safetensors file (required; recorded in the artifact)
    ngram     True (default): n-gram prompt lookup first; the head drafts only when the
              lookup finds nothing (lookups, when they hit, are accepted more often)
    min_prob  stop drafting once the head's top probability falls below this (default
              0.5; 0.35 and 0.7 were slower on the golden prompts): unlikely drafts cost
              a head evaluation and a verify row each and are rarely accepted
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.norm import RMSNorm
from .ngram import lookup
from .proposer import Proposal, Proposer, ProposeRequest, SpeculativeConfig, register_proposer
from .rejection_sampler import draw, sampling_probs

# tensor names in the head file (its state_dict); "token_ids" maps reduced-vocab rows to
# token ids
HEAD_TENSORS = ("norm_hidden.weight", "norm_embed.weight", "fc.weight", "gate_up.weight",
                "down.weight", "norm_out.weight", "lm_head.weight", "token_ids")
# ... and of a head fed middle layers: "tap_layers" [n] int64 the target's layer indices,
# "taps.fc.weight", "taps.norms.{j}.weight"
TAP_LAYERS = "tap_layers"
NORM_EPS = 1e-5


class TapFusion(nn.Module):
    """The target's residual stream after n middle layers [T, n, H] -> [T, H]: each
    normed, concatenated, projected. Zero-initialised: a fresh fusion leaves the head's
    input as it is."""

    def __init__(self, num_taps: int, hidden_size: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(RMSNorm(hidden_size, NORM_EPS) for _ in range(num_taps))
        self.fc = nn.Linear(num_taps * hidden_size, hidden_size, bias=False)
        nn.init.zeros_(self.fc.weight)

    def forward(self, taps: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([norm(taps[:, j]) for j, norm in enumerate(self.norms)], -1))


class HiddenDraftHead(nn.Module):
    """(feature [T, H], token embedding [T, H], taps [T, n, H] or None) -> (predicted next
    feature [T, H], reduced-vocab logits [T, V_sub] fp32). `token_ids` [V_sub] int64: the
    token id of each logit column. `tap_layers`: the target layers whose output (residual
    stream) the first draft also reads; later drafts start from a predicted feature, which
    has none. Norms are the target's RMSNorm (C kernel for bf16 rows)."""

    def __init__(self, hidden_size: int, intermediate_size: int, token_ids: torch.Tensor,
                 tap_layers: Sequence[int] = ()) -> None:
        super().__init__()
        h, i = hidden_size, intermediate_size
        self.tapped: tuple[int, ...] = tuple(int(t) for t in tap_layers)
        self.taps = TapFusion(len(self.tapped), h) if self.tapped else None
        if self.tapped:  # in the file as "tap_layers"
            self.register_buffer(TAP_LAYERS, torch.tensor(self.tapped, dtype=torch.int64))
        self.norm_hidden = RMSNorm(h, NORM_EPS)
        self.norm_embed = RMSNorm(h, NORM_EPS)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * i, bias=False)
        self.down = nn.Linear(i, h, bias=False)
        self.norm_out = RMSNorm(h, NORM_EPS)
        self.lm_head = nn.Linear(h, len(token_ids), bias=False)
        self.register_buffer("token_ids", token_ids.to(torch.int64), persistent=True)

    def forward(self, feature: torch.Tensor, embed: torch.Tensor,
                taps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.norm_hidden(feature)
        if taps is not None and self.taps is not None:
            hidden = hidden + self.taps(taps)
        x = self.fc(torch.cat([hidden, self.norm_embed(embed)], -1))
        gate, up = self.gate_up(x).chunk(2, -1)
        x = x + self.down(F.silu(gate) * up)
        predicted = self.norm_out(x)
        return predicted, self.lm_head(predicted).float()

    @classmethod
    def from_file_state(cls, state: dict[str, torch.Tensor], hidden_size: int,
                        dtype: torch.dtype) -> "HiddenDraftHead":
        missing = [n for n in HEAD_TENSORS if n not in state]
        if missing:
            raise ValueError(f"a hidden-state draft head needs tensors {', '.join(missing)}; "
                             f"the file has {sorted(state)}. Re-run `qserve quantize --draft "
                             "hidden_draft`.")
        if state["fc.weight"].shape != (hidden_size, 2 * hidden_size):
            raise ValueError(f"the draft head was made for hidden size "
                             f"{state['fc.weight'].shape[0]}, the target has {hidden_size}.")
        taps = state[TAP_LAYERS].tolist() if TAP_LAYERS in state else ()
        head = cls(hidden_size, state["down.weight"].shape[1], state["token_ids"], taps)
        names = [n for n in head.state_dict()]
        missing = [n for n in names if n not in state]
        if missing:
            raise ValueError(f"the draft head reads target layers {list(taps)} but its file "
                             f"lacks {', '.join(missing)}. Re-run `qserve quantize --draft "
                             "hidden_draft`.")
        head.load_state_dict({n: state[n] for n in names})
        return head.to(dtype).eval()

    def check_target(self, num_layers: int) -> None:
        """ValueError when a tapped layer is outside the target (a head of another model)."""
        bad = [t for t in self.tapped if not 0 <= t < num_layers]
        if bad:
            raise ValueError(f"the draft head reads target layers {bad}, the target has "
                             f"{num_layers} layers: it was trained for another model.")

    def pack_for_cpu(self) -> None:
        """Inference only. Where the C FP8 kernel is vectorised (AMX or AVX512-BF16),
        every linear goes to E4M3 with per-row scales for it (half the bytes of bf16, read
        from memory once per evaluation); elsewhere they go to oneDNN's layout (faster than
        plain matmuls at one row).
        Drafts only propose: the target's verification keeps the output exact."""
        from ...kernels import native_fp8_gemv
        from ...kernels.cpu_linear import packing_available
        from ..layers.packing import pack_for_cpu

        if self.fc.weight.dtype != torch.bfloat16:
            return
        if native_fp8_gemv.available() and native_fp8_gemv.vectorized():
            for name in ("fc", "gate_up", "down", "lm_head"):
                setattr(self, name, Fp8RowsLinear(getattr(self, name).weight))
            if self.taps is not None:
                self.taps.fc = Fp8RowsLinear(self.taps.fc.weight)
        elif packing_available():
            pack_for_cpu(self)


class Fp8RowsLinear(nn.Module):
    """x [..., in] bf16 -> [..., out] bf16 through the C FP8 kernel: the weight in E4M3
    with one scale per output row, the input quantized per call of up to 16 rows with one
    dynamic scale (computed in C)."""

    def __init__(self, weight: torch.Tensor) -> None:  # [out, in] bf16
        super().__init__()
        from ...kernels.fp8 import scale_from_amax
        from ...kernels.fp8 import quantize_fp8
        from ...kernels.native_fp8_gemv import pack_fp8_weight

        scale = scale_from_amax(weight.float().abs().amax(1, keepdim=True))  # [out, 1] fp32
        self.packed = pack_fp8_weight(quantize_fp8(weight, scale))
        self.scale = scale.reshape(-1).contiguous()  # [out] fp32
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ...kernels.native_fp8_gemv import MAX_ROWS, fp8_gemv_dynamic_bf16

        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        if rows.shape[0] > MAX_ROWS:
            out = torch.cat([self(rows[i:i + MAX_ROWS]) for i in range(0, len(rows), MAX_ROWS)])
        else:
            out = fp8_gemv_dynamic_bf16(rows, self.packed, self.scale)
        return out.reshape(*x.shape[:-1], self.out_features)


def load_head(path: str, hidden_size: int, dtype: torch.dtype) -> HiddenDraftHead:
    """ValueError (saying what is wrong) for a missing, unreadable or mismatched file."""
    from safetensors.torch import load_file

    try:
        state = load_file(path)
    except Exception as e:  # missing file, not safetensors, truncated
        raise ValueError(f"cannot read the draft head {path}: {e}. Give the head file an "
                         "artifact quantized with `--draft hidden_draft` wrote "
                         "(draft/hidden_draft_head.safetensors).") from None
    return HiddenDraftHead.from_file_state(state, hidden_size, dtype)


class HiddenDraftProposer(Proposer):
    """Needs the engine's `observe(request_id, position, feature)` after every step."""

    uses_hidden = True

    def __init__(self, head: HiddenDraftHead, embedding: torch.Tensor, vocab_size: int, *,
                 ngram: bool = True, min_prob: float = 0.5, seed: int = 0) -> None:
        self.head = head
        self.embedding = embedding  # [vocab, H] the target's input embedding (plain layout)
        self.vocab_size = vocab_size
        self.ngram = ngram
        self.min_prob = min_prob
        self.generator = torch.Generator().manual_seed(seed)
        # id -> (position, feature [H], taps [n, H] or None)
        self._features: dict[str, tuple[int, torch.Tensor, torch.Tensor | None]] = {}

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.head.tapped

    def observe(self, request_id: str, position: int, feature: torch.Tensor,
                taps: torch.Tensor | None = None) -> None:
        """The target's feature [H] at `position` (the request's last computed token) and
        its residual stream after `tap_layers` there [n, H]."""
        self._features[request_id] = (position, feature, taps)

    def release(self, request_id: str) -> None:
        self._features.pop(request_id, None)

    def _full_probs(self, logits: torch.Tensor, params) -> torch.Tensor:
        """Reduced-vocab logits [V_sub] -> the draft distribution q over the full vocab
        [V] fp32 (zero outside the head's tokens)."""
        full = torch.full((1, self.vocab_size), float("-inf"))
        full[0, self.head.token_ids] = logits
        return sampling_probs(full, params)[0]

    @torch.inference_mode()
    def propose(self, batch: Sequence[ProposeRequest]) -> list[Proposal]:
        out: list[Proposal] = [Proposal([]) for _ in batch]
        rows = []  # batch indices the head drafts for
        for i, b in enumerate(batch):
            req = b.request
            if self.ngram:
                found = lookup(req.all_token_ids, b.num_drafts, 2, 3)
                if found:
                    out[i] = Proposal(found)
                    continue
            seen = self._features.get(req.request_id)
            if seen is not None and seen[0] == req.num_computed_tokens - 1:
                rows.append(i)
        if not rows:
            return out
        observed = [self._features[batch[i].request.request_id] for i in rows]
        feature = torch.stack([f for _, f, _ in observed])  # [n, H]
        taps = (torch.stack([t for _, _, t in observed])  # [n, taps, H], first draft only
                if all(t is not None for _, _, t in observed) else None)
        token = torch.tensor([batch[i].request.all_token_ids[-1] for i in rows])
        drafts: list[list[int]] = [[] for _ in rows]
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        live = list(range(len(rows)))
        for _ in range(max(batch[i].num_drafts for i in rows)):
            feature, logits = self.head(feature, self.embedding[token].to(feature.dtype), taps)
            taps = None
            probs = torch.softmax(logits, -1)  # [n, V_sub] fp32
            top_p, top_i = probs.max(-1)
            keep, nxt = [], []
            for j, r in enumerate(live):
                params = batch[rows[r]].request.params
                if params.is_greedy:
                    if float(top_p[j]) < self.min_prob:
                        continue
                    tok = int(self.head.token_ids[top_i[j]])
                else:
                    q = self._full_probs(logits[j], params)
                    tok = draw(q, self.generator)
                    qs[r].append(q)
                drafts[r].append(tok)
                if len(drafts[r]) < batch[rows[r]].num_drafts:
                    keep.append(j)
                    nxt.append(tok)
            if not keep:
                break
            idx = torch.tensor(keep)
            feature, live = feature[idx], [live[j] for j in keep]
            token = torch.tensor(nxt)
        for r, i in enumerate(rows):
            if drafts[r]:
                out[i] = Proposal(drafts[r], torch.stack(qs[r]) if qs[r] else None)
        return out


@register_proposer("hidden_draft")
def build(config: SpeculativeConfig, target, **_) -> HiddenDraftProposer:
    """`target`: the engine's LoadedModel (its input embedding and vocab size)."""
    path = config.options.get("head")
    if not path:
        raise ValueError("the hidden_draft proposer needs a trained head: serve an artifact "
                         "quantized with `--draft hidden_draft`.")
    model = target.model
    cfg = model.config
    head = load_head(path, cfg.hidden_size, target.dtype)
    head.check_target(cfg.num_layers)
    head.pack_for_cpu()
    return HiddenDraftProposer(head, model.backbone.embed_tokens.weight, cfg.vocab_size,
                               ngram=bool(config.options.get("ngram", True)),
                               min_prob=float(config.options.get("min_prob", 0.5)))
