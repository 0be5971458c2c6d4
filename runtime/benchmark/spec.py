"""Benchmark of speculative decoding on real prompts (a command, never a test).

    python -m qserve.runtime.benchmark.spec [MODEL] --threads 2 \
        --proposers ngram,early_exit:12 --k 4 --num-prompts 4 --max-tokens 64
    python -m qserve.runtime.benchmark.spec ARTIFACT --proposers ngram,hidden_draft   # its head
    python -m qserve.runtime.benchmark.spec ARTIFACT --proposers hidden_draft --k 1,2,3,4 \
        --prompts text                                    # held-out text, a sweep over k

Reports per proposer and k the acceptance rate, tokens per verifying step and tokens per
step (every decode step, drafted or not), single-stream decode tokens/s (greedy, one
request at a time, time from the first to the last token), and output throughput at each
--concurrency with speculation off and with the fastest proposer and k. MODEL defaults to
the default built-in model's FP8 artifact (as `qserve serve` uses it).
Prompts (--prompts):
    golden  the golden agreement prompts (evals/golden), wrapped in the chat template when
            the model has one: chat answers
    text    seeded random windows of --text-len tokens of the held-out text that `qserve
            bench` and the llama.cpp comparison cut their prompts from (the Python language
            reference), continued without a template: text continuation
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import click

from ..formats.sources import DEFAULT_MODEL

GOLDEN = Path(__file__).resolve().parents[2] / "evals" / "golden" / "agreement_prompts.jsonl"
FALLBACK = ["The history of the printing press", "def fibonacci(n):",
            "Here is a short recipe for pancakes:", "The water cycle begins when"]


@dataclass
class Run:
    setting: str
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    output_tokens: int = 0
    wall_seconds: float = 0.0
    acceptance_rate: float | None = None
    tokens_per_step: float | None = None  # per verifying step (a step with drafts)
    tokens_per_decode_step: float | None = None  # per decode step, drafted or not

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.wall_seconds if self.wall_seconds else 0.0


def _golden_prompts(tok, n: int) -> list[list[int]]:
    texts = ([json.loads(line)["prompt"] for line in GOLDEN.read_text().splitlines() if line]
             if GOLDEN.is_file() else FALLBACK)[:n]
    if tok.chat_template:
        return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]),
                           add_special_tokens=False) for t in texts]
    return [tok.encode(t) for t in texts]


def _text_prompts(tok, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n windows of `length` tokens at seeded random offsets of the held-out text."""
    from .workloads import default_corpus

    ids = tok.encode("\n\n".join(default_corpus()))
    rng = random.Random(seed)
    starts = [rng.randrange(max(1, len(ids) - length)) for _ in range(n)]
    return [ids[s:s + length] for s in starts]


PROMPTS = {"golden": lambda tok, n, length: _golden_prompts(tok, n),
           "text": _text_prompts}


def _engine(lm, spec, kv_gib: float):
    from ..engine import EngineConfig, LLMEngine

    return LLMEngine.from_model(lm, EngineConfig(kv_cache_gib=kv_gib, max_num_seqs=64,
                                                 speculative=spec))


def _generate(engine, prompts, params, tag: str) -> tuple[dict, float]:
    """Run prompts together; per request the arrival times of its tokens; wall seconds."""
    times: dict[str, list[float]] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params)
        times[f"{tag}-{i}"] = []
    t0 = time.perf_counter()
    while engine.has_unfinished:
        for out in engine.step():
            now = time.perf_counter()
            times[out.request_id] += [now] * len(out.token_ids)
    return times, time.perf_counter() - t0


def single_stream(lm, name: str, spec, prompts, params, kv_gib: float) -> Run:
    engine = _engine(lm, spec, kv_gib)
    _generate(engine, prompts[:1], params.__class__(max_tokens=4, temperature=0.0), "warm")
    run = Run(name)
    base = engine.stats().spec
    decode_steps = 0
    for i, ids in enumerate(prompts):
        times, _ = _generate(engine, [ids], params, f"s{i}")
        for ts in times.values():
            run.decode_tokens += len(ts) - 1
            run.decode_seconds += ts[-1] - ts[0]
            decode_steps += len(set(ts)) - 1  # one arrival time per step
    if spec is not None:
        s = engine.stats().spec
        proposed, accepted = s.proposed - base.proposed, s.accepted - base.accepted
        steps, emitted = s.steps - base.steps, s.emitted - base.emitted
        run.acceptance_rate = accepted / proposed if proposed else 0.0
        run.tokens_per_step = emitted / steps if steps else 0.0
        run.tokens_per_decode_step = run.decode_tokens / decode_steps if decode_steps else 0.0
    return run


def concurrent(lm, name: str, spec, prompts, params, c: int, kv_gib: float) -> Run:
    engine = _engine(lm, spec, kv_gib)
    _generate(engine, prompts[:1], params.__class__(max_tokens=4, temperature=0.0), "warm")
    batch = [prompts[i % len(prompts)] for i in range(c)]
    times, wall = _generate(engine, batch, params, f"c{c}")
    return Run(name, output_tokens=sum(len(t) for t in times.values()), wall_seconds=wall)


def _spec(text: str, k: int, disable_by_batch_size: int | None = None, artifact_draft=None,
          adaptive: bool = True):
    """`artifact_draft`: the artifact's recorded draft (a bare `hidden_draft` or
    `early_exit` takes its head from there); `adaptive`: the draft budget on."""
    from dataclasses import replace

    from ..spec.options import resolve_speculative

    if text == "off":
        return None
    return replace(resolve_speculative(text, k, artifact_draft),
                   disable_by_batch_size=disable_by_batch_size, adaptive=adaptive)


