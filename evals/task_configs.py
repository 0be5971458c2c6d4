"""Load the lm-eval task definitions (evals/tasks/*.yaml) as config dicts for lm-eval.

The YAML files are plain lm-eval task configs with two project conventions, resolved here
so the tasks work from any working directory and without lm-eval's include paths:
- `dataset_kwargs.data_files` paths (one, or a list read as one dataset) are relative to
  the evals/ package directory, or a `{placeholder}` filled from `values` (e.g. the
  reference outputs of one model);
- `process_results: NAME` / `process_docs: NAME` name a function in
  evals/task_functions.py.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from ..runtime.formats.errors import QserveError
from .task_functions import TASK_FUNCTIONS

EVALS_DIR = Path(__file__).parent
TASKS_DIR = EVALS_DIR / "tasks"
HOOKS = ("process_results", "process_docs")  # task config keys that name a function


class TaskConfigError(QserveError, ValueError):
    pass


def task_names() -> list[str]:
    return sorted(p.stem for p in TASKS_DIR.glob("*.yaml"))


def _data_file(task_file: Path, rel: str, values: dict[str, str] | None) -> str:
    """A task's data file: relative to evals/, or a {placeholder} filled from values."""
    if rel.startswith("{") and rel.endswith("}"):
        key = rel[1:-1]
        if not values or key not in values:
            raise TaskConfigError(f"{task_file}: data file {rel} needs a value for {key!r}.")
        resolved = Path(values[key])
    else:
        resolved = EVALS_DIR / rel
    if not resolved.is_file():
        raise TaskConfigError(f"{task_file}: data file {resolved} does not exist.")
    return str(resolved)


def load_task_config(name: str, values: dict[str, str] | None = None) -> dict:
    path = TASKS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise TaskConfigError(f"unknown eval task {name!r}; known: {', '.join(task_names())}.")
    cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    files = cfg.get("dataset_kwargs", {}).get("data_files", {})
    for split, rel in list(files.items()):
        # one file, or a list of files read as one dataset in order (doc ids run on)
        resolved = [_data_file(path, r, values) for r in (rel if isinstance(rel, list) else [rel])]
        files[split] = resolved if isinstance(rel, list) else resolved[0]
    for hook in HOOKS:
        fn = cfg.get(hook)
        if isinstance(fn, str):
            if fn not in TASK_FUNCTIONS:
                raise TaskConfigError(f"{path}: {hook} {fn!r} is not in "
                                      f"evals/task_functions.py ({', '.join(TASK_FUNCTIONS)}).")
            cfg[hook] = TASK_FUNCTIONS[fn]
    return cfg
