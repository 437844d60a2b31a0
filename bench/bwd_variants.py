"""A/B of SparseMLA backward kernel variants on one GPU (a benchmark, not a test): the backward
kernel alone (dKV zero-fill + kernel, CUDA events, median of --reps after a warm-up) at GLM-5.3-Flash's
shape, to find what makes one variant slower than another. Each variant's dq/dkv are checked
against the first native variant's.

  python bench/bwd_variants.py --out DIR [--seqlen 32768] [--heads 16 32]

Variants (all top-k 2051 k-pool indices, one KV head, bf16):
  stock576        the 576 kernel the #7617 route runs (q/kv zero-padded, indices -1 padded to 2112)
  native_0050     the native kernel as 0050 builds it at 32+ heads (dynamic top-k, -1 rows not
                  gathered; 256 threads from a 32-head block), dKV staged in 2 slices (upstream's)
  native_split4   ... in 4 slices (less shared memory, still one block per SM at 16 heads)
  native_split8   ... in 8 slices (two blocks per SM at 16 heads): what 0050 now picks at 16 heads
  native_noskip   0030's kernel: -1 rows gather row 0 (MCORE_DSA_TILELANG_NATIVE_SCHEDULE=0)
  native_static   indices -1 padded to 2080 and a static top-k (no run-time width)
  native_split8_static  both
--set probes (issue #17: what bounds the backward; needs WIP_PATCHES=wip/0090-bwd-timing-probes.patch):
  native          the kernel sparse_mla_bwd runs at this head count (head block min(heads, 32);
                  256 threads from a 32-head block; dKV in 8 slices at 16 heads, 2 above)
  native_no_atomic / native_no_gemm / native_no_gather   the same without that stage
  native_bh64     at 64 heads: one 64-head block (256 threads, dKV in 8 slices), so each
                  (query, key) is added once
  native_bh64_no_atomic
--set chunks (0105): native (the whole dKV block, staged in row slices) and native_c64/c128 (dKV
  in 64/128-column chunks, staged) and native_c64d/c128d (added from registers); with 0106 (in
  the series from .15) also native_c64l (16 heads) / native_c128l (4-float adds from registers
  into a line-ordered accumulator, the default since 0106); with WIP_PATCHES=wip/0113 at 64
  heads native_ws64 (warpgroup roles: WG0 scores, P, dS and half of dQ; WG1 the other half and dKV)
  and native_ws64_s2 (0114: two dKV accumulator stages); with 0115 native_ws64_s2_w1/w2/w3 (WG0
  computes and adds the first 1/2/3 dKV chunks of each block); with wip/0135 (in wip/STACK) the
  route's kernel's timing probes (native_ws64_s2_w1_hi_ef_pq132_rp_<probe>; before .27
  native_ws64_s2_w2_hi_ef_ph8000_rp_<probe>): _no_atomic /
  _no_gather / _no_dkv (no dKV GEMMs and adds) / _no_sdp (WG0 without the S and dP GEMMs);
  with WIP_PATCHES=wip/0116 native_ws64_addwg
  (a third warpgroup adds dKV from a shared-memory chunk stage); with WIP_PATCHES=wip/0118
  native_ws64_tma / native_ws64_s2_tma (WG1's dKV chunks added by the TMA unit from a shared stage,
  cp.reduce.async.bulk, one 256-byte row a thread; one and two accumulator stages); with
  WIP_PATCHES=wip/0119-l2-hints.patch native_ws64_s2_w2_l2<tag> (0115's kernel with L2 eviction
  hints, L2_HINTS);
  native_ws64_s2_w2_hi (0120: each warpgroup loads a block's indices once, not per chunk),
  native_ws64_s2_w2_ef / _hi_ef (0120: Q, dO and the KV gather evict_first in L2) and _ph<t> /
  _hi_ef_ph<t> (0121: a CTA's first key block from the global timer, --block-phase-ns;
  --unsorted shuffles each query's indices) and _hi_ef_ph<t>_rp (0133: the dKV adds by lane
  pairs, the route's kernel in .25 and .26) and native_ws64_s2_w1_hi_ef_pq132_rp (0141/0142: WG0
  one chunk, the query's phase for 132 SMs: the route's kernel since .27), with wip/0167 its
  _dqst / _dqef / _dqstef (dQ staged in the dead KV buffer and stored in whole rows / stored
  with an L2 evict_first policy / both) and _no_dq_store (timing only: no dQ store); with wip/0137
  _hi_ef_ph<t>_rp_el24/_el32/_el40 (the pairs' adds with an L2 cache policy, evict_last for the
  accumulator's first that many MiB);
  with 0134 (the route's since .26) or 0150 also at 16 heads (the ws64 kernel as 64 rows);
  with 0150 native_ws64_fixed at 16/32/64 heads (issue #21: int64 fixed-point
  dKV at the scale _fixed_point_scale picks on the device, built with the run-time softmax scale
  as the wrapper builds it; fixed_shift: that scale's log2, bitwise_repeat over 3 calls)
--ref NAME [NAME ...]: the variant the others' dq/dkv are checked against, the first of these a
  head count has (default native); it runs first whatever its place in the list
--key-range N: every index taken modulo N (-1 kept), so the dKV rows the kernel adds to (N x 512
  fp32) stay in L2 when N is small: the atomics' cost with and without L2 misses
--live-heads N: heads N and up with zero q and dO and an infinite LSE (zero P and dS, the values a
  64-row tile's padded rows have), loaded and stored all the same: run at 64 heads with 32 live,
  it tells whether the 64-head kernel's time over the 32-head one's is the extra rows' traffic
  (it stays) or their values (it falls to the 32-head time)
Writes DIR/bwd-variants.jsonl (one row per variant) and prints it.
"""
import argparse
import inspect
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from precompile import compile_in_processes  # noqa: E402  (bench/ is on sys.path: the script's folder)

