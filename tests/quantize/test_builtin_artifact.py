"""Where a built-in model's FP8 artifact lives, and when the cached one is used."""

import pytest

from qserve.quantize.builtin_artifact import artifact_path, cached_builtin_artifact
from qserve.runtime.formats.manifest import MANIFEST_FILE


def test_cached_artifact_is_used_only_when_it_exists(tmp_path, monkeypatch):
    monkeypatch.setenv("QSERVE_CACHE", str(tmp_path))
    path = artifact_path("smollm2-135m")
    assert path == tmp_path / "artifacts" / "smollm2-135m"
    assert cached_builtin_artifact("smollm2-135m") == "smollm2-135m"  # none made yet
    path.mkdir(parents=True)
    (path / MANIFEST_FILE).write_text("{}")
    assert cached_builtin_artifact("smollm2-135m") == str(path)
    assert cached_builtin_artifact("/some/checkpoint") == "/some/checkpoint"  # not built-in


def test_an_artifact_in_the_older_folder_is_found_and_moved_not_made_again(tmp_path,
                                                                           monkeypatch):
    """A cache an older qserve filled (artifacts/NAME-fp8): found as it is, and moved to
    artifacts/NAME by the first use that takes the model's lock; nothing is quantized."""
    import json

    from qserve.quantize import builtin_artifact as ba
    from qserve.runtime.formats.manifest import Manifest

    monkeypatch.setenv("QSERVE_CACHE", str(tmp_path))
    old = tmp_path / "artifacts" / "smollm2-135m-fp8"
    old.mkdir(parents=True)
    recipe = ba.builtin_recipe("smollm2-135m")
    Manifest(source={"spec": "smollm2-135m"}, recipe=json.loads(json.dumps(recipe.to_dict())),
             calibration={}).write(old)
    assert cached_builtin_artifact("smollm2-135m") == str(old)
    monkeypatch.setattr(ba, "quantize", lambda *a, **k: pytest.fail("quantized again"))
    monkeypatch.setattr(ba, "tokenizer_is_current", lambda path, spec: True)
    said = []
    new = tmp_path / "artifacts" / "smollm2-135m"
    assert ba.builtin_artifact("smollm2-135m", said.append) == str(new)
    assert not old.exists() and (new / MANIFEST_FILE).is_file()
    assert any("moved the cached artifact" in s for s in said)
    assert cached_builtin_artifact("smollm2-135m") == str(new)


