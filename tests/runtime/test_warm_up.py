"""The server's warm-up (runtime/warm_up.py): a 256-token prompt, then a decode batch of
two; on a KV pool too small for 256 tokens (a small --kv-cache-gib), the longest
power-of-two prompt the pool holds instead of a failed start."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from qserve.runtime.engine import EngineConfig
from qserve.runtime.llm import LLM
from qserve.runtime.warm_up import LONG_PROMPT, warm_up

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("warm") / "t"))


@pytest.mark.parametrize("num_kv_blocks, longest", [(64, LONG_PROMPT), (8, 64), (3, 32)])
def test_warm_up_fits_the_pool(tiny, num_kv_blocks, longest, monkeypatch):
    llm = LLM(tiny, dtype=torch.float32,
              config=EngineConfig(num_kv_blocks=num_kv_blocks, block_size=16))
    engine = llm.engine
    prompts = {}
    real_add = engine.add_request
    monkeypatch.setattr(engine, "add_request",
                        lambda rid, ids, params, **kw: prompts.setdefault(rid, len(ids))
                        and real_add(rid, ids, params, **kw))
    warm_up(engine, llm.lm.tokenizer)
    assert prompts["warmup-long"] == longest
    assert {"warmup-0", "warmup-1"} <= set(prompts)
    assert not engine.has_unfinished and engine.tokens_computed >= longest
