"""The `qserve` command line.

    qserve models                 built-in models and where their files are
    qserve env [--json]           this machine's CPU, torch, compiler and kernel paths
    qserve generate [MODEL]       one completion or chat reply, streamed to stdout
    qserve perplexity [MODEL]     perplexity on the held-out real text
    qserve quantize SOURCE ...    (offline) calibrate into an FP8 artifact
    qserve eval ARTIFACT          eval gates that decide whether an artifact may serve
    qserve serve [ARTIFACT]       OpenAI-compatible server
    qserve gateway --config F     LLM gateway in front of OpenAI-compatible servers
    qserve router / cluster       prefill/decode disaggregation (router over workers)

User errors (`QserveError`) print one line and exit with status 2, never a traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import sys
import threading
import time
from pathlib import Path

# qserve never fetches from a model hub: models come from packages, files and the cache.
# Offline mode keeps libraries (datasets, transformers) from waiting on a network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# numpy's OpenBLAS starts a worker per core at import and its workers poll for work; qserve
# does no BLAS through numpy, and on a small machine those threads take time slices from the
# kernels' OpenMP team (measured: ~0.5% of a serving process's CPU, as much in `qserve bench`).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click  # noqa: E402

from ..calib.errors import CalibrationError  # noqa: E402
from .formats.errors import QserveError  # noqa: E402
from ..kernels.cache import cache_root  # noqa: E402
from .formats.sources import BUILTIN_MODELS, DEFAULT_MODEL  # noqa: E402
from .gateway.command import gateway  # noqa: E402
from .disagg.command import cluster, router  # noqa: E402
from ..evals.gates import SUITES  # noqa: E402

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def _user_errors(fn):
    """Turn QserveError into a clean one-line message and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (QserveError, CalibrationError) as e:
            raise click.ClickException(str(e)) from None

    return wrapper


def _set_threads(threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)


def _torch_dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name])


def _cpu_list(ctx, param, value: str | None) -> frozenset[int] | None:
    """A CPU list as taskset writes it ("0", "0,2", "1-3,6") -> its CPUs."""
    if value is None:
        return None
    cpus: set[int] = set()
    try:
        for part in value.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if hi else int(lo)
            if first < 0 or last < first:
                raise ValueError
            cpus.update(range(first, last + 1))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a CPU list such as 0 or 0,2-3.") from None
    return frozenset(cpus)


threads_option = click.option(
    "--threads", type=click.IntRange(min=1), default=None,
    help="CPU threads for torch (default: torch's choice). Fix it when timing.")
def _device(ctx, param, value: str) -> str:
    """--device checked at once (a one-line usage error, not a traceback mid-load)."""
    from .device import DeviceError, resolve_device

    try:
        resolve_device(value)
    except DeviceError as e:
        raise click.BadParameter(str(e)) from None
    return value


device_option = click.option(
    "--device", default="auto", show_default=True, callback=_device,
    help="Where the engine computes: auto | cpu | cuda | cuda:N (auto: the first CUDA GPU "
         "when torch sees one, else the CPU).")
enforce_eager_option = click.option(
    "--enforce-eager", is_flag=True,
    help="CUDA: run decode steps eagerly instead of replaying CUDA graphs (recorded at "
         "start for 1, 2, 4, 8, 16, ... sequences). No effect on the CPU.")
dtype_option = click.option(
    "--dtype", type=click.Choice(sorted(DTYPES)), default="bf16", show_default=True,
    help="Compute dtype on CPU.")


class _Group(click.Group):
    def main(self, *args, **kwargs):
        # Exit code 2 for ClickException as for usage errors: the input was wrong.
        click.ClickException.exit_code = 2
        return super().main(*args, **kwargs)


@click.group(cls=_Group)
@click.version_option(package_name="qserve")
def main():
    """qserve: quantize a language model to static FP8 once, then serve it.

    Models are given as a built-in name (see `qserve models`), an HF checkpoint
    directory (config.json + *.safetensors), or a .gguf file.
    """


@main.command()
@_user_errors
def models():
    """List the built-in models and where their files are."""
    click.echo(f"cache: {cache_root()}  (set QSERVE_CACHE to move it)")
    for name, m in BUILTIN_MODELS.items():
        default = " (default)" if name == DEFAULT_MODEL else ""
        try:
            where = str(m.locate())
        except QserveError as e:
            where = f"not installed: {m.install}"
            del e
        click.echo(f"{name}{default}\n  {m.description}\n  package: {m.package}\n  file: {where}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of lines.")
def env(as_json):
    """This machine's CPU, torch, C compiler, and which kernel each CPU op takes.

    Paste it into a bug report. Loads the C kernel libraries, compiling any this machine
    has not built yet.
    """
    import json

    from .capabilities import probe

    caps = probe()
    if as_json:
        click.echo(json.dumps(caps.as_dict(), indent=2))
    else:
        click.echo("\n".join(caps.lines()))