def test_a_builtin_recipe_file_is_used_and_a_changed_one_requantizes(tmp_path, monkeypatch):
    """builtin_recipe: quantize/recipes/NAME.yaml where there is one, else the default; a
    cached artifact made with another recipe is quantized again (quantize faked here)."""
    import json

    from qserve.quantize import builtin_artifact as ba
    from qserve.quantize.recipe import Recipe, load_recipe
    from qserve.runtime.formats.manifest import Manifest

    monkeypatch.setenv("QSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ba, "RECIPES_DIR", tmp_path / "recipes")
    (tmp_path / "recipes").mkdir()
    assert ba.builtin_recipe("smollm2-135m") == Recipe()
    (tmp_path / "recipes" / "smollm2-135m.yaml").write_text("weight_only: [\"re:.*\"]\n")
    recipe = ba.builtin_recipe("smollm2-135m")
    assert recipe == load_recipe(tmp_path / "recipes" / "smollm2-135m.yaml")
    assert recipe.weight_only == ("re:.*",)

    made = []

    def fake_quantize(spec, path, r, force, progress):
        made.append(r)
        path.mkdir(parents=True, exist_ok=True)
        m = Manifest(source={"spec": spec}, recipe=json.loads(json.dumps(r.to_dict())),
                     calibration={})
        m.write(path)

        class Report:
            pass
        return Report()

    monkeypatch.setattr(ba, "quantize", fake_quantize)
    monkeypatch.setattr(ba, "format_report", lambda report: "weights: x\nartifact: y")
    current = [True]  # what tokenizer_is_current says (tested below)
    monkeypatch.setattr(ba, "tokenizer_is_current", lambda path, spec: current[0])
    said = []
    path = ba.builtin_artifact("smollm2-135m", said.append)
    assert made == [recipe] and "no quantized artifact" in said[0]
    assert ba.builtin_artifact("smollm2-135m", said.append) == path and len(made) == 1
    (tmp_path / "recipes" / "smollm2-135m.yaml").write_text("kv_cache: {enabled: false}\n")
    ba.builtin_artifact("smollm2-135m", said.append)
    assert len(made) == 2 and not made[1].kv_cache.enabled
    assert any("recipe of smollm2-135m changed" in s for s in said)
    current[0] = False  # the source's tokenizer as converted today differs
    ba.builtin_artifact("smollm2-135m", said.append)
    assert len(made) == 3 and any("tokenizer of smollm2-135m changed" in s for s in said)


def test_tokenizer_is_current_compares_the_tokenizer_files(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from qserve.quantize import builtin_artifact as ba

    source, art = tmp_path / "source", tmp_path / "artifact"
    for d in (source, art):
        d.mkdir()
        (d / "tokenizer.json").write_text('{"normalizer": null}')
        (d / "tokenizer_config.json").write_text("{}")
    monkeypatch.setattr(ba, "resolve_source",
                        lambda spec: SimpleNamespace(checkpoint_dir=str(source)))
    assert ba.tokenizer_is_current(art, "smollm2-135m")
    (source / "tokenizer.json").write_text('{"normalizer": {"type": "NFC"}}')
    assert not ba.tokenizer_is_current(art, "smollm2-135m")
    (art / "tokenizer.json").write_text('{"normalizer": {"type": "NFC"}}')
    assert ba.tokenizer_is_current(art, "smollm2-135m")
    (source / "chat_template.jinja").write_text("{{ messages }}")  # a file only one side has
    assert not ba.tokenizer_is_current(art, "smollm2-135m")


def test_smollm2s_builtin_recipe_is_int8_weight_only_with_bf16_kv_and_head():
    """quantize/recipes/smollm2-135m.yaml: every linear of the 30 layers and the LM head
    int8 weight-only (GPTQ, per channel), no FP8 KV cache, under the KL budget that stands
    for the default gates (docs/quality.md)."""
    from qserve.quantize.builtin_artifact import builtin_recipe

    r = builtin_recipe("smollm2-135m")
    assert (r.weights.type, r.weights.granularity, r.weights.algorithm) == \
        ("int8", "channel", "gptq")
    for i in range(30):
        for proj in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
            name = f"model.layers.{i}.{proj}"
            assert not r.is_ignored(name) and r.is_weight_only(name), name
    assert r.is_weight_only("lm_head") and not r.kv_cache.enabled
    assert r.budget.enabled and (r.budget.kl, r.budget.ppl) == (0.004, 0.0)


def test_qwens_builtin_recipe_is_fp8_linears_with_an_int8_head_and_bf16_kv():
    """quantize/recipes/qwen2.5-coder-0.5b.yaml: the decoder linears FP8 W8A8 as the
    default recipe has them, the LM head int8 weight-only per row, no FP8 KV cache."""
    from qserve.quantize.builtin_artifact import builtin_recipe
    from qserve.quantize.recipe import Recipe

    r, default = builtin_recipe("qwen2.5-coder-0.5b", "avx2"), Recipe()
    assert (r.weights, r.activations) == (default.weights, default.activations)
    assert r.weights.type == "fp8"
    for i in range(24):
        for proj in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
            name = f"model.layers.{i}.{proj}"
            assert not r.is_ignored(name) and not r.is_weight_only(name), name
    assert r.lm_head == "int8" and r.is_weight_only("lm_head")
    assert not r.kv_cache.enabled and default.kv_cache.enabled


@pytest.mark.parametrize("klass", ["amx", "avx2", "avx512", "portable"])
def test_qwens_builtin_recipe_is_the_fp8_file_on_classes_not_measured_otherwise(klass):
    from qserve.quantize.builtin_artifact import RECIPES_DIR, builtin_recipe_path

    assert builtin_recipe_path("qwen2.5-coder-0.5b", klass) == \
        RECIPES_DIR / "qwen2.5-coder-0.5b.yaml"


def test_qwens_builtin_recipe_on_avx512_bf16_is_w8a8_int8():
    """quantize/recipes/qwen2.5-coder-0.5b@avx512-bf16.yaml: measured faster there, gates
    passed: every linear and the head W8A8 int8, bf16 KV, the shipped preset's content."""
    from qserve.quantize.builtin_artifact import builtin_recipe
    from qserve.quantize.recipe import load_recipe

    r = builtin_recipe("qwen2.5-coder-0.5b", "avx512-bf16")
    assert r.weights.type == "int8" and r.activations.dynamic and not r.kv_cache.enabled
    assert not r.is_weight_only("lm_head") and not r.is_ignored("lm_head")
    assert r == load_recipe("w8a8-int8")
    # other models have no class file: their one recipe on every class
    assert builtin_recipe("smollm2-135m", "avx512-bf16") == builtin_recipe("smollm2-135m", "avx2")


def test_two_processes_wanting_the_artifact_take_turns(tmp_path, monkeypatch):
    """While one caller quantizes (the first worker of `qserve cluster`), another waits on
    the lock file, says so, and then finds the artifact made: it is quantized once."""
    import json
    import threading

    from qserve.quantize import builtin_artifact as ba
    from qserve.runtime.formats.manifest import Manifest

    monkeypatch.setenv("QSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ba, "tokenizer_is_current", lambda path, spec: True)
    monkeypatch.setattr(ba, "format_report", lambda report: "weights: x\nartifact: y")
    started, release, made = threading.Event(), threading.Event(), []

    def slow_quantize(spec, path, r, force, progress):
        made.append(spec)
        started.set()
        assert release.wait(10)
        path.mkdir(parents=True)
        Manifest(source={"spec": spec}, recipe=json.loads(json.dumps(r.to_dict())),
                 calibration={}).write(path)

    monkeypatch.setattr(ba, "quantize", slow_quantize)
    first = threading.Thread(target=ba.builtin_artifact, args=("smollm2-135m", lambda m: None))
    first.start()
    assert started.wait(10)
    said, got = [], []
    second = threading.Thread(target=lambda: got.append(
        ba.builtin_artifact("smollm2-135m", said.append)))
    second.start()
    second.join(0.5)
    assert second.is_alive() and any("waiting for it" in m for m in said)
    release.set()
    first.join(10)
    second.join(10)
    assert got == [str(ba.artifact_path("smollm2-135m"))] and made == ["smollm2-135m"]

