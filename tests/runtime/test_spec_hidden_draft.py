"""The hidden-state draft proposer: its head file, what it drafts, and what the engine
hands it. The engine's features are checked against the target's own dense forward (the
oracle) at the position each was said to belong to; greedy outputs against the engine
without speculation. fp32 tiny Llama, bf16 KV, CPU; untrained heads (drafts mostly wrong)."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qserve.runtime.attention import AttentionMetadata, DenseAttention
from qserve.runtime.engine import LLMEngine
from qserve.runtime.llm import LLM
from qserve.runtime.loaded_model import load
from qserve.runtime.request import Request
from qserve.runtime.sampling_params import SamplingParams
from qserve.runtime.spec.hidden_draft import HiddenDraftHead, HiddenDraftProposer, load_head
from qserve.runtime.spec.proposer import ProposeRequest, make_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import (spec_engine_config, spec_prompts,  # noqa: E402
                         write_tiny_hidden_draft_head, write_tiny_llama)

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("hidden")
    lm = load(str(write_tiny_llama(root / "t")), torch.float32)
    head = write_tiny_hidden_draft_head(root / "head.safetensors", lm, num_tokens=250)
    return lm, str(head)


@pytest.fixture(scope="module")
def tapped(tiny, tmp_path_factory):
    """A head that also reads the target's residual stream after layer 0 (of 2)."""
    lm, _ = tiny
    path = tmp_path_factory.mktemp("tapped") / "head.safetensors"
    return str(write_tiny_hidden_draft_head(path, lm, num_tokens=250, tap_layers=(0,)))


def _spec(head, k=3, **opts):
    return make_config("hidden_draft", k, head=head, **{"ngram": False, "min_prob": 0.0, **opts})


def test_head_file_round_trip_and_bad_files(tiny, tmp_path):
    lm, path = tiny
    head = load_head(path, 64, torch.float32)
    state = load_file(path)
    again = HiddenDraftHead.from_file_state(head.state_dict(), 64, torch.float32)
    f, e = torch.randn(3, 64), torch.randn(3, 64)
    for a, b in zip(head(f, e), again(f, e)):
        torch.testing.assert_close(a, b)
    assert head(f, e)[1].shape == (3, 250)
    with pytest.raises(ValueError, match="needs tensors fc.weight"):
        HiddenDraftHead.from_file_state({k: v for k, v in state.items() if k != "fc.weight"},
                                        64, torch.float32)
    with pytest.raises(ValueError, match="hidden size 64, the target has 32"):
        HiddenDraftHead.from_file_state(state, 32, torch.float32)
    with pytest.raises(ValueError, match="needs a trained head"):
        LLMEngine.from_model(lm, spec_engine_config(make_config("hidden_draft", 3)))


def _request(ids, params=GREEDY, computed=None):
    req = Request("r", list(ids), params)
    req.num_computed_tokens = len(ids) - 1 if computed is None else computed
    return req


def test_proposer_drafts_only_from_a_current_feature(tiny):
    lm, path = tiny
    head = load_head(path, 64, torch.float32)
    prop = HiddenDraftProposer(head, lm.model.backbone.embed_tokens.weight, 300,
                               ngram=False, min_prob=0.0)
    req = _request([5, 6, 7, 8])
    assert prop.propose([ProposeRequest(req, 3)])[0].token_ids == []  # nothing observed
    prop.observe("r", 1, torch.randn(64))  # stale: the last computed position is 2
    assert prop.propose([ProposeRequest(req, 3)])[0].token_ids == []
    feature = torch.randn(64)
    prop.observe("r", 2, feature)
    drafts = prop.propose([ProposeRequest(req, 3)])[0]
    # the oracle: the head run by hand from (feature, last token), argmax each time
    f, t, want = feature[None], 8, []
    for _ in range(3):
        f, logits = head(f, lm.model.backbone.embed_tokens.weight[[t]])
        t = int(head.token_ids[logits.argmax()])
        want.append(t)
    assert drafts.token_ids == want and drafts.probs is None
    assert all(t < 250 for t in want)  # only the head's tokens
    prop.release("r")
    assert prop.propose([ProposeRequest(req, 3)])[0].token_ids == []


