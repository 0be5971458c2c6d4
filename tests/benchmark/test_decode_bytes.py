"""What a decode step reads, counted from an artifact's safetensors headers."""

import json

import pytest
import torch
from safetensors.torch import save_file

from qserve.runtime.benchmark.decode_bytes import main, weight_bytes
from qserve.runtime.decode_rate import decode_rates


def _checkpoint(root, tie: bool, head: bool):
    root.mkdir()
    tensors = {"model.embed_tokens.weight": torch.zeros(10, 4, dtype=torch.bfloat16),  # 80 B
               "model.layers.0.mlp.down_proj.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn),
               "model.layers.0.mlp.down_proj.weight_scale": torch.zeros(4)}  # 16 + 16 B
    if head:
        tensors["lm_head.weight"] = torch.zeros(10, 4, dtype=torch.int8)  # 40 B
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                  "tie_word_embeddings": tie}))
    return root


@pytest.mark.parametrize("tie,head,per_step", [
    (True, False, 112),   # the embedding is the head: read whole every step
    (False, True, 72),    # a head of its own: the embedding gives one row a token
    (True, True, 72),     # tied in the source, but the artifact stores its own head
])
def test_the_embedding_counts_only_where_it_is_the_head(tmp_path, tie, head, per_step):
    w = weight_bytes(_checkpoint(tmp_path / "a", tie, head))
    assert (w.per_step, w.embedding, w.total) == (per_step, 80, 112 + 40 * head)


def test_not_a_checkpoint_is_named_not_a_traceback(tmp_path):
    with pytest.raises(SystemExit, match="decode_bytes: .*no such file"):
        main([str(tmp_path / "missing")])


@pytest.mark.parametrize("kw", [{"tokens": 1}, {"reps": 0}, {"batches": ()}, {"batches": (0,)}])
def test_decode_rates_refuses_bad_arguments_before_loading(kw):
    with pytest.raises(ValueError, match="decode_rates"):
        decode_rates("no-such-artifact", **kw)
