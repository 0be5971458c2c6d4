"""Python hooks that the task YAMLs name (`process_results: NAME`, `process_docs: NAME`),
by registry."""

from __future__ import annotations

from typing import Callable

TASK_FUNCTIONS: dict[str, Callable] = {}


def task_function(name: str):
    def register(fn):
        TASK_FUNCTIONS[name] = fn
        return fn
    return register


def common_prefix_fraction(output: str, reference: str) -> float:
    """Share of the reference's characters that the output reproduces before diverging
    (1.0 for an identical output; an empty reference counts as matched by an empty one)."""
    if not reference:
        return 1.0 if not output else 0.0
    n = 0
    for a, b in zip(output, reference):
        if a != b:
            break
        n += 1
    return n / len(reference)


@task_function("agreement")
def agreement(doc: dict, results: list[str]) -> dict[str, float]:
    """Greedy continuation vs the bf16 reference's: identical, and common-prefix share."""
    out, ref = results[0], doc["reference"]
    return {"identical": float(out == ref), "prefix_match": common_prefix_fraction(out, ref)}


# Characters of each held-out document that the perplexity gate scores: about one
# 2,048-token rolling window of this text, so every document weighs alike in the standard
# error and the gate reads ~15k tokens (the whole file is ~36k) per model.
HELDOUT_EVAL_CHARS = 8000


def first_lines(text: str, limit: int) -> str:
    """text cut to at most `limit` characters at a line end (whole if it fits or if its
    first line alone is longer)."""
    if len(text) <= limit:
        return text
    cut = text.rfind("\n", 0, limit)
    return text[:cut] if cut > 0 else text[:limit]


@task_function("heldout_excerpts")
def heldout_excerpts(dataset):
    """Each held-out document's first HELDOUT_EVAL_CHARS characters (at a line end)."""
    return dataset.map(lambda doc: {"text": first_lines(doc["text"], HELDOUT_EVAL_CHARS)})