@main.command()
@click.argument("model", default=DEFAULT_MODEL)
@click.option("--prompt", "-p", default=None, help="Prompt text (default: read stdin).")
@click.option("--chat/--no-chat", default=None,
              help="Wrap the prompt as a user message in the chat template "
                   "(default: on when the model has a template).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="0 is greedy.")
@click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=1.0)
@click.option("--seed", type=int, default=None)
@device_option
@enforce_eager_option
@threads_option
@dtype_option
@_user_errors
def generate(model, prompt, chat, max_tokens, temperature, top_p, seed, device, enforce_eager,
             threads, dtype):
    """Generate one reply from MODEL (default: smollm2-135m), streamed to stdout.

    Runs through the serving engine (the same sampler, kernels and KV cache as `qserve
    serve`), so a seeded sample here is the one the server gives."""
    from .llm import LLM
    from .loaded_model import load
    from .sampling_params import SamplingParams

    _set_threads(threads)
    if prompt is None:
        if sys.stdin.isatty():
            raise QserveError("no prompt: pass --prompt TEXT or pipe text on stdin.")
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise QserveError("the prompt is empty.")
    t0 = time.perf_counter()
    lm = load(model, _torch_dtype(dtype))
    tok = lm.tokenizer
    use_chat = bool(tok.chat_template) if chat is None else chat
    if use_chat:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}])
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(prompt, add_special_tokens=True)
    try:
        from .engine import EngineConfig

        llm = LLM(lm, device=device,
                  config=EngineConfig(decode_graphs="off") if enforce_eager else None)
    except ValueError as e:
        raise QserveError(str(e)) from None
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            seed=seed)
    t1 = time.perf_counter()
    n = 0
    first = None
    for out in llm.stream(ids, params):
        n += len(out.token_ids)
        first = first or (time.perf_counter() if out.token_ids else None)
        click.echo(out.text, nl=False)
    click.echo("")
    t2 = time.perf_counter()
    decode_s = t2 - (first or t2)
    rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
    click.echo(
        f"[{lm.name}: {len(ids)} prompt tokens, {n} generated; load {t1 - t0:.1f}s, "
        f"first token {(first or t2) - t1:.2f}s, decode {rate:.1f} tok/s, "
        f"{os.environ.get('OMP_NUM_THREADS') or threads or 'default'} threads]",
        err=True,
    )


