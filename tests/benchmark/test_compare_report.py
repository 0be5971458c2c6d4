"""The comparison page: KV budget arithmetic, py-spy summaries, per-model sections."""

import datetime

import pytest

from qserve.runtime.benchmark.client import RequestResult
from qserve.runtime.benchmark.compare_llamacpp import CASES
from qserve.runtime.benchmark.compare_report import CaseResult, kv_budget_rows, write_markdown
from qserve.runtime.benchmark.metrics import compute_metrics
from qserve.runtime.benchmark.profiler import summarize

SMOLLM2_SHAPE = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                 "hidden_size": 576}


def test_kv_budget_rows_for_smollm2_shape():
    # 2 (K, V) x 30 layers x 3 kv heads x 64 dims = 11,520 elements per token;
    # 1 GiB / (16-token blocks of 11,520 bytes) = 5,825 blocks = 93,200 tokens
    assert kv_budget_rows(SMOLLM2_SHAPE) == [("fp8", 11520, 93200, 45),
                                             ("bf16", 23040, 46592, 22)]


def test_pyspy_summary_shares():
    raw = ("python;main (a/cli.py:3);step (runtime/engine.py:10);forward (torch/nn.py:5) 6\n"
           "python;main (a/cli.py:3);step (runtime/engine.py:12) 2\n"
           "python;main (a/cli.py:3);poll (x/loop.py:7) 2\n")
    spots, total = summarize(raw, top=2)
    assert total == 10
    assert [(s.function, s.self_share, s.inclusive_share) for s in spots] == [
        ("forward (torch/nn.py)", 0.6, 0.6), ("step (runtime/engine.py)", 0.2, 0.8)]


def _metrics(scale):
    results = [RequestResult(True, 10, 3, 3, ttft=0.1 * scale, e2el=0.5 * scale,
                             itl=[0.2 * scale, 0.2 * scale]) for _ in range(2)]
    return compute_metrics(results, 1.0 * scale)


def _write(path, model, scale):
    res = {server: {c.key: CaseResult(c.title, _metrics(s)) for c in CASES}
           for server, s in (("llama.cpp", 1.0), ("qserve", scale))}
    write_markdown(path, model, date=datetime.datetime(2026, 1, 2, 3, 4), threads=2,
                   llama_version="0.0.0", cmake_flags=["-DX=ON"], llama_cmd=["llama-server"],
                   qserve_cmd=["serve", model], results=res,
                   kv_rows=kv_budget_rows(SMOLLM2_SHAPE), spots=None)


def test_sections_per_model_are_replaced_in_place(tmp_path):
    page = tmp_path / "bench.md"
    _write(page, "model-a", 2.0)
    _write(page, "model-b", 4.0)
    text = page.read_text()
    assert text.startswith("# qserve and llama.cpp's server")
    assert text.index("## model-a, built-in recipe, 2 threads") < text.index("## model-b, built-in recipe, 2 threads")
    # qserve twice as slow: output tok/s ratio 0.50x, latency ratio 2.00x
    a = text[text.index("## model-a, built-in recipe, 2 threads"):text.index("## model-b, built-in recipe, 2 threads")]
    assert "| aggregate output tok/s (higher is better) | 6.0 | 3.0 | 0.50x |" in a
    assert "| TPOT p50 ms | 200.0 | 400.0 | 2.00x |" in a
    _write(page, "model-a", 1.0)
    again = page.read_text()
    assert again.count("## model-a, built-in recipe, 2 threads") == 1 and again.count("## model-b, built-in recipe, 2 threads") == 1
    assert "| TPOT p50 ms | 200.0 | 200.0 | 1.00x |" in again


def _page_with_variant(tmp_path, label: str, case_key: str, scale: float) -> str:
    """The page of a run where both servers measured 1.0 on every case and the qserve
    variant `label` measured `scale` on `case_key`."""
    case = next(c for c in CASES if c.key == case_key)
    res = {server: {c.key: CaseResult(c.title, _metrics(1.0)) for c in CASES}
           for server in ("llama.cpp", "qserve")}
    res[label] = {case_key: CaseResult(case.title, _metrics(scale))}
    page = tmp_path / "bench.md"
    write_markdown(page, "m", date=datetime.datetime(2026, 1, 2, 3, 4), threads=1,
                   llama_version="0.0.0", cmake_flags=[], llama_cmd=["llama-server"],
                   qserve_cmd=["serve", "m"], results=res,
                   kv_rows=kv_budget_rows(SMOLLM2_SHAPE), spots=None)
    return page.read_text()


def test_prefix_reuse_line_from_the_no_caching_run(tmp_path):
    from qserve.runtime.benchmark.compare_report import NO_REUSE_LABEL

    text = _page_with_variant(tmp_path, NO_REUSE_LABEL, "shared", 6.0)
    assert "TTFT p50 600.0 ms with `--no-enable-prefix-caching`, 100.0 ms with it on: 6.00x" in text


