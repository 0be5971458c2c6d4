"""`qserve eval`: run the gate suite's lm-eval tasks on an artifact and decide.

    artifact (verified) -> its bf16 reference (the source it was quantized from)
    -> reference outputs for the agreement prompts (shipped or cached per reference digest)
    -> reference results (shipped for built-in models, else cached per reference
       digest + datasets + task configs + limit: reference_values.py)
    -> candidate results: in-process through the engine (lm-eval model `qserve`), or an
       OpenAI-compatible endpoint through lm-eval's `local-completions`
    -> one verdict per gate -> EvalReport

Per-document metric values come from lm-eval's logged samples, so every gate is computed
on the same documents for the artifact and the reference, with standard errors.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from ..runtime.atomic_file import write_text_atomic
from ..runtime.formats.artifact_reader import Artifact, open_artifact
from ..runtime.formats.errors import QserveError
from ..runtime.formats.manifest import package_versions
from . import reference_values
from .reference_values import DocValues
from .gates import SETTLED_MARGIN, GateResult, GateSuite, evaluate_gate
from .golden_tasks import GOLDEN_DIR, file_digest, golden_digests
from .task_configs import load_task_config

log = logging.getLogger(__name__)

AGREEMENT_TASK = "qserve_agreement"
AGREEMENT_TOKENS = 64
# bump when the engine's outputs change (invalidates cached reference results and outputs);
# 3: prefill attention in bf16; 4: decode attention in C (another fp32 summation order);
# 5: small-batch FP8 linears in C (another fp32 summation order); 6: C RMSNorm and the C
# decode path (silu's exp, the norms' sum order); 7: FP8 linears of up to 16 rows on AMX
# (another fp32 summation order); 8: scoring runs the LM head on the continuation's rows
# only (fewer rows per matmul); 9: bf16 prompt attention through SDPA on AMX (another
# order of sums; 62 of the 3,331 generation items of SmolLM2's reference flipped)
ADAPTER_VERSION = 9


class EvalError(QserveError):
    pass


@dataclass
class EvalReport:
    artifact: dict  # path, digest
    reference: dict  # spec, digest
    mode: str  # "in-process" | "endpoint"
    endpoint: str | None
    gates_file: dict  # path, sha256
    datasets: dict[str, str]  # golden file -> sha256
    results: list[GateResult]
    seconds: float
    limit: int | None
    versions: dict = field(default_factory=package_versions)
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    @property
    def passed(self) -> bool:
        return all(r.passed is not False for r in self.results)

    @property
    def unsettled(self) -> list[str]:
        """Gates whose statistic lies within 2 standard errors of the threshold: these
        datasets do not settle their verdict (the same artifact may land either side)."""
        return [f"{r.gate.task}/{r.gate.metric}" for r in self.results
                if r.margin_in_stderr is not None and abs(r.margin_in_stderr) < SETTLED_MARGIN]

    @property
    def failed(self) -> list[str]:
        """Gates that failed, settled or not."""
        return [f"{r.gate.task}/{r.gate.metric}" for r in self.results if r.passed is False]

    def to_dict(self) -> dict:
        return {"passed": self.passed, "created": self.created, "artifact": self.artifact,
                "reference": self.reference, "mode": self.mode, "endpoint": self.endpoint,
                "gates_file": self.gates_file, "limit": self.limit, "datasets": self.datasets,
                "versions": self.versions, "seconds": round(self.seconds, 1),
                "metrics": [r.to_dict() for r in self.results]}


# -- datasets and references -------------------------------------------------------------
def check_golden() -> dict[str, str]:
    """sha256 of every golden file, verified against DIGESTS.json."""
    recorded = golden_digests()
    for name, digest in recorded.items():
        path = GOLDEN_DIR / name
        if not path.is_file() or file_digest(path) != digest:
            raise EvalError(f"{path}: missing or changed (sha256 differs from DIGESTS.json); "
                            "reinstall qserve or rebuild with `python -m qserve.evals.golden_tasks "
                            "--write`.")
    return recorded


def reference_of(artifact: Artifact) -> tuple[str, str]:
    """(spec to load the bf16 reference, its digest) from the artifact's manifest."""
    src = artifact.manifest.source
    spec, digest = src.get("spec"), src.get("sha256")
    if not spec or not digest:
        raise EvalError(f"{artifact.path}: the manifest does not name its source checkpoint; "
                        "cannot compare against a reference.")
    return str(spec), str(digest)


