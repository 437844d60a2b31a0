"""Small native-route fwd+bwd calls to run under compute-sanitizer (memcheck): the native kernels
take the caller's top-k width, address row seq_len_kv for -1 entries (0050, relying on TileLang's
bounds predicate) and treat out-of-range indices as -1 (0080: no gather, no dKV atomic); memcheck
shows whether any access leaves the tensors. Each call is checked (finite, and the results with
out-of-range indices equal those with -1 in their place: out bitwise, dq and dk within 1e-3); the
script exits non-zero on a failed check. As scripts/gpu_run.sh sanitize runs it:

  compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/sanitize_native.py [--quick]

--quick (for racecheck, which is slow on every shared-memory access): the 8-, 16-, 32- and 64-head
cases (8 heads: 0123's 16-row forward tiles with rows past the real heads, and since 0153 the
64-row backward as 64 rows (`--option bwd_ws64_few_heads=False`: the head block's line-ordered
dKV add at 128 threads, 0106); 0112-0114's 64-row kernels at 32 heads, run as 64 rows, and at 64,
with top-k 257: more than one block pair), with fewer queries.
--option NAME=VALUE (repeatable): run every case with that NativeKernelOptions field (a Python
literal), e.g. a draft's kernel that a WIP_PATCHES run applied.
--queries N: every case with N queries instead (with a persistent forward, more than the SMs,
so that its CTAs take more than one query: 0160's loop, 0163's counter).
--forward-only: the forward calls alone (out checked; no backward).
"""
import argparse
import ast
import contextlib
import os
import sys

import torch

from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa
from megatron.core.transformer.experimental_attention_variant.ops.tilelang_utils import (
    override_native_kernel_options,
)


def fwd_bwd(q0, k0, idx, do):
    q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
    out = tilelang_dsa.fused_sparse_mla_absorbed(q, k, idx, 512 ** -0.5, 512)
    if args.forward_only:
        torch.cuda.synchronize()
        return out.detach(), None, None
    out.backward(do)
    torch.cuda.synchronize()
    return out.detach(), q.grad, k.grad


def close(a, b):
    """Within 1e-3 relative L2 (dq sums its key blocks in 0121's timer-given order, dk adds in any
    order)."""
    return bool((a.float() - b.float()).norm() <= 1e-3 * a.float().norm())


os.environ["MCORE_DSA_TILELANG_NOPE"] = "native"
failed = []
ap = argparse.ArgumentParser()
ap.add_argument("--quick", action="store_true")
ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE")
ap.add_argument("--queries", type=int, default=0,
                help="every case with this many queries (e.g. more than the SMs, so that a "
                     "persistent kernel's CTAs take more than one query each)")
ap.add_argument("--forward-only", action="store_true",
                help="only the forward calls (a forward kernel's sanitizer run at more queries, "
                     "without the backward's instrumented time)")
args = ap.parse_args()
options = {name: ast.literal_eval(value) for name, _, value in (o.partition("=") for o in args.option)}
if options:
    print(f"NativeKernelOptions: {options}", flush=True)
# held for the whole run (an unreferenced context manager would be closed, and the options
# restored, as soon as it is collected)
OPTIONS = contextlib.ExitStack()
OPTIONS.enter_context(override_native_kernel_options(**options))
CASES = ((300, 16, 2051), (256, 8, 65), (512, 64, 127), (300, 32, 2051))
if args.quick:
    # top-k 257 at 32/64 heads: three 64-key block pairs, so 0112's forward reuses its KV halves,
    # P and max buffers and runs both phases of its barriers
    CASES = ((64, 8, 257), (64, 16, 2051), (64, 32, 257), (64, 64, 257))
if args.queries:
    CASES = tuple((args.queries, heads, topk) for _, heads, topk in CASES)
for sq, heads, topk in CASES:
    g = torch.Generator(device="cuda").manual_seed(sq)
    q = torch.randn(sq, 1, heads, 512, generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn(sq, 1, 1, 512, generator=g, device="cuda").to(torch.bfloat16)
    do = torch.randn(sq, 1, heads, 512, generator=g, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, sq, (1, sq, topk), generator=g, device="cuda", dtype=torch.int32)
    idx[:, :, topk // 2:] = -1
    idx[:, 5] = -1
    oob = idx.clone()
    oob[:, :, topk // 2:topk // 2 + 8] = sq + 4096  # past the end of KV
    oob[:, 7, :3] = -9
    ref = idx.clone()
    ref[:, 7, :3] = -1
    a, b = fwd_bwd(q, k, ref, do), fwd_bwd(q, k, oob, do)
    checks = dict(finite=all(bool(torch.isfinite(t.float()).all()) for t in a + b if t is not None),
                  out_equal=torch.equal(a[0], b[0]))
    if not args.forward_only:
        checks.update(dq_close=close(a[1], b[1]), dk_close=close(a[2], b[2]))
    print(f"sq {sq} heads {heads} topk {topk}: {checks}", flush=True)
    failed += [f"{sq}/{heads}/{topk}: {k}" for k, ok in checks.items() if not ok]
if failed:
    print("FAILED: " + "; ".join(failed))
    sys.exit(1)
