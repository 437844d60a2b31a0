"""megatron-core's own cuDNN backend (dsa_kernel_backend="cudnn": FlashMLA forward, cuDNN CuTe-DSL
backward) and our native route agree on a GLM-5.3-Flash shape, both through the public hook with
MCORE_DSA_REQUIRE_FUSED=1. The benchmark's cudnn rows time this peer; this test is what makes their
numbers comparable. It skips where cudnn-frontend, cutlass-dsl or flash_mla are missing (they travel
to a GPU host as wheels: scripts/pack_cudnn_site.sh, CUDNN_SITE)."""
import pathlib
import sys

import pytest
import torch

from sparse_ref import kpool_indices, rel_l2, sparse_attention_reference

from megatron.core.transformer.experimental_attention_variant import dsa_kernels
from megatron.core.transformer.transformer_config import MLATransformerConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import cudnn_peer  # noqa: E402

SCALE = 512 ** -0.5
DEV = "cuda"


@pytest.fixture(scope="module")
def cudnn_backend():
    module, reason = cudnn_peer.load()
    if module is None:
        pytest.skip(f"needs megatron-core's cuDNN backend packages: {reason}")
    return module


def config(heads, backend):
    return MLATransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=heads,
                                kv_lora_rank=512, qk_pos_emb_head_dim=0, dsa_kernel_backend=backend)


def through_hook(backend, q, k, idx, do):
    q = q.detach().clone().requires_grad_()
    k = k.detach().clone().requires_grad_()
    out = dsa_kernels.run_fused_absorbed_sparse_attention(config(q.size(2), backend), q, k, idx,
                                                          SCALE, 512)
    assert out is not None, f"{backend} declined"
    out.backward(do)
    torch.cuda.synchronize()
    return out.detach(), q.grad, k.grad


@pytest.mark.parametrize("heads", [16, 64])
def test_cudnn_backend_matches_native_route(cudnn_backend, monkeypatch, heads):
    monkeypatch.setenv("MCORE_DSA_REQUIRE_FUSED", "1")
    monkeypatch.setenv("MCORE_DSA_TILELANG_NOPE", "native")
    sq = 4096
    g = torch.Generator(device=DEV).manual_seed(heads)
    q = torch.randn(sq, 1, heads, 512, generator=g, device=DEV).to(torch.bfloat16)
    k = torch.randn(sq, 1, 1, 512, generator=g, device=DEV).to(torch.bfloat16)
    do = torch.randn(sq, 1, heads, 512, generator=g, device=DEV).to(torch.bfloat16)
    idx = kpool_indices(sq, g, device=DEV).unsqueeze(0)  # top-k 2051, -1 where a row has fewer
    ours = through_hook("tilelang", q, k, idx, do)
    peer = through_hook("cudnn", q, k, idx, do)
    for name, a, b in zip(("out", "dq", "dk"), ours, peer):
        assert a.shape == b.shape, name
        assert torch.isfinite(b.float()).all(), f"cudnn {name} has non-finite values"
        err = rel_l2(b, a)
        assert err < 1e-2, f"{name}: cudnn vs native relative L2 {err:.2e}"
    # and both against the FP32 reference on sampled rows (a row's out and dq depend on it alone)
    rows = torch.tensor([0, 1, 5, 2050, 2051, sq - 1], device=DEV)
    qs = q[rows].float().requires_grad_()
    ref = sparse_attention_reference(qs.permute(1, 0, 2, 3), k.float().permute(1, 0, 2, 3),
                                     idx[:, rows].unsqueeze(2), SCALE).permute(1, 0, 2, 3)
    ref.backward(do[rows].float())
    for which, (out, dq, _) in (("native", ours), ("cudnn", peer)):
        assert rel_l2(out[rows], ref) < 1e-2, which
        assert rel_l2(dq[rows], qs.grad) < 1e-2, which
