"""0151/0152 (issue #21): the host side of the deterministic backward with a fixed-point scale for
each key. Its kernels need a GPU (tests/gpu); the scales that keep every lane's sum in range are
plain torch, checked here on CPU, and the route is checked against its kernels' contract in
PyTorch."""

import pytest
import torch

from native_kernels import _has_option, bwd_mod, has, needs

pytestmark = needs("0151")

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


@needs("0152")
@pytest.mark.parametrize("u", [-20, 0, 17])
def test_fine_key_scales_bring_the_bound_just_under_the_exact_range(u):
    """0152: "fp32" with fine scales: each selected key's scaled bound is 2^24 - 2^20 rounded
    down (never above: every partial sum of integer-valued floats stays exact below 2^24, with
    2^20 left for the rounding of up to 2^20 queries), one to two bits finer than the power-of-two
    scales; the inverse is the scale's to float32 rounding; a key no query selected keeps 1."""
    counts = torch.tensor(
        [[0, 1, 2, 3, 2**20 + 7, 2**40 - 1, 2**40, 2**53 + 1, 2**61 + 12345]], dtype=torch.int64
    )
    scale, inv = bwd_mod._key_scales(counts, torch.tensor([2.0**u]), "fp32", fine=True)
    coarse, _ = bwd_mod._key_scales(counts, torch.tensor([2.0**u]), "fp32")
    assert scale.dtype == inv.dtype == torch.float32 and scale.shape == counts.shape
    scaled = counts.double() * 2.0**-u * scale.double()
    top = 2.0**24 - 2.0**20
    selected = counts > 0
    assert (scaled <= top).all()
    assert (scaled[selected] >= top * (1 - 2.0**-22)).all()
    ratio = scale.double()[selected] / coarse.double()[selected]
    assert ((ratio > 1.8) & (ratio <= 3.75)).all(), ratio  # one to two bits finer
    assert scale[0, 0] == 1 and inv[0, 0] == 1
    assert ((scale.double() * inv.double() - 1).abs() <= 2.0**-23).all()
    with pytest.raises(AssertionError):
        bwd_mod._key_scales(counts, torch.tensor([1.0]), "int32x2", fine=True)


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


def _kernel_terms(q, kv, do, indices, lse, delta, scale):
    """What the ws64 kernel works with, in PyTorch: P and dS rounded to bf16 as it rounds them
    (p_cast, ds_cast) and each (query, selected key) pair's dKV term summed over the heads,
    c = dS^T q + P^T dO, in fp32. Returns P, dS [b, s, h, K], c [b, s, K, W], the gathered rows'
    keys [b, s, K] and their validity."""
    from test_native_routing import LOG2E

    qf, kf, dof = q.float(), kv[:, :, 0].float(), do.float()
    b, sk, w = kf.shape
    idx = indices[:, :, 0].long()
    valid = (idx >= 0) & (idx < sk)
    keys = idx.clamp(0, sk - 1)
    kg = kf[torch.arange(b).view(b, 1, 1), keys]  # [b, s, K, W]
    p = torch.exp2(torch.einsum("bshw,bskw->bshk", qf, kg) * scale * LOG2E - lse.unsqueeze(-1))
    p = p * valid.unsqueeze(2)
    dp = torch.einsum("bshd,bskd->bshk", dof, kg)
    ds = (p * (dp - delta.float().unsqueeze(-1)) * scale).bfloat16().float()
    p = p.bfloat16().float()
    c = torch.einsum("bshk,bshw->bskw", ds.double(), qf.double())
    c += torch.einsum("bshk,bshw->bskw", p.double(), dof.double())
    return p, ds, c.float(), keys, valid


def _in_group(valid, g, groups):
    """valid [s, K] kept only on the rows of the queries that add into accumulator g (query s
    into s mod groups)."""
    return valid & (torch.arange(valid.size(0)) % groups == g).unsqueeze(-1)


