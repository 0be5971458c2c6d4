"""The bf16 reference's results shipped with the package (evals/reference_values.py): each
shipped file answers for today's datasets, tasks and engine version, holds what the
reference computes here, and a cold eval of a built-in model reads it instead of loading
the reference."""

import json

import pytest

from qserve.evals import reference_values as rv
from qserve.evals import runner
from qserve.evals.gates import SUITES, GateSuite, load_gates
from qserve.evals.runner import check_golden

REGENERATE = "python -m qserve.evals.reference_values {spec} --suite {suite} --write"


def _shipped() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(rv.SHIPPED_DIR.glob("values-*.json"))]


def _suite_name(tasks: list[str], limit) -> str | None:
    for name, path in SUITES.items():
        s = load_gates(path)
        if list(s.tasks) == tasks and s.limit == limit:
            return name
    return None


def test_the_default_model_ships_its_default_suite():
    default = load_gates(SUITES["default"])
    assert any(f["reference"]["spec"] == "smollm2-135m"
               and f["suite"] == {"tasks": list(default.tasks), "limit": default.limit}
               for f in _shipped())


@pytest.mark.parametrize("f", _shipped(), ids=lambda f: f"{f['reference']['spec']}-"
                         f"{_suite_name(f['suite']['tasks'], f['suite']['limit'])}")
def test_each_shipped_file_answers_for_todays_datasets_tasks_and_engine(f):
    """A dataset, task config or ADAPTER_VERSION changed without recording again leaves
    the file unused by every eval: fail here and name the command."""
    suite = _suite_name(f["suite"]["tasks"], f["suite"]["limit"])
    assert suite is not None, f"{f['suite']} is no package suite; delete the file"
    ref = f["reference"]
    datasets = check_golden()
    outputs = runner.reference_outputs_file(ref["digest"], shipped=True)
    assert outputs.is_file(), f"{outputs.name} missing: {REGENERATE.format(spec=ref['spec'], suite=suite)}"
    datasets[f"reference/{outputs.name}"] = runner.file_digest(outputs)
    key = rv.shipped_key(ref["digest"], load_gates(SUITES[suite]), datasets)
    assert key == f["key"], ("shipped reference results are stale (datasets, tasks or "
                             "ADAPTER_VERSION changed): " + REGENERATE.format(spec=ref["spec"],
                                                                             suite=suite))
    assert rv.shipped_path(ref["digest"], key).is_file()
    n = {t: len(docs) for t, ms in f["values"].items() for docs in ms.values()}
    assert set(n) == set(f["suite"]["tasks"]) and min(n.values()) > 0


def _suite(tmp_path) -> GateSuite:
    p = tmp_path / "g.yaml"
    p.write_text("tasks: [qserve_choice]\ngates:\n  - {task: qserve_choice, metric: acc, "
                 "min_recovery: 0.9}\n")
    return load_gates(p)


