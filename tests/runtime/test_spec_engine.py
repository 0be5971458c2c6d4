"""Speculative decoding in the engine against the non-speculative engine (the oracle):
greedy outputs identical for every proposer, with chunked prefill, prefix hits and
preemption; KV blocks all back after rejections and aborts; nothing wrong in the prefix
cache; never past max_tokens or a stop string. fp32 tiny Llama, bf16 KV, CPU."""

import sys
from pathlib import Path

import pytest
import torch

from qserve.runtime.engine import LLMEngine
from qserve.runtime.llm import LLM
from qserve.runtime.loaded_model import load
from qserve.runtime.sampling_params import SamplingParams
from qserve.runtime.spec.proposer import make_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import spec_engine_config, spec_prompts, write_tiny_llama  # noqa: E402

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("spec")
    target = load(str(write_tiny_llama(root / "target")), torch.float32)
    draft = load(str(write_tiny_llama(root / "draft", seed=1, num_hidden_layers=1)),
                 torch.float32)
    return target, draft


def _spec(name, models, k=3):
    # min_n 1: the tiny random model rarely repeats a bigram, so the default (2) would
    # hardly draft; these tests are about what happens to drafts
    opts = {"ngram": {"min_n": 1}, "early_exit": {"num_layers": 1},
            "draft_model": {"path": models[1]}}[name]
    return make_config(name, k, **opts)




@pytest.mark.parametrize("name", ["ngram", "early_exit", "draft_model"])
def test_greedy_identical_with_chunked_prefill_and_prefix_hits(models, name):
    lm = models[0]
    prompts = spec_prompts(6)
    ref = LLM(lm, config=spec_engine_config()).generate(prompts, GREEDY)
    llm = LLM(lm, config=spec_engine_config(_spec(name, models)))
    for _ in range(2):  # the second round hits the prefix cache filled by the first
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    stats = llm.engine.stats()
    assert stats.tokens_cached >= 6 * 16
    assert stats.spec.proposed > stats.spec.accepted  # rejections happened ...
    if name != "draft_model":  # (a random 1-layer draft rarely agrees with the target)
        assert stats.spec.accepted > 0  # ... and acceptances
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize("name", ["ngram", "early_exit"])
def test_greedy_identical_under_preemption(models, name):
    lm = models[0]
    prompts = spec_prompts(5, seed=1)
    ref = LLM(lm, config=spec_engine_config(num_kv_blocks=7, max_num_batched_tokens=16)).generate(prompts, GREEDY)
    llm = LLM(lm, config=spec_engine_config(_spec(name, models), num_kv_blocks=7, max_num_batched_tokens=16))
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert llm.engine.blocks.num_free_blocks == 7


