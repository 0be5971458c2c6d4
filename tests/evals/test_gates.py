"""Gate definitions (validation) and verdicts (statistics by hand)."""

import math

import pytest

from qserve.evals.gates import (Gate, GateError, aggregate, evaluate_gate, jackknife_stderr,
                                load_gates)


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
