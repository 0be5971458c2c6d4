"""The gateway's difficulty router, measured: share sent to the small model, quality, cost.

    python -m qserve.runtime.benchmark.difficulty_routing answer [--small smollm2-135m]
        [--large qwen2.5-coder-0.5b] [--per-category 60] [--threads 1] [--answers FILE]
        [--small-url URL] [--large-url URL] [--write-labels [--labels FILE]]
    python -m qserve.runtime.benchmark.difficulty_routing report [--answers FILE]
        [--labels FILE] [--model FILE] [--thresholds 0.2,0.3,0.4,0.5,0.6,0.7]
        [--out docs/gateway-routing.md]

`answer` asks both models every golden generation item of a deterministic sample
(`--per-category` items of each category, chosen by the hash of their id) with the golden
eval's protocol: the raw prompt as a completion, greedy, at most 12 tokens, stopping at a
newline, comma or full stop, scored by exact match with case and punctuation ignored. Each
model runs in llama.cpp's `llama-server` (started here, one after the other, with
`--threads`; or already running at `--small-url` / `--large-url`), and each answer's
compute time (llama-server's own prompt + generation milliseconds) is kept with it in the
answers file (JSONL, appended as it goes, so an interrupted run resumes). `--write-labels`
then rewrites the golden rows of the router's labels file from these answers (label 1
where the large model is right and the small one wrong), keeping the constructed rows.

`report` scores the held-out split of the labels file with the router's model and writes
the page: for each threshold, the share of requests sent to the small model, the accuracy
of auto routing on the golden items against always-large and always-small (and against
sending the same share to the small model at random), and the cost saved, measured as the
compute time the routed model took against the large model's on the same items; and by
bytes of weights read per generated token (the GGUF sizes), which is what decode costs
on a memory-bound machine.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import string
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import httpx

from qserve.kernels.cache import cache_root
from qserve.runtime.capabilities import cpu_class, cpu_flags, cpu_model
from qserve.runtime.formats.errors import QserveError
from qserve.runtime.formats.sources import BUILTIN_MODELS
from qserve.runtime.gateway.config import AutoRoute
from qserve.runtime.gateway.difficulty import DifficultyRouter
from qserve.runtime.gateway.difficulty_train import (
    HELDOUT_PERCENT,
    default_labels_path,
    read_labels,
    row_messages,
    split_of,
)

from .errors import BenchmarkError
from .llamacpp_build import cmake_flags, ensure_llama_server, find_llama_server
from .server_process import ServerProcess, free_port

ROLES = ("small", "large")
# the golden generation eval's protocol (evals/tasks/qserve_generation.yaml)
MAX_TOKENS = 12
STOP = ["\n", ",", "."]
DEFAULT_THRESHOLDS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
DEFAULT_THRESHOLD = AutoRoute.threshold   # the gateway's default
CTX_SIZE = 2048


def golden_items() -> list[dict]:
    """The golden generation items (evals/golden/generation.jsonl)."""
    from qserve.evals.golden_tasks import GOLDEN_DIR

    path = GOLDEN_DIR / "generation.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def sample_items(items: list[dict], per_category: int) -> list[dict]:
    """`per_category` items of each category (all of a smaller one), the ones whose ids hash
    lowest: the same sample every run, spread over the whole category. Sorted by id."""
    by_category: dict[str, list[dict]] = defaultdict(list)
    for item in items:
        by_category[item["category"]].append(item)
    chosen = []
    for rows in by_category.values():
        rows.sort(key=lambda r: hashlib.sha256(r["id"].encode()).hexdigest())
        chosen += rows[:per_category]
    return sorted(chosen, key=lambda r: r["id"])


def normalize(text: str) -> str:
    """The golden eval's comparison form: stripped, lowercased, punctuation removed."""
    return text.strip().lower().translate(str.maketrans("", "", string.punctuation))


def is_correct(output: str, answer: str) -> bool:
    return normalize(output) == normalize(answer)


@dataclass(frozen=True)
class ModelSpec:
    role: str  # "small" | "large"
    name: str  # as given: a built-in model name or a .gguf path
    gguf: Path | None  # None when only a URL was given and the name is no file or built-in

    @property
    def weight_bytes(self) -> int | None:
        return self.gguf.stat().st_size if self.gguf is not None else None