def test_lookup_order_shipped_then_cache_then_none(tmp_path, monkeypatch):
    monkeypatch.setattr(rv, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setenv("QSERVE_CACHE", str(tmp_path / "cache"))
    suite, digest, datasets = _suite(tmp_path), "ab" * 32, {"choice.jsonl": "00"}
    assert rv.lookup(digest, suite, datasets) is None
    cached = rv.write_cache({"qserve_choice": {"acc": {0: 1.0, 1: 0.0}}}, digest, suite, datasets)
    assert cached.source == "computed"
    got = rv.lookup(digest, suite, datasets)
    assert got.source == "cached" and got.values == {"qserve_choice": {"acc": {0: 1.0, 1: 0.0}}}
    path = rv.write_shipped({"qserve_choice": {"acc": {0: 0.0, 1: 1.0}, "x": {0: (1.5, 2)}}},
                            {"spec": "m", "digest": digest}, suite, datasets, 1.0)
    got = rv.lookup(digest, suite, datasets)
    assert got.source == "shipped" and got.path == path and got.recorded["cpu_class"]
    assert got.values["qserve_choice"]["x"] == {0: (1.5, 2)}
    assert rv.lookup(digest, suite, datasets, recompute=True).source == "cached"
    # another dataset, another key: the shipped file answers for nothing else
    assert rv.lookup(digest, suite, {"choice.jsonl": "01"}) is None
    # a file under the right name whose key is not the name's
    raw = json.loads(path.read_text())
    raw["key"] = "0" * 24
    path.write_text(json.dumps(raw))
    with pytest.raises(rv.ReferenceValuesError, match="--recompute-reference"):
        rv.lookup(digest, suite, datasets)
    path.write_text("{not json")  # a damaged install
    with pytest.raises(rv.ReferenceValuesError, match="unreadable.*--recompute-reference"):
        rv.lookup(digest, suite, datasets)
    assert rv.lookup(digest, suite, datasets, recompute=True).source == "cached"


@pytest.mark.real_model
def test_shipped_values_are_what_the_reference_computes_here(smollm2_dir):
    """The default model's shipped results against its bf16 reference run here on the
    first documents of each task: the same answers on most (numerics of another CPU class
    may flip a near tie) and log-likelihoods within 1%. On another CPU class than the one
    that recorded them, bf16 products are summed in another order (AVX2 has no bf16
    instructions and sums in fp32; oneDNN blocks AVX512-BF16's vdpbf16ps and AMX's tiles
    differently), and 48-token greedy continuations part at near ties more often than
    that: the agreement task, which compares them with the continuations the recording
    class generated, is then not compared; the other tasks still are."""
    from qserve.evals.lm_adapter import QserveLM
    from qserve.kernels.cpu_class import cpu_class, cpu_flags

    default = load_gates(SUITES["default"])
    f = next(f for f in _shipped() if f["reference"]["spec"] == "smollm2-135m"
             and f["suite"]["tasks"] == list(default.tasks) and f["suite"]["limit"] is None)
    outputs = runner.reference_outputs_file(f["reference"]["digest"], shipped=True)
    configs = runner._task_configs(list(default.tasks), {"reference_outputs": str(outputs)})
    here = runner.run_tasks(QserveLM(model="smollm2-135m"), None, configs, 4)
    shipped = rv.from_json(f["values"])
    same_numerics = f["recorded"]["cpu_class"] == cpu_class(cpu_flags())
    for task, metrics in here.items():
        if task == "qserve_agreement" and not same_numerics:
            continue
        for metric, docs in metrics.items():
            assert docs, (task, metric)
            for d, v in docs.items():
                s = shipped[task][metric][d]
                if isinstance(v, tuple):  # (log-likelihood, words or bytes)
                    assert s[1] == v[1] and abs(s[0] - v[0]) <= 0.01 * abs(v[0]), (task, d)
                elif metric in ("exact_match", "acc", "acc_norm", "identical"):
                    continue  # counted below
                else:
                    assert abs(s - v) <= 0.05 * max(abs(v), 1e-9), (task, metric, d, s, v)
            if metric in ("exact_match", "acc", "acc_norm", "identical"):
                same = sum(shipped[task][metric][d] == v for d, v in docs.items())
                assert same >= len(docs) - 1, (task, metric, same, len(docs))


@pytest.mark.real_model
def test_a_cold_eval_of_the_default_model_reads_the_shipped_results(smollm2_fp8, tmp_path,
                                                                       monkeypatch):
    """The default suite on an artifact of the default model with an empty cache: the
    reference is never loaded, its results come from the package. The artifact's side is
    stubbed with the reference's own results (every gate at recovery 1), which the real
    candidate runs elsewhere (test_eval_gates.py)."""
    monkeypatch.setenv("QSERVE_CACHE", str(tmp_path / "cache"))
    loaded = []

    class Stub:
        def __init__(self, model, device):
            assert device == "auto"  # run_eval's default, handed to every model it loads
            loaded.append(model)

    monkeypatch.setattr("qserve.evals.lm_adapter.QserveLM", Stub)
    default = load_gates(SUITES["default"])
    f = next(f for f in _shipped() if f["reference"]["spec"] == "smollm2-135m"
             and f["suite"]["tasks"] == list(default.tasks) and f["suite"]["limit"] is None)
    monkeypatch.setattr(runner, "run_tasks",
                        lambda model, args, configs, limit: rv.from_json(f["values"]))
    report = runner.run_eval(str(smollm2_fp8), default)
    assert loaded == [str(smollm2_fp8)]  # the artifact only
    assert report.reference["results"] == "shipped" and report.passed
    assert all(r.statistic in (0.0, 1.0) for r in report.results if r.statistic is not None)


def test_agreement_outputs_from_the_package_unless_recomputed(tmp_path, monkeypatch):
    monkeypatch.setattr(rv, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setenv("QSERVE_CACHE", str(tmp_path / "cache"))
    digest = "cd" * 32
    cache = runner.reference_outputs_file(digest)
    assert cache.parent == tmp_path / "cache" / "evals"  # nothing shipped: the cache
    package = runner.reference_outputs_file(digest, shipped=True)
    assert package.parent == rv.SHIPPED_DIR and package.name == cache.name
    package.parent.mkdir(parents=True)
    package.write_text("{}\n")
    assert runner.reference_outputs_file(digest) == package
    assert runner.reference_outputs_file(digest, shipped=False) == cache  # --recompute-reference
    assert runner.reference_outputs_file(digest, "ef" * 32) != package  # extra prompts: cache