SCALE = 512 ** -0.5
TOPK = 2051


def probe_variants(heads):
    bh = min(32, max(16, heads))
    base = dict(tail=0, topk=2080, dynamic=True, threads=256 if bh >= 32 else 128, skip=True,
                split=8 if bh == 16 else 2, block_h=bh)
    v = {"native": base}
    for probe in ("no_atomic", "no_gemm", "no_gather"):
        v[f"native_{probe}"] = dict(base, probe=probe)
    if heads >= 64:
        # one 64-head block: with dKV in 2 slices it needs 237568 B of shared memory (run 8: does
        # not launch); in 8 slices 212992 B (ptxas, sm_90a: 255 registers, ~430 B spill stores)
        v["native_bh64"] = dict(base, block_h=64, threads=256, split=8)
        v["native_bh64_no_atomic"] = dict(v["native_bh64"], probe="no_atomic")
    return v


def chunk_variants(heads):
    """0105 (issue #17): the dKV block computed and added dkv_chunk columns at a time, staged in
    shared memory for 4-float atomics (cNN) or added from registers (cNNd), against the whole
    block staged in row slices (`native`, the kernel before 0105). Run 12 measured these and TMA
    bulk reduce-add variants (wip/0120 at commit 8460cdb)."""
    bh = min(64, max(16, heads))
    base = dict(tail=0, topk=2080, dynamic=True, threads=128 if bh == 16 else 256, skip=True,
                split=8 if bh in (16, 64) else 2, block_h=bh)
    v = {"native": base}
    for c in (64, 128):
        v[f"native_c{c}"] = dict(base, dkv_chunk=c)
        v[f"native_c{c}d"] = dict(base, dkv_chunk=c, dkv_direct=True)
    # 0106 (wheels from .15): 4-float adds from registers into a line-ordered accumulator (16
    # columns a warp)
    from megatron.core.transformer.experimental_attention_variant.ops import (
        tilelang_sparse_mla_bwd as bwd_mod,
    )

    ws64_fn = getattr(bwd_mod, "sparse_mla_bwd_ws64", None)
    ws64 = inspect.signature(getattr(ws64_fn, "func", ws64_fn)).parameters if ws64_fn else {}
    if "dkv_lines" in inspect.signature(getattr(bwd_mod.bwd, "func", bwd_mod.bwd)).parameters:
        lines = 16 * base["threads"] // 32
        v[f"native_c{lines}l"] = dict(base, dkv_chunk=lines, dkv_lines=True)
    from bench import has_native_option  # bench/bench.py (this script's folder is on sys.path)

    # 0134: 16 heads on the 64-row kernel too (the route's since .26)
    ws64_heads = (16, 32, 64) if has_native_option("bwd_ws64_16_heads") else (32, 64)
    if has_native_option("bwd_ws64_few_heads"):  # 0153: and fewer (the route's since .31)
        ws64_heads += tuple(range(1, 16))
    if heads in ws64_heads and ws64_fn is not None:
        # 0113: warpgroup roles with 64-row tiles (32 heads as 64 rows), dKV in line order
        v["native_ws64"] = dict(base, ws64=True, dkv_lines=True)
        if "dkv_stages" in ws64:  # 0114: two dKV accumulator stages (native_ws64: 0113's one)
            v["native_ws64_s2"] = dict(base, ws64=True, dkv_lines=True, dkv_stages=2)
        if "wg0_dkv_chunks" in ws64:  # 0115: WG0 takes the first m dKV chunks of each block
            for m in (1, 2, 3):
                v[f"native_ws64_s2_w{m}"] = dict(v["native_ws64_s2"], wg0_dkv_chunks=m)
        if hasattr(bwd_mod, "sparse_mla_bwd_ws64_tma"):  # wip/0118: TMA bulk adds, column order
            v["native_ws64_tma"] = dict(base, ws64=True, tma_dkv_add=True)
            v["native_ws64_s2_tma"] = dict(base, ws64=True, tma_dkv_add=True, dkv_stages=2)
        if "hoist_indices" in ws64:  # 0120: a block's indices loaded once, not per chunk
            v["native_ws64_s2_w2_hi"] = dict(v["native_ws64_s2_w2"], hoist_indices=True)
        if "evict_first_loads" in ws64:  # 0120: Q, dO and the KV gather evict_first in L2
            v["native_ws64_s2_w2_ef"] = dict(v["native_ws64_s2_w2"], evict_first_loads=True)
            v["native_ws64_s2_w2_hi_ef"] = dict(v["native_ws64_s2_w2_hi"], evict_first_loads=True)
        if "block_phase_ns" in ws64:  # 0121: a CTA's first key block from the global timer
            for t in VARIANT_SETS.get("block_phase_ns") or (8000,):
                v[f"native_ws64_s2_w2_ph{t}"] = dict(v["native_ws64_s2_w2"], block_phase_ns=t)
                v[f"native_ws64_s2_w2_hi_ef_ph{t}"] = dict(v["native_ws64_s2_w2_hi_ef"],
                                                           block_phase_ns=t)
                if "row_pairs" in ws64:  # 0133: the dKV adds by lane pairs (the route's until .27)
                    rp = v[f"native_ws64_s2_w2_hi_ef_ph{t}_rp"] = dict(
                        v[f"native_ws64_s2_w2_hi_ef_ph{t}"], row_pairs=True)
                    if "dkv_evict_last_mib" in ws64:  # wip/0137: the pairs' adds, L2 policy
                        for mib in (24, 32, 40):
                            v[f"native_ws64_s2_w2_hi_ef_ph{t}_rp_el{mib}"] = dict(
                                rp, dkv_evict_last_mib=mib)
        if "block_phase_queries" in ws64 and "row_pairs" in ws64 and "native_ws64_s2_w2_hi_ef" in v:
            # 0141/0142: the route's kernel (WG0 one chunk, the query's phase for 132 SMs)
            v["native_ws64_s2_w1_hi_ef_pq132_rp"] = dict(
                v["native_ws64_s2_w2_hi_ef"], wg0_dkv_chunks=1, block_phase_queries=132,
                row_pairs=True)
            if "dq_staged" in ws64:  # wip/0167: dQ staged in the KV buffer / stored evict_first
                route = v["native_ws64_s2_w1_hi_ef_pq132_rp"]
                v["native_ws64_s2_w1_hi_ef_pq132_rp_dqst"] = dict(route, dq_staged=True)
                v["native_ws64_s2_w1_hi_ef_pq132_rp_dqef"] = dict(route, dq_evict_first=True)
                v["native_ws64_s2_w1_hi_ef_pq132_rp_dqstef"] = dict(
                    route, dq_staged=True, dq_evict_first=True)
                if "probe" in ws64:  # (timing only: dQ not stored at all)
                    v["native_ws64_s2_w1_hi_ef_pq132_rp_no_dq_store"] = dict(
                        route, probe="no_dq_store")
        if "l2_hint" in ws64:  # wip/0119-l2-hints: L2 eviction hints on 0115's default kernel
            for tag, mode in L2_HINTS.items():
                v[f"native_ws64_s2_w2_l2{tag}"] = dict(v["native_ws64_s2_w2"], l2_hint=mode)
        if hasattr(bwd_mod, "sparse_mla_bwd_ws64_add_wg"):  # wip/0116: an add warpgroup
            v["native_ws64_addwg"] = dict(base, add_wg=True)
        if "probe" in ws64:  # wip/0135: timing probes of the route's kernel (wrong results)
            pbase = next(n for n in ("native_ws64_s2_w1_hi_ef_pq132_rp",
                                     "native_ws64_s2_w2_hi_ef_ph8000_rp", "native_ws64_s2_w2",
                                     "native_ws64_s2") if n in v)
            for probe in ("no_atomic", "no_gather", "no_dkv", "no_sdp"):
                v[f"{pbase}_{probe}"] = dict(v[pbase], probe=probe)
    if heads in (16, 32, 64) and "dkv_fixed" in ws64:
        # 0150 (issue #21): int64 fixed-point dKV adds (column order), the wrapper's stages 2
        # and WG0 chunks 2; at 16 heads the fp32 kernel at 64 rows beside it (the 64-bit adds'
        # own cost)
        s2w2 = dict(base, ws64=True, dkv_stages=2, wg0_dkv_chunks=2)
        if heads == 16:
            v["native_ws64_s2_w2"] = dict(s2w2, dkv_lines=True)
            # with 0120/0121 the fp32 kernel at 16 heads (as 64 rows) with its levers too
            if "block_phase_ns" in ws64:
                hi_ef = dict(v["native_ws64_s2_w2"], hoist_indices=True, evict_first_loads=True)
                v["native_ws64_s2_w2_hi_ef"] = hi_ef
                for t in VARIANT_SETS.get("block_phase_ns") or (8000,):
                    v[f"native_ws64_s2_w2_hi_ef_ph{t}"] = dict(hi_ef, block_phase_ns=t)
                    if "row_pairs" in ws64:  # 0133's pairs too (what wip/0134 routes)
                        v[f"native_ws64_s2_w2_hi_ef_ph{t}_rp"] = dict(
                            hi_ef, block_phase_ns=t, row_pairs=True)
        v["native_ws64_fixed"] = dict(s2w2, dkv_fixed=True)
    return v