@main.command()
@click.argument("model", default=DEFAULT_MODEL)
@click.option("--window", type=click.IntRange(min=2), default=1024, show_default=True)
@click.option("--stride", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Score only the first N tokens of the held-out text.")
@threads_option
@dtype_option
@_user_errors
def perplexity(model, window, stride, max_tokens, threads, dtype):
    """Perplexity of MODEL on the held-out real text (never used for calibration)."""
    from ..evals.golden_text import HELDOUT_FILE, load_heldout_text
    from ..evals.perplexity import perplexity as ppl
    from .attention import DenseAttention
    from .loaded_model import load

    if stride > window:
        raise QserveError(f"--stride ({stride}) must not exceed --window ({window}).")
    _set_threads(threads)
    lm = load(model, _torch_dtype(dtype))
    t0 = time.perf_counter()
    r = ppl(lm.model, lm.tokenizer, load_heldout_text(), window, stride, max_tokens,
            attention=lm.attention(DenseAttention()))
    dt = time.perf_counter() - t0
    click.echo(
        f"{lm.name} {dtype}: perplexity {r.perplexity:.4f} over {r.num_tokens} tokens "
        f"({r.num_docs} docs of {HELDOUT_FILE.name}, window {r.window}, stride {r.stride}) "
        f"in {dt:.1f}s"
    )


@main.command()
@click.argument("reference")
@click.argument("candidates", nargs=-1, required=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Score only the first N tokens of the held-out text.")
@click.option("--agreement-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Greedy tokens per prompt for the agreement check.")
@threads_option
@dtype_option
@_user_errors
def compare(reference, candidates, max_tokens, agreement_tokens, threads, dtype):
    """Compare artifacts (CANDIDATES) with REFERENCE: perplexity and greedy agreement.

    Perplexity on the held-out text; greedy agreement over the first --agreement-tokens
    tokens after prefixes of the held-out documents (teacher-forced top-1 agreement, and
    the share of prompts whose greedy output is identical).
    """
    from ..evals.agreement import agreement, heldout_prompts, reference_continuations
    from ..evals.golden_text import load_heldout_text
    from ..evals.perplexity import perplexity as ppl
    from .attention import DenseAttention
    from .loaded_model import load

    _set_threads(threads)
    texts = load_heldout_text()
    ref = load(reference, _torch_dtype(dtype))
    prompts = [ref.tokenizer.encode(p) for p in heldout_prompts(texts)]
    t0 = time.perf_counter()
    ref_out = reference_continuations(ref.model, prompts, agreement_tokens, ref.attention)
    ref_ppl = ppl(ref.model, ref.tokenizer, texts, max_tokens=max_tokens,
                  attention=ref.attention(DenseAttention()))
    click.echo(f"{'model':<48} {'perplexity':>11} {'vs ref':>8} {'top-1 agree':>12} "
               f"{'identical':>10}")
    click.echo(f"{reference:<48} {ref_ppl.perplexity:>11.4f} {'':>8} {'':>12} {'':>10}")
    for cand_spec in candidates:
        cand = load(cand_spec, _torch_dtype(dtype))
        if cand.tokenizer.hf.to_str() != ref.tokenizer.hf.to_str():
            raise QserveError(f"{cand_spec}: its tokenizer differs from {reference}'s; "
                              "compare models that share a tokenizer.")
        r = ppl(cand.model, cand.tokenizer, texts, max_tokens=max_tokens,
                attention=cand.attention(DenseAttention()))
        a = agreement(cand.model, prompts, ref_out, cand.attention)
        delta = (r.perplexity / ref_ppl.perplexity - 1) * 100
        click.echo(f"{cand_spec:<48} {r.perplexity:>11.4f} {delta:>+7.2f}% "
                   f"{a.token_agreement:>11.1%} {a.sequences_identical:>10.1%}")
    click.echo(f"[{ref_ppl.num_tokens} held-out tokens; {len(prompts)} prompts x "
               f"{agreement_tokens} greedy tokens; {time.perf_counter() - t0:.0f}s]", err=True)


@main.command()
@click.argument("source")
@click.option("--out", "out_dir", required=True, help="Artifact directory to write.")
@click.option("--recipe", default=None,
              help="Recipe YAML (schemes, observers, ignore list), or a shipped recipe by name "
                   "(w8a8-int8: int8 weights and per-row int8 inputs).")
@click.option("--calib", default=None,
              help="Calibration data: .jsonl/.json/.parquet/.txt or a saved dataset dir "
                   "(default: the bundled real-text corpus).")
@click.option("--num-samples", type=click.IntRange(min=1), default=None,
              help="Override the recipe's calibration.num_samples.")
@click.option("--seq-len", type=click.IntRange(min=2), default=None,
              help="Override the recipe's calibration.seq_len.")
@click.option("--force", is_flag=True, help="Replace DIR if it exists.")
@click.option("--shard-mib", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Largest safetensors shard; finished tensors wait in memory up to this.")
@click.option("--draft", default=None,
              help="Record a draft for speculative decoding: model:SOURCE, early_exit:N, "
                   "early_exit:N+head (head distilled on the calibration text), hidden_draft "
                   "(a head over the target's last hidden state, distilled on its own "
                   "answers; n-gram lookup first), or ngram.")
@click.option("--num-speculative-tokens", type=click.IntRange(1, 32), default=4,
              show_default=True, help="The draft's default k (tokens proposed per step).")
@click.option("--budget", default=None,
              help="Quality budget, e.g. ppl=+1%, kl=0.004 or both (ppl=+1%,kl=0.004): keep "
                   "what it takes (linear inputs, the KV cache, whole layers) closer to bf16 "
                   "for word perplexity and/or next-token KL within it (measured; takes "
                   "several times a plain quantize). Recipe key: budget.")
@click.option("--mla", default=None, metavar="RANK|auto",
              help="Convert attention to latent attention (MLA, DeepSeek-V3 layout) before "
                   "FP8 calibration: the latent rank, or auto (the smallest within "
                   "--mla-budget). Llama-family sources. Recipe key: mla.")
@click.option("--mla-budget", default=None, metavar="PCT",
              help="For --mla auto: the largest token-perplexity increase on held-out text, "
                   "e.g. 5% (default 5%).")
@click.option("--mla-rope-heads", type=click.IntRange(min=1), default=None,
              help="Kv heads' worth of key kept under RoPE (default 1: DeepSeek-V3's layout; "
                   "more is closer to the source but only qserve reads it).")
@click.option("--mla-rope-select", type=click.Choice(["heads", "pairs"]), default=None,
              help="Which keys keep RoPE: heads (the first --mla-rope-heads mixed kv heads "
                   "whole, the default) or pairs (as many frequency-pair slots, per layer "
                   "those where dropping RoPE costs most; only qserve reads it).")
@click.option("--mla-distill", type=click.IntRange(min=0), default=None, metavar="STEPS",
              help="Distil each converted attention layer towards the source's for STEPS "
                   "steps on the calibration text (0: none).")
@click.option("--mla-distill-model", type=click.IntRange(min=0), default=None, metavar="STEPS",
              help="Then distil all converted attention projections together towards the "
                   "source's next-token distribution, one 512-token row per step (0: none; "
                   "about 6 s a step on 2 cores for SmolLM2-135M).")
@click.option("--gate", is_flag=True,
              help="Run the eval gates on the new artifact and record the verdict in its "
                   "manifest (what `qserve serve` checks); exit 1 if a gate fails.")
@click.option("--suite", type=click.Choice(list(SUITES)), default=None,
              help="The package gate suite for --gate (default: default).")
@click.option("--gates", "gates_file", default=None,
              help="Gate definitions for --gate (default: the package's default gates).")
@threads_option
@click.option("--dtype", type=click.Choice(["auto", *sorted(DTYPES)]), default="auto",
              show_default=True,
              help="Calibration compute dtype; auto: bf16 where the CPU has native bf16 "
                   "matmuls, fp32 elsewhere (see `qserve env`).")
@_user_errors
def quantize(source, out_dir, recipe, calib, num_samples, seq_len, force, shard_mib, draft,
             num_speculative_tokens, budget, mla, mla_budget, mla_rope_heads, mla_rope_select,
             mla_distill, mla_distill_model, gate, suite, gates_file, threads, dtype):
    """Calibrate SOURCE into a static FP8 artifact (compressed-tensors format).

    SOURCE is a built-in name, an HF checkpoint directory or a .gguf file. Weights become
    FP8 E4M3 (per output channel by default) with static per-tensor activation scales;
    the KV cache gets calibrated k/v scales. Calibration runs block by block, so memory
    grows with the largest block, not the model. The artifact appears at DIR only once
    it is complete and verified.
    """
    from dataclasses import replace

    from ..quantize.draft import parse_draft
    from ..quantize.pipeline import format_report, quantize as run
    from ..quantize.recipe import load_recipe

    _set_threads(threads)
    if gates_file or suite:  # checked now, not after minutes of calibration
        if not gate:
            raise QserveError("--suite and --gates name the gate definitions for --gate; "
                              "add --gate.")
        from ..evals.gates import gates_path, load_gates

        gates_file = gates_path(suite, gates_file)
        load_gates(gates_file)
    draft_spec = parse_draft(draft, num_speculative_tokens) if draft else None
    r = load_recipe(recipe)
    if recipe is None and not Path(source).exists():
        from ..quantize.builtin_artifact import builtin_recipe, builtin_recipe_path

        if builtin_recipe_path(source) is not None:  # the recipe `qserve serve` makes it with
            r = builtin_recipe(source)
            _say(f"qserve: quantizing {source} with its built-in recipe, as `qserve serve "
                 f"{source}` does (--recipe FILE for another).")
    overrides = {k: v for k, v in (("num_samples", num_samples), ("seq_len", seq_len)) if v}
    if overrides:
        r = replace(r, calibration=replace(r.calibration, **overrides))
    if budget is not None:
        from ..quantize.budget import BudgetSpec

        spec = BudgetSpec.parse(budget)
        r = replace(r, budget=replace(r.budget, ppl=spec.ppl, kl=spec.kl))
    r = _with_mla_options(r, mla, mla_budget, mla_rope_heads, mla_distill, mla_distill_model,
                          mla_rope_select)
    bar = _progress_printer()
    report = run(source, out_dir, r, calib, force,
                 None if dtype == "auto" else _torch_dtype(dtype), progress=bar,
                 shard_bytes=shard_mib << 20, draft=draft_spec)
    click.echo("", err=True)
    click.echo(format_report(report))
    if report.budget is not None and report.budget.met is False:
        _say(f"qserve: {report.out_dir} is written, but it measures "
             f"{report.budget.final.ppl_increase:+.2%} word perplexity against the budget's "
             f"+{report.budget.spec.ppl:.2%} (recorded in its manifest).")
        sys.exit(1)
    if gate:
        from ..evals.report import settled_failures
        from ..evals.serve_gate import run_gates

        verdict = run_gates(str(report.out_dir), _say, gates_file)
        if not verdict.passed:
            settled = settled_failures(verdict.failed, verdict.unsettled)
            then = ("`qserve serve` refuses it without --allow-ungated" if settled else
                    "each failing gate is within the datasets' noise, so `qserve serve` "
                    "serves it with a warning")
            _say(f"qserve: {report.out_dir} is written, but its eval gates FAIL (recorded in its "
                 f"manifest): {then}.")
            sys.exit(1)


def _with_mla_options(r, mla, budget, rope_heads, distill, distill_model=None,
                      rope_select=None):
    """The recipe with the --mla* options applied (checked like recipe keys)."""
    from ..quantize.recipe import recipe_from_dict

    if mla is None and (budget, rope_heads, distill, distill_model, rope_select) != (None,) * 5:
        raise QserveError("--mla-budget, --mla-rope-heads, --mla-rope-select, --mla-distill "
                          "and --mla-distill-model apply to a conversion: add --mla RANK or "
                          "--mla auto.")
    if mla is None:
        return r
    raw = {k: v for k, v in r.to_dict()["mla"].items()}
    if mla == "auto":
        raw.update(auto=True, rank=0)
    elif mla.isdigit() and int(mla) > 0:
        raw.update(rank=int(mla), auto=False)
    else:
        raise QserveError(f"--mla {mla!r}: give a positive latent rank (e.g. 127) or auto.")
    if budget is not None:
        if raw["rank"]:
            raise QserveError("--mla-budget applies to --mla auto; a fixed rank has no budget.")
        text = budget.strip().rstrip("%").lstrip("+")
        try:
            raw["budget"] = float(text) / 100
        except ValueError:
            raise QserveError(f"--mla-budget {budget!r}: give a percentage, e.g. 5%.") from None
    if rope_heads is not None:
        raw["rope_heads"] = rope_heads
    if rope_select is not None:
        raw["rope_select"] = rope_select
    if distill is not None:
        raw["distill_steps"] = distill
    if distill_model is not None:
        raw["distill_model_steps"] = distill_model
    from dataclasses import replace

    return replace(r, mla=recipe_from_dict({"mla": raw}).mla)


def _progress_printer():
    """One status line on stderr, rewritten in place."""
    start = time.perf_counter()

    def show(msg: str) -> None:
        bar = ""
        head, _, frac = msg.rpartition(" ")
        if head == "block" and "/" in frac:  # "block 3/30": draw a bar
            done, total = (int(x) for x in frac.split("/"))
            fill = round(30 * done / total)
            bar = f" [{'#' * fill}{'.' * (30 - fill)}]"
        click.echo(f"\r[{time.perf_counter() - start:6.1f}s] {msg:<24}{bar}", nl=False, err=True)

    return show


@main.command(name="import")
@click.argument("path")
@click.option("--source", required=True,
              help="The bf16 model PATH was quantized from (a built-in name or a checkpoint "
                   "directory): the reference for `qserve eval` and `qserve compare`.")
@click.option("--force", is_flag=True, help="Write the manifest again where there is one.")
@_user_errors
def import_(path, source, force):
    """Adopt a compressed-tensors FP8 checkpoint made elsewhere (e.g. by llm-compressor)
    as an artifact: checks that qserve serves its scheme and that it matches SOURCE, then
    writes its qserve.json manifest (the weights stay as they are)."""
    from ..quantize.import_checkpoint import import_checkpoint

    m = import_checkpoint(path, source, force=force)
    click.echo(f"{path}: imported ({len(m.files)} files, reference {source}); serve it with "
               f"`qserve serve {path}`.")


@main.command(name="eval")
@click.argument("artifact", default=DEFAULT_MODEL)
@click.option("--suite", type=click.Choice(list(SUITES)), default=None,
              help="A package gate suite: default (~5 min cold on 2 cores), or full (the "
                   "same gates on about twice the generation and 2.8x the choice items: "
                   "standard errors ~0.6x the default's; ~16 min cold).")
@click.option("--gates", default=None,
              help="Gate definitions (YAML; default: the package's evals/gates/default.yaml).")
@click.option("--endpoint", default=None,
              help="Evaluate this OpenAI-compatible server (base URL) instead of running the "
                   "artifact in-process; ARTIFACT then supplies tokenizer and reference.")
@click.option("--served-model", default=None,
              help="Model name the endpoint serves (default: the first of its /v1/models).")
@click.option("--out", "out_dir", default=None,
              help="Directory for report.json / report.md (default: under the cache).")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Documents per task (overrides the gates file; for quick checks).")
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Extra agreement prompts (JSONL of {id, prompt|messages}), e.g. from "
                   "`qserve gateway export`: real traffic joins the agreement gate.")
@click.option("--recompute-reference", is_flag=True,
              help="Compute the bf16 reference's results on this machine even where qserve "
                   "ships them (SmolLM2's default and full suites, Qwen2.5-Coder's default).")
@device_option
@threads_option
@_user_errors
def eval_(artifact, suite, gates, endpoint, served_model, out_dir, limit, prompts,
          recompute_reference, device, threads):
    """Run eval gates (perplexity, tasks, agreement) on ARTIFACT; exit 0 only if all pass.

    ARTIFACT is a qserve artifact or a built-in model name (its cached FP8 artifact). The
    bf16 source named in the artifact's manifest is the reference. An in-process report
    is recorded in the artifact's manifest, which `qserve serve` checks.
    """
    from ..evals.gates import gates_path, load_gates
    from ..evals.report import record_in_manifest, to_markdown, write_report
    from ..evals.runner import run_eval

    _set_threads(threads)
    gates = load_gates(gates_path(suite, gates))
    if limit is not None:
        gates.limit = limit
    path = _builtin_artifact(artifact)
    t0 = time.perf_counter()
    report = run_eval(path, gates, endpoint=endpoint, served_model=served_model,
                      progress=lambda m: click.echo(f"[{time.perf_counter() - t0:6.1f}s] {m}",
                                                    err=True), prompts=prompts,
                      recompute_reference=recompute_reference, device=device)
    out = Path(out_dir) if out_dir else (cache_root() / "evals" / "reports" /
                                         f"{Path(path).name}-{report.artifact['digest'][:12]}")
    js, md = write_report(report, out)
    if report.mode == "in-process":
        record_in_manifest(report, js)
    click.echo(to_markdown(report))
    click.echo(f"report: {js} and {md}" + ("; recorded in the artifact's manifest"
                                             if report.mode == "in-process" else ""), err=True)
    if not report.passed:
        sys.exit(1)


@main.command()
@click.argument("artifact", default=DEFAULT_MODEL)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 exposes the server to the network).")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--api-key", default=None, envvar="QSERVE_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1 routes (or set QSERVE_API_KEY).")
@click.option("--served-model-name", default=None,
              help="The model name clients send (default: ARTIFACT as given).")
