"""The shipped golden datasets: rebuilt byte for byte from their tables, digests recorded,
well formed, and large enough to say something."""

import json

from qserve.evals import golden_tasks as G
from qserve.evals.runner import check_golden
from qserve.evals.task_configs import TaskConfigError, load_task_config, task_names

import pytest


def _rows(name):
    return [json.loads(line) for line in (G.GOLDEN_DIR / name).read_text().splitlines()]


def test_files_are_what_the_builder_makes():
    for name, build in G.BUILDERS.items():
        assert (G.GOLDEN_DIR / name).read_text(encoding="utf-8") == G.render(build()), name


def test_digests_recorded_for_every_golden_file():
    recorded = check_golden()
    assert set(recorded) == {p.name for p in G.GOLDEN_DIR.glob("*.jsonl")}


def test_generation_rows():
    rows = _rows("generation.jsonl")
    assert len(rows) >= 3000 and len({r["id"] for r in rows}) == len(rows)
    assert len({r["prompt"] for r in rows}) == len(rows)
    for r in rows:
        assert r["answer"].strip() == r["answer"] and r["answer"]
        assert r["prompt"] and not r["prompt"].endswith(" ")
    # the few-shot examples never give the answer away (a copy item's question holds it)
    shots = [r for r in rows if "\n" in r["prompt"] and not r["category"].startswith("copy")]
    assert len(shots) > 1200
    assert not any(f": {r['answer']}\n" in r["prompt"] for r in shots)


def test_choice_rows():
    rows = _rows("choice.jsonl")
    assert len(rows) >= 900 and len({r["query"] for r in rows}) == len(rows)
    for r in rows:
        assert len(r["choices"]) == 4 and len(set(r["choices"])) == 4
        assert 0 <= r["gold"] < 4


def test_full_suite_items_are_new_and_of_the_generated_kinds():
    gen, gen_more = _rows("generation.jsonl"), _rows("generation_more.jsonl")
    assert len(gen_more) == sum(G.MORE_COUNTS.values())
    assert not {r["prompt"] for r in gen} & {r["prompt"] for r in gen_more}
    assert len({r["prompt"] for r in gen_more}) == len(gen_more)
    assert not {r["id"] for r in gen} & {r["id"] for r in gen_more}
    assert {r["category"] for r in gen_more} <= {r["category"] for r in gen}
    choice, choice_more = _rows("choice.jsonl"), _rows("choice_more.jsonl")
    assert len(choice_more) == G.CHOICE_MORE_NUMBER_SEQUENCES
    assert not {r["query"] for r in choice} & {r["query"] for r in choice_more}
    for r in choice_more:
        assert len(set(r["choices"])) == 4 and 0 <= r["gold"] < 4


def test_a_task_reads_a_list_of_files_as_one_dataset():
    cfg = load_task_config("qserve_choice_full")
    files = cfg["dataset_kwargs"]["data_files"]["test"]
    assert [f.rsplit("/", 1)[1] for f in files] == ["choice.jsonl", "choice_more.jsonl"]


def test_task_configs_resolve_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in task_names():
        if name == "qserve_agreement":
            with pytest.raises(TaskConfigError, match="needs a value for 'reference_outputs'"):
                load_task_config(name)
            ref = tmp_path / "ref.jsonl"
            ref.write_text('{"id": "a", "prompt": "x", "reference": "y"}\n')
            cfg = load_task_config(name, {"reference_outputs": str(ref)})
            assert callable(cfg["process_results"])
        else:
            cfg = load_task_config(name)
        if name == "qserve_heldout":
            assert callable(cfg["process_docs"])
        for paths in cfg["dataset_kwargs"]["data_files"].values():
            for path in paths if isinstance(paths, list) else [paths]:
                assert path.startswith("/")
    with pytest.raises(TaskConfigError, match="unknown eval task"):
        load_task_config("nope")


def test_agreement_metric():
    from qserve.evals.task_functions import agreement, common_prefix_fraction

    assert agreement({"reference": "abcd"}, ["abcd"]) == {"identical": 1.0, "prefix_match": 1.0}
    assert agreement({"reference": "abcd"}, ["abxx"]) == {"identical": 0.0, "prefix_match": 0.5}
    assert common_prefix_fraction("", "") == 1.0


def test_heldout_excerpts_cut_at_line_ends():
    from datasets import Dataset

    from qserve.evals.task_functions import HELDOUT_EVAL_CHARS, first_lines, heldout_excerpts

    assert first_lines("ab\ncd\nef", 5) == "ab" and first_lines("ab\ncd", 5) == "ab\ncd"
    assert first_lines("abcdefgh", 4) == "abcd"  # one long line: cut inside it
    long = "\n".join(f"line {i}" for i in range(5000))
    out = heldout_excerpts(Dataset.from_list([{"text": long}, {"text": "short"}]))
    assert out[1]["text"] == "short"
    cut = out[0]["text"]
    assert len(cut) <= HELDOUT_EVAL_CHARS and long.startswith(cut + "\n")
    assert len(cut) > HELDOUT_EVAL_CHARS - 20