def test_min_prob_stops_drafting_and_ngram_goes_first(tiny):
    lm, path = tiny
    head = load_head(path, 64, torch.float32)
    emb = lm.model.backbone.embed_tokens.weight
    req = _request([5, 6, 7, 5, 6])
    sure = HiddenDraftProposer(head, emb, 300, ngram=False, min_prob=1.01)
    sure.observe("r", 3, torch.randn(64))
    assert sure.propose([ProposeRequest(req, 4)])[0].token_ids == []  # never that sure
    first = HiddenDraftProposer(head, emb, 300, ngram=True, min_prob=0.0)
    first.observe("r", 3, torch.randn(64))
    assert first.propose([ProposeRequest(req, 4)])[0].token_ids == [7, 5, 6]  # the lookup


def test_sampled_drafts_come_with_their_full_vocab_distribution(tiny):
    lm, path = tiny
    head = load_head(path, 64, torch.float32)
    prop = HiddenDraftProposer(head, lm.model.backbone.embed_tokens.weight, 300,
                               ngram=False)
    req = _request([5, 6, 7, 8], SamplingParams(temperature=0.8, top_k=20, max_tokens=8))
    prop.observe("r", 2, torch.randn(64))
    drafts = prop.propose([ProposeRequest(req, 2)])[0]
    assert len(drafts.token_ids) == 2 and drafts.probs.shape == (2, 300)
    torch.testing.assert_close(drafts.probs.sum(-1), torch.ones(2))
    assert float(drafts.probs[:, 250:].sum()) == 0.0  # outside the head's tokens: q = 0
    assert all(int((row > 0).sum()) <= 20 for row in drafts.probs)  # top-k applied
    assert all(float(drafts.probs[i, t]) > 0 for i, t in enumerate(drafts.token_ids))


class _Recorder(HiddenDraftProposer):
    seen: list

    def observe(self, request_id, position, feature, taps=None):
        self.seen.append((request_id, position, feature.clone(),
                          None if taps is None else taps.clone()))
        super().observe(request_id, position, feature, taps)


@torch.inference_mode()
def test_engine_hands_over_the_feature_of_the_last_computed_position(tiny):
    lm, path = tiny
    llm = LLM(lm, config=spec_engine_config(_spec(path, k=3)))
    rec = _Recorder(load_head(path, 64, torch.float32), lm.model.backbone.embed_tokens.weight,
                    300, ngram=True, min_prob=0.0)
    rec.seen = []
    llm.engine.spec.proposer = rec
    prompts = spec_prompts(3)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.stats().spec.accepted > 0  # the repetitive prompt: some drafts kept
    full = {o.request_id: p + o.token_ids for p, o in zip(prompts, outs)}
    assert len(rec.seen) > 20
    for rid, pos, feature, taps in rec.seen:
        assert taps is None  # the head reads no middle layers
        ids = torch.tensor(full[rid])
        dense = lm.model(ids, torch.arange(len(ids)), AttentionMetadata.single(len(ids)),
                         DenseAttention())  # [T, H] the oracle, bf16 K/V aside
        dist = (dense - feature).norm(dim=-1)
        assert int(dist.argmin()) == pos, (rid, pos)
        assert float(dist[pos]) < 0.05 * float(feature.norm())


@pytest.mark.parametrize("ngram", [False, True])
def test_greedy_identical_with_chunked_prefill_and_prefix_hits(tiny, ngram):
    lm, path = tiny
    prompts = spec_prompts(6)
    ref = [o.token_ids for o in LLM(lm, config=spec_engine_config()).generate(prompts, GREEDY)]
    llm = LLM(lm, config=spec_engine_config(_spec(path, ngram=ngram)))
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
    stats = llm.engine.stats()
    assert stats.spec.proposed > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_greedy_identical_under_preemption_and_no_leak_after_aborts(tiny):
    lm, path = tiny
    prompts = spec_prompts(5, seed=1)
    small = dict(num_kv_blocks=7, max_num_batched_tokens=16)
    ref = [o.token_ids for o in LLM(lm, config=spec_engine_config(**small)).generate(prompts, GREEDY)]
    llm = LLM(lm, config=spec_engine_config(_spec(path), **small))
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
    assert llm.engine.stats().num_preemptions > 0
    engine = LLMEngine.from_model(lm, spec_engine_config(_spec(path)))
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, GREEDY)
    for _ in range(4):
        engine.step()
    for i in range(len(prompts)):
        engine.abort_request(f"a{i}")
    assert engine.spec.proposer._features == {}
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_unreadable_head_tensors_are_refused(tiny, tmp_path):
    lm, path = tiny
    state = load_file(path)
    state["fc.weight"] = state["fc.weight"][:, :64].contiguous()
    bad = tmp_path / "bad.safetensors"
    save_file(state, str(bad))
    with pytest.raises(ValueError, match="hidden size"):
        LLMEngine.from_model(lm, spec_engine_config(_spec(str(bad))))
    for missing in (tmp_path / "none.safetensors", tmp_path):
        with pytest.raises(ValueError, match="cannot read the draft head"):
            LLMEngine.from_model(lm, spec_engine_config(_spec(str(missing))))