@click.option("--kv-cache-gib", type=click.FloatRange(min=0.0, min_open=True), default=1.0,
              show_default=True, help="Memory for the paged KV cache.")
@click.option("--kv-dtype", type=click.Choice(["fp8", "bf16"]), default=None,
              help="KV cache dtype (default: fp8 for artifacts with k/v scales, else bf16).")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=64, show_default=True,
              help="Most requests running in one batch.")
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=512,
              show_default=True, help="Token budget of one engine step (chunked prefill).")
@click.option("--max-prefill-tokens-with-decodes", type=click.IntRange(min=1), default=None,
              help="Prompt tokens in a step that also decodes (default: the step budget). "
                   "Smaller keeps inter-token latency even while long prompts arrive.")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait beyond the --max-num-seqs running; more get 429.")
@click.option("--max-body-mib", type=click.FloatRange(min=0.0, min_open=True), default=8.0,
              show_default=True, help="Largest request body accepted (413 beyond).")
@click.option("--max-tokens-default", type=click.IntRange(min=1), default=1024,
              show_default=True,
              help="Tokens generated for a request that names no max_tokens (cut to the "
                   "context's room), so that no request holds a slot for minutes unasked.")
@click.option("--shutdown-drain-s", type=click.FloatRange(min=0.0), default=10.0,
              show_default=True,
              help="On SIGTERM or Ctrl-C: new requests are refused and running streams may "
                   "go on this long, then end with an error event.")
