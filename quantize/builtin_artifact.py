"""A built-in model's artifact, quantized into the cache on first use.

`qserve serve smollm2-135m` and `qserve eval smollm2-135m` name a model, not an artifact:
the first use quantizes it with the model's built-in recipe (quantize/recipes/NAME@CLASS.yaml
where measurements chose one for this CPU's class, else quantize/recipes/NAME.yaml, else
the default recipe; calibrating in this CPU's calibration dtype) into
QSERVE_CACHE/artifacts/NAME (named after the model, not a format: a recipe may choose int8
weights or a bf16 KV cache; a folder left as NAME-fp8 by an older qserve is moved there
once); later uses find it there, and quantize it again when the
built-in recipe has changed since, or the source's tokenizer as converted today (a GGUF
converter change, e.g. Qwen2's NFC normalizer) differs from the one the artifact holds.
Processes that want the same artifact at once (the workers of `qserve cluster`, two
servers) take turns through a lock file beside it: one quantizes, the others wait and then
find it made.
"""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Callable, Iterator

from ..kernels.cache import cache_root
from ..runtime.formats.artifact_reader import is_artifact
from ..runtime.formats.manifest import Manifest
from ..runtime.formats.sources import BUILTIN_MODELS, resolve_source
from .artifact_writer import TOKENIZER_FILES
from .pipeline import format_report, quantize
from .recipe import Recipe, RecipeError, load_recipe, recipe_from_dict

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"


def builtin_recipe_path(name: str, klass: str | None = None) -> Path | None:
    """The file of the recipe a built-in model's artifact is made with on a CPU of class
    `klass` (default: this one's, under QSERVE_CPU_CLASS's cap): NAME@CLASS.yaml where
    measurements on that class chose one, else NAME.yaml (each says how), else None (the
    default recipe). The artifact is made on the machine that serves it, so it can be the
    one that is fastest there among those that pass the gates."""
    if klass is None:
        from ..kernels.cpu_class import cpu_class, cpu_flags

        klass = cpu_class(cpu_flags())
    for path in (RECIPES_DIR / f"{name}@{klass}.yaml", RECIPES_DIR / f"{name}.yaml"):
        if path.is_file():
            return path
    return None


def builtin_recipe(name: str, klass: str | None = None) -> Recipe:
    """The recipe a built-in model's artifact is made with (builtin_recipe_path), else the
    default."""
    path = builtin_recipe_path(name, klass)
    return load_recipe(path) if path is not None else Recipe()


def artifact_path(name: str) -> Path:
    """Where a built-in model's artifact is kept in the cache."""
    return cache_root() / "artifacts" / name


def legacy_artifact_path(name: str) -> Path:
    """Where qserve kept it before (named after FP8 whatever the recipe chose)."""
    return cache_root() / "artifacts" / f"{name}-fp8"


def cached_builtin_artifact(spec: str) -> str:
    """A built-in model's cached artifact when one was made (nothing is quantized here;
    one in the older folder counts); anything else, or a built-in model without one, as
    given."""
    if spec not in BUILTIN_MODELS:
        return spec
    for path in (artifact_path(spec), legacy_artifact_path(spec)):
        if is_artifact(path):
            return str(path)
    return spec


def _adopt_legacy(spec: str, path: Path, say: Callable[[str], None]) -> None:
    """Move an artifact an older qserve left in legacy_artifact_path to `path` (one
    rename, under the model's lock), so it is checked and used, not made again."""
    old = legacy_artifact_path(spec)
    if not path.exists() and is_artifact(old):
        old.rename(path)
        say(f"qserve: moved the cached artifact of {spec} from {old} to {path}")


def made_with(path: Path, recipe: Recipe) -> bool:
    """Whether the artifact at `path` was made with `recipe` (read with today's defaults
    for keys its manifest predates); False where there is none. With a budget, the recipe
    asked for is the one recorded beside the search (the manifest's `recipe` is what the
    search chose)."""
    if not is_artifact(path):
        return False
    manifest = Manifest.read(path)
    requested = (manifest.summary.get("budget") or {}).get("requested_recipe")
    for made in (manifest.recipe, requested):
        try:
            if made is not None and recipe_from_dict(made) == recipe:
                return True
        except (RecipeError, TypeError):
            pass
    return False


def tokenizer_is_current(path: Path, spec: str) -> bool:
    """Whether the artifact at `path` holds, byte for byte, the tokenizer files of its
    source `spec` as converted today (quantize copies them verbatim)."""
    source = Path(resolve_source(spec).checkpoint_dir)
    for name in TOKENIZER_FILES:
        a, b = path / name, source / name
        if a.is_file() != b.is_file() or (a.is_file() and a.read_bytes() != b.read_bytes()):
            return False
    return True


def builtin_artifact(spec: str, say: Callable[[str], None],
                     progress: Callable[[str], None] | None = None) -> str:
    """For a built-in model name, the path of its cached FP8 artifact (made now if
    missing; `say` reports that, `progress` follows the quantization). Anything else is
    returned as given."""
    if spec not in BUILTIN_MODELS:
        return spec
    path = artifact_path(spec)
    with builtin_turn(spec, say):
        return _current_artifact(spec, path, say, progress)


@contextlib.contextmanager
def builtin_turn(spec: str, say: Callable[[str], None]) -> Iterator[None]:
    """Hold a built-in model's artifact lock (QSERVE_CACHE/artifacts/.NAME.lock) while
    this process checks, makes or gates its artifact; say so when another one holds it."""
    path = artifact_path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"qserve: another process is making the artifact of {spec}; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _current_artifact(spec: str, path: Path, say: Callable[[str], None],
                      progress: Callable[[str], None] | None) -> str:
    _adopt_legacy(spec, path, say)
    recipe = builtin_recipe(spec)
    if is_artifact(path):
        if not made_with(path, recipe):
            say(f"qserve: the built-in recipe of {spec} changed since {path} was made; "
                "quantizing it again")
        elif not tokenizer_is_current(path, spec):
            say(f"qserve: the tokenizer of {spec} changed since {path} was made; "
                "quantizing it again")
        else:
            return str(path)
    else:
        say(f"qserve: no quantized artifact for {spec} yet; quantizing it once into {path}")
    report = quantize(spec, path, recipe, force=True, progress=progress)
    say("")
    say(format_report(report).splitlines()[-2])
    return str(path)