VARIANT_SETS = {}
# wip/0119's modes: the dKV adds evict_last; the KV gather evict_first / evict_last; Q and dO
# evict_first
L2_HINTS = {
    "al": "acc_last",
    "kf": "kv_first+q_first",
    "al_kf": "acc_last+kv_first+q_first",
    "kl": "kv_last",
    "al_kfpf": "acc_last+kv_first+pf256+q_first",  # pf256: the gather with a 256-byte L2 prefetch
    "kfpf": "kv_first+pf256+q_first",
}


def set_variants(heads):
    """Every variant of the selected --set at this head count."""
    if VARIANT_SETS.get("set") == "probes":
        return probe_variants(heads)
    if VARIANT_SETS.get("set") == "chunks":
        return chunk_variants(heads)
    return schedule_variants(heads)


def variants(heads):
    """The variants to run at this head count: the set's, or those of them --only names."""
    only = VARIANT_SETS.get("only")
    return {n: c for n, c in set_variants(heads).items() if not only or n in only}


def schedule_variants(heads):
    thr = 256 if heads >= 32 else 128
    v = {
        "stock576": dict(tail=64, topk=2112, dynamic=False, threads=128, skip=False, split=2),
        "native_0050": dict(tail=0, topk=2080, dynamic=True, threads=thr, skip=True, split=2),
        "native_split4": dict(tail=0, topk=2080, dynamic=True, threads=thr, skip=True, split=4),
        "native_split8": dict(tail=0, topk=2080, dynamic=True, threads=thr, skip=True, split=8),
        "native_noskip": dict(tail=0, topk=2080, dynamic=True, threads=128, skip=False, split=2),
        "native_static": dict(tail=0, topk=2080, dynamic=False, threads=thr, skip=True, split=2),
        "native_split8_static": dict(tail=0, topk=2080, dynamic=False, threads=thr, skip=True, split=8),
    }
    return v