@click.option("--max-n", type=click.IntRange(min=1), default=16, show_default=True,
              help="Most samples (n) one request may ask for; they share one prefill.")
@click.option("--tool-call-parser", default="auto", show_default=True,
              help="How the model writes tool calls: 'hermes' (Qwen2.5/3, Hermes), or "
                   "'auto' (from the chat template; a template without tool support gets "
                   "the hermes format described in a system prompt).")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True,
              show_default=True, help="Reuse the KV blocks of identical prompt prefixes.")
@click.option("--decode-impl", default=None, help="Paged-attention decode variant (advanced).")
@click.option("--keep-fp8-weights/--no-keep-fp8-weights", default=True, show_default=True,
              help="CPU: keep each FP8 linear's E4M3 bytes beside its bf16 copy (+1 byte per "
                   "weight), so decode steps of a few sequences read 1 byte per weight.")
@click.option("--batch-invariant/--no-batch-invariant", default=True, show_default=True,
              help="An FP8 artifact's every step runs the C kernels, whose per-row sums do not "
                   "depend on the batch: a greedy request's tokens depend on its prompt alone. "
                   "--no-batch-invariant: long prompt steps take torch's matmuls (faster "
                   "prompts on AMX / AVX512-BF16; tokens may then depend on the batch).")
