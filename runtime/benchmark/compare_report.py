"""The markdown page of the llama.cpp comparison: one section per model, rewritten in place."""

from __future__ import annotations

import datetime
import statistics
from dataclasses import dataclass
from pathlib import Path

from qserve.kernels import cpu_class
from qserve.runtime.kv_cache import KVCacheSpec

from .metrics import BenchmarkMetrics
from .report import upsert_section

# results label of qserve's run with prefix caching off (shared-prefix case only)
NO_REUSE_LABEL = "qserve-no-prefix-caching"
# results label and value of qserve's run with prompt tokens capped in steps that also
# decode (`--max-prefill-tokens-with-decodes`, mixed case only). 8: with the case's 8
# streams a step then holds at most 16 tokens, which the C decode path runs
# (kernels/native_fp8_gemv.MAX_ROWS); a 32-token cap leaves 40-token steps to the modules,
# ~3x a decode step (measured on SmolLM2, one thread: ITL p99 / p50 1.54 at 8, 3.0 at 32)
PREFILL_CAP = 8
PREFILL_CAP_LABEL = f"qserve-prefill-cap-{PREFILL_CAP}"
# results label and serve options of qserve's run with n-gram speculation (one-stream
# case only; speculation stands down when more than one request runs)
SPEC_ARGS = ("--speculative", "ngram", "--num-speculative-tokens", "5",
             "--speculative-disable-by-batch-size", "1")
SPEC_LABEL = "qserve-ngram"
# ... and with the hidden-state draft of an artifact quantized with `--draft hidden_draft`
# (compare_llamacpp --draft-artifact): n-gram lookup first, the head where it finds nothing
HIDDEN_SPEC_ARGS = ("--speculative", "hidden_draft", "--num-speculative-tokens", "5",
                    "--speculative-disable-by-batch-size", "1")
HIDDEN_SPEC_LABEL = "qserve-hidden-draft"

KV_BUDGET = 2**30  # bytes
STREAM_TOKENS = 2048
PROFILED_CASE = "streams16"  # the case whose qserve run py-spy profiles

HEADER = """# qserve and llama.cpp's server, side by side (CPU)

`python -m qserve.runtime.benchmark.compare_llamacpp --model MODEL --threads 2` builds
llama.cpp's own C++ server (`llama-server`, continuous batching over `--parallel` slots)
from the llama-cpp-python source distribution, then serves the same GGUF file with it
and with `qserve serve`, one after the other, with the same thread count, and sends both
the same prompts (cut from real text with the model's tokenizer, same seeds) through
`qserve bench`: streaming `/v1/completions`, greedy, exact output lengths (`max_tokens`
with `ignore_eos`), output tokens counted from the usage chunk. Ratios are qserve divided
by llama.cpp. Timings come from a shared 2-core machine: compare within a table. A
section's title names the CPU it was measured on; sections without one come from a Xeon
with AVX-512 and AMX-BF16. `--cases` runs a subset of the workloads (the others are left
out of its table).
A section's title also names what qserve served (`--recipe`): the model's built-in
artifact, or the all-FP8 default recipe's; titles without one predate built-in recipes
and served the all-FP8 artifact.
"""


@dataclass
class CaseResult:
    title: str
    metrics: BenchmarkMetrics


