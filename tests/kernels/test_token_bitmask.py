"""The token-mask kernel against the torch reference and the grammar engine's own: the
same logits, bit for bit, for permissive, restrictive and mixed masks, a vocabulary that
is not a multiple of 32, and a subset of rows."""

import pytest
import torch

from qserve.kernels import native_token_bitmask as tb


@pytest.mark.parametrize("vocab", [49152, 1000, 37])
@pytest.mark.parametrize("kind", ["restrictive", "permissive", "random"])
def test_the_kernel_equals_the_references(vocab, kind):
    g = torch.Generator().manual_seed(vocab)
    rows, width = 6, (vocab + 31) // 32
    if kind == "restrictive":
        mask = torch.zeros(rows, width, dtype=torch.int32)
        mask[:, 0] = 0b1011
    elif kind == "permissive":
        mask = torch.full((rows, width), -1, dtype=torch.int32)
        mask[:, -1] = 0x7FFF0000 if vocab > 32 else 0
    else:
        mask = torch.randint(-2**31, 2**31 - 1, (rows, width), generator=g, dtype=torch.int64
                             ).to(torch.int32)
    logits = torch.randn(rows, vocab, generator=g)
    chosen = [0, 2, 5]
    got, want = logits.clone(), logits.clone()
    assert tb.available()
    tb.apply_token_bitmask(got, mask, chosen)
    tb.apply_token_bitmask_reference(want, mask, chosen)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 3, 4]], logits[[1, 3, 4]])  # other rows untouched
    import xgrammar as xgr

    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, mask, indices=chosen)
    assert torch.equal(got, theirs)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="fp32"):
        tb.apply_token_bitmask(torch.zeros(2, 64, dtype=torch.bfloat16),
                               torch.zeros(2, 2, dtype=torch.int32), [0])
    with pytest.raises(ValueError, match="int32"):
        tb.apply_token_bitmask(torch.zeros(2, 64), torch.zeros(2, 1, dtype=torch.int32), [0])
    with pytest.raises(ValueError, match="rows"):
        tb.apply_token_bitmask(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), [2])
