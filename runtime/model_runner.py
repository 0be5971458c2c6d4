"""Model runner: one scheduled step -> one forward pass over a flat batch -> logits.

Builds the flat batch (token ids, positions, paged attention metadata) from the
scheduler's chunks, runs the model with the paged KV backend, and computes logits only
for the rows that are sampled (the last token of each chunk that reaches the end of its
request) plus, for requests that asked for prompt logprobs, their prompt rows. A step the
engine found greedy throughout (sampler.argmax_decides) asks for the sampled rows' greedy
tokens instead of their logits (`execute(sched, greedy=True)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .decode_graphs import DecodeGraphs, capture_sizes
from .execution_backend import ExecutionBackend
from .kv_cache import KVCache
from .models.native_decoder import NativeDecoder
from .paged_attention_backend import PagedAttentionBackend, PagedAttentionMetadata
from .scheduler import ScheduledChunk, SchedulerOutput
from .step_buffers import DecodeRow, StepBuffers


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
    # the rows of its last known token and of each draft; None when the step was run for
    # greedy_ids instead
    logits: torch.Tensor | None
    # request_id -> (first position, fp32 logits [rows, vocab]) of that chunk's prompt rows
    prompt_logits: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # the final (normed) hidden states of the `logits` rows [same rows, hidden] model dtype
    sampled_hidden: torch.Tensor | None = None
    # the residual stream after each of the runner's tap_layers at those rows
    # [same rows, len(tap_layers), hidden] model dtype (None: no layers tapped)
    sampled_taps: torch.Tensor | None = None
    # execute(greedy=True) only, else None: [len(sampled)] int64 on the step's device, each
    # sampled chunk's greedy token (the argmax of the logits row it would have had)
    greedy_ids: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache,
                 decode_impl: str | None = None, batch_invariant: bool = True,
                 execution: ExecutionBackend | None = None, max_num_seqs: int = 64,
                 graph_max_context: int = 8192) -> None:
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
        # plain decode steps on fixed device buffers, as CUDA graphs where captured
        self.graphs: DecodeGraphs | None = None
        if execution is not None and execution.decode_graphs != "off":
            bs = kv_cache.block_size
            width = min(-(-graph_max_context // bs), kv_cache.num_blocks)
            buffers = StepBuffers(max_num_seqs, width, kv_cache.groups.num_groups, bs,
                                  self.device)
            self.graphs = DecodeGraphs(model, self.backend, buffers,
                                       capture_sizes(max_num_seqs), execution.decode_graphs)

    def capture_graphs(self) -> None:
        """Record the decode graphs (CUDA only; once, after the weights and the KV pool are
        in place). A model that cannot be captured runs its decode steps eagerly."""
        if self.graphs is not None and self.graphs.mode == "captured" \
                and not self.graphs.capture():
            self.graphs = None

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

    def _decode_rows(self, chunks: list[ScheduledChunk]) -> list[DecodeRow] | None:
        """The step as decode rows when the decode graphs can run it, else None: every
        chunk one new token that samples, no drafts, no prompt rows, no tapped layers."""
        if self.graphs is None or self.tap_layers:
            return None
        rows = []
        for c in chunks:
            if (c.num_tokens != 1 or c.draft_token_ids or not c.samples
                    or prompt_row_span(c) is not None):
                return None
            rows.append(DecodeRow(c.request.all_token_ids[c.start], c.start,
                                  tuple(c.block_tables)))
        return rows if self.graphs.fits(rows) else None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, greedy: bool = False) -> RunnerOutput:
        """Run one step. greedy: give each sampled chunk's greedy token (RunnerOutput.
        greedy_ids, the model's greedy_tokens) instead of the sampled rows' logits; only
        for steps sampler.argmax_decides passes (no drafts: one row per sampled chunk)."""
        chunks = out.chunks
        if greedy and any(c.draft_token_ids for c in chunks):
            raise ValueError("greedy steps take one row per sampled chunk; a chunk with "
                             "drafts needs its rows' logits to verify them.")
        decode_rows = self._decode_rows(chunks)
        if decode_rows is not None:  # [B, hidden]: row b is chunk b's new token
            return self._outputs(chunks, self.graphs.run(decode_rows), None, greedy)
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
        return self._outputs(chunks, hidden, taps, greedy)

    def _outputs(self, chunks: list[ScheduledChunk], hidden: torch.Tensor,
                 taps: dict[int, torch.Tensor | None] | None,
                 greedy: bool = False) -> RunnerOutput:
        """Logits of the sampled rows (and of requested prompt rows) from the step's final
        hidden states [T, hidden]; greedy: the sampled rows' greedy tokens instead of their
        logits."""
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
        logits, greedy_ids = None, None
        if greedy:  # [len(sampled)] int64: the argmax without the [rows, vocab] logits
            greedy_ids = (self.model.greedy_tokens(sampled_hidden) if rows
                          else torch.empty(0, dtype=torch.int64))
        else:
            logits = (self.model.compute_logits(sampled_hidden) if rows
                      else torch.empty(0, 0))
        # every request's prompt rows through the LM head at once: one read of its weight
        # per step, not one per request (short scoring prompts are weight-read bound)
        prompt_logits = {}
        if prompt_rows:
            all_rows = self.model.compute_logits(
                hidden[torch.tensor(prompt_rows, device=self.device)])
            prompt_logits = {rid: (start, all_rows[at:at + n])
                             for rid, start, at, n in prompt_spans}
        return RunnerOutput(sampled, logits, prompt_logits, sampled_hidden, sampled_taps,
                            greedy_ids)