class KeyFixedFakes:
    """The per-key fixed-point kernels' contract in PyTorch (0151): the first pass's bounds,
    the second pass's rounded terms (as int32 lanes or integer-valued floats) and the
    postprocess. It also checks the invariant the design rests on: every key's sum of |terms|,
    in every column, is within its bound."""

    def __init__(self):
        self.bound_units = None
        self.checked = 0
        self.indices = {}  # the indices each pass was given

    def get_bound(self, H, D, topk, evict_first_loads=False, key_groups=1):
        def kernel(q, kv, do, indices, lse, delta, row_max, key_bound, scale, bound_scale):
            self.indices["bound"] = indices.clone()
            assert row_max.shape == (*q.shape[:3], 2) and key_bound.dtype == torch.int64
            assert key_bound.shape == (kv.size(0), kv.size(1), key_groups)
            assert torch.equal(row_max[..., 0], q.float().abs().amax(-1))
            assert torch.equal(row_max[..., 1], do.float().abs().amax(-1))
            p, ds, _, keys, valid = _kernel_terms(q, kv, do, indices, lse, delta, scale)
            t = torch.einsum("bshk,bsh->bsk", ds.abs().double(), row_max[..., 0].double())
            t += torch.einsum("bshk,bsh->bsk", p.double(), row_max[..., 1].double())
            count = torch.ceil((t * bound_scale.double() * (1 + 2**-10)).float().double())
            for bi in range(key_bound.size(0)):
                for g in range(key_groups):
                    v = _in_group(valid[bi], g, key_groups)
                    key_bound[bi, :, g].index_add_(0, keys[bi][v], count[bi][v].long())
            self.bound_units = key_bound.clone(), bound_scale.clone()

        return kernel

    def get_ws64(self, H, D, topk, dkv_key_fixed=None, dkv_key_groups=1, **levers):
        assert dkv_key_fixed in ("int32x2", "fp32"), dkv_key_fixed
        assert dkv_key_fixed == "fp32" or dkv_key_groups == 1
        assert levers.get("block_phase_ns", 0) == 0
        self.levers, self.form, self.heads = levers, dkv_key_fixed, H
        groups = dkv_key_groups

        def kernel(q, kv, do, indices, lse, delta, dkv, scale, key_scale):
            from test_native_routing import _bwd_from_lse_delta, _to_lines

            self.indices["adds"] = indices.clone()
            self.key_scale = key_scale.clone()
            _, _, c, keys, valid = _kernel_terms(q, kv, do, indices, lse, delta, scale)
            key_bound, units = self.bound_units
            assert key_scale.shape == (kv.size(0), kv.size(1), groups)
            for bi, g in ((bi, g) for bi in range(c.size(0)) for g in range(groups)):
                v = _in_group(valid[bi], g, groups)
                k, terms = keys[bi][v], c[bi][v]
                total = torch.zeros(kv.size(1), D, dtype=torch.float64)
                total.index_add_(0, k, terms.abs().double())
                limit = key_bound[bi, :, g].double() / units.double()
                assert (total <= limit.unsqueeze(-1)).all(), "a key's terms exceed its bound"
                self.checked += int((total > 0).any(-1).sum())
                x = torch.round(terms * key_scale[bi, k, g].unsqueeze(-1))  # rint: half to even
                if dkv_key_fixed == "int32x2":
                    lanes = x.long()
                    packed = (lanes[:, 1::2] << 32) + lanes[:, 0::2]
                    dkv[bi, :, 0].index_add_(0, k, packed)
                else:
                    dkv[bi, :, g].index_add_(0, k, _to_lines(x))
            dq, _ = _bwd_from_lse_delta(q, kv, do, indices, lse, delta, scale)
            return dq.to(q.dtype)

        return kernel

    def get_post(self, D, form, groups=1):
        def kernel(dkv, key_inv):
            assert key_inv.shape == (*dkv.shape[:2], groups)
            from test_native_routing import _from_lines

            if form == "int32x2":
                lo = dkv & 0xFFFFFFFF
                lo = torch.where(lo >= 2**31, lo - 2**32, lo)
                hi = (dkv - lo) >> 32
                assert hi.abs().max() < 2**31, "a lane's sum does not fit int32"
                sums = torch.stack([lo, hi], dim=-1).flatten(-2).double()
            else:
                assert dkv.abs().max() < 2**24, "a sum of integer-valued floats is not exact"
                sums = _from_lines(dkv).double()
            out = (sums * key_inv.double()[..., None]).sum(2, keepdim=True)
            return out.to(torch.bfloat16)

        return kernel