def test_tapped_head_file_and_what_it_reads(tiny, tapped, tmp_path):
    lm, _ = tiny
    head = load_head(tapped, 64, torch.float32)
    assert head.tapped == (0,)
    again = HiddenDraftHead.from_file_state(head.state_dict(), 64, torch.float32)
    f, e, m = torch.randn(3, 64), torch.randn(3, 64), torch.randn(3, 1, 64)
    for a, b in zip(head(f, e, m), again(f, e, m)):
        torch.testing.assert_close(a, b)
    assert not torch.allclose(head(f, e, m)[1], head(f, e)[1])  # the taps count
    prop = HiddenDraftProposer(head, lm.model.backbone.embed_tokens.weight, 300, ngram=False,
                               min_prob=0.0)
    assert prop.tap_layers == (0,)
    req = _request([5, 6, 7, 8])
    prop.observe("r", 2, f[0], m[0])
    drafts = prop.propose([ProposeRequest(req, 2)])[0].token_ids
    # the oracle by hand: the taps feed the first draft only
    f1, logits = head(f[:1], lm.model.backbone.embed_tokens.weight[[8]], m[:1])
    t1 = int(head.token_ids[logits.argmax()])
    _, logits = head(f1, lm.model.backbone.embed_tokens.weight[[t1]])
    assert drafts == [t1, int(head.token_ids[logits.argmax()])]
    state = load_file(tapped)
    with pytest.raises(ValueError, match="lacks taps.fc.weight"):
        HiddenDraftHead.from_file_state({k: v for k, v in state.items() if k != "taps.fc.weight"},
                                        64, torch.float32)
    state["tap_layers"] = torch.tensor([5])
    other = tmp_path / "other.safetensors"
    save_file(state, str(other))
    with pytest.raises(ValueError, match=r"reads target layers \[5\], the target has 2"):
        LLMEngine.from_model(lm, spec_engine_config(_spec(str(other))))


@torch.inference_mode()
def test_engine_hands_over_the_tapped_layers_of_the_last_computed_position(tiny, tapped):
    lm, _ = tiny
    prompts = spec_prompts(3)
    ref = [o.token_ids for o in LLM(lm, config=spec_engine_config()).generate(prompts, GREEDY)]
    llm = LLM(lm, config=spec_engine_config(_spec(tapped, k=3)))
    rec = _Recorder(load_head(tapped, 64, torch.float32), lm.model.backbone.embed_tokens.weight,
                    300, ngram=True, min_prob=0.0)
    rec.seen = []
    llm.engine.spec.proposer = rec
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    full = {o.request_id: p + o.token_ids for p, o in zip(prompts, outs)}
    assert len(rec.seen) > 20
    layer0 = {}
    hook = lm.model.backbone.layers[0].register_forward_hook(
        lambda _m, _a, out: layer0.__setitem__("out", out))
    try:
        for rid, pos, _, taps in rec.seen:
            ids = torch.tensor(full[rid])
            lm.model(ids, torch.arange(len(ids)), AttentionMetadata.single(len(ids)),
                     DenseAttention())  # the oracle: layer 0's output over the whole text
            assert taps.shape == (1, 64)
            dist = (layer0["out"] - taps[0]).norm(dim=-1)
            assert int(dist.argmin()) == pos, (rid, pos)
            assert float(dist[pos]) < 0.05 * float(taps.norm())
    finally:
        hook.remove()
