"""The `qserve` command line: help, models, generate, perplexity, and clean user errors."""

import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from qserve.runtime.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("cli") / "tiny")


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_help_lists_commands():
    out = run("--help").output
    for cmd in ("models", "env", "generate", "perplexity", "quantize", "eval", "serve"):
        assert f"  {cmd}" in out
    assert "static FP8 artifact" in run("quantize", "--help").output
    assert "OpenAI-compatible" in run("serve", "--help").output
    assert "eval gates" in run("eval", "--help").output


@pytest.mark.parametrize("args,message", [
    (["--kv-receive-cores", "0"], "is for a decode worker; this is --role both"),
    (["--role", "decode", "--kv-receive-cores", "2-1"], "is not a CPU list"),
    (["--role", "decode", "--kv-receive-cores", "0,x"], "is not a CPU list"),
    (["--role", "decode", "--kv-receive-cores", "1000000"], "not CPUs this machine lets"),
])
def test_serve_refuses_bad_kv_receive_cores_before_loading(tiny, args, message):
    r = run("serve", str(tiny), *args)
    assert r.exit_code != 0 and message in r.output
    assert "Traceback" not in r.output and "loaded in" not in r.output


def test_models_lists_builtins():
    out = run("models").output
    assert "smollm2-135m (default)" in out and "gemma3-270m" in out


def test_generate_from_hf_dir(tiny):
    r = run("generate", str(tiny), "--prompt", "The quick", "--max-tokens", "5", "--dtype", "fp32")
    assert r.exit_code == 0
    assert re.search(r"\[.*: \d+ prompt tokens, [1-5] generated; load", r.stderr)


def test_unknown_model_is_clean_error():
    r = run("generate", "no-such-model", "--prompt", "hi")
    assert r.exit_code == 2
    assert "not a built-in model" in r.output
    assert "Traceback" not in r.output


def test_quantize_then_generate_and_perplexity(tiny, tmp_path):
    out = tmp_path / "art"
    r = run("quantize", str(tiny), "--out", str(out), "--num-samples", "2", "--seq-len", "32",
            "--dtype", "fp32")
    assert r.exit_code == 0, r.output
    assert "quantized linears: 14" in r.output
    r = run("quantize", str(tiny), "--out", str(out), "--num-samples", "2", "--seq-len", "32")
    assert r.exit_code == 2 and "already exists" in r.output
    r = run("generate", str(out), "--prompt", "The quick", "--max-tokens", "3", "--dtype", "fp32")
    assert r.exit_code == 0, r.output
    r = run("perplexity", str(out), "--max-tokens", "64", "--window", "32", "--stride", "16")
    assert r.exit_code == 0, r.output
    assert "over 64 tokens" in r.output


@pytest.mark.parametrize("threshold,exit_code,passed", [(10.0, 0, True), (-0.5, 1, False)])
def test_quantize_gate_runs_the_gates_and_records_the_verdict(tiny, tmp_path, threshold,
                                                              exit_code, passed):
    """--gate: the eval gates run on the new artifact, their verdict lands in its manifest
    (what serve checks), and a FAIL exits 1 with the artifact kept. Tiny model, one task."""
    from qserve.runtime.formats.manifest import Manifest

    gates = tmp_path / "g.yaml"
    gates.write_text("tasks: [qserve_heldout]\nlimit: 2\ngates:\n  - {task: qserve_heldout, "
                     f"metric: word_perplexity, max_relative_increase: {threshold}}}\n")
    out = tmp_path / "art"
    r = run("quantize", str(tiny), "--out", str(out), "--num-samples", "2", "--seq-len", "32",
            "--dtype", "fp32", "--gate", "--gates", str(gates))
    assert r.exit_code == exit_code, r.output
    assert ("# qserve eval: PASS" if passed else "# qserve eval: FAIL") in r.output
    rec = Manifest.read(out).eval
    assert rec["passed"] is passed and rec["mode"] == "in-process"
    assert ("eval gates FAIL" in r.output) == (not passed)
    if not passed:  # what serve will do, said as the record decides it
        from qserve.evals.report import settled_failures

        assert rec["failed"] == ["qserve_heldout/word_perplexity"]
        refused = bool(settled_failures(rec["failed"], rec["unsettled"]))
        assert ("`qserve serve` refuses it" in r.output) == refused
        assert ("serves it with a warning" in r.output) == (not refused)


def test_quantize_gates_without_gate_is_refused_before_calibrating(tiny, tmp_path):
    r = run("quantize", str(tiny), "--out", str(tmp_path / "o"), "--gates", "g.yaml")
    assert r.exit_code != 0 and "add --gate" in r.output and not (tmp_path / "o").exists()
    r = run("quantize", str(tiny), "--out", str(tmp_path / "o"), "--gate", "--gates",
            str(tmp_path / "missing.yaml"))
    assert r.exit_code != 0 and "no such gates file" in r.output


