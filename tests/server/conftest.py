"""Shared fixtures: a tiny Llama, an AsyncEngine over it, the app, and an ASGI client."""


import asyncio
import sys
from pathlib import Path

import pytest
import torch

from qserve.runtime.async_engine import AsyncEngine
from qserve.runtime.engine import EngineConfig, LLMEngine
from qserve.runtime.loaded_model import load

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>"
                 "{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}")
ENGINE_CONFIG = EngineConfig(num_kv_blocks=64, kv_dtype="bf16", max_num_batched_tokens=64,
                             decode_impl="eager")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    root = write_tiny_llama(tmp_path_factory.mktemp("server") / "tiny")
    cfg = root / "tokenizer_config.json"
    import json

    data = json.loads(cfg.read_text())
    data["chat_template"] = CHAT_TEMPLATE
    cfg.write_text(json.dumps(data))
    return root


@pytest.fixture(scope="session")
def lm(tiny_dir):
    return load(str(tiny_dir), torch.float32)


@pytest.fixture
def engine(lm):
    eng = AsyncEngine(LLMEngine.from_model(lm, ENGINE_CONFIG))
    yield eng
    eng.shutdown()


def run(coro):
    return asyncio.run(coro)


def client_for(app):
    import httpx

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                             timeout=60)


def sse_events(text: str) -> list[str]:
    """The data payloads of an SSE body."""
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


@pytest.fixture
def app(engine, lm):
    from qserve.runtime.server import create_app

    return create_app(engine, lm.tokenizer, "tiny")


@pytest.fixture(scope="session")
def reference(lm):
    """LLM over the same model and engine config: the greedy oracle for the server."""
    from qserve.runtime.llm import LLM

    return LLM(lm, config=ENGINE_CONFIG)


def assert_error(resp, status: int, param=None, code=None):
    """`resp` is an OpenAI error object with this status (and param / code when given)."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err

