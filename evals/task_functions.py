"""Python hooks that the task YAMLs name (`process_results: NAME`), by registry."""

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