def test_prefill_cap_line_from_the_capped_run(tmp_path):
    from qserve.runtime.benchmark.compare_report import PREFILL_CAP, PREFILL_CAP_LABEL

    text = _page_with_variant(tmp_path, PREFILL_CAP_LABEL, "mixed", 2.0)
    assert PREFILL_CAP_LABEL == f"qserve-prefill-cap-{PREFILL_CAP}"
    assert (f"with `--max-prefill-tokens-with-decodes {PREFILL_CAP}` (at most {PREFILL_CAP} "
            "prompt tokens in a step that also decodes): ITL p50 400.0 ms, p99 400.0 ms, "
            "p99 / p50 1.00 (without it 1.00); output 3.0 tok/s (without it 6.0).") in text


def test_add_variants_needs_an_existing_report_folder(tmp_path):
    from qserve.runtime.benchmark.compare_llamacpp import main

    with pytest.raises(SystemExit, match="is not a folder of bench reports"):
        main(["--add-variants", str(tmp_path / "missing")])


def test_out_must_be_a_file_and_is_checked_before_any_server_runs(tmp_path):
    from qserve.runtime.benchmark.compare_llamacpp import main

    with pytest.raises(SystemExit, match="is a folder; give the markdown file"):
        main(["--out", str(tmp_path)])


def test_speculation_line_from_the_ngram_run(tmp_path):
    from qserve.runtime.benchmark.compare_report import SPEC_ARGS, SPEC_LABEL

    text = _page_with_variant(tmp_path, SPEC_LABEL, "stream1", 0.5)  # half the TPOT
    assert (f"with n-gram speculation (`{' '.join(SPEC_ARGS)}`): decode 10.0 tok/s (1000 / "
            "TPOT p50), 2.00x llama.cpp's (without speculation 1.00x).") in text


def test_hidden_draft_line_from_the_draft_artifact_run(tmp_path):
    from qserve.runtime.benchmark.compare_report import HIDDEN_SPEC_ARGS, HIDDEN_SPEC_LABEL

    text = _page_with_variant(tmp_path, HIDDEN_SPEC_LABEL, "stream1", 0.8)
    assert (f"`--draft hidden_draft` (`{' '.join(HIDDEN_SPEC_ARGS)}`): decode 6.2 tok/s (1000 / "
            "TPOT p50), 1.25x llama.cpp's, 1.25x qserve without speculation.") in text
    assert ("--threads 1 --no-profile --draft-artifact ART` (ART: `qserve quantize m --out ART --draft "
            "hidden_draft[:N]`; its manifest records how the head was trained).") in text
    assert "one-stream prompts are random windows of held-out text" in text  # the caveat on their drafting


def test_no_random_prompt_caveat_without_a_speculative_run(tmp_path):
    from qserve.runtime.benchmark.compare_report import PREFILL_CAP_LABEL

    text = _page_with_variant(tmp_path, PREFILL_CAP_LABEL, "mixed", 0.8)
    assert "one-stream prompts are random windows" not in text


def test_draft_artifact_must_be_an_artifact(tmp_path):
    from qserve.runtime.benchmark.compare_llamacpp import main

    with pytest.raises(SystemExit, match="not an artifact folder"):
        main(["--draft-artifact", str(tmp_path)])


def test_cases_option_takes_known_workloads_only(tmp_path):
    from qserve.runtime.benchmark.compare_llamacpp import case_keys, main

    assert case_keys("stream1, streams16") == ("stream1", "streams16")
    assert case_keys(None) is None
    with pytest.raises(SystemExit, match="unknown case nope; choose from streams16, stream1"):
        main(["--cases", "stream1,nope", "--from-reports", str(tmp_path)])


def test_one_section_per_cpu_with_only_the_measured_cases(tmp_path):
    page = tmp_path / "bench.md"
    _write(page, "m", 1.0)  # no CPU recorded: the section of earlier pages
    only = {server: {"stream1": CaseResult(CASES[1].title, _metrics(s))}
            for server, s in (("llama.cpp", 1.0), ("qserve", 0.5))}
    for _ in range(2):  # the second write replaces the CPU's section
        write_markdown(page, "m", date=datetime.datetime(2026, 1, 2, 3, 4), threads=2,
                       cpu="Some CPU, 2 cores, AVX-512 (BF16), no AMX", cases="stream1",
                       llama_version="0.0.0",
                       cmake_flags=[], llama_cmd=["llama-server"], qserve_cmd=["serve", "m"],
                       results=only, kv_rows=kv_budget_rows(SMOLLM2_SHAPE), spots=None)
    text = page.read_text()
    assert text.count("## m, built-in recipe, 2 threads\n") == 1
    assert text.count("## m, built-in recipe, 2 threads, Some CPU, 2 cores, AVX-512 (BF16), no AMX\n") == 1
    cpu_section = text[text.index("## m, built-in recipe, 2 threads, Some CPU"):]
    assert ("| 1 stream (random, 128 in / 128 out, 6 requests) | decode tok/s = 1000 / TPOT "
            "p50 (higher is better) | 5.0 | 10.0 | 2.00x |") in cpu_section
    assert "16 concurrent streams" not in cpu_section and "no reuse possible" not in cpu_section
    assert "compare_llamacpp --model m --threads 2 --cases stream1`" in cpu_section
    # the 16-stream case without a profile: the command that reproduces it says so
    assert "compare_llamacpp --model m --threads 2 --no-profile`" in text