def resolve_model(role: str, name: str, url: str | None) -> ModelSpec:
    """A built-in model name or a .gguf path; BenchmarkError if neither (unless a URL
    serves it, when only the bytes-per-token cost is then unknown)."""
    if name in BUILTIN_MODELS:
        try:
            return ModelSpec(role, name, BUILTIN_MODELS[name].locate())
        except QserveError as exc:
            raise BenchmarkError(str(exc)) from exc
    path = Path(name)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSpec(role, name, path)
    if url:
        return ModelSpec(role, name, None)
    raise BenchmarkError(f"--{role} {name!r}: not a built-in model ({', '.join(BUILTIN_MODELS)})"
                         " or a .gguf file")


def llama_server_cmd(binary: Path, gguf: Path, port: int, threads: int) -> list[str]:
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(threads), "--threads-batch", str(threads), "--parallel", "1",
            "--ctx-size", str(CTX_SIZE)]


def ask(client: httpx.Client, base: str, prompt: str) -> dict:
    """One golden item as llama-server's /completion: output and its compute time."""
    try:
        resp = client.post(base + "/completion", json={
            "prompt": prompt, "n_predict": MAX_TOKENS, "temperature": 0.0, "stop": STOP,
            "cache_prompt": False})
        resp.raise_for_status()
        body = resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise BenchmarkError(f"{base}/completion failed: {exc} (is it a llama-server?)") from exc
    timings = body.get("timings") or {}
    return {"output": body.get("content", ""),
            "prompt_n": timings.get("prompt_n"), "prompt_ms": timings.get("prompt_ms"),
            "predicted_n": timings.get("predicted_n"),
            "predicted_ms": timings.get("predicted_ms")}


