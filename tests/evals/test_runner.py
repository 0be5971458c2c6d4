"""evals/runner.run_tasks around lm-eval: what a run does besides scoring."""

import subprocess

from lm_eval.api.model import LM

from qserve.evals import runner


class _ConstantLM(LM):
    """Every continuation at log-likelihood -1, not greedy: enough for lm-eval to run a
    task, at no model's cost."""

    def loglikelihood(self, requests):
        return [(-1.0, False) for _ in requests]

    def loglikelihood_rolling(self, requests):
        return [-1.0 for _ in requests]

    def generate_until(self, requests):
        return ["" for _ in requests]


def test_an_eval_runs_no_git_in_the_current_directory(tmp_path, monkeypatch):
    """lm-eval records the commit of the directory it runs in (`git describe`), which
    prints `fatal: not a git repository` into a passing eval's output outside a repository
    and names an unrelated one inside: run_tasks keeps it from asking, and only while it
    runs."""
    import lm_eval.evaluator as evaluator

    real_commit = evaluator.get_git_commit_hash
    calls, real_check_output = [], subprocess.check_output

    def check_output(cmd, *a, **k):
        calls.append(cmd)
        return real_check_output(cmd, *a, **k)

    monkeypatch.setattr(subprocess, "check_output", check_output)
    monkeypatch.chdir(tmp_path)
    values = runner.run_tasks(_ConstantLM(), None, runner._task_configs(["qserve_choice"], {}),
                              2)
    assert set(values["qserve_choice"]["acc"]) == {0, 1}  # the task ran, on 2 documents
    assert not [c for c in calls if "git" in str(c)], calls
    assert evaluator.get_git_commit_hash is real_commit
