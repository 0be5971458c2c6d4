"""Sampler and SamplingParams: exact masks, penalty formulas, seeds, and distribution."""

import math

import pytest
import torch

from qserve.runtime.sampler import (Sampler, SamplingState, TokenLogprobs, apply_min_p,
                                    apply_penalties, apply_top_k, apply_top_p, prompt_logprobs)
from qserve.runtime.sampling_params import SamplingParams

NEG_INF = float("-inf")


def states(*params, prompt=(1, 2, 3)):
    return [SamplingState(p, prompt) for p in params]


def random_logits(b, v, seed=0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


# ---------------------------------------------------------------- SamplingParams
def test_params_defaults_and_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[7], top_k=-1)
    assert p.stop == ("###",) and p.stop_token_ids == (7,) and p.top_k == 0
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy
    assert not SamplingParams().needs_penalties
    assert SamplingParams(repetition_penalty=1.2).needs_penalties


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens must be a positive integer"),
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature must be a number"),
    ({"top_k": -2}, "top_k must be"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
    ({"stop": ["ok", ""]}, "stop must hold non-empty strings"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must hold token ids"),
    ({"logprobs": 21}, r"logprobs must be None or an integer in \[0, 20\]"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be None"),
    ({"prompt_logprobs_from": -1}, "prompt_logprobs_from must be an integer >= 0"),
    ({"prompt_logprobs_from": 1.5}, "prompt_logprobs_from must be an integer >= 0"),
    ({"n": 0}, "n must be a positive integer"),
    ({"n": 0}, "n must be a positive integer"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
])
def test_params_validation_messages(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


# ---------------------------------------------------------------- masks and penalties
def test_top_p_mask_on_a_hand_made_distribution():
    logits = torch.tensor([[0.5, 0.25, 0.15, 0.1]]).log()
    keep = lambda p: torch.isfinite(apply_top_p(logits, torch.tensor([p]))).tolist()[0]
    assert keep(0.7) == [True, True, False, False]  # 0.5 < 0.7 -> the 0.25 token stays
    assert keep(0.5) == [True, False, False, False]  # mass above the 0.25 token is 0.5
    assert keep(0.8) == [True, True, True, False]
    assert keep(0.95) == [True, True, True, True]
    assert keep(0.01) == [True, False, False, False]
    assert keep(1.0) == [True] * 4
    # row-wise, and the kept logits are unchanged
    two = torch.cat([logits, logits.flip(1)])
    out = apply_top_p(two, torch.tensor([0.7, 1.0]))
    assert out[0, :2].tolist() == logits[0, :2].tolist()
    assert out[0, 2:].tolist() == [NEG_INF, NEG_INF]
    assert out[1].tolist() == logits.flip(1)[0].tolist()


def test_min_p_and_top_k_masks():
    logits = torch.tensor([[0.5, 0.25, 0.15, 0.1]]).log()
    keep = lambda m: torch.isfinite(apply_min_p(logits, torch.tensor([m]))).tolist()[0]
    assert keep(0.3) == [True, True, True, False]  # threshold 0.15: 0.15 kept, 0.1 not
    assert keep(0.5) == [True, True, False, False]
    assert keep(0.0) == [True] * 4
    x = torch.tensor([[1.0, 4.0, 3.0, 3.0, 0.0], [1.0, 4.0, 3.0, 2.0, 0.0]])
    out = apply_top_k(x, torch.tensor([2, 0]))
    assert out[0].tolist() == [NEG_INF, 4.0, 3.0, 3.0, NEG_INF]  # ties at the k-th stay
    assert out[1].tolist() == x[1].tolist()  # 0 disables


def test_penalty_formulas_exact():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    out = apply_penalties(logits, prompt_token_ids=[[0], [0]], output_token_ids=[[1, 1, 2], []],
                          repetition=torch.tensor([2.0, 1.0]),
                          frequency=torch.tensor([0.5, 0.5]), presence=torch.tensor([0.25, 0.25]))
    # row 0: rep: 2/2, -1*2, 0.5/2, 3; freq 0.5*count, presence 0.25 for tokens 1 and 2
    assert out[0].tolist() == [1.0, -2.0 - 1.0 - 0.25, 0.25 - 0.5 - 0.25, 3.0]
    assert out[1].tolist() == [2.0, -1.0, 0.5, 3.0]  # no output, repetition 1: unchanged
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 3.0]  # input untouched


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    st = states(SamplingParams(temperature=0, frequency_penalty=0.2))[0]
    assert Sampler()(logits, [st]).token_ids == [0]
    st.append_output(0)
    assert Sampler()(logits, [st]).token_ids == [1]
    rep = SamplingState(SamplingParams(temperature=0, repetition_penalty=1.5), prompt_token_ids=[0])
    assert Sampler()(logits, [rep]).token_ids == [1]  # 3.0 / 1.5 = 2.0 < 2.9


# ---------------------------------------------------------------- sampling
def test_greedy_is_exact_argmax():
    logits = random_logits(5, 50)
    out = Sampler()(logits, states(*[SamplingParams(temperature=0)] * 5))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5


def test_top_k_1_equals_greedy():
    logits = random_logits(6, 40, seed=1)
    out = Sampler(torch.Generator().manual_seed(0))(
        logits, states(*[SamplingParams(temperature=1.5, top_k=1)] * 6))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_alone_or_batched():
    logits = random_logits(4, 64, seed=2)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def run(batch_rows, param_list, steps=8):
        sts = states(*param_list)
        sampler = Sampler()
        seq = []
        for _ in range(steps):
            out = sampler(logits[batch_rows], sts)
            seq.append(out.token_ids)
            for s, t in zip(sts, out.token_ids):
                s.append_output(t)
        return seq

    alone = [step[0] for step in run([0], [seeded])]
    again = [step[0] for step in run([0], [seeded])]
    batched = [step[1] for step in run([3, 0, 1], [SamplingParams(temperature=0.7, top_p=0.9),
                                                 seeded, SamplingParams(temperature=0)])]
    assert alone == again == batched
    assert len(set(alone)) > 1  # really sampled, not constant
    other = [step[0] for step in run([0], [SamplingParams(temperature=1.0, seed=99)])]
    assert other != alone


def test_masks_applied_in_the_sampler():
    copies = 50  # many rows per call rather than many calls: small ops are slow here
    logits = torch.tensor([[0.5, 0.25, 0.15, 0.1]]).log().repeat(4 * copies, 1)
    params = [SamplingParams(top_p=0.5), SamplingParams(min_p=0.6),
              SamplingParams(top_k=2, temperature=0.5),
              SamplingParams(top_p=0.7, min_p=0.6)] * copies
    sampler = Sampler(torch.Generator().manual_seed(0))
    seen = [set() for _ in range(4)]
    for _ in range(2):
        for row, t in enumerate(sampler(logits, states(*params)).token_ids):
            seen[row % 4].add(t)
    assert seen == [{0}, {0}, {0, 1}, {0}]


def test_temperature_sampling_follows_softmax_chi_square():
    logits = torch.tensor([[1.0, 0.0, -0.5, 0.7, -2.0]])
    temperature = 0.8
    expected = torch.softmax(logits[0] / temperature, -1)
    n = 4000
    batch = 500
    sampler = Sampler(torch.Generator().manual_seed(7))
    st = states(*[SamplingParams(temperature=temperature)] * batch)
    counts = torch.zeros(5)
    for _ in range(n // batch):
        ids = sampler(logits.repeat(batch, 1), st).token_ids
        counts += torch.bincount(torch.tensor(ids), minlength=5)
    chi2 = float(((counts - n * expected) ** 2 / (n * expected)).sum())
    assert chi2 < 18.47  # 4 degrees of freedom, p = 0.001


def test_logprobs_are_raw_log_softmax():
    logits = random_logits(3, 30, seed=3)
    params = [SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.3),
              SamplingParams(temperature=0.9, seed=5),
              SamplingParams(temperature=0.9, seed=6, logprobs=0)]
    out = Sampler()(logits, states(*params))
    ref = torch.log_softmax(logits, -1)
    lp0 = out.logprobs[0]
    assert lp0.token_id == out.token_ids[0]
    assert lp0.logprob == ref[0, out.token_ids[0]].item()
    top = torch.topk(ref[0], 3)
    assert lp0.top == list(zip(top.indices.tolist(), top.values.tolist()))
    assert out.logprobs[1] is None
    assert out.logprobs[2] == TokenLogprobs(out.token_ids[2], ref[2, out.token_ids[2]].item(), [])


def test_prompt_logprobs():
    logits = random_logits(4, 20, seed=4)  # rows after tokens 0..3; the last predicts past
    prompt = [5, 9, 0, 19]
    out = prompt_logprobs(logits, prompt, num_top=2)
    ref = torch.log_softmax(logits, -1)
    assert out[0] is None and len(out) == 4
    for j in range(1, 4):
        assert out[j].token_id == prompt[j]
        assert out[j].logprob == ref[j - 1, prompt[j]].item()
        top = torch.topk(ref[j - 1], 2)
        assert out[j].top == list(zip(top.indices.tolist(), top.values.tolist()))
    assert prompt_logprobs(logits[:3], prompt) == [None] + [
        TokenLogprobs(prompt[j], ref[j - 1, prompt[j]].item(), []) for j in range(1, 4)]
    assert math.isclose(sum(math.exp(v) for v in ref[0].tolist()), 1.0, rel_tol=1e-5)
    with pytest.raises(ValueError, match="prompt logits must be"):
        prompt_logprobs(logits[:2], prompt)


def test_sampler_rejects_bad_input():
    with pytest.raises(ValueError, match="fp32 logits"):
        Sampler()(torch.zeros(1, 4, dtype=torch.bfloat16), states(SamplingParams()))
    with pytest.raises(ValueError, match="one row per state"):
        Sampler()(torch.zeros(2, 4), states(SamplingParams()))