def reference_outputs_file(ref_digest: str, extra_digest: str | None = None,
                           shipped: bool | None = None) -> Path:
    """Shipped reference outputs for a built-in model, else the cache location (one per
    extra prompts file, keyed by its digest). shipped: True, the package's location
    whether or not the file is there yet; False, the cache's."""
    name = f"agreement-{ref_digest[:16]}-v{ADAPTER_VERSION}.jsonl"
    in_package = reference_values.SHIPPED_DIR / name
    if extra_digest is None and (shipped or (shipped is None and in_package.is_file())):
        return in_package
    extra = f"-{extra_digest[:12]}" if extra_digest else ""
    name = f"agreement-{ref_digest[:16]}{extra}-v{ADAPTER_VERSION}.jsonl"
    return reference_values.cache_dir() / name


def artifact_tokenizer(artifact: Artifact):
    from ..runtime.tokenizer import Tokenizer

    return Tokenizer.from_dir(artifact.path)


def read_extra_prompts(path: str, tokenizer) -> list[dict]:
    """An eval prompts file (`qserve gateway export`): {"id", "prompt"} or {"id",
    "messages"} per line, chat messages rendered with the model's chat template."""
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise EvalError(f"{path}:{n} is not a JSON line.") from None
        if not isinstance(row, dict) or "id" not in row:
            raise EvalError(f"{path}:{n}: each line needs an 'id' and a 'prompt' or "
                            f"'messages'.")
        if isinstance(row.get("messages"), list):
            prompt = tokenizer.apply_chat_template(row["messages"])
        elif isinstance(row.get("prompt"), str):
            prompt = row["prompt"]
        else:
            raise EvalError(f"{path}:{n}: each line needs a 'prompt' string or a "
                            f"'messages' list.")
        rows.append({"id": f"extra-{row['id']}", "prompt": prompt})
    if not rows:
        raise EvalError(f"{path} holds no prompts.")
    return rows


def record_reference_outputs(ref_model, ref_digest: str, path: Path,
                             extra: list[dict] | None = None) -> Path:
    """Greedy AGREEMENT_TOKENS-token continuations of the agreement prompts (and of the
    `extra` ones) by the bf16 reference (a QserveLM), written as {"id", "prompt",
    "reference", "reference_digest"}."""
    prompts = [json.loads(line) for line in
               (GOLDEN_DIR / "agreement_prompts.jsonl").read_text().splitlines() if line]
    prompts = (extra or []) + prompts     # first: a --limit run still covers them
    outs = ref_model.greedy([p["prompt"] for p in prompts], AGREEMENT_TOKENS)
    rows = [{"id": p["id"], "prompt": p["prompt"], "reference": o,
             "reference_digest": ref_digest} for p, o in zip(prompts, outs)]
    write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


# -- running tasks --------------------------------------------------------------------------
def _task_configs(tasks: list[str], values: dict[str, str]) -> list[dict]:
    return [load_task_config(t, values) for t in tasks]


def per_doc_values(samples: dict[str, list[dict]], configs: list[dict]) -> DocValues:
    """lm-eval logged samples -> task -> metric -> doc id -> per-document value."""
    out: DocValues = {}
    for cfg in configs:
        task = cfg["task"]
        filters = cfg.get("filter_list") or [{"name": "none"}]
        wanted = filters[0]["name"]
        metrics = [m["metric"] for m in cfg.get("metric_list", [])]
        per: dict[str, dict[int, object]] = {m: {} for m in metrics}
        for s in samples.get(task, []):
            if s.get("filter", "none") != wanted:
                continue
            for m in metrics:
                if m in s:
                    v = s[m]
                    per[m][int(s["doc_id"])] = tuple(v) if isinstance(v, (list, tuple)) else v
        out[task] = per
    return out


@contextlib.contextmanager
def _no_directory_commit() -> Iterator[None]:
    """While active, lm-eval's evaluator records no git commit. It would run `git describe`
    in the current directory: outside a repository that prints `fatal: not a git
    repository` into a passing eval's output, inside one it names whatever repository the
    user stands in. The report records qserve's own version and packages instead."""
    import lm_eval.evaluator as evaluator

    real = evaluator.get_git_commit_hash
    evaluator.get_git_commit_hash = lambda: None
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = real


