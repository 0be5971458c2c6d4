"""`qserve eval` end to end on the real default model: a good FP8 artifact passes its
gates and is recorded so `qserve serve` accepts it; one with corrupted scales fails and is
refused; the endpoint mode (lm-eval local-completions against a live `qserve serve`) agrees
with the in-process mode on the same artifact.

A reduced suite (6 documents per task, looser thresholds) keeps this within CI time; the
default suite and its measured time are in docs/eval-gates.md."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from lm_eval.models.openai_completions import LocalCompletionsAPI
from safetensors.torch import load_file, save_file

from qserve.evals.gates import load_gates
from qserve.evals.report import GateStatus, gate_status, record_in_manifest, write_report
from qserve.evals.lm_adapter import QserveLM
from qserve.evals.runner import endpoint_model_args, run_eval, run_tasks
from qserve.evals.task_configs import load_task_config
from qserve.runtime.formats.artifact_reader import open_artifact
from qserve.runtime.formats.manifest import Manifest
from qserve.runtime.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from server.live_server import LiveServer  # noqa: E402

pytestmark = pytest.mark.real_model

QUICK_GATES = """\
tasks: [qserve_heldout, qserve_generation, qserve_choice, qserve_agreement]
limit: 6
gates:
  - {task: qserve_heldout, metric: word_perplexity, max_relative_increase: 0.10}
  - {task: qserve_generation, metric: exact_match, min_recovery: 0.75}
  - {task: qserve_choice, metric: acc, min_recovery: 0.75}
  - {task: qserve_agreement, metric: prefix_match}
"""


@pytest.fixture(scope="module")
def gates_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("gates") / "quick.yaml"
    p.write_text(QUICK_GATES)
    return p


@pytest.fixture(scope="module")
def artifact(smollm2_fp8):
    return smollm2_fp8


@pytest.fixture(scope="module")
def good_report(artifact, gates_file, tmp_path_factory):
    return run_eval(str(artifact), load_gates(gates_file))


def _metrics(report):
    return {(r.gate.task, r.gate.metric): r for r in report.results}


def test_good_artifact_passes_and_is_recorded(artifact, good_report, tmp_path):
    d = good_report.to_dict()
    assert d["passed"] is True, d["metrics"]
    assert d["mode"] == "in-process" and d["limit"] == 6
    assert d["reference"]["spec"] == "smollm2-135m" and len(d["reference"]["digest"]) == 64
    assert d["artifact"]["digest"] == open_artifact(artifact).digest
    assert {"generation.jsonl", "choice.jsonl", "heldout_text.jsonl"} <= set(d["datasets"])
    m = _metrics(good_report)
    ppl = m[("qserve_heldout", "word_perplexity")]
    assert ppl.n == 6 and ppl.reference > 1.0 and ppl.value > 1.0
    assert 0.0 <= ppl.statistic <= 0.10 and ppl.statistic_stderr is not None
    assert m[("qserve_choice", "acc")].reference > 0.5  # the bf16 model knows these
    # serve refuses before the report is recorded, accepts after
    st = gate_status(artifact, d["artifact"]["digest"])
    assert not st.may_serve and "no eval gate report" in st.why
    js, md = write_report(good_report, tmp_path / "rep")
    assert json.loads(js.read_text())["passed"] is True and "| qserve_choice | acc |" in md.read_text()
    record_in_manifest(good_report, js)
    assert gate_status(artifact, open_artifact(artifact).digest) == GateStatus(
        True, f"gates passed {good_report.created}", good_report.unsettled, [])
    assert Manifest.read(artifact).eval["unsettled"] == good_report.unsettled


def test_corrupted_scales_fail_and_are_refused(artifact, good_report, gates_file, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(artifact, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    for name in tensors:
        if name.endswith("mlp.down_proj.weight_scale"):
            tensors[name] = tensors[name] * 3  # a writer bug: scales off by 3x
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    m = Manifest.read(bad)
    m.record_files(bad)
    m.eval = None
    m.write(bad)
    result = CliRunner().invoke(main, ["eval", str(bad), "--gates", str(gates_file),
                                       "--out", str(tmp_path / "rep")])
    assert result.exit_code == 1, result.output
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["passed"] is False
    verdicts = {(x["task"], x["metric"]): x for x in report["metrics"]}
    assert verdicts[("qserve_heldout", "word_perplexity")]["verdict"] == "FAIL"
    assert verdicts[("qserve_heldout", "word_perplexity")]["statistic"] > 0.5
    rec = Manifest.read(bad).eval
    assert rec["passed"] is False and "qserve_heldout/word_perplexity" in rec["failed"]
    assert "qserve_heldout/word_perplexity" not in rec["unsettled"]  # settled: refused
    refused = CliRunner().invoke(main, ["serve", str(bad)])
    assert refused.exit_code != 0
    assert "its last gate report failed" in refused.output and "--allow-ungated" in refused.output


def _values(report) -> list[tuple]:
    return [(r.gate.task, r.gate.metric, r.n, r.value, r.value_stderr, r.reference,
             r.statistic, r.statistic_stderr, r.passed) for r in report.results]


def test_the_same_artifact_evaluated_twice_gets_the_same_report(artifact, good_report,
                                                                gates_file):
    """Values, not only the verdict: every metric, its standard error and statistic equal
    to the last bit (the engine's steps are batch-invariant, the sampling seeded)."""
    again = run_eval(str(artifact), load_gates(gates_file))
    assert _values(again) == _values(good_report)


def test_endpoint_mode_agrees_with_in_process(artifact, good_report, gates_file):
    args = ["--served-model-name", "smol", "--threads", "1", "--kv-cache-gib", "0.25",
            "--max-num-batched-tokens", "2048", "--allow-ungated"]
    heldout = [load_task_config("qserve_heldout")]
    with LiveServer(artifact, args=args) as live:
        remote = run_eval(str(artifact), load_gates(gates_file), endpoint=live.base)
        client = LocalCompletionsAPI(**endpoint_model_args(live.base, open_artifact(artifact),
                                                           None))
        far_docs = run_tasks(client, None, heldout, 6)["qserve_heldout"]
    assert remote.mode == "endpoint" and remote.endpoint == live.base
    # lm-eval's API client scores one document per call, so the server runs one sequence
    # per step; the in-process adapter with one sequence per step and the server's step
    # budget schedules alike, and then every document's log-likelihood is the same number:
    # the same windows, prefix token, tokens and echo log-probs.
    # ... and the same thread count (oneDNN splits its sums by thread).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        near_docs = run_tasks(QserveLM(model=str(artifact), batch_size=1), None, heldout,
                              6)["qserve_heldout"]
    finally:
        torch.set_num_threads(threads)
    assert near_docs and far_docs == near_docs
    # The in-process run batches many sequences per step, the server one document a step:
    # with batch-invariant steps the whole reports are the same numbers
    assert _values(remote) == _values(good_report)