def _key_fixed_fakes(monkeypatch):
    """KeyFixedFakes in place of the deterministic route's kernels, on a stand-in 132-SM device."""
    from test_native_routing import _fake_sm_count

    f = KeyFixedFakes()
    monkeypatch.setattr(bwd_mod, "_get_bwd_key_bound_kernel", f.get_bound)
    monkeypatch.setattr(bwd_mod, "_get_bwd_ws64_kernel", f.get_ws64)
    monkeypatch.setattr(bwd_mod, "_get_postprocess_key_fixed_kernel", f.get_post)
    monkeypatch.delenv("MCORE_DSA_TILELANG_BWD_MAX_BLOCK_H", raising=False)
    _fake_sm_count(monkeypatch, 132)  # (0142: the CPU inputs stand for a device with 132 SMs)
    return f


def _route_inputs(heads):
    """The backward's inputs at 256 tokens, top-k 65, indices in score order (as an indexer
    gives them), outlier rows included (q x10 on one head, dO x10 on a few queries): q, kv, dO,
    the indices, the scale, the LSE (log2) and delta."""
    from sparse_ref import causal_random_indices
    from test_native_routing import _attend, _lse_log2

    g = torch.Generator().manual_seed(heads)
    s, w, topk = 256, 512, 65
    q = torch.randn(1, s, heads, w, generator=g)
    q[:, :, 1] *= 10
    q = q.bfloat16()
    kv = torch.randn(1, s, 1, w, generator=g).bfloat16()
    do = torch.randn(1, s, heads, w, generator=g)
    do[:, ::37] *= 10
    do = do.bfloat16()
    idx = causal_random_indices(s, s, topk, g)
    idx = idx.gather(-1, torch.rand(idx.shape, generator=g).argsort(-1)).view(1, s, 1, topk)
    scale = w**-0.5
    lse = _lse_log2(q, kv, idx, scale)
    delta = (_attend(q, kv, idx, scale).bfloat16().float() * do.float()).sum(-1)
    return q, kv, do, idx, scale, lse, delta


@pytest.mark.parametrize("form", ["default", "int32x2", "fp32", "fp32/4", pytest.param(
    "fp32+fine", marks=needs("0152"))])
@pytest.mark.parametrize("heads", [pytest.param(8, marks=needs("0153")), 16, 64])
@pytest.mark.parametrize("sort", [False, pytest.param(True, marks=pytest.mark.skipif(
    not _has_option("bwd_deterministic_sort"),
    reason="wip/0138 (NativeKernelOptions.bwd_deterministic_sort) is not applied")),
    pytest.param("phase", marks=pytest.mark.skipif(
        not _has_option("bwd_block_phase_queries"),
        reason="patch 0142 (NativeKernelOptions.bwd_block_phase_queries) is not in the tree"))])
def test_key_fixed_route_matches_the_fp32_gradient(monkeypatch, form, heads, sort):
    """sparse_mla_bwd's deterministic route with bwd_deterministic_form, its kernels replaced by
    their contract in PyTorch: the two passes' arguments, the scales between them, the bound
    holding for every key, and dk within bf16 rounding of the exact gradient (outlier rows
    included: q x10 on one head, dO x10 on a few queries). "default": bwd_deterministic alone
    takes the "fp32" form, with 0152's fine scales (not powers of two). wip/0138 (sort): both passes get
    each query's indices sorted by key (without it, as given), and the gradients are the same.
    Series 0142 (phase, its default): the adds pass gets the device's SM count as
    block_phase_queries, and both passes the sorted indices; the other cases run with
    bwd_block_phase_queries=0 (the timer's A/B, which the deterministic route leaves off).
    8 heads (0153): the same route, on the 64-row kernel built for 8 heads."""
    from test_native_routing import _bwd_from_lse_delta, options

    f = _key_fixed_fakes(monkeypatch)
    q, kv, do, idx, scale, lse, delta = _route_inputs(heads)
    s = q.size(1)
    default = form == "default"
    form, fine = form.split("+")[0], form.endswith("+fine")
    form, _, groups = form.partition("/")
    chosen = {} if default else dict(
        bwd_deterministic_form=form,
        bwd_deterministic_key_groups=int(groups or 1),
        **({"bwd_deterministic_fine_scales": fine} if has("0152") else {}),
    )
    given = idx.clone()
    with options(
        bwd_deterministic=True,
        **chosen,
        **({"bwd_deterministic_sort": True} if sort is True else {}),
        **({"bwd_block_phase_queries": 0}
           if sort != "phase" and _has_option("bwd_block_phase_queries") else {}),
    ):
        dq, dk = bwd_mod.sparse_mla_bwd(q, kv, None, do, idx, lse, scale, delta=delta)
    assert torch.equal(idx, given), "the caller's indices are left as given"
    assert f.form == ("fp32" if default else form)
    assert f.heads == heads  # the kernel built for the caller's heads (8: as 64 rows)
    if default or fine:  # 0152: the scales are not all powers of two
        selected = f.key_scale[f.key_scale != 1]
        assert not torch.equal(torch.frexp(selected)[0], torch.full_like(selected, 0.5))
    assert f.levers.get("block_phase_queries", 0) == (132 if sort == "phase" else 0)
    want = given.sort(-1).values if sort else given
    assert torch.equal(f.indices["bound"], want) and torch.equal(f.indices["adds"], want)
    assert f.checked > s // 2
    # (the fakes' dq sums the keys in the order the kernel gets them)
    exact_dq, exact_dk = _bwd_from_lse_delta(q, kv, do, want, lse, delta, scale)
    assert dk.shape == kv.shape and dk.dtype == torch.bfloat16
    err = ((dk.float() - exact_dk).norm() / exact_dk.norm()).item()
    assert err < 4e-3, f"dk relative L2 {err:.2e}"  # bf16 rounding of P, dS and dk
    assert torch.equal(dq, exact_dq.to(dq.dtype))


