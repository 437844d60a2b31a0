"""The TileLang SparseMLA kernels of the patched tree, lowered and compiled without a GPU.

TileLang 0.1.15 + nvcc lower and compile the forward kernel and the backward kernels (preprocess,
bwd, postprocess) for sm_90 (sm_90a for the warp-specialized forward) on a CPU-only host, for the
DeepSeek-V3.2 layout (q/k width 576 = d_v 512 + a 64-wide RoPE tail) and for the native NoPE
layout (q/k width 512 = d_v, no tail; GLM-5.3-Flash). The generated CUDA and the dynamic
shared-memory size show what each patch promises: no tail buffers, gather, GEMM or atomics in the
native kernels (0030), the zero-filling gather and 256-thread backward (0050), the warp-specialized
forward's warpgroups and barriers (0070), the index-bounds compare of every native kernel (0080).
Each compile's wall time is printed (pytest -s, or the -rA report). The routing through the hook
is tested in test_native_routing.py.

Needs tilelang and nvcc; skipped with the reason otherwise.
"""
import os
import re
import tempfile
import time

import pytest

from native_kernels import (
    BLOCK_I,
    BWD_BLOCK,
    D_V,
    FEATURES,
    FWD_STAGES,
    SM90A_TARGET,
    SM90_MAX_DYN_SMEM,
    SM90_SMEM_PER_SM,
    SM90_TARGET,
    TAIL,
    bwd_ws64_route_kwargs,
    bwd_mod,
    fwd_mod,
    fwd_ws64_route_kwargs,
    has,
    listed,
    needs,
    needs_draft,
    needs_nvcc,
    needs_tilelang,
    ptxas_sm90a,
    round_up as _round_up,
)


@pytest.mark.parametrize("number", sorted(FEATURES))
def test_series_features_are_in_the_tree(number):
    """A native patch that patches/series lists has its code in the tree the tests import."""
    what, present = FEATURES[number]
    if not listed(number):
        pytest.skip(f"patch {number} is not in patches/series")
    assert present(), f"patches/series lists {number}, but the tree has no {what}"


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


def _bwd(sm90, heads, tail, topk, topk_dynamic, max_block_h=32, **extra):
    return sm90(
        _label("bwd", heads, tail, topk, topk_dynamic, dict(extra, max_block_h=max_block_h)),
        bwd_mod.bwd, heads, D_V, tail, topk, 1, None, max_block_h=max_block_h,
        topk_dynamic=topk_dynamic, **extra,
    )


def _only_smem(smem):
    assert len(smem) == 1, smem
    return next(iter(smem.values()))


def _smem_regions(src):
    """{buffer: (start, end)} of the shared-memory buffers a kernel carves out of its dynamic
    allocation, from the generated CUDA and the buffers' declarations."""
    offsets = dict(re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);", src))
    starts = sorted((int(o), name) for name, o in offsets.items())
    return {name: (start, nxt) for (start, name), (nxt, _) in zip(starts, starts[1:] + [(None, None)])}


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


@needs_tilelang
@needs_nvcc
@needs("0050")
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




def _sm90a(sm90, name, jit_fn, *args, **kwargs):
    """sm90's build for sm_90a (setmaxnreg, wgmma need it), the fixture's target back after."""
    os.environ["TILELANG_DEFAULT_TARGET"] = SM90A_TARGET
    try:
        return sm90(f"{name} sm_90a", jit_fn, *args, **kwargs)
    finally:
        os.environ["TILELANG_DEFAULT_TARGET"] = SM90_TARGET


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
@needs("0070")
@pytest.mark.parametrize("heads,buffers,chains,ctas", [(16, 3, 4, 132), (32, 2, 4, 0), (16, 3, 2, 0)])
def test_fwd_native_warp_specialized_compiles_for_sm90a(sm90, heads, buffers, chains, ctas):
    """0070: three warpgroups (384 threads). The gather warpgroup issues zero-filling cp.async
    and hands buffers over with mbarriers; neither it nor the second consumer shares a named
    barrier with the first consumer (a shared id hung an early draft on the H200). WG0 runs the
    score GEMM in `chains` independent MMA chains and the softmax; WG1 the whole P.V. Each
    warpgroup loops over its CTA's queries when persistent (ctas CTAs); with ctas = 0, a CTA a
    query, there is no query loop at all."""
    topk = _round_up(2051, buffers * BLOCK_I)
    src, smem, _ = _sm90a(sm90, f"fwd_ws h{heads} topk {topk} buffers {buffers} chains {chains} ctas {ctas}",
                          fwd_mod.sparse_mla_fwd_nope_ws, heads, D_V, topk, None,
                          block_I=BLOCK_I, num_buffers=buffers, qk_chains=chains, ctas=ctas)
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


@needs_tilelang
@needs_nvcc
@needs("0080")
def test_native_kernels_compare_every_index_with_the_kv_length(sm90):
    """0080: every native kernel turns an index outside [0, seq_len_kv) into -1 with one unsigned
    compare (the forward's mask and gather, the backward's mask, gather and dKV atomics); the 576
    kernels are generated as before, without it."""
    compare = "< ((uint)seq_len_kv)"
    topk, btopk = _round_up(2051, BLOCK_I), _round_up(2051, BWD_BLOCK)
    for heads in (16, 64):
        fwd, _, _ = _fwd(sm90, heads, 0, topk, True, skip_invalid_gather=True)
        bwd, _, _ = _bwd(sm90, heads, 0, btopk, True, threads=256 if heads > 16 else 128,
                         skip_invalid_gather=True)
        assert fwd.count(compare) >= 2 and bwd.count(compare) >= 3, heads
    for src, _, _ in (_fwd(sm90, 16, TAIL, 2048, False), _bwd(sm90, 16, TAIL, 2048, False)):
        assert "(uint)seq_len_kv" not in src


@needs_tilelang
@needs_nvcc
@needs("0100")
def test_native_bwd_64_head_block_fits(sm90):
    """0100: the native backward at 64 kernel heads as one 64-head block (256 threads, dKV staged
    in 8 slices) builds for sm_90a within the shared memory limit, with 0080's index test."""
    btopk = _round_up(2051, BWD_BLOCK)
    one, one_smem, _ = _bwd(sm90, 64, 0, btopk, True, max_block_h=64, threads=256,
                            skip_invalid_gather=True, split_store=8)
    two, two_smem, _ = _bwd(sm90, 64, 0, btopk, True, threads=256, skip_invalid_gather=True)
    # a 64-row Q/dO tile: more shared memory than the 32-head block's, within the limit only
    # because dKV is staged in 8 slices (2 would need 237568 B)
    assert _only_smem(two_smem) < _only_smem(one_smem) == 212992 <= SM90_MAX_DYN_SMEM
    assert "__launch_bounds__(256" in one and "576" not in one
    assert one.count("< ((uint)seq_len_kv)") >= 3 and one.count("AtomicAddx4(") > 0


@needs_tilelang
@needs_nvcc
@needs("0105")
def test_native_bwd_dkv_chunks_shrink_the_accumulator(sm90):
    """0105: the native backward's dKV accumulator is a column chunk: at a 16-head block (128
    threads) 32 x 64 staged in shared memory for 4-float atomics, in no more shared memory than the
    whole block's 8 slices (two CTAs still fit an SM); at a 64-head block (256 threads) 32 x 128
    added from registers with 2-float atomics and no stage. Both keep 0080's index test."""
    btopk = _round_up(2051, BWD_BLOCK)
    common = dict(skip_invalid_gather=True, split_store=8)
    whole16, whole16_smem, _ = _bwd(sm90, 16, 0, btopk, True, max_block_h=16, threads=128, **common)
    c16, c16_smem, _ = _bwd(sm90, 16, 0, btopk, True, max_block_h=16, threads=128, dkv_chunk=64,
                            **common)
    whole64, whole64_smem, _ = _bwd(sm90, 64, 0, btopk, True, max_block_h=64, threads=256, **common)
    c64, c64_smem, _ = _bwd(sm90, 64, 0, btopk, True, max_block_h=64, threads=256, dkv_chunk=128,
                            dkv_direct=True, **common)
    # per thread: 32 x 512 / 128 = 128 floats whole, 32 x 64 / 128 and 32 x 128 / 256 = 16 chunked
    assert "float acc_dkv[128];" in whole16 and "float acc_dkv[16];" in c16
    assert "float acc_dkv[64];" in whole64 and "float acc_dkv[16];" in c64
    assert 2 * (_only_smem(c16_smem) + 1024) <= SM90_SMEM_PER_SM
    assert _only_smem(c16_smem) <= _only_smem(whole16_smem)
    assert _only_smem(c64_smem) < _only_smem(whole64_smem) <= SM90_MAX_DYN_SMEM
    assert c16.count("AtomicAddx4(") > 0 and "AtomicAddx2(" not in c16
    assert c64.count("AtomicAddx2(") > 0 and "AtomicAddx4(" not in c64
    for src in (c16, c64):
        assert src.count("< ((uint)seq_len_kv)") >= 3 and "576" not in src


