"""A/B of native NoPE forward kernel variants on one GPU (a benchmark, not a test), at
GLM-5.3-Flash's shape (top-k 2051 k-pool indices, one KV head, bf16), through
sparse_mla_fwd_interface, with FlashMLA's sparse prefill (when importable) in the same run.
Each variant's output and LSE are checked against the first variant's and sampled rows against
the FP32 reference (two rows with no valid index must give exactly zero), then it is timed (CUDA events, median of --reps after a warm-up).

  python bench/fwd_variants.py --out DIR [--seqlen 32768] [--heads 16 32 64] [--variants ...]

Variants: pipelined (0030/0050's kernel as shipped), pipe_s3 / pipe_bi32_s4 / pipe_t128 (the
same kernel with other stage counts, block sizes or thread counts), ws (0070's
warp-specialized kernel with two KV buffers, where the installed tree has it; ws3 the same
with three, 16 heads only; _c2: its score GEMM in two MMA chains instead of four; _np: a CTA per
query instead of persistent; _w: both GEMMs on wgmma, with WIP_PATCHES=wip/0080-ws-wgmma.patch),
ws64 (32 and 64 heads: 0112's 64-row tiles as the series builds them; the others run with it
off; the series' options one at a time off: ws64_frag the output stored from the accumulator
fragment, 4 bytes a thread (0154 off), ws64_cta a CTA a query (0160), ws64_exp2f / ws_exp2f exp2f
(0161), ws64_gmask -1 entries masked from global memory before the score GEMMs (0162), ws64_fixed
fixed shares of the queries (0163), ws64_qstage the output staged in the Q buffer (0164),
ws64_fill a new counter filled with zero before each call (0166); ws64_plain all of 0160-0164
off), flashmla. Writes
DIR/fwd-variants.jsonl, one row per (seqlen, heads, variant), as they finish. --rounds N times
every variant N times, interleaved, for differences near the run-to-run noise (rows carry "round").
"""
import argparse
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

SCALE = 512 ** -0.5
TOPK = 2051
# name -> (warp-specialized forward?, sparse_mla_fwd_interface keyword arguments)
VARIANTS = {
    "pipelined": (False, {}),
    "pipe_s3": (False, dict(num_stages=3)),
    "pipe_bi32_s4": (False, dict(block_I=32, num_stages=4)),
    "pipe_t128": (False, dict(threads=128)),
    "ws": (True, {}),  # two KV buffers
    "ws3": (True, {}),  # three KV buffers (16 heads only: 221 KB of shared memory)
    "ws_c2": (True, {}),  # the score GEMM in two MMA chains instead of four
    "ws3_c2": (True, {}),
    # the same kernels with a CTA per query instead of persistent
    "ws_np": (True, {}),
    "ws3_np": (True, {}),
    # wip/0080 (NativeKernelOptions.fwd_ws_mma="wgmma"): both GEMMs on wgmma, transposed
    "ws_w": (True, {}),
    "ws3_w": (True, {}),
    "ws3_w_np": (True, {}),
    # 0112 (NativeKernelOptions.fwd_ws64): 64-row tiles, two consumer warpgroups, 32/64 heads
    "ws64": (False, {}),
    # the series' 64-row forward with one of its options off (ws64_plain: 0160-0164 all off)
    "ws64_frag": (False, {}),  # 0154: the output from the fragment (and so 0164 off too)
    "ws64_cta": (False, {}),  # 0160: a CTA a query instead of persistent
    "ws64_exp2f": (False, {}),  # 0161: exp2f instead of ex2.approx.ftz
    "ws_exp2f": (True, {}),  # the same in 0070's forward
    "ws64_gmask": (False, {}),  # 0162: -1 entries masked from global memory, before the GEMMs
    "ws64_fixed": (False, {}),  # 0163: fixed shares of the queries instead of a counter
    "ws64_qstage": (False, {}),  # 0164: the output staged in the Q buffer (0154's)
    "ws64_fill": (False, {}),  # 0166: a new counter filled before each call, not one kept
    "ws64_plain": (False, {}),
}
THREE_BUFFERS = tuple(v for v in VARIANTS if v.startswith("ws3"))  # 16 heads only
# the variants that set the series' own options away from their defaults: (field, patch, value)
_NO_PERSIST = ("fwd_ws64_persistent", "0160", False)
_NO_FAST_EXP2 = ("fast_exp2", "0161", False)
_NO_SHARED_MASK = ("fwd_ws64_shared_mask", "0162", False)
_NO_DYNAMIC = ("fwd_ws64_dynamic", "0163", False)
_NO_STAGE_OUT = ("fwd_ws64_stage_out", "0164", False)
_NO_COUNTER_RESET = ("fwd_ws64_counter_reset", "0166", False)
SERIES_OPTIONS = {
    "ws64_frag": (("fwd_ws64_smem_store", "0154", False),),
    "ws64_cta": (_NO_PERSIST,),
    "ws64_exp2f": (_NO_FAST_EXP2,),
    "ws_exp2f": (_NO_FAST_EXP2,),
    "ws64_gmask": (_NO_SHARED_MASK,),
    "ws64_fixed": (_NO_DYNAMIC,),
    "ws64_qstage": (_NO_STAGE_OUT,),
    "ws64_fill": (_NO_COUNTER_RESET,),
    "ws64_plain": (_NO_PERSIST, _NO_FAST_EXP2, _NO_SHARED_MASK, _NO_DYNAMIC, _NO_STAGE_OUT),
}


