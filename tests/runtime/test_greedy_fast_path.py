"""The greedy fast path (EngineConfig.greedy_fast_path, sampler.argmax_decides): a step
whose sampled requests are all greedy and plain takes each row's token from the model's
greedy_tokens (an 8-bit LM head's fused C argmax: no [rows, vocab] logits) instead of
making logits and sampling them. Its tokens equal those of the engine without it, for
int8, FP8 and bf16 heads, with chunked prefill, n > 1 forks and speculation; a step with
one request that needs the logits (logprobs, sampling, logit_bias, penalties, a grammar,
drafts, forks) does not take it."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qserve.kernels import native_fp8_gemv
from qserve.quantize.pipeline import quantize
from qserve.quantize.recipe import recipe_from_dict
from qserve.runtime.engine import EngineConfig
from qserve.runtime.layers.fp8_linear import Fp8Linear
from qserve.runtime.llm import LLM
from qserve.runtime.sampler import argmax_decides
from qserve.runtime.sampling_params import SamplingParams
from qserve.runtime.spec.proposer import make_config
from qserve.runtime.structured.spec import GrammarSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CONFIG = EngineConfig(num_kv_blocks=128, max_num_batched_tokens=32, kv_dtype="fp8")


# -- the eligibility test alone ------------------------------------------------------------

def _chunk(rid: str = "a", samples: bool = True, drafts: tuple[int, ...] = (),
           grammar: object | None = None, **params) -> SimpleNamespace:
    """A scheduled chunk as argmax_decides reads it (greedy unless params say otherwise)."""
    p = SamplingParams(**{"temperature": 0.0, **params})
    return SimpleNamespace(samples=samples, draft_token_ids=drafts, request=SimpleNamespace(
        request_id=rid, sampling=SimpleNamespace(params=p, grammar=grammar)))


@pytest.mark.parametrize("spoiler", [
    {"logprobs": 0}, {"temperature": 0.7}, {"temperature": 0.7, "seed": 3},
    {"logit_bias": {3: 1.0}}, {"presence_penalty": 0.5}, {"frequency_penalty": -0.5},
    {"repetition_penalty": 1.1}, {"structured": GrammarSpec("regex", "a+")},
    {"grammar": object()}, {"drafts": (4, 5)}, {"rid": "forking"}])
def test_one_sampled_chunk_that_reads_its_logits_rules_the_step_out(spoiler):
    plain = [_chunk("x"), _chunk("y", prompt_logprobs=1)]  # prompt rows are made apart
    assert argmax_decides(plain, {"forking"})
    assert not argmax_decides(plain + [_chunk(**spoiler)], {"forking"})
    # a chunk that does not sample this step (a prefill chunk short of the prompt's end)
    # reads no logits, whatever its request asks
    assert argmax_decides(plain + [_chunk(**spoiler, samples=False)], {"forking"})


def test_a_step_that_samples_nothing_is_not_a_greedy_step():
    assert not argmax_decides([], ())
    assert not argmax_decides([_chunk(samples=False)], ())


# -- the engine ----------------------------------------------------------------------------

_HEADS: dict[str, object] = {}  # LM head format -> its tiny artifact, loaded (per module)


def _head_artifact(fmt: str, tmp_path_factory):
    """The tiny Llama artifact with an LM head of `fmt`, served in bf16 (made once)."""
    if fmt not in _HEADS:
        torch.set_num_threads(2)
        root = tmp_path_factory.mktemp(f"greedy-{fmt}")
        ckpt = write_tiny_llama(root / "ckpt")  # vocabulary 300: 18 tiles of 16, 12 channels
        recipe = {"calibration": {"num_samples": 4, "seq_len": 64}, "lm_head": fmt}
        quantize(str(ckpt), root / "art", recipe_from_dict(recipe), dtype=torch.float32)
        _HEADS[fmt] = LLM(str(root / "art"), dtype=torch.bfloat16,
                          config=EngineConfig(num_kv_blocks=8)).lm
    return _HEADS[fmt]


@pytest.fixture(scope="module", params=["int8", "fp8", "bf16"])
def head_lm(request, tmp_path_factory):
    """(LM head format, the tiny Llama artifact with that head, served in bf16)."""
    return request.param, _head_artifact(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def int8_head_lm(tmp_path_factory):
    return _head_artifact("int8", tmp_path_factory)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 70, 17, 41, 9, 33][:n]  # some longer than a step's 32-token budget
    return [torch.randint(2, 300, (length,), generator=g).tolist() for length in lengths]


def _fused_calls(monkeypatch) -> list[int]:
    """Rows of every fused argmax call from now on (the C kernel's wrapper, spied on)."""
    calls: list[int] = []
    real = native_fp8_gemv.fp8_gemv_argmax_bf16
    monkeypatch.setattr(native_fp8_gemv, "fp8_gemv_argmax_bf16",
                        lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    return calls


def test_greedy_tokens_equal_those_without_the_fast_path(head_lm, monkeypatch):
    head, lm = head_lm
    prompts = _prompts(6)
    slow = LLM(lm, config=replace(CONFIG, greedy_fast_path=False))
    calls = _fused_calls(monkeypatch)
    want = [o.token_ids for o in slow.generate(prompts, GREEDY)]
    assert slow.engine.num_greedy_steps == 0 and calls == []
    fast = LLM(lm, config=CONFIG)
    got = [o.token_ids for o in fast.generate(prompts, GREEDY)]
    assert got == want and all(len(t) == 12 for t in got)
    assert fast.engine.num_greedy_steps >= 12  # every step that samples
    if head == "bf16" or not native_fp8_gemv.vectorized():
        assert calls == []  # the logits' argmax: the same path, without the sampler
    else:
        lm_head = lm.model.lm_head
        assert isinstance(lm_head, Fp8Linear) and lm_head.c_weight is not None
        assert lm_head.codes == ("int8" if head == "int8" else "e4m3")
        assert len(calls) == fast.engine.num_greedy_steps and max(calls) > 1


@pytest.mark.parametrize("spoiler", [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1),
    SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)],
    ids=["logprobs", "sampled"])