@needs_tilelang
@needs_nvcc
@needs("0106")
@pytest.mark.parametrize("heads,threads", [(16, 128), (32, 256), (64, 256)])
def test_native_bwd_dkv_lines_adds_4_floats_from_registers(sm90, heads, threads):
    """0106: the line-ordered dKV add (16 columns a warp) reorders each chunk in registers and
    adds it with 4-float atomics straight from them: no shared stage for dKV (less shared memory
    than 0105's staged 16-head chunk), no 2-float atomics. The postprocess built with lines=True
    compiles for sm_90a too."""
    btopk = _round_up(2051, BWD_BLOCK)
    chunk = 16 * (threads // 32)
    src, smem, _ = _bwd(sm90, heads, 0, btopk, True, max_block_h=heads, threads=threads,
                        skip_invalid_gather=True, split_store=8, dkv_chunk=chunk, dkv_lines=True)
    assert "float acc_dkv[16];" in src and "float acc_lines[16];" in src
    assert src.count("AtomicAddx4(") > 0 and "AtomicAddx2(" not in src
    assert "acc_dkv_shared" not in src
    assert src.count("< ((uint)seq_len_kv)") >= 3 and "576" not in src
    if heads == 16:
        _, staged_smem, _ = _bwd(sm90, 16, 0, btopk, True, max_block_h=16, threads=128,
                                 skip_invalid_gather=True, split_store=8, dkv_chunk=64)
        assert _only_smem(smem) < _only_smem(staged_smem)
    plain, _, _ = sm90("post", bwd_mod.postprocess, D_V, 0, 1)
    post, _, _ = sm90("post-lines", bwd_mod.postprocess, D_V, 0, 1, lines=True)
    assert post != plain


@needs_tilelang
@needs_nvcc
@needs("0107")
def test_delta_kernel_builds_for_the_callers_heads(sm90):
    """0107: with padded heads SparseMLA computes delta on the caller's heads only (8 a GPU at
    GLM's tensor-parallel sizes), a head count no other kernel is built for: it builds for sm_90
    like the 16-head one, the heads being its grid's first axis."""
    src8, _, _ = sm90("pre-8", bwd_mod.preprocess, 8, D_V)
    src16, _, _ = sm90("pre-16", bwd_mod.preprocess, 16, D_V)
    # Delta[b, s, h] rows are 8 heads long where the 16-head kernel's are 16
    assert "* (int64_t)8)) + ((int64_t)((int)blockIdx.x)))] = delta" in src8
    assert "* (int64_t)16)) + ((int64_t)((int)blockIdx.x)))] = delta" in src16


def _scalar_params(src, name):
    """The non-pointer float parameters of kernel `name` in TileLang's CUDA source."""
    sig = re.search(rf"__global__ void (?:__launch_bounds__\([^)]*\) )?{name}\(([^)]*)\)", src)
    assert sig, f"no kernel {name}"
    return [p.split()[-1] for p in sig.group(1).split(",") if p.split()[0] == "float"]


@needs_tilelang
@needs_nvcc
@needs("0108")
def test_runtime_scale_kernels_take_the_scale_as_an_argument(sm90):
    """0108: built with runtime_scale the native backward and the 64-head forward take one float
    argument (the softmax scale) and fold no scale into the code; the 576 kernels keep theirs."""
    btopk = _round_up(2051, BWD_BLOCK)
    rt_bwd, _, _ = _bwd(sm90, 16, 0, btopk, True, max_block_h=16, threads=128,
                        skip_invalid_gather=True, split_store=8, dkv_chunk=64, dkv_lines=True,
                        runtime_scale=True)
    rt_fwd, _, _ = _fwd(sm90, 64, 0, _round_up(2051, BLOCK_I), True, skip_invalid_gather=True,
                        runtime_scale=True)
    tail_fwd, _, _ = _fwd(sm90, 16, TAIL, 2048, False)
    assert len(_scalar_params(rt_bwd, "sparse_mla_bwd_kernel_kernel")) == 1
    assert len(_scalar_params(rt_fwd, "main_kernel")) == 1
    assert _scalar_params(tail_fwd, "main_kernel") == []
    # the argument is multiplied by log2(e) in the kernel
    for src in (rt_bwd, rt_fwd):
        assert "0x1.7154764ee6c2fp+0f" in src  # log2(e), applied to the argument in the kernel


@needs_tilelang
@needs_nvcc
@needs("0108")
def test_runtime_and_build_time_scale_kernels_both_return_their_outputs(sm90):
    """0108: one process builds a kernel with the runtime scale, then the same builder without it
    (the native route, then a 576 or an A/B kernel): each returns its own outputs. TileLang's
    adapter rewrites a negative out_idx in place to the first build's positions; with the scale
    argument before the outputs the second build failed (GPU run 16a)."""
    cases = (
        (fwd_mod.sparse_mla_fwd, (16, D_V, 0, 128, 1, None),
         dict(block_I=BLOCK_I, num_stages=FWD_STAGES, threads=256, topk_dynamic=True,
              skip_invalid_gather=True), ["Output_handle", "Lse_handle"]),
        (bwd_mod.bwd, (16, D_V, 0, 128, 1, None),
         dict(max_block_h=16, topk_dynamic=True, threads=128, skip_invalid_gather=True),
         ["dQ_handle"]),
    )
    for jit_fn, args, kwargs, outputs in cases:
        params = {}
        for runtime in (True, False):  # in this order: the first build sets the decorator's list
            kernel = jit_fn.compile(*args, runtime_scale=runtime, **kwargs)
            names = params[runtime] = [p.name for p in kernel.prim_func.params]
            assert [names[i] for i in kernel.adapter.result_idx] == outputs, (jit_fn, runtime)
        assert params[True][:-1] == params[False]  # the scale is the last argument


def _split_ws64_fwd(src):
    """0112's kernel by warpgroup: (WG0, WG1, producer), cut at their setmaxnreg."""
    _, wg0, rest = src.split("warpgroup_reg_alloc<216>")
    wg1, producer = rest.split("warpgroup_reg_dealloc<72>")
    return wg0, wg1, producer


# 0160's consumers handing Q over in a query's last block pair (17 pairs at top-k 2051)
_Q_HANDOVER_IN_LAST_PAIR = r"if \(p_i\w* == 16\) \{\s*bar_q_free\[0\]\.arrive\(\);"


def _ws64_fwd_sm90a(sm90, heads, **draft):
    """0112's forward at top-k 2051 with the scale at each call, for sm_90a, with these builder
    arguments (none: the builder's defaults; the route's: fwd_ws64_route_kwargs()); one build a
    set of them (the fixture keys by the name)."""
    topk = _round_up(2051, 2 * BLOCK_I)
    name = f"fwd_ws64 h{heads} topk {topk}" + "".join(f" {k}={v}" for k, v in sorted(draft.items()))
    return _sm90a(sm90, name, fwd_mod.sparse_mla_fwd_nope_ws64, heads, D_V, topk, None,
                  block_I=BLOCK_I, runtime_scale=True, **draft)


def _ptxas_report(src):
    """What ptxas says (-v) about TileLang's CUDA built for sm_90a with nvcc."""
    with tempfile.TemporaryDirectory() as tmp:
        return ptxas_sm90a(src, os.path.join(tmp, "k.cubin"))


def _assert_no_spills(report):
    """ptxas's -v report (_ptxas_report) has a spill line for the kernel, and it spills nothing."""
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(st == ld == "0" for st, ld in spills), spills


def _bwd_ws64_route_sm90a(sm90, heads):
    """0113's backward at top-k 2051 as the route builds it (the series' levers at their
    defaults), for sm_90a."""
    return _sm90a(sm90, f"bwd_ws64 h{heads} route", bwd_mod.sparse_mla_bwd_ws64, heads, D_V,
                  _round_up(2051, BWD_BLOCK), runtime_scale=True, **bwd_ws64_route_kwargs())


# The route's 64-row builds at 64 heads (the forward at 32 too, and with 0160 off: a CTA a query).
_WS64_BUILDS = {
    "fwd_ws64": lambda sm90: _ws64_fwd_sm90a(sm90, 64, **fwd_ws64_route_kwargs()),
    "fwd_ws64_h32": lambda sm90: _ws64_fwd_sm90a(sm90, 32, **fwd_ws64_route_kwargs()),
    "fwd_ws64_cta": lambda sm90: _ws64_fwd_sm90a(sm90, 64, **{
        **fwd_ws64_route_kwargs(), "ctas": 0, "dynamic": False, "stage_out": False,
        "counter_reset": False}),
    "bwd_ws64": lambda sm90: _bwd_ws64_route_sm90a(sm90, 64),
    "bwd_ws64_h8": lambda sm90: _bwd_ws64_route_sm90a(sm90, 8),
}


@needs_tilelang
@needs_nvcc
@needs("0113")
@pytest.mark.parametrize("kind", ["fwd_ws64", "fwd_ws64_h32", pytest.param(
    "fwd_ws64_cta", marks=needs("0160")), "bwd_ws64", pytest.param(
    "bwd_ws64_h8", marks=needs("0153"))])
def test_ws64_kernels_keep_wgmma_asynchronous(sm90, kind):
    """ptxas serializes every wgmma of a kernel (its warning C7514) when a non-wgmma
    instruction touches the accumulator of one still in flight, for instance one left in flight
    across a loop's back edge: each HGMMA then gets its own arrive and wait (wip/0117 lost
    20-26% of the forward that way in run 19). The 64-row kernels the route builds at 64 heads
    (the forward at 32 heads too, with the series' options: 0154's store, 0160-0164's persistent
    form, and 0160's A/B, a CTA a query with 0161/0162's options; 0153: the backward at 8 heads)
    compile without it and without spills."""
    src, _, _ = _WS64_BUILDS[kind](sm90)
    report = _ptxas_report(src)
    assert "C7514" not in report and "serialized" not in report, report[-2000:]
    _assert_no_spills(report)


@needs_tilelang
@needs_nvcc
@needs("0154")
@pytest.mark.parametrize("heads", [32, 64])
def test_fwd_native_ws64_smem_store(sm90, heads):
    """0154: each consumer writes its output half into its half of the Q buffer with stmatrix
    after an async-proxy fence, syncs its own warpgroup only (a CTA-wide barrier in one
    warpgroup's branch would hang) and stores whole rows 16 bytes a thread; no 4-byte output
    stores are left. With smem_store=False the output goes out 4 bytes a thread from the
    fragment, as before 0154; the shared memory is the same."""
    src, smem, _ = _ws64_fwd_sm90a(sm90, heads)
    frag_src, frag_smem, _ = _ws64_fwd_sm90a(sm90, heads, smem_store=False)
    assert smem == frag_smem
    wg0, wg1, _ = _split_ws64_fwd(src)
    for wg, half, bar in ((wg0, "Q_l", "3"), (wg1, "Q_r", "4")):
        tail = wg[wg.rindex("fence_proxy_async"):]
        assert "ptx_stmatrix" in tail and f"(bfloat16_t*){half})" in tail, tail[:400]
        assert "__syncthreads" not in tail and f"__sync_thread_partial({bar}, 128)" in tail
        assert re.search(r"\*\(uint4\*\)\(Output \+", tail), tail[-600:]
    assert not re.search(r"\*\(uint1\*\)\(Output \+", src)
    assert re.search(r"\*\(uint1\*\)\(Output \+", frag_src)


@needs_tilelang
@needs_nvcc
@needs("0112")
@pytest.mark.parametrize("heads", [32, 64])
def test_fwd_native_ws64_compiles_for_sm90a(sm90, heads):
    """0112: 384 threads, two consumer warpgroups on 64-row wgmma tiles and a gather warpgroup.
    Each consumer has its own named barrier (3, 4) and the producer none (a shared id hung an
    early 0070 draft); both consumers store their half of the output, WG0 the LSE; the producer
    loads Q with zero-filling cp.async, predicated on the row at 32 heads (run as 64 rows, the
    rows past the heads zero and never stored). setmaxnreg fits (216/216/72)."""
    src, smem, _ = _ws64_fwd_sm90a(sm90, heads)
    assert "__launch_bounds__(384" in src and "int topk_len" in src
    assert len(_scalar_params(src, "main_kernel")) == 1  # 0108: the scale at each call
    _check_setmaxnreg_budget(src)
    wg0, wg1, producer = _split_ws64_fwd(src)
    assert set(re.findall(r"__sync_thread_partial\((\d+), 128\)", wg0)) == {"3"}
    assert set(re.findall(r"__sync_thread_partial\((\d+), 128\)", wg1)) == {"4"}
    assert "__sync_thread_partial" not in producer and "__syncthreads" not in producer
    assert "Output + " in wg0 and "Output + " in wg1 and "Output" not in producer
    assert "Lse[" in wg0 and "Lse[" not in wg1
    assert "wgmma" in wg0 and "wgmma" in wg1 and "mma_sync" not in src
    q_loads = [line for line in producer.splitlines() if "(&(Q[" in line]
    assert q_loads and all("cp_async_gs_conditional<16>" in line for line in q_loads)
    assert all(("min(" in line) == (heads == 32) for line in q_loads)
    assert "_tail" not in src and "(int64_t)576" not in src
    assert _only_smem(smem) <= SM90_MAX_DYN_SMEM


@needs_tilelang
@needs_nvcc
@needs("0163")
@pytest.mark.parametrize("heads", [32, 64])
def test_fwd_native_ws64_dynamic_compiles_for_sm90a(sm90, heads):
    """0163: the persistent forward's CTAs take their queries after the first from a counter.
    Only the producer's thread 0 adds to it, once a query, after the consumers have freed Q and
    before the producer loads the next Q; it hands the query over on a one-arrival barrier that
    every warpgroup waits on, and every warpgroup leaves its loop at the first query past the
    last. The same registers' budget and shared memory (plus the two handed-over ints) as the
    fixed shares."""
    src, smem, _ = _ws64_fwd_sm90a(sm90, heads, ctas=132, dynamic=True)
    _, fixed_smem, _ = _ws64_fwd_sm90a(sm90, heads, ctas=132)
    _check_setmaxnreg_budget(src)
    assert "bar_qn[0].init(1);" in src
    wg0, wg1, producer = _split_ws64_fwd(src)
    assert src.count("atomicAdd(") == 1 and "atomicAdd(" in producer
    free, add = producer.index("bar_q_free[0].wait("), producer.index("atomicAdd(")
    assert free < add < producer.index("bar_qn[0].arrive()") < producer.index("(&(Q[")
    for wg in (wg0, wg1, producer):
        assert "break;" in wg and "bar_qn[0].wait(" in wg
        assert wg.index("bar_qn[0].wait(") < wg.index("break;")
    assert "bar_qn[0].arrive()" not in wg0 + wg1
    # the producer's own named barrier (TileLang's around the handed-over int), none of theirs
    assert set(re.findall(r"__sync_thread_partial\((\d+), 128\)", wg0)) == {"3"}
    assert set(re.findall(r"__sync_thread_partial\((\d+), 128\)", wg1)) == {"4"}
    assert set(re.findall(r"__sync_thread_partial\((\d+), 128\)", producer)) <= {"5"}
    assert 0 <= _only_smem(smem) - _only_smem(fixed_smem) <= 16
    assert _only_smem(smem) <= SM90_MAX_DYN_SMEM


@needs_tilelang
@needs_nvcc
@needs("0166")
@pytest.mark.parametrize("heads", [32, 64])
def test_fwd_native_ws64_counter_reset_compiles_for_sm90a(sm90, heads):
    """0166: with the route's options the kernel differs from 0163's only in the producer's
    thread 0: it keeps the add's value and, where that is the call's last (nq - 1), stores 0 to
    the counter, after the add and before handing the query over. The same registers' budget
    and shared memory."""
    route = dict(fwd_ws64_route_kwargs(), ctas=132, dynamic=True, counter_reset=True)
    src, smem, _ = _ws64_fwd_sm90a(sm90, heads, **route)
    _, smem_0163, _ = _ws64_fwd_sm90a(sm90, heads, **dict(route, counter_reset=False))
    _check_setmaxnreg_budget(src)
    wg0, wg1, producer = _split_ws64_fwd(src)
    assert src.count("atomicAdd(") == 1 and "atomicAdd(" in producer
    add = producer.index("atomicAdd(")
    last = r"if \(took\[0\] == \(\(batch \* seq_len\) - 1\)\) \{\s*Next\[0\] = 0;"
    reset = re.search(last, producer)
    assert reset and add < reset.start() < producer.index("bar_qn[0].arrive()", add)
    assert src.count("Next[0] = 0;") == 1
    assert _only_smem(smem) == _only_smem(smem_0163)
    assert " 0 bytes spill stores, 0 bytes spill loads" in _ptxas_report(src)


@needs_tilelang
@needs("0166")
def test_fwd_native_ws64_counter_reset_needs_two_ctas():
    """0166: with one CTA the loop's nq turns leave no room for its add past the last query, and
    the counter would be left at nq - 1 (the next call would skip queries): the builder refuses
    it, and counter_reset without 0163's counter."""
    args = (64, D_V, _round_up(2051, 2 * BLOCK_I), None)
    kw = dict(block_I=BLOCK_I, runtime_scale=True, dynamic=True, counter_reset=True)
    with pytest.raises(AssertionError, match="two CTAs or more"):
        fwd_mod.sparse_mla_fwd_nope_ws64.compile(*args, ctas=1, **kw)
    with pytest.raises(AssertionError, match="two CTAs or more"):
        fwd_mod.sparse_mla_fwd_nope_ws64.compile(*args, ctas=132, **dict(kw, dynamic=False))


@needs_tilelang
@needs_nvcc
@needs("0160")
@pytest.mark.parametrize("smem_store", [True, False])
@pytest.mark.parametrize("heads", [32, 64])
def test_fwd_native_ws64_persistent_compiles_for_sm90a(sm90, heads, smem_store):
    """0160: with ctas, ctas CTAs each loop over their queries in all three warpgroups. Each
    consumer arrives once a query on the 256-arrival Q handover: with 0154's store (the output
    staged in the Q buffer) after its last read of the output back from it, without it in its
    last block pair, after the score GEMMs (waited). The producer waits on it before loading the
    next Q and adds no CTA-wide sync; the warpgroups keep their own named barriers, the same
    shared memory as a CTA a query, and the barriers' phases count pairs over the queries."""
    store = {} if smem_store else {"smem_store": False}
    src, smem, _ = _ws64_fwd_sm90a(sm90, heads, ctas=132, **store)
    one, one_smem, _ = _ws64_fwd_sm90a(sm90, heads, **store)
    assert "bar_q_free[0].init(256);" in src
    _check_setmaxnreg_budget(src)
    wg0, wg1, producer = _split_ws64_fwd(src)
    for wg in (wg0, wg1, producer):
        assert re.search(r"for \(int q_it\w* = 0; q_it\w* < .*/ 132\)", wg)
    for wg in (wg0, wg1):
        assert wg.count("bar_q_free") == 1
        arrive = wg.index("bar_q_free[0].arrive()")
        if smem_store:
            stores = [m.start() for m in re.finditer(r"\*\(uint4\*\)\(Output \+", wg)]
            assert stores and stores[-1] < arrive
            assert not re.findall(_Q_HANDOVER_IN_LAST_PAIR, wg)
        else:
            assert len(re.findall(_Q_HANDOVER_IN_LAST_PAIR, wg)) == 1
            assert wg.rindex("warpgroup_wait<0>()", 0, arrive) > wg.rindex("Q_", 0, arrive)
    assert set(re.findall(r"__sync_thread_partial\((\d+), 128\)", wg0)) == {"3"}
    assert set(re.findall(r"__sync_thread_partial\((\d+), 128\)", wg1)) == {"4"}
    assert "__sync_thread_partial" not in producer and "__syncthreads" not in producer
    wait = producer.index("bar_q_free[0].wait(((q_it")
    assert wait < producer.index("(&(Q[") < producer.index("mbarrier_cp_async_arrive_noinc(bar_q")
    assert "* 17) + p_i" in wg0 and "* 17) + p_i" in producer  # 17 pairs a query
    assert _only_smem(smem) == _only_smem(one_smem)


@needs_tilelang
@needs_nvcc
@needs("0164")
@pytest.mark.parametrize("heads", [32, 64])
def test_fwd_native_ws64_stage_out_compiles_for_sm90a(sm90, heads):
    """0164: the persistent form with 0154's store stages each consumer's output in a buffer
    of its own, 64 columns at a time (four chunks, a warpgroup sync before each chunk's writes
    and before its reads), never in the Q buffer, so Q is handed over in the last block pair
    again; 16-byte stores; the whole fits the SM's 227 KiB (no spills, no serialized wgmma:
    test_ws64_kernels_keep_wgmma_asynchronous)."""
    src, smem, _ = _ws64_fwd_sm90a(sm90, heads, ctas=132, stage_out=True)
    _, q_smem, _ = _ws64_fwd_sm90a(sm90, heads, ctas=132)
    assert _only_smem(smem) == _only_smem(q_smem) + 2 * 64 * 64 * 2
    assert _only_smem(smem) <= SM90_MAX_DYN_SMEM
    wg0, wg1, _ = _split_ws64_fwd(src)
    for wg, bar in ((wg0, "3"), (wg1, "4")):
        assert len(re.findall(_Q_HANDOVER_IN_LAST_PAIR, wg)) == 1 and wg.count("bar_q_free") == 1
        tail = wg[wg.rindex("for (int c"):]
        syncs = re.findall(rf"__sync_thread_partial\({bar}, 128\)", tail)
        assert len(syncs) == 2 and "__syncthreads" not in tail, tail[:600]
        assert re.search(r"\*\(uint4\*\)\(Output \+", tail) and "Q_" not in tail
    assert not re.search(r"\*\(uint1\*\)\(Output \+", src)


@needs_tilelang
@needs_nvcc
@needs("0113")
@pytest.mark.parametrize("heads", [pytest.param(8, marks=needs("0153")),
                                   pytest.param(16, marks=needs("0134")), 32, 64])
def test_bwd_native_ws64_compiles_for_sm90a(sm90, heads):
    """0113: 256 threads, a CTA a query. WG0 gathers (zero-filling cp.async), computes P and dS
    and stores the left half of dQ; WG1 the right half and dKV, added 4 floats at a time from
    registers into the line-ordered accumulator with 0080's index test, no 2-float adds. At 32
    heads (0134: and 16; 0153: and 8) the tiles are 64 rows: the rows past the heads load zeros
    (predicated), take an infinite LSE (P = 0) and are not stored."""
    topk = _round_up(2051, BWD_BLOCK)
    src, smem, _ = _sm90a(sm90, f"bwd_ws64 h{heads} topk {topk}", bwd_mod.sparse_mla_bwd_ws64,
                          heads, D_V, topk, runtime_scale=True)
    assert "__launch_bounds__(256" in src and "int topk_len" in src
    assert len(_scalar_params(src, "sparse_mla_bwd_kernel_kernel")) == 1  # 0108's scale
    assert src.count("AtomicAddx4(") > 0 and "AtomicAddx2(" not in src
    assert src.count("< ((uint)seq_len_kv)") >= 3
    assert src.count("cp_async_gs_conditional<16>") >= 1
    stores = re.findall(r"\*\(uint1\*\)\(dQ \+", src)
    assert len(stores) == 2  # one a warpgroup, each its half
    padded = "CUDART_INF_F" in src and "min(" in src
    assert padded == (heads < 64)
    assert "_tail" not in src and "576" not in src and "mma_sync" not in src
    assert _only_smem(smem) <= SM90_MAX_DYN_SMEM
    assert "wait_wgmma" not in src  # one dKV accumulator stage: every GEMM waited for
    # the warpgroups use these buffers at the same time: the backward's aggressive shared-memory
    # merge (lifetime-based reuse, blind to warp specialization) must not have overlaid any two
    sizes = dict(Q_shared=64 * 512 * 2, dO_shared=64 * 512 * 2, KV_shared=64 * 512 * 2,
                 P_shared=64 * 64 * 2, dS_shared=64 * 64 * 2)
    regions = _smem_regions(src)
    assert set(regions) == set(sizes)
    for name, (start, end) in regions.items():
        assert (end or _only_smem(smem)) - start >= sizes[name], regions


@needs_tilelang
@needs_nvcc
@needs("0114")
def test_bwd_native_ws64_two_dkv_stages(sm90):
    """0114: WG1's dKV chunks alternate between two 32-register accumulators issued as async
    wgmma; each wait leaves the newer chunk's two groups in flight (the last waits for all), and
    the finished accumulator is fenced right after its wait, before the adds read it. Same
    shared memory as 0113's kernel, same 4-float adds."""
    topk = _round_up(2051, BWD_BLOCK)
    src, smem, _ = _sm90a(sm90, f"bwd_ws64 h64 topk {topk} stages 2", bwd_mod.sparse_mla_bwd_ws64,
                          64, D_V, topk, runtime_scale=True, dkv_stages=2)
    # the same build as test_bwd_native_ws64_compiles_for_sm90a's at 64 heads (one compile)
    one, one_smem, _ = _sm90a(sm90, f"bwd_ws64 h64 topk {topk}", bwd_mod.sparse_mla_bwd_ws64,
                              64, D_V, topk, runtime_scale=True)
    assert "float acc_dkv[32];" in src and "float acc_dkv_b[32];" in src
    assert "float acc_dkv_b[32];" not in one
    # the loop over chunk pairs is unrolled by nvcc, not in the source: one wait<2> a pair, one
    # more in the branch that issues the next pair, the wait<0> in the other
    waits = list(re.finditer(r"wait_wgmma<(\d)>\(\);", src))
    assert [m.group(1) for m in waits] == ["2", "2", "0"]
    for m in waits:  # between a wait and the next read of a chunk (its reorder): a fence on
        # the accumulator that read takes
        read = re.compile(r"= \*\(float2\*\)\((acc_dkv(_b)?) \+").search(src, m.end())
        fence = f"warpgroup_fence_operand(reinterpret_cast<float*>({read.group(1)} + 0), 32)"
        assert fence in src[m.end():read.start()], read.group(1)
    # every wgmma of the chunks is waited for before WG1 hands P and dS back to WG0
    release = src.index("bar_ps_free[0].arrive()", waits[-1].end())
    assert "wgmma" not in src[waits[-1].end():release].replace("wait_wgmma", "")
    assert src.count("AtomicAddx4(") > 0 and "AtomicAddx2(" not in src
    assert _only_smem(smem) == _only_smem(one_smem)


@needs_tilelang
@needs_nvcc
@needs("0115")
def test_bwd_native_ws64_wg0_dkv_chunks(sm90):
    """0115: WG0 computes and adds two of each key block's dKV chunks from its own accumulator:
    the previous block's between issuing a gather (its cp.async arrive on bar_kv) and waiting
    for it, the last block's after the loop, before its dQ store. WG1 adds the other six in
    0114's pairs. Same shared memory as 0114's kernel."""
    topk = _round_up(2051, BWD_BLOCK)
    src, smem, _ = _sm90a(sm90, f"bwd_ws64 h64 topk {topk} stages 2 wg0 2",
                          bwd_mod.sparse_mla_bwd_ws64, 64, D_V, topk, runtime_scale=True,
                          dkv_stages=2, wg0_dkv_chunks=2)
    # the same build as test_bwd_native_ws64_two_dkv_stages's (one compile)
    two, two_smem, _ = _sm90a(sm90, f"bwd_ws64 h64 topk {topk} stages 2",
                              bwd_mod.sparse_mla_bwd_ws64, 64, D_V, topk, runtime_scale=True,
                              dkv_stages=2)
    split = src.index("bar_ps[0].wait(")  # WG1's first statement of its loop
    wg0, wg1 = src[:split], src[split:]
    assert "float acc_dkv_0[32];" in src and "acc_dkv_0" not in wg1
    adds = "AtomicAddx4("
    assert wg0.count(adds) == 2 and wg1.count(adds) == two.count(adds)
    issued, first = wg0.index("mbarrier_cp_async_arrive_noinc(bar_kv[0])"), wg0.index(adds)
    assert issued < first < wg0.index("bar_kv[0].wait(")
    assert "if (0 < i_i) {" in wg0[issued:first]  # the previous block's: none before the first
    last = wg0.index(adds, first + 1)
    assert wg0.index("bar_ps[0].arrive()") < last < wg0.index("*(uint1*)(dQ + ")
    assert re.findall(r"wait_wgmma<(\d)>", src) == ["2", "2", "0"]  # WG1's pairs, as 0114's
    assert _only_smem(smem) == _only_smem(two_smem)


@needs_tilelang
@needs("0115")
@pytest.mark.parametrize("stages, chunks", [(1, 8), (2, 7)])
def test_bwd_native_ws64_wg0_dkv_chunks_leave_wg1_its_stages(sm90, stages, chunks):
    """0115: WG1 keeps at least one dKV chunk a stage. With two stages it takes its chunks in
    pairs after an odd first one; seven of eight chunks for WG0 would leave it none to pair, a
    kernel issuing a ninth chunk's GEMM and never waiting for it: declined at build time."""
    topk = _round_up(2051, BWD_BLOCK)
    with pytest.raises(AssertionError):
        _sm90a(sm90, f"bwd_ws64 h64 topk {topk} stages {stages} wg0 {chunks}",
               bwd_mod.sparse_mla_bwd_ws64, 64, D_V, topk, runtime_scale=True,
               dkv_stages=stages, wg0_dkv_chunks=chunks)


# the CUDA statements that order the warpgroups' work (named and CTA barriers, mbarrier waits
# and arrives, wgmma waits); fences are left out (the hand-issued copies add two harmless ones)
_ORDERING = re.compile(
    r"__syncthreads\(\)|__sync_thread_partial\([^;]*;|\w+\[0\]\.wait\([^;]*;|\w+\[0\]\.arrive\(\)"
    r"|mbarrier_cp_async_arrive_noinc\(\w+\[0\]\)|wait_wgmma<\d>\(\)"
)


# 0141: the route's WG0 takes one dKV chunk a key block (0115's split took two)
ROUTE_WG0 = 1 if has("0141") else 2


def _route_bwd_ws64(sm90, tag="", **extra):
    """The CUDA of 0113's backward at 64 heads and top-k 2051 built as the route builds it (two
    dKV stages, WG0's chunks, 0120's levers, 0142's query phase for 132 SMs or else 0121's timer
    phase where the tree has them), with `extra` builder options in their place; tag names them,
    so that tests asking for the same build share one compile."""
    topk = _round_up(2051, BWD_BLOCK)
    queries = 132 if has("0142") else 0
    phase_ns = 8000 if has("0121") and not queries else 0
    options = dict(runtime_scale=True, dkv_stages=2, wg0_dkv_chunks=ROUTE_WG0, hoist_indices=True,
                   evict_first_loads=True, **({"block_phase_ns": phase_ns} if phase_ns else {}),
                   **({"block_phase_queries": queries} if queries else {}))
    src, _, _ = _sm90a(
        sm90, f"bwd_ws64 h64 topk {topk} stages 2 wg0 {ROUTE_WG0} hi ef ph{phase_ns} pq{queries}{tag}",
        bwd_mod.sparse_mla_bwd_ws64, 64, D_V, topk, **dict(options, **extra))
    return src


@needs_tilelang
@needs_nvcc
@needs("0151")
@pytest.mark.parametrize("form", ["int64", "fp32", "int32x2"])
def test_bwd_native_ws64_deterministic_adds(sm90, form):
    """0150/0151: the deterministic backward's second pass as the route builds it at 64 heads
    (0133's pairs off): "int64" adds each value as __float2ll_rn(v * FixedScale[0]) with a 64-bit
    integer atomic; "fp32" rounds each value times its key's scale (rintf) and adds the
    integer-valued floats 4 at a time in line order; "int32x2" packs two rounded columns into
    one 64-bit atomic (glm_add_lanes). No form keeps another's add."""
    arg = {"dkv_fixed": True} if form == "int64" else {"dkv_key_fixed": form}
    src = _route_bwd_ws64(sm90, f" det {form}", **arg)
    assert ("__float2ll_rn" in src) == (form == "int64")
    assert ("rintf" in src) == (form == "fp32")
    assert ("AtomicAddx4(" in src) == (form == "fp32")
    lane_adds = src.count("glm_add_lanes(") - src.count("void glm_add_lanes(")  # (the prelude's)
    assert (lane_adds > 0) == (form == "int32x2")
    assert "AtomicAddx2(" not in src and "glm_globaltimer" not in src


@needs_tilelang
@needs_nvcc
@needs("0120")
def test_bwd_native_ws64_levers_keep_the_ordering(sm90):
    """0120: with hoisted indices and evict_first copies issued by hand (TileLang plans no sync
    for them: it does not see their shared writes), 0115's kernel keeps its sequence of barriers,
    waits and arrives, and the copies replace TileLang's, one for one. 0121's timer phase adds
    one CTA barrier after thread 0 writes the phase slot (read once, never written again);
    0142's query phase (the route's since 0142) adds none."""
    topk = _round_up(2051, BWD_BLOCK)
    # (without 0141: the same build as test_bwd_native_ws64_wg0_dkv_chunks's, one compile)
    off, _, _ = _sm90a(sm90, f"bwd_ws64 h64 topk {topk} stages 2 wg0 {ROUTE_WG0}",
                       bwd_mod.sparse_mla_bwd_ws64, 64, D_V, topk, runtime_scale=True,
                       dkv_stages=2, wg0_dkv_chunks=ROUTE_WG0)
    on = _route_bwd_ws64(sm90)
    seq_on, seq_off = _ORDERING.findall(on), _ORDERING.findall(off)
    if has("0121"):
        # the timer's phase: the route's build before 0142, an A/B build since
        timer = on if not has("0142") else _route_bwd_ws64(
            sm90, " timer", block_phase_queries=0, block_phase_ns=8000)
        seq_t = _ORDERING.findall(timer)
        assert seq_t[:2] == ["__syncthreads()", "__syncthreads()"] and seq_t[1:] == seq_off
        phase = re.findall(r"phase\[0\] = [^;]*glm_globaltimer\(\) / \(uint64_t\)8000\)", timer)
        assert len(phase) == 1 and len(re.findall(r"phase\[0\] =", timer)) == 1
    if has("0142") or not has("0121"):
        assert seq_on == seq_off and "glm_globaltimer" not in on
    assert "L2::evict_first" in on and "L2::evict_first" not in off
    copies = len(re.findall(r"cp_async_gs(?:_conditional)?<16>", off))
    assert on.count("glm_cp_async16_evict_first(") == copies + 1  # + the helper's definition
    assert "cp_async_gs" not in on
    assert on.count("AtomicAddx4(") == off.count("AtomicAddx4(")


@needs("0133")
def test_row_pair_columns_land_where_line_order_puts_them():
    """0133's register order (_pair_column) and glm_add_row_pair's addressing against 0106's line
    order (_line_column), column by column of a 64-column chunk: the lane whose MMA column pairs
    are 2q, 2q + 1 (q = lane % 4) holds, at pair positions 32 gp + 8 q .. + 7, its 4 columns of
    group 2 gp then its 4 of group 2 gp + 1, each in line order; the helper adds v[0..3] at line
    columns col0 .. col0 + 3 and v[4..7] at col0 + 16 .. col0 + 19, col0 = 32 gp + 4 q (the
    address add_chunk_pairs passes); every column once."""
    pair, line = bwd_mod._pair_column, bwd_mod._line_column
    assert sorted(pair(d) for d in range(64)) == list(range(64))
    for gp in range(2):
        for q in range(4):
            lane_cols = [d for d in range(64) if d // 32 == gp and (d % 8) // 2 == q]
            by_position = sorted(lane_cols, key=pair)
            first = 32 * gp + 8 * q
            assert [pair(d) for d in by_position] == list(range(first, first + 8))
            col0 = 32 * gp + 4 * q
            assert [line(d) for d in by_position] == (
                [col0 + k for k in range(4)] + [col0 + 16 + k for k in range(4)])
            # add_chunk_pairs's column for d_i = 32 gp + 8 q: d_i // 32 * 32 + d_i % 32 // 8 * 4
            d_i = 32 * gp + 8 * q
            assert d_i // 32 * 32 + d_i % 32 // 8 * 4 == col0


@needs_tilelang
@needs_nvcc
@needs("0133")
def test_bwd_native_ws64_row_pairs_lane_layout(sm90):
    """0133: every dKV add of the route's 64-row kernel goes through glm_add_row_pair (no 4-float
    atomics left), once a lane for each 8 adjacent registers, and the `hi` argument (bi_i // 4 % 2
    in the macro: the row's bit 2) is lane bit 4 in TileLang's layout, the lane the helper's
    __shfl_xor_sync(..., 16) reaches. A layout where row r ^ 4 sat elsewhere would pair the wrong
    lanes and corrupt dKV with no error. The barrier sequence is the kernel's without pairs."""
    # (the builds of test_bwd_native_ws64_levers_keep_the_ordering and of the evict_last test)
    off = _route_bwd_ws64(sm90)
    on = _route_bwd_ws64(sm90, " pairs", row_pairs=True)
    assert off.count("AtomicAddx4(") > 0 and "glm_add_row_pair" not in off
    assert "AtomicAddx4(" not in on
    calls = re.findall(r"glm_add_row_pair\(\(&\(dKV\[[^;]*\), 512, (rows(?:_0)?)\[\((i_\d+) >> 4\)\], "
                       r"([^;]*?), \(&\((acc_lines(?:_0)?)\[(i_\d+)\]\)\)\);", on)
    assert len(calls) == on.count("glm_add_row_pair(") - 1 >= 2  # - the helper's definition
    for rows, i_row, hi, _, i_reg in calls:
        assert hi == "((((int)threadIdx.x) & 31) >> 4)", hi
        assert i_row == i_reg and f"if (({i_reg} % 8) == 0)" in on
    assert _ORDERING.findall(on) == _ORDERING.findall(off)


@needs_tilelang
@needs_nvcc
@needs_draft("wip/0137", "bwd_dkv_evict_last_mib")
def test_bwd_native_ws64_dkv_evict_last_changes_only_the_add(sm90):
    """wip/0137: with dkv_evict_last_mib the row pairs' 4-float add carries an L2 cache policy
    (createpolicy.range: evict_last for the first m MiB from the batch's accumulator row 0,
    evict_first past them) and nothing else of the kernel changes: the kernels' code after the
    prelude is the pairs build's, character for character; without the option the adds take no
    policy. A size past createpolicy's 32-bit byte counts, or the option without the pairs, is
    refused."""
    # (off: test_bwd_native_ws64_row_pairs_lane_layout's "pairs" build, one compile)
    off = _route_bwd_ws64(sm90, " pairs", row_pairs=True)
    on = _route_bwd_ws64(sm90, " pairs el32", row_pairs=True, dkv_evict_last_mib=32)
    policy = "createpolicy.range.global.L2::evict_last.L2::evict_first.b64"
    assert on.count(policy) == 1 and '"r"(32u << 20)' in on and "L2::evict_last" not in off
    assert on.count("red.global.add.L2::cache_hint.v4.f32") == 1
    assert "red.global.add.v4.f32" not in on and off.count("red.global.add.v4.f32") == 1
    kernel = lambda src: src[src.index("extern \"C\" __global__"):]
    assert kernel(on) == kernel(off)
    topk = _round_up(2051, BWD_BLOCK)
    for bad in (dict(row_pairs=True, dkv_evict_last_mib=4096),
                dict(row_pairs=False, dkv_evict_last_mib=32)):
        with pytest.raises(AssertionError):
            bwd_mod.sparse_mla_bwd_ws64(64, D_V, topk, runtime_scale=True, dkv_stages=2,
                                        wg0_dkv_chunks=2, hoist_indices=True, **bad)


_DQ_FRAGMENT_STORE = re.compile(r"\*\(uint1\*\)\(dQ \+")
_DQ_STAGED_STORE = re.compile(r"glm_st_dq16\(\(&\(dQ\[")


def _dq_tails(src):
    """wip/0167's staged dQ stores: each warpgroup's tail from its last async-proxy fence to its
    glm_st_dq16 call, in source order (WG0's, WG1's)."""
    calls = [m.start() for m in _DQ_STAGED_STORE.finditer(src)]
    return [(src.rindex("fence_proxy_async", 0, at), at) for at in calls]


def _ordering_without_dq_tails(src):
    for start, end in reversed(_dq_tails(src)):
        src = src[:start] + src[end:]
    return _ORDERING.findall(src)


@needs_tilelang
@needs_nvcc
@needs_draft("wip/0167", "bwd_ws64_dq_staged")
def test_bwd_native_ws64_dq_store(sm90):
    """wip/0167: with dq_staged each warpgroup's tail fences the async proxy, writes its half of
    dQ into its half of the KV buffer's columns, syncs its own warpgroup only (a 128-thread named
    barrier: a CTA-wide one in one warpgroup's branch would hang) and stores 16 bytes a thread
    with glm_st_dq16, 16 rows a thread; no 4-byte dQ store is left. With dq_evict_first the
    fragment's stores go through glm_st_dq2, whose st.global carries an L2 evict_first policy
    from createpolicy; with both, the staged stores carry it. The barrier sequence outside the
    tails is the route's; no spills."""
    off = _route_bwd_ws64(sm90)
    st = _route_bwd_ws64(sm90, " dqst", dq_staged=True)
    ef = _route_bwd_ws64(sm90, " dqef", dq_evict_first=True)
    both = _route_bwd_ws64(sm90, " dqstef", dq_staged=True, dq_evict_first=True)
    assert len(_DQ_FRAGMENT_STORE.findall(off)) == 2 and "glm_st_dq" not in off
    for src in (st, both):
        assert not _DQ_FRAGMENT_STORE.search(src) and "glm_st_dq2((" not in src
        tails = _dq_tails(src)
        assert len(tails) == 2
        for (start, end), bar in zip(tails, ("3", "4")):
            tail = src[start:end]
            assert "__syncthreads" not in tail and f"__sync_thread_partial({bar}, 128)" in tail
            assert "KV_shared) +" in tail, tail[:600]  # the bf16 half written into the buffer
            assert re.search(r"for \(int r_\d+ = 0; r_\d+ < 16; \+\+r_\d+\) \{\s*$", tail)
    assert not _DQ_FRAGMENT_STORE.search(ef) and ef.count("glm_st_dq2((&(dQ[") == 2
    assert not _DQ_STAGED_STORE.search(ef)
    hint, policy = "st.global.L2::cache_hint", "createpolicy.fractional.L2::evict_first.b64"
    assert f"{hint}.b32" in ef and f"{hint}.v4.b32" in both and hint not in st
    # (0120's evict_first loads make the same policy in their own helper)
    assert ef.count(policy) == both.count(policy) == st.count(policy) + 1 == off.count(policy) + 1
    for src in (st, ef, both):
        assert _ordering_without_dq_tails(src) == _ORDERING.findall(off)
        _assert_no_spills(_ptxas_report(src))


def _lane_rows_model(levels):
    """glm_add_lane_rows (wip/0168) for one warp's row half, line by line in Python: lane L holds
    row L // 4's packed columns L % 4 + 4j (j = 0 .. 7); returns the warp's adds in issue order,
    each {lane: (row, column, value)}, value = the (row, column) it came from."""
    lanes = range(32)
    row = {L: L // 4 for L in lanes}
    w = {L: [(row[L], L % 4 + 4 * j) for j in range(8)] for L in lanes}
    hi, hi2, q = ({L: (L >> 4) & 1 for L in lanes}, {L: (L >> 3) & 1 for L in lanes},
                  {L: L % 4 for L in lanes})
    shfl = lambda x, m: {L: x[L ^ m] for L in lanes}
    other = shfl(row, 16)
    ra = {L: other[L] if hi[L] else row[L] for L in lanes}
    rb = {L: row[L] if hi[L] else other[L] for L in lanes}
    a, b = {L: [] for L in lanes}, {L: [] for L in lanes}
    for m in range(4):
        got = shfl({L: w[L][2 * m] if hi[L] else w[L][2 * m + 1] for L in lanes}, 16)
        for L in lanes:
            a[L].append(got[L] if hi[L] else w[L][2 * m])
            b[L].append(w[L][2 * m + 1] if hi[L] else got[L])
    adds = []
    if levels == 1:
        for m in range(4):
            adds.append({L: (ra[L], q[L] + 8 * m + 4 * hi[L], a[L][m]) for L in lanes})
            adds.append({L: (rb[L], q[L] + 8 * m + 4 * hi[L], b[L][m]) for L in lanes})
        return adds
    ra2, rb2 = shfl(ra, 8), shfl(rb, 8)
    for n in range(2):
        ga = shfl({L: a[L][2 * n] if hi2[L] else a[L][2 * n + 1] for L in lanes}, 8)
        gb = shfl({L: b[L][2 * n] if hi2[L] else b[L][2 * n + 1] for L in lanes}, 8)
        col = {L: q[L] + 16 * n + 8 * hi2[L] + 4 * hi[L] for L in lanes}
        adds.append({L: (ra2[L] if hi2[L] else ra[L], col[L], ga[L] if hi2[L] else a[L][2 * n])
                     for L in lanes})
        adds.append({L: (ra[L] if hi2[L] else ra2[L], col[L], a[L][2 * n + 1] if hi2[L] else ga[L])
                     for L in lanes})
        adds.append({L: (rb2[L] if hi2[L] else rb[L], col[L], gb[L] if hi2[L] else b[L][2 * n])
                     for L in lanes})
        adds.append({L: (rb[L] if hi2[L] else rb2[L], col[L], b[L][2 * n + 1] if hi2[L] else gb[L])
                     for L in lanes})
    return adds


@needs_draft("wip/0168", "bwd_deterministic_lane_rows")
@pytest.mark.parametrize("levels,rows", [(1, 4), (2, 2)])
def test_int32x2_lane_rows_exchange(levels, rows):
    """wip/0168's exchange (modelled): each of the warp's 8 rows x 32 packed columns is added
    once, with its own value, and each add covers `rows` rows, each in one run of 32 / rows
    adjacent columns aligned to it (4 x 64 B or 2 x 128 B of the int64 accumulator). And
    _lane_column keeps each lane's columns (8j + 2q + e) as its 16 adjacent floats 16q + 2j + e."""
    seen = set()
    for add in _lane_rows_model(levels):
        for r, c, v in add.values():
            assert v == (r, c) and (r, c) not in seen
            seen.add((r, c))
        by_row = {}
        for r, c, _ in add.values():
            by_row.setdefault(r, []).append(c)
        assert len(by_row) == rows
        for cols in by_row.values():
            width = 32 // rows
            assert sorted(cols) == list(range(min(cols), min(cols) + width)) and min(cols) % width == 0
    assert len(seen) == 8 * 32
    lane = bwd_mod._lane_column
    assert sorted(lane(d) for d in range(64)) == list(range(64))
    for d in range(64):
        j, q, e = d // 8, (d % 8) // 2, d % 2
        assert lane(d) == 16 * q + 2 * j + e


@needs_tilelang
@needs_nvcc
@needs_draft("wip/0168", "bwd_deterministic_lane_rows")
def test_bwd_native_ws64_int32x2_lane_rows(sm90):
    """wip/0168: the int32x2 second pass as the route builds it at 64 heads with lane_rows 4 and 2
    adds every chunk through glm_add_lane_rows<1> / <2> (the row exchange), twice a thread (its
    two row halves), from the _lane_column copy; no glm_add_lanes call is left; the barrier
    sequence is the 8-row build's; no spills. lane_rows is the int32x2 form's only, without the
    row pairs (whose adds are of floats)."""
    det = dict(dkv_key_fixed="int32x2")
    eight = _route_bwd_ws64(sm90, " det int32x2", **det)
    assert "glm_add_lane_rows" not in eight
    for rows, level in ((4, 1), (2, 2)):
        src = _route_bwd_ws64(sm90, f" det int32x2 lanes{rows}", lane_rows=rows, **det)
        calls = re.findall(rf"glm_add_lane_rows<{level}>\(\(&\(dKV\[[^;]*, 256, (rows(?:_0)?)"
                           r"\[\((i_\d+) >> 4\)\], (ks(?:_0)?)\[\(\2 >> 4\)\], "
                           r"\(\(\(\(int\)threadIdx.x\) & 31\) >> 4\), "
                           r"\(\(\(\(int\)threadIdx.x\) & 15\) >> 3\), \(&\(acc_lines(?:_0)?\[\2\]\)\)\);",
                           src)
        assert len(calls) >= 2 and len(calls) == src.count(f"glm_add_lane_rows<{level}>((")
        for _, i_reg, _ in calls:
            assert f"if (({i_reg} % 16) == 0)" in src
        assert "glm_add_lanes(" not in src.split("glm_add_lane_rows(void")[-1]
        assert _ORDERING.findall(src) == _ORDERING.findall(eight)
        _assert_no_spills(_ptxas_report(src))
    topk = _round_up(2051, BWD_BLOCK)
    for bad in (dict(lane_rows=4), dict(lane_rows=3, dkv_key_fixed="int32x2"),
                dict(lane_rows=2, dkv_key_fixed="fp32"),
                dict(lane_rows=2, dkv_key_fixed="int32x2", row_pairs=True)):
        with pytest.raises(AssertionError):
            bwd_mod.sparse_mla_bwd_ws64(64, D_V, topk, runtime_scale=True, hoist_indices=True, **bad)


@needs_tilelang
@needs_nvcc
@needs("0142")
def test_bwd_native_ws64_query_phase_replaces_the_timer(sm90):
    """0142: with block_phase_queries=q a CTA's walk starts at key block (query * blocks / q)
    mod blocks, computed from blockIdx.x where a block is indexed: no timer read, no phase slot
    (the ordering: test_bwd_native_ws64_levers_keep_the_ordering). At top-k 2051 (33 blocks) and
    q = 132 that is (blockIdx.x % 132) / 4. Both phases at once, or a negative q, are refused."""
    on = _route_bwd_ws64(sm90)  # (that test's build: one compile)
    assert "glm_globaltimer" not in on and "phase[0]" not in on
    walk = re.findall(r"\(\(\(\(int\)blockIdx\.x\) % 132\) / 4\) \+ i_i\w*\) % 33\)", on)
    assert len(walk) >= 3  # the blocks the loop and the last block after it index
    topk = _round_up(2051, BWD_BLOCK)
    for bad in (dict(block_phase_queries=132, block_phase_ns=8000), dict(block_phase_queries=-1)):
        with pytest.raises(AssertionError):
            bwd_mod.sparse_mla_bwd_ws64(64, D_V, topk, runtime_scale=True, dkv_stages=2,
                                        wg0_dkv_chunks=2, **bad)


@needs_tilelang
@needs_nvcc
@needs("0162")
@pytest.mark.parametrize("heads", [32, 64])
def test_fwd_native_ws64_shared_mask_compiles_for_sm90a(sm90, heads):
    """0162: with shared_mask the consumers read no index from global memory; each clears
    its scores in the first score GEMM, waits on the producer's 16-arrival mask barrier after
    the second GEMM has completed and adds the mask from shared memory before the row maxima.
    The producer's 16 writers (one a row group) arrive after the pair's last gather is issued.
    512 B (2 x 64 fp32) more shared memory than without."""
    src, smem, _ = _ws64_fwd_sm90a(sm90, heads, shared_mask=True)
    _, one_smem, _ = _ws64_fwd_sm90a(sm90, heads)
    assert "bar_mask[0].init(16);" in src
    _check_setmaxnreg_budget(src)
    wg0, wg1, producer = _split_ws64_fwd(src)
    for wg in (wg0, wg1):
        assert "Indices[" not in wg
        wait = wg.index("bar_mask[0].wait(")
        assert wg.rindex("warpgroup_wait<0>()", 0, wait) > wg.rindex("tl::wgmma", 0, wait)
        assert wait < wg.index("mask_shared", wait) < wg.index("tl::AllReduce<tl::MaxOp", wait)
    assert producer.count("bar_mask[0].arrive()") == 1
    assert producer.index("mask_shared") > producer.rindex("mbarrier_cp_async_arrive_noinc")
    assert _only_smem(smem) == _only_smem(one_smem) + 2 * 64 * 4


@needs_tilelang
@needs_nvcc
@needs("0161")
@pytest.mark.parametrize("kernel", ["fwd_ws", "fwd_ws64", "bwd_ws64"])
def test_native_fast_exp2_compiles_for_sm90a(sm90, kernel):
    """0161: with fast_exp2 (the route's default) every exponential of the kernel is the
    prelude's ex2.approx.ftz helper and none is exp2f; without it (the builders' default), none
    is the helper."""
    if kernel == "fwd_ws":
        build = lambda **kw: _sm90a(sm90, f"fwd_ws h16 {kw}", fwd_mod.sparse_mla_fwd_nope_ws, 16,
                                    D_V, _round_up(2051, 3 * BLOCK_I), None, block_I=BLOCK_I,
                                    num_buffers=3, ctas=132, runtime_scale=True, **kw)
    elif kernel == "fwd_ws64":
        build = lambda **kw: _ws64_fwd_sm90a(sm90, 64, **kw)
    else:
        build = lambda **kw: _sm90a(sm90, f"bwd_ws64 h64 {kw}", bwd_mod.sparse_mla_bwd_ws64, 64,
                                    D_V, _round_up(2051, 64), runtime_scale=True, dkv_stages=2,
                                    wg0_dkv_chunks=2, **kw)
    fast, _, _ = build(fast_exp2=True)
    plain, _, _ = build()
    assert "ex2.approx.ftz.f32" in fast and fast.count("glm_exp2_ftz(") > 1  # defined, called
    assert "exp2f(" not in fast
    assert "exp2f(" in plain and "glm_exp2_ftz" not in plain
