"""Gate definitions (validation) and verdicts (statistics by hand)."""

import math

import pytest

from qserve.evals.gates import (SUITES, Gate, GateError, aggregate, evaluate_gate,
                                gates_path, jackknife_stderr, load_gates)


def _write(tmp_path, text):
    p = tmp_path / "gates.yaml"
    p.write_text(text)
    return p


def test_default_gates_load():
    suite = load_gates()
    assert suite.tasks == ["qserve_heldout", "qserve_generation", "qserve_choice",
                           "qserve_agreement"]
    kinds = {(g.task, g.metric): (g.kind, g.threshold) for g in suite.gates}
    assert kinds[("qserve_heldout", "word_perplexity")] == ("max_relative_increase", 0.01)
    assert kinds[("qserve_choice", "acc")] == ("min_recovery", 0.99)
    assert kinds[("qserve_generation", "exact_match")] == ("min_recovery", 0.99)
    assert kinds[("qserve_agreement", "prefix_match")] == (None, None)
    assert suite.needs_reference


def test_full_suite_has_the_default_gates_on_its_larger_tasks():
    default, full = load_gates(), load_gates(gates_path("full", None))
    bigger = {"qserve_generation": "qserve_generation_full", "qserve_choice": "qserve_choice_full"}
    assert full.tasks == [bigger.get(t, t) for t in default.tasks]
    assert [(bigger.get(g.task, g.task), g.metric, g.kind, g.threshold) for g in default.gates] \
        == [(g.task, g.metric, g.kind, g.threshold) for g in full.gates]
    assert full.limit is None


def test_suite_names_and_gates_files_are_exclusive():
    assert gates_path(None, None) is None and gates_path(None, "x.yaml") == "x.yaml"
    assert gates_path("default", None) == str(SUITES["default"])
    with pytest.raises(GateError, match="give one of them"):
        gates_path("full", "x.yaml")
    with pytest.raises(GateError, match="unknown gate suite 'huge'; known: default, full"):
        gates_path("huge", None)


@pytest.mark.parametrize("text, message", [
    ("tasks: [qserve_choice]\ngates: []\nbogus: 1", "unknown key(s) ['bogus']"),
    ("tasks: [nope]\ngates: [{task: nope, metric: acc}]", "unknown task 'nope'"),
    ("tasks: []\ngates: []", "'tasks' must be a non-empty list"),
    ("tasks: [qserve_choice]\ngates: []", "'gates' is empty"),
    ("tasks: [qserve_choice]\ngates: [{task: qserve_heldout, metric: acc}]",
     "task 'qserve_heldout' is not in 'tasks'"),
    ("tasks: [qserve_choice]\ngates: [{task: qserve_choice, metric: acc, min: 0.1, max: 0.9}]",
     "one threshold per gate"),
    ("tasks: [qserve_choice]\ngates: [{task: qserve_choice, metric: acc, min: high}]",
     "min must be a number"),
    ("tasks: [qserve_choice]\ngates: [{task: qserve_choice, metric: acc, above: 1}]",
     "unknown key(s) ['above']"),
    ("tasks: [qserve_choice]\nlimit: 0\ngates: [{task: qserve_choice, metric: acc}]",
     "'limit' must be a positive integer"),
    ("tasks: [qserve_choice\n", "not valid YAML"),
])
def test_bad_gate_files(tmp_path, text, message):
    with pytest.raises(GateError) as e:
        load_gates(_write(tmp_path, text))
    assert message in str(e.value)


def test_missing_gates_file(tmp_path):
    with pytest.raises(GateError, match="no such gates file"):
        load_gates(tmp_path / "absent.yaml")


def test_jackknife_of_a_mean_is_the_sample_standard_error():
    xs = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    n, m = len(xs), sum(xs) / len(xs)
    classic = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)
    got = jackknife_stderr(n, lambda sel: sum(xs[i] for i in sel) / len(sel))
    assert got == pytest.approx(classic, rel=1e-12)


def test_weighted_perplexity_and_relative_increase():
    ref = {0: (-10.0, 5), 1: (-20.0, 5)}  # ppl exp(30/10)
    cand = {0: (-10.5, 5), 1: (-20.0, 5)}  # exp(30.5/10)
    assert aggregate("word_perplexity", list(ref.values())) == pytest.approx(math.exp(3.0))
    gate = Gate("qserve_heldout", "word_perplexity", "max_relative_increase", 0.01)
    r = evaluate_gate(gate, cand, ref)
    assert r.statistic == pytest.approx(math.exp(0.05) - 1)  # +5.1%
    assert r.passed is False
    r2 = evaluate_gate(Gate("qserve_heldout", "word_perplexity", "max_relative_increase", 0.06),
                       cand, ref)
    assert r2.passed is True and r2.reference == pytest.approx(math.exp(3.0))