def test_a_step_with_one_request_that_reads_the_logits_is_not_a_greedy_step(
        head_lm, spoiler, monkeypatch):
    """Four requests run in every step together (one step prefills them all); with one
    of them asking for logprobs or sampling, no step takes the fast path, and the greedy
    requests' tokens stay those they get beside a greedy fourth."""
    _, lm = head_lm
    prompts = _prompts(4, seed=1)
    config = replace(CONFIG, max_num_batched_tokens=256)
    control = LLM(lm, config=config)
    plain = control.generate(prompts, GREEDY)
    assert control.engine.num_greedy_steps == 12  # each of the 12 steps samples all four
    calls = _fused_calls(monkeypatch)
    mixed = LLM(lm, config=config)
    outs = mixed.generate(prompts, [GREEDY] * 3 + [spoiler])
    assert mixed.engine.num_greedy_steps == 0 and calls == []
    assert [o.token_ids for o in outs[:3]] == [o.token_ids for o in plain[:3]]
    without = LLM(lm, config=replace(config, greedy_fast_path=False)).generate(
        prompts, [GREEDY] * 3 + [spoiler])
    assert [(o.token_ids, o.logprobs) for o in outs] == [
        (o.token_ids, o.logprobs) for o in without]
    if spoiler.logprobs is not None:
        assert len(outs[3].logprobs) == 12


def test_forks_and_drafts_keep_their_tokens(int8_head_lm):
    """n = 2 samples fork from their parent's first row (its prompt step is no greedy
    step), n-gram drafts are verified on logits (steps with drafts are none): the tokens
    equal the engine's without the fast path. One head suffices: the engine's choice does
    not depend on it."""
    lm = int8_head_lm
    prompts = _prompts(3, seed=2)
    twice = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=2)
    for config in (CONFIG, replace(CONFIG, speculative=make_config("ngram", 3, min_n=1))):
        fast = LLM(lm, config=config)
        got = [o.token_ids for o in fast.generate(prompts, twice)]
        slow = LLM(lm, config=replace(config, greedy_fast_path=False))
        assert got == [o.token_ids for o in slow.generate(prompts, twice)]
        assert got[0::2] == got[1::2]  # greedy samples of one prompt agree
        assert fast.engine.num_forked == 3 and fast.engine.num_greedy_steps > 0
        if config.speculative is not None:
            assert fast.engine.spec.counters.proposed > 0
