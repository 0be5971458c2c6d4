"""The engine loop: schedule -> run the model -> sample -> detokenize -> stop checks.

    engine = LLMEngine.from_model(loaded_model, EngineConfig(...))
    engine.add_request("r1", prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished:
        for out in engine.step(): ...        # RequestOutput deltas

`LLM` (runtime/llm.py) wraps it for offline batch use; the server drives the same loop.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer
from .device import DeviceError, kv_pool_bytes, resolve_device
from .disagg import kv_export, kv_import
from .execution_backend import ExecutionBackend
from .kv_cache import KVCache, KVCacheSpec
from .kv_tail import KVTail
from .layers.fusion import fuse_projections
from .layers.packing import pack_for_cpu
from .layers.placement import place_on_device
from .model_runner import ModelRunner, first_prompt_row
from .request import Request, RequestStatus
from .sampler import Sampler, TokenLogprobs, argmax_decides, prompt_logprobs
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig
from .spec.proposer import Proposal, SpeculativeConfig, build_proposer
from .spec.rejection_sampler import verify
from .spec.speculator import SpecCounters, Speculator
from .step_times import StepTimes
from .stop_checker import StopChecker
from .structured.compiler import GrammarCompiler
from .structured.grammar_state import GrammarState
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .disagg.kv_transfer import KVTransfer


@dataclass(frozen=True)
class EngineConfig:
    # where the engine computes: "auto" | "cpu" | "cuda" | "cuda:N" (runtime/device.py;
    # auto: the first CUDA GPU when torch sees one)
    device: str = "auto"
    # "auto" | "torch" | "triton" (runtime/execution_backend.py; None: QSERVE_KERNELS,
    # else auto: Triton on CUDA, torch on CPU)
    kernels: str | None = None
    # how FP8 linears multiply on a device (ExecutionBackend.fp8_gemm; None: by device)
    fp8_gemm: str | None = None
    # on CUDA, the KV pool takes what keeps the process within this share of the device's
    # memory once the weights are there (kv_cache_gib is the CPU's budget)
    gpu_memory_utilization: float = 0.9
    # how decode steps run on a device (runtime/decode_graphs.py): None is "captured" (CUDA
    # graphs) on CUDA, "off" elsewhere; "off" is `--enforce-eager`; "padded" runs the
    # graphs' fixed buffers eagerly (the Triton interpreter's stand-in)
    decode_graphs: str | None = None
    # decode graphs serve sequences of up to this many tokens (the width of their fixed
    # block tables); a step with a longer one runs eagerly
    graph_max_context: int = 8192
    kv_cache_gib: float = 1.0
    num_kv_blocks: int | None = None  # overrides kv_cache_gib when set
    kv_dtype: str | None = None  # "fp8" | "bf16"; None: fp8 for artifacts, else bf16
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True  # False: no request reuses another's KV blocks
    # prompt tokens in a step that also decodes (None: max_num_batched_tokens)
    max_prefill_tokens_with_decodes: int | None = None
    decode_impl: str | None = None  # paged attention decode variant (None: default)
    speculative: "SpeculativeConfig | None" = None  # runtime/spec; None: no speculation
    # fuse q|k|v and gate|up (runtime/layers/fusion.py) and pack CPU bf16 linear weights
    # for oneDNN (runtime/layers/packing.py), once; the loaded model is changed in place,
    # so its weights are then read only through its layers
    prepare_weights: bool = True
    # FP8 linears keep their E4M3 bytes (one more byte per weight) so steps read one byte
    # per weight (C kernel); False saves that memory, and steps multiply the bf16 copy
    keep_fp8_weights: bool = True
    # every step of an FP8 artifact runs the C linears and decoder, whose per-row sums do
    # not depend on the other rows: a greedy request's tokens then depend on its prompt
    # alone, not on the batch, the chunking or the cache (runtime/layers/packing.py's
    # c_kernel_rows). False: steps of more rows than one pass over the weights serves run
    # torch's matmuls (faster prompt steps on AMX / AVX512-BF16; not batch-invariant)
    batch_invariant: bool = True
    # structured outputs: the tokens a greedy request's grammar forces next (`"name": `
    # after a property is done, say) go to the step as drafts the model verifies (at most
    # this many a step; 0: off), so a forced run costs one step, not one step a token
    jump_forward_tokens: int = 8
    # ... while at most this many requests run: in a larger batch a step that verifies
    # drafts costs more than the forced runs save (docs/structured-outputs.md)
    jump_forward_max_batch: int = 4
    # ... and stops once, after JUMP_FORWARD_TRIAL drafted tokens, fewer than this share
    # were accepted: a model that spells forced text otherwise than the grammar engine's
    # tokenization (Gemma 3: a third accepted) pays for drafts it rejects
    jump_forward_min_acceptance: float = 0.5
    # a step whose sampled requests are all greedy and plain (sampler.argmax_decides: no
    # logprobs, logit_bias, penalties, grammar, drafts or forks) takes each row's greedy
    # token from the model (greedy_tokens: an 8-bit LM head's C kernel keeps a running
    # max, never making the [rows, vocab] logits); the same tokens. False: every step
    # makes the logits and samples them
    greedy_fast_path: bool = True
    # prefill/decode disaggregation: blocks reserved for imported KV whose request has not
    # come this long after are given back (runtime/disagg/kv_import.StagedImports); 4x the
    # decode request's KV wait (server/disagg_routes.DisaggRole.kv_timeout_s)
    kv_import_ttl_s: float = 120.0


log = logging.getLogger("qserve.engine")

JUMP_FORWARD_TRIAL = 256  # drafted forced tokens before their acceptance is judged


@dataclass
class RequestOutput:
    request_id: str
    text: str  # new text since the last output
    token_ids: list[int]  # new tokens since the last output
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    spec: "SpecCounters | None" = None  # final output of a speculated request: its totals
    # a constrained request ended before its grammar was complete (max_tokens, a stop
    # string): its text does not follow the grammar
    grammar_incomplete: bool = False
    scheduled_at: float | None = None  # time.monotonic() the request first entered a step


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    prefix_hit_rate: float
    num_preemptions: int
    tokens_computed: int
    tokens_cached: int
    spec: "SpecCounters | None" = None  # speculative decoding totals (None: off)
    tokens_imported: int = 0  # prompt tokens whose KV arrived with the request (KV tails)
    num_held: int = 0  # finished requests whose KV blocks are kept until release_kv
    num_staged_imports: int = 0  # KV imports reserved, not yet committed or cancelled
    # {sequences: seconds} of recent decode steps (runtime/step_times.py)
    decode_step_s: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineLayout:
    """What an engine is, fixed when it is built: safe to read from any thread."""

    namespace: str  # the prefix cache's namespace (artifact, dtype, KV dtype)
    block_size: int  # tokens per KV block
    num_blocks: int  # KV blocks in the pool (each KV group)
    kv_dtype: str  # "fp8" | "bf16"

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size


class _Tracker:
    """Per-request text state: detokenizer and stop checker."""

    def __init__(self, req: Request, tok: Tokenizer) -> None:
        self.detok = IncrementalDetokenizer.after_prompt(tok, req.prompt_token_ids,
                                                         req.params.skip_special_tokens)
        self.stop = StopChecker.from_params(req.params, tok.eos_token_ids)
        self.prompt_logprobs: list[TokenLogprobs | None] = []


def freeze_startup_objects() -> None:
    """Move every object alive now (the model, tokenizer, modules: hundreds of thousands)
    out of the garbage collector's view: collections triggered by a step's short-lived
    objects then scan only those, instead of walking the whole model again and again
    (gc.freeze; objects made later are collected as usual)."""
    gc.collect()
    gc.freeze()


class LLMEngine:
    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, kv_cache: KVCache,
                 namespace: str, config: EngineConfig,
                 execution: ExecutionBackend | None = None) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, config
        # the device and kernels every step uses (None: the CPU torch backend)
        self.execution = execution
        self.kv_cache = kv_cache
        self.blocks = BlockManager(kv_cache.num_blocks, kv_cache.block_size, namespace=namespace,
                                   windows=kv_cache.groups.windows)
        self.layout = EngineLayout(namespace, kv_cache.block_size, kv_cache.num_blocks,
                                   kv_cache.spec.dtype)
        # KV imports reserved and not yet claimed (decode role; engine thread only)
        self.kv_imports = kv_import.StagedImports(ttl_s=config.kv_import_ttl_s)
        self.scheduler = Scheduler(self.blocks, SchedulerConfig(
            config.max_num_batched_tokens, config.max_num_seqs, config.enable_prefix_caching,
            config.max_prefill_tokens_with_decodes))
        self.runner = ModelRunner(model, kv_cache, decode_impl=config.decode_impl,
                                  batch_invariant=config.batch_invariant, execution=execution,
                                  max_num_seqs=config.max_num_seqs,
                                  graph_max_context=config.graph_max_context)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self._trackers: dict[str, _Tracker] = {}
        self.tokens_computed = 0
        self.step_times = StepTimes()  # decode steps' seconds by sequences (router reads it)
        self.spec: Speculator | None = None  # set by from_model when speculation is on
        # structured outputs: compiled grammars (thread-safe; the server compiles into it
        # before admitting a request, so the loop only looks them up)
        self.grammars = GrammarCompiler(tokenizer, max(tokenizer.vocab_size,
                                                       model.config.vocab_size))
        # parent request id -> samples of an n > 1 request that fork from it (sharing its
        # prompt's KV blocks) once its prompt is computed
        self._forks: dict[str, list[Request]] = {}
        self.num_forked = 0  # samples that got their prompt's KV by forking
        # grammar-forced drafts (jump-forward): scored and accepted, over the engine's life
        self.jump_forward = SpecCounters()
        self._jumps: set[str] = set()  # requests whose drafts this step are forced tokens
        # steps whose tokens came from the model's greedy_tokens (the greedy fast path)
        self.num_greedy_steps = 0

    @classmethod
    def from_model(cls, lm, config: EngineConfig | None = None) -> "LLMEngine":
        """Build from a runtime.loaded_model.LoadedModel."""
        config = config or EngineConfig()
        execution = ExecutionBackend.choose(resolve_device(config.device), config.kernels,
                                            config.fp8_gemm, config.decode_graphs)
        for note in execution.notes:  # a slower path taken, and why
            log.warning("%s", note)
        kv_dtype = config.kv_dtype or ("fp8" if lm.kv_scales else "bf16")
        if kv_dtype == "fp8" and not lm.kv_scales:
            raise ValueError("an FP8 KV cache needs calibrated k/v scales: serve a quantized "
                             "artifact (`qserve quantize`), or use kv_dtype='bf16'.")
        if config.prepare_weights:
            fuse_projections(lm.model)
        if execution.cpu_native:
            if config.prepare_weights:
                pack_for_cpu(lm.model, keep_fp8=config.keep_fp8_weights,
                             batch_invariant=config.batch_invariant)
        else:
            place_on_device(lm.model, execution)
        cfg = lm.model.config
        spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.block_size,
                           kv_dtype, layer_windows=tuple(cfg.sliding_windows),
                           values_in_keys=getattr(cfg, "mla", None) is not None)
        scales = lm.kv_scales if kv_dtype == "fp8" else None
        device = execution.device
        if config.num_kv_blocks is not None:
            cache = KVCache(spec, config.num_kv_blocks, scales, device)
        elif device.type == "cuda":
            cache = KVCache.for_budget(
                spec, kv_pool_bytes(device, config.gpu_memory_utilization), scales, device)
        else:
            cache = KVCache.for_budget(spec, int(config.kv_cache_gib * 2**30), scales, device)
        namespace = f"{lm.path}:{lm.dtype}:{kv_dtype}"
        engine = cls(lm.model, lm.tokenizer, cache, namespace, config, execution)
        engine.runner.capture_graphs()  # CUDA graphs of decode steps, where they are on
        if config.speculative is not None:
            proposer = build_proposer(config.speculative, lm, kv_cache=cache,
                                      decode_impl=config.decode_impl, execution=execution)
            if not (execution.cpu_native or proposer.any_device):
                raise DeviceError(
                    f"the {config.speculative.proposer} proposer runs its draft on the CPU "
                    f"torch backend only, not beside an engine on {execution.device} with "
                    f"{execution.kernels} kernels: use --speculative ngram, draft_model or "
                    f"early_exit there, or off.")
            engine.spec = Speculator(proposer, config.speculative.num_speculative_tokens,
                                     disable_by_batch_size=config.speculative.disable_by_batch_size,
                                     adaptive=config.speculative.adaptive)
            if engine.spec.tap_layers:
                engine.runner.tap(engine.spec.tap_layers)
        freeze_startup_objects()
        return engine

    # -- requests ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, kv_tail: KVTail | None = None,
                    hold_kv: bool = False, fork_of: str | None = None) -> Request:
        """Queue a request. `kv_tail`: KV of the prompt past its last full block, computed
        elsewhere (used when the prefix cache holds the blocks before it). `hold_kv`: keep
        the request's KV blocks once it finishes, until `release_kv` (to export them).
        `fork_of`: the id of a request with the same prompt, still waiting for its first
        token; this one then shares its prompt's KV (one prefill for both) and samples its
        first token from the same logits. Without such a request it runs on its own.
        `params.n` must be 1: an n > 1 request is n requests, one per
        `params.for_sample(i)`, all but the first forking from the first.
        `params.structured` is compiled here unless it is in `self.grammars` already."""
        if params.n != 1:
            raise ValueError(f"the engine runs one sample per request, got n={params.n}: add "
                             f"n requests with params.for_sample(i) (fork_of the first).")
        if request_id in self.requests or request_id in self.scheduler.held:
            raise ValueError(f"request id {request_id!r} is already in use.")
        if kv_tail is not None:
            if not self.config.enable_prefix_caching:
                raise ValueError("a KV tail extends blocks found in the prefix cache, which "
                                 "is off on this engine: enable prefix caching.")
            kv_tail.check(prompt_token_ids, self.blocks.block_size,
                          len(self.kv_cache.layers), self.kv_cache.spec.values_in_keys)
        vocab = self.tokenizer.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}.")
        width = self.grammars.vocab_size
        bad = [t for t, _ in params.logit_bias if t >= width]
        if bad:
            raise ValueError(f"logit_bias names token ids outside the vocabulary [0, {width}): "
                             f"{bad[:5]}.")
        if (params.prompt_logprobs is not None
                and params.prompt_logprobs_from >= max(1, len(prompt_token_ids))):
            raise ValueError(f"prompt_logprobs_from={params.prompt_logprobs_from} scores no "
                             f"token of a {len(prompt_token_ids)}-token prompt: give a "
                             f"position below {len(prompt_token_ids)}.")
        req = Request(request_id, list(prompt_token_ids), params, kv_tail=kv_tail,
                      hold_kv=hold_kv)
        if params.structured is not None:  # GrammarError (a ValueError) when it cannot be
            req.sampling.grammar = GrammarState(self.grammars.compile(params.structured))
        parent = self.requests.get(fork_of) if fork_of is not None else None
        if (parent is not None and not parent.output_token_ids and kv_tail is None
                and parent.prompt_token_ids == req.prompt_token_ids and not hold_kv):
            self.scheduler.check_fits(req)
            self._forks.setdefault(parent.request_id, []).append(req)
        else:
            self.scheduler.add_request(req)
        self.requests[request_id] = req
        self._trackers[request_id] = _Tracker(req, self.tokenizer)
        return req

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks. Returns False if it is unknown."""
        for parent_id, children in list(self._forks.items()):  # a sample not yet forked
            for child in children:
                if child.request_id == request_id:
                    children.remove(child)
                    child.status = RequestStatus.FINISHED_ABORTED
                    if not children:
                        del self._forks[parent_id]
                    self.requests.pop(request_id, None)
                    self._trackers.pop(request_id, None)
                    return True
        for child in self._forks.pop(request_id, []):  # its samples now run on their own
            self.scheduler.add_request(child)
        req = self.scheduler.abort(request_id)
        if self.spec is not None:
            self.spec.release(request_id)
        self.requests.pop(request_id, None)
        self._trackers.pop(request_id, None)
        return req is not None

    def release_kv(self, request_id: str) -> bool:
        """Free the KV blocks a finished `hold_kv` request kept. False if none held."""
        return self.scheduler.release(request_id) is not None

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._forks)

    def stats(self) -> EngineStats:
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting),
                           self.blocks.num_blocks, self.blocks.num_free_blocks,
                           self.blocks.prefix_hit_rate, self.scheduler.num_preemptions,
                           self.tokens_computed, self.scheduler.tokens_cached,
                           None if self.spec is None else replace(self.spec.counters),
                           self.scheduler.tokens_imported, len(self.scheduler.held),
                           len(self.kv_imports), self.step_times.snapshot())

    # -- KV hand-off (prefill/decode disaggregation, runtime/disagg) ------------------
    # Engine thread, between steps, except write_kv_import.
    def export_kv(self, request_id: str, token_ids: list[int]) -> "KVTransfer":
        """The KV of the prompt `token_ids` of the finished `hold_kv` request
        `request_id` (its full blocks and the tail after them, kv_export.export_request);
        the request's held blocks are released whatever happens."""
        try:
            return kv_export.export_request(self, request_id, token_ids)
        finally:
            self.release_kv(request_id)

    def reserve_kv_import(self, transfer: "KVTransfer") -> kv_import.ImportPlan:
        """Check a received transfer against this engine (KVTransferMismatch) and reserve
        blocks for it (NotEnoughKVBlocks when too few are free); nothing changes on an
        error. The plan then goes to write_kv_import and commit_kv_import, or
        cancel_kv_import."""
        kv_import.check_transfer(self, transfer)
        return self.kv_imports.reserve(self, transfer)

    def write_kv_import(self, plan: kv_import.ImportPlan) -> None:
        """Any thread, also while the engine steps: copy a reserved plan's bytes into its
        blocks, which no request reads before commit_kv_import."""
        kv_import.write_import(self.kv_cache, plan)

    def commit_kv_import(self, plan: kv_import.ImportPlan) -> kv_import.ImportResult:
        """Register a written plan's blocks in the prefix cache (ValueError: it expired or
        was cancelled, its request computes its prompt instead)."""
        return self.kv_imports.commit(self, plan)

    def cancel_kv_import(self, plan: kv_import.ImportPlan) -> bool:
        """Give a plan's blocks back unregistered; True if it still held them."""
        return self.kv_imports.cancel(self, plan)

    # -- one iteration ----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        proposals = self.spec.propose(self.scheduler.running) if self.spec else {}
        for rid in self._forks.keys() & proposals.keys():  # its first token forks: no drafts
            del proposals[rid]
        self._jumps = self._jump_forward(proposals)
        sched = self.scheduler.schedule({rid: p.token_ids for rid, p in proposals.items()})
        if not sched.chunks:
            return []
        for req, tail in sched.kv_tails:  # before any step reads those positions
            tail.write(self.kv_cache, self.blocks.block_tables(req.request_id))
        greedy = self.config.greedy_fast_path and argmax_decides(sched.chunks, self._forks)
        decode_rows = self.spec.decode_rows(sched.chunks) if self.spec is not None else None
        result = self.runner.execute(sched, greedy=greedy)
        self.tokens_computed += sched.num_tokens
        self.scheduler.update_from_output(sched)
        outputs: dict[str, RequestOutput] = {}
        for rid, (start, logits) in result.prompt_logits.items():
            req = self.requests[rid]
            tracker = self._trackers[rid]
            ids = req.prompt_token_ids[start:start + logits.shape[0] + 1]
            lp = prompt_logprobs(logits, ids, req.params.prompt_logprobs or 0)
            if start == first_prompt_row(req.params):  # also a recompute after preemption
                tracker.prompt_logprobs = [None] * start + lp  # unscored positions: None
            else:
                tracker.prompt_logprobs += lp[1:]
        if self._forks:
            result = self._fork_samples(result)
        rows = [1 + len(c.draft_token_ids) for c in result.sampled]
        # chunks without drafts: one batched sampler call; the others are verified
        plain = [i for i, n in enumerate(rows) if n == 1]
        starts = [0]
        for n in rows[:-1]:
            starts.append(starts[-1] + n)
        drawn = {}
        if result.greedy_ids is not None:  # argmax_decides: each row's token is its argmax
            drawn = {i: (token, None) for i, token in enumerate(result.greedy_ids.tolist())}
            self.num_greedy_steps += 1
        elif plain:
            logits = (result.logits if len(plain) == len(rows)
                      else result.logits[torch.tensor([starts[i] for i in plain])])
            sample = self.sampler(logits, [result.sampled[i].request.sampling for i in plain])
            drawn = dict(zip(plain, zip(sample.token_ids, sample.logprobs)))
        for i, c in enumerate(result.sampled):
            if i in drawn:
                token, lp = drawn[i]
                outputs[c.request.request_id] = self._accept(c.request, [token], [lp])
            else:
                outputs[c.request.request_id] = self._verify(
                    c, result.logits[starts[i]:starts[i] + rows[i]], proposals)
        if self.spec is not None and self.spec.wants_hidden and result.sampled_hidden is not None:
            self._observe_hidden(result, rows, outputs)
        seconds = time.perf_counter() - t0
        if sched.num_tokens == len(sched.chunks):  # one token per sequence: a decode step
            self.step_times.record(len(sched.chunks), seconds)
        if self.spec is not None:
            self.spec.record_step(decode_rows, seconds)
        return list(outputs.values())

    def _jump_forward(self, proposals: dict) -> set[str]:
        """Put the tokens each decoding, greedy, constrained request's grammar forces next
        in `proposals` (ahead of a proposer's drafts), as deterministic drafts; returns
        their requests. Verification keeps the tokens exact: where the grammar's own
        tokenization of a forced string is not the only one allowed, the model's argmax
        decides as for any draft. Sampled requests are left to sample token by token: a
        verification draws differently, and how many drafts a step takes depends on the
        other requests, which a seeded request's draws must not."""
        limit = self.config.jump_forward_tokens
        jumps = set()
        jf = self.jump_forward
        if (not limit or len(self.scheduler.running) > self.config.jump_forward_max_batch
                or (jf.proposed >= JUMP_FORWARD_TRIAL
                    and jf.accepted < self.config.jump_forward_min_acceptance * jf.proposed)):
            return jumps
        for req in self.scheduler.running:
            grammar = req.sampling.grammar
            if (grammar is None or not req.params.is_greedy or req.params.needs_penalties
                    or req.num_tokens - req.num_computed_tokens != 1
                    or req.request_id in self._forks):
                continue
            room = limit
            if req.params.max_tokens is not None:  # never past max_tokens
                room = min(room, req.params.max_tokens - len(req.output_token_ids) - 1)
            forced = grammar.forced_tokens()[:max(room, 0)]
            if forced:
                proposals[req.request_id] = Proposal(forced)
                jumps.add(req.request_id)
        return jumps

    def _fork_samples(self, result):
        """Fork the waiting samples of every request whose prompt this step completed: each
        shares the prompt's full KV blocks and gets a copy of the partly filled last one,
        and samples its first token from its parent's logits row (the result grows by
        those rows). A sample whose fork finds no free block runs on its own instead."""
        sampled, order = [], []  # chunks and the result rows they read
        offset = 0
        for c in result.sampled:
            n = 1 + len(c.draft_token_ids)
            sampled.append(c)
            order += range(offset, offset + n)
            children = (self._forks.pop(c.request.request_id, [])
                        if not c.draft_token_ids else [])
            for child in children:
                copies = self.blocks.fork(c.request.request_id, child.request_id)
                if copies is None:
                    self.scheduler.add_request(child)
                    continue
                self.kv_cache.copy_blocks(copies)
                child.num_computed_tokens = c.request.num_computed_tokens
                child.num_cached_tokens = c.request.num_cached_tokens
                child.scheduled_at = c.request.scheduled_at
                self.scheduler.adopt_running(child)
                self._trackers[child.request_id].prompt_logprobs = list(
                    self._trackers[c.request.request_id].prompt_logprobs)
                sampled.append(replace(c, request=child,
                                       block_tables=self.blocks.block_tables(child.request_id)))
                order.append(offset)
                self.num_forked += 1
            offset += n
        if len(order) == offset:
            return result
        at = torch.tensor(order)
        return replace(result, sampled=sampled, logits=result.logits[at],
                       sampled_hidden=None if result.sampled_hidden is None
                       else result.sampled_hidden[at],
                       sampled_taps=None if result.sampled_taps is None
                       else result.sampled_taps[at])

    def _observe_hidden(self, result, rows: list[int], outputs: dict) -> None:
        """Give the proposer each unfinished request's final hidden state at its last
        computed position: the row whose logits chose its newest token (rows of a chunk
        cover positions c.end - n .. c.end - 1)."""
        offset = 0
        for c, n in zip(result.sampled, rows):
            req = c.request
            if not outputs[req.request_id].finished:
                row = offset + n - 1 - (c.end - req.num_computed_tokens)
                taps = None if result.sampled_taps is None else result.sampled_taps[row]
                self.spec.observe(req, result.sampled_hidden[row], taps)
            offset += n

    def _verify(self, c, logits: torch.Tensor, proposals) -> RequestOutput:
        """Sample (no drafts) or verify (drafts) one chunk's logits [1 + drafts, V]."""
        req = c.request
        if not c.draft_token_ids:
            sample = self.sampler(logits, [req.sampling])
            return self._accept(req, sample.token_ids, sample.logprobs)
        if req.request_id in self._jumps:
            verdict = verify(logits, c.draft_token_ids, None, req.sampling)
            self.jump_forward.count(len(c.draft_token_ids), verdict)
        else:
            verdict = self.spec.verify(req, logits, c.draft_token_ids,
                                       proposals[req.request_id])
        req.num_computed_tokens += verdict.num_accepted  # KV of rejected drafts is dropped
        out = self._accept(req, verdict.token_ids, verdict.logprobs or [None] * len(
            verdict.token_ids))
        if not out.finished:
            self.blocks.trim(req.request_id, req.num_computed_tokens)
        return out

    def _accept(self, req: Request, tokens: list[int], lps: list) -> RequestOutput:
        """Emit tokens in order until one finishes the request (the rest are dropped)."""
        tracker = self._trackers[req.request_id]
        out = RequestOutput(req.request_id, "", [], num_prompt_tokens=req.num_prompt_tokens,
                            num_cached_tokens=req.num_cached_tokens,
                            scheduled_at=req.scheduled_at)
        grammar = req.sampling.grammar
        for token, lp in zip(tokens, lps):
            if grammar is not None and not grammar.accept(token):
                upd = _grammar_rejected(tracker, token)  # never from a masked sampler
                break
            req.append_output(token)
            upd = tracker.stop.update(token, tracker.detok.add(token))
            out.text += upd.text
            out.token_ids.append(token)
            out.logprobs += [lp] if lp else []
            if upd.finish_reason is None and grammar is not None and grammar.terminated:
                upd = tracker.stop.finish_grammar()  # its stop token was accepted
            if upd.finish_reason is not None:
                break
        if (len(req.output_token_ids) == len(out.token_ids)
                and req.params.prompt_logprobs is not None):
            out.prompt_logprobs = tracker.prompt_logprobs
        if upd.finish_reason is not None:
            out.text += tracker.detok.flush() if upd.finish_reason == "length" else ""
            status = (RequestStatus.FINISHED_LENGTH if upd.finish_reason == "length"
                      else RequestStatus.FINISHED_STOPPED)
            self.scheduler.finish(req, status)
            out.finished, out.finish_reason, out.stop_reason = True, upd.finish_reason, upd.stop_reason
            out.grammar_incomplete = grammar is not None and not grammar.completed
            del self.requests[req.request_id]
            del self._trackers[req.request_id]
            if self.spec is not None:
                out.spec = self.spec.release(req.request_id)
        return out


def _grammar_rejected(tracker: _Tracker, token: int):
    """End a request whose sampler chose a token its grammar does not allow (a bug, not
    an input error: logged, the request stops cleanly, the loop goes on)."""
    import logging

    logging.getLogger("qserve.engine").error(
        "token %d is outside the request's grammar; the request ends here", token)
    return tracker.stop.finish_grammar()