@click.option("--speculative", default=None,
              help="Speculative decoding: ngram[:MAX_N], early_exit[:N], draft_model[:PATH], "
                   "hidden_draft (the artifact's head) or off (default: the artifact's recorded draft, else off).")
@click.option("--num-speculative-tokens", type=click.IntRange(1, 32), default=None,
              help="Draft tokens per step (default: the artifact's, else 4).")
@click.option("--speculative-disable-by-batch-size", type=click.IntRange(min=1), default=None,
              help="Draft nothing while more than this many requests are running (a "
                   "verifying step costs more than a plain one; default: always draft).")
@click.option("--speculative-adaptive/--no-speculative-adaptive", default=True,
              help="Cut the drafts of greedy and unseeded requests, step by step, to the "
                   "number whose expected tokens pay for verifying them at this machine's "
                   "measured step times (default; a draft model or early exit is asked "
                   "for only those). --no-speculative-adaptive makes and verifies every "
                   "draft.")
@click.option("--allow-ungated", is_flag=True,
              help="Serve an artifact without a `qserve eval` report that lets it serve "
                   "(none, one for other files, or a FAIL beyond the datasets' noise; a "
                   "FAIL within it serves with a warning).")
@click.option("--role", type=click.Choice(["both", "prefill", "decode"]), default="both",
              show_default=True,
              help="Prefill/decode disaggregation: a prefill worker computes prompts and ships "
                   "their KV; a decode worker receives it (its KV port is in "
                   "/v1/disagg/info) and generates. Put `qserve router` in front.")
@click.option("--kv-transport", type=click.Choice(["socket", "mooncake"]), default="socket",
              show_default=True,
              help="How a decode worker receives KV: `socket` (loopback TCP frames) or "
                   "`mooncake` (Mooncake's transfer engine writes into a registered buffer; "
                   "needs mooncake-transfer-engine-non-cuda and libibverbs1/librdmacm1).")
