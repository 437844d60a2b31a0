"""Small calls of 0070's warp-specialized forward to run under compute-sanitizer (memcheck,
synccheck, racecheck): its gather issues cp.async by hand on computed shared addresses and its
warpgroups hand buffers over with mbarriers. Shapes reuse the kernels fwd_variants.py compiles
(top-k 2051), with -1 rows, a -1 half, out-of-range indices (0080: they count as -1) and a short
sequence (most entries -1). Each call's output is checked (finite, zero on the rows with no valid
index, and equal to the output with -1 in place of the out-of-range entries); the script exits
non-zero on any failed check. Run it as scripts/gpu_run.sh sanitize does:

  compute-sanitizer --tool racecheck --error-exitcode 1 python3 bench/sanitize_ws.py [--quick]
"""
import sys

import torch

from megatron.core.transformer.experimental_attention_variant.ops import (
    tilelang_sparse_mla_fwd as fwd_mod,
)
from megatron.core.transformer.experimental_attention_variant.ops.tilelang_utils import (
    override_native_kernel_options,
)

failed = []
# persistent (the default: one CTA an SM, so 300 queries are 2-3 a CTA, with a batch of 2 the
# queries of both) and a CTA a query; --quick (for racecheck, which is slow on every shared
# memory access): 160 queries, more than one a CTA on a 132-SM H200 in the persistent form
CASES = ((300, 16, 2, True), (256, 32, 1, True), (300, 16, 1, False))
if "--quick" in sys.argv[1:]:
    CASES = ((160, 16, 1, True), (160, 32, 1, True))
for sq, heads, batch, persist in CASES:
    g = torch.Generator(device="cuda").manual_seed(sq)
    q = torch.randn(batch, sq, heads, 512, generator=g, device="cuda").to(torch.bfloat16)
    kv = torch.randn(batch, sq, 1, 512, generator=g, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, sq, (batch, sq, 1, 2051), generator=g, device="cuda", dtype=torch.int32)
    idx[..., 1500:] = -1
    idx[:, 5] = -1
    oob = idx.clone()
    oob[..., 1500:1600] = sq + 1000  # past the end of KV
    oob[..., 1600:1610] = -7
    with override_native_kernel_options(fwd_warp_specialized=True, fwd_ws_persistent=persist):
        out, lse = fwd_mod.sparse_mla_fwd_interface(q, kv, idx, sm_scale=512 ** -0.5)
        out_oob, _ = fwd_mod.sparse_mla_fwd_interface(q, kv, oob, sm_scale=512 ** -0.5)
    torch.cuda.synchronize()
    checks = dict(finite=bool(torch.isfinite(out.float()).all()),
                  row5_zero=int(torch.count_nonzero(out[:, 5])) == 0,
                  oob_as_minus_one=torch.equal(out, out_oob))
    print(f"sq {sq} heads {heads} batch {batch} persistent {persist}: {checks}", flush=True)
    failed += [f"{sq}/{heads}/{batch}/{persist}: {k}" for k, ok in checks.items() if not ok]
if failed:
    print("FAILED: " + "; ".join(failed))
    sys.exit(1)
