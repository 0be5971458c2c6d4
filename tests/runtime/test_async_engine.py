"""AsyncEngine: concurrent streams, abort on early exit, recovery after a failed step."""

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from qserve.runtime.async_engine import AsyncEngine, EngineError
from qserve.runtime.engine import EngineConfig, LLMEngine
from qserve.runtime.generate import GenerationParams, generate
from qserve.runtime.loaded_model import load
from qserve.runtime.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama  # noqa: E402

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    torch.set_num_threads(1)
    return load(str(write_tiny_llama(tmp_path_factory.mktemp("async") / "tiny")), torch.float32)


@pytest.fixture
def engine(lm):
    eng = AsyncEngine(LLMEngine.from_model(lm, EngineConfig(
        num_kv_blocks=64, kv_dtype="bf16", max_num_batched_tokens=32, decode_impl="eager")))
    yield eng
    eng.shutdown()


async def _collect(engine, rid, ids, params=GREEDY):
    tokens = []
    async for out in engine.generate(rid, ids, params):
        tokens += out.token_ids
    return tokens


def test_concurrent_streams_match_reference(lm, engine):
    prompts = [list(range(3 + i, 10 + 2 * i)) for i in range(12)]

    async def main():
        return await asyncio.gather(*(_collect(engine, f"r{i}", p) for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    for p, got in zip(prompts, results):
        assert got == list(generate(lm.model, p, GenerationParams(max_new_tokens=6)))


def test_leaving_the_stream_aborts_and_frees_blocks(engine):
    async def main():
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        async for _ in engine.generate("long", list(range(2, 40)), params):
            break  # the client went away
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not engine.engine.has_unfinished:
                break

    asyncio.run(main())
    assert not engine.engine.has_unfinished
    assert engine.engine.blocks.num_free_blocks == engine.engine.blocks.num_blocks


def test_failed_step_errors_in_flight_then_recovers(engine, monkeypatch):
    real_step = engine.engine.step
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine.engine, "step", flaky)

    async def main():
        with pytest.raises(EngineError, match="boom"):
            await _collect(engine, "a", list(range(2, 12)))
        return await _collect(engine, "b", list(range(2, 12)))

    assert len(asyncio.run(main())) == 6
    assert engine.engine.blocks.num_free_blocks == engine.engine.blocks.num_blocks


def test_bad_request_raises_in_stream(engine):
    async def main():
        await _collect(engine, "bad", [10**6])

    with pytest.raises(ValueError, match="out of range"):
        asyncio.run(main())


def test_loop_in_the_calling_thread_until_stop_when(lm):
    """start_thread=False: run_forever steps in the caller's thread (how `qserve serve`
    runs it) while asyncio consumers live in another, and returns once stop_when() holds."""
    import threading

    eng = AsyncEngine(LLMEngine.from_model(lm, EngineConfig(
        num_kv_blocks=64, kv_dtype="bf16", max_num_batched_tokens=32, decode_impl="eager")),
        start_thread=False)
    assert not eng.is_running
    prompts = [list(range(3 + i, 9 + i)) for i in range(4)]
    results, seen_running = [], []

    def consumers():
        async def main():
            out = await asyncio.gather(*(_collect(eng, f"c{i}", p) for i, p in enumerate(prompts)))
            seen_running.append(eng.is_running)  # outputs came: the loop runs
            return out
        results.extend(asyncio.run(main()))

    t = threading.Thread(target=consumers)
    t.start()
    eng.run_forever(stop_when=lambda: not t.is_alive())
    t.join()
    assert not eng.is_running and seen_running == [True]
    for p, got in zip(prompts, results):
        assert got == list(generate(lm.model, p, GenerationParams(max_new_tokens=6)))
    threaded = AsyncEngine(eng.engine)
    try:
        with pytest.raises(RuntimeError, match="its own thread"):
            threaded.run_forever()
    finally:
        threaded.shutdown()


def test_submitted_streams_call_back_each_step_and_cancel_stops_them(lm, engine):
    """submit(): outputs reach the callback in the caller's loop, in order, the stream's
    last one finished (then the stream is unregistered); cancel() aborts a running request
    (its blocks freed) and no output of a later step reaches its callback."""
    prompt = list(range(3, 12))

    async def main():
        done = asyncio.Event()
        got, loops = [], set()

        def put(item):
            loops.add(asyncio.get_running_loop())
            got.append(item)
            if item.finished:
                done.set()

        engine.submit("a", prompt, GREEDY, put)
        with pytest.raises(ValueError, match="already in use"):
            engine.submit("a", prompt, GREEDY, put)
        await asyncio.wait_for(done.wait(), 30)
        tokens = [t for out in got for t in out.token_ids]
        assert tokens == list(generate(lm.model, prompt, GenerationParams(max_new_tokens=6)))
        assert [out.finished for out in got] == [False] * (len(got) - 1) + [True]
        assert loops == {asyncio.get_running_loop()}
        engine.submit("a", prompt, GREEDY, put)  # the finished stream's id is free again

        cut = []
        first = asyncio.Event()

        def put_cut(item):
            cut.append(item)
            first.set()

        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        engine.submit("b", list(range(2, 40)), long, put_cut)
        await asyncio.wait_for(first.wait(), 30)
        engine.cancel("b")
        seen = len(cut)
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not engine.engine.has_unfinished:
                break
        await asyncio.sleep(0.1)
        # at most the outputs already handed over when cancel() ran
        assert len(cut) <= seen + 1 and not any(out.finished for out in cut)

    asyncio.run(main())
    assert not engine.engine.has_unfinished
    assert engine.engine.blocks.num_free_blocks == engine.engine.blocks.num_blocks
