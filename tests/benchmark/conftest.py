"""Fixtures: a tiny random Llama checkpoint (with its tiny tokenizer) for the benchmark."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from tiny_models import write_tiny_llama  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>"
                 "{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    root = write_tiny_llama(tmp_path_factory.mktemp("bench") / "tiny")
    cfg = root / "tokenizer_config.json"
    data = json.loads(cfg.read_text())
    data["chat_template"] = CHAT_TEMPLATE
    cfg.write_text(json.dumps(data))
    return root