@pytest.mark.skipif(not _has_option("bwd_deterministic_lane_rows"),
                    reason="wip/0168 (NativeKernelOptions.bwd_deterministic_lane_rows) is not applied")
@pytest.mark.parametrize("form,rows,want", [("int32x2", 8, None), ("int32x2", 4, 4),
                                            ("int32x2", 2, 2), ("fp32", 2, None)])
def test_lane_rows_reach_the_int32x2_adds_only(monkeypatch, form, rows, want):
    """wip/0168: bwd_deterministic_lane_rows reaches the second pass's build as lane_rows for the
    "int32x2" form, and only where it is not 8 (the default: the series' own call); the "fp32"
    form never gets it. The gradients are the fakes' exact ones either way."""
    from test_native_routing import _bwd_from_lse_delta, options

    f = _key_fixed_fakes(monkeypatch)
    q, kv, do, idx, scale, lse, delta = _route_inputs(16)
    with options(bwd_deterministic=True, bwd_deterministic_form=form,
                 bwd_deterministic_lane_rows=rows):
        dq, dk = bwd_mod.sparse_mla_bwd(q, kv, None, do, idx, lse, scale, delta=delta)
    assert f.form == form and f.levers.get("lane_rows") == want
    # (the fakes' dq sums the keys in the order the kernel gets them: sorted, 0142's phase)
    exact_dq, exact_dk = _bwd_from_lse_delta(q, kv, do, idx.sort(-1).values, lse, delta, scale)
    assert ((dk.float() - exact_dk).norm() / exact_dk.norm()).item() < 4e-3
    assert torch.equal(dq, exact_dq.to(dq.dtype))


def test_first_pass_keeps_p_and_ds_apart_from_the_kv_buffer():
    """The first pass (no dQ GEMM after WG0's P/dS stores) must not let TileLang's shared-memory
    merge put P and dS in the KV buffer: WG0 gathers the next block there while WG1 still reads
    them (a review found that race in the draft's first build). Built for sm_90a on CPU."""
    import os
    import re

    from native_kernels import SM90A_TARGET, _nvcc

    tilelang = pytest.importorskip("tilelang")

    if _nvcc() is None:
        pytest.skip("nvcc not found (PATH, CUDA_HOME/bin)")
    old = os.environ.get("TILELANG_DEFAULT_TARGET")
    os.environ["TILELANG_DEFAULT_TARGET"] = SM90A_TARGET
    tilelang.disable_cache()
    try:
        kernel = bwd_mod.sparse_mla_bwd_ws64_key_bound.compile(64, 512, 2112)
    finally:
        tilelang.enable_cache()
        if old is None:
            os.environ.pop("TILELANG_DEFAULT_TARGET")
        else:
            os.environ["TILELANG_DEFAULT_TARGET"] = old
    src = kernel.get_kernel_source()
    offsets = dict(
        re.findall(r"void\* (\w+_shared) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", src)
    )
    sizes = {"KV_shared": 64 * 512 * 2, "P_shared": 64 * 64 * 2, "dS_shared": 64 * 64 * 2}
    assert set(sizes) <= set(offsets), offsets
    spans = sorted((int(offsets[n]), int(offsets[n]) + size, n) for n, size in sizes.items())
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        assert end <= start, f"{a} and {b} share shared memory: {offsets}"
    assert "glm_bound_count" in src
