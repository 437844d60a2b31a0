"""ptxas resource usage (registers, spills, shared memory) of the SparseMLA kernels of the patched
tree, compiled for sm_90a on any host (no GPU needed: TileLang lowers, nvcc compiles).

  python bench/ptxas_report.py [--only NAME ...]
  python bench/ptxas_report.py --builder sparse_mla_bwd_ws64 --args '{"H": 64, "D": 512, "topk": 2051}'
      [--cuda FILE] [--sass FILE]

The second form builds any builder of the backward or forward module with the given keyword
arguments (a draft's new ones too) and also counts SASS instructions that matter here (spill
STL/LDL, HGMMA, RED, SHFL, BAR); --cuda / --sass keep the generated CUDA and the disassembly.

Each config builds one kernel through the tree's own builders (the arguments the wrappers pass),
takes TileLang's generated CUDA and compiles it again with `nvcc --cubin -Xptxas -v`, then prints
one line per kernel: registers per thread, spill stores/loads (bytes), static + dynamic smem.
Spills in the 64-row accumulators are what costs the 128-thread backward (see reports/README.md).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TILELANG_DEFAULT_TARGET", '{"kind": "cuda", "arch": "sm_90a"}')

import tilelang  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from native_kernels import ptxas_sm90a  # noqa: E402  (tests/: the codegen tests' nvcc call)

from megatron.core.transformer.experimental_attention_variant.ops import (  # noqa: E402
    tilelang_sparse_mla_bwd as bwd_mod,
    tilelang_sparse_mla_fwd as fwd_mod,
)

SCALE = 512 ** -0.5


def _bwd(heads, tail, topk, threads, dynamic, skip, block_h=32, stages=2, bs=32, **kw):
    return lambda: bwd_mod.bwd(heads, 512, tail, topk, 1, SCALE, max_block_h=block_h,
                               threads=threads, topk_dynamic=dynamic, block_size=bs,
                               skip_invalid_gather=skip, num_stages=stages, **kw)


def _fwd(heads, tail, topk, **kw):
    return lambda: fwd_mod.sparse_mla_fwd(heads, 512, tail, topk, 1, SCALE, **kw)


# name -> builder. "stock": the 576 kernel the #7617 route runs (indices -1 padded to 2112 fwd,
# 2080 bwd); "native": 0030+0050 as the wrapper builds it for GLM (top-k 2051 at run time).
CONFIGS = {
    "bwd576_h16_t128": _bwd(16, 64, 2080, 128, False, False),
    "bwd512_h16_t128_dyn_skip": _bwd(16, 0, 2080, 128, True, True),
    "bwd512_h16_t128_static": _bwd(16, 0, 2080, 128, False, False),
    "bwd512_h16_t128_dyn_noskip": _bwd(16, 0, 2080, 128, True, False),
    "bwd512_h16_t256_bs64_dyn_skip": _bwd(16, 0, 2112, 256, True, True, bs=64),
    "bwd512_h16_t128_split4": _bwd(16, 0, 2080, 128, True, True, split_store=4),
    "bwd512_h16_t128_split8": _bwd(16, 0, 2080, 128, True, True, split_store=8),
    "bwd576_h32_t128": _bwd(32, 64, 2080, 128, False, False),
    "bwd512_h32_t256_dyn_skip": _bwd(32, 0, 2080, 256, True, True),
    # 64 heads: two 32-head blocks (what sparse_mla_bwd runs) vs one 64-head block, each (query,
    # key) added once (issue #17's lever); split 2 needs more shared memory than Hopper allows
    "bwd512_h64_bh32_t256": _bwd(64, 0, 2080, 256, True, True),
    "bwd512_h64_bh64_t256_split4": _bwd(64, 0, 2080, 256, True, True, block_h=64, split_store=4),
    "bwd512_h64_bh64_t256_split8": _bwd(64, 0, 2080, 256, True, True, block_h=64, split_store=8),
    "fwd512_h16_pipelined": _fwd(16, 0, 2112, topk_dynamic=True, skip_invalid_gather=True),
    "fwd512_h64_pipelined": _fwd(64, 0, 2112, topk_dynamic=True, skip_invalid_gather=True),
}
if hasattr(fwd_mod, "sparse_mla_fwd_nope_ws"):  # 0070
    CONFIGS.update({
        f"fwd512_h{h}_ws{nb}_ctas{c}": (lambda h=h, nb=nb, c=c: fwd_mod.sparse_mla_fwd_nope_ws(
            h, 512, -(-2051 // (64 * nb)) * 64 * nb, SCALE, num_buffers=nb, ctas=c))
        for h, nb, c in ((16, 3, 132), (32, 2, 132), (16, 3, 0))
    })


def ptxas(kernel, sass=False):
    """ptxas's registers, spills and smem of the kernel compiled for sm_90a, its output, and with
    sass=True the cubin's SASS (cuobjdump from the CUDA toolkit, or the one triton ships)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        text = ptxas_sm90a(kernel.get_kernel_source(), cubin)
        code = (subprocess.run([_cuobjdump(), "-sass", cubin], capture_output=True, text=True,
                               check=True).stdout if sass else None)
    regs = re.findall(r"Used (\d+) registers", text)
    spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    smem = re.findall(r"(\d+) bytes smem", text)
    return regs, spill, smem, text, code