def run_tasks(model, model_args: dict | None, configs: list[dict], limit: int | None,
              batch_size: int | str = 64) -> DocValues:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # our tasks come as config dicts: skip indexing lm-eval's thousands of built-in YAMLs
    with _no_directory_commit():
        results = simple_evaluate(model=model, model_args=model_args, tasks=configs,
                                  limit=limit, batch_size=batch_size, bootstrap_iters=0,
                                  log_samples=True, verbosity="WARNING",
                                  task_manager=TaskManager(include_defaults=False))
    if results is None:
        raise EvalError("lm-eval returned no results.")
    return per_doc_values(results["samples"], configs)


# -- the whole run ----------------------------------------------------------------------------
@dataclass
class _Inputs:
    """What both sides of a run are evaluated on, and the reference to load if needed."""
    artifact: Artifact
    reference: dict  # spec, digest
    datasets: dict[str, str]  # golden file -> sha256 (with the agreement outputs' file)
    configs: list[dict]  # lm-eval task configs
    reference_model: Callable[[], object]  # the bf16 reference (a QserveLM), loaded once


def _inputs(artifact_path: str, suite: GateSuite, prompts: str | None,
            progress: Callable[[str], None], shipped_outputs: bool | None = None,
            device: str = "auto") -> _Inputs:
    """The artifact, its reference, the datasets and the task configs; records the
    reference's agreement outputs where neither the package nor the cache has them
    (shipped_outputs: as reference_outputs_file's `shipped`; True records them into the
    package, for reference_values' recording command; False never reads the package's)."""
    from .lm_adapter import QserveLM

    datasets = check_golden()
    artifact = open_artifact(artifact_path)  # refuses a changed artifact
    ref_spec, ref_digest = reference_of(artifact)
    loaded = []

    def reference_model() -> QserveLM:
        if not loaded:
            progress(f"loading the bf16 reference {ref_spec}")
            loaded.append(QserveLM(model=ref_spec, device=device))
        return loaded[0]

    values: dict[str, str] = {}
    if prompts is not None and AGREEMENT_TASK not in suite.tasks:
        raise EvalError(f"--prompts adds agreement prompts, but the gates file runs no "
                        f"{AGREEMENT_TASK} task; add it to the gates file's tasks.")
    if AGREEMENT_TASK in suite.tasks:
        extra, extra_digest = None, None
        if prompts is not None:
            extra = read_extra_prompts(prompts, artifact_tokenizer(artifact))
            extra_digest = file_digest(Path(prompts))
            datasets = {**datasets, f"prompts/{Path(prompts).name}": extra_digest}
        path = reference_outputs_file(ref_digest, extra_digest, shipped=shipped_outputs)
        if not path.is_file():
            progress("recording the reference's greedy outputs")
            record_reference_outputs(reference_model(), ref_digest, path, extra)
        values["reference_outputs"] = str(path)
        datasets = {**datasets, f"reference/{path.name}": file_digest(path)}
    return _Inputs(artifact, {"spec": ref_spec, "digest": ref_digest}, datasets,
                   _task_configs(suite.tasks, values), reference_model)


def reference_results(artifact_path: str, suite: GateSuite,
                      progress: Callable[[str], None] | None = None
                      ) -> tuple[dict, dict[str, str], DocValues]:
    """The bf16 reference's results for `suite`, computed here (reference_values' recording
    command): (reference {spec, digest}, datasets, per-document values)."""
    progress = progress or (lambda msg: None)
    inputs = _inputs(artifact_path, suite, None, progress, shipped_outputs=True)
    progress("evaluating the bf16 reference")
    return inputs.reference, inputs.datasets, run_tasks(inputs.reference_model(), None,
                                                        inputs.configs, suite.limit)