def read_answers(path: Path) -> tuple[dict | None, dict[tuple[str, str], dict]]:
    """The meta line and the answers, by (role, id), of an answers file (empty if none)."""
    if not path.is_file():
        return None, {}
    meta, answers = None, {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BenchmarkError(f"{path}:{n}: not JSON ({exc.msg})") from exc
        if "meta" in row:
            meta = row["meta"]
        else:
            answers[(row["role"], row["id"])] = row
    return meta, answers


def answer(args: argparse.Namespace) -> int:
    specs = {"small": resolve_model("small", args.small, args.small_url),
             "large": resolve_model("large", args.large, args.large_url)}
    urls = {"small": args.small_url, "large": args.large_url}
    items = sample_items(golden_items(), args.per_category)
    path = Path(args.answers)
    meta = {"small": specs["small"].name, "large": specs["large"].name,
            "small_bytes": specs["small"].weight_bytes,
            "large_bytes": specs["large"].weight_bytes, "threads": args.threads,
            "cpu": cpu_model(), "cpu_class": cpu_class(cpu_flags()), "cpus": os.cpu_count(),
            "per_category": args.per_category}
    old_meta, done = read_answers(path)
    if old_meta is not None and {k: old_meta.get(k) for k in meta} != meta:
        raise BenchmarkError(f"{path} holds answers of another run ({old_meta}); give a new "
                             "--answers file or delete it")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as out:
        if old_meta is None:
            meta["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds")
            out.write(json.dumps({"meta": meta}) + "\n")
        for role in ROLES:
            todo = [it for it in items if (role, it["id"]) not in done]
            print(f"{role} ({specs[role].name}): {len(items) - len(todo)} answered, "
                  f"{len(todo)} to go", file=sys.stderr)
            if not todo:
                continue
            if urls[role]:
                _answer_all(urls[role].rstrip("/"), role, todo, out, done)
                continue
            build = find_llama_server(cmake_flags(cpu_flags())) or ensure_llama_server()
            port = free_port()
            log = cache_root() / "bench" / f"difficulty-{role}-llama-server.log"
            cmd = llama_server_cmd(build.binary, specs[role].gguf, port, args.threads)
            with ServerProcess(f"llama-server ({specs[role].name})", cmd, port, log) as server:
                _answer_all(server.base, role, todo, out, done)
    answered = sum(1 for it in items if all((r, it["id"]) in done for r in ROLES))
    print(f"{answered} items answered by both models -> {path}", file=sys.stderr)
    if args.write_labels:
        write_golden_labels(Path(args.labels), items, done)
    return 0


def _answer_all(base: str, role: str, items: list[dict], out, done: dict) -> None:
    with httpx.Client(timeout=300) as client:
        for k, item in enumerate(items, 1):
            row = {"role": role, "id": item["id"], **ask(client, base, item["prompt"])}
            row["correct"] = is_correct(row["output"], item["answer"])
            out.write(json.dumps(row) + "\n")
            out.flush()
            done[(role, item["id"])] = row
            if k % 50 == 0:
                print(f"  {role}: {k}/{len(items)}", file=sys.stderr)


def write_golden_labels(path: Path, items: list[dict], done: dict) -> None:
    """Replace the golden rows of the labels file with one row per item both models
    answered; constructed rows stay. Rows sorted by id, one JSON object a line."""
    kept = [r for r in read_labels(path) if r.get("source") != "golden"] if path.is_file() \
        else []
    golden = []
    for it in items:
        small, large = done.get(("small", it["id"])), done.get(("large", it["id"]))
        if small is None or large is None:
            continue
        golden.append({
            "id": it["id"], "split": split_of(it["id"]), "source": "golden",
            "kind": it["category"],
            "label": int(large["correct"] and not small["correct"]),
            "label_from": "model answers", "prompt": it["prompt"], "answer": it["answer"],
            "small_output": small["output"], "large_output": large["output"],
            "small_correct": small["correct"], "large_correct": large["correct"]})
    rows = sorted(kept + golden, key=lambda r: r["id"])
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")
    print(f"{len(golden)} golden + {len(kept)} constructed rows -> {path}", file=sys.stderr)


# ---------------------------------------------------------------------------------- report


@dataclass(frozen=True)
class SweepPoint:
    """Auto routing at one threshold, on the held-out split."""

    threshold: float
    share_small: float  # golden items sent to the small model
    accuracy: float  # golden items answered right by the model they were sent to
    accuracy_random: float  # the same share sent to the small model at random (expected)
    time_saved: float  # 1 - compute time of the routed models / of the large model alone
    bytes_saved: float | None  # 1 - weight bytes read per token, routed / large alone
    easy_small: float  # constructed easy prompts sent to the small model
    hard_large: float  # constructed hard prompts sent to the large model


def _ms(row: dict) -> float:
    return float(row.get("prompt_ms") or 0.0) + float(row.get("predicted_ms") or 0.0)


def _share(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else float("nan")


def auc(scores: list[float], labels: list[int]) -> float:
    """Area under the ROC curve (ties count half): the chance that a random hard row
    scores above a random easy one."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def sweep(golden: list[dict], scores: dict[str, float], times: dict[tuple[str, str], float],
          constructed: list[dict], thresholds: list[float], bytes_ratio: float | None,
          ) -> list[SweepPoint]:
    acc_small = _share([r["small_correct"] for r in golden])
    acc_large = _share([r["large_correct"] for r in golden])
    large_ms = sum(times[("large", r["id"])] for r in golden)
    points = []
    for t in thresholds:
        small = [scores[r["id"]] < t for r in golden]
        share = _share(small)
        correct = [r["small_correct"] if s else r["large_correct"] for r, s in zip(golden, small)]
        routed_ms = sum(times[("small" if s else "large", r["id"])]
                        for r, s in zip(golden, small))
        points.append(SweepPoint(
            threshold=t, share_small=share, accuracy=_share(correct),
            accuracy_random=share * acc_small + (1 - share) * acc_large,
            time_saved=1 - routed_ms / large_ms if large_ms else float("nan"),
            bytes_saved=None if bytes_ratio is None else share * (1 - bytes_ratio),
            easy_small=_share([scores[r["id"]] < t for r in constructed if r["label"] == 0]),
            hard_large=_share([scores[r["id"]] >= t for r in constructed if r["label"] == 1])))
    return points


def _pct(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def _se(p: float, n: int) -> str:
    return f"{100 * math.sqrt(p * (1 - p) / n):.1f}" if n else "n/a"


def report(args: argparse.Namespace) -> int:
    labels_path = Path(args.labels)
    rows = read_labels(labels_path)
    router = DifficultyRouter.load(args.model)
    meta, answers = read_answers(Path(args.answers))
    if meta is None:
        raise BenchmarkError(f"{args.answers}: no answers; run the `answer` step first")
    held = [r for r in rows if r["split"] == "heldout"]
    golden = [r for r in held if r["source"] == "golden"
              and ("small", r["id"]) in answers and ("large", r["id"]) in answers]
    constructed = [r for r in held if r["source"] == "constructed"]
    if not golden:
        raise BenchmarkError(f"{labels_path}: no held-out golden rows with answers in "
                             f"{args.answers}")
    scores = {r["id"]: router.score(row_messages(r)) for r in held}
    times = {key: _ms(row) for key, row in answers.items()}
    bytes_ratio = (meta["small_bytes"] / meta["large_bytes"]
                   if meta.get("small_bytes") and meta.get("large_bytes") else None)
    thresholds = sorted({*args.thresholds, DEFAULT_THRESHOLD})
    points = sweep(golden, scores, times, constructed, thresholds, bytes_ratio)
    text = render(args, meta, rows, held, golden, constructed, scores, answers, points,
                  bytes_ratio)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(text)
    print(f"-> {out}", file=sys.stderr)
    return 0


def _speed(answers: dict, role: str) -> tuple[float, float]:
    """(prompt tokens/s, generated tokens/s) of one model over all its answers."""
    rows = [r for (k, _), r in answers.items() if k == role]
    pn = sum(r.get("prompt_n") or 0 for r in rows)
    pms = sum(r.get("prompt_ms") or 0 for r in rows)
    gn = sum(r.get("predicted_n") or 0 for r in rows)
    gms = sum(r.get("predicted_ms") or 0 for r in rows)
    return (1000 * pn / pms if pms else float("nan"), 1000 * gn / gms if gms else float("nan"))


def _counts(rows: list[dict]) -> str:
    lines = ["| source | label from | split | easy (0) | hard (1) |", "|---|---|---|---:|---:|"]
    tally = Counter((r["source"], r["label_from"], r["split"], r["label"]) for r in rows)
    for source, frm, split in sorted({k[:3] for k in tally}):
        lines.append(f"| {source} | {frm} | {split} | {tally[(source, frm, split, 0)]} | "
                     f"{tally[(source, frm, split, 1)]} |")
    return "\n".join(lines)


def render(args, meta, rows, held, golden, constructed, scores, answers, points,
           bytes_ratio) -> str:
    n = len(golden)
    acc_small = _share([r["small_correct"] for r in golden])
    acc_large = _share([r["large_correct"] for r in golden])
    oracle_small = _share([r["label"] == 0 for r in golden])
    acc_oracle = _share([r["small_correct"] or r["large_correct"] for r in golden])
    both = [r for r in rows if r["source"] == "golden"]
    small_speed, large_speed = _speed(answers, "small"), _speed(answers, "large")
    golden_auc = auc([scores[r["id"]] for r in golden], [r["label"] for r in golden])
    all_auc = auc([scores[r["id"]] for r in held], [r["label"] for r in held])
    cmd = "python -m qserve.runtime.benchmark.difficulty_routing"
    sweep_rows = "\n".join(
        f"| {p.threshold:.2f} | {_pct(p.share_small)} | {_pct(p.accuracy)} "
        f"| {_pct(p.accuracy_random)} | {_pct(p.time_saved)} | {_pct(p.bytes_saved)} "
        f"| {_pct(p.easy_small)} | {_pct(p.hard_large)} |" for p in points)
    default = next(p for p in points if p.threshold == DEFAULT_THRESHOLD)
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for r in golden:
        by_cat[r["kind"]].append(r)
    cat_rows = []
    for cat in sorted(by_cat):
        rs = by_cat[cat]
        small = [scores[r["id"]] < DEFAULT_THRESHOLD for r in rs]
        auto = [r["small_correct"] if s else r["large_correct"] for r, s in zip(rs, small)]
        cat_rows.append(
            f"| {cat} | {len(rs)} | {_pct(_share(small))} | {_pct(_share(auto))} "
            f"| {_pct(_share([r['large_correct'] for r in rs]))} "
            f"| {_pct(_share([r['small_correct'] for r in rs]))} |")
    thresholds = ",".join(f"{t:g}" for t in args.thresholds)
    return f"""# Difficulty routing (`model: "auto"`)

The gateway's `auto` model sends each request to a small or a large backend by a difficulty
score: `qserve.runtime.gateway.difficulty.DifficultyRouter` computes cheap features of the
request text (lengths, turns, code and math, task verbs such as extract / classify / prove /
write a program, constraints, question type; tens of microseconds of pure Python, no model
call) and a logistic regression turns them into the estimated probability that the small
model answers worse than the large one. A request goes to the small model when that score is
below the configured threshold (default {DEFAULT_THRESHOLD}); the decision and its
reason are reported in a response header. The classifier is trained with numpy by
`python -m qserve.runtime.gateway.difficulty_train` from
`runtime/gateway/data/difficulty_labels.jsonl` into `runtime/gateway/data/difficulty_model.json`.

## Labels

| | |
|---|---|
| small model | {meta['small']} |
| large model | {meta['large']} |

- **golden** rows: golden generation items (`evals/golden/generation.jsonl`; a fixed
  sample, chosen by id hash, of {meta['per_category']} per category) answered by both
  models with the golden eval's protocol: raw prompt as a completion, greedy, at most
  {MAX_TOKENS} tokens, stop at newline / comma / full stop, exact match ignoring case and
  punctuation. Label from **model answers**: hard (1) where the large model is right and
  the small one wrong, easy (0) elsewhere (the small model does as well as the large one).
  Of these {len(both)} items the small model answers
  {_pct(_share([r['small_correct'] for r in both]))}, the large one
  {_pct(_share([r['large_correct'] for r in both]))}.
- **constructed** rows: hand-written chat prompts (some with a system prompt, several
  turns or content parts), labelled **by construction**: easy ones are short extraction,
  formatting, classification, lookup, translation and one-line summary requests; hard ones
  are multi-step reasoning and proofs, programming, long-form writing, summaries that must
  also analyse, and tasks with many requirements. No model answered them.
- Split by a hash of the id: {HELDOUT_PERCENT}% of ids are held out (never trained on); every number
  below is on the held-out split.

{_counts(rows)}

## Results (held-out split)

{n} golden items (accuracy: the share answered right by the model the request went to;
± one standard error in points), {len(constructed)} constructed prompts.

| routing | share to small | golden accuracy |
|---|---:|---:|
| always large | 0.0% | {_pct(acc_large)} ± {_se(acc_large, n)} |
| always small | 100.0% | {_pct(acc_small)} ± {_se(acc_small, n)} |
| auto, threshold {DEFAULT_THRESHOLD} | {_pct(default.share_small)} | {_pct(default.accuracy)} ± {_se(default.accuracy, n)} |
| oracle (small exactly where it does as well) | {_pct(oracle_small)} | {_pct(acc_oracle)} |

Threshold sweep. *random at same share*: the expected accuracy of sending the same share of
golden items to the small model at random, the baseline the classifier has to beat. *Time
saved*: 1 − (llama-server compute time, prompt + generation, of the model each item was
routed to) / (that of the large model on every item), measured per item. *Bytes saved*:
1 − weight bytes read per generated token, routed vs always large, from the GGUF file sizes
(the small model's is {_pct(bytes_ratio)} of the large one's). *Easy → small* and
*hard → large*: the constructed prompts routed as their construction says.

| threshold | share to small | auto accuracy | random at same share | time saved | bytes saved | easy → small | hard → large |
|---:|---:|---:|---:|---:|---:|---:|---:|
{sweep_rows}

Ranking quality of the score (area under the ROC curve, hard vs easy): {golden_auc:.3f} on
the held-out golden items, {all_auc:.3f} on all held-out rows.

Per category at threshold {DEFAULT_THRESHOLD}:

| category | items | to small | auto | always large | always small |
|---|---:|---:|---:|---:|---:|
{chr(10).join(cat_rows)}

## Machine and speed

- CPU: {meta['cpu']} ({meta.get('cpu_class', 'n/a')}, {meta.get('cpus', 'n/a')} CPUs)
- server: llama.cpp's `llama-server`, {meta['threads']} thread(s), one model at a time
- small model: {small_speed[0]:.0f} prompt tokens/s, {small_speed[1]:.0f} generated tokens/s
- large model: {large_speed[0]:.0f} prompt tokens/s, {large_speed[1]:.0f} generated tokens/s
- answers collected {meta.get('date', 'n/a')}; speeds over all {len(both)} answered items

Other work may share the machine, so times vary by some percent between runs.

## Reproduce

```
{cmd} answer --small {meta['small']} --large {meta['large']} --per-category {meta['per_category']} --threads {meta['threads']} --write-labels
python -m qserve.runtime.gateway.difficulty_train
{cmd} report --thresholds {thresholds}
```

`answer` starts llama.cpp's `llama-server` for each model (or uses `--small-url` /
`--large-url`), keeps each answer with its timings in the answers file (default in the
qserve cache directory) and resumes an interrupted run; `--write-labels` rewrites the golden
rows of the labels file. `report` writes this page.

## Limitations

- The golden items are short few-shot completions (facts, sequences, arithmetic, copying):
  the easy end of real traffic. Quality is measured only on them; the constructed prompts
  show only where the router sends each kind, not how well either model answers them.
- Both models here are small ({meta['small']} and {meta['large']}); with a larger large
  model the cost gap, and so the saving per request routed small, grows, but the labels
  (which items the small model answers as well) must be collected again with it.
- The golden categories differ more than the items within one: the score mostly learns
  which kinds of task the small model fails (sums, counting down, number words) and routes
  a whole kind one way, so quality inside a kind is that of the model it is sent to.
- The cost is measured for these one-line answers, where the prompt dominates; for long
  answers decode dominates and the bytes-per-token ratio is the better guide.
- The features see words, not meaning: a short prompt that needs knowledge the small model
  lacks (an obscure capital) looks like an easy lookup.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qserve.runtime.benchmark.difficulty_routing",
                                 description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    default_answers = str(cache_root() / "bench" / "difficulty-answers.jsonl")
    a = sub.add_parser("answer", help="answer the golden sample with both models")
    a.add_argument("--small", default="smollm2-135m", help="built-in name or .gguf file")
    a.add_argument("--large", default="qwen2.5-coder-0.5b", help="built-in name or .gguf file")
    a.add_argument("--small-url", default=None, help="a running llama-server for --small")
    a.add_argument("--large-url", default=None, help="a running llama-server for --large")
    a.add_argument("--per-category", type=int, default=60)
    a.add_argument("--threads", type=int, default=1)
    a.add_argument("--answers", default=default_answers)
    a.add_argument("--write-labels", action="store_true",
                   help="rewrite the golden rows of the labels file from the answers")
    a.add_argument("--labels", default=str(default_labels_path()))
    r = sub.add_parser("report", help="measure routing on the held-out split, write the page")
    r.add_argument("--answers", default=default_answers)
    r.add_argument("--labels", default=str(default_labels_path()))
    r.add_argument("--model", default=None, help="router model JSON (default: the shipped one)")
    r.add_argument("--thresholds", default=",".join(map(str, DEFAULT_THRESHOLDS)),
                   type=lambda s: [float(x) for x in s.split(",") if x.strip()])
    r.add_argument("--out", default="docs/gateway-routing.md")
    args = ap.parse_args(argv)
    if args.step == "answer" and (args.per_category < 1 or args.threads < 1):
        ap.error("--per-category and --threads must be at least 1")
    if args.step == "report" and not all(0 <= t <= 1 for t in args.thresholds):
        ap.error("--thresholds must lie in [0, 1]")
    try:
        return answer(args) if args.step == "answer" else report(args)
    except (BenchmarkError, QserveError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
