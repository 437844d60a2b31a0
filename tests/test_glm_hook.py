"""GLM-5.3-Flash shapes through the hook DSAttention calls,
dsa_kernels.run_fused_absorbed_sparse_attention, with a config that selects the tilelang backend.
A recording stand-in for SparseMLA checks what the kernel receives; the output comes from the
PyTorch reference of the kernel contract so gradients flow back to the inputs.
Width 576 goes to the RoPE-tail kernels with top-k padded with -1 to a multiple of 64. Width 512
goes to the native NoPE kernels as is (0040: no 576 copy, no padded indices), or, with
MCORE_DSA_TILELANG_NOPE=padded, through #7617's zero-padding to 576 (0010)."""
import math

import pytest
import torch

from native_kernels import has, needs
from sparse_ref import D_QK, ReferenceSparseMLA, causal_random_indices

from megatron.core.transformer.experimental_attention_variant import dsa_kernels
from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa
from megatron.core.transformer.transformer_config import MLATransformerConfig


def tilelang_config(heads=16):
    return MLATransformerConfig(
        num_layers=1,
        hidden_size=256,
        num_attention_heads=heads,
        kv_lora_rank=512,
        qk_pos_emb_head_dim=0,
        dsa_kernel_backend="tilelang",
    )


class Recorder:
    """Stands in for SparseMLA: records each call's inputs, then runs the reference."""

    def __init__(self):
        self.calls = []

    def apply(self, q, kv, indices, scaling, *save_output):
        self.calls.append(dict(q=q.detach().clone(), kv=kv.detach().clone(),
                               indices=indices.clone(), scaling=scaling, save_output=save_output))
        return ReferenceSparseMLA.apply(q, kv, indices, scaling, *save_output)


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(tilelang_dsa, "SparseMLA", rec)
    monkeypatch.setattr(dsa_kernels, "_ABSORBED_FIRST_CALL_REPORTED", True)  # keep logs quiet
    monkeypatch.delenv("MCORE_DSA_REQUIRE_FUSED", raising=False)
    monkeypatch.delenv("MCORE_DSA_TILELANG_NOPE", raising=False)
    return rec