def test_bad_recipe_is_clean_error(tiny, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("weights:\n  granularity: row\n")
    r = run("quantize", str(tiny), "--out", str(tmp_path / "o"), "--recipe", str(recipe))
    assert r.exit_code == 2
    assert "weights.granularity must be one of channel, tensor" in r.output


def test_serve_refuses_disable_by_batch_size_without_speculation(tiny):
    r = run("serve", str(tiny), "--allow-ungated", "--speculative-disable-by-batch-size", "2",
            "--dtype", "fp32")
    assert r.exit_code != 0
    assert "needs speculation" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("choice, message", [
    ("hidden_draft", "needs a trained head"),
    ("hidden_draft:/nowhere/head.safetensors", "cannot read the draft head"),
])
def test_serve_hidden_draft_without_a_head_is_a_clean_error(tiny, choice, message):
    r = run("serve", str(tiny), "--allow-ungated", "--speculative", choice, "--dtype", "fp32")
    assert r.exit_code != 0
    assert message in r.output and "Traceback" not in r.output


def test_serve_on_a_port_in_use_is_a_clean_error(tiny):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = run("serve", str(tiny), "--allow-ungated", "--dtype", "fp32", "--threads", "1",
                "--port", str(port), "--log-level", "error")
    assert r.exit_code == 2
    assert f"did not start on 127.0.0.1:{port}" in r.output and "Pick another with --port" in r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("option, value", [("--max-tokens-default", "0"),
                                           ("--shutdown-drain-s", "-1")])
def test_serve_refuses_bad_limits_before_loading(option, value):
    r = run("serve", "no-such-model", option, value)
    assert r.exit_code == 2
    assert option in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("flag, want", [([], True), (["--no-batch-invariant"], False)])
def test_serve_gives_the_engine_its_batch_invariance(tiny, monkeypatch, flag, want):
    from qserve.runtime.engine import LLMEngine

    seen = []

    def spy(cls, lm, config=None):
        seen.append(config.batch_invariant)
        raise SystemExit(3)  # stop before serving

    monkeypatch.setattr(LLMEngine, "from_model", classmethod(spy))
    r = CliRunner().invoke(main, ["serve", str(tiny), "--allow-ungated", "--dtype", "fp32",
                                  "--threads", "1", *flag])
    assert r.exit_code == 3 and seen == [want]


@pytest.mark.parametrize("extra, builtin", [([], True), (["--recipe", "RECIPE"], False)])
def test_quantize_of_a_builtin_name_takes_its_builtin_recipe(monkeypatch, tmp_path, extra,
                                                             builtin):
    """`qserve quantize smollm2-135m` makes what `qserve serve smollm2-135m` would (its
    built-in recipe), unless --recipe names another."""
    import qserve.quantize.pipeline as pipeline
    from qserve.quantize.builtin_artifact import builtin_recipe
    from qserve.quantize.recipe import Recipe

    seen = []

    def spy(source, out_dir, recipe, *a, **k):
        seen.append(recipe)
        raise SystemExit(3)  # stop before any work

    monkeypatch.setattr(pipeline, "quantize", spy)
    (tmp_path / "r.yaml").write_text("calibration: {num_samples: 2}\n")
    extra = [str(tmp_path / "r.yaml") if a == "RECIPE" else a for a in extra]
    r = CliRunner().invoke(main, ["quantize", "smollm2-135m", "--out", str(tmp_path / "o"),
                                  *extra])
    assert r.exit_code == 3
    assert builtin_recipe("smollm2-135m") != Recipe()
    assert (seen[0] == builtin_recipe("smollm2-135m")) == builtin
    assert ("built-in recipe" in r.output) == builtin


def test_serve_answers_only_after_the_grammar_tables_are_built(tiny, monkeypatch):
    """The grammar tables are built beside the engine's warm-up and finished before the
    server is made: built after it, they held the cores while the first clients ran."""
    import time as clock

    from qserve.runtime import async_engine
    from qserve.runtime.structured.compiler import GrammarCompiler

    done = []

    def slow_warm_up(self):
        clock.sleep(0.5)
        done.append("grammar")

    def stop(engine, start_thread=False):
        done.append("server")
        raise SystemExit(3)  # stop before serving

    monkeypatch.setattr(GrammarCompiler, "warm_up", slow_warm_up)
    monkeypatch.setattr(async_engine, "AsyncEngine", stop)
    r = CliRunner().invoke(main, ["serve", str(tiny), "--allow-ungated", "--dtype", "fp32",
                                  "--threads", "1"])
    assert r.exit_code == 3 and done == ["grammar", "server"]


def test_serve_refuses_no_speculative_adaptive_without_speculation(tiny):
    r = run("serve", str(tiny), "--allow-ungated", "--no-speculative-adaptive", "--dtype", "fp32")
    assert r.exit_code != 0
    assert "--no-speculative-adaptive needs speculation" in r.output and "Traceback" not in r.output
