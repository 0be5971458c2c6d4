"""perplexity() equals a direct computation with transformers on a tiny model."""

import math
import sys
from pathlib import Path

import torch

from qserve.evals.perplexity import perplexity
from qserve.runtime.formats.checkpoint import open_checkpoint
from qserve.runtime.models.loader import load_model
from qserve.runtime.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3,
         "def f(x): return x  # Python is a programming language"]


def test_matches_transformers_full_context(tmp_path):
    from transformers import AutoModelForCausalLM

    root = write_tiny_llama(tmp_path / "tiny")
    ours = load_model(open_checkpoint(root), torch.float32)
    tok = Tokenizer.from_dir(root)
    theirs = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for text in TEXTS:
        ids = torch.tensor([tok.encode(text)])
        with torch.no_grad():
            logits = theirs(ids).logits[0, :-1]
        nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    r = perplexity(ours, tok, TEXTS, window=512, stride=256)
    assert r.num_tokens == count
    assert math.isclose(r.perplexity, math.exp(nll / count), rel_tol=1e-5)


def test_windows_and_budget(tmp_path):
    root = write_tiny_llama(tmp_path / "tiny")
    ours = load_model(open_checkpoint(root), torch.float32)
    tok = Tokenizer.from_dir(root)
    r = perplexity(ours, tok, TEXTS, window=8, stride=4, max_tokens=20)
    assert r.num_tokens == 20 and r.num_docs == 1
