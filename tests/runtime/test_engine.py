"""The engine against the step-by-step reference: chunked prefill, prefix hits,
preemption, batch invariance, aborts, stop strings, FP8 KV. fp32 on CPU, tiny Llama."""

import sys
from pathlib import Path

import pytest
import torch

from qserve.quantize.pipeline import quantize
from qserve.quantize.recipe import recipe_from_dict
from qserve.runtime.engine import EngineConfig, LLMEngine
from qserve.runtime.generate import GenerationParams, generate
from qserve.runtime.llm import LLM
from qserve.runtime.loaded_model import load
from qserve.runtime.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import Bf16KV, write_tiny_llama  # noqa: E402

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    torch.set_num_threads(1)  # tiny ops: threads only add overhead here
    root = write_tiny_llama(tmp_path_factory.mktemp("eng") / "tiny")
    return load(str(root), torch.float32)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(2, 300, (20,), generator=g).tolist()  # a shared 20-token prefix
    out = []
    for i in range(n):
        tail = torch.randint(2, 300, (int(torch.randint(1, 30, (1,), generator=g)),),
                             generator=g).tolist()
        out.append((shared if i % 2 == 0 else []) + tail)
    return out


def _reference(lm, prompt, n=10, wrap=Bf16KV):
    return list(generate(lm.model, prompt, GenerationParams(max_new_tokens=n), wrap))


def _cfg(**kw):
    base = dict(num_kv_blocks=64, max_num_batched_tokens=8, kv_dtype="bf16", decode_impl="eager")
    base.update(kw)
    return EngineConfig(**base)


def test_mixed_batch_equals_reference_with_chunked_prefill_and_prefix_hits(lm):
    prompts = _prompts(8)
    llm = LLM(lm, config=_cfg())
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == _reference(lm, p)
        assert o.finish_reason == "length"
    stats = llm.engine.stats()
    assert stats.tokens_cached >= 16  # the shared prefix's full block was reused
    assert stats.kv_blocks_free == stats.kv_blocks_total  # no leak


def test_preemption_under_small_kv_budget_keeps_outputs(lm):
    prompts = _prompts(6, seed=1)
    llm = LLM(lm, config=_cfg(num_kv_blocks=7, max_num_batched_tokens=16))
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o.token_ids == _reference(lm, p)
    assert llm.engine.blocks.num_free_blocks == 7


def test_batch_invariance_alone_vs_32(lm):
    prompts = _prompts(32, seed=2)
    alone = LLM(lm, config=_cfg(max_num_batched_tokens=64)).generate([prompts[5]], GREEDY)[0]
    batch = LLM(lm, config=_cfg(num_kv_blocks=256, max_num_batched_tokens=64)).generate(
        prompts, GREEDY)
    assert batch[5].token_ids == alone.token_ids


def test_prefix_hit_skips_compute_and_changes_nothing(lm):
    prompt = list(range(2, 50))  # 48 tokens: 2 full blocks cacheable (the last is computed)
    llm = LLM(lm, config=_cfg(max_num_batched_tokens=64))
    first = llm.generate([prompt], GREEDY)[0]
    computed = llm.engine.stats().tokens_computed
    second = llm.generate([prompt], GREEDY)[0]
    assert second.num_cached_tokens == 32
    assert llm.engine.stats().tokens_computed - computed == (48 - 32) + 9
    assert second.token_ids == first.token_ids


def test_prefill_capped_in_steps_that_decode(lm):
    engine = LLMEngine.from_model(lm, _cfg(max_num_batched_tokens=64,
                                           max_prefill_tokens_with_decodes=4))
    steps = []  # per step: [(request id, prompt tokens or 0 for a decode)]
    execute = engine.runner.execute

    def spy(sched, **kw):
        steps.append([(c.request.request_id,
                       max(0, min(c.end, c.request.num_prompt_tokens) - c.start))
                      for c in sched.chunks])
        return execute(sched, **kw)

    engine.runner.execute = spy
    a, b = list(range(2, 12)), list(range(40, 80))  # 10 and 40 prompt tokens
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = {"a": [], "b": []}  # request id -> generated tokens

    def step():
        for out in engine.step():
            outs[out.request_id] += out.token_ids

    engine.add_request("a", a, params)
    step()
    engine.add_request("b", b, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished:
        step()
    assert steps[0] == [("a", 10)]  # nothing decoding: the whole budget
    b_prompt = [n for step in steps for rid, n in step if rid == "b" and n]
    assert sum(b_prompt) == 40 and max(b_prompt) <= 4  # a decodes throughout
    for step in steps[1:]:
        if any(rid == "a" and n == 0 for rid, n in step):
            assert sum(n for _, n in step) <= 4
    assert outs["a"] == _reference(lm, a, 20) and outs["b"] == _reference(lm, b, 5)
    assert engine.blocks.num_free_blocks == 64


def test_prefill_cap_must_be_positive():
    from qserve.runtime.scheduler import SchedulerConfig

    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes"):
        SchedulerConfig(max_prefill_tokens_with_decodes=0)


def test_abort_frees_blocks(lm):
    engine = LLMEngine.from_model(lm, _cfg())
    engine.add_request("a", list(range(2, 40)), SamplingParams(max_tokens=50, temperature=0))
    engine.add_request("b", list(range(5, 30)), SamplingParams(max_tokens=5, temperature=0,
                                                               ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert engine.abort_request("a")
    assert not engine.abort_request("a")
    while engine.has_unfinished:
        engine.step()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_stop_string_not_emitted(lm):
    prompt = _prompts(1, seed=3)[0]
    llm = LLM(lm, config=_cfg())
    full = llm.generate([prompt], GREEDY)[0]
    assert len(full.text) > 4
    stop = full.text[2:4]
    cut = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, stop=stop,
                                                ignore_eos=True))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.index(stop)]