def build(heads, cfg):
    from megatron.core.transformer.experimental_attention_variant.ops import (
        tilelang_sparse_mla_bwd as bwd_mod,
    )

    if cfg.get("add_wg"):  # wip/0116 (dKV in column order)
        return bwd_mod.sparse_mla_bwd_ws64_add_wg(heads, 512, cfg["topk"], SCALE)
    if cfg.get("ws64"):  # 0113 (0114: dkv_stages)
        builder = bwd_mod.sparse_mla_bwd_ws64_tma if cfg.get("tma_dkv_add") else bwd_mod.sparse_mla_bwd_ws64
        # every option the row names that the builder takes (a row's option the builder would not
        # see builds another kernel than its name says: the _rp rows did until 0133's row_pairs
        # was passed here)
        params = inspect.signature(getattr(builder, "func", builder)).parameters
        unknown = set(cfg) - set(params) - WS64_ROW_KEYS
        if unknown:  # an option this tree's builder does not take: the row would lie
            raise ValueError(f"the 64-row builder takes no {sorted(unknown)}")
        extra = {k: v for k, v in cfg.items() if k in params and k not in WS64_POSITIONAL}
        # dkv_fixed: the fixed-point scale comes with the softmax scale's run-time argument
        scale = None if cfg.get("dkv_fixed") else SCALE
        if cfg.get("dkv_fixed"):
            extra["runtime_scale"] = True
        return builder(heads, 512, cfg["topk"], scale, **extra)
    extra = {"probe": cfg["probe"]} if cfg.get("probe") else {}  # wip/0090's kernels only
    extra.update({k: cfg[k] for k in ("dkv_chunk", "dkv_direct", "dkv_lines") if k in cfg})
    return bwd_mod.bwd(heads, 512, cfg["tail"], cfg["topk"], 1, SCALE,
                       max_block_h=cfg.get("block_h", 32), threads=cfg["threads"],
                       topk_dynamic=cfg["dynamic"], skip_invalid_gather=cfg["skip"],
                       split_store=cfg["split"], **extra)


