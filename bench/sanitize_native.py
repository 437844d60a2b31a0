"""Small native-route fwd+bwd calls to run under compute-sanitizer (memcheck): the native kernels
take the caller's top-k width and (patch 0050) address row seq_len_kv for -1 entries, relying on
TileLang's bounds predicate; memcheck shows whether any access leaves the tensors.

  compute-sanitizer --tool memcheck python3 bench/sanitize_native.py
"""
import os

import torch

from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa

os.environ["MCORE_DSA_TILELANG_NOPE"] = "native"
for sq, heads, topk in ((300, 16, 2051), (256, 8, 65), (512, 64, 127)):
    g = torch.Generator(device="cuda").manual_seed(sq)
    q = torch.randn(sq, 1, heads, 512, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
    k = torch.randn(sq, 1, 1, 512, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
    idx = torch.randint(0, sq, (1, sq, topk), generator=g, device="cuda", dtype=torch.int32)
    idx[:, :, topk // 2:] = -1
    idx[:, 5] = -1
    out = tilelang_dsa.fused_sparse_mla_absorbed(q, k, idx, 512 ** -0.5, 512)
    out.float().sum().backward()
    torch.cuda.synchronize()
    print(f"sq {sq} heads {heads} topk {topk}: finite={bool(torch.isfinite(out.float()).all())}", flush=True)
