"""The TileLang SparseMLA kernels of the patched tree, without a GPU.

1. Compile checks: TileLang 0.1.15 + nvcc lower and compile the forward kernel and the backward
   kernels (preprocess, bwd, postprocess) for sm_90 on a CPU-only host, for the DeepSeek-V3.2
   layout (q/k width 576 = d_v 512 + a 64-wide RoPE tail) and for the native NoPE layout
   (q/k width 512 = d_v, no tail; GLM-5.3-Flash). The generated CUDA and the dynamic
   shared-memory size show that the native kernels have no tail buffers, tail gather, tail GEMM
   or tail atomics, and mask the top-k columns past the caller's width themselves.
   Each compile's wall time is printed (pytest -s, or the -rA report).
2. Routing: the fused hook with fake kernel objects (a PyTorch reference of the kernel contract)
   in place of the compiled kernels. Width 512 reaches the kernels with the caller's own storage
   (no 576 copy, no -1 padded indices copy) and dq/dkv come back 512 wide; width 576 takes the
   old path (RoPE-tail kernels, indices padded to a multiple of 64).

Needs tilelang (both parts) and nvcc (part 1); skipped with the reason otherwise.
"""
import inspect
import os
import re
import shutil
import time
import types

import pytest
import torch
import torch.utils._python_dispatch

from sparse_ref import causal_random_indices, sparse_attention_reference

from megatron.core.transformer.experimental_attention_variant import dsa_kernels
from megatron.core.transformer.experimental_attention_variant.ops import (
    sparse_mla,
    tilelang_dsa,
    tilelang_sparse_mla_bwd as bwd_mod,
    tilelang_sparse_mla_fwd as fwd_mod,
)
from megatron.core.transformer.experimental_attention_variant.ops.tilelang_utils import (
    HAVE_TILELANG,
)

SM90_TARGET = '{"kind": "cuda", "arch": "sm_90"}'
SM90_MAX_DYN_SMEM = 232448  # 227 KiB, the opt-in per-block maximum on Hopper
D_V = 512
TAIL = 64
BLOCK_I = 64  # forward index block
BWD_BLOCK = 32  # backward index block
FWD_STAGES = 2

needs_tilelang = pytest.mark.skipif(not HAVE_TILELANG, reason="tilelang is not importable")


