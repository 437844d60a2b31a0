"""H200 benchmark of the DSA sparse-attention paths, side by side in one run (a benchmark, not a
test). Writes JSONL rows, a markdown table and a PNG plot.

  python bench/bench.py --out DIR [--quick] [--configs 16:32768 ...] [--rows native_fwd ...]

Each row: median (and min) of --reps timed calls after one warm-up call, CUDA events; peak memory
allocated during warm-up + timed calls above what was allocated before (the inputs, the output
gradient and the indices are allocated before; the input gradients and everything else during).

Paths (q/k width, top-k width), all batch 1, one KV head, bf16, causal GLM-5.3-Flash k-pool indices:
  dense         512/2051  megatron-core's dense fallback (dsa._unfused_absorbed_dsa_fn), until OOM
  stock576      576/2048  the unpatched DeepSeek-V3.2 layout through the fused hook (reference)
  padded        512/2051  the patched NoPE path, #7617: zero-pad to 576, -1-pad top-k (fwd+bwd)
  native        512/2051  the native NoPE kernels, no 576 copies (where the wheel has them)
  native_sched0 512/2051  the same with MCORE_DSA_TILELANG_NATIVE_SCHEDULE=0 (without 0050), 32k/16 heads
  native_recompute 512/2051  the same with MCORE_DSA_TILELANG_NATIVE_SAVE_OUT=0 (without 0060: the
                backward recomputes the forward, as upstream's SparseMLA does), 32k/16 heads
  padded_fwd / native_fwd   the same, forward only
  flashmla_fwd  512/2051  FlashMLA's SM90 sparse prefill (sgl-flash-mla), forward only: heads padded
                to 64 and top-k to a multiple of 128 with -1 before timing; output checked
                against our padded path
"""
import argparse
import json
import math
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from sparse_ref import kpool_indices, rel_l2  # noqa: E402

from megatron.core.transformer.experimental_attention_variant import dsa, dsa_kernels  # noqa: E402
from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa  # noqa: E402
from megatron.core.transformer.transformer_config import MLATransformerConfig  # noqa: E402

DEV = "cuda"
GIB = 1024 ** 3
NOPE_ENV = "MCORE_DSA_TILELANG_NOPE"  # native | padded (the native patches' switch)
SCHEDULE_ENV = "MCORE_DSA_TILELANG_NATIVE_SCHEDULE"  # 0: the native kernels without patch 0050
SAVE_OUT_ENV = "MCORE_DSA_TILELANG_NATIVE_SAVE_OUT"  # 0: recompute out/lse in bwd (without 0060)


def has_native():
    return bool(getattr(tilelang_dsa, "NOPE_NATIVE_AVAILABLE", False))


def flash_mla():
    try:
        import flash_mla as fm  # noqa: F401

        return fm, None
    except Exception as exc:  # noqa: BLE001
        return None, f"flash_mla not importable: {type(exc).__name__}: {exc}"


_CFG = {}


def cfg(heads):
    if heads not in _CFG:
        _CFG[heads] = MLATransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=heads,
                                           kv_lora_rank=512, qk_pos_emb_head_dim=0,
                                           dsa_kernel_backend="tilelang")
    return _CFG[heads]


def hook_fn(heads, route=None):
    def fn(q, k, idx, scale):
        if route:
            os.environ[NOPE_ENV] = route
        out = dsa_kernels.run_fused_absorbed_sparse_attention(cfg(heads), q, k, idx, scale, 512)
        if out is None:
            raise RuntimeError("fused hook declined")
        return out
    return fn


def dense_fn(q, k, idx, scale):
    return dsa._unfused_absorbed_dsa_fn(q, k, idx, scale, 512)


class FlashMLAFwd:
    def __init__(self, fm, heads, idx):
        self.fm, self.heads = fm, heads
        self.hp = max(64, 64 * math.ceil(heads / 64))
        topk = idx.size(-1)
        pad = -topk % 128
        self.idx = torch.nn.functional.pad(idx[0], (0, pad), value=-1).unsqueeze(1).contiguous()

    def prepare(self, q, k):
        qp = torch.nn.functional.pad(q[:, 0], (0, 0, 0, self.hp - self.heads)).contiguous()
        return qp, k[:, 0].contiguous()

    def __call__(self, qp, kv, scale):
        out, _, _ = self.fm.flash_mla_sparse_fwd(qp, kv, self.idx, scale, d_v=512, use_legacy=True)
        return out

    def with_lse(self, qp, kv, scale):
        """(out, lse) for the caller's heads, lse in log2 as TileLang's kernels give it (FlashMLA's
        is natural-log)."""
        out, _, lse = self.fm.flash_mla_sparse_fwd(qp, kv, self.idx, scale, d_v=512, use_legacy=True)
        return out[:, : self.heads], lse[:, : self.heads] / math.log(2)


