"""Benchmark workloads: lists of requests whose prompt lengths are true token counts.

Prompts are windows of real text (the held-out Python Language Reference, or any corpus
file), cut to an exact token count with the server's tokenizer. Every workload is a
registered function `(WorkloadParams, PromptBuilder, Random) -> list[RequestSpec]`.

    random         lengths uniform in [L*(1-r), L*(1+r)] (vLLM's range ratio)
    shared-prefix  every request is one long document + its own question
    mixed          short chats, and with probability p a long-prompt request
    trace          a JSONL file: arrival time, prompt or prompt length, output length
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable

from .errors import BenchmarkError
from .prompt_tokenizer import PromptTokenizer


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    prompt_len: int  # tokens of `prompt` (no special tokens), measured by the tokenizer
    output_len: int  # exact, through max_tokens + ignore_eos
    arrival: float | None = None  # seconds after the start (trace files); None: load decides
    prefix_len: int = 0  # leading tokens identical to the shared document (shared-prefix)


@dataclass(frozen=True)
class WorkloadParams:
    num_prompts: int = 64
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    seed: int = 0
    # shared-prefix
    prefix_len: int = 2000
    question_len: int = 32
    # mixed
    long_fraction: float = 0.25
    long_input_len: int = 1024
    long_output_len: int = 32
    # trace
    trace_file: str | None = None


def default_corpus() -> list[str]:
    """The held-out real text shipped with qserve (data only; no evals code is imported)."""
    path = resources.files("qserve.evals") / "golden" / "heldout_text.jsonl"
    return [json.loads(line)["text"] for line in path.read_text("utf-8").splitlines() if line]


def load_corpus(path: str | None) -> list[str]:
    """A corpus file: .jsonl with a "text" field per line, or plain text."""
    if path is None:
        return default_corpus()
    p = Path(path)
    if not p.is_file():
        raise BenchmarkError(f"--corpus {path}: no such file")
    raw = p.read_text("utf-8", errors="replace")
    if p.suffix != ".jsonl":
        return [raw]
    try:
        return [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise BenchmarkError(f"--corpus {path}: each line must be JSON with a \"text\" "
                             f"field ({e})") from None


class PromptBuilder:
    """Cuts windows of the corpus to exact token lengths."""

    def __init__(self, tokenizer: PromptTokenizer, corpus: list[str]) -> None:
        self.tok = tokenizer
        self.ids = tokenizer.encode("\n\n".join(corpus))  # [corpus_tokens]
        if len(self.ids) < 16:
            raise BenchmarkError("the prompt corpus is too short (under 16 tokens)")

    def _window(self, start: int, n: int) -> list[int]:
        reps = (start + n) // len(self.ids) + 1
        return (self.ids * reps)[start:start + n] if reps > 1 else self.ids[start:start + n]

    def text(self, length: int, rng: random.Random) -> tuple[str, int]:
        """Real text of `length` tokens (re-tokenized); returns (text, measured length).
        The window is resized until its text re-tokenizes to `length`; if that never
        happens the closest text is returned with its measured length."""
        if length < 1:
            raise BenchmarkError(f"a prompt length must be at least 1 token, not {length}")
        start = rng.randrange(len(self.ids))
        n, best = length, None
        for _ in range(8):
            text = self.tok.decode(self._window(start, n))
            got = len(self.tok.encode(text))
            if best is None or abs(got - length) < abs(best[1] - length):
                best = (text, got)
            if got == length:
                break
            n = max(1, n + length - got)
        return best


def _jitter(mean: int, ratio: float, rng: random.Random) -> int:
    if ratio <= 0:
        return mean
    return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))


def random_workload(p: WorkloadParams, b: PromptBuilder, rng: random.Random) -> list[RequestSpec]:
    out = []
    for _ in range(p.num_prompts):
        text, n = b.text(_jitter(p.input_len, p.range_ratio, rng), rng)
        out.append(RequestSpec(text, n, _jitter(p.output_len, p.range_ratio, rng)))
    return out


def shared_prefix_workload(p: WorkloadParams, b: PromptBuilder,
                           rng: random.Random) -> list[RequestSpec]:
    """num_prompts users ask about one document of prefix_len tokens."""
    doc, _ = b.text(p.prefix_len, rng)
    doc_ids = b.tok.encode(doc)
    out = []
    for i in range(p.num_prompts):
        question, _ = b.text(p.question_len, rng)
        prompt = f"{doc}\n\nQuestion {i + 1}: {question}"
        ids = b.tok.encode(prompt)
        shared = next((k for k, (a, c) in enumerate(zip(ids, doc_ids)) if a != c),
                      min(len(ids), len(doc_ids)))
        out.append(RequestSpec(prompt, len(ids), _jitter(p.output_len, p.range_ratio, rng),
                               prefix_len=shared))
    return out


def mixed_workload(p: WorkloadParams, b: PromptBuilder, rng: random.Random) -> list[RequestSpec]:
    """Short chats; each request is a long-prompt one with probability long_fraction."""
    out = []
    for _ in range(p.num_prompts):
        long = rng.random() < p.long_fraction
        ilen = p.long_input_len if long else p.input_len
        olen = p.long_output_len if long else p.output_len
        text, n = b.text(_jitter(ilen, p.range_ratio, rng), rng)
        out.append(RequestSpec(text, n, _jitter(olen, p.range_ratio, rng)))
    return out


def _trace_field(row: dict, key: str, where: str, kind: type, minimum: float):
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (kind, int)) or value < minimum:
        raise BenchmarkError(f"{where}: \"{key}\" must be a number >= {minimum} "
                             f"(got {value!r})")
    return value


def trace_workload(p: WorkloadParams, b: PromptBuilder, rng: random.Random) -> list[RequestSpec]:
    """One request per JSONL line: {"timestamp": s, "prompt": str | "input_len": n,
    "output_len": n}; requests are sent at their timestamps (seconds from the start)."""
    if p.trace_file is None:
        raise BenchmarkError("the trace workload needs --trace-file FILE.jsonl")
    path = Path(p.trace_file)
    if not path.is_file():
        raise BenchmarkError(f"--trace-file {path}: no such file")
    out = []
    for lineno, line in enumerate(path.read_text("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchmarkError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise BenchmarkError(f"{where}: each line must be a JSON object")
        at = float(_trace_field(row, "timestamp", where, float, 0))
        olen = _trace_field(row, "output_len", where, int, 1)
        if isinstance(row.get("prompt"), str) and row["prompt"]:
            text, n = row["prompt"], len(b.tok.encode(row["prompt"]))
        elif "input_len" in row:
            text, n = b.text(_trace_field(row, "input_len", where, int, 1), rng)
        else:
            raise BenchmarkError(f"{where}: give \"prompt\" (text) or \"input_len\" (tokens)")
        out.append(RequestSpec(text, n, int(olen), arrival=at))
        if len(out) == p.num_prompts:
            break
    if not out:
        raise BenchmarkError(f"--trace-file {path}: no requests in the file")
    return sorted(out, key=lambda r: r.arrival)


WORKLOADS: dict[str, Callable[[WorkloadParams, PromptBuilder, random.Random],
                              list[RequestSpec]]] = {
    "random": random_workload,
    "shared-prefix": shared_prefix_workload,
    "mixed": mixed_workload,
    "trace": trace_workload,
}


def make_workload(name: str, params: WorkloadParams, builder: PromptBuilder) -> list[RequestSpec]:
    if name not in WORKLOADS:
        raise BenchmarkError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if params.num_prompts < 1:
        raise BenchmarkError("--num-prompts must be at least 1")
    if not 0 <= params.range_ratio < 1:
        raise BenchmarkError(f"--range-ratio must be in [0, 1), not {params.range_ratio}")
    return WORKLOADS[name](params, builder, random.Random(params.seed))