def make_inputs(width, topk, heads, sq=4, sk=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    sk = sk or topk + 37
    query = torch.randn(sq, 1, heads, width, generator=g).to(torch.bfloat16).requires_grad_()
    key = torch.randn(sk, 1, 1, width, generator=g).to(torch.bfloat16).requires_grad_()
    # distinct causal keys per row (the last sq of sk positions), -1 where a row has fewer
    idx = causal_random_indices(sq, sk, topk, g, offset=sk - sq - 40).unsqueeze(0)
    return query, key, idx


WIDTHS = [512, 576]
TOPKS = [64, 65, 127, 2051]
HEADS = [8, 16, 32, 64]  # GLM-5.3-Flash's 64 DSA heads over TP 8, 4, 2, 1


# 0150: megatron's deterministic_mode (ModelParallelConfig) reaches SparseMLA as its deterministic
# argument, the backward's choice; on both NoPE routes and the 576 kernels (whose backward has no
# deterministic form: it warns there). Without it SparseMLA gets the call it always got.
@needs("0150")
@pytest.mark.parametrize("mode", [False, True])
@pytest.mark.parametrize("width,route", [(512, "native"), (512, "padded"), (576, "native")])
def test_deterministic_mode_reaches_sparse_mla(recorder, monkeypatch, width, route, mode):
    monkeypatch.setenv("MCORE_DSA_TILELANG_NOPE", route)
    config = tilelang_config(16)
    config.deterministic_mode = mode
    query, key, idx = make_inputs(width, 65, 16)
    out = dsa_kernels.run_fused_absorbed_sparse_attention(config, query, key, idx, 0.05, 512)
    assert out is not None
    (call,) = recorder.calls
    # SparseMLA.apply(q, kv, indices, scaling, save_output, out_heads, deterministic)
    extra = call["save_output"]
    assert (len(extra) == 3 and extra[2] is True) == mode
    if not mode:
        assert len(extra) <= 1


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("topk", TOPKS)
@pytest.mark.parametrize("width,route", [(512, "native"), (512, "padded"), (576, "native")])
def test_kernel_receives_its_layout_and_grads_reach_inputs(recorder, monkeypatch, width, route, topk, heads):
    monkeypatch.setenv("MCORE_DSA_TILELANG_NOPE", route)
    query, key, idx = make_inputs(width, topk, heads)
    q0, k0, i0 = query.detach().clone(), key.detach().clone(), idx.clone()
    scale = 0.0625 + 1e-3 * width  # any caller value: it must reach the kernel unchanged
    out = dsa_kernels.run_fused_absorbed_sparse_attention(
        tilelang_config(heads), query, key, idx, scale, 512
    )
    assert out is not None, "the fused hook declined a supported GLM shape"
    assert out.shape == (query.size(0), 1, heads, 512) and out.dtype == torch.bfloat16
    assert len(recorder.calls) == 1
    call = recorder.calls[0]
    native = width == 512 and route == "native"
    # 0123: the native kernels take the caller's heads as they are (16-row tiles inside)
    kernel_heads = heads if native and has("0123") else max(heads, 16)
    kernel_width = 512 if native else D_QK
    kernel_topk = topk if native else math.ceil(topk / 64) * 64
    q, kv, ind = call["q"], call["kv"], call["indices"]
    assert q.shape == (1, query.size(0), kernel_heads, kernel_width)
    assert kv.shape == (1, key.size(0), 1, kernel_width)
    assert ind.shape == (1, query.size(0), 1, kernel_topk) and ind.dtype == torch.int32
    # the caller's data, unchanged, in the first `width` channels of the real heads
    assert torch.equal(q[0, :, :heads, :width], q0[:, 0])
    assert torch.equal(kv[0, :, 0, :width], k0[:, 0, 0])
    # zero RoPE slot where padded (512 -> 576) and zero padded heads (< 16)
    assert torch.count_nonzero(q[..., width:]) == 0
    assert torch.count_nonzero(kv[..., width:]) == 0
    assert torch.count_nonzero(q[:, :, heads:]) == 0
    # indices: the caller's, then (576 layout) -1 sentinels up to the next multiple of 64
    assert torch.equal(ind[0, :, 0, :topk], i0[0].to(torch.int32))
    assert bool((ind[..., topk:] == -1).all())
    assert call["scaling"] == scale

    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(grad)
    for t, ref in ((query, q0), (key, k0)):
        assert t.grad is not None and t.grad.shape == ref.shape
        assert torch.isfinite(t.grad.float()).all()
        assert torch.count_nonzero(t.grad) > 0
    # inputs untouched, also after backward
    assert torch.equal(query.detach(), q0) and torch.equal(key.detach(), k0) and torch.equal(idx, i0)


@pytest.mark.parametrize("heads", [8, 16, 32, 64])
def test_auto_route_takes_native_kernels_at_every_head_count(recorder, heads):
    """No MCORE_DSA_TILELANG_NOPE: the native kernels, measured faster than #7617's padding on an
    H200 at 16 kernel heads (8 heads on 16-row tiles) and up once 0050 schedules the 16-head
    backward."""
    query, key, idx = make_inputs(512, 2051, heads)
    assert dsa_kernels.run_fused_absorbed_sparse_attention(
        tilelang_config(heads), query, key, idx, 0.04, 512) is not None
    call = recorder.calls[0]
    assert (call["q"].size(-1), call["kv"].size(-1), call["indices"].size(-1)) == (512, 512, 2051)
    # 0060: out/lse kept for backward where the hook's output is the kernel's (no padded heads);
    # 0107: with padded heads too, keeping only the caller's heads
    if has("0123"):  # the caller's heads as they are: nothing to drop
        assert call["save_output"] == (True,)
    elif has("0107"):
        assert call["save_output"] == ((True,) if heads >= 16 else (True, heads))
    else:
        assert call["save_output"] == (heads >= 16,)


def _declines(recorder, query, key, idx, v_channels=512, heads=None):
    cfg = tilelang_config(heads or query.size(2))
    out = dsa_kernels.run_fused_absorbed_sparse_attention(cfg, query, key, idx, 0.04, v_channels)
    return out is None and not recorder.calls


@pytest.mark.parametrize("width", [128, 320, 544, 640])
def test_declines_other_widths(recorder, width):
    query, key, idx = make_inputs(width, 64, 16)
    assert _declines(recorder, query, key, idx)


def test_declines_other_value_width(recorder):
    query, key, idx = make_inputs(512, 64, 16)
    assert _declines(recorder, query, key, idx, v_channels=448)


def test_declines_mismatched_query_key_width(recorder):
    query, _, idx = make_inputs(512, 64, 16)
    _, key, _ = make_inputs(576, 64, 16)
    assert _declines(recorder, query, key, idx)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_declines_non_bf16(recorder, dtype):
    query, key, idx = make_inputs(512, 65, 16)
    assert _declines(recorder, query.detach().to(dtype), key.detach().to(dtype), idx)


@pytest.mark.parametrize("heads", [24, 48, 96])
def test_declines_head_counts_the_kernel_cannot_tile(recorder, heads):
    query, key, idx = make_inputs(512, 2051, heads)
    assert _declines(recorder, query, key, idx)


def test_declines_grouped_kv(recorder):
    query, key, idx = make_inputs(512, 65, 16)
    key2 = key.detach().expand(-1, -1, 2, -1).contiguous()
    assert _declines(recorder, query, key2, idx)


def test_declines_empty_topk(recorder):
    query, key, _ = make_inputs(512, 64, 16)
    idx = torch.empty((1, query.size(0), 0), dtype=torch.int32)
    assert _declines(recorder, query, key, idx)


def test_declines_without_tilelang(monkeypatch):
    """No kernel importable (SparseMLA is None): decline, never crash."""
    monkeypatch.setattr(tilelang_dsa, "SparseMLA", None)
    monkeypatch.setattr(dsa_kernels, "_ABSORBED_FIRST_CALL_REPORTED", True)
    monkeypatch.delenv("MCORE_DSA_REQUIRE_FUSED", raising=False)
    query, key, idx = make_inputs(512, 2051, 16)
    assert dsa_kernels.run_fused_absorbed_sparse_attention(
        tilelang_config(), query, key, idx, 0.04, 512) is None
