"""Numerics on CPU: the patched fused hook, with the PyTorch reference of the SparseMLA kernel
contract plugged in as the kernel, against megatron-core's own dense fallback
(dsa._unfused_absorbed_dsa_fn) on the unpadded inputs, forward and backward."""
import pytest
import torch

from sparse_ref import (
    KPOOL_WIDTH,
    ReferenceSparseMLA,
    causal_random_indices,
    default_scale,
    kpool_indices,
    rel_l2,
)

from megatron.core.transformer.experimental_attention_variant import dsa, dsa_kernels
from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa
from test_glm_hook import tilelang_config

# bf16 inputs and outputs on both sides; the two compute in fp32 but round differently
TOL = 1e-2


@pytest.fixture(autouse=True)
def reference_kernel(monkeypatch):
    monkeypatch.setattr(tilelang_dsa, "SparseMLA", ReferenceSparseMLA)
    monkeypatch.setattr(dsa_kernels, "_ABSORBED_FIRST_CALL_REPORTED", True)
    monkeypatch.delenv("MCORE_DSA_REQUIRE_FUSED", raising=False)
    monkeypatch.delenv("MCORE_DSA_TILELANG_NOPE", raising=False)
    ReferenceSparseMLA.calls.clear()


@pytest.fixture(params=["native", "padded"])
def route(request, monkeypatch):
    """Both NoPE routes: the native 512 kernels (default) and #7617's zero-padding to 576."""
    monkeypatch.setenv("MCORE_DSA_TILELANG_NOPE", request.param)
    return request.param


def fused_and_dense(query, key, idx, scale, grad):
    """Run both paths on the same leaf inputs; return (out, dq, dk) for each."""
    results = []
    for fused in (True, False):
        q = query.detach().clone().requires_grad_()
        k = key.detach().clone().requires_grad_()
        if fused:
            out = dsa_kernels.run_fused_absorbed_sparse_attention(
                tilelang_config(q.size(2)), q, k, idx, scale, 512)
            assert out is not None, "fused hook declined"
        else:
            out = dsa._unfused_absorbed_dsa_fn(q, k, idx, scale, 512)
        out.backward(grad)
        results.append((out.detach(), q.grad, k.grad))
    assert ReferenceSparseMLA.calls, "the reference kernel was not called"
    return results


def check_close(fused, dense, tol=TOL):
    for name, a, b in zip(("out", "dq", "dk"), fused, dense):
        assert torch.isfinite(a.float()).all(), name
        err = rel_l2(a, b)
        assert err < tol, f"{name}: relative L2 error {err:.2e} >= {tol}"


def inputs(sq, sk, heads, width, seed):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(sq, 1, heads, width, generator=g).to(torch.bfloat16)
    key = torch.randn(sk, 1, 1, width, generator=g).to(torch.bfloat16)
    grad = torch.randn(sq, 1, heads, 512, generator=g).to(torch.bfloat16)
    return query, key, grad, g


@pytest.mark.parametrize("width", [512, 576])
@pytest.mark.parametrize("topk,heads", [(64, 16), (65, 8), (127, 32)])
def test_fused_matches_dense_fallback(width, topk, heads, route):
    query, key, grad, g = inputs(160, 160, heads, width, seed=topk + heads)
    idx = causal_random_indices(160, 160, topk, g).unsqueeze(0)
    fused, dense = fused_and_dense(query, key, idx, default_scale(width), grad)
    check_close(fused, dense)


def test_glm_kpool_2051_causal_matches_dense_fallback(route):
    """GLM-5.3-Flash: width 512, 16 heads, 2051-wide causal k-pool indices at 2200 tokens, so
    early rows hold far fewer keys than the width and late rows pick 512 of their pools."""
    sq = 2200
    query, key, grad, g = inputs(sq, sq, 16, 512, seed=7)
    idx = kpool_indices(sq, g).unsqueeze(0)
    valid = (idx >= 0).sum(-1)
    assert idx.size(-1) == KPOOL_WIDTH and int(valid.min()) < 64 and int(valid.max()) > 2048
    fused, dense = fused_and_dense(query, key, idx, default_scale(512), grad)
    check_close(fused, dense)
    # native: 512 wide, the 2051 width as is; padded: 576 wide, 2051 padded to 2112 with -1
    want = (512, 2051) if route == "native" else (576, 2112)
    assert (ReferenceSparseMLA.calls[0][0][-1], ReferenceSparseMLA.calls[0][2][-1]) == want


def test_row_without_valid_index_gives_zero_output_and_gradient(route):
    query, key, grad, g = inputs(96, 96, 16, 512, seed=3)
    idx = causal_random_indices(96, 96, 65, g).unsqueeze(0)
    idx[0, 10] = -1
    idx[0, 50] = -1
    fused, dense = fused_and_dense(query, key, idx, default_scale(512), grad)
    check_close(fused, dense)
    out, dq, _ = fused
    for row in (10, 50):
        assert torch.count_nonzero(out[row]) == 0 and torch.count_nonzero(dq[row]) == 0
    assert torch.count_nonzero(out[11]) > 0