# the 64-row builders' arguments that build() gives positionally
WS64_POSITIONAL = ("H", "D", "topk", "sm_scale")
# a 64-row row's keys that are not builder arguments (the head-block rows' fields it inherits,
# and what picks the builder)
WS64_ROW_KEYS = {"tail", "dynamic", "threads", "skip", "split", "block_h", "ws64", "dkv_lines",
                 "tma_dkv_add"}


def compile_job(args):
    heads, name, cfg, cache = args
    if cache:
        os.environ["TILELANG_CACHE_DIR"] = cache
    t0 = time.perf_counter()
    try:
        build(heads, cfg)
        return f"compiled {name} h{heads}: {time.perf_counter() - t0:.0f} s"
    except Exception as exc:  # noqa: BLE001
        return f"compile FAILED {name} h{heads}: {type(exc).__name__}: {str(exc)[:300]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--heads", type=int, nargs="*", default=[16, 32])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--set", choices=["schedule", "probes", "chunks"], default="schedule")
    ap.add_argument("--only", nargs="*", help="run only these variants (and time them once)")
    ap.add_argument("--ref", nargs="*", help="check the variants against the first of these that "
                    "a head count has (default: native)")
    ap.add_argument("--block-phase-ns", type=int, nargs="*",
                    help="0121's block_phase_ns values for the _ph<t> rows (default 8000)")
    ap.add_argument("--unsorted", action="store_true",
                    help="shuffle each query's indices (megatron's indexer gives them in score "
                    "order, the k-pool generator sorted): what block_phase_ns gains without sorting")
    ap.add_argument("--build-only", action="store_true",
                    help="compile the selected variants and stop (no GPU needed: with "
                    "TILELANG_DEFAULT_TARGET set, e.g. to sm_90a, a CPU host checks a draft builds)")
    ap.add_argument("--key-range", type=int, default=0,
                    help="take every index modulo this (0: as drawn), an L2-capacity probe")
    ap.add_argument("--live-heads", type=int, default=0,
                    help="heads from this one on have zero q and dO and an infinite LSE (0: all "
                    "live): their P and dS are zero, as a 64-row tile's padded rows are, while "
                    "the kernel still loads and stores them: whether the time a head count adds "
                    "comes from the rows' traffic or from their values")
    args = ap.parse_args()
    VARIANT_SETS["set"] = args.set
    VARIANT_SETS["only"] = args.only
    VARIANT_SETS["block_phase_ns"] = args.block_phase_ns
    if args.only:
        # a name no head count of this set has would leave nothing to run: say so, with the names
        known = {n for h in args.heads for n in set_variants(h)}
        missing = sorted(set(args.only) - known)
        if missing:
            ap.error(f"--only {' '.join(missing)}: no such variant in --set {args.set} at heads "
                     f"{' '.join(map(str, args.heads))} (there: {' '.join(sorted(known))})")
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.build_only:
        results = [compile_job((h, n, c, None))
                   for h in args.heads for n, c in variants(h).items()]
        print("\n".join(results))
        return 1 if any("FAILED" in r for r in results) else 0
    _, unfinished = compile_in_processes(
        compile_job, [(h, n, c) for h in args.heads for n, c in variants(h).items()], timeout=240)

    import torch

    from bench import RowSink, timed  # bench/bench.py (this script's folder is on sys.path)
    from sparse_ref import kpool_indices, rel_l2
    from megatron.core.transformer.experimental_attention_variant.ops import (
        tilelang_sparse_mla_bwd as bwd_mod,
        tilelang_sparse_mla_fwd as fwd_mod,
    )

    dev = "cuda"
    ref_names = args.ref or ["native_0050" if args.set == "schedule" else "native"]
    s = args.seqlen
    g = torch.Generator(device=dev).manual_seed(0)
    idx = kpool_indices(s, g, device=dev).view(1, s, 1, TOPK).contiguous()
    if args.key_range:
        idx = torch.where(idx >= 0, idx % args.key_range, idx)
    if args.unsorted:
        perm = torch.rand(idx.shape, generator=g, device=dev).argsort(dim=-1)
        idx = idx.gather(-1, perm).contiguous()
    idx_2080 = torch.nn.functional.pad(idx, (0, 2080 - TOPK), value=-1).contiguous()
    idx_2112 = torch.nn.functional.pad(idx, (0, 2112 - TOPK), value=-1).contiguous()
    rows = []
    emit = RowSink(out_dir / "bwd-variants.jsonl")  # one line per variant as it finishes

    for heads in args.heads:
        q = (torch.randn(1, s, heads, 512, device=dev, generator=g) * 0.5).to(torch.bfloat16)
        kv = (torch.randn(1, s, 1, 512, device=dev, generator=g) * 0.5).to(torch.bfloat16)
        do = (torch.randn(1, s, heads, 512, device=dev, generator=g) * 0.1).to(torch.bfloat16)
        live = args.live_heads if 0 < args.live_heads < heads else heads
        q[:, :, live:] = 0
        do[:, :, live:] = 0
        out, lse = fwd_mod.sparse_mla_fwd_interface(q, kv, idx, sm_scale=SCALE)
        lse[:, :, live:] = float("inf")  # (delta is zero there: dO is)
        delta = bwd_mod.sparse_mla_delta(out, do)
        q576 = torch.nn.functional.pad(q, (0, 64)).contiguous()
        kv576 = torch.nn.functional.pad(kv, (0, 64)).contiguous()
        ref = None
        ref_name = next((n for n in ref_names if n in variants(heads)), ref_names[0])
        # the reference first, so that every other variant is checked against it
        for name, cfg in sorted(variants(heads).items(), key=lambda item: item[0] != ref_name):
            row = dict(name=name, heads=heads, seqlen=s, index_width=TOPK, **cfg)  # cfg topk: the kernel's
            if args.key_range:
                row["key_range"] = args.key_range
            if live < heads:
                row["live_heads"] = live
            if (heads, name, cfg) in unfinished:
                row["error"] = "compile did not finish in time (skipped)"
                emit(row)
                rows.append(row)
                continue
            try:
                kernel = build(heads, cfg)
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                emit(row)
                rows.append(row)
                continue
            qq, kk = (q576, kv576) if cfg["tail"] else (q, kv)
            ii = idx_2112 if cfg["tail"] else (idx if cfg["dynamic"] else idx_2080)
            fixed = cfg.get("dkv_fixed", False)  # 0150: an int64 accumulator
            dkv = torch.zeros(kk.shape, dtype=torch.int64 if fixed else torch.float32, device=dev)
            # 0150: the softmax scale and the fixed-point scale at each call
            call_args = (SCALE, bwd_mod._fixed_point_scale(q, kv, do, delta, SCALE)) if fixed else ()

            def call():
                dkv.zero_()
                return kernel(qq, kk, do, ii, lse, delta, dkv, *call_args)

            dq = call()
            torch.cuda.synchronize()
            got = (dq[..., :512].clone(), dkv[..., :512].clone())
            if cfg.get("dkv_lines"):  # 0106: the accumulator's columns in line order
                got = (got[0], got[1][..., [bwd_mod._line_column(d) for d in range(512)]])
            if fixed:  # int64 counts of 2^-shift, column order
                row["fixed_shift"] = int(call_args[1][0].log2().item())
                first = (dq.view(torch.int16).clone(), dkv.clone())
                same = True
                for _ in range(2):  # 3 calls in all: identical dq and dkv bits
                    dq2 = call()
                    torch.cuda.synchronize()
                    same = same and torch.equal(dq2.view(torch.int16), first[0])
                    same = same and torch.equal(dkv, first[1])
                row["bitwise_repeat"] = same
                got = (got[0], got[1].double().mul(call_args[1][1].double()).float())
            row["t_start"] = time.time()  # (to match gpu_run.sh's GPU_SAMPLE_MS samples)
            times = timed(call, args.reps)
            row["t_end"] = time.time()
            row["bwd_ms"] = statistics.median(times)
            row["bwd_ms_min"] = min(times)
            if name == ref_name:
                ref = got
            if ref is not None:
                row[f"dq_rel_l2_vs_{ref_name}"] = rel_l2(got[0], ref[0])
                row[f"dkv_rel_l2_vs_{ref_name}"] = rel_l2(got[1], ref[1])
            emit(row)
            rows.append(row)
            del dq, dkv, got
        del q, kv, do, out, lse, delta, q576, kv576
        torch.cuda.empty_cache()
    emit.close()


if __name__ == "__main__":
    sys.exit(main())
