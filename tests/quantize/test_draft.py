"""`qserve quantize --draft`: the draft is recorded in the artifact and its manifest, its
files are verified, and serving with the artifact's default draft gives the same greedy
output as serving without speculation. Tiny random Llamas sharing one tokenizer."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qserve.runtime.formats.artifact_reader import artifact_draft
from qserve.quantize.draft import DraftError, DraftSpec, parse_draft
from qserve.quantize.hidden_draft_train import HeadTraining
from qserve.runtime.formats.manifest import ArtifactError
from qserve.quantize.pipeline import quantize
from qserve.quantize.recipe import recipe_from_dict
from qserve.runtime.engine import EngineConfig
from qserve.runtime.llm import LLM
from qserve.runtime.loaded_model import load
from qserve.runtime.sampling_params import SamplingParams
from qserve.runtime.spec.options import resolve_speculative

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama  # noqa: E402

RECIPE = {"calibration": {"num_samples": 4, "seq_len": 64}}
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3], [7, 8, 9, 10] * 5, list(range(30, 70))]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("draft")
    return (write_tiny_llama(root / "target", num_hidden_layers=3),
            write_tiny_llama(root / "small", seed=1, num_hidden_layers=1))


def _artifact(tmp_path, target, draft):
    out = tmp_path / "art"
    quantize(str(target), out, recipe_from_dict(RECIPE), dtype=torch.float32,
             draft=parse_draft(draft, 3) if isinstance(draft, str) else draft)
    return out


def _same_greedy_as_plain(art):
    lm = load(str(art), torch.float32)
    spec = resolve_speculative(None, None, artifact_draft(art))
    cfg = dict(num_kv_blocks=64, max_num_batched_tokens=16, decode_impl="eager")
    plain = LLM(lm, config=EngineConfig(**cfg)).generate(PROMPTS, GREEDY)
    llm = LLM(lm, config=EngineConfig(**cfg, speculative=spec))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [p.token_ids for p in plain]
    assert llm.engine.stats().spec.proposed > 0
    return spec


def test_draft_model_is_a_quantized_artifact_inside(sources, tmp_path):
    art = _artifact(tmp_path, sources[0], f"model:{sources[1]}")
    manifest = json.loads((art / "qserve.json").read_text())
    entry = manifest["draft"]
    assert entry["kind"] == "draft_model" and entry["num_speculative_tokens"] == 3
    assert json.loads((art / "draft" / "qserve.json").read_text())["recipe"] == manifest["recipe"]
    assert (art / "draft" / "config.json").is_file()
    spec = _same_greedy_as_plain(art)
    assert spec.proposer == "draft_model" and spec.num_speculative_tokens == 3
    (art / "draft" / "qserve.json").write_text((art / "draft" / "qserve.json").read_text() + " ")
    with pytest.raises(ArtifactError, match="draft was changed"):
        artifact_draft(art)


def test_early_exit_head_trained_and_verified(sources, tmp_path):
    art = _artifact(tmp_path, sources[0], "early_exit:1+head")
    entry = json.loads((art / "qserve.json").read_text())["draft"]
    assert entry["kind"] == "early_exit" and entry["num_layers"] == 1
    stats = entry["head"]["training"]
    assert stats["train_tokens"] > 0 and stats["steps"] > 0
    spec = _same_greedy_as_plain(art)
    assert spec.options["num_layers"] == 1 and spec.options["head"].endswith(".safetensors")
    head = art / "draft" / "early_exit_head.safetensors"
    head.write_bytes(head.read_bytes()[:-1] + b"\0")
    with pytest.raises(ArtifactError, match="sha256 does not match"):
        artifact_draft(art)


def test_hidden_draft_head_trained_and_verified(sources, tmp_path):
    small = HeadTraining(vocab_size=200, intermediate_size=32, num_instructions=6,
                         answer_tokens=12, completion_tokens=12, epochs=2)
    art = _artifact(tmp_path, sources[0], DraftSpec("hidden_draft", num_speculative_tokens=3,
                                                    head_training=small))
    entry = json.loads((art / "qserve.json").read_text())["draft"]
    assert entry["kind"] == "hidden_draft"
    stats = entry["head"]["training"]
    # per calibration sample two continuations and a snippet instruction, plus 6 others
    assert stats["vocab_size"] == 200 and stats["prompts"] == 4 * 3 + 6
    assert stats["train_rows"] > 100 and stats["generated_tokens"] > 0
    spec = _same_greedy_as_plain(art)
    assert spec.proposer == "hidden_draft" and spec.options["head"].endswith(".safetensors")
    head = art / "draft" / "hidden_draft_head.safetensors"
    # the head reads the middle layers the manifest names
    assert stats["tap_layers"] and load_file(str(head))["tap_layers"].tolist() == stats["tap_layers"]
    head.write_bytes(head.read_bytes()[:-1] + b"\0")
    with pytest.raises(ArtifactError, match="sha256 does not match"):
        artifact_draft(art)


def test_ngram_recorded_and_serve_options_override(sources, tmp_path):
    art = _artifact(tmp_path, sources[0], "ngram")
    entry = artifact_draft(art)
    assert entry == {"kind": "ngram", "num_speculative_tokens": 3}
    assert resolve_speculative(None, None, entry).proposer == "ngram"
    assert resolve_speculative(None, 6, entry).num_speculative_tokens == 6
    assert resolve_speculative("off", None, entry) is None
    ee = resolve_speculative("early_exit:2", None, entry)
    assert ee.options == {"num_layers": 2} and ee.num_speculative_tokens == 4
    assert resolve_speculative(None, None, None) is None
    with pytest.raises(ValueError, match="unknown proposer"):
        resolve_speculative("eagle", None, entry)
    with pytest.raises(ValueError, match="needs --speculative"):
        resolve_speculative(None, 3, None)


@pytest.mark.parametrize("bad", ["model:", "early_exit:x", "early_exit:2+tail", "ngram:3", "lookahead",
                                 "hidden_draft:0", "hidden_draft:x"])
def test_bad_draft_specs_are_clear_errors(bad):
    with pytest.raises(DraftError):
        parse_draft(bad)


def test_draft_with_another_tokenizer_is_refused(sources, tmp_path):
    other = tmp_path / "other"
    write_tiny_llama(other, seed=2, num_hidden_layers=1)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10], list(vocab)[11]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(DraftError, match="tokenizer"):
        _artifact(tmp_path, sources[0], f"model:{other}")
    assert not (tmp_path / "art").exists()


def test_head_loss_soft_targets_and_argmax_special_case():
    import torch.nn.functional as F

    from qserve.quantize.hidden_draft_train import _soft_cross_entropy, _top

    torch.manual_seed(0)
    target = torch.randn(5, 12)  # the target's logits over a 12-token vocabulary
    remap = torch.full((12,), -100)
    remap[torch.tensor([1, 3, 4, 7, 8, 10])] = torch.arange(6)  # the head's 6 tokens
    head_logits = torch.randn(5, 6)
    # k = 0: the argmax alone, i.e. the hard cross-entropy (rows whose argmax is inside)
    p, i = _top(target, 0)
    inside = remap[target.argmax(-1)] >= 0
    hard = F.cross_entropy(head_logits[inside], remap[target.argmax(-1)][inside])
    got = _soft_cross_entropy(head_logits, p, i, remap) * len(target) / int(inside.sum())
    assert torch.allclose(got, hard)
    # k = 12: the whole distribution, renormalised over the head's tokens
    p, i = _top(target, 12)
    w = torch.softmax(target, -1)[:, remap >= 0]
    want = -(w / w.sum(-1, keepdim=True) * torch.log_softmax(head_logits, -1)).sum(-1).mean()
    assert torch.allclose(_soft_cross_entropy(head_logits, p, i, remap), want, atol=1e-3)


def test_tapped_layers_sit_at_fractions_of_the_depth():
    cfg = HeadTraining()
    assert cfg.tap_layers(30) == (9, 19)  # SmolLM2-135M
    assert cfg.tap_layers(18) == (5, 11)  # Gemma 3 270M
    assert cfg.tap_layers(2) == (0,)  # duplicates merge
    assert HeadTraining(tap_fractions=()).tap_layers(30) == ()
