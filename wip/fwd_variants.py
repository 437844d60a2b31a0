"""A/B of the native NoPE forward kernels on one GPU (a benchmark, not a test): 0030/0050's
pipelined kernel (MCORE_DSA_TILELANG_NATIVE_FWD_WS=0) against 0070's warp-specialized one, at
GLM-5.3-Flash's shape (top-k 2051 k-pool indices, one KV head, bf16), through
sparse_mla_fwd_interface. Checks that both give the same output and LSE (two rows with no valid
index must give exactly zero), then times each (CUDA events, median of --reps after a warm-up).

  python bench/fwd_variants.py --out DIR [--seqlen 32768] [--heads 16 32 64]

Writes DIR/fwd-variants.jsonl, one row per (heads, kernel), as they finish.
"""
import argparse
import json
import os
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

SCALE = 512 ** -0.5
TOPK = 2051
ENV = "MCORE_DSA_TILELANG_NATIVE_FWD_WS"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--heads", type=int, nargs="*", default=[16, 32, 64])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    import torch

    from bench import timed
    from sparse_ref import kpool_indices, rel_l2
    from megatron.core.transformer.experimental_attention_variant.ops import (
        tilelang_sparse_mla_fwd as fwd_mod,
    )

    dev, s = "cuda", args.seqlen
    g = torch.Generator(device=dev).manual_seed(0)
    idx = kpool_indices(s, g, device=dev).view(1, s, 1, TOPK).contiguous()
    empty = (3, s - 2)
    for r in empty:
        idx[0, r] = -1
    sink = open(out_dir / "fwd-variants.jsonl", "w")

    def emit(row):
        print(json.dumps(row), flush=True)
        sink.write(json.dumps(row) + "\n")
        sink.flush()

    for heads in args.heads:
        q = (torch.randn(1, s, heads, 512, device=dev, generator=g) * 0.5).to(torch.bfloat16)
        kv = (torch.randn(1, s, 1, 512, device=dev, generator=g) * 0.5).to(torch.bfloat16)
        res = {}
        for name, flag in (("pipelined", "0"), ("warp_specialized", "1")):
            os.environ[ENV] = flag
            row = dict(name=name, heads=heads, seqlen=s, topk=TOPK)
            try:
                out, lse = fwd_mod.sparse_mla_fwd_interface(q, kv, idx, sm_scale=SCALE)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                emit(row)
                continue
            times = timed(lambda: fwd_mod.sparse_mla_fwd_interface(q, kv, idx, sm_scale=SCALE), args.reps)
            row["fwd_ms"] = statistics.median(times)
            row["fwd_ms_min"] = min(times)
            row["finite"] = bool(torch.isfinite(out.float()).all()) and bool(torch.isfinite(lse).all())
            row["empty_rows_zero"] = all(
                int(torch.count_nonzero(out[0, r])) == 0 and int(torch.count_nonzero(lse[0, r])) == 0
                for r in empty
            )
            res[name] = (out, lse)
            if "pipelined" in res and name != "pipelined":
                o0, l0 = res["pipelined"]
                row["out_rel_l2_vs_pipelined"] = rel_l2(out, o0)
                row["out_max_abs_diff_vs_pipelined"] = (out.float() - o0.float()).abs().max().item()
                row["lse_max_abs_diff_vs_pipelined"] = (lse - l0).abs().max().item()
                row["ratio_vs_pipelined"] = row["fwd_ms"] / res_ms
            if name == "pipelined":
                res_ms = row["fwd_ms"]
            emit(row)
        os.environ.pop(ENV, None)
        del q, kv, res
        torch.cuda.empty_cache()
    sink.close()


if __name__ == "__main__":
    sys.exit(main())
