"""The fused hook's routing, with fake kernel objects (a PyTorch implementation of the kernel
contract) in place of the compiled kernels, on CPU. Width 512 reaches the kernels with the
caller's own storage (no 576 copy, no -1 padded indices copy, no padded KV copy) and dq/dkv come
back 512 wide; width 576 takes the old path (RoPE-tail kernels, indices padded to a multiple of
64). The build arguments each head count gets (0050's schedule, 0070's warp-specialized forward)
and the A/B options of NativeKernelOptions. The generated code itself: test_kernel_codegen.py.
"""
import collections
import types

import pytest
import torch
import torch.utils._python_dispatch

from native_kernels import (
    BLOCK_I,
    BWD_BLOCK,
    D_V,
    TAIL,
    _has_option,
    bwd_mod,
    dsa_kernels,
    fwd_mod,
    fwd_ws64_route_kwargs,
    has,
    needs,
    needs_draft,
    needs_tilelang,
    round_up as _round_up,
    sparse_mla,
)
from sparse_ref import causal_random_indices, sparse_attention_reference

from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa

# kernel calls of one fwd+bwd on the native route: 0060 keeps out/lse (no forward recompute)
NATIVE_CALLS = ["fwd", "bwd"] if has("0060") else ["fwd", "fwd", "bwd"]


def options(**changes):
    """NativeKernelOptions changed for a block (0050 and later)."""
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_utils

    return tilelang_utils.override_native_kernel_options(**changes)


LOG2E = 1.4426950408889634


def _attend(q, kv, indices, scale):
    """Kernel contract in fp32: q [b,s,h,W], kv [b,sk,1,W], indices [b,s,1,K] (-1 masked)."""
    return sparse_attention_reference(q.float(), kv.float(), indices, scale, d_v=D_V)


def _lse_log2(q, kv, indices, scale):
    idx = indices[:, :, 0].long()
    valid = idx >= 0
    scores = torch.einsum("bshd,bkd->bhsk", q.float(), kv[:, :, 0].float()) * scale
    g = idx.clamp(min=0).unsqueeze(1).expand(-1, q.size(2), -1, -1)
    logits = scores.gather(-1, g).masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [b, h, s]
    lse = torch.where(torch.isfinite(lse), lse * LOG2E, torch.zeros_like(lse))
    return lse.permute(0, 2, 1).contiguous()


def _bwd_from_lse_delta(q, kv, do, indices, lse, delta, scale):
    """The backward kernel's contract in fp32 from the lse (log2) and delta it is given, not
    recomputed ones: P = 2^(scale log2(e) q.k - lse) over the valid indices, dS = P (dO.v -
    delta) scale; dq = dS k, dk = dS^T q (+ P^T dO in the value columns). Returns dq [b,s,h,W]
    and dk [b,sk,1,W]."""
    qf, kf, dof = q.float(), kv[:, :, 0].float(), do.float()
    b, sk, w = kf.shape
    idx = indices[:, :, 0].long()  # [b, s, K]
    valid = (idx >= 0) & (idx < sk)
    rows = idx.clamp(0, sk - 1) + (torch.arange(b) * sk).view(b, 1, 1)
    kg = kf.reshape(b * sk, w)[rows]  # [b, s, K, W]
    p = torch.exp2(torch.einsum("bshw,bskw->bshk", qf, kg) * scale * LOG2E - lse.unsqueeze(-1))
    p = p * valid.unsqueeze(2)
    dp = torch.einsum("bshd,bskd->bshk", dof, kg[..., :D_V])
    ds = p * (dp - delta.float().unsqueeze(-1)) * scale
    dq = torch.einsum("bshk,bskw->bshw", ds, kg)
    dkg = torch.einsum("bshk,bshw->bskw", ds, qf)
    dkg[..., :D_V] += torch.einsum("bshk,bshd->bskd", p, dof)
    dk = torch.zeros(b * sk, w).index_add_(0, rows[valid], dkg[valid])
    return dq, dk.view(b, sk, 1, w)


def _line_order(width):
    """0106's line order, written out independently of the kernel module: within each 16
    columns, the MMA fragment's column pairs (2r, 2r + 1) and (8 + 2r, 9 + 2r) of lane group r
    are stored at 4r .. 4r + 3. Returns where each column is stored."""
    where = []
    for d in range(width):
        group, h, r, e = d // 16, (d % 16) // 8, (d % 8) // 2, d % 2
        where.append(16 * group + 4 * r + 2 * h + e)
    return torch.tensor(where)


def _to_lines(x):
    out = torch.empty_like(x)
    out[..., _line_order(x.size(-1))] = x
    return out


def _from_lines(x):
    return x[..., _line_order(x.size(-1))]


class KernelFakes:
    """Stands in for the compiled kernels: records what the kernel getters and kernel calls
    receive and computes the kernel contract in PyTorch."""

    def __init__(self, scale_holder):
        self.builds = []
        self.calls = []
        self.scale = scale_holder

    def _check_topk(self, topk, indices, topk_dynamic):
        width = indices.size(-1)
        assert (width <= topk) if topk_dynamic else (width == topk)

    def get_fwd(self, heads, dim, tail_dim, topk, kv_group, sm_scale, block_I, num_stages,
                threads, topk_dynamic=False, **extra):
        self.builds.append(dict(kind="fwd", heads=heads, dim=dim, tail_dim=tail_dim, topk=topk,
                                topk_dynamic=topk_dynamic, threads=threads, **extra))

        runtime_scale = extra.get("runtime_scale", False)

        def kernel(q, kv, indices, *scale):
            self._check_topk(topk, indices, topk_dynamic)
            assert q.size(-1) == kv.size(-1) == dim + tail_dim
            # 0108: a kernel built with runtime_scale takes the scale at each call (and only
            # then); the fake computes with that one, not the one the getter saw
            assert len(scale) == (1 if runtime_scale else 0)
            s = scale[0] if runtime_scale else sm_scale
            self.calls.append(dict(kind="fwd", q=q, kv=kv, indices=indices, scale=s))
            out = _attend(q, kv, indices, s).to(q.dtype)
            return out, _lse_log2(q, kv, indices, s)

        return kernel

    def get_fwd_ws(self, heads, dim, topk, sm_scale, block_I, num_buffers, qk_chains=4, ctas=0,
                   runtime_scale=False, **drafts):
        # drafts: 0161's fast_exp2 (passed only when on, its default), which changes no result
        assert set(drafts) <= {"fast_exp2"}, drafts
        kernel = self.get_fwd(heads, dim, 0, topk, 1, sm_scale, block_I, None, 384,
                              topk_dynamic=True, runtime_scale=runtime_scale)
        self.builds[-1].update(kind="fwd_ws", num_buffers=num_buffers, qk_chains=qk_chains,
                               ctas=ctas, **drafts)
        return kernel

    def get_fwd_ws64(self, heads, dim, topk, sm_scale, block_I, runtime_scale=False,
                     smem_store=True, ctas=0, **drafts):
        # smem_store: 0154's output store through the Q buffer (the same result); ctas: 0160's
        # persistent form (0: a CTA a query); drafts: 0161's fast_exp2, 0162's shared_mask, 0163's
        # dynamic, 0164's stage_out and 0166's counter_reset (passed only when on, as they are by
        # default)
        assert set(drafts) <= {"fast_exp2", "shared_mask", "dynamic", "stage_out",
                               "counter_reset"}, drafts
        # (the builder's own assertions: 0164's buffers only for the persistent form with 0154's
        # store; 0166's only with 0163's counter)
        assert not drafts.get("stage_out") or (ctas and smem_store), (ctas, smem_store)
        assert not drafts.get("counter_reset") or drafts.get("dynamic"), drafts
        kernel = self.get_fwd(heads, dim, 0, topk, 1, sm_scale, block_I, None, 384,
                              topk_dynamic=True, runtime_scale=runtime_scale)
        self.builds[-1].update(kind="fwd_ws64", smem_store=smem_store, ctas=ctas, **drafts)
        if not drafts.get("dynamic"):
            return kernel
        assert ctas and runtime_scale, "0163: dynamic only with ctas and the runtime scale"
        build = self.builds[-1]

        def counted(q, kv, indices, counter, *scale):
            # 0163: the query counter, zero at each call, before the scale
            assert counter.dtype == torch.int32 and counter.shape == (1,)
            assert counter.device == q.device and int(counter[0]) == 0
            build["counters"] = build.get("counters", 0) + 1
            return kernel(q, kv, indices, *scale)

        return counted

    def get_pre(self, H, D):
        def kernel(o, do):
            return (o.float() * do.float()).sum(-1)

        return kernel

    def get_bwd(self, H, D, D_tail, topk, kv_group, sm_scale, max_block_h, topk_dynamic=False,
                **extra):
        self.builds.append(dict(kind="bwd", heads=H, dim=D, tail_dim=D_tail, topk=topk,
                                topk_dynamic=topk_dynamic, max_block_h=max_block_h, **extra))

        runtime_scale = extra.get("runtime_scale", False)

        def kernel(q, kv, do, indices, lse, delta, *rest):
            # 0108: runtime_scale adds the scale after dkv (the last argument)
            assert len(rest) == (2 if runtime_scale else 1)
            s = rest[1] if runtime_scale else sm_scale
            dkv = rest[0]
            self._check_topk(topk, indices, topk_dynamic)
            assert q.size(-1) == kv.size(-1) == dkv.size(-1) == D + D_tail
            assert dkv.dtype == torch.float32
            self.calls.append(dict(kind="bwd", q=q, kv=kv, indices=indices, dkv=dkv, do=do,
                                   delta=delta, scale=s))
            # from the lse and delta the wrappers hand over (0107 pads delta for padded heads)
            dq, dk = _bwd_from_lse_delta(q, kv, do, indices, lse, delta, s)
            # 0106: a kernel built with dkv_lines keeps dKV in line order (the postprocess built
            # with lines=True restores it)
            dkv += _to_lines(dk) if extra.get("dkv_lines") else dk
            return dq.to(q.dtype)

        return kernel

    def get_bwd_ws64(self, H, D, topk, dkv_stages=1, wg0_dkv_chunks=0, **levers):
        # the head counts the kernel takes (its builder asserts the same)
        assert H in (32, 64) or 1 <= H <= 16, H
        # 0113's kernel: the scale at each call, dKV added in 0106's line order; 0120's and
        # 0121's levers (hoist_indices, evict_first_loads, block_phase_ns), 0161's
        # fast_exp2, wip/0132's async_dq, 0133's row_pairs, wip/0137's dkv_evict_last_mib,
        # 0142's block_phase_queries and wip/0167's dq_staged / dq_evict_first change no result
        assert set(levers) <= {"hoist_indices", "evict_first_loads", "block_phase_ns",
                               "fast_exp2", "async_dq", "row_pairs", "dkv_evict_last_mib",
                               "block_phase_queries", "dq_staged", "dq_evict_first"}, levers
        kernel = self.get_bwd(H, D, 0, topk, 1, None, 64, topk_dynamic=True, runtime_scale=True,
                              dkv_lines=True)
        self.builds[-1].update(kind="bwd_ws64", dkv_stages=dkv_stages, wg0_dkv_chunks=wg0_dkv_chunks,
                               **levers)
        return kernel

    def get_post(self, D, D_tail, kv_group, lines=False):
        self.builds.append(dict(kind="post", dim=D, tail_dim=D_tail, lines=lines))

        def kernel(dkv):
            assert dkv.size(-1) == D + D_tail
            return (_from_lines(dkv) if lines else dkv).to(torch.bfloat16)

        return kernel


class ShapeLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Every tensor an aten op makes while the hook runs (the fakes' own work excluded)."""

    def __init__(self):
        super().__init__()
        self.shapes = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.shapes.append((str(func), tuple(t.shape)))
        return out


@pytest.fixture
def fakes(monkeypatch):
    if sparse_mla.SparseMLA is None or tilelang_dsa.SparseMLA is None:
        pytest.skip("SparseMLA is unavailable (tilelang is not importable)")
    f = KernelFakes(None)
    # looked up on each call, so _run_hook can wrap the fakes
    monkeypatch.setattr(fwd_mod, "_get_sparse_mla_fwd_kernel", lambda *a, **k: f.get_fwd(*a, **k))
    if has("0070"):
        monkeypatch.setattr(fwd_mod, "_get_sparse_mla_fwd_nope_ws_kernel",
                            lambda *a, **k: f.get_fwd_ws(*a, **k))
    monkeypatch.setattr(bwd_mod, "_get_preprocess_kernel", lambda *a, **k: f.get_pre(*a, **k))
    monkeypatch.setattr(bwd_mod, "_get_bwd_kernel", lambda *a, **k: f.get_bwd(*a, **k))
    monkeypatch.setattr(bwd_mod, "_get_postprocess_kernel", lambda *a, **k: f.get_post(*a, **k))
    if has("0112"):
        monkeypatch.setattr(fwd_mod, "_get_sparse_mla_fwd_nope_ws64_kernel",
                            lambda *a, **k: f.get_fwd_ws64(*a, **k))
    if has("0113"):
        monkeypatch.setattr(bwd_mod, "_get_bwd_ws64_kernel", lambda *a, **k: f.get_bwd_ws64(*a, **k))
    monkeypatch.setattr(dsa_kernels, "_ABSORBED_FIRST_CALL_REPORTED", True)  # keep logs quiet
    for var in ("MCORE_DSA_REQUIRE_FUSED", "MCORE_DSA_CHECK_INDICES",
                "MCORE_DSA_TILELANG_TOPK_BUCKET", "MCORE_DSA_TILELANG_BWD_MAX_BLOCK_H"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MCORE_DSA_TILELANG_NOPE", "native")  # whatever the head count
    # 0142: the 64-row backward reads the device's SM count; the CPU inputs stand for an H200's
    _fake_sm_count(monkeypatch, 132)
    # 0070's warp-specialized forward and 0112/0113's 64-row kernels are tested on their own
    # below; the tests here check the pipelined forward's and the head-block backward's build
    # arguments
    off = dict(fwd_warp_specialized=False) if has("0070") else {}
    off.update({name: False for number, name in (("0112", "fwd_ws64"), ("0113", "bwd_ws64"))
                if has(number)})
    if not off:  # a tree without them (and maybe without NativeKernelOptions)
        yield f
        return
    with options(**off):
        yield f


def _config(heads):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=heads,
                                kv_lora_rank=512, qk_pos_emb_head_dim=0,
                                dsa_kernel_backend="tilelang")


def _inputs(width, topk, heads, sq, sk, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(sq, 1, heads, width, generator=g).to(torch.bfloat16).requires_grad_()
    key = torch.randn(sk, 1, 1, width, generator=g).to(torch.bfloat16).requires_grad_()
    idx = causal_random_indices(sq, sk, topk, g, offset=sk - sq).unsqueeze(0)  # int32
    return query, key, idx


def _run_hook(fakes, query, key, idx, scale):
    log = ShapeLog()
    orig = {n: getattr(fakes, n) for n in ("get_fwd", "get_fwd_ws", "get_fwd_ws64", "get_pre",
                                           "get_bwd", "get_bwd_ws64", "get_post")}

    def paused(fn):
        def wrapper(*a, **kw):
            kernel = fn(*a, **kw)

            def run(*ka):
                log.paused = True
                try:
                    return kernel(*ka)
                finally:
                    log.paused = False

            return run

        return wrapper

    for n, fn in orig.items():
        setattr(fakes, n, paused(fn))
    grad = torch.randn(query.size(0), 1, query.size(2), D_V,
                       generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with log:
        out = dsa_kernels.run_fused_absorbed_sparse_attention(
            _config(query.size(2)), query, key, idx, scale, D_V)
        assert out is not None, "the fused hook declined a supported shape"
        out.backward(grad)
    for n, fn in orig.items():
        setattr(fakes, n, fn)
    return out, grad, log.shapes


def _fake_sm_count(monkeypatch, sms):
    """torch.cuda.get_device_properties faked: the CPU inputs stand for a device with `sms` SMs.
    Returns the list of devices it is asked about."""
    asked = []

    def props(device):
        asked.append(torch.device(device))
        return types.SimpleNamespace(multi_processor_count=sms)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    return asked


def _assert_hook_matches_reference(out, grad, query, key, idx, scale):
    """The hook's output and the gradients it left in query.grad / key.grad within 2e-2
    (relative L2) of the FP32 reference's."""
    ref_out, ref_dq, ref_dk = _reference_grads(query, key, idx, scale, grad)
    for got, ref in ((out, ref_out), (query.grad, ref_dq), (key.grad, ref_dk)):
        assert (got.float() - ref).norm() / ref.norm() < 2e-2


def _reference_grads(query, key, idx, scale, grad):
    q = query.detach().float().permute(1, 0, 2, 3).requires_grad_()
    k = key.detach().float().permute(1, 0, 2, 3).requires_grad_()
    out = sparse_attention_reference(q, k, idx.unsqueeze(2), scale, d_v=D_V)
    out.backward(grad.float().permute(1, 0, 2, 3))
    return out.permute(1, 0, 2, 3), q.grad.permute(1, 0, 2, 3), k.grad.permute(1, 0, 2, 3)


def _bwd_sorts(kind):
    """Does a backward kernel of this build kind get each query's indices sorted by key (0121's
    timer phase, on bwd_ws64's kernel)?"""
    return kind == "bwd_ws64" and has("0121")


# (topk, sq, sk, seq bucket): 2051 is GLM-5.3-Flash's k-pool width; sq = 256 keeps the default
# 256-token sequence bucket copy-free, a bucket of 1 does the same for a short sq.
NATIVE_CASES = [(2051, 8, 2100, "1"), (131, 256, 512, None)]


@needs_tilelang
@pytest.mark.parametrize("topk,sq,sk,bucket", NATIVE_CASES)
def test_native_512_reaches_kernels_with_callers_storage(fakes, monkeypatch, topk, sq, sk,
                                                         bucket):
    if bucket is None:
        monkeypatch.delenv("MCORE_DSA_TILELANG_SEQ_BUCKET", raising=False)
    else:
        monkeypatch.setenv("MCORE_DSA_TILELANG_SEQ_BUCKET", bucket)
    heads, scale = 16, 512 ** -0.5
    query, key, idx = _inputs(512, topk, heads, sq, sk)
    out, grad, shapes = _run_hook(fakes, query, key, idx, scale)

    # kernels built tail-free, for the bucketed top-k, taking the caller's width
    kinds = {b["kind"]: b for b in fakes.builds}
    assert kinds["fwd"]["tail_dim"] == 0 and kinds["fwd"]["dim"] == 512
    assert kinds["fwd"]["topk"] == _round_up(topk, BLOCK_I) and kinds["fwd"]["topk_dynamic"]
    assert kinds["bwd"]["tail_dim"] == 0 and kinds["bwd"]["dim"] == 512
    assert kinds["bwd"]["topk"] == _round_up(topk, BWD_BLOCK) and kinds["bwd"]["topk_dynamic"]
    assert kinds["post"]["tail_dim"] == 0
    if has("0050"):  # 0050: zero-filled -1 rows; 16 heads keep the 128-thread bwd
        assert kinds["fwd"]["skip_invalid_gather"] and kinds["bwd"]["skip_invalid_gather"]
        assert kinds["bwd"]["threads"] == 128

    # forward (and the backward's recompute without 0060) and backward read the caller's storage
    # (the backward a sorted copy of the indices where its kernel takes the timer phase)
    calls = fakes.calls
    assert [c["kind"] for c in calls] == NATIVE_CALLS
    for c in calls:
        assert c["q"].shape == (1, sq, heads, 512) and c["kv"].shape == (1, sk, 1, 512)
        assert c["q"].data_ptr() == query.data_ptr()
        assert c["kv"].data_ptr() == key.data_ptr()
        assert c["indices"].shape == (1, sq, 1, topk)
        if c["kind"] == "bwd" and _bwd_sorts("bwd"):
            assert torch.equal(c["indices"], idx.view(c["indices"].shape).sort(-1).values)
        else:
            assert c["indices"].data_ptr() == idx.data_ptr()
    assert calls[-1]["dkv"].shape == (1, sk, 1, 512)

    # no tensor 576 wide (padded q/k, dq, dkv) and no index tensor padded to 64 or 32
    assert not [s for s in shapes if s[1] and s[1][-1] == 576], shapes
    padded = {_round_up(topk, BLOCK_I), _round_up(topk, BWD_BLOCK)} - {topk}
    assert not [s for s in shapes if s[1] and s[1][-1] in padded]

    # and the numbers are the caller's attention
    ref_out, ref_dq, ref_dk = _reference_grads(query, key, idx, scale, grad)
    assert query.grad.shape == query.shape and key.grad.shape == key.shape
    for got, ref in ((out, ref_out), (query.grad, ref_dq), (key.grad, ref_dk)):
        err = (got.float() - ref).norm() / ref.norm()
        assert err < 2e-2, err


@needs_tilelang
@needs("0050")
@pytest.mark.parametrize("heads,threads", [(16, 128), (32, 256), (64, 256)])
@pytest.mark.parametrize("on", [True, False])
def test_native_schedule_switch(fakes, heads, threads, on):
    """0050: 256 bwd threads from a 32-head block up; NativeKernelOptions(schedule=False) gives
    0030's native kernels (no zero-filled gather, 128 threads)."""
    query, key, idx = _inputs(512, 131, heads, 256, 512)
    with options(schedule=on):
        _run_hook(fakes, query, key, idx, 0.05)
    kinds = {b["kind"]: b for b in fakes.builds}
    assert kinds["fwd"]["skip_invalid_gather"] is on and kinds["bwd"]["skip_invalid_gather"] is on
    assert kinds["bwd"]["threads"] == (threads if on else 128)
    if "split_store" in kinds["bwd"]:  # 16-head block: dKV staged in 8 slices (2 CTAs per SM)
        eight = (16, 64) if has("0100") else (16,)  # 0100: the 64-head block needs 8 to fit
        assert kinds["bwd"]["split_store"] == (8 if on and heads in eight else 2)


@needs_tilelang
@needs("0100")
@pytest.mark.parametrize("heads,block_h", [(16, 16), (32, 32), (64, 64), (128, 64)])
@pytest.mark.parametrize("max_block_h", [None, 32])
def test_native_backward_head_block(fakes, monkeypatch, heads, block_h, max_block_h):
    """0100: the native backward takes a head block of up to 64 (one block of 256 threads at 64
    kernel heads, dKV staged in 8 slices, so each (query, key) is added to dKV once; two at
    128); NativeKernelOptions(bwd_max_block_h=32) gives two 32-head blocks at 64 heads (2 slices);
    upstream's MCORE_DSA_TILELANG_BWD_MAX_BLOCK_H still wins over both."""
    monkeypatch.delenv("MCORE_DSA_TILELANG_BWD_MAX_BLOCK_H", raising=False)
    query, key, idx = _inputs(512, 131, heads, 256, 512)
    changes = {} if max_block_h is None else dict(bwd_max_block_h=max_block_h)
    with options(**changes):
        _run_hook(fakes, query, key, idx, 0.05)
    bwd = [b for b in fakes.builds if b["kind"] == "bwd"]
    assert len(bwd) == 1
    want = block_h if max_block_h is None else min(block_h, max_block_h)
    assert bwd[0]["max_block_h"] == (64 if max_block_h is None else max_block_h)
    assert bwd[0]["threads"] == (256 if want >= 32 else 128)
    assert bwd[0]["split_store"] == (8 if want in (16, 64) else 2)
    # upstream's variable overrides the option
    fakes.builds.clear()
    monkeypatch.setenv("MCORE_DSA_TILELANG_BWD_MAX_BLOCK_H", "32")
    _run_hook(fakes, query, key, idx, 0.05)
    assert [b["max_block_h"] for b in fakes.builds if b["kind"] == "bwd"] == [32]


@needs_tilelang
@needs("0105")
@pytest.mark.parametrize("heads,block_h", [(8, 16), (16, 16), (32, 32), (64, 64), (128, 64)])
@pytest.mark.parametrize("chunks", [True, False])
@pytest.mark.parametrize("max_block_h", [None, 32])
def test_native_backward_dkv_chunks(fakes, monkeypatch, heads, block_h, chunks, max_block_h):
    """0105: the native backward computes and adds dKV in column chunks: 64 columns staged at a
    16-head block, 128 from registers at a 64-head block, whole at a 32-head block (also when
    bwd_max_block_h=32 makes 64 heads two 32-head blocks); NativeKernelOptions(
    bwd_dkv_chunks=False) gives the whole-block kernels at every head count."""
    monkeypatch.delenv("MCORE_DSA_TILELANG_BWD_MAX_BLOCK_H", raising=False)
    query, key, idx = _inputs(512, 131, heads, 256, 512)
    changes = dict(bwd_dkv_chunks=chunks)
    if has("0106"):
        changes["bwd_dkv_lines"] = False  # 0106's line-ordered add replaces these forms
    if max_block_h is not None:
        changes["bwd_max_block_h"] = max_block_h
    with options(**changes):
        _run_hook(fakes, query, key, idx, 0.05)
    bwd = [b for b in fakes.builds if b["kind"] == "bwd"]
    assert len(bwd) == 1
    block = block_h if max_block_h is None else min(block_h, max_block_h)
    want = {16: (64, False), 64: (128, True)}.get(block, (0, False)) if chunks else (0, False)
    assert (bwd[0]["dkv_chunk"], bwd[0]["dkv_direct"]) == want
    # the staged slices are what the whole-block kernel uses; the chunked one ignores them
    assert bwd[0]["split_store"] == (8 if block in (16, 64) else 2)


@needs_tilelang
@needs("0106")
@pytest.mark.parametrize("heads,block_h", [(8, 16), (16, 16), (32, 32), (64, 64), (128, 64)])
@pytest.mark.parametrize("lines", [True, False])
@pytest.mark.parametrize("chunks", [True, False])
def test_native_backward_dkv_lines(fakes, monkeypatch, heads, block_h, lines, chunks):
    """0106: by default the native backward adds dKV chunks of 16 columns a warp (64 at 128
    threads, 128 at 256) from registers into a line-ordered accumulator, at every head block, and
    builds the postprocess that restores the order; bwd_dkv_lines=False gives 0105's forms,
    bwd_dkv_chunks=False the whole-block kernels either way. The gradients through the hook are
    the same in every case (the fake kernels apply the line order the real ones use)."""
    monkeypatch.delenv("MCORE_DSA_TILELANG_BWD_MAX_BLOCK_H", raising=False)
    query, key, idx = _inputs(512, 131, heads, 256, 512)
    with options(bwd_dkv_lines=lines, bwd_dkv_chunks=chunks):
        _run_hook(fakes, query, key, idx, 0.05)
    grads = (query.grad, key.grad)
    bwd = [b for b in fakes.builds if b["kind"] == "bwd"]
    post = [b for b in fakes.builds if b["kind"] == "post"]
    assert len(bwd) == 1 and len(post) == 1
    on = lines and chunks
    assert bwd[0]["dkv_lines"] is on and post[0]["lines"] is on
    if on:
        assert bwd[0]["dkv_chunk"] == (64 if block_h == 16 else 128)
        assert not bwd[0]["dkv_direct"]
    query2, key2, _ = _inputs(512, 131, heads, 256, 512)
    with options(bwd_dkv_chunks=False):
        _run_hook(fakes, query2, key2, idx, 0.05)
    assert torch.count_nonzero(key.grad) > 0
    for got, want in ((query.grad, query2.grad), (key.grad, key2.grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@needs("0106")
def test_kernel_line_column_is_the_tests_line_order():
    """0106: the kernel module's own line order (which the backward's add and its postprocess
    both use) is the one written out here; the fakes above apply this one."""
    from megatron.core.transformer.experimental_attention_variant.ops import (
        tilelang_sparse_mla_bwd as bwd_mod,
    )

    assert [bwd_mod._line_column(d) for d in range(512)] == _line_order(512).tolist()


def test_line_order_is_a_permutation_of_4_float_lines():
    """The test's own line order (above): a bijection of each 16 columns, and a thread's 4 floats
    (lane group r: columns 2r, 2r + 1, 8 + 2r, 9 + 2r) land on one aligned 16-byte vector."""
    where = _line_order(512)
    assert sorted(where.tolist()) == list(range(512))
    for g in range(0, 512, 16):
        for r in range(4):
            cols = [g + 2 * r, g + 2 * r + 1, g + 8 + 2 * r, g + 9 + 2 * r]
            assert where[cols].tolist() == list(range(g + 4 * r, g + 4 * r + 4))


@needs_tilelang
@needs("0108")
@pytest.mark.parametrize("runtime", [True, False])
def test_runtime_scale_kernels_are_one_build_for_every_scale(monkeypatch, runtime):
    """0108: a getter asked for a runtime-scale kernel builds it once, with no scale, whatever
    scale it is given (the kernel takes it at each call); otherwise once per scale, with it."""
    from megatron.core.transformer.experimental_attention_variant.ops import (
        tilelang_sparse_mla_bwd as bwd_mod,
        tilelang_sparse_mla_fwd as fwd_mod,
    )

    built = []

    def builder(kind):
        def build(*args, **kwargs):
            built.append((kind, args, kwargs))
            return object()

        return build

    for mod, name in ((fwd_mod, "sparse_mla_fwd"), (fwd_mod, "sparse_mla_fwd_nope_ws"),
                      (bwd_mod, "bwd")):
        monkeypatch.setattr(mod, name, builder(name))
    for mod, cache in ((fwd_mod, "_tilelang_sparse_mla_fwd_kernel_cache"),
                       (fwd_mod, "_tilelang_sparse_mla_fwd_ws_kernel_cache"),
                       (bwd_mod, "_tilelang_sparse_mla_bwd_kernel_cache")):
        monkeypatch.setattr(mod, cache, collections.OrderedDict())  # empty, restored after
    for scale in (512 ** -0.5, 0.1, 0.1):
        fwd_mod._get_sparse_mla_fwd_kernel(64, 512, 0, 2112, 1, scale, 64, 2, 256,
                                           topk_dynamic=True, runtime_scale=runtime)
        fwd_mod._get_sparse_mla_fwd_nope_ws_kernel(16, 512, 2112, scale, 64, 3, 4, 132,
                                                   runtime_scale=runtime)
        bwd_mod._get_bwd_kernel(16, 512, 0, 2080, 1, scale, 16, True, runtime_scale=runtime)
    assert len(built) == (3 if runtime else 6)
    for kind, args, kwargs in built:
        assert kwargs["runtime_scale"] is runtime
        scale = kwargs.get("sm_scale", args[3] if kind == "sparse_mla_fwd_nope_ws" else args[5])
        assert (scale is None) == runtime


@needs_tilelang
@needs("0105")
def test_576_backward_never_chunks_dkv(fakes):
    """0105: the 576 (#7617) route's backward is built as before: no dKV chunks."""
    query, key, idx = _inputs(576, 131, 16, 256, 512)
    _run_hook(fakes, query, key, idx, 0.05)
    bwd = [b for b in fakes.builds if b["kind"] == "bwd"]
    assert bwd and all(b["dkv_chunk"] == 0 and not b["dkv_direct"] for b in bwd)


@needs_tilelang
@needs("0070")
@pytest.mark.parametrize("heads,kernel_heads", [(8, 16), (16, 16), (32, 32), (64, 64), (128, 128)])
@pytest.mark.parametrize("ws", [True, False])
@pytest.mark.parametrize("persist", [True, False])
def test_native_forward_warp_specialized_switch(fakes, monkeypatch, heads, kernel_heads, ws, persist):
    """0070: the native route's forward is the warp-specialized kernel at 16 and 32 kernel heads
    (3 KV buffers at 16, 2 at 32, four score MMA chains; built for top-k rounded to a whole
    number of buffer rounds of 64 indices, taking the caller's q, kv and indices) and the
    pipelined one from 64 heads (its second consumer holds the whole output: no room at 64);
    NativeKernelOptions(fwd_warp_specialized=False) gives the pipelined one everywhere (True is
    the default). At 16 kernel heads it is persistent, one CTA per SM of the input's device,
    unless fwd_ws_persistent=False; at 32 a CTA a query. The backward is the same."""
    monkeypatch.delenv("MCORE_DSA_TILELANG_SEQ_BUCKET", raising=False)
    asked = _fake_sm_count(monkeypatch, 7)
    topk, scale = 131, 512 ** -0.5
    query, key, idx = _inputs(512, topk, heads, 256, 512)
    with options(fwd_warp_specialized=ws, fwd_ws_persistent=persist):
        out, grad, _ = _run_hook(fakes, query, key, idx, scale)
    on = ws and kernel_heads in (16, 32)
    fwd = [b for b in fakes.builds if b["kind"] in ("fwd", "fwd_ws")]
    assert {b["kind"] for b in fwd} == {"fwd_ws" if on else "fwd"}
    native_heads = heads if has("0123") else kernel_heads  # 0123: 8 heads on 16-row tiles
    assert fwd[0]["heads"] == native_heads and fwd[0]["tail_dim"] == 0
    buffers = 3 if kernel_heads == 16 else 2
    assert fwd[0]["topk"] == _round_up(topk, buffers * BLOCK_I if on else BLOCK_I)
    if on:
        assert fwd[0]["num_buffers"] == buffers and fwd[0]["qk_chains"] == 4
        persistent = persist and kernel_heads == 16
        assert fwd[0]["ctas"] == (7 if persistent else 0)
        assert set(asked) == ({query.device} if persistent else set())
    first = fakes.calls[0]
    assert first["kind"] == "fwd" and first["indices"].data_ptr() == idx.data_ptr()
    assert first["kv"].data_ptr() == key.data_ptr()
    if heads == native_heads:
        assert first["q"].data_ptr() == query.data_ptr()
    _assert_hook_matches_reference(out, grad, query, key, idx, scale)


@needs_tilelang
@needs("0113")
@pytest.mark.parametrize("heads,kernel_heads", [(8, 16), (16, 16), (32, 32), (64, 64), (128, 128)])
@pytest.mark.parametrize("fwd_on,bwd_on", [(True, True), (True, False), (False, True)])
def test_native_64_row_kernels_switch(fakes, monkeypatch, heads, kernel_heads, fwd_on, bwd_on):
    """0112/0113 (both on by default): at 32 and 64 kernel heads the native forward is the
    64-row warp-specialized kernel (built for top-k rounded to two 64-index blocks) and the
    backward (0134: at 16 too; 0153: and 8) the kernel with warpgroup roles (dKV in line order,
    so the line-order postprocess); each on its own with NativeKernelOptions fwd_ws64 /
    bwd_ws64, the other head counts untouched. Both take the caller's q, kv and indices, and the
    gradients through the hook are the reference's. Upstream's MCORE_DSA_TILELANG_BWD_MAX_BLOCK_H, and 0050's
    schedule=False, give the head-block backward back."""
    monkeypatch.delenv("MCORE_DSA_TILELANG_SEQ_BUCKET", raising=False)
    topk, scale = 131, 512 ** -0.5
    query, key, idx = _inputs(512, topk, heads, 256, 512)
    with options(fwd_ws64=fwd_on, bwd_ws64=bwd_on):  # 0070 off (the fixture)
        out, grad, _ = _run_hook(fakes, query, key, idx, scale)
    rows64 = kernel_heads in (32, 64)
    native_heads = heads if has("0123") else kernel_heads  # 0123: 8 heads on 16-row tiles
    # 0134: 16 kernel heads take the 64-row backward too; 0153: and fewer (8)
    bwd_rows64 = native_heads in ((16, 32, 64) if has("0134") else (32, 64)) or (
        native_heads < 16 and has("0153"))
    fwd = [b for b in fakes.builds if b["kind"].startswith("fwd")]
    bwd = [b for b in fakes.builds if b["kind"].startswith("bwd")]
    post = [b for b in fakes.builds if b["kind"] == "post"]
    assert len(fwd) == len(bwd) == len(post) == 1
    assert (fwd[0]["kind"] == "fwd_ws64") == (fwd_on and rows64)
    assert (bwd[0]["kind"] == "bwd_ws64") == (bwd_on and bwd_rows64)
    assert fwd[0]["heads"] == bwd[0]["heads"] == native_heads
    if fwd[0]["kind"] == "fwd_ws64":
        assert fwd[0]["topk"] == _round_up(topk, 2 * BLOCK_I) and fwd[0]["runtime_scale"]
    if bwd[0]["kind"] == "bwd_ws64":
        assert bwd[0]["topk"] == _round_up(topk, BWD_BLOCK) and post[0]["lines"]
        assert bwd[0]["dkv_stages"] == (2 if has("0114") else 1)  # 0114: two stages by default
        # 0115: WG0 takes two dKV chunks; 0141: one
        assert bwd[0]["wg0_dkv_chunks"] == (1 if has("0141") else 2 if has("0115") else 0)
        if has("0120"):  # by default a block's indices loaded once, evict_first loads
            assert bwd[0]["hoist_indices"] and bwd[0]["evict_first_loads"]
        if has("0142"):  # by default the query's phase (the device's SMs), indices sorted
            assert bwd[0]["block_phase_queries"] == 132 and bwd[0]["block_phase_ns"] == 0
        elif has("0121"):  # by default the timer phase, over each query's indices sorted by key
            assert bwd[0]["block_phase_ns"] == 8000
    sorted_bwd = _bwd_sorts(bwd[0]["kind"])
    for c in fakes.calls:
        assert c["kv"].data_ptr() == key.data_ptr()
        if sorted_bwd and c["kind"] == "bwd":  # the same indices, each row in key order
            assert torch.equal(c["indices"].view(-1, topk), idx.view(-1, topk).sort(-1).values)
        else:
            assert c["indices"].data_ptr() == idx.data_ptr()
        if heads == native_heads:
            assert c["q"].data_ptr() == query.data_ptr()
    _assert_hook_matches_reference(out, grad, query, key, idx, scale)
    if not (bwd_on and bwd_rows64):
        return

    def backward_builds(**opts):
        """The backward kernel builds of one more fwd+bwd with bwd_ws64 and opts."""
        fakes.builds.clear()
        query2, key2, _ = _inputs(512, topk, heads, 256, 512)
        with options(bwd_ws64=True, **opts):
            _run_hook(fakes, query2, key2, idx, scale)
        return [b for b in fakes.builds if b["kind"].startswith("bwd")]

    if has("0114"):  # bwd_dkv_two_stages=False: 0113's one accumulator
        one = backward_builds(bwd_dkv_two_stages=False)
        assert [(b["kind"], b["dkv_stages"]) for b in one] == [("bwd_ws64", 1)]
    if has("0115"):  # bwd_wg0_dkv_chunks=0: WG1 adds every chunk (0114's kernel)
        wg1 = backward_builds(bwd_wg0_dkv_chunks=0)
        assert [(b["kind"], b["wg0_dkv_chunks"]) for b in wg1] == [("bwd_ws64", 0)]
    monkeypatch.setenv("MCORE_DSA_TILELANG_BWD_MAX_BLOCK_H", "32")
    assert [b["kind"] for b in backward_builds()] == ["bwd"]
    monkeypatch.delenv("MCORE_DSA_TILELANG_BWD_MAX_BLOCK_H")
    assert [b["kind"] for b in backward_builds(schedule=False)] == ["bwd"]


@needs_tilelang
@needs("0160")
@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("persist", [False, True, 2])
@pytest.mark.parametrize("dynamic", [False, pytest.param(True, marks=needs("0163"))])
def test_native_fwd_ws64_persistent_switch(fakes, monkeypatch, heads, persist, dynamic):
    """0160: NativeKernelOptions.fwd_ws64_persistent (on by default) builds 0112's forward with
    one CTA an SM of the query's device (2: two, two waves); off, a CTA a query, without asking
    the device. 0163's fwd_ws64_dynamic (on by default) builds the persistent one with its query
    counter and passes a zero int32 counter at each call (before the scale); without
    fwd_ws64_persistent it changes nothing (a CTA a query has no counter). The gradients through
    the hook are the reference's either way."""
    asked = _fake_sm_count(monkeypatch, 7)
    topk, scale = 131, 512 ** -0.5
    query, key, idx = _inputs(512, topk, heads, 256, 512)
    dyn = {"fwd_ws64_dynamic": dynamic} if has("0163") else {}
    fields = dict(fwd_ws64_persistent=persist, **dyn)
    with options(fwd_ws64=True, **fields):  # 0112 off (the fixture)
        out, grad, _ = _run_hook(fakes, query, key, idx, scale)
    fwd = [b for b in fakes.builds if b["kind"].startswith("fwd")]
    assert [b["kind"] for b in fwd] == ["fwd_ws64"]
    assert fwd[0]["ctas"] == 7 * int(persist)
    assert set(asked) == ({query.device} if persist else set())
    assert fwd[0].get("dynamic", False) == (dynamic and bool(persist))
    assert fwd[0].get("counters", 0) == (1 if dynamic and persist else 0)
    _assert_hook_matches_reference(out, grad, query, key, idx, scale)


@needs_tilelang
@needs("0166")
@pytest.mark.parametrize("dynamic", [True, False])
@pytest.mark.parametrize("reset", [True, False])
def test_native_fwd_ws64_counter_reset_switch(fakes, monkeypatch, reset, dynamic):
    """0166: NativeKernelOptions.fwd_ws64_counter_reset (on by default) builds the persistent
    forward whose kernel leaves the query counter zero; off, 0163's kernel. Without 0163's
    counter (fwd_ws64_dynamic off) it changes nothing. The call passes a zero counter either way
    (here on the CPU a new one each call: the kept one is a CUDA stream's, which
    tests/gpu/test_sparse_mla_gpu.py checks)."""
    _fake_sm_count(monkeypatch, 7)
    topk, scale = 131, 512 ** -0.5
    query, key, idx = _inputs(512, topk, 64, 256, 512)
    with options(fwd_ws64=True, fwd_ws64_dynamic=dynamic, fwd_ws64_counter_reset=reset):
        out, grad, _ = _run_hook(fakes, query, key, idx, scale)
    (build,) = [b for b in fakes.builds if b["kind"].startswith("fwd")]
    assert build.get("counter_reset", False) == (reset and dynamic)
    assert build.get("counters", 0) == int(dynamic)
    _assert_hook_matches_reference(out, grad, query, key, idx, scale)


@needs_tilelang
@needs("0160")
@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("smem_store", [True, False])
def test_native_fwd_ws64_route_defaults(fakes, monkeypatch, heads, smem_store):
    """0160-0164 and 0166 on by default: the route builds 0112's forward persistent on the
    device's SMs with fast_exp2, the shared mask, the query counter (0166: left zero by the
    kernel) and 0164's output buffers (what the codegen tests build as the route's kernel,
    fwd_ws64_route_kwargs). With 0154's store off, 0164's buffers are not asked for (the
    builder takes them only with it)."""
    _fake_sm_count(monkeypatch, 7)
    topk, scale = 131, 512 ** -0.5
    query, key, idx = _inputs(512, topk, heads, 256, 512)
    with options(fwd_ws64=True, fwd_ws64_smem_store=smem_store):  # 0112 off (the fixture)
        out, grad, _ = _run_hook(fakes, query, key, idx, scale)
    (build,) = [b for b in fakes.builds if b["kind"].startswith("fwd")]
    want = fwd_ws64_route_kwargs(sms=7)
    if not smem_store:
        want.update(smem_store=False)
        want.pop("stage_out", None)
    assert {k: v for k, v in build.items() if k in want} == want
    assert smem_store or "stage_out" not in build
    _assert_hook_matches_reference(out, grad, query, key, idx, scale)


@needs_tilelang
@needs("0161")
@pytest.mark.parametrize("heads", [16, 32, 64])
@pytest.mark.parametrize("fast", [False, True])
def test_native_fast_exp2_switch(fakes, monkeypatch, heads, fast):
    """0161: NativeKernelOptions.fast_exp2 (on by default) reaches the warp-specialized
    forward's builder and the 64-row backward's (at 16 heads too since 0134; the head-block
    kernel, which 16 heads take without 0134, keeps exp2f); off, their calls are without the
    argument. The gradients through the hook are the reference's either way."""
    _fake_sm_count(monkeypatch, 7)  # 0070's persistent forward asks for the SM count
    topk, scale = 131, 512 ** -0.5
    query, key, idx = _inputs(512, topk, heads, 256, 512)
    # the fixture turns the warp-specialized and 64-row kernels off
    with options(fwd_warp_specialized=True, fwd_ws64=True, bwd_ws64=True, fast_exp2=fast):
        out, grad, _ = _run_hook(fakes, query, key, idx, scale)
    built = {b["kind"]: b for b in fakes.builds}
    fwd_kind = "fwd_ws" if heads == 16 else "fwd_ws64"
    ws64_16 = has("0134")  # 0134: 16 heads on the 64-row backward
    kinds = (fwd_kind, "bwd_ws64") if heads > 16 or ws64_16 else (fwd_kind,)
    for kind in kinds:
        assert kind in built, sorted(built)
        assert built[kind].get("fast_exp2", False) == fast, (kind, built[kind])
    if heads == 16 and not ws64_16:
        assert "fast_exp2" not in built["bwd"]
    _assert_hook_matches_reference(out, grad, query, key, idx, scale)


# 0154's, 0162's and wip drafts' options for 0112's forward and 0113's backward: (NativeKernelOptions
# field, the option turning the kernel on (the fixture turns it off), the build's kind, builder
# argument, patch)
_DRAFT_SWITCHES = [
    ("fwd_ws64_smem_store", "fwd_ws64", "fwd_ws64", "smem_store", "0154"),
    ("fwd_ws64_shared_mask", "fwd_ws64", "fwd_ws64", "shared_mask", "0162"),
    ("bwd_ws64_async_dq", "bwd_ws64", "bwd_ws64", "async_dq", "wip/0132"),
]


@needs_tilelang
@pytest.mark.parametrize("field,kernel_on,kind,arg", [
    pytest.param(field, kernel_on, kind, arg, id=field, marks=needs_draft(draft, field))
    for field, kernel_on, kind, arg, draft in _DRAFT_SWITCHES])
@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("on", [False, True])
def test_native_64_row_draft_switch(fakes, heads, on, field, kernel_on, kind, arg):
    """0154 (fwd_ws64_smem_store) and 0162 (fwd_ws64_shared_mask), on by default, and wip/0132
    (bwd_ws64_async_dq): the option reaches 0112's / 0113's builder as its argument (0162's and
    a draft's off: the call without it), the only build of its direction. The gradients through
    the hook are the reference's."""
    topk, scale = 131, 512 ** -0.5
    query, key, idx = _inputs(512, topk, heads, 256, 512)
    with options(**{kernel_on: True, field: on}):
        out, grad, _ = _run_hook(fakes, query, key, idx, scale)
    built = [b for b in fakes.builds if b["kind"].split("_")[0] == kind.split("_")[0]]
    assert [b["kind"] for b in built] == [kind]
    assert built[0].get(arg, False) == on
    _assert_hook_matches_reference(out, grad, query, key, idx, scale)


def _backward_builds(fakes, heads, **fields):
    """The backward builds of one fwd+bwd through the hook (top-k 131, 256 tokens) with these
    NativeKernelOptions fields, after checking its gradients against the reference's."""
    topk, scale = 131, 512 ** -0.5
    query, key, idx = _inputs(512, topk, heads, 256, 512)
    with options(**fields):
        out, grad, _ = _run_hook(fakes, query, key, idx, scale)
    _assert_hook_matches_reference(out, grad, query, key, idx, scale)
    return [b for b in fakes.builds if b["kind"].startswith("bwd")]


@needs_tilelang
@needs("0142")
@pytest.mark.parametrize("heads", [16, 32, 64])
@pytest.mark.parametrize("queries,ns,want", [(-1, 8000, 132), (66, 8000, 66), (0, 8000, 0),
                                             (0, 0, 0)])
def test_native_64_row_backward_query_phase(fakes, heads, queries, ns, want):
    """0142: bwd_block_phase_queries reaches the 64-row backward's builder as
    block_phase_queries (-1, the default: the device's SM count) with the timer phase off
    (block_phase_ns 0); 0 gives 0121's timer phase (bwd_block_phase_ns). With either phase the
    kernel gets each query's indices sorted by key; with both fields 0, none, and the indices as
    given. The gradients through the hook, on indices in score order, are the reference's."""
    topk, scale = 131, 512 ** -0.5
    query, key, idx = _inputs(512, topk, heads, 256, 512)
    g = torch.Generator().manual_seed(heads)
    idx = idx.gather(-1, torch.rand(idx.shape, generator=g).argsort(-1))
    with options(bwd_ws64=True, bwd_block_phase_queries=queries, bwd_block_phase_ns=ns):
        out, grad, _ = _run_hook(fakes, query, key, idx, scale)
    _assert_hook_matches_reference(out, grad, query, key, idx, scale)
    built = [b for b in fakes.builds if b["kind"].startswith("bwd")]
    assert [b["kind"] for b in built] == ["bwd_ws64"]
    assert built[0]["block_phase_queries"] == want
    assert built[0]["block_phase_ns"] == (0 if want else ns)
    (call,) = [c for c in fakes.calls if c["kind"] == "bwd"]
    given = idx.view(-1, topk)
    assert torch.equal(call["indices"].view(-1, topk), given.sort(-1).values if want or ns else given)


@needs_draft("wip/0169", "bwd_sort_int16")
def test_sort_rows_narrow_gives_the_same_order():
    """wip/0169: _sort_rows(narrow=True) sorts each row as int16 and gives the int32 sort's rows
    (indices below 2^15 with -1 entries among them, in place and not), a row count that is not a
    multiple of rows_per_pass included."""
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 2**15, (1, 37, 1, 131), generator=g, dtype=torch.int32)
    idx[0, ::5, 0, ::7] = -1
    want = bwd_mod._sort_rows(idx.clone(), rows_per_pass=8)
    got = bwd_mod._sort_rows(idx, rows_per_pass=8, narrow=True)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    inplace = idx.clone()
    assert torch.equal(bwd_mod._sort_rows(inplace, in_place=True, rows_per_pass=8, narrow=True), want)
    assert torch.equal(inplace, want)


@needs_tilelang
@needs_draft("wip/0169", "bwd_sort_int16")
@pytest.mark.parametrize("on,kv_rows,want", [(False, 256, False), (True, 256, True),
                                             (True, 2**15 + 64, False)])
def test_native_backward_sorts_as_int16_only_where_asked_and_it_fits(monkeypatch, fakes, on, kv_rows,
                                                                    want):
    """wip/0169: the route sorts the indices as int16 (narrow) only with bwd_sort_int16 and a
    KV of at most 2^15 rows; the kernel gets them sorted either way, and the gradients through
    the hook are the reference's."""
    seen = []
    sort_rows = bwd_mod._sort_rows

    def spy(indices, **kwargs):
        seen.append(kwargs.get("narrow", False))
        return sort_rows(indices, **kwargs)

    monkeypatch.setattr(bwd_mod, "_sort_rows", spy)
    topk, scale = 131, 512 ** -0.5
    query, key, idx = _inputs(512, topk, 16, 256, kv_rows)  # (the queries are the KV's last)
    with options(bwd_ws64=True, bwd_sort_int16=on):
        out, grad, _ = _run_hook(fakes, query, key, idx, scale)
    _assert_hook_matches_reference(out, grad, query, key, idx, scale)
    assert seen == [want]
    (call,) = [c for c in fakes.calls if c["kind"] == "bwd"]
    assert torch.equal(call["indices"].view(-1, topk), idx.view(-1, topk).sort(-1).values)


@needs_tilelang
@needs_draft("wip/0137", "bwd_dkv_evict_last_mib")
@pytest.mark.parametrize("heads", [16, 32, 64])
@pytest.mark.parametrize("mib,pairs,want", [(0, True, None), (32, True, 32), (48, True, 48),
                                            (32, False, None)])
def test_native_64_row_backward_dkv_evict_last(fakes, heads, mib, pairs, want):
    """wip/0137: bwd_dkv_evict_last_mib reaches the 64-row backward's builder as
    dkv_evict_last_mib, only with 0133's row pairs (whose adds take the policy); 0 (the default)
    or without the pairs, the call is the series' own, without the argument. The gradients
    through the hook are the reference's."""
    built = _backward_builds(fakes, heads, bwd_ws64=True, bwd_ws64_row_pairs=pairs,
                             bwd_dkv_evict_last_mib=mib)
    assert [b["kind"] for b in built] == ["bwd_ws64"]
    assert built[0].get("dkv_evict_last_mib") == want


@needs_tilelang
@needs_draft("wip/0167", "bwd_ws64_dq_staged")
@pytest.mark.parametrize("heads", [8, 16, 64])
@pytest.mark.parametrize("staged,evict_first", [(False, False), (True, False), (False, True),
                                                (True, True)])
def test_native_64_row_backward_dq_store(fakes, heads, staged, evict_first):
    """wip/0167: bwd_ws64_dq_staged and bwd_ws64_dq_evict_first reach the 64-row backward's
    builder as dq_staged and dq_evict_first, both together, when either is on; with both off
    (the defaults) the call is the series' own, without them. The gradients through the hook
    are the reference's."""
    built = _backward_builds(fakes, heads, bwd_ws64=True, bwd_ws64_dq_staged=staged,
                             bwd_ws64_dq_evict_first=evict_first)
    assert [b["kind"] for b in built] == ["bwd_ws64"]
    on = staged or evict_first
    assert built[0].get("dq_staged") == (staged if on else None)
    assert built[0].get("dq_evict_first") == (evict_first if on else None)


@needs_tilelang
@pytest.mark.skipif(not has("0133"),
                    reason="0133 (NativeKernelOptions.bwd_ws64_row_pairs) is not in the series")
@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("pairs,hoist,want", [(True, True, True), (False, True, False),
                                              (True, False, False)])
def test_native_64_row_backward_row_pairs(fakes, heads, pairs, hoist, want):
    """0133: 0113's backward is built with row_pairs (the default) unless bwd_ws64_row_pairs is
    off, or bwd_hoist_indices is (the pairs read the block's hoisted rows). The gradients through
    the hook are the reference's."""
    from megatron.core.transformer.experimental_attention_variant.ops.tilelang_utils import (
        NativeKernelOptions,
    )

    assert NativeKernelOptions().bwd_ws64_row_pairs, "0133's default"
    built = _backward_builds(fakes, heads, bwd_ws64=True, bwd_ws64_row_pairs=pairs,
                             bwd_hoist_indices=hoist)
    assert [b["kind"] for b in built] == ["bwd_ws64"]
    assert built[0]["row_pairs"] is want


@needs_tilelang
@pytest.mark.skipif(not _has_option("bwd_ws64_16_heads"),
                    reason="0134 (NativeKernelOptions.bwd_ws64_16_heads) is not in the series")
@pytest.mark.parametrize("heads,on,kind", [(16, None, "bwd_ws64"), (16, False, "bwd"),
                                           (16, True, "bwd_ws64"), (8, True, "bwd"),
                                           (32, False, "bwd_ws64")])
def test_native_16_heads_backward_switch(fakes, heads, on, kind):
    """0134: 16 kernel heads take 0113's 64-row backward (the default), with 0121's sort of the
    indices as at 32/64 heads; bwd_ws64_16_heads=False keeps the head-block kernel there; fewer
    heads keep the head-block kernel (0153's own switch, bwd_ws64_few_heads, off here), and 32
    heads the 64-row one, whatever it says. The
    gradients through the hook are the reference's."""
    from megatron.core.transformer.experimental_attention_variant.ops.tilelang_utils import (
        NativeKernelOptions,
    )

    assert NativeKernelOptions().bwd_ws64_16_heads, "0134's default"
    switch = {} if on is None else {"bwd_ws64_16_heads": on}
    if heads < 16 and _has_option("bwd_ws64_few_heads"):  # (0153's route: its own test below)
        switch["bwd_ws64_few_heads"] = False
    built = _backward_builds(fakes, heads, bwd_ws64=True, **switch)
    assert [b["kind"] for b in built] == [kind]
    if kind == "bwd_ws64":
        assert built[0]["heads"] == heads


@needs_tilelang
@needs("0153")
@pytest.mark.parametrize("heads", [1, 8, 12, 15])
@pytest.mark.parametrize("on", [None, False, True])
def test_native_few_heads_backward_switch(fakes, heads, on):
    """0153: fewer than 16 kernel heads take 0113's 64-row backward (the default), built for the
    caller's heads, whatever bwd_ws64_16_heads says; bwd_ws64_few_heads=False keeps the
    head-block kernel there. The gradients through the hook are the reference's. (The
    deterministic route's kernels there: tests/test_deterministic_key_scales.py.)"""
    from megatron.core.transformer.experimental_attention_variant.ops.tilelang_utils import (
        NativeKernelOptions,
    )

    assert NativeKernelOptions().bwd_ws64_few_heads, "0153's default"
    switch = {} if on is None else {"bwd_ws64_few_heads": on}
    built = _backward_builds(fakes, heads, bwd_ws64=True, bwd_ws64_16_heads=False, **switch)
    assert [b["kind"] for b in built] == (["bwd"] if on is False else ["bwd_ws64"])
    assert built[0]["heads"] == heads


@needs_tilelang
def test_native_512_small_head_count_pads_heads_only(fakes):
    query, key, idx = _inputs(512, 131, 8, 256, 512)
    _run_hook(fakes, query, key, idx, 0.05)
    fwd_call = fakes.calls[0]
    if has("0123"):  # the caller's 8 heads, no padded copy; dO, delta and dq 8 heads too
        assert fwd_call["q"].shape == (1, 256, 8, 512)
        assert fwd_call["q"].data_ptr() == query.data_ptr()
        bwd_call = fakes.calls[-1]
        assert bwd_call["do"].size(2) == bwd_call["delta"].size(2) == 8
    else:
        assert fwd_call["q"].shape == (1, 256, 16, 512)  # heads padded to the 16-head tile
        assert torch.count_nonzero(fwd_call["q"][:, :, 8:]) == 0
    assert fwd_call["kv"].data_ptr() == key.data_ptr()
    assert fwd_call["indices"].data_ptr() == idx.data_ptr()
    assert query.grad.shape == query.shape
    # padded heads: SparseMLA keeps the caller's heads of the output (0107); before 0107 the
    # hook's output was a copy, so SparseMLA recomputed instead of saving
    assert [c["kind"] for c in fakes.calls] == (NATIVE_CALLS if has("0107") else
                                                 ["fwd", "fwd", "bwd"])


def _with_empty_rows(idx, rows):
    idx = idx.clone()
    idx[:, rows] = -1  # rows with no valid index: zero output and zero gradient
    return idx


@needs_tilelang
@needs("0060")
@pytest.mark.parametrize("heads", [16, pytest.param(8, marks=needs("0107"))])
def test_native_save_output_matches_recompute(fakes, monkeypatch, heads):
    """0060: the native route keeps out/lse for backward (one forward kernel per fwd+bwd) and
    gives what upstream's recompute gives (NativeKernelOptions(save_output=False)), including zero
    output and gradients for rows with no valid index, which it no longer masks itself. 0107: with
    padded heads (8 query heads run as 16 before 0123; since, 16-row tiles in the kernels) too,
    keeping only the caller's heads."""
    monkeypatch.delenv("MCORE_DSA_TILELANG_SEQ_BUCKET", raising=False)
    sq, sk, topk, scale = 256, 512, 131, 512 ** -0.5
    empty = [0, 5, 200]
    results = {}
    for save in (True, False):
        fakes.calls.clear()
        query, key, idx = _inputs(512, topk, heads, sq, sk)
        idx = _with_empty_rows(idx, empty)
        with options(save_output=save):
            out, grad, _ = _run_hook(fakes, query, key, idx, scale)
        kinds = [c["kind"] for c in fakes.calls]
        assert kinds == (["fwd", "bwd"] if save else ["fwd", "fwd", "bwd"])
        bwd = fakes.calls[-1]
        assert bwd["do"].size(2) == bwd["delta"].size(2) == (heads if has("0123") else max(heads, 16))
        if save and heads < 16 and not has("0123"):  # the padded heads get zero dO and zero delta
            assert torch.count_nonzero(bwd["do"][:, :, heads:]) == 0
            assert torch.count_nonzero(bwd["delta"][:, :, heads:]) == 0
            assert torch.count_nonzero(bwd["delta"][:, :, :heads]) > 0
        results[save] = (out.detach(), query.grad, key.grad)
    for saved, recomputed in zip(results[True], results[False]):
        assert torch.equal(saved, recomputed)
    out, dq, _ = results[True]
    assert torch.count_nonzero(out[empty]) == 0 and torch.count_nonzero(dq[empty]) == 0
    assert torch.count_nonzero(out) > 0 and torch.count_nonzero(dq) > 0
    ref_out, ref_dq, ref_dk = _reference_grads(query, key, idx, scale, grad)
    for got, ref in zip(results[True], (ref_out, ref_dq, ref_dk)):
        assert (got.float() - ref).norm() / ref.norm() < 2e-2


@needs_tilelang
@needs("0107")
@pytest.mark.parametrize("heads", [8, 16])
def test_native_saved_output_is_the_callers(fakes, monkeypatch, heads):
    """0060/0107: the output SparseMLA keeps for backward is the one the hook hands back (the same
    storage, the caller's heads only), so keeping it costs no memory, also with padded heads."""
    monkeypatch.delenv("MCORE_DSA_TILELANG_SEQ_BUCKET", raising=False)
    query, key, idx = _inputs(512, 131, heads, 256, 512)
    out = dsa_kernels.run_fused_absorbed_sparse_attention(_config(heads), query, key, idx, 0.05,
                                                          D_V)
    nodes, seen = [out.grad_fn], set()
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "SparseMLABackward":
            break
        nodes.extend(n for n, _ in node.next_functions)
    else:
        pytest.fail("no SparseMLA node behind the hook's output")
    kept = node.saved_tensors[3]
    assert kept.shape == (1, 256, heads, D_V)
    assert kept.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()


@needs_tilelang
@needs("0060")
def test_native_batch_two_recomputes(fakes, monkeypatch):
    """Batch > 1: the hook's output is a permuted copy, so SparseMLA recomputes (saving would
    keep a second copy alive until backward)."""
    monkeypatch.delenv("MCORE_DSA_TILELANG_SEQ_BUCKET", raising=False)
    g = torch.Generator().manual_seed(3)
    heads, sq, sk, topk = 16, 256, 512, 131
    query = torch.randn(sq, 2, heads, 512, generator=g).to(torch.bfloat16).requires_grad_()
    key = torch.randn(sk, 2, 1, 512, generator=g).to(torch.bfloat16).requires_grad_()
    idx = torch.stack([causal_random_indices(sq, sk, topk, g, offset=sk - sq) for _ in range(2)])
    out = dsa_kernels.run_fused_absorbed_sparse_attention(_config(heads), query, key, idx,
                                                          0.05, D_V)
    assert out is not None and out.shape == (sq, 2, heads, D_V)
    out.float().sum().backward()
    assert [c["kind"] for c in fakes.calls] == ["fwd", "fwd", "bwd"]
    assert query.grad.shape == query.shape and key.grad.shape == key.shape


@needs_tilelang
def test_576_keeps_the_rope_tail_path(fakes, monkeypatch):
    monkeypatch.delenv("MCORE_DSA_TILELANG_SEQ_BUCKET", raising=False)
    topk, sq, sk, heads = 131, 256, 512, 16
    query, key, idx = _inputs(576, topk, heads, sq, sk)
    out, grad, _ = _run_hook(fakes, query, key, idx, 576 ** -0.5)
    kinds = {b["kind"]: b for b in fakes.builds}
    assert kinds["fwd"]["tail_dim"] == TAIL and not kinds["fwd"]["topk_dynamic"]
    assert kinds["bwd"]["tail_dim"] == TAIL and not kinds["bwd"]["topk_dynamic"]
    assert kinds["post"]["tail_dim"] == TAIL
    if has("0050"):
        assert not kinds["fwd"]["skip_invalid_gather"] and not kinds["bwd"]["skip_invalid_gather"]
        assert kinds["bwd"]["threads"] == 128
    padded = _round_up(topk, BLOCK_I)
    for c in fakes.calls:
        assert c["q"].size(-1) == 576 and c["kv"].size(-1) == 576
        assert c["indices"].shape == (1, sq, 1, padded)  # -1 padded to a multiple of 64
        assert bool((c["indices"][..., topk:] == -1).all())
    assert fakes.calls[2]["dkv"].size(-1) == 576
    _assert_hook_matches_reference(out, grad, query, key, idx, 576 ** -0.5)


@needs("0121")
@pytest.mark.parametrize("in_place", [False, True])
def test_sort_rows_sorts_each_row_a_few_rows_at_a_time(in_place):
    """0121's _sort_rows: each row in ascending order (-1 first), the whole tensor whatever the
    number of passes; in place it sorts the given tensor's storage, else it leaves it as given."""
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(-1, 1000, (2, 7, 1, 33), generator=g, dtype=torch.int32)
    given = idx.clone()
    got = bwd_mod._sort_rows(idx, in_place=in_place, rows_per_pass=3)  # 14 rows: 5 passes
    assert got.shape == given.shape and got.dtype == torch.int32
    assert torch.equal(got, given.sort(dim=-1).values)
    if in_place:
        assert got.data_ptr() == idx.data_ptr()
    else:
        assert torch.equal(idx, given) and got.data_ptr() != idx.data_ptr()


@needs_tilelang
@needs("0150")
def test_deterministic_request_without_a_fixed_point_form_warns(fakes):
    """0150: NativeKernelOptions.schedule=False (0030's kernels) has no fixed-point form: a
    deterministic request says so (a warning) and runs the fp32 backward, not silently."""
    heads, topk, scale = 16, 131, 512 ** -0.5
    query, key, idx = _inputs(512, topk, heads, 256, 512)
    with options(schedule=False, bwd_deterministic=True):
        with pytest.warns(UserWarning, match="deterministic backward was asked for"):
            out, grad, _ = _run_hook(fakes, query, key, idx, scale)
    assert [b["kind"] for b in fakes.builds if b["kind"].startswith("bwd")] == ["bwd"]
    _assert_hook_matches_reference(out, grad, query, key, idx, scale)