def _nvcc():
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    for cand in (shutil.which("nvcc"), os.path.join(cuda_home, "bin", "nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


needs_nvcc = pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (PATH, CUDA_HOME/bin)")


def _round_up(x, m):
    return (x + m - 1) // m * m


# ---------------------------------------------------------------------------------------------
# 1. sm_90 compile checks
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sm90():
    """Compile for sm_90 whatever the host has: TileLang's default target comes from
    TILELANG_DEFAULT_TARGET at compile time. The kernel cache is off so every compile is real."""
    import tilelang

    old = os.environ.get("TILELANG_DEFAULT_TARGET")
    os.environ["TILELANG_DEFAULT_TARGET"] = SM90_TARGET
    tilelang.disable_cache()
    built = {}

    def build(name, jit_fn, *args, **kwargs):
        if name not in built:
            t0 = time.perf_counter()
            kernel = jit_fn.compile(*args, **kwargs)  # the decorator's out_idx and pass configs
            seconds = time.perf_counter() - t0
            src = kernel.get_kernel_source()
            smem = {
                gv.name_hint: int(f.attrs["dyn_shared_memory_buf"])
                for gv, f in kernel.artifact.device_mod.functions.items()
                if "dyn_shared_memory_buf" in f.attrs
            }
            print(f"\n[compile sm_90] {name}: {seconds:.1f} s, dynamic smem {smem}")
            built[name] = (src, smem, seconds)
        return built[name]

    yield build
    tilelang.enable_cache()
    if old is None:
        os.environ.pop("TILELANG_DEFAULT_TARGET", None)
    else:
        os.environ["TILELANG_DEFAULT_TARGET"] = old


def _label(kind, heads, tail, topk, topk_dynamic, extra):
    opts = "".join(f" {k}={v}" for k, v in sorted(extra.items()))
    return f"{kind} h{heads} width {D_V + tail} topk {topk}{' dynamic' if topk_dynamic else ''}{opts}"


def _fwd(sm90, heads, tail, topk, topk_dynamic, **extra):
    return sm90(
        _label("fwd", heads, tail, topk, topk_dynamic, extra),
        fwd_mod.sparse_mla_fwd,
        heads,
        D_V,
        tail,
        topk,
        1,
        None,
        block_I=BLOCK_I,
        num_stages=FWD_STAGES,
        threads=256,
        topk_dynamic=topk_dynamic,
        **extra,
    )


def _bwd(sm90, heads, tail, topk, topk_dynamic, **extra):
    return sm90(
        _label("bwd", heads, tail, topk, topk_dynamic, extra),
        bwd_mod.bwd, heads, D_V, tail, topk, 1, None, max_block_h=32,
        topk_dynamic=topk_dynamic, **extra,
    )


def _only_smem(smem):
    assert len(smem) == 1, smem
    return next(iter(smem.values()))


def _has_sm90_mma(src):
    return "mma_sync" in src or "wgmma" in src


@needs_tilelang
@needs_nvcc
@pytest.mark.parametrize("heads", [16, 64])
def test_fwd_native_512_has_no_tail_and_saves_exactly_the_tail_smem(sm90, heads):
    src576, smem576, _ = _fwd(sm90, heads, TAIL, 2048, False)
    src512, smem512, _ = _fwd(sm90, heads, 0, _round_up(2051, BLOCK_I), True)
    # the 576 kernel: tail buffers and a 576-element KV row
    assert "Q_tail_shared" in src576 and "K_tail_shared" in src576
    assert "(int64_t)576" in src576
    # the native kernel: no tail buffer, no 576 row anywhere, same MMA path
    assert "_tail" not in src512
    assert "576" not in src512
    assert _has_sm90_mma(src512)
    # top-k width is a kernel argument and columns past it are masked in the kernel
    assert "int topk_len" in src512 and "< topk_len" in src512
    # dynamic shared memory: exactly the tail buffers less (Q tail + double-buffered K tail)
    h_block = max(heads, 16)
    tail_bytes = h_block * TAIL * 2 + FWD_STAGES * BLOCK_I * TAIL * 2
    s576, s512 = _only_smem(smem576), _only_smem(smem512)
    assert s576 - s512 == tail_bytes, (s576, s512)
    assert s512 <= SM90_MAX_DYN_SMEM and s576 <= SM90_MAX_DYN_SMEM


@needs_tilelang
@needs_nvcc
@pytest.mark.parametrize("heads", [16, 64])
def test_bwd_native_512_has_no_tail_gemm_or_atomics(sm90, heads):
    src576, smem576, _ = _bwd(sm90, heads, TAIL, 2048, False)
    src512, smem512, _ = _bwd(sm90, heads, 0, _round_up(2051, BWD_BLOCK), True)
    for name in ("Q_tail_shared", "KV_tail_shared", "acc_dkv_tail_shared"):
        assert name in src576
    assert "_tail" not in src512
    assert "576" not in src512  # no 576 row stride for Q, dQ, KV or the fp32 dKV atomics
    assert _has_sm90_mma(src512)
    assert "int topk_len" in src512 and "< topk_len" in src512
    # the 576 kernel issues the 512 + 64 column atomics, the native one only the 512 column ones
    n576, n512 = src576.count("AtomicAddx4("), src512.count("AtomicAddx4(")
    assert 0 < n512 < n576, (n512, n576)
    s576, s512 = _only_smem(smem576), _only_smem(smem512)
    assert s512 < s576 <= SM90_MAX_DYN_SMEM, (s576, s512)


@needs_tilelang
@needs_nvcc
def test_bwd_pre_and_postprocess_compile(sm90):
    pre_src, _, _ = sm90("preprocess h16 D 512", bwd_mod.preprocess, 16, D_V)
    assert "preprocess" in pre_src
    post576, _, _ = sm90("postprocess width 576", bwd_mod.postprocess, D_V, TAIL, 1)
    post512, _, _ = sm90("postprocess width 512", bwd_mod.postprocess, D_V, 0, 1)
    assert "(int64_t)576" in post576
    # the native dKV cast covers 512 columns: 64 rows x 512 per block, no 576 stride
    assert "576" not in post512 and "(int64_t)32768" in post512


HAVE_NATIVE_SCHEDULE = "skip_invalid_gather" in inspect.signature(
    fwd_mod._get_sparse_mla_fwd_kernel).parameters
needs_native_schedule = pytest.mark.skipif(
    not HAVE_NATIVE_SCHEDULE, reason="the native schedule patch (0050) is not in this tree")
HAVE_SAVE_OUT = sparse_mla.SparseMLA is not None and "save_output" in inspect.signature(
    sparse_mla.SparseMLA.forward).parameters
needs_save_out = pytest.mark.skipif(
    not HAVE_SAVE_OUT, reason="the native save-output patch (0060) is not in this tree")
# kernel calls of one fwd+bwd on the native route: 0060 keeps out/lse (no forward recompute)
NATIVE_CALLS = ["fwd", "bwd"] if HAVE_SAVE_OUT else ["fwd", "fwd", "bwd"]


@needs_tilelang
@needs_nvcc
@needs_native_schedule
def test_native_schedule_keeps_the_pipeline_and_zero_fills_invalid_rows(sm90):
    """0050: a -1 entry addresses row seq_len_kv, which the gather's bounds predicate turns
    into a zero-filling cp.async; the double-buffered cp.async pipeline must survive that."""
    topk = _round_up(2051, BLOCK_I)
    plain, plain_smem, _ = _fwd(sm90, 16, 0, topk, True)
    src, smem, _ = _fwd(sm90, 16, 0, topk, True, skip_invalid_gather=True)
    assert smem == plain_smem  # same double-buffered KV tile
    assert src.count("cp_async_gs_conditional") == plain.count("cp_async_gs_conditional") > 0
    assert "= seq_len_kv;" in src and "= seq_len_kv;" not in plain
    # backward at block_H 32 (64 heads): 256 threads, same shared memory
    btopk = _round_up(2051, BWD_BLOCK)
    bplain, bplain_smem, _ = _bwd(sm90, 64, 0, btopk, True)
    bsrc, bsmem, _ = _bwd(sm90, 64, 0, btopk, True, threads=256, skip_invalid_gather=True)
    assert bsmem == bplain_smem
    assert "__launch_bounds__(256" in bsrc and "__launch_bounds__(128" in bplain
    assert "= seq_len_kv;" in bsrc and "576" not in bsrc


HAVE_WS = hasattr(fwd_mod, "_get_sparse_mla_fwd_nope_ws_kernel")
needs_ws = pytest.mark.skipif(
    not HAVE_WS, reason="the warp-specialized native forward patch (0070) is not in this tree")
SM90A_TARGET = '{"kind": "cuda", "arch": "sm_90a"}'  # setmaxnreg (warp specialization) needs sm_90a


def _check_setmaxnreg_budget(src):
    """setmaxnreg.inc blocks until the CTA's pool has the registers: what the consumer
    warpgroups add over the launch allocation must fit in what the producer gives back, or
    the kernel hangs on its first instruction (a wip draft did, on the H200)."""
    threads = int(re.search(r"__launch_bounds__\((\d+)", src).group(1))
    start = 65536 // threads // 8 * 8  # registers a thread gets at launch (168 at 384 threads)
    inc = [int(n) for n in re.findall(r"warpgroup_reg_alloc<(\d+)>", src)]
    dec = [int(n) for n in re.findall(r"warpgroup_reg_dealloc<(\d+)>", src)]
    assert inc and dec, "no setmaxnreg in a warp-specialized kernel"
    assert all(n % 8 == 0 and 24 <= n <= 256 for n in inc + dec)
    assert sum(n - start for n in inc) <= sum(start - n for n in dec), (start, inc, dec)


@needs_tilelang
@needs_nvcc
@needs_ws
@pytest.mark.parametrize("heads,buffers,chains,ctas", [(16, 3, 4, 132), (32, 2, 4, 0), (16, 3, 2, 0)])
def test_fwd_native_warp_specialized_compiles_for_sm90a(sm90, heads, buffers, chains, ctas):
    """0070: three warpgroups (384 threads). The gather warpgroup issues zero-filling cp.async
    and hands buffers over with mbarriers; neither it nor the second consumer shares a named
    barrier with the first consumer (a shared id hung an early draft on the H200). WG0 runs the
    score GEMM in `chains` independent MMA chains and the softmax; WG1 the whole P.V. Each
    warpgroup loops over its CTA's queries when persistent (ctas CTAs); with ctas = 0, a CTA a
    query, there is no query loop at all."""
    os.environ["TILELANG_DEFAULT_TARGET"] = SM90A_TARGET  # the sm90 fixture restores it
    topk = _round_up(2051, buffers * BLOCK_I)
    try:
        src, smem, _ = sm90(f"fwd_ws h{heads} topk {topk} buffers {buffers} chains {chains} ctas {ctas} sm_90a",
                            fwd_mod.sparse_mla_fwd_nope_ws, heads, D_V, topk, None,
                            block_I=BLOCK_I, num_buffers=buffers, qk_chains=chains, ctas=ctas)
    finally:
        os.environ["TILELANG_DEFAULT_TARGET"] = SM90_TARGET
    assert "__launch_bounds__(384" in src
    # persistent: the query loop in all three warpgroups, striding by the CTA count; a query's
    # (batch, position) is worked out once a query: a division by seq_len inside the index
    # expressions (64-bit, an element) made a draft 1.8x slower on the H200
    assert len(re.findall(r"for \(int q_it(_\d+)? = 0;", src)) == (3 if ctas else 0)
    assert (f"* {ctas})" in src) == bool(ctas)
    assert ("blockIdx.y" in src) == (not ctas)  # a CTA a query: (position, batch) = blockIdx
    assert "/ ((int64_t)seq_len)" not in src and "% ((int64_t)seq_len)" not in src
    assert "_tail" not in src and "(int64_t)576" not in src  # no tail, no 576-wide row
    assert "int topk_len" in src
    assert "cp_async_gs_conditional<16>" in src and "mbarrier_cp_async_arrive_noinc" in src
    _check_setmaxnreg_budget(src)
    wg0, rest = src.split("warpgroup_reg_alloc<232>", 1)
    wg1, producer = rest.split("warpgroup_reg_dealloc<80>", 1)
    for other in (wg1, producer):  # WG0's reductions use named barriers; nobody else may
        assert "__sync_thread_partial" not in other and "__syncthreads" not in other
    # WG1 rescales the whole output by WG0's alpha, divides by WG0's sum and stores both
    # halves (with a fragment shared with WG0, TileLang dropped all three in a draft)
    alphas = set(re.findall(r"\(\(float\*\)(v_\d+)\)", wg0))  # one fp32 alpha tile per buffer
    assert len(alphas) == buffers and set(re.findall(r"\(\(float\*\)(v_\d+)\)", wg1)) == alphas
    assert "sumexp_shared" in wg1
    assert wg1.count("Output + ") == 2 and "Output + " not in wg0
    assert "Lse[" in wg0
    assert _has_sm90_mma(src)
    # per buffer: WG0's score GEMM in `chains` accumulators of 2 n8 tiles a warp, WG1's P.V in
    # 2 halves of 8 (16 heads) or 16 (32 heads) n8 tiles... counted as mma_sync call sites
    assert wg0.count("mma_sync") == buffers * chains * 2
    assert src.count("mbarrier_cp_async_arrive_noinc") == buffers  # one per buffer
    # the producer loads the next block's indices after issuing a buffer (not before each row)
    assert producer.count("Indices[") == buffers + 1
    # Q + the KV buffers + the bf16 probability tiles, within Hopper's per-block maximum
    assert _only_smem(smem) >= 2 * (heads * D_V + buffers * BLOCK_I * D_V + buffers * heads * BLOCK_I)
    assert _only_smem(smem) <= SM90_MAX_DYN_SMEM


@needs_tilelang
@needs_nvcc
def test_576_static_topk_kernels_still_reject_unaligned_topk():
    """Without topk_dynamic the old contract holds: top-k a multiple of the index block."""
    with pytest.raises(AssertionError):
        fwd_mod.sparse_mla_fwd.get_tir(16, D_V, TAIL, 2051, 1, None)
    with pytest.raises(AssertionError):
        bwd_mod.bwd.get_tir(16, D_V, TAIL, 2051, 1, None)


# ---------------------------------------------------------------------------------------------
# 2. routing through the fused hook with fake kernel objects (CPU)
# ---------------------------------------------------------------------------------------------

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

        def kernel(q, kv, indices):
            self._check_topk(topk, indices, topk_dynamic)
            assert q.size(-1) == kv.size(-1) == dim + tail_dim
            self.calls.append(dict(kind="fwd", q=q, kv=kv, indices=indices))
            out = _attend(q, kv, indices, sm_scale).to(q.dtype)
            return out, _lse_log2(q, kv, indices, sm_scale)

        return kernel

    def get_fwd_ws(self, heads, dim, topk, sm_scale, block_I, num_buffers, qk_chains=4, ctas=0):
        kernel = self.get_fwd(heads, dim, 0, topk, 1, sm_scale, block_I, None, 384,
                              topk_dynamic=True)
        self.builds[-1].update(kind="fwd_ws", num_buffers=num_buffers, qk_chains=qk_chains,
                               ctas=ctas)
        return kernel

    def get_pre(self, H, D):
        def kernel(o, do):
            return (o.float() * do.float()).sum(-1)

        return kernel

    def get_bwd(self, H, D, D_tail, topk, kv_group, sm_scale, max_block_h, topk_dynamic=False,
                **extra):
        self.builds.append(dict(kind="bwd", heads=H, dim=D, tail_dim=D_tail, topk=topk,
                                topk_dynamic=topk_dynamic, **extra))

        def kernel(q, kv, do, indices, lse, delta, dkv):
            self._check_topk(topk, indices, topk_dynamic)
            assert q.size(-1) == kv.size(-1) == dkv.size(-1) == D + D_tail
            assert dkv.dtype == torch.float32
            self.calls.append(dict(kind="bwd", q=q, kv=kv, indices=indices, dkv=dkv))
            with torch.enable_grad():
                qf = q.detach().float().requires_grad_()
                kf = kv.detach().float().requires_grad_()
                out = _attend(qf, kf, indices, sm_scale)
                dq, dk = torch.autograd.grad(out, (qf, kf), do.float())
            dkv += dk
            return dq.to(q.dtype)

        return kernel

    def get_post(self, D, D_tail, kv_group):
        self.builds.append(dict(kind="post", dim=D, tail_dim=D_tail))

        def kernel(dkv):
            assert dkv.size(-1) == D + D_tail
            return dkv.to(torch.bfloat16)

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
    if HAVE_WS:
        monkeypatch.setattr(fwd_mod, "_get_sparse_mla_fwd_nope_ws_kernel",
                            lambda *a, **k: f.get_fwd_ws(*a, **k))
    monkeypatch.setattr(bwd_mod, "_get_preprocess_kernel", lambda *a, **k: f.get_pre(*a, **k))
    monkeypatch.setattr(bwd_mod, "_get_bwd_kernel", lambda *a, **k: f.get_bwd(*a, **k))
    monkeypatch.setattr(bwd_mod, "_get_postprocess_kernel", lambda *a, **k: f.get_post(*a, **k))
    monkeypatch.setattr(dsa_kernels, "_ABSORBED_FIRST_CALL_REPORTED", True)  # keep logs quiet
    monkeypatch.delenv("MCORE_DSA_REQUIRE_FUSED", raising=False)
    for var in ("MCORE_DSA_TILELANG_TOPK_BUCKET", "MCORE_DSA_TILELANG_BWD_MAX_BLOCK_H",
                "MCORE_DSA_TILELANG_NATIVE_SCHEDULE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MCORE_DSA_TILELANG_NOPE", "native")  # whatever the head count
    # 0070's warp-specialized forward is tested on its own below; the tests here check the
    # pipelined forward's build arguments
    monkeypatch.setenv("MCORE_DSA_TILELANG_NATIVE_FWD_WS", "0")
    return f


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
    orig = {n: getattr(fakes, n) for n in ("get_fwd", "get_fwd_ws", "get_pre", "get_bwd", "get_post")}

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


def _reference_grads(query, key, idx, scale, grad):
    q = query.detach().float().permute(1, 0, 2, 3).requires_grad_()
    k = key.detach().float().permute(1, 0, 2, 3).requires_grad_()
    out = sparse_attention_reference(q, k, idx.unsqueeze(2), scale, d_v=D_V)
    out.backward(grad.float().permute(1, 0, 2, 3))
    return out.permute(1, 0, 2, 3), q.grad.permute(1, 0, 2, 3), k.grad.permute(1, 0, 2, 3)


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
    if HAVE_NATIVE_SCHEDULE:  # 0050: zero-filled -1 rows; 16 heads keep the 128-thread bwd
        assert kinds["fwd"]["skip_invalid_gather"] and kinds["bwd"]["skip_invalid_gather"]
        assert kinds["bwd"]["threads"] == 128

    # forward (and the backward's recompute without 0060) and backward read the caller's storage
    calls = fakes.calls
    assert [c["kind"] for c in calls] == NATIVE_CALLS
    for c in calls:
        assert c["q"].shape == (1, sq, heads, 512) and c["kv"].shape == (1, sk, 1, 512)
        assert c["q"].data_ptr() == query.data_ptr()
        assert c["kv"].data_ptr() == key.data_ptr()
        assert c["indices"].shape == (1, sq, 1, topk)
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
@needs_native_schedule
@pytest.mark.parametrize("heads,threads", [(16, 128), (32, 256), (64, 256)])
@pytest.mark.parametrize("schedule", ["1", "0"])
def test_native_schedule_switch(fakes, monkeypatch, heads, threads, schedule):
    """0050: 256 bwd threads from a 32-head block up; MCORE_DSA_TILELANG_NATIVE_SCHEDULE=0 gives
    0030's native kernels (no zero-filled gather, 128 threads)."""
    monkeypatch.setenv("MCORE_DSA_TILELANG_NATIVE_SCHEDULE", schedule)
    query, key, idx = _inputs(512, 131, heads, 256, 512)
    _run_hook(fakes, query, key, idx, 0.05)
    kinds = {b["kind"]: b for b in fakes.builds}
    on = schedule == "1"
    assert kinds["fwd"]["skip_invalid_gather"] is on and kinds["bwd"]["skip_invalid_gather"] is on
    assert kinds["bwd"]["threads"] == (threads if on else 128)
    if "split_store" in kinds["bwd"]:  # 16-head block: dKV staged in 8 slices (2 CTAs per SM)
        assert kinds["bwd"]["split_store"] == (8 if on and heads == 16 else 2)


@needs_tilelang
@needs_ws
@pytest.mark.parametrize("heads,kernel_heads", [(8, 16), (16, 16), (32, 32), (64, 64), (128, 128)])
@pytest.mark.parametrize("ws", [None, "1", "0"])
@pytest.mark.parametrize("persist", [None, "0"])
def test_native_forward_warp_specialized_switch(fakes, monkeypatch, heads, kernel_heads, ws, persist):
    """0070: the native route's forward is the warp-specialized kernel at 16 and 32 kernel heads
    (3 KV buffers at 16, 2 at 32, four score MMA chains; built for top-k rounded to a whole
    number of buffer rounds of 64 indices, taking the caller's q, kv and indices) and the
    pipelined one from 64 heads (its second consumer holds the whole output: no room at 64);
    MCORE_DSA_TILELANG_NATIVE_FWD_WS=0 gives the pipelined one everywhere, =1 is the default.
    At 16 kernel heads it is persistent, one CTA per SM of the input's device, unless
    MCORE_DSA_TILELANG_NATIVE_FWD_WS_PERSIST=0; at 32 a CTA a query. The backward is the same."""
    monkeypatch.delenv("MCORE_DSA_TILELANG_SEQ_BUCKET", raising=False)
    monkeypatch.delenv("MCORE_DSA_TILELANG_NATIVE_FWD_WS_BUFFERS", raising=False)
    monkeypatch.delenv("MCORE_DSA_TILELANG_NATIVE_FWD_WS_CHAINS", raising=False)
    if ws is None:
        monkeypatch.delenv("MCORE_DSA_TILELANG_NATIVE_FWD_WS", raising=False)
    else:
        monkeypatch.setenv("MCORE_DSA_TILELANG_NATIVE_FWD_WS", ws)
    if persist is None:
        monkeypatch.delenv("MCORE_DSA_TILELANG_NATIVE_FWD_WS_PERSIST", raising=False)
    else:
        monkeypatch.setenv("MCORE_DSA_TILELANG_NATIVE_FWD_WS_PERSIST", persist)
    asked = []  # the CPU inputs stand for a device with 7 SMs

    def props(device):
        asked.append(torch.device(device))
        return types.SimpleNamespace(multi_processor_count=7)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    topk, scale = 131, 512 ** -0.5
    query, key, idx = _inputs(512, topk, heads, 256, 512)
    out, grad, _ = _run_hook(fakes, query, key, idx, scale)
    on = ws != "0" and kernel_heads in (16, 32)
    fwd = [b for b in fakes.builds if b["kind"] in ("fwd", "fwd_ws")]
    assert {b["kind"] for b in fwd} == {"fwd_ws" if on else "fwd"}
    assert fwd[0]["heads"] == kernel_heads and fwd[0]["tail_dim"] == 0
    buffers = 3 if kernel_heads == 16 else 2
    assert fwd[0]["topk"] == _round_up(topk, buffers * BLOCK_I if on else BLOCK_I)
    if on:
        assert fwd[0]["num_buffers"] == buffers and fwd[0]["qk_chains"] == 4
        persistent = persist != "0" and kernel_heads == 16
        assert fwd[0]["ctas"] == (7 if persistent else 0)
        assert set(asked) == ({query.device} if persistent else set())
    first = fakes.calls[0]
    assert first["kind"] == "fwd" and first["indices"].data_ptr() == idx.data_ptr()
    assert first["kv"].data_ptr() == key.data_ptr()
    if heads == kernel_heads:
        assert first["q"].data_ptr() == query.data_ptr()
    ref_out, ref_dq, ref_dk = _reference_grads(query, key, idx, scale, grad)
    for got, ref in ((out, ref_out), (query.grad, ref_dq), (key.grad, ref_dk)):
        assert (got.float() - ref).norm() / ref.norm() < 2e-2


@needs_tilelang
def test_native_512_small_head_count_pads_heads_only(fakes):
    query, key, idx = _inputs(512, 131, 8, 256, 512)
    _run_hook(fakes, query, key, idx, 0.05)
    fwd_call = fakes.calls[0]
    assert fwd_call["q"].shape == (1, 256, 16, 512)  # heads padded to the 16-head tile
    assert torch.count_nonzero(fwd_call["q"][:, :, 8:]) == 0
    assert fwd_call["kv"].data_ptr() == key.data_ptr()
    assert fwd_call["indices"].data_ptr() == idx.data_ptr()
    assert query.grad.shape == query.shape
    # padded heads: the hook's output is a copy, so SparseMLA recomputes instead of saving
    assert [c["kind"] for c in fakes.calls] == ["fwd", "fwd", "bwd"]


def _with_empty_rows(idx, rows):
    idx = idx.clone()
    idx[:, rows] = -1  # rows with no valid index: zero output and zero gradient
    return idx


@needs_tilelang
@needs_save_out
def test_native_save_output_matches_recompute(fakes, monkeypatch):
    """0060: the native route keeps out/lse for backward (one forward kernel per fwd+bwd) and
    gives what upstream's recompute gives (MCORE_DSA_TILELANG_NATIVE_SAVE_OUT=0), including zero
    output and gradients for rows with no valid index, which it no longer masks itself."""
    monkeypatch.delenv("MCORE_DSA_TILELANG_SEQ_BUCKET", raising=False)
    heads, sq, sk, topk, scale = 16, 256, 512, 131, 512 ** -0.5
    empty = [0, 5, 200]
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("MCORE_DSA_TILELANG_NATIVE_SAVE_OUT", flag)
        fakes.calls.clear()
        query, key, idx = _inputs(512, topk, heads, sq, sk)
        idx = _with_empty_rows(idx, empty)
        out, grad, _ = _run_hook(fakes, query, key, idx, scale)
        kinds = [c["kind"] for c in fakes.calls]
        assert kinds == (["fwd", "bwd"] if flag == "1" else ["fwd", "fwd", "bwd"])
        results[flag] = (out.detach(), query.grad, key.grad)
    for saved, recomputed in zip(results["1"], results["0"]):
        assert torch.equal(saved, recomputed)
    out, dq, _ = results["1"]
    assert torch.count_nonzero(out[empty]) == 0 and torch.count_nonzero(dq[empty]) == 0
    assert torch.count_nonzero(out) > 0 and torch.count_nonzero(dq) > 0
    ref_out, ref_dq, ref_dk = _reference_grads(query, key, idx, scale, grad)
    for got, ref in zip(results["1"], (ref_out, ref_dq, ref_dk)):
        assert (got.float() - ref).norm() / ref.norm() < 2e-2


@needs_tilelang
@needs_save_out
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
    if HAVE_NATIVE_SCHEDULE:
        assert not kinds["fwd"]["skip_invalid_gather"] and not kinds["bwd"]["skip_invalid_gather"]
        assert kinds["bwd"]["threads"] == 128
    padded = _round_up(topk, BLOCK_I)
    for c in fakes.calls:
        assert c["q"].size(-1) == 576 and c["kv"].size(-1) == 576
        assert c["indices"].shape == (1, sq, 1, padded)  # -1 padded to a multiple of 64
        assert bool((c["indices"][..., topk:] == -1).all())
    assert fakes.calls[2]["dkv"].size(-1) == 576
    ref_out, ref_dq, ref_dk = _reference_grads(query, key, idx, 576 ** -0.5, grad)
    for got, ref in ((out, ref_out), (query.grad, ref_dq), (key.grad, ref_dk)):
        assert (got.float() - ref).norm() / ref.norm() < 2e-2
