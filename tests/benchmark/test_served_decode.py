"""The served-decode benchmark: argument checks, its rate window, its step timer on a tiny
engine, and its stream reader against the tiny model served in-process."""

import asyncio
import json
import sys
import threading
from pathlib import Path

import pytest
import torch

from qserve.runtime.benchmark.served_decode import (StreamTimes, _served, main, read_event,
                                                    step_times, window_rate)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama  # noqa: E402


@pytest.mark.parametrize("argv", [["--batch", "1,x"], ["--tokens", "4"], ["--batch", "0"],
                                  ["--batch", "65"], ["--rounds", "0"],
                                  ["--baseline-tree", "/nonexistent"]])
def test_bad_arguments_are_refused_before_loading(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    err = capsys.readouterr().err
    assert "--batch" in err or "--tokens" in err or "streams" in err or "--baseline" in err


def test_window_rate_counts_only_while_every_stream_decodes():
    # stream a: chunks at 0..10 s; stream b starts at 2 s and ends at 8 s
    a = StreamTimes(chunks=[float(t) for t in range(11)], tokens=11)
    b = StreamTimes(chunks=[2.0, 4.0, 6.0, 8.0], tokens=4)
    # window (2, 8]: a's chunks 3..8 (6), b's 4, 6, 8 (3) over 6 s
    assert window_rate([a, b]) == pytest.approx(9 / 6)
    assert a.itl == [1.0] * 10
    # no window where both decode: 0
    assert window_rate([StreamTimes([0.0, 1.0], 2), StreamTimes([2.0, 3.0], 2)]) == 0.0


def test_a_token_whose_text_is_error_or_usage_is_a_chunk_not_an_event():
    res = StreamTimes()
    for t, text in enumerate(["error", "usage", " the"]):
        chunk = {"id": "c", "choices": [{"index": 0, "text": text, "finish_reason": None}]}
        read_event(res, b"data: " + json.dumps(chunk).encode() + b"\n", float(t))
    read_event(res, b'data: {"id": "c", "choices": [{"index": 0, "text": "", '
                    b'"finish_reason": "length"}]}\n', 3.0)
    read_event(res, b'data: {"id": "c", "choices": [], "usage": {"prompt_tokens": 2, '
                    b'"completion_tokens": 3, "total_tokens": 5}}\n', 4.0)
    read_event(res, b"data: [DONE]\n", 5.0)
    assert (res.chunks, res.tokens, res.error) == ([0.0, 1.0, 2.0], 3, "")
    read_event(res, b'data: {"error": {"message": "engine died", "type": "server_error"}}\n',
               6.0)
    assert "engine died" in res.error


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from qserve.runtime.engine import EngineConfig
    from qserve.runtime.loaded_model import load

    torch.set_num_threads(1)
    lm = load(str(write_tiny_llama(tmp_path_factory.mktemp("sd") / "tiny")), torch.float32)
    config = EngineConfig(num_kv_blocks=64, kv_dtype="bf16", max_num_batched_tokens=64,
                          decode_impl="eager")
    return lm, config


def test_step_times_are_the_decode_steps_of_the_whole_batch(tiny):
    from qserve.runtime.engine import LLMEngine
    from qserve.runtime.sampling_params import SamplingParams

    lm, config = tiny
    engine = LLMEngine.from_model(lm, config)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    times = step_times(engine, [[5, 6, 7], [8, 9, 10, 11]], params)
    # one prefill step gives both first tokens; then 9 decode steps, the last finishes both
    assert len(times) == 8 and all(t > 0 for t in times)
    assert not engine.has_unfinished


def test_served_streams_are_timed_chunk_by_chunk(tiny):
    import uvicorn

    from qserve.runtime.async_engine import AsyncEngine
    from qserve.runtime.benchmark.server_process import free_port
    from qserve.runtime.engine import LLMEngine
    from qserve.runtime.server import create_app

    lm, config = tiny
    engine = AsyncEngine(LLMEngine.from_model(lm, config))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, lm.tokenizer, "m"),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            threading.Event().wait(0.05)
        streams = asyncio.run(_served(f"http://127.0.0.1:{port}", "m",
                                      [[5, 6, 7], [8, 9, 10, 11]], 12))
        for s in streams:
            assert s.error == "" and s.tokens == 12
            # a chunk per token but where the detokenizer held one back
            assert 2 <= len(s.chunks) <= 12 and s.chunks == sorted(s.chunks)
        bad = asyncio.run(_served(f"http://127.0.0.1:{port}", "other", [[5, 6]], 12))
        assert bad[0].error.startswith("HTTP 404")
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()