def timed(call, reps):
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def measure(name, width, heads, seqlen, topk_width, make_call, reps, fwd_only):
    row = dict(name=name, dim=width, width=topk_width, heads=heads, seqlen=seqlen)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    try:
        call, cleanup = make_call()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.perf_counter() - t0, 3)
        times = timed(call, reps)
        row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
        key = "fwd_ms" if fwd_only else "fwd_bwd_ms"
        row[key] = statistics.median(times)
        row[key + "_min"] = min(times)
        row["oom"] = False
        extra = cleanup()
        if extra:
            row.update(extra)
    except torch.OutOfMemoryError as exc:
        row["oom"] = True
        row["msg"] = str(exc).split("\n")[0][:200]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def run(args):
    torch.manual_seed(0)
    lengths16 = [4096, 8192, 16384, 32768, 65536] if not args.quick else [4096, 32768]
    configs = [(16, L) for L in lengths16] + [(h, 32768) for h in (8, 32, 64)]
    if args.configs:  # a subset, as HEADS:TOKENS
        configs = [tuple(int(x) for x in c.split(":")) for c in args.configs]
    fm, fm_reason = flash_mla()
    native = has_native()
    rows, notes = [], []
    if not native:
        notes.append("native: not measured (this wheel has no native NoPE kernels)")
    if fm is None:
        notes.append(f"flashmla_fwd: skipped ({fm_reason})")
    dense_oom = {}
    idx_cache = {}
    for heads, L in configs:
        if L not in idx_cache:
            idx_cache.clear()
            g = torch.Generator(device=DEV).manual_seed(L)
            idx_cache[L] = kpool_indices(L, g, device=DEV).unsqueeze(0)
        idx = idx_cache[L]
        g = torch.Generator(device=DEV).manual_seed(L + heads)
        q512 = torch.randn(L, 1, heads, 512, generator=g, device=DEV).to(torch.bfloat16)
        k512 = torch.randn(L, 1, 1, 512, generator=g, device=DEV).to(torch.bfloat16)
        do = torch.randn(L, 1, heads, 512, generator=g, device=DEV).to(torch.bfloat16)
        scale = 512 ** -0.5

        def fwd_bwd(fn, q0, k0, ix, fwd_only=False):
            def make():
                q = q0.detach().clone().requires_grad_(not fwd_only)
                k = k0.detach().clone().requires_grad_(not fwd_only)

                def call():
                    q.grad = k.grad = None
                    if fwd_only:
                        with torch.no_grad():
                            fn(q, k, ix, scale)
                    else:
                        fn(q, k, ix, scale).backward(do)
                return call, lambda: None
            return make

        def add(name, width, topk_width, make, fwd_only=False):
            if args.rows and name not in args.rows:
                return {}
            rows.append(measure(name, width, heads, L, topk_width, make, args.reps, fwd_only))
            return rows[-1]

        # dense fallback: until it runs out of memory at this head count
        if heads in dense_oom:
            notes.append(f"dense {heads} heads {L}: not run (OOM at {dense_oom[heads]})")
        else:
            r = add("dense", 512, 2051, fwd_bwd(dense_fn, q512, k512, idx))
            if r.get("oom"):
                dense_oom[heads] = L
        # stock DeepSeek-V3.2 layout: 576 wide, top-k 2048 (the pools, without the tail pool)
        q576 = torch.randn(L, 1, heads, 576, generator=g, device=DEV).to(torch.bfloat16)
        k576 = torch.randn(L, 1, 1, 576, generator=g, device=DEV).to(torch.bfloat16)
        idx2048 = idx[..., :2048].contiguous()
        os.environ[NOPE_ENV] = "padded"
        add("stock576", 576, 2048, fwd_bwd(hook_fn(heads), q576, k576, idx2048))
        del q576, k576, idx2048
        add("padded", 512, 2051, fwd_bwd(hook_fn(heads, "padded"), q512, k512, idx))
        if native:
            add("native", 512, 2051, fwd_bwd(hook_fn(heads, "native"), q512, k512, idx))
            if heads == 16 and L == 32768:  # A/B of patches 0050 (schedule) and 0060 (saved out)
                os.environ[SCHEDULE_ENV] = "0"
                add("native_sched0", 512, 2051, fwd_bwd(hook_fn(heads, "native"), q512, k512, idx))
                os.environ.pop(SCHEDULE_ENV)
                os.environ[SAVE_OUT_ENV] = "0"
                add("native_recompute", 512, 2051,
                    fwd_bwd(hook_fn(heads, "native"), q512, k512, idx))
                os.environ.pop(SAVE_OUT_ENV)
        add("padded_fwd", 512, 2051, fwd_bwd(hook_fn(heads, "padded"), q512, k512, idx, True), True)
        if native:
            add("native_fwd", 512, 2051, fwd_bwd(hook_fn(heads, "native"), q512, k512, idx, True), True)
        if fm is not None and (not args.rows or "flashmla_fwd" in args.rows):
            with torch.no_grad():
                os.environ[NOPE_ENV] = "padded"
                ours = hook_fn(heads, "padded")(q512, k512, idx, scale)

            def make_fm():
                f = FlashMLAFwd(fm, heads, idx)
                qp, kv = f.prepare(q512, k512)
                holder = {}

                def call():
                    with torch.no_grad():
                        holder["out"] = f(qp, kv, scale)

                def check():
                    out = holder["out"][:, : heads].unsqueeze(1)
                    return {"rel_l2_vs_padded": rel_l2(out, ours), "flashmla_heads": f.hp,
                            "flashmla_topk": f.idx.size(-1)}
                return call, check
            add("flashmla_fwd", 512, 2051, make_fm, True)
            del ours
        del q512, k512, do
        os.environ.pop(NOPE_ENV, None)
    return rows, notes


