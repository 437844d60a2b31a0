"""Small calls of 0070's warp-specialized forward to run under compute-sanitizer (memcheck,
synccheck, racecheck): its gather issues cp.async by hand on computed shared addresses and its
warpgroups hand buffers over with mbarriers. Shapes reuse the kernels fwd_variants.py compiles
(top-k 2051), with -1 rows, a -1 half and a short sequence (most entries -1).

  compute-sanitizer --tool racecheck python3 bench/sanitize_ws.py
"""
import os

import torch

from megatron.core.transformer.experimental_attention_variant.ops import (
    tilelang_sparse_mla_fwd as fwd_mod,
)

os.environ["MCORE_DSA_TILELANG_NATIVE_FWD_WS"] = "1"
# persistent (the default: one CTA an SM, so 300 queries are 2-3 a CTA, with a batch of 2 the
# queries of both) and a CTA a query
for sq, heads, batch, persist in ((300, 16, 2, "1"), (256, 32, 1, "1"), (300, 16, 1, "0")):
    os.environ["MCORE_DSA_TILELANG_NATIVE_FWD_WS_PERSIST"] = persist
    g = torch.Generator(device="cuda").manual_seed(sq)
    q = torch.randn(batch, sq, heads, 512, generator=g, device="cuda").to(torch.bfloat16)
    kv = torch.randn(batch, sq, 1, 512, generator=g, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, sq, (batch, sq, 1, 2051), generator=g, device="cuda", dtype=torch.int32)
    idx[..., 1500:] = -1
    idx[:, 5] = -1
    out, lse = fwd_mod.sparse_mla_fwd_interface(q, kv, idx, sm_scale=512 ** -0.5)
    torch.cuda.synchronize()
    print(f"sq {sq} heads {heads} batch {batch} persist {persist}: finite={bool(torch.isfinite(out.float()).all())} "
          f"row5 zero={int(torch.count_nonzero(out[0, 5])) == 0}", flush=True)