@click.option("--kv-receive-cores", callback=_cpu_list, default=None, metavar="LIST",
              help="CPUs (e.g. 0 or 0,2-3) on which a decode worker reads, checks and "
                   "copies into its KV pool the KV it receives, instead of its own: on one "
                   "machine, a prefill worker's cores keep that work off the decode steps.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
@device_option
@click.option("--gpu-memory-utilization", type=click.FloatRange(0.0, 1.0, min_open=True),
              default=0.9, show_default=True,
              help="CUDA: the share of the GPU's memory the process may hold; the KV pool "
                   "gets what the weights leave of it (--kv-cache-gib is the CPU's).")
@enforce_eager_option
@threads_option
@dtype_option
@_user_errors
def serve(artifact, host, port, api_key, served_model_name, kv_cache_gib, kv_dtype, max_num_seqs,
          max_num_batched_tokens, max_prefill_tokens_with_decodes, max_queue, max_body_mib,
          max_tokens_default, shutdown_drain_s, max_n, tool_call_parser, enable_prefix_caching,
          decode_impl, keep_fp8_weights, batch_invariant, speculative, num_speculative_tokens,
          speculative_disable_by_batch_size, speculative_adaptive, allow_ungated, role,
          kv_transport,
          kv_receive_cores, log_level, device, gpu_memory_utilization, enforce_eager, threads,
          dtype):
    """Serve ARTIFACT (default: the default model) with an OpenAI-compatible API over SSE.

    ARTIFACT is a qserve artifact, a built-in model name, an HF checkpoint directory or a
    .gguf file. A built-in name serves its FP8 artifact, quantized into the cache on first
    use; directories and .gguf files are served as given (bf16; `qserve quantize` them
    for FP8). One engine
    loop serves all requests: POST /v1/completions and /v1/chat/completions (streaming or
    not), GET /v1/models, /health, /metrics, /tokenize, /detokenize, /tokenizer_info, and
    a chat page at /.
    """
    import logging

    import uvicorn

    from . import telemetry
    from .async_engine import AsyncEngine
    from .capabilities import probe
    from .engine import EngineConfig, LLMEngine

    telemetry.configure("qserve-serve")  # on only where the OTEL_* variables ask for it
    from .loaded_model import load
    from .server import ServerLimits, create_app, model_context_length
    from .warm_up import warm_up

    if kv_receive_cores is not None:
        from .disagg.connector import check_cores

        if role != "decode":
            raise QserveError(f"--kv-receive-cores is for a decode worker; this is --role "
                              f"{role}.")
        try:
            check_cores(kv_receive_cores)
        except ValueError as e:
            raise QserveError(f"--kv-receive-cores: {e}") from None
    if role == "decode" and kv_transport == "mooncake":
        from .disagg.mooncake_connector import INSTALL_HINT, available

        if not available():  # before minutes of loading
            raise QserveError(f"--kv-transport mooncake: Mooncake's transfer engine does not "
                              f"import here; {INSTALL_HINT}.")
    if decode_impl is not None:
        from ..kernels.paged_attention import DECODE_IMPLS

        if decode_impl not in DECODE_IMPLS:
            raise QserveError(f"--decode-impl {decode_impl!r} is unknown; choose one of "
                              f"{', '.join(sorted(DECODE_IMPLS))}.")
    _set_threads(threads)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    click.echo(f"qserve: {probe().one_line()}", err=True)
    t0 = time.perf_counter()
    served_as = artifact
    artifact = prepare_builtin_artifact(artifact, gate=not allow_ungated)
    from ..evals.serve_gate import check_gates

    check_gates(artifact, allow_ungated, _say)
    lm = load(artifact, _torch_dtype(dtype))
    try:
        from .formats.artifact_reader import artifact_draft
        from .spec.options import resolve_speculative

        spec = resolve_speculative(speculative, num_speculative_tokens,
                                   artifact_draft(lm.path) if lm.is_artifact else None)
        if spec is not None and speculative_disable_by_batch_size is not None:
            spec = dataclasses.replace(spec,
                                       disable_by_batch_size=speculative_disable_by_batch_size)
        elif speculative_disable_by_batch_size is not None:
            raise QserveError("--speculative-disable-by-batch-size needs speculation "
                              "(--speculative PROPOSER, or an artifact with a draft).")
        if spec is not None:
            spec = dataclasses.replace(spec, adaptive=speculative_adaptive)
        elif not speculative_adaptive:
            raise QserveError("--no-speculative-adaptive needs speculation "
                              "(--speculative PROPOSER, or an artifact with a draft).")
        config = EngineConfig(device=device, gpu_memory_utilization=gpu_memory_utilization,
                              decode_graphs="off" if enforce_eager else None,
                              kv_cache_gib=kv_cache_gib, kv_dtype=kv_dtype,
                              max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens,
                              enable_prefix_caching=enable_prefix_caching,
                              max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes,
                              decode_impl=decode_impl, speculative=spec,
                              keep_fp8_weights=keep_fp8_weights,
                              batch_invariant=batch_invariant)
        engine = LLMEngine.from_model(lm, config)
        limits = ServerLimits(max_in_flight=max_num_seqs + max_queue,
                              max_body_bytes=int(max_body_mib * 2**20),
                              max_tokens_default=max_tokens_default,
                              shutdown_drain_s=shutdown_drain_s, max_n=max_n,
                              max_model_len=model_context_length(lm.checkpoint.config))
        from .tools import pick_format

        pick_format(lm.tokenizer.chat_template, tool_call_parser)  # a bad name: an error now
    except ValueError as e:
        raise QserveError(str(e)) from None
    # the grammar engine's tables for this vocabulary, built beside the engine's warm-up
    # and finished before the server answers: built after it, they held both cores for
    # ~1.4 s while the first clients' requests ran (a 3 s first TTFT, 0.9 s decode stalls)
    grammar_warm_up = threading.Thread(target=engine.grammars.warm_up,
                                       name="qserve-grammar-warm-up", daemon=True)
    grammar_warm_up.start()
    warm_up(engine, lm.tokenizer)
    grammar_warm_up.join()
    async_engine = AsyncEngine(engine, start_thread=False)  # its loop runs below, here
    name = served_model_name or served_as
    from .formats.artifact_reader import artifact_identity
    from .server.disagg_routes import DisaggRole

    disagg = DisaggRole(role, kv_transport=kv_transport, receive_cores=kv_receive_cores)
    if role == "decode":
        if not enable_prefix_caching:
            raise QserveError("--role decode places received KV in the prefix cache: drop "
                              "--no-enable-prefix-caching.")
        from .disagg import create_connector

        def make():
            return create_connector(kv_transport, host="127.0.0.1", port=0, listen=True,
                                    receive_cores=kv_receive_cores)

        receiver = make()  # an ephemeral port the OS picks ...
        while receiver.port == port:  # ... which may be the one HTTP is about to bind
            spare = make()
            receiver.close()
            receiver = spare
        disagg.receiver = receiver
    app = create_app(async_engine, lm.tokenizer, name, api_key=api_key, limits=limits,
                     identity=artifact_identity(artifact), disagg=disagg,
                     tool_call_parser=tool_call_parser)
    state = app.state.qserve
    shown = f"[{host}]" if ":" in host else host
    click.echo(
        f"qserve: {name} loaded in {time.perf_counter() - t0:.1f}s "
        f"({engine.blocks.num_blocks} KV blocks, {engine.kv_cache.spec.dtype} KV, context "
        f"{state.max_model_len} tokens, {limits.max_in_flight} requests at most"
        f"{f', speculative {spec.proposer} k={spec.num_speculative_tokens}' if spec else ''}"
        f"{', API key required' if api_key else ''}"
        f"{f', {engine.execution.line()}' if not engine.execution.cpu_native else ''}"
        f"{f', role {role}' if role != 'both' else ''}"
        f"{f', {kv_transport} KV receiver on port {disagg.receiver.port}' if disagg.receiver else ''})",
        err=True)
    click.echo(f"qserve: serving at http://{shown}:{port}/v1  (chat page: http://{shown}:{port}/)",
               err=True)
    # HTTP in a thread, the engine loop in this one (why: runtime/async_engine.py). Ctrl-C
    # or SIGTERM stop the HTTP server gracefully (a second one forcibly); the loop keeps
    # stepping until the server thread is gone, so requests in flight can finish.
    # uvicorn waits for open connections past the streams' drain (they end themselves)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=shutdown_drain_s + 5))
    http = threading.Thread(target=_run_http, args=(server,), name="qserve-http", daemon=True)
    handlers = {sig: signal.signal(sig, server.handle_exit)
                for sig in (signal.SIGINT, signal.SIGTERM)}
    http.start()
    _favour_http(http.native_id)
    try:
        async_engine.run_forever(stop_when=lambda: not http.is_alive())
    finally:
        server.should_exit = True
        http.join(timeout=10)
        async_engine.shutdown()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if not server.started:
        raise QserveError(f"the HTTP server did not start on {host}:{port} (its error is "
                          f"above); is the port in use? Pick another with --port.")


ENGINE_NICE = 10  # how much lower the engine's threads run than the HTTP thread


def _favour_http(http_tid: int | None) -> None:
    """Every thread of this process but the HTTP one (the engine loop and the OpenMP
    workers of its kernels) gets ENGINE_NICE more niceness. With the engine keeping every
    core busy, requests (and 429s) are then answered as they come instead of waiting for a
    time slice; the engine loses nothing while HTTP is idle. Linux only; a no-op where
    /proc is missing or the change is not allowed."""
    tasks = "/proc/self/task"
    if http_tid is None or not hasattr(os, "setpriority") or not os.path.isdir(tasks):
        return
    for tid in os.listdir(tasks):
        if int(tid) == http_tid:
            continue
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid),
                           os.getpriority(os.PRIO_PROCESS, int(tid)) + ENGINE_NICE)
        except OSError:
            pass