def test_fp8_kv_engine_equals_fp8_reference(lm, tmp_path):
    art = tmp_path / "art"
    quantize(str(lm.path), art, recipe_from_dict({"calibration": {"num_samples": 4, "seq_len": 64}}),
             dtype=torch.float32)
    qlm = load(str(art), torch.float32)
    prompts = _prompts(4, seed=4)
    llm = LLM(qlm, config=_cfg(kv_dtype="fp8"))
    for p, o in zip(prompts, llm.generate(prompts, GREEDY)):
        assert o.token_ids == _reference(qlm, p, wrap=qlm.attention)


def test_prefix_caching_off_computes_every_prompt(lm):
    prompt = list(range(2, 50))
    llm = LLM(lm, config=_cfg(max_num_batched_tokens=64, enable_prefix_caching=False))
    first = llm.generate([prompt], GREEDY)[0]
    computed = llm.engine.stats().tokens_computed
    second = llm.generate([prompt], GREEDY)[0]
    assert second.num_cached_tokens == 0 and llm.engine.stats().tokens_cached == 0
    assert llm.engine.stats().tokens_computed - computed == 48 + 9
    assert second.token_ids == first.token_ids


def test_seeded_sampling_reproducible_in_batch(lm):
    prompts = _prompts(4, seed=5)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    a = LLM(lm, config=_cfg()).generate([prompts[0]], params)[0]
    b = LLM(lm, config=_cfg()).generate(prompts, params)[0]
    assert a.token_ids == b.token_ids


def test_seeded_sample_equals_the_reference_loops(lm):
    """One sampler: the reference loop draws a seeded request's tokens as the engine does
    (same per-request generator, same distribution), so both give the same sample."""
    prompts = _prompts(3, seed=4)
    for seed in (1, 2):
        params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=seed,
                                ignore_eos=True)
        served = LLM(lm, config=_cfg()).generate(prompts, params)
        for p, o in zip(prompts, served):
            ref = list(generate(lm.model, p, GenerationParams(max_new_tokens=10,
                                                              temperature=1.0, top_p=0.9,
                                                              seed=seed), Bf16KV))
            assert o.token_ids == ref


def test_stream_yields_the_generated_tokens_and_closing_it_aborts(lm):
    prompt = _prompts(1, seed=6)[0]
    llm = LLM(lm, config=_cfg())
    whole = llm.generate([prompt], GREEDY)[0]
    parts = list(llm.stream(prompt, GREEDY))
    assert [t for p in parts for t in p.token_ids] == whole.token_ids
    assert "".join(p.text for p in parts) == whole.text
    assert [p.finish_reason for p in parts][-1] == "length"
    assert all(p.finish_reason is None for p in parts[:-1])
    it = llm.stream(prompt, GREEDY)
    next(it)
    it.close()  # the consumer stops early: the request leaves the engine
    assert not llm.engine.has_unfinished


def test_request_too_large_for_cache_rejected(lm):
    engine = LLMEngine.from_model(lm, _cfg(num_kv_blocks=2))
    with pytest.raises(ValueError, match="needs 3 KV blocks"):
        engine.add_request("x", list(range(2, 40)), SamplingParams(max_tokens=5))


def test_gemma3_sliding_window_engine_equals_reference(tmp_path):
    from tiny_models import write_tiny_gemma3

    glm = load(str(write_tiny_gemma3(tmp_path / "gemma")), torch.float32)
    prompts = [list(range(2, 2 + n)) for n in (7, 25, 41)]  # shorter and longer than the window
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = LLM(glm, config=_cfg(max_num_batched_tokens=16)).generate(prompts, params)
    for p, o in zip(prompts, outs):
        assert o.token_ids == _reference(glm, p, n=12)


