"""Benchmark: where one decode step's time goes, in-process (no server).

    python -m qserve.runtime.benchmark.step [MODEL] [--batch 1,16] [--tokens 32] [--reps 3]
        [--threads 1] [--prefill 2048] [--modules] [--prompt-len 1024] [--per-kernel]
        [--no-batch-invariant] [--no-floor]

For each batch size, generates `--tokens` greedy tokens for that many prompts through
`LLM.generate` (`--reps` times, the fastest kept) with wall-clock timers around the
runtime's parts: the C decode path (runtime/models/native_decoder.py: whole steps, whose
own parts are not timed separately; a step it leaves shows ~0 here),
the FP8 linears (and, inside them, the packed (oneDNN or fp32) / torch matmul), the KV store and paged
attention, the LM head (its logits, or the greedy tokens of the engine's greedy fast path),
RMSNorm and RoPE. Times are per engine step; the
parts are nested calls, so they need not add up to the step. `--prefill N` also times
one N-token prompt of held-out text (one output token; the engine's default step budget
chunks it), with the same parts. `--modules` runs every step in the modules (the C
decode path off), to compare the two on one artifact. `--prompt-len N` gives each request
its own N-token window of held-out text instead of a short prompt, so decode steps attend
over ~N tokens of context. `--per-kernel` runs the C path's step programs one call at a
time and adds up their times by kernel (each call then pays its own ctypes call, ~1-2 us),
for that path's decode steps of the full batch, and the rate its linears reach at the
step's shapes. `--no-batch-invariant` serves as
`qserve serve --no-batch-invariant` does (steps of more rows than one pass over the weights
take torch's matmuls), to measure what batch invariance costs. Each batch size also gets
its floor (benchmark/machine_rates.py, measured first in the same process; `--no-floor`
skips it): its weight bytes at this CPU's copy rate and its linears' multiply-adds at its
best GEMM rate, and the step as a multiple of the larger. MODEL defaults to the built-in
model's cached FP8 artifact when there is one.
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import torch

# (label, module, attribute): the functions timed; each is looked up where it is called
PARTS = [
    ("C decode path (whole steps)", "qserve.runtime.models.native_decoder", "NativeDecoder.forward"),
    ("FP8 linears", "qserve.runtime.layers.fp8_linear", "Fp8Linear.forward"),
    ("  of which matmul (packed)", "qserve.kernels.fp8_gemm", "packed_linear"),
    ("KV store", "qserve.kernels.dispatch", "store_kv"),
    ("paged attention", "qserve.kernels.dispatch", "paged_attention"),
    ("LM head + logits", "qserve.runtime.models.llama", "LlamaForCausalLM.compute_logits"),
    # greedy steps (EngineConfig.greedy_fast_path): the head's argmax without logits, or
    # (a head without the fused kernel) around the logits timed above
    ("LM head, greedy tokens", "qserve.runtime.models.llama", "LlamaForCausalLM.greedy_tokens"),
    ("RMSNorm", "qserve.runtime.layers.norm", "RMSNorm.forward"),
    ("RoPE", "qserve.runtime.layers.self_attention", "apply_rotary"),
]


@contextmanager
def timed(totals: dict[str, float]):
    """Wrap every PARTS function with a timer adding into totals[label]; undo on exit."""
    import importlib

    undo = []
    for label, module_name, attr in PARTS:
        owner = importlib.import_module(module_name)
        *path, name = attr.split(".")
        for p in path:
            owner = getattr(owner, p)
        real = getattr(owner, name)

        def wrapper(*a, _real=real, _label=label, **k):
            t = time.perf_counter()
            try:
                return _real(*a, **k)
            finally:
                totals[_label] = totals.get(_label, 0.0) + time.perf_counter() - t

        setattr(owner, name, wrapper)
        undo.append((owner, name, real))
    try:
        yield
    finally:
        for owner, name, real in reversed(undo):
            setattr(owner, name, real)


def main(argv: list[str] | None = None) -> None:
    from ...quantize.builtin_artifact import cached_builtin_artifact
    from ..formats.errors import CheckpointError
    from ..engine import EngineConfig
    from ..llm import LLM
    from ..sampling_params import SamplingParams
    from ..decode_rate import story_prompts, warm_up
    from . import machine_rates
    from .decode_bytes import weight_bytes

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--batch", default="1,16", help="Comma-separated batch sizes.")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="Also time the prefill of one N-token prompt.")
    ap.add_argument("--modules", action="store_true",
                    help="Run every step in the modules (no C decode path).")
    ap.add_argument("--prompt-len", type=int, default=0, metavar="N",
                    help="Prompts of N tokens of held-out text (default: a short prompt).")
    ap.add_argument("--per-kernel", action="store_true",
                    help="Time the C path's decode steps call by call, by kernel.")
    ap.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                    help="Serve without batch invariance (EngineConfig.batch_invariant).")
    ap.add_argument("--no-floor", dest="floor", action="store_false",
                    help="Skip measuring this CPU's copy and GEMM rates (the step's floor).")
    args = ap.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        ap.error(f"--batch must be comma-separated integers, got {args.batch!r}")
    if args.tokens < 2 or args.reps < 1 or min(batches) < 1 or args.prefill < 0 \
            or args.prompt_len < 0:
        ap.error("--tokens must be >= 2, --reps >= 1, every batch size >= 1, --prefill and "
                 "--prompt-len >= 0")
    torch.set_num_threads(args.threads)

    model = cached_builtin_artifact(args.model)
    try:
        llm = LLM(model, config=EngineConfig(batch_invariant=args.batch_invariant))
    except CheckpointError as e:  # a path that is no artifact: the message, not a traceback
        raise SystemExit(f"step benchmark: {e}") from None
    if args.modules:
        llm.engine.runner.native = None
    warm_up(llm, max(batches))
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    print(f"{model}, {args.threads} thread(s), {args.tokens} greedy tokens per request, "
          f"best of {args.reps}; ms per engine step; C decode path "
          f"{'on' if llm.engine.runner.native is not None else 'off'}; batch-invariant "
          f"{'on' if args.batch_invariant else 'off'}")
    spec = llm.engine.kv_cache.spec
    print(f"reads {weight_bytes(llm.lm.path).per_step / 2**20:.1f} MiB of weights a decode step "
          f"(benchmark/decode_bytes.py); KV cache {spec.dtype}, {spec.bytes_per_token:,} "
          f"bytes a token of context")
    rates = None
    if args.floor:
        rates = machine_rates.measure()
        print(machine_rates.MachineRates.describe(rates))
    step_bytes = weight_bytes(llm.lm.path).per_step
    macs = machine_rates.macs_per_row(llm.lm.model)
    native = llm.engine.runner.native
    if args.per_kernel and native is None:
        raise SystemExit("--per-kernel times the C decode path, which does not run this "
                         "artifact here (see `qserve env`); drop --per-kernel or --modules.")
    for batch in batches:
        prompts = (story_prompts(batch)
                   if not args.prompt_len else _text_prompts(llm, batch, args.prompt_len))
        kernels: dict[str, float] = {}
        with per_kernel(native if args.per_kernel else None, batch, kernels):
            wall, totals = _best_of(args.reps, lambda: llm.generate(prompts, params))
        steps = args.tokens
        print(f"\nbatch {batch}: {wall * 1e3 / steps:.1f} ms/step, "
              f"{batch * steps / wall:.1f} output tok/s")
        _print_parts(totals, steps)
        if rates is not None:
            floor = rates.floor(step_bytes, macs, batch)
            print(f"  floor {floor.ms:.1f} ms (weights at the copy rate {floor.memory_ms:.1f}, "
                  f"linears at the best GEMM rate {floor.compute_ms:.1f}): the step is "
                  f"{wall * 1e3 / steps / floor.ms:.2f}x it")
        if args.per_kernel:
            _print_kernels(kernels, batch, _body_macs(llm.lm.model, macs), rates)
    if args.prefill:
        _bench_prefill(llm, args.prefill, args.reps)


@contextmanager
def per_kernel(native, rows: int, totals: dict[str, float]):
    """While active, the C decode path's steps of `rows` rows run their program one call
    at a time; totals[kernel] adds up each kernel's seconds and totals[""] counts the
    steps. native None: nothing changes."""
    if native is None:
        yield
        return
    program, real = native.program, native.program.run

    def run(values, begin=0, end=None):
        if values["t"] != rows:
            return real(values, begin, end)
        end = len(program.calls) if end is None else end
        totals[""] = totals.get("", 0) + (begin == 0)
        for i in range(begin, end):
            t = time.perf_counter()
            real(values, i, i + 1)
            kernel = program.calls[i].kernel
            totals[kernel] = totals.get(kernel, 0.0) + time.perf_counter() - t

    program.run = run
    try:
        yield
    finally:
        del program.run  # the class's method again


def _body_macs(model, macs: int) -> int:
    """Multiply-adds one row makes in the decoder's linears: `macs` (every linear) less the
    LM head's, which the C step program leaves to the head's own call."""
    head = getattr(model, "lm_head", None)
    return macs - (getattr(head, "in_features", 0) * getattr(head, "out_features", 0))


def _print_kernels(kernels: dict[str, float], rows: int, body_macs: int = 0,
                   rates=None) -> None:
    steps = kernels.pop("", 0)
    if not steps:
        print(f"  no C step of exactly {rows} rows ran: the decode steps shared the prompts' "
              f"prefill chunks; with --prompt-len, add --reps 2 (the second run's prompts "
              f"come from the prefix cache)")
        return
    print(f"  C decode steps of {rows} rows, by kernel ({steps:.0f} steps, ms per step):")
    for name, sec in sorted(kernels.items(), key=lambda kv: -kv[1]):
        print(f"    {name:<26} {sec * 1e3 / steps:7.1f}")
    # the linears' kernels (fp8_gemv, int8_gemv_wonly, int8_gemm, bf16_gemv_heads, ...),
    # s per step
    linear_s = sum(sec for name, sec in kernels.items() if "gemv" in name or "gemm" in name)
    linear_s /= steps
    if body_macs and linear_s > 0:
        gflop_s = 2 * body_macs * rows / linear_s / 1e9
        best = max(rates.gemm_gflop_s.values()) if rates is not None else None
        # W8A8 int8 steps: also against torch's int8 GEMM, the rate integer kernels aim at
        int8 = rates.int8_gop_s if rates is not None and "int8_gemm" in kernels else None
        print(f"  the decoder's linears at the step's shapes: {gflop_s:.0f} GFLOP/s"
              + (f", {gflop_s / best:.2f} of the best GEMM rate" if best else "")
              + (f", {gflop_s / int8:.2f} of torch's int8 GEMM rate" if int8 else ""))


def _text_prompts(llm, n: int, length: int) -> list[list[int]]:
    """n distinct length-token windows of the held-out text."""
    from ...evals.golden_text import heldout_token_ids

    ids = heldout_token_ids(llm.lm.tokenizer)
    if len(ids) < n * length:
        raise SystemExit(f"--prompt-len {length} for a batch of {n} needs {n * length} tokens "
                         f"of held-out text; it has {len(ids)}: lower --prompt-len.")
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def _print_parts(totals: dict[str, float], per: int) -> None:
    for label, _, _ in PARTS:
        if label in totals:
            print(f"  {label:<28} {totals[label] * 1e3 / per:7.1f}")


def _best_of(reps: int, run) -> tuple[float, dict[str, float]]:
    """(wall seconds, part totals) of the fastest of `reps` timed runs of run()."""
    best: tuple[float, dict[str, float]] | None = None
    for _ in range(reps):
        totals: dict[str, float] = {}
        with timed(totals):
            t0 = time.perf_counter()
            run()
            wall = time.perf_counter() - t0
        if best is None or wall < best[0]:
            best = (wall, totals)
    return best


def _bench_prefill(llm, n: int, reps: int) -> None:
    from ...evals.golden_text import heldout_token_ids
    from ..sampling_params import SamplingParams

    ids = heldout_token_ids(llm.lm.tokenizer)
    if len(ids) < n * (reps + 1):  # a warm-up and `reps` timed prompts
        raise SystemExit(f"--prefill {n} with --reps {reps} needs {n * (reps + 1)} tokens of "
                         f"held-out text (distinct prompts, so no prefix-cache hits); it has "
                         f"{len(ids)}: lower --prefill or --reps.")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    prompts = iter([ids[i * n:(i + 1) * n] for i in range(reps + 1)])  # disjoint slices
    llm.generate([next(prompts)], params)  # compile this path's shapes
    wall, totals = _best_of(reps, lambda: llm.generate([next(prompts)], params))
    print(f"\nprefill {n} tokens: {wall * 1e3:.0f} ms, {n / wall:.0f} tok/s (ms per prefill)")
    _print_parts(totals, 1)


if __name__ == "__main__":
    main()