def test_recovery_and_absolute_gates():
    ref = {i: 1.0 for i in range(10)}
    cand = {**ref, 3: 0.0}  # one answer lost: recovery 0.9
    r = evaluate_gate(Gate("qserve_choice", "acc", "min_recovery", 0.9), cand, ref)
    assert (r.value, r.reference, r.statistic, r.passed) == (0.9, 1.0, pytest.approx(0.9), True)
    assert evaluate_gate(Gate("qserve_choice", "acc", "min_recovery", 0.99), cand, ref).passed is False
    assert evaluate_gate(Gate("qserve_choice", "acc", "min", 0.95), cand, None).passed is False
    assert evaluate_gate(Gate("qserve_choice", "acc", "max", 0.95), cand, None).passed is True
    reported = evaluate_gate(Gate("qserve_choice", "acc"), cand, ref)
    assert reported.passed is None and reported.to_dict()["verdict"] == "reported"


def test_relative_gate_without_reference_is_an_error():
    with pytest.raises(GateError, match="needs reference"):
        evaluate_gate(Gate("qserve_choice", "acc", "min_recovery", 0.99), {0: 1.0}, None)


def test_margin_in_standard_errors_has_the_passing_side_positive():
    xs = {i: float(i % 2) for i in range(20)}  # mean 0.5, se sqrt(0.25 / 19)
    se = math.sqrt(0.25 / 19)
    above = evaluate_gate(Gate("qserve_choice", "acc", "min", 0.4), xs, None)
    assert above.passed and above.margin_in_stderr == pytest.approx(0.1 / se)
    over = evaluate_gate(Gate("qserve_choice", "acc", "max", 0.4), xs, None)
    assert not over.passed and over.margin_in_stderr == pytest.approx(-0.1 / se)
    assert evaluate_gate(Gate("qserve_choice", "acc"), xs, None).margin_in_stderr is None
    assert evaluate_gate(Gate("qserve_choice", "acc", "min", 0.4), xs,
                         None).to_dict()["margin_in_stderr"] == pytest.approx(0.1 / se)


def test_serve_refuses_a_settled_fail_and_warns_on_an_unsettled_verdict(tmp_path):
    """What `qserve serve` does with the verdict recorded in the manifest (a tiny artifact
    with hand-written records: the real runs are in test_eval_gates.py)."""
    import sys
    from pathlib import Path

    import torch

    from qserve.evals.serve_gate import check_gates
    from qserve.quantize.pipeline import quantize
    from qserve.quantize.recipe import recipe_from_dict
    from qserve.runtime.formats.artifact_reader import open_artifact
    from qserve.runtime.formats.errors import QserveError
    from qserve.runtime.formats.manifest import Manifest

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_models import write_tiny_llama

    src = write_tiny_llama(tmp_path / "src")
    art = tmp_path / "art"
    quantize(str(src), art, recipe_from_dict({"calibration": {"num_samples": 2, "seq_len": 32}}),
             dtype=torch.float32)
    digest = open_artifact(art).digest

    def record(passed, unsettled, failed=None, allow_ungated=False):
        m = Manifest.read(art)
        m.eval = {"passed": passed, "unsettled": unsettled, "artifact_digest": digest,
                  "created": "2026-12-02T00:00:00Z"}
        if failed is not None:
            m.eval["failed"] = failed
        m.write(art)
        said = []
        check_gates(str(art), allow_ungated, said.append)
        return said

    assert record(True, []) == [f"qserve: {art}: gates passed 2026-12-02T00:00:00Z"]
    said = record(True, ["qserve_choice/acc"])
    assert len(said) == 1 and "warning" in said[0] and "qserve_choice/acc" in said[0] \
        and "do not settle" in said[0]
    gen, ppl = "qserve_generation/exact_match", "qserve_heldout/word_perplexity"
    # settled FAILs refuse: a failing gate outside the margin, whatever else is unsettled
    for unsettled, failed in (([], [gen]), ([ppl], [gen]), ([gen], [gen, ppl])):
        with pytest.raises(QserveError, match="its last gate report failed") as e:
            record(False, unsettled, failed)
        settled = [g for g in failed if g not in unsettled]
        assert f"({', '.join(settled)}, settled)" in str(e.value)
        assert "--allow-ungated" in str(e.value)
    # a record without the failed gates' names (older manifests): any FAIL refuses
    for unsettled in ([], [gen]):
        with pytest.raises(QserveError, match="its last gate report failed") as e:
            record(False, unsettled)
        assert all(u in str(e.value) for u in unsettled)
    # a FAIL within the noise on every failing gate: served, with a warning naming them
    said = record(False, [gen, ppl], [gen])
    assert len(said) == 1 and "warning" in said[0] and gen in said[0] \
        and "within the datasets' noise" in said[0] and "--suite full" in said[0]
    # --allow-ungated serves a settled FAIL with a warning
    said = record(False, [], [gen], allow_ungated=True)
    assert len(said) == 1 and "--allow-ungated" in said[0] and f"({gen}, settled)" in said[0]