def test_rounds_show_medians_and_the_median_of_the_per_round_ratios(tmp_path):
    """Three alternating rounds: qserve 2x, 4x and 8x slower than llama.cpp, whose own
    speed drifts (1, 2, 1): values are per-server medians, the ratio the median of the
    rounds' ratios, each round's ratio listed."""
    def res(ref, ours):
        return {server: {c.key: CaseResult(c.title, _metrics(s)) for c in CASES}
                for server, s in (("llama.cpp", ref), ("qserve", ours))}

    rounds = [res(1.0, 2.0), res(2.0, 8.0), res(1.0, 8.0)]
    page = tmp_path / "bench.md"
    write_markdown(page, "m", date=datetime.datetime(2026, 1, 2, 3, 4), threads=2,
                   llama_version="0.0.0", cmake_flags=[], llama_cmd=["llama-server"],
                   qserve_cmd=["serve", "m"], results=rounds[0],
                   kv_rows=kv_budget_rows(SMOLLM2_SHAPE), spots=None, rounds=rounds)
    text = page.read_text()
    assert "--rounds 3" in text and "3 rounds, the servers alternating" in text
    # TPOT p50: llama.cpp 200, 400, 200 ms (median 200); qserve 400, 1600, 1600 (1600);
    # ratios 2, 4, 8 (median 4)
    assert "| TPOT p50 ms | 200.0 | 1,600.0 | 4.00x | 2.00, 4.00, 8.00 |" in text


def test_report_names_per_round():
    from qserve.runtime.benchmark.compare_llamacpp import report_name, round_suffix

    assert report_name("qserve", "stream1") == "qserve-stream1.json"  # round 1: plain names
    assert report_name("qserve", "stream1", 3) == "qserve-stream1.r3.json"
    assert round_suffix(1) == "" and round_suffix(2) == ".r2"


def test_rounds_below_one_are_refused_before_anything_runs(tmp_path):
    from qserve.runtime.benchmark.compare_llamacpp import main

    with pytest.raises(SystemExit, match="--rounds 0: give 1 or more"):
        main(["--rounds", "0", "--from-reports", str(tmp_path)])


def test_a_default_recipe_run_has_its_own_section_and_says_what_was_served(tmp_path):
    page = tmp_path / "bench.md"
    only = {server: {"stream1": CaseResult(CASES[1].title, _metrics(s))}
            for server, s in (("llama.cpp", 1.0), ("qserve", 0.5))}
    for recipe, served in (("builtin", ["serve", "m"]), ("default", ["serve", "ARTIFACT"])):
        write_markdown(page, "m", date=datetime.datetime(2026, 1, 2, 3, 4), threads=2,
                       cpu="Some CPU", cases="stream1", llama_version="0.0.0", recipe=recipe,
                       cmake_flags=[], llama_cmd=["llama-server"], qserve_cmd=served,
                       results=only, kv_rows=kv_budget_rows(SMOLLM2_SHAPE), spots=None)
    text = page.read_text()
    builtin = text[text.index("## m, built-in recipe"):text.index("## m, default recipe")]
    default = text[text.index("## m, default recipe (all FP8), 2 threads, Some CPU\n"):]
    assert "with its built-in recipe" in builtin and "--recipe" not in builtin
    assert "compare_llamacpp --model m --threads 2 --recipe default --cases stream1`" in default
    assert "`qserve serve ARTIFACT`" in default and "all FP8 (W8A8 static, FP8 KV cache)" in default


def test_served_artifact_is_the_model_for_builtin_and_names_a_bad_recipe(tmp_path, monkeypatch):
    from qserve.runtime.benchmark import compare_llamacpp as cl

    monkeypatch.setenv("QSERVE_CACHE", str(tmp_path))
    assert cl.served_artifact("m", "builtin") == "m"  # the built-in artifact: serve the model
    bad = tmp_path / "r.yaml"
    bad.write_text("weights: {granularty: channel}\n")
    with pytest.raises(cl.BenchmarkError, match="--recipe .*granularty"):
        cl.served_artifact("m", str(bad))