def _k_values(text: str) -> list[int]:
    """"1,2,3" -> [1, 2, 3]; a usage error for anything else."""
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ks = []
    if not ks or any(not 1 <= k <= 32 for k in ks):
        raise click.BadParameter(f"{text!r}: give draft lengths from 1 to 32, comma-separated "
                                 "(e.g. 4 or 1,2,3,4)", param_hint="--k")
    return ks


@click.command()
@click.argument("model", default=DEFAULT_MODEL)
@click.option("--proposers", default="ngram,early_exit:12", show_default=True,
              help="Comma-separated --speculative values to compare with 'off'.")
@click.option("--k", "ks", default="4", show_default=True, callback=lambda c, p, v: _k_values(v),
              help="Draft length, or several comma-separated: each proposer runs at each.")
@click.option("--prompts", "prompt_set", type=click.Choice(sorted(PROMPTS)), default="golden",
              show_default=True, help="Chat answers to the golden prompts, or held-out text "
              "continued.")
@click.option("--text-len", type=click.IntRange(min=1), default=128, show_default=True,
              help="Prompt tokens of each --prompts text window.")
@click.option("--num-prompts", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("--concurrency", default="1,4,16", show_default=True)
@click.option("--concurrency-tokens", type=click.IntRange(min=2), default=32, show_default=True,
              help="max_tokens per request in the concurrency runs.")
@click.option("--kv-cache-gib", type=float, default=0.25, show_default=True)
@click.option("--disable-by-batch-size", type=click.IntRange(min=1), default=None,
              help="As serve's --speculative-disable-by-batch-size.")
@click.option("--budget", type=click.Choice(["on", "off", "both"]), default="on",
              show_default=True, help="The draft budget (serve's --speculative-adaptive): "
              "on, off (every proposed draft verified), or each proposer both ways.")
@click.option("--threads", type=click.IntRange(min=1), default=None)
@click.option("--json-out", default=None, help="Also write the results as JSON here.")
def main(model, proposers, ks, prompt_set, text_len, num_prompts, max_tokens, concurrency,
         concurrency_tokens, kv_cache_gib, disable_by_batch_size, budget, threads, json_out):
    import torch

    from ..formats.artifact_reader import artifact_draft
    from ...quantize.builtin_artifact import builtin_artifact
    from ..loaded_model import load
    from ..sampling_params import SamplingParams

    if threads:
        torch.set_num_threads(threads)
    lm = load(builtin_artifact(model, lambda m: click.echo(m, err=True)), torch.bfloat16)
    recorded = artifact_draft(lm.path) if lm.is_artifact else None
    prompts = PROMPTS[prompt_set](lm.tokenizer, num_prompts, text_len)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # (label, --speculative value, k, draft budget on)
    ways = {"on": (True,), "off": (False,), "both": (True, False)}[budget]
    settings = [("off", "off", 0, True)] + [
        ((p if len(ks) == 1 else f"{p} k={k}") + ("" if on else " (all drafts)"), p, k, on)
        for p in proposers.split(",") if p for k in ks for on in ways]
    click.echo(f"model {lm.name} ({lm.path}), {len(prompts)} {prompt_set} prompts, "
               f"{max_tokens} tokens, k={','.join(map(str, ks))}, threads {torch.get_num_threads()}")
    click.echo(f"{'setting':<24} {'decode tok/s':>12} {'speedup':>8} {'accept':>7} "
               f"{'tok/verify':>10} {'tok/step':>8}")
    single = []
    for label, s, k, on in settings:
        r = single_stream(lm, label, _spec(s, k, disable_by_batch_size, recorded, on), prompts,
                          params, kv_cache_gib)
        single.append(r)
        speed = r.decode_tok_s / single[0].decode_tok_s if single[0].decode_tok_s else 0
        acc = "-" if r.acceptance_rate is None else f"{r.acceptance_rate:.1%}"
        tps = "-" if r.tokens_per_step is None else f"{r.tokens_per_step:.2f}"
        tpd = "-" if r.tokens_per_decode_step is None else f"{r.tokens_per_decode_step:.2f}"
        click.echo(f"{label:<24} {r.decode_tok_s:>12.2f} {speed:>7.2f}x {acc:>7} {tps:>10} "
                   f"{tpd:>8}")
    best = max(range(1, len(single)), key=lambda i: single[i].decode_tok_s, default=None)
    conc = []
    cparams = SamplingParams(max_tokens=concurrency_tokens, temperature=0.0, ignore_eos=True)
    if concurrency.strip():
        click.echo(f"throughput (output tok/s), {concurrency_tokens} tokens per request:")
    for c in [int(x) for x in concurrency.split(",") if x]:
        row = [concurrent(lm, label, _spec(s, k, disable_by_batch_size, recorded, on), prompts,
                          cparams, c, kv_cache_gib)
               for label, s, k, on in [settings[0]] + ([settings[best]] if best else [])]
        conc.append((c, row))
        click.echo(f"  concurrency {c:>3}: " + ", ".join(
            f"{r.setting} {r.throughput:.2f}" for r in row))
    if json_out:
        data = {"model": str(lm.path), "prompts": prompt_set, "k": ks, "max_tokens": max_tokens,
                "single_stream": [vars(r) | {"decode_tok_s": r.decode_tok_s} for r in single],
                "concurrency": [{"concurrency": c, "runs": [vars(r) | {"throughput": r.throughput}
                                                            for r in row]} for c, row in conc]}
        Path(json_out).write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
