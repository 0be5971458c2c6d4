"""Model runner: one scheduled step -> one forward pass over a flat batch -> logits.

Builds the flat batch (token ids, positions, paged attention metadata) from the
scheduler's chunks, runs the model with the paged KV backend, and computes logits only
for the rows that are sampled (the last token of each chunk that reaches the end of its
request) plus, for requests that asked for prompt logprobs, their prompt rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .execution_backend import ExecutionBackend
from .kv_cache import KVCache
from .models.native_decoder import NativeDecoder
from .paged_attention_backend import PagedAttentionBackend, PagedAttentionMetadata
from .scheduler import ScheduledChunk, SchedulerOutput


def first_prompt_row(params) -> int:
    """The first prompt position whose logits are kept: row i predicts token i + 1, so
    scoring from position p needs the row at p - 1."""
    return max(0, params.prompt_logprobs_from - 1)


def prompt_row_span(chunk) -> tuple[int, int] | None:
    """Positions [first, end) of this chunk whose prompt logits its request asked for."""
    req = chunk.request
    if req.params.prompt_logprobs is None:
        return None
    first = max(chunk.start, first_prompt_row(req.params))
    end = min(chunk.end, req.num_prompt_tokens)
    return (first, end) if first < end else None


@dataclass
class RunnerOutput:
    sampled: list[ScheduledChunk]  # chunks that produce a next token, row order of `logits`
    # [sum(1 + len(c.draft_token_ids) for c in sampled), vocab] fp32: per sampled chunk,
    # the rows of its last known token and of each draft
    logits: torch.Tensor
    # request_id -> (first position, fp32 logits [rows, vocab]) of that chunk's prompt rows
    prompt_logits: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # the final (normed) hidden states of the `logits` rows [same rows, hidden] model dtype
    sampled_hidden: torch.Tensor | None = None
    # the residual stream after each of the runner's tap_layers at those rows
    # [same rows, len(tap_layers), hidden] model dtype (None: no layers tapped)
    sampled_taps: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache,
                 decode_impl: str | None = None, batch_invariant: bool = True,
                 execution: ExecutionBackend | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        # where the step's inputs go (execution None: the CPU torch backend)
        self.device = torch.device("cpu") if execution is None else execution.device
        self.backend = PagedAttentionBackend(
            kv_cache, decode_impl, None if execution is None else execution.kernels)
        # small decode steps of a packed Llama FP8 model as C calls (None: modules only)
        self.native = (NativeDecoder.build(model, kv_cache, decode_impl, batch_invariant)
                       if execution is None or execution.cpu_native else None)
        self.tap_layers: tuple[int, ...] = ()
        self._taps: dict[int, torch.Tensor | None] | None = None  # filled during a forward

    def tap(self, layers: tuple[int, ...]) -> None:
        """Also return the residual stream after these decoder layers at the sampled rows
        (RunnerOutput.sampled_taps), for a draft head that reads middle layers."""
        self.tap_layers = tuple(layers)
        decoder_layers = self.model.backbone.layers
        for index in self.tap_layers:  # a decoder layer returns its residual stream [T, H]
            decoder_layers[index].register_forward_hook(
                lambda _m, _a, out, index=index: self._keep_tap(index, out))

    def _keep_tap(self, index: int, out: torch.Tensor) -> None:
        if self._taps is not None:
            self._taps[index] = out

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        chunks = out.chunks
        ids, positions = [], []
        for c in chunks:
            ids += c.request.all_token_ids[c.start:c.end - len(c.draft_token_ids)]
            ids += c.draft_token_ids
            positions += range(c.start, c.end)
        tables = [[list(c.block_tables[g]) for c in chunks]
                  for g in range(self.kv_cache.groups.num_groups)]
        meta = PagedAttentionMetadata.build(
            [c.num_tokens for c in chunks], [c.start for c in chunks], tables[0],
            self.kv_cache.block_size, seq_ids=tuple(range(len(chunks))),
            group_tables=tuple(tables[1:]))
        ids_t = torch.tensor(ids, dtype=torch.int64)  # [T] host
        positions_t = torch.tensor(positions, dtype=torch.int64)  # [T] host
        if self.device.type != "cpu":  # one copy a tensor; the host built the step
            ids_t = ids_t.to(self.device, non_blocking=True)
            positions_t = positions_t.to(self.device, non_blocking=True)
            # the attention metadata stays on the host: the Triton wrappers check it there
            # and upload it once a step (their layout cache), with no device sync a layer
        self._taps = dict.fromkeys(self.tap_layers) if self.tap_layers else None
        hidden = (None if self.native is None
                  else self.native.forward(ids_t, positions_t, meta, self._taps))
        if hidden is None:
            hidden = self.model(ids_t, positions_t, meta, self.backend)
        taps, self._taps = self._taps, None
        rows, sampled, prompt_rows, prompt_spans = [], [], [], []
        offset = 0
        for c in chunks:
            if c.samples:
                rows += range(offset + c.num_tokens - 1 - len(c.draft_token_ids),
                              offset + c.num_tokens)
                sampled.append(c)
            span = prompt_row_span(c)
            if span is not None:  # rows [first, end) of the prompt go through the LM head
                first, end = span
                prompt_spans.append((c.request.request_id, first, len(prompt_rows), end - first))
                prompt_rows += range(offset + first - c.start, offset + end - c.start)
            offset += c.num_tokens
        sampled_at = torch.tensor(rows, device=self.device)
        sampled_hidden = hidden[sampled_at] if rows else None
        sampled_taps = None
        if rows and taps is not None:  # [rows, len(tap_layers), hidden]
            sampled_taps = torch.stack([taps[i][sampled_at] for i in self.tap_layers], 1)
        logits = (self.model.compute_logits(sampled_hidden) if rows else torch.empty(0, 0))
        # every request's prompt rows through the LM head at once: one read of its weight
        # per step, not one per request (short scoring prompts are weight-read bound)
        prompt_logits = {}
        if prompt_rows:
            all_rows = self.model.compute_logits(
                hidden[torch.tensor(prompt_rows, device=self.device)])
            prompt_logits = {rid: (start, all_rows[at:at + n])
                             for rid, start, at, n in prompt_spans}
        return RunnerOutput(sampled, logits, prompt_logits, sampled_hidden, sampled_taps)
