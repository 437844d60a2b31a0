"""wip/0127 (issue #21, a draft outside the series): the host side of the deterministic backward
with a fixed-point scale for each key. Its kernels need a GPU (tests/gpu); the scales that keep
every lane's sum in range are plain torch, checked here on CPU. Skips while the draft is not
applied to the tree under test."""

import pytest
import torch

from native_kernels import bwd_mod

pytestmark = pytest.mark.skipif(
    not hasattr(bwd_mod, "_key_scales"), reason="wip/0127 (_key_scales) is not applied"
)

# headroom of a key's scaled bound: a lane's final sum (int32x2), every partial sum (fp32)
HEADROOM = {"int32x2": 2**30, "fp32": 2**23}


@pytest.mark.parametrize("form", sorted(HEADROOM))
@pytest.mark.parametrize("u", [-20, 0, 17])
def test_key_scales_use_the_headroom_and_stay_within_it(form, u):
    counts = torch.tensor(
        [[0, 1, 2, 3, 2**20 + 7, 2**40 - 1, 2**40, 2**53 + 1, 2**61 + 12345]], dtype=torch.int64
    )
    scale, inv = bwd_mod._key_scales(counts, torch.tensor([2.0**u]), form)
    assert scale.dtype == inv.dtype == torch.float32 and scale.shape == counts.shape
    bound = counts.double() * 2.0**-u  # what the first pass bounded, in real units
    scaled = bound * scale.double()
    assert (scaled < HEADROOM[form]).all()
    selected = counts > 0
    assert (scaled[selected] >= HEADROOM[form] / 4).all(), "more than 2 bits of headroom unused"
    assert scale[0, 0] == 1 and inv[0, 0] == 1  # no query selected the key
    # powers of two, each the other's inverse: the postprocess undoes the scale exactly
    assert torch.equal(scale.double() * inv.double(), torch.ones_like(bound))
    assert torch.equal(torch.frexp(scale)[0], torch.full_like(scale, 0.5))


def test_key_scales_are_nan_where_the_bound_is_not_finite():
    counts = torch.tensor([[0, 5, 2**30]], dtype=torch.int64)
    scale, inv = bwd_mod._key_scales(counts, torch.tensor([float("nan")]), "int32x2")
    assert torch.isnan(inv).all() and torch.isfinite(scale).all()


def test_key_bound_scale_keeps_the_bound_sum_in_int64():
    g = torch.Generator().manual_seed(0)
    s, h, d = 64, 16, 512
    q = torch.randn(1, s, h, d, generator=g).bfloat16()
    kv = torch.randn(1, s, 1, d, generator=g).bfloat16()
    do = (torch.randn(1, s, h, d, generator=g) * 1e-4).bfloat16()
    delta = torch.randn(1, s, h, generator=g) * 1e-3
    unit = bwd_mod._key_bound_scale(q, kv, do, delta, d**-0.5)
    assert unit.shape == (1,) and unit.dtype == torch.float32
    assert torch.frexp(unit)[0].item() == 0.5  # a power of two
    # a query's term is at most H x the per-pair bound: S of them, rounded up, below 2^62
    a = torch.linalg.vector_norm(do.float(), dim=-1).max()
    b = torch.linalg.vector_norm(kv.float(), dim=-1).max()
    per_pair = (
        a * b + delta.abs().max()
    ) * d**-0.5 * q.float().abs().max() + do.float().abs().max()
    total = s * (h * per_pair * 1.001 * unit.double() + 1)
    assert 2**59 < total < 2**62, "the unit wastes more than 3 bits"
    nan = bwd_mod._key_bound_scale(
        q, kv, do.float().masked_fill(do.float() > 0, float("inf")).bfloat16(), delta, 1.0
    )
    assert torch.isnan(nan).all()