def run_eval(artifact_path: str, suite: GateSuite, endpoint: str | None = None,
             served_model: str | None = None, threads: int | None = None,
             progress: Callable[[str], None] | None = None,
             prompts: str | None = None, recompute_reference: bool = False,
             device: str = "auto") -> EvalReport:
    """prompts: an extra prompts file whose prompts join the agreement task's.
    recompute_reference: compute the reference's results (and its agreement outputs) here
    even where the package ships them (reference_values.py). device: where the artifact
    and the reference run in-process (runtime/device.py)."""
    from .lm_adapter import QserveLM

    progress = progress or (lambda msg: None)
    t0 = time.perf_counter()
    inputs = _inputs(artifact_path, suite, prompts, progress,
                     shipped_outputs=False if recompute_reference else None, device=device)
    artifact, datasets, configs = inputs.artifact, inputs.datasets, inputs.configs
    reference = inputs.reference
    ref_digest = reference["digest"]

    ref_results = None  # a ReferenceValues
    if suite.needs_reference or any(g.task == AGREEMENT_TASK for g in suite.gates):
        ref_results = reference_values.lookup(ref_digest, suite, datasets, recompute_reference)
        if ref_results is None:
            progress("evaluating the bf16 reference")
            ref_results = reference_values.write_cache(
                run_tasks(inputs.reference_model(), None, configs, suite.limit),
                ref_digest, suite, datasets)
        elif ref_results.source == "shipped":
            progress(f"the bf16 reference's results: shipped with qserve (recorded on an "
                     f"{(ref_results.recorded or {}).get('cpu_class', '?')} CPU)")
    ref_values = ref_results.values if ref_results else None
    inputs = None  # frees the reference model before loading the artifact

    if endpoint:
        progress(f"evaluating {endpoint}")
        from lm_eval.models.openai_completions import LocalCompletionsAPI

        cand = run_tasks(LocalCompletionsAPI(**endpoint_model_args(endpoint, artifact,
                                                                   served_model)),
                         None, configs, suite.limit)
        mode = "endpoint"
    else:
        progress("evaluating the artifact in-process")
        cand = run_tasks(QserveLM(model=str(artifact.path), device=device), None, configs,
                         suite.limit)
        mode = "in-process"

    results = []
    for gate in suite.gates:
        got = cand.get(gate.task, {}).get(gate.metric)
        if got is None:
            raise EvalError(f"task {gate.task} has no metric {gate.metric!r}; its metrics: "
                            f"{', '.join(cand.get(gate.task, {}))}.")
        ref = ref_values.get(gate.task, {}).get(gate.metric) if ref_values else None
        results.append(evaluate_gate(gate, got, ref))
    gates_file = {"path": str(suite.path), "sha256": file_digest(suite.path)}
    reference = {**reference, "results": ref_results.source if ref_results else None}
    return EvalReport({"path": str(artifact.path), "digest": artifact.digest}, reference,
                      mode, endpoint, gates_file, datasets, results,
                      time.perf_counter() - t0, suite.limit)


def endpoint_model_args(endpoint: str, artifact: Artifact, served_model: str | None) -> dict:
    """lm-eval `local-completions` arguments: the server's completions URL, the model name
    it serves, and the artifact's tokenizer (token-id requests, BOS as the model adds it)."""
    import httpx

    from ..runtime.tokenizer import Tokenizer

    base = endpoint.rstrip("/")
    if base.endswith("/v1/completions"):
        base = base[: -len("/completions")]
    elif not base.endswith("/v1"):
        base = base + "/v1"
    if served_model is None:
        try:
            r = httpx.get(f"{base}/models", timeout=10)
            r.raise_for_status()
            served_model = r.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise EvalError(f"cannot list models at {base}/models ({e}); is the server "
                            "running? Pass --served-model NAME if it has no /v1/models.") from None
    from .lm_adapter import rolling_window_tokens

    tok = Tokenizer.from_dir(artifact.path, artifact.checkpoint.generation_config)
    bos = tok.hf.token_to_id(tok.bos_token) if tok.bos_token else None
    add_bos = bos is not None and tok.encode("a")[:1] == [bos]
    limit = int(artifact.checkpoint.config.get("max_position_embeddings", 2048))
    return {"model": served_model, "base_url": f"{base}/completions",
            "tokenizer": str(artifact.path), "tokenizer_backend": "huggingface",
            "tokenized_requests": True, "add_bos_token": add_bos,
            # the token before a rolling window's first token, as QserveLM.prefix_token_id
            "custom_prefix_token_id": bos if bos is not None else tok.eos_token_ids[0],
            # its rolling windows are max_length - 1 tokens: + 1 gives the in-process windows
            "max_length": rolling_window_tokens(limit) + 1, "batch_size": 16, "num_concurrent": 4,
            "max_retries": 1,
            "timeout": 600}