def kv_budget_rows(hf_config: dict) -> list[tuple[str, int, int, int]]:
    """(dtype, KV bytes per token, tokens in 1 GiB, 2,048-token streams in 1 GiB)."""
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    rows = []
    for dtype in ("fp8", "bf16"):
        spec = KVCacheSpec(hf_config["num_hidden_layers"],
                           hf_config.get("num_key_value_heads", heads), head_dim, 16, dtype)
        tokens = spec.num_blocks_for(KV_BUDGET) * spec.block_size
        rows.append((dtype, spec.bytes_per_token, tokens, tokens // STREAM_TOKENS))
    return rows


def _threads(n: int) -> str:
    return f"{n} thread" + ("" if n == 1 else "s")


def _f(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"


def _ratio_rows(rounds: list[dict[str, dict[str, CaseResult]]]) -> list[tuple]:
    """(case, metric, llama.cpp value, qserve value, ratio, per-round ratios): the values
    are medians over the rounds, the ratio the median of the rounds' ratios (qserve /
    llama.cpp); None where a server has no result."""
    rows = []

    def add(case: str, metric: str, fn) -> None:
        per_round = [[r[s].get(case) for s in ("llama.cpp", "qserve")] for r in rounds]
        if per_round[0] == [None, None]:
            return
        title = next(c.title for c in per_round[0] if c is not None)
        values = [[fn(c.metrics) for r in per_round if (c := r[i]) is not None]
                  for i in (0, 1)]
        ratios = [fn(r[1].metrics) / fn(r[0].metrics) for r in per_round
                  if None not in r and fn(r[0].metrics)]
        rows.append((title, metric,
                     *(statistics.median(v) if v else None for v in values),
                     statistics.median(ratios) if ratios else None, ratios))

    add("streams16", "aggregate output tok/s (higher is better)", lambda m: m.output_throughput)
    add("streams16", "TPOT p50 ms", lambda m: m.tpot.median)
    add("streams16", "TTFT p50 ms", lambda m: m.ttft.median)
    add("stream1", "decode tok/s = 1000 / TPOT p50 (higher is better)",
        lambda m: 1000.0 / m.tpot.median)
    add("stream1", "TTFT p50 ms", lambda m: m.ttft.median)
    for case in ("shared", "distinct"):
        add(case, "TTFT p50 ms", lambda m: m.ttft.median)
        add(case, "E2EL p50 ms", lambda m: m.e2el.median)
        add(case, "input+output tok/s (higher is better)", lambda m: m.total_token_throughput)
    add("mixed", "ITL p50 ms", lambda m: m.itl.median)
    add("mixed", "ITL p99 ms", lambda m: m.itl.percentiles["p99"])
    add("mixed", "ITL p99 / p50", lambda m: m.itl.percentiles["p99"] / m.itl.median)
    add("mixed", "output tok/s (higher is better)", lambda m: m.output_throughput)
    return rows


def recipe_kind(recipe: str) -> str:
    """compare_llamacpp --recipe as a kind: "builtin", "default" or "file"."""
    return recipe if recipe in ("builtin", "default") else "file"


# by recipe kind: (a page section's title part, what qserve served)
SERVED = {"builtin": ("built-in recipe", "the model's built-in artifact, quantized from the "
                                         "same GGUF with its built-in recipe"),
          "default": ("default recipe (all FP8)", "ARTIFACT: quantized from the same GGUF "
                      "with the default recipe, all FP8 (W8A8 static, FP8 KV cache)"),
          "file": ("recipe file", "ARTIFACT: quantized from the same GGUF with a recipe file")}


def _recipe_name(recipe: str) -> str:
    """A recipe file as a page names it: its file name (shipped ones live in
    quantize/recipes/)."""
    return Path(recipe).name


def section_key(model: str, threads: int, cpu: str | None, recipe: str = "builtin") -> str:
    """A page section's title and marker: one per model, what qserve served (a recipe file
    by its name), thread count and CPU."""
    kind = recipe_kind(recipe)
    served = f"recipe {_recipe_name(recipe)}" if kind == "file" else SERVED[kind][0]
    return f"{model}, {served}, {_threads(threads)}" + (f", {cpu}" if cpu else "")


def _env_prefix() -> str:
    """"QSERVE_CPU_CLASS=avx2 " where the run was capped to a lower CPU class, else ""."""
    klass = cpu_class.cap()
    return f"{cpu_class.ENV_VAR}={klass} " if klass else ""


def model_section(model: str, date: datetime.datetime, threads: int, llama_version: str,
                  cmake_flags: list[str], llama_cmd: list[str], qserve_cmd: list[str],
                  results: dict[str, dict[str, CaseResult]], kv_rows, spots,
                  cpu: str | None = None, cases: str | None = None,
                  rounds: list[dict[str, dict[str, CaseResult]]] | None = None,
                  recipe: str = "builtin") -> str:
    rounds = rounds or [results]
    draft = (f" --draft-artifact ART` (ART: `qserve quantize {model} --out ART --draft "
             "hidden_draft[:N]`; its manifest records how the head was trained)"
             if results.get(HIDDEN_SPEC_LABEL) else "`")
    if PROFILED_CASE in results.get("qserve", {}) and not spots:
        draft = " --no-profile" + draft  # profiling needs py-spy
    if cases:
        draft = f" --cases {cases}" + draft
    kind = recipe_kind(recipe)
    if kind != "builtin":
        draft = f" --recipe {_recipe_name(recipe) if kind == 'file' else kind}" + draft
    if len(rounds) > 1:
        draft = f" --rounds {len(rounds)}" + draft
    lines = [f"## {section_key(model, threads, cpu, recipe)}", "",
             f"Measured {date:%Y-%m-%d %H:%M} UTC, {_threads(threads)} each, command "
             f"`{_env_prefix()}python -m qserve.runtime.benchmark.compare_llamacpp --model {model} "
             f"--threads {threads}{draft}.", "",
             f"- llama.cpp: `llama-server` from llama-cpp-python {llama_version}'s vendored "
             f"tree, built with `{' '.join(cmake_flags)}`; run as "
             f"`{' '.join(llama_cmd)}` (f16 KV cache, its default).",
             f"- qserve: `qserve {' '.join(qserve_cmd)}` ({SERVED[kind][1]}"
             + (f" ({_recipe_name(recipe)})" if kind == "file" else "")
             + ", prefix caching on).", "",
             *([f"{len(rounds)} rounds, the servers alternating; values are medians over "
                "the rounds, ratios the median of the per-round ratios (listed last).", ""]
               if len(rounds) > 1 else []),
             "| workload | metric | llama.cpp | qserve | qserve / llama.cpp |"
             + (" per round |" if len(rounds) > 1 else ""),
             "|---|---|---:|---:|---:|" + ("---|" if len(rounds) > 1 else "")]
    for case, metric, ref, ours, ratio, ratios in _ratio_rows(rounds):
        shown = f"{ratio:.2f}x" if ratio is not None else "-"
        show = [("not measured" if v is None else _f(v)) for v in (ref, ours)]
        each = f" {', '.join(f'{r:.2f}' for r in ratios)} |" if len(rounds) > 1 else ""
        lines.append(f"| {case} | {metric} | {show[0]} | {show[1]} | {shown} |{each}")
    q = results["qserve"]
    off = results.get(NO_REUSE_LABEL, {})
    lines.append("")
    if "distinct" in q:
        lines.append("The \"no reuse possible\" row sends the same shape (16 requests of "
                     "~2,040 prompt tokens) with 16 different documents, which no cache can "
                     "share.")
    if "shared" in off and "shared" in q:
        m_off, m_on = off["shared"].metrics, q["shared"].metrics
        lines.append(
            "Prefix reuse, qserve alone on the shared-prefix workload: TTFT p50 "
            f"{_f(m_off.ttft.median)} ms with `--no-enable-prefix-caching`, "
            f"{_f(m_on.ttft.median)} ms with it on: "
            f"{m_off.ttft.median / max(m_on.ttft.median, 1e-9):.2f}x.")
    capped = results.get(PREFILL_CAP_LABEL, {})
    if "mixed" in capped and "mixed" in q:
        (cap_p50, cap_p99), (on_p50, on_p99) = (
            (r["mixed"].metrics.itl.median, r["mixed"].metrics.itl.percentiles["p99"])
            for r in (capped, q))
        lines.append(
            f"Mixed load, qserve alone with `--max-prefill-tokens-with-decodes {PREFILL_CAP}` "
            f"(at most {PREFILL_CAP} prompt tokens in a step that also decodes): ITL p50 "
            f"{_f(cap_p50)} ms, p99 {_f(cap_p99)} ms, p99 / p50 "
            f"{cap_p99 / max(cap_p50, 1e-9):.2f} (without it {on_p99 / max(on_p50, 1e-9):.2f}); "
            f"output {_f(capped['mixed'].metrics.output_throughput)} tok/s (without it "
            f"{_f(q['mixed'].metrics.output_throughput)}).")
    spec = results.get(SPEC_LABEL, {})
    ref = results.get("llama.cpp", {})
    round1 = ", in the same round; variants run in round 1 only" if len(rounds) > 1 else ""
    if "stream1" in spec and "stream1" in q and "stream1" in ref:
        rate = {name: 1000.0 / max(r["stream1"].metrics.tpot.median, 1e-9)
                for name, r in (("spec", spec), ("plain", q), ("llama", ref))}
        lines.append(
            f"One stream, qserve alone with n-gram speculation (`{' '.join(SPEC_ARGS)}`): "
            f"decode {_f(rate['spec'])} tok/s (1000 / TPOT p50), "
            f"{rate['spec'] / rate['llama']:.2f}x llama.cpp's (without speculation "
            f"{rate['plain'] / rate['llama']:.2f}x{round1}).")
    hidden = results.get(HIDDEN_SPEC_LABEL, {})
    if "stream1" in hidden and "stream1" in q and "stream1" in ref:
        rate = {name: 1000.0 / max(r["stream1"].metrics.tpot.median, 1e-9)
                for name, r in (("spec", hidden), ("plain", q), ("llama", ref))}
        lines.append(
            "One stream, qserve alone serving the same model's artifact quantized with "
            f"`--draft hidden_draft` (`{' '.join(HIDDEN_SPEC_ARGS)}`): decode "
            f"{_f(rate['spec'])} tok/s (1000 / TPOT p50), {rate['spec'] / rate['llama']:.2f}x "
            f"llama.cpp's, {rate['spec'] / rate['plain']:.2f}x qserve without speculation.")
    if "stream1" in q and ("stream1" in spec or "stream1" in hidden):
        lines.append("The one-stream prompts are random windows of held-out text (not random "
                     "tokens), continued without a chat template; drafting gains more on such "
                     "continuations than on chat answers: speculation's gain on chat prompts "
                     "is what `python -m qserve.runtime.benchmark.spec` measures on the golden "
                     "prompts.")
    if "distinct" in q and "shared" in q:
        reuse = q["distinct"].metrics.ttft.median / max(q["shared"].metrics.ttft.median, 1e-9)
        lines.append("For qserve, TTFT p50 without possible reuse / with the shared "
                     f"document: {reuse:.2f}x.")
    lines.append("")
    lines += ["KV cache per token and the concurrency that fits a fixed 1 GiB KV budget "
              f"(streams of {STREAM_TOKENS:,} tokens; computed from the model's shape, as "
              "`python -m qserve.runtime.benchmark.kv` reports; llama.cpp's default f16 cache "
              "has the bf16 size):", "",
              "| KV dtype | bytes / token | tokens in 1 GiB | streams of 2,048 |",
              "|---|---:|---:|---:|"]
    lines += [f"| {d} | {b:,} | {t:,} | {s} |" for d, b, t, s in kv_rows]
    if spots:
        hot, total = spots
        lines += ["", f"Where qserve spends its time in the 16-stream run (py-spy, {total:,} "
                  "samples of on-CPU Python stacks across threads; self = innermost Python "
                  "frame, including the native torch op it calls):", "",
                  "| function | self | inclusive |", "|---|---:|---:|"]
        lines += [f"| `{h.function}` | {h.self_share:.1%} | {h.inclusive_share:.1%} |"
                  for h in hot]
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, model: str, **kw) -> None:
    """Replace (or append) this model, thread count and CPU's section; other sections
    stay."""
    section = model_section(model, **kw)
    key = section_key(model, kw["threads"], kw.get("cpu"), kw.get("recipe", "builtin"))
    upsert_section(path, key, section, HEADER)