def write_table(rows, notes, path):
    lines = ["| path | q/k width | top-k | heads | tokens | fwd+bwd ms | fwd ms | peak extra GiB | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        fb = "OOM" if r.get("oom") else (f"{r['fwd_bwd_ms']:.1f}" if "fwd_bwd_ms" in r else "")
        fo = f"{r['fwd_ms']:.2f}" if "fwd_ms" in r else ""
        mem = "OOM" if r.get("oom") else f"{r['peak_extra_gib']:.2f}"
        note = f"rel L2 vs padded {r['rel_l2_vs_padded']:.1e}" if "rel_l2_vs_padded" in r else ""
        lines.append(f"| {r['name']} | {r['dim']} | {r['width']} | {r['heads']} | {r['seqlen']} | {fb} | {fo} | {mem} | {note} |")
    lines += [""] + [f"- {n}" for n in notes]
    path.write_text("\n".join(lines) + "\n")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    names = sorted({r["name"] for r in rows}, key=lambda n: [r["name"] for r in rows].index(n))
    for n in names:
        rs = sorted([r for r in rows if r["name"] == n and r["heads"] == 16 and not r.get("oom")],
                    key=lambda r: r["seqlen"])
        if not rs:
            continue
        xs = [r["seqlen"] for r in rs]
        if "fwd_bwd_ms" in rs[0]:
            a.plot(xs, [r["peak_extra_gib"] for r in rs], marker="o", label=n)
        b.plot(xs, [r.get("fwd_bwd_ms", r.get("fwd_ms")) for r in rs], marker="o",
               linestyle="-" if "fwd_bwd_ms" in rs[0] else "--", label=n + (" (fwd+bwd)" if "fwd_bwd_ms" in rs[0] else ""))
    for ax, title, yl in ((a, "peak extra memory, fwd+bwd (16 heads)", "GiB"),
                          (b, "time (16 heads); dashed = forward only", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel(yl)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    oom = [r["seqlen"] for r in rows if r["name"] == "dense" and r["heads"] == 16 and r.get("oom")]
    if oom:
        a.axvline(min(oom), color="grey", linestyle=":")
        a.text(min(oom), a.get_ylim()[1], " dense OOM", va="top", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--configs", nargs="*", help="only these HEADS:TOKENS, e.g. 16:32768")
    ap.add_argument("--rows", nargs="*", help="only these row names, e.g. native_fwd flashmla_fwd")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, notes = run(args)
    with open(out / "h200-bench.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    write_table(rows, notes, out / "h200-bench.md")
    plot(rows, out / "h200-bench.png")
    print("\n".join(notes))


if __name__ == "__main__":
    main()
