"""Draft preparation for speculative decoding (`qserve quantize ... --draft KIND`).

    --draft model:SOURCE        a separate small model sharing the target's tokenizer,
                                quantized with the same recipe into DIR/draft/ (itself an
                                artifact with its own manifest)
    --draft early_exit:N        self-draft: the target's first N layers, final norm, LM head
    --draft early_exit:N+head   ... plus a small head (residual MLP) distilled on the
                                calibration text to predict the target's next token,
                                written to DIR/draft/early_exit_head.safetensors
    --draft hidden_draft[:N]    self-draft from the target's last hidden state: a small
                                head (MLP + reduced LM head) distilled on the target's own
                                answers to N instructions (default 384) and calibration
                                continuations, written to DIR/draft/hidden_draft_head.safetensors;
                                n-gram lookup first at run time
    --draft ngram               n-gram prompt lookup at run time (no files)

The manifest's `draft` entry records the kind, its options, the default number of
speculative tokens, and the sha256 of every draft file; `read_draft`
(runtime/formats/draft_entry.py) verifies them before the runtime uses the draft. The
early-exit head is trained against the source (bf16) model; the hidden-state head against
the quantized target itself (the whole artifact, before it is moved into place), whose
hidden states it will be given when served.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from ..runtime.formats.errors import QserveError
from ..runtime.formats.manifest import MANIFEST_FILE, sha256_file

if TYPE_CHECKING:  # imported where used: training pulls in the model code
    from .hidden_draft_train import HeadTraining

DRAFT_DIR = "draft"
HEAD_FILE = "early_exit_head.safetensors"
HIDDEN_HEAD_FILE = "hidden_draft_head.safetensors"


class DraftError(QserveError):
    """A draft specification or draft model that cannot be used."""


@dataclass(frozen=True)
class DraftSpec:
    kind: str  # "draft_model" | "early_exit" | "hidden_draft" | "ngram" (proposer names)
    source: str | None = None  # draft_model: what to quantize
    num_layers: int | None = None  # early_exit
    train_head: bool = False  # early_exit
    head_training: "HeadTraining | None" = None  # hidden_draft (None: the defaults)
    num_speculative_tokens: int = 4


def _model(arg: str, k: int) -> DraftSpec:
    if not arg:
        raise DraftError("--draft model:SOURCE needs a SOURCE (a built-in name, HF directory "
                         "or .gguf file of a smaller model with the same tokenizer).")
    return DraftSpec("draft_model", source=arg, num_speculative_tokens=k)


def _early_exit(arg: str, k: int) -> DraftSpec:
    layers, _, extra = arg.partition("+")
    if not layers.isdigit() or int(layers) < 1 or extra not in ("", "head"):
        raise DraftError(f"--draft early_exit:{arg}: expected early_exit:N or early_exit:N+head "
                         "with N >= 1 the number of layers to run.")
    return DraftSpec("early_exit", num_layers=int(layers), train_head=extra == "head",
                     num_speculative_tokens=k)


def _hidden_draft(arg: str, k: int) -> DraftSpec:
    from .hidden_draft_train import HeadTraining

    if arg and (not arg.isdigit() or int(arg) < 1):
        raise DraftError(f"--draft hidden_draft:{arg}: expected hidden_draft or hidden_draft:N "
                         "with N >= 1 the number of instructions the target answers.")
    training = HeadTraining(num_instructions=int(arg)) if arg else None
    return DraftSpec("hidden_draft", num_speculative_tokens=k, head_training=training)


def _ngram(arg: str, k: int) -> DraftSpec:
    if arg:
        raise DraftError(f"--draft ngram takes no argument, got ngram:{arg}.")
    return DraftSpec("ngram", num_speculative_tokens=k)


DRAFT_KINDS: dict[str, Callable[[str, int], DraftSpec]] = {
    "model": _model, "early_exit": _early_exit, "hidden_draft": _hidden_draft, "ngram": _ngram}


def parse_draft(text: str, num_speculative_tokens: int = 4) -> DraftSpec:
    kind, _, arg = text.partition(":")
    if kind not in DRAFT_KINDS:
        raise DraftError(f"--draft {text!r}: unknown kind {kind!r}; use one of model:SOURCE, "
                         "early_exit:N[+head], hidden_draft[:N], ngram.")
    if not 1 <= num_speculative_tokens <= 32:
        raise DraftError(f"--num-speculative-tokens must be in [1, 32], got "
                         f"{num_speculative_tokens}.")
    return DRAFT_KINDS[kind](arg, num_speculative_tokens)


def prepare_draft(spec: DraftSpec, artifact_tmp: Path, *, target_dir: Path, recipe, calib,
                  dtype: torch.dtype, samples: torch.Tensor,
                  progress: Callable[[str], None]) -> dict:
    """Write the draft's files under `artifact_tmp`/draft and return the manifest entry.
    `artifact_tmp` holds the whole quantized target (the hidden-state head learns from it,
    as it will be served); `target_dir` is the source checkpoint."""
    entry: dict = {"kind": spec.kind, "num_speculative_tokens": spec.num_speculative_tokens}
    if spec.kind == "draft_model":
        from .pipeline import quantize

        progress(f"quantizing the draft model {spec.source}")
        report = quantize(spec.source, artifact_tmp / DRAFT_DIR, recipe, calib, dtype=dtype,
                          progress=progress)
        _check_tokenizers(target_dir, report.out_dir)
        entry.update(dir=DRAFT_DIR, source=spec.source,
                     manifest_sha256=sha256_file(report.out_dir / MANIFEST_FILE))
    elif spec.kind == "early_exit":
        entry["num_layers"] = spec.num_layers
        if spec.train_head:
            from .draft_head import train_head

            progress(f"training the early-exit head on layer {spec.num_layers}")
            (artifact_tmp / DRAFT_DIR).mkdir()
            path = artifact_tmp / DRAFT_DIR / HEAD_FILE
            stats = train_head(target_dir, spec.num_layers, samples, path, progress=progress)
            entry["head"] = _head_entry(path, stats)
    elif spec.kind == "hidden_draft":
        from .hidden_draft_train import HeadTraining, train_hidden_draft

        progress("training the hidden-state draft head on the target's own answers")
        (artifact_tmp / DRAFT_DIR).mkdir()
        path = artifact_tmp / DRAFT_DIR / HIDDEN_HEAD_FILE
        stats = train_hidden_draft(artifact_tmp, samples, path,
                                   spec.head_training or HeadTraining(), progress=progress)
        entry["head"] = _head_entry(path, stats)
    return entry


def _head_entry(path: Path, stats: dict) -> dict:
    """The manifest entry of a head file written to DRAFT_DIR (read back by read_draft)."""
    return {"file": f"{DRAFT_DIR}/{path.name}", "sha256": sha256_file(path), "training": stats}


def _check_tokenizers(target_dir: Path, draft_dir: Path) -> None:
    def vocab(root: Path) -> dict:
        data = json.loads((root / "tokenizer.json").read_text(encoding="utf-8"))
        added = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
        return {**data.get("model", {}).get("vocab", {}), **added}

    if vocab(target_dir) != vocab(draft_dir):
        raise DraftError(f"the draft model's tokenizer ({draft_dir}) differs from the target's; "
                         "a draft model must share the target's tokenizer.")