def _run_http(server) -> None:
    """uvicorn's serve loop for a thread: when it cannot start it logs why and exits, which
    ends only this thread; `server.started` then stays False for the caller to report."""
    try:
        server.run()
    except SystemExit:
        pass


def _say(message: str) -> None:
    click.echo(message, err=True)


def _builtin_artifact(spec: str) -> str:
    from ..quantize.builtin_artifact import builtin_artifact

    return builtin_artifact(spec, _say, _progress_printer())


def prepare_builtin_artifact(spec: str, gate: bool) -> str:
    """For a built-in model's name: make its artifact if needed and, with `gate`, run its
    default gates if they never ran (`qserve serve`; `qserve cluster` before it starts its
    workers); returns the artifact's path. Anything else is returned as given."""
    if spec not in BUILTIN_MODELS:
        return spec
    path = _builtin_artifact(spec)
    if gate:
        from ..evals.serve_gate import gate_once
        from ..quantize.builtin_artifact import builtin_turn

        with builtin_turn(spec, _say):  # one process gates it, others then read it
            gate_once(path, _say)
    return path


from .benchmark.cli import bench  # noqa: E402

main.add_command(bench)
main.add_command(gateway)
main.add_command(router)
main.add_command(cluster)

if __name__ == "__main__":
    main()