def test_gemma3_sliding_blocks_given_back_with_prefix_hits_and_preemption(tmp_path):
    """Sliding-window layers keep their own block tables and give back blocks behind the
    window: the same greedy tokens as the dense reference, with prefix hits (a shared
    prompt start), chunked prefill and preemption (a pool too small for all at once), while
    a request's sliding blocks stay bounded by its window however long it runs."""
    from tiny_models import write_tiny_gemma3

    glm = load(str(write_tiny_gemma3(tmp_path / "gemma", sliding_window=8)), torch.float32)
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(2, 300, (20,), generator=g).tolist()
    prompts = [shared + torch.randint(2, 300, (n,), generator=g).tolist() for n in (3, 9, 14)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    refs = [_reference(glm, p, n=40) for p in prompts]
    for blocks in (200, 40):  # room for all; preemption (3 x 2 groups x ~19 blocks > 40)
        llm = LLM(glm, config=_cfg(num_kv_blocks=blocks, block_size=4,
                                   max_num_batched_tokens=8))
        engine = llm.engine
        assert engine.blocks.windows == (None, 8, 8)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        most_sliding = 0
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
        while engine.has_unfinished:
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
            for r in engine.scheduler.running:
                tables = engine.blocks.block_tables(r.request_id)
                held = engine.blocks.num_held_blocks(r.request_id) - len(tables[0])
                most_sliding = max(most_sliding, held)
        assert most_sliding <= 2 * (-(-(8 + 8) // 4) + 1)  # two sliding groups
        assert engine.blocks.num_free_blocks == blocks
        assert engine.blocks.prefix_stats[0] > 0  # the shared start was served from cache
        if blocks == 40:
            assert engine.scheduler.num_preemptions > 0
        for i, ref in enumerate(refs):
            assert tokens[f"r{i}"] == ref


def test_prompt_logprobs_from_scores_only_the_tail(lm):
    """prompt_logprobs_from=p: entries before p are None, the rest equal full scoring's,
    across chunk boundaries (16-token steps) and preemption mid-prompt; a start past the
    prompt is refused."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 300, (n,), generator=g).tolist() for n in (45, 30, 38)]
    full = LLM(lm, config=_cfg(num_kv_blocks=64)).generate(
        prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    starts = [40, 1, 17]  # a short tail, everything, from inside the second chunk
    for cfg in (_cfg(num_kv_blocks=64), _cfg(num_kv_blocks=9, max_num_batched_tokens=16)):
        params = [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1,
                                 prompt_logprobs_from=s) for s in starts]
        outs = LLM(lm, config=cfg).generate(prompts, params)
        for p, s, out, ref in zip(prompts, starts, outs, full):
            lps = out.prompt_logprobs
            assert len(lps) == len(p) and all(t is None for t in lps[:s])
            assert [t.token_id for t in lps[s:]] == p[s:]
            torch.testing.assert_close(torch.tensor([t.logprob for t in lps[s:]]),
                                       torch.tensor([t.logprob for t in ref.prompt_logprobs[s:]]),
                                       rtol=1e-4, atol=1e-4)
            assert ([t.top[0][0] for t in lps[s:]]
                    == [t.top[0][0] for t in ref.prompt_logprobs[s:]])  # the greedy check
    with pytest.raises(ValueError, match="prompt_logprobs_from=45 scores no token"):
        LLM(lm, config=_cfg()).generate([prompts[0]], SamplingParams(
            max_tokens=1, prompt_logprobs=0, prompt_logprobs_from=45))


def test_prompt_logprobs_complete_despite_prefix_hits_and_preemption(lm):
    """Scoring requests that share a cached prefix still get a logprob for every prompt
    token (they bypass prefix reuse), equal to those of a lone request; a pool small enough
    to force preemption mid-prompt does not duplicate entries."""
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(2, 300, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(2, 300, (5,), generator=g).tolist() for _ in range(3)]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

    def score(cfg, batch):
        llm = LLM(lm, config=cfg)
        llm.generate([shared + [7]], SamplingParams(max_tokens=1, temperature=0.0))  # warm cache
        return llm.generate(batch, params)

    alone = [score(_cfg(num_kv_blocks=64), [p])[0].prompt_logprobs for p in prompts]
    for cfg in (_cfg(num_kv_blocks=64), _cfg(num_kv_blocks=9, max_num_batched_tokens=16)):
        outs = score(cfg, prompts)
        for p, out, ref in zip(prompts, outs, alone):
            lps = out.prompt_logprobs
            assert len(lps) == len(p) and lps[0] is None
            assert [t.token_id for t in lps[1:]] == p[1:]
            torch.testing.assert_close(torch.tensor([t.logprob for t in lps[1:]]),
                                       torch.tensor([t.logprob for t in ref[1:]]),
                                       rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("fp32", torch.float32),
                                         ("bfloat16", torch.bfloat16), ("auto", torch.bfloat16),
                                         (torch.float32, torch.float32)])
def test_llm_takes_dtype_names_like_vllm(lm, name, dtype):
    from qserve.runtime.loaded_model import resolve_dtype

    assert resolve_dtype(name) is dtype


def test_llm_refuses_an_unknown_dtype_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match="'float32'"):
        LLM(str(tmp_path), dtype="float8")
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(tmp_path), dtype=torch.int8)


def test_llm_loads_in_the_named_dtype(tmp_path):
    root = write_tiny_llama(tmp_path / "tiny")
    llm = LLM(str(root), dtype="float32", config=_cfg())
    assert llm.lm.dtype == torch.float32
    assert next(llm.lm.model.parameters()).dtype == torch.float32
    assert len(llm.generate([[3, 4, 5]], GREEDY)[0].token_ids) == 10