def test_no_block_leak_after_rejections_and_aborts(models):
    engine = LLMEngine.from_model(models[0], spec_engine_config(_spec("early_exit", models, k=4)))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(spec_prompts(4, seed=2)):
        engine.add_request(f"r{i}", p, params)
    for _ in range(12):
        engine.step()
    assert engine.spec.counters.proposed > engine.spec.counters.accepted > 0
    assert engine.abort_request("r1") and engine.abort_request("r3")
    while engine.has_unfinished:
        engine.step()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    proposer = engine.spec.proposer  # the draft's own cache is released too
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def test_prefix_cache_holds_only_verified_kv(models):
    """After speculation with rejections, a request whose prompt is an earlier request's
    prompt + output reuses cached blocks and still matches a cold, non-speculative run."""
    lm = models[0]
    prompt = spec_prompts(1, seed=3)[0]
    llm = LLM(lm, config=spec_engine_config(_spec("early_exit", models), max_num_batched_tokens=64))
    first = llm.generate([prompt], GREEDY)[0]
    assert llm.engine.stats().spec.proposed > llm.engine.stats().spec.accepted
    follow = prompt + first.token_ids
    warm = llm.generate([follow], GREEDY)[0]
    assert warm.num_cached_tokens >= 32
    cold = LLM(lm, config=spec_engine_config(max_num_batched_tokens=64)).generate([follow], GREEDY)[0]
    assert warm.token_ids == cold.token_ids


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 11])
def test_never_past_max_tokens(models, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompt = [7, 8, 9, 10] * 5  # n-gram drafts always available
    out = LLM(models[0], config=spec_engine_config(_spec("ngram", models, k=4))).generate([prompt], params)[0]
    ref = LLM(models[0], config=spec_engine_config()).generate([prompt], params)[0]
    assert out.token_ids == ref.token_ids and len(out.token_ids) == max_tokens
    assert out.finish_reason == "length"


def test_stop_string_cuts_inside_accepted_drafts(models):
    lm = models[0]
    prompt = [7, 8, 9, 10] * 5
    full = LLM(lm, config=spec_engine_config()).generate([prompt], GREEDY)[0]
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=stop)
    llm = LLM(lm, config=spec_engine_config(_spec("ngram", models, k=4)))
    cut = llm.generate([prompt], params)[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.index(stop)]
    assert llm.engine.stats().spec.accepted > 0
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_bad_proposer_settings_are_clear_errors(models):
    with pytest.raises(ValueError, match="unknown proposer"):
        make_config("medusa", 3)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_config("ngram", 0)
    with pytest.raises(ValueError, match="num_layers"):
        LLMEngine.from_model(models[0], spec_engine_config(make_config("early_exit", 3, num_layers=2)))


def test_metrics_report_speculation_counters(models):
    from qserve.runtime.server.metrics import ServerMetrics

    llm = LLM(models[0], config=spec_engine_config(_spec("ngram", models, k=4)))
    out = llm.generate([[7, 8, 9, 10] * 5], GREEDY)[0]
    stats = llm.engine.stats()
    text = ServerMetrics().render(stats, 8)
    s = stats.spec
    assert f"qserve_spec_decode_num_draft_tokens_total {s.proposed}" in text
    assert f"qserve_spec_decode_num_accepted_tokens_total {s.accepted}" in text
    assert f"qserve_spec_decode_num_steps_total {s.steps}" in text
    assert 0 < s.accepted <= s.proposed
    assert s.emitted == s.accepted + s.steps  # one corrected or bonus token per step
    assert out.finish_reason == "length" and len(out.token_ids) == 24
    plain = ServerMetrics().render(LLM(models[0], config=spec_engine_config()).engine.stats(), 8)
    assert "spec_decode" not in plain


def test_ngram_drafts_from_the_longest_match_and_needs_two_tokens_by_default():
    from qserve.runtime.spec.ngram import NgramProposer, lookup

    tokens = [5, 6, 7, 1, 6, 9, 2, 5, 6]
    assert lookup(tokens, 3, 2, 3) == [7, 1, 6]  # "5 6" matched at the start
    assert lookup(tokens[:-1] + [9], 3, 2, 3) == []  # "5 9" occurs nowhere earlier
    assert lookup(tokens[:-1] + [9], 3, 1, 3) == [2, 5, 9]  # a lone "9" does, at min_n 1
    assert NgramProposer(make_config("ngram", 3)).min_n == 2


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size(models):
    prompt = [7, 8, 9, 10] * 5
    spec = make_config("ngram", 3, min_n=1, disable_by_batch_size=1)
    llm = LLM(models[0], config=spec_engine_config(spec, max_num_batched_tokens=64))
    both = llm.generate([prompt, prompt[:-1]], GREEDY)  # two running together: no drafts
    assert llm.engine.stats().spec.proposed == 0
    alone = llm.generate([prompt], GREEDY)[0]  # one running: drafts again
    assert llm.engine.stats().spec.proposed > 0
    assert alone.token_ids == both[0].token_ids  # greedy either way
    with pytest.raises(ValueError, match="disable_by_batch_size must be a positive integer"):
        make_config("ngram", 3, disable_by_batch_size=0)