def runs_at(name, heads):
    """The variants built for some head counts only: three buffers at 16, 64-row tiles at 32/64."""
    if name in THREE_BUFFERS:
        return heads == 16
    return heads in (32, 64) if name.startswith("ws64") else True


def call(fwd_mod, name, q, kv, idx):
    """One forward of variant `name`: the A/B choices go through NativeKernelOptions."""
    from megatron.core.transformer.experimental_attention_variant.ops.tilelang_utils import (
        override_native_kernel_options,
    )

    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_utils

    ws, kw = VARIANTS[name]
    opts = dict(fwd_warp_specialized=ws)
    if "fwd_ws64" in tilelang_utils.NativeKernelOptions.__dataclass_fields__:
        opts["fwd_ws64"] = name.startswith("ws64")  # on by default at 32/64 heads: off for the others
    elif name.startswith("ws64"):
        raise RuntimeError(f"{name} needs patch 0112 (NativeKernelOptions.fwd_ws64)")
    if ws:
        opts.update(fwd_ws_buffers=3 if name in THREE_BUFFERS else 2,
                    fwd_ws_chains=2 if name.endswith("_c2") else 4,
                    fwd_ws_persistent=not name.endswith("_np"))
        if "w" in name.split("_"):
            if "fwd_ws_mma" not in tilelang_utils.NativeKernelOptions.__dataclass_fields__:
                raise RuntimeError(f"{name} needs wip/0080-ws-wgmma.patch (WIP_PATCHES=)")
            opts["fwd_ws_mma"] = "wgmma"
    for field, patch, value in SERIES_OPTIONS.get(name, ()):
        if field not in tilelang_utils.NativeKernelOptions.__dataclass_fields__:
            raise RuntimeError(f"{name} needs patch {patch} (NativeKernelOptions.{field})")
        opts[field] = value
    with override_native_kernel_options(**opts):
        return fwd_mod.sparse_mla_fwd_interface(q, kv, idx, sm_scale=SCALE, **kw)