def dyn_smem(kernel):
    return [int(f.attrs["dyn_shared_memory_buf"])
            for _, f in kernel.artifact.device_mod.functions.items()
            if "dyn_shared_memory_buf" in f.attrs]


def _cuobjdump():
    import shutil

    import triton

    found = shutil.which("cuobjdump")
    return found or os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")


# SASS opcodes that matter here: spills, wgmma, atomics, shuffles, barriers
SASS_OPS = {"STL": r"\bSTL", "LDL": r"\bLDL", "HGMMA": r"\bHGMMA", "RED": r"\bREDG?\b|\bRED\.",
            "SHFL": r"\bSHFL", "BAR": r"\bBAR\.", "SYNCS": r"\bSYNCS"}


def build_one(args):
    import json

    mod = bwd_mod if hasattr(bwd_mod, args.builder) else fwd_mod
    t0 = time.time()
    kernel = getattr(mod, args.builder)(**json.loads(args.args))
    if args.cuda:
        with open(args.cuda, "w") as f:
            f.write(kernel.get_kernel_source())
    regs, spill, smem, text, sass = ptxas(kernel, sass=True)
    if args.sass:
        with open(args.sass, "w") as f:
            f.write(sass)
    counts = {k: len(re.findall(v, sass)) for k, v in SASS_OPS.items()}
    print(f"{args.builder} {args.args}: regs={regs} spill(st,ld)={spill} static_smem={smem} "
          f"dyn_smem={dyn_smem(kernel)} sass={counts} ({time.time() - t0:.0f} s)", flush=True)
    if args.raw:
        print(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--raw", action="store_true", help="print ptxas's own output too")
    ap.add_argument("--builder", help="a builder of the bwd or fwd module, built with --args")
    ap.add_argument("--args", default="{}", help="the builder's keyword arguments, as JSON")
    ap.add_argument("--cuda", help="write the generated CUDA here (--builder)")
    ap.add_argument("--sass", help="write the SASS here (--builder)")
    args = ap.parse_args()
    tilelang.disable_cache()
    if args.builder:
        return build_one(args)
    for name, build in CONFIGS.items():
        if args.only and name not in args.only:
            continue
        t0 = time.time()
        kernel = build()
        regs, spill, smem, text, _ = ptxas(kernel)
        print(f"{name}: regs={regs} spill(st,ld)={spill} static_smem={smem} dyn_smem={dyn_smem(kernel)} "
              f"({time.time() - t0:.0f} s)", flush=True)
        if args.raw:
            print(text)


if __name__ == "__main__":
    sys.exit(main())
