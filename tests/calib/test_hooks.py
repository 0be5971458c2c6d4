"""Forward-hook recording of linear inputs, and the K/V-observing attention wrapper."""

import pytest
import torch
from torch import nn

from qserve.calib.errors import CalibrationError
from qserve.calib.hooks import ActivationRecorder, KVObservers, ObservingAttention
from qserve.calib.observers import Observer, make_observer
from qserve.runtime.attention import (AttentionMetadata, AttentionSpec,
                                      ContiguousCacheAttention, DenseAttention)


class Recording(Observer):
    """Keeps every tensor it is given (tests only)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def _update(self, rows, batch_amax):
        pass

    def observe(self, x):
        self.seen.append(x.clone())
        super().observe(x)

    def _amax(self):
        return torch.zeros(1)


def _toy_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def test_recorder_feeds_each_module_its_own_input():
    model = _toy_model()
    x = torch.randn(2, 5, 4)  # [batch, seq, in_features]
    want_out = model(x)
    hidden = torch.relu(model[0](x))  # input of model[2]
    modules = {"fc1": model[0], "fc2": model[2]}
    with ActivationRecorder(modules, lambda name: Recording()) as rec:
        out = model(x)
        model(x[:1, :3])
    assert torch.equal(out, want_out)  # hooks do not change the forward pass
    fc1, fc2 = rec.observers["fc1"].seen, rec.observers["fc2"].seen
    assert [t.shape for t in fc1] == [(10, 4), (3, 4)]  # [tokens, in_features]
    assert [t.shape for t in fc2] == [(10, 3), (3, 3)]
    assert all(t.dtype == torch.float32 for t in fc1 + fc2)
    assert torch.equal(fc1[0], x.reshape(10, 4)) and torch.equal(fc1[1], x[:1, :3].reshape(3, 4))
    assert torch.allclose(fc2[0], hidden.reshape(10, 3))
    assert rec.num_calls == {"fc1": 2, "fc2": 2}
    model(x)  # detached on exit
    assert len(fc1) == 2 and len(model[0]._forward_pre_hooks) == 0


def test_recorder_with_real_observers_and_remove():
    model = _toy_model()
    x = torch.randn(6, 4, dtype=torch.bfloat16)
    model = model.to(torch.bfloat16)
    rec = ActivationRecorder({"fc1": model[0], "fc2": model[2]},
                             lambda name: make_observer("minmax", dim=-1 if name == "fc2" else None))
    h = torch.relu(model[0](x))
    model(x)
    rec.remove()
    rec.remove()  # idempotent
    model(x * 100)
    assert rec.observers["fc1"].amax().item() == x.float().abs().max().item()
    assert torch.equal(rec.observers["fc2"].amax(), h.float().abs().amax(dim=0))


def test_recorder_rejects_modules_without_in_features():
    relu = nn.ReLU()
    lin = nn.Linear(2, 2)
    with pytest.raises(CalibrationError, match="in_features"):
        ActivationRecorder({"ok": lin, "act": relu}, lambda name: make_observer("minmax"))
    assert len(lin._forward_pre_hooks) == 0  # nothing left attached after the failure


def _spec(layer_idx):
    return AttentionSpec(layer_idx=layer_idx, num_heads=4, num_kv_heads=2, head_dim=3,
                         scale=3 ** -0.5)


def test_observing_attention_records_kv_per_layer_and_per_head():
    gen = torch.Generator().manual_seed(0)
    meta = AttentionMetadata.from_lengths([3, 4])
    qkv = {i: [torch.randn(7, h, 3, generator=gen) * (i + 1) for h in (4, 2, 2)] for i in (0, 1)}
    created = []

    def factory(layer_idx):
        created.append(layer_idx)
        dim = None if layer_idx == 0 else 1  # layer 0 per layer, layer 1 per kv head
        return make_observer("minmax", dim=dim), make_observer("minmax", dim=dim)

    attn = ObservingAttention(DenseAttention(), factory)
    for step in range(2):
        for i in (0, 1):
            q, k, v = qkv[i]
            out = attn.forward(_spec(i), q, k, v, meta)
            assert torch.equal(out, DenseAttention().forward(_spec(i), q, k, v, meta))
    assert created == [0, 1]  # one pair of observers per layer
    k0, v0 = qkv[0][1], qkv[0][2]
    obs0 = attn.observers[0]
    assert isinstance(obs0, KVObservers)
    assert obs0.k.amax().shape == () and obs0.k.amax().item() == k0.abs().max().item()
    assert obs0.v.amax().item() == v0.abs().max().item()
    k1, v1 = qkv[1][1], qkv[1][2]
    assert torch.equal(attn.observers[1].k.amax(), k1.abs().amax(dim=(0, 2)))  # [num_kv_heads]
    assert torch.equal(attn.observers[1].v.amax(), v1.abs().amax(dim=(0, 2)))
    assert attn.observers[1].k.scale().shape == (2,)


def test_observing_attention_passes_output_through_and_forwards_attributes():
    sentinel = torch.full((2, 4, 3), 7.0)

    class Fake:
        calls = 0

        def forward(self, spec, q, k, v, meta):
            Fake.calls += 1
            return sentinel

    k_obs, v_obs = make_observer("minmax"), make_observer("minmax")
    attn = ObservingAttention(Fake(), {5: (k_obs, v_obs)})
    q, k, v = torch.zeros(2, 4, 3), torch.ones(2, 2, 3), -2 * torch.ones(2, 2, 3)
    assert attn.forward(_spec(5), q, k, v, AttentionMetadata.single(2)) is sentinel
    assert Fake.calls == 1 and k_obs.amax().item() == 1.0 and v_obs.amax().item() == 2.0
    with pytest.raises(CalibrationError, match="layer 6"):
        attn.forward(_spec(6), q, k, v, AttentionMetadata.single(2))

    cached = ObservingAttention(ContiguousCacheAttention(),
                                lambda i: (make_observer("minmax"), make_observer("minmax")))
    cached.forward(_spec(0), torch.zeros(2, 4, 3), k, v, AttentionMetadata.single(2))
    assert cached.cached_len(0) == 2  # delegated to the inner backend
    # Decode step: only the new token's K/V are observed.
    cached.forward(_spec(0), torch.zeros(1, 4, 3), 5 * torch.ones(1, 2, 3), v[:1],
                   AttentionMetadata.single(1, context_len=2))
    assert cached.observers[0].k.amax().item() == 5.0