def compile_job(args):
    heads, name, cache = args
    os.environ["TILELANG_CACHE_DIR"] = cache
    import torch
    from megatron.core.transformer.experimental_attention_variant.ops import (
        tilelang_sparse_mla_fwd as fwd_mod,
    )

    t0 = time.perf_counter()
    s = 256
    q = torch.randn(1, s, heads, 512, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, s, 1, 512, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, s, (1, s, 1, TOPK), device="cuda", dtype=torch.int32)
    try:
        call(fwd_mod, name, q, kv, idx)
        torch.cuda.synchronize()
        res = "ok"
    except Exception as exc:  # noqa: BLE001
        res = f"{type(exc).__name__}: {str(exc)[:200]}"
    return f"compile {name} heads {heads}: {res} in {time.perf_counter() - t0:.1f} s"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqlen", type=int, nargs="*", default=[32768])
    ap.add_argument("--heads", type=int, nargs="*", default=[16, 32, 64])
    ap.add_argument("--variants", nargs="*", default=["pipelined", "ws", "flashmla"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every variant this many times, interleaved (round r: all variants once)")
    ap.add_argument("--precompile", action="store_true", help="compile every kernel first, in parallel")
    ap.add_argument("--precompile-timeout", type=float, default=180,
                    help="seconds for all compile jobs; a variant whose job has not returned is skipped")
    args = ap.parse_args()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    kernels = [v for v in args.variants if v in VARIANTS]
    skip = set()
    if args.precompile:
        from precompile import compile_in_processes

        t0 = time.perf_counter()
        _, hung = compile_in_processes(compile_job, [(h, v) for h in args.heads for v in kernels
                                                     if runs_at(v, h)],
                                       timeout=args.precompile_timeout)
        print(f"precompiled in {time.perf_counter() - t0:.0f} s", flush=True)
        skip = set(hung)  # (heads, variant) whose first call did not return: not timed

    import torch

    from bench import FlashMLAFwd, RowSink, flash_mla, timed
    from sparse_ref import kpool_indices, rel_l2, sparse_attention_reference
    from megatron.core.transformer.experimental_attention_variant.ops import (
        tilelang_sparse_mla_fwd as fwd_mod,
    )

    fm, fm_reason = flash_mla()
    emit = RowSink(out_dir / "fwd-variants.jsonl", "a")

    def time_into(row, fn):
        times = timed(fn, args.reps)
        row["fwd_ms"] = statistics.median(times)
        row["fwd_ms_min"] = min(times)

    dev = "cuda"
    for s in args.seqlen:
        g = torch.Generator(device=dev).manual_seed(s)
        idx = kpool_indices(s, g, device=dev).view(1, s, 1, TOPK).contiguous()
        empty = (3, s - 2)
        for r in empty:
            idx[0, r] = -1
        for heads in args.heads:
            q = (torch.randn(1, s, heads, 512, device=dev, generator=g) * 0.5).to(torch.bfloat16)
            kv = (torch.randn(1, s, 1, 512, device=dev, generator=g) * 0.5).to(torch.bfloat16)
            ref, ref_ms = None, None
            # sampled rows against the FP32 reference (dense scores over the sampled rows only), so
            # a kernel that leaves part of its output unwritten cannot pass by inheriting an
            # earlier variant's memory
            rows = torch.arange(0, s, max(1, s // 64), device=dev)
            ref_rows = sparse_attention_reference(q[:, rows], kv, idx[:, rows], SCALE)
            checked = {}
            for rnd, name in [(r, n) for r in range(args.rounds) for n in args.variants]:
                if not runs_at(name, heads):
                    continue
                row = dict(name=name, heads=heads, seqlen=s, topk=TOPK)
                if args.rounds > 1:
                    row["round"] = rnd
                if rnd > 0:  # checked in round 0: only timed again
                    if name not in checked:
                        continue
                    time_into(row, checked[name])
                    torch.cuda.empty_cache()
                    emit(row)
                    continue
                if (heads, name) in skip:
                    row["skipped"] = "its first call did not return in the precompile step (hang)"
                    emit(row)
                    continue
                if name == "flashmla":
                    if fm is None:
                        row["skipped"] = fm_reason
                        emit(row)
                        continue
                    # bench.py's shape rules: heads padded to 64, top-k to 128 with -1
                    f = FlashMLAFwd(fm, heads, idx[:, :, 0])
                    qp, kv0 = f.prepare(q.transpose(0, 1), kv.transpose(0, 1))

                    def fn(f=f, qp=qp, kv0=kv0):
                        o, l = f.with_lse(qp, kv0, SCALE)
                        return o[None], l[None]  # batch dim back
                else:
                    def fn(name=name):
                        return call(fwd_mod, name, q, kv, idx)
                try:
                    out, lse = fn()
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    emit(row)
                    continue
                row["sampled_rows_rel_l2_vs_fp32"] = rel_l2(out[:, rows], ref_rows)
                time_into(row, fn)
                row["finite"] = bool(torch.isfinite(out.float()).all())
                row["empty_rows_zero"] = all(
                    int(torch.count_nonzero(out[0, r])) == 0 for r in empty
                )
                if ref is None:  # a copy: out itself is poisoned below
                    ref, ref_ms, ref_name = (out.clone(), lse.clone()), row["fwd_ms"], name
                else:
                    o0, l0 = ref
                    row["vs"] = ref_name
                    row["out_rel_l2"] = rel_l2(out, o0)
                    row["out_max_abs_diff"] = (out.float() - o0.float()).abs().max().item()
                    ok = torch.isfinite(l0) & (l0 != 0)
                    row["lse_max_abs_diff"] = (lse.float() - l0.float())[ok].abs().max().item()
                    row["ratio"] = row["fwd_ms"] / ref_ms
                emit(row)
                checked[name] = fn
                out.fill_(float("nan"))  # poison: the next variant's output may reuse this memory
                del out, lse
            del q, kv, ref
            torch.cuda.empty_cache()
    emit.close()


if __name__ == "__main__":
    sys.exit(main())
