"""TP parity of megatron-core's DSAttention on GLM-5.3-Flash's NoPE DSA layout (absorbed MLA,
q/k width 512, k-pool top-k 2051, 64 heads), fused TileLang backend, under torch.distributed.

Launch one process per GPU; the tensor-parallel size is the world size:

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    for n in 2 4 8; do torchrun --nproc_per_node $n bench/tp_parity.py --out reports/tp-parity/tp$n; done

Every rank builds the same inputs and weights from one seed (on CPU, then moved to its device):
query [sq, 1, 64, 512], the shared latent key [sq, 1, 1, 512], up_v_weight [64, v_head_dim, 512],
the output gradient, and one set of k-pool top-k indices (tests/sparse_ref.kpool_indices, width
2051) shared by all heads and ranks. Each rank then runs

- TP=N: megatron's DSAttention (a DSA index-share skip layer, so the top-k indices come from the
  layer's own index-share holder instead of the lightning indexer) on its 64/N-head shard, with
  `dsa_kernel_backend="tilelang"`, forward and backward; output, dq and d(up_v_weight) are
  all-gathered over heads and dk all-reduced (every shard reads the one latent key);
- TP=1: a second DSAttention, configured with tensor_model_parallel_size=1 and a one-rank TP group,
  on all 64 heads on the same GPU (the computation TP=1 would do);
- an FP32 PyTorch reference of the same sparse attention (tests/sparse_ref), for scale.

and compares. MCORE_DSA_REQUIRE_FUSED=1 is set, so a decline of the fused hook (which would run
the dense O(sq*sk) fallback) raises; the script records it per rank. It also records which kernel
layout each rank's SparseMLA call got (512 = native NoPE kernels, 576 = #7617's zero padding), and
torch.cuda.max_memory_allocated of the TP=N forward+backward per rank (peak stats reset first; the
inputs and the gathered results of earlier steps are included, the TP=1 run is not).

`--mode hook` skips DSAttention and calls the hook it uses,
dsa_kernels.run_fused_absorbed_sparse_attention, on each rank's head shard, then applies up_v
like DSAttention does (for a megatron-core whose DSAttention cannot take the NoPE layout).

`--cpu` runs the same logic with gloo on CPU, with tests/sparse_ref.ReferenceSparseMLA (the
kernel's input contract in PyTorch) in place of the TileLang kernel, so it can be checked without
a GPU: `python -m torch.distributed.run --nproc_per_node 2 bench/tp_parity.py --cpu --seq 256 --out D`.

Rank 0 writes DIR/tp-parity.json and prints a one-line summary; the exit status is 0 only when
every rank ran fused and every compared tensor is within --tol (relative L2).

NVLink multicast must stay off: the script refuses to run unless NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set.
"""
import argparse
import datetime
import json
import math
import os
import pathlib
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
REQUIRED_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for tp-parity.json")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU with the PyTorch kernel stand-in")
    p.add_argument("--mode", choices=["dsattention", "hook"], default="dsattention")
    p.add_argument("--seq", type=int, default=4096, help="tokens (one sequence, causal)")
    p.add_argument("--heads", type=int, default=64, help="DSA heads at TP=1 (GLM-5.3-Flash: 64)")
    p.add_argument("--v-head-dim", type=int, default=128)
    p.add_argument("--topk-tokens", type=int, default=2048, help="k-pool top-k tokens (+3 tail)")
    p.add_argument("--softmax-scale", type=float, default=512 ** -0.5)
    p.add_argument("--tol", type=float, default=2e-2, help="relative L2 tolerance (bf16)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--nope-route", choices=["auto", "native", "padded"], default=None,
                   help="sets MCORE_DSA_TILELANG_NOPE (default: leave as is)")
    return p.parse_args(argv)


def check_env():
    bad = {k: os.environ.get(k) for k, v in REQUIRED_ENV.items() if os.environ.get(k) != v}
    if bad:
        want = " ".join(f"{k}={v}" for k, v in REQUIRED_ENV.items())
        have = ", ".join(f"{k}={v!r}" for k, v in bad.items())
        sys.stderr.write(
            f"tp_parity.py: refusing to run: NVLink multicast must stay off ({want}); "
            f"found {have}. Export them before torchrun.\n"
        )
        sys.exit(2)


def main(argv=None):
    args = parse_args(argv)
    check_env()  # before any process group exists
    os.environ["MCORE_DSA_REQUIRE_FUSED"] = "1"  # a decline raises instead of going dense
    if args.nope_route:
        os.environ["MCORE_DSA_TILELANG_NOPE"] = args.nope_route
    if os.environ.get("FROM_INSTALLED") != "1":
        sys.path.insert(0, str(ROOT / "build" / "tree"))
    sys.path.insert(0, str(ROOT / "tests"))

    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.cpu:
        device = torch.device("cpu")
        backend = "gloo"
    else:
        if not torch.cuda.is_available():
            sys.exit("tp_parity.py: no CUDA device (use --cpu for the gloo/CPU check)")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    init_kw = dict(backend=backend, timeout=datetime.timedelta(minutes=20))
    if backend == "nccl":
        init_kw["device_id"] = device
    dist.init_process_group(**init_kw)
    try:
        result = run(args, torch, dist, world, rank, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return result


def run(args, torch, dist, world, rank, device):
    import sparse_ref
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import transformer_config as tc
    from megatron.core.transformer.enums import AttnBackend, AttnMaskType
    from megatron.core.transformer.experimental_attention_variant import dsa, dsa_kernels
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    tp = world
    H, V, W = args.heads, args.v_head_dim, 512
    if H % tp:
        raise SystemExit(f"{H} heads do not split over TP={tp}")
    h = H // tp
    sq = args.seq
    topk_width = args.topk_tokens + sparse_ref.POOL - 1

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    pg_tp = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    assert pg_tp.tp.size() == tp and pg_tp.tp.rank() == rank
    # one-rank TP groups for the TP=1 computation (new_group is collective: every rank makes all)
    solo = [dist.new_group([r]) for r in range(world)]
    pg_one = ProcessGroupCollection(tp=solo[rank], cp=pg_tp.cp)

    if args.cpu:
        # 0.19 refuses dsa_kernel_backend="tilelang" without CUDA (utils.py
        # _validate_dsa_kernel_backend_dependencies); the CPU check swaps the kernel anyway.
        tc._validate_dsa_kernel_backend_dependencies = lambda backend: None
        tilelang_dsa.SparseMLA = sparse_ref.ReferenceSparseMLA
    if tilelang_dsa.SparseMLA is None:
        raise SystemExit("TileLang SparseMLA is not importable (is tilelang installed?)")

    # record what each SparseMLA call receives (kernel layout = the route the hook took)
    kernel_calls = []
    real_sparse_mla = tilelang_dsa.SparseMLA

    class RecordingSparseMLA:
        @staticmethod
        def apply(q, kv, indices, scaling, *save_output):  # save_output: 0060's native route
            kernel_calls.append(dict(q=list(q.shape), kv=list(kv.shape),
                                     indices=list(indices.shape), scale=scaling))
            return real_sparse_mla.apply(q, kv, indices, scaling, *save_output)

    tilelang_dsa.SparseMLA = RecordingSparseMLA

    def make_config(tp_size):
        return MLATransformerConfig(
            num_layers=2, hidden_size=256, num_attention_heads=H, q_lora_rank=128,
            kv_lora_rank=W, qk_head_dim=128, qk_pos_emb_head_dim=0, v_head_dim=V,
            experimental_attention_variant="dsa", dsa_kernel_backend="tilelang",
            dsa_indexer_n_heads=4, dsa_indexer_head_dim=64, dsa_indexer_topk=topk_width,
            # layer 2 of (freq 2, offset 1) is an index-share skip layer: no indexer, top-k
            # comes from layer 1's slot in the holder, which the script fills
            dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1,
            rope_type="rope", add_bias_linear=False, tensor_model_parallel_size=tp_size,
            sequence_parallel=False, bf16=True, params_dtype=torch.bfloat16,
            use_cpu_initialization=True, attention_backend=AttnBackend.auto,
        )

    def make_attention(cfg, pg):
        att = dsa.DSAttention(
            config=cfg, submodules=dsa.DSAttentionSubmodules(indexer=None), layer_number=2,
            attn_mask_type=AttnMaskType.causal, attention_type="self",
            softmax_scale=args.softmax_scale, k_channels=W, v_channels=W, pg_collection=pg,
        )
        assert att.skip_topk and att.source_layer == 1 and att.indexer is None
        return att.to(device)

    # ---- identical inputs on every rank
    g = torch.Generator().manual_seed(args.seed)
    bf = torch.bfloat16
    query = torch.randn(sq, 1, H, W, generator=g).to(bf)
    key = torch.randn(sq, 1, 1, W, generator=g).to(bf)
    up_v = (torch.randn(H, V, W, generator=g) * W ** -0.5).to(bf)
    grad_out = torch.randn(sq, 1, H * V, generator=g).to(bf)
    x = torch.randn(sq, 1, 256, generator=g).to(bf)
    qr = torch.randn(sq, 1, 128, generator=g).to(bf)
    idx = sparse_ref.kpool_indices(sq, g, width=topk_width, topk_tokens=args.topk_tokens)
    idx = idx.unsqueeze(0)  # [b=1, sq, 2051]
    query, key, up_v, grad_out, x, qr, idx = (t.to(device) for t in (query, key, up_v, grad_out, x, qr, idx))
    heads = slice(rank * h, (rank + 1) * h)

    def forward_backward(cfg, pg, q_in, up_in, g_out):
        qq = q_in.detach().clone().requires_grad_()
        kk = key.detach().clone().requires_grad_()
        ww = up_in.detach().clone().requires_grad_()
        if args.mode == "dsattention":
            att = make_attention(cfg, pg)
            setattr(cfg, dsa.DSAttention._HOLDER_ATTR, {1: idx})
            out = att(qq, kk, None, None, x, qr, attn_mask_type=AttnMaskType.causal, up_v_weight=ww)
        else:
            lat = dsa_kernels.run_fused_absorbed_sparse_attention(cfg, qq, kk, idx, args.softmax_scale, W)
            if lat is None:  # strict mode raises first; keep the check for clarity
                raise RuntimeError("fused hook declined")
            out = torch.einsum("sbhc,hdc->sbhd", lat, ww).reshape(sq, 1, -1)
        out.backward(g_out)
        return out.detach(), qq.grad, kk.grad, ww.grad

    res = dict(rank=rank, device=str(device), heads=h, declined=None, error=None)
    cuda = device.type == "cuda"
    ok_run = True
    try:
        dsa_kernels._ABSORBED_FIRST_CALL_REPORTED = False
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        out_l, dq_l, dk_l, dw_l = forward_backward(
            make_config(tp), pg_tp, query[:, :, heads], up_v[heads],
            grad_out.view(sq, 1, H, V)[:, :, heads].reshape(sq, 1, h * V).contiguous(),
        )
        if cuda:
            torch.cuda.synchronize()
            res["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
            res["mem_before_bytes"] = base
        else:
            res["peak_mem_bytes"] = None
        res["tp_seconds"] = round(time.perf_counter() - t0, 4)
        res["tp_kernel_calls"] = list(kernel_calls)
    except RuntimeError as exc:
        ok_run = False
        msg = f"{type(exc).__name__}: {exc}"
        res["declined" if "declined" in str(exc) else "error"] = msg
        traceback.print_exc()

    # every rank must reach the collectives below, so agree on whether the TP run worked
    flag = torch.tensor([1 if ok_run else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    cmp = {}
    if flag.item() == 1:
        def gather_cat(t, dim):
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous())
            return torch.cat(parts, dim=dim)

        out_tp = gather_cat(out_l.view(sq, 1, h, V), 2).reshape(sq, 1, H * V)
        dq_tp = gather_cat(dq_l, 2)
        dw_tp = gather_cat(dw_l, 0)
        dk_tp = dk_l.float()
        dist.all_reduce(dk_tp)
        del out_l, dq_l, dw_l, dk_l

        # TP=1: all heads through a TP-size-1 DSAttention on this rank's device
        n_before = len(kernel_calls)
        out_1, dq_1, dk_1, dw_1 = forward_backward(make_config(1), pg_one, query, up_v, grad_out)
        res["tp1_kernel_calls"] = kernel_calls[n_before:]

        # FP32 PyTorch reference of the same sparse attention
        qf = query.float().requires_grad_()
        kf = key.float().requires_grad_()
        wf = up_v.float().requires_grad_()
        lat = sparse_ref.sparse_attention_reference(
            qf.permute(1, 0, 2, 3), kf.permute(1, 0, 2, 3), idx.unsqueeze(2), args.softmax_scale
        ).permute(1, 0, 2, 3)
        out_f = torch.einsum("sbhc,hdc->sbhd", lat, wf).reshape(sq, 1, H * V)
        out_f.backward(grad_out.float())
        ref = dict(out=out_f.detach(), dq=qf.grad, dk=kf.grad, dw=wf.grad)
        del lat, out_f, qf, kf, wf

        tp_n = dict(out=out_tp, dq=dq_tp, dk=dk_tp, dw=dw_tp)
        tp_1 = dict(out=out_1, dq=dq_1, dk=dk_1, dw=dw_1)
        for name in tp_n:
            a, b, f = tp_n[name], tp_1[name], ref[name]
            cmp[name] = dict(
                shape=list(a.shape),
                finite=bool(torch.isfinite(a.float()).all()),
                rel_l2_tpN_vs_tp1=sparse_ref.rel_l2(a, b),
                max_abs_tpN_vs_tp1=(a.float() - b.float()).abs().max().item(),
                rel_l2_tpN_vs_fp32=sparse_ref.rel_l2(a, f),
                rel_l2_tp1_vs_fp32=sparse_ref.rel_l2(b, f),
            )
    res["compare"] = cmp

    per_rank = [None] * world
    dist.all_gather_object(per_rank, res)
    if rank != 0:
        return 0

    def passes(r):
        c = r.get("compare") or {}
        return (r["declined"] is None and r["error"] is None and len(c) == 4 and all(
            v["finite"] and v["rel_l2_tpN_vs_tp1"] < args.tol and v["rel_l2_tpN_vs_fp32"] < args.tol
            for v in c.values()))

    ok = all(passes(r) for r in per_rank)
    worst = {}
    for name in ("out", "dq", "dk", "dw"):
        vals = [r["compare"][name]["rel_l2_tpN_vs_tp1"] for r in per_rank if r.get("compare")]
        worst[name] = max(vals) if vals else None
    peaks = [r.get("peak_mem_bytes") for r in per_rank]
    routes = sorted({c["q"][-1] for r in per_rank for c in r.get("tp_kernel_calls", [])})
    report = dict(
        ok=ok, tp=tp, world_size=world, mode=args.mode, backend="gloo-cpu" if args.cpu else "nccl",
        kernel="ReferenceSparseMLA (PyTorch stand-in)" if args.cpu else "TileLang SparseMLA",
        shape=dict(seq=sq, batch=1, heads=H, heads_per_rank=H // tp, qk_width=512, v_head_dim=V,
                   topk_width=topk_width, softmax_scale=args.softmax_scale),
        tol=args.tol, seed=args.seed,
        env={k: os.environ.get(k) for k in (*REQUIRED_ENV, "MCORE_DSA_REQUIRE_FUSED",
                                             "MCORE_DSA_TILELANG_NOPE")},
        declined_ranks=[r["rank"] for r in per_rank if r["declined"]],
        error_ranks=[r["rank"] for r in per_rank if r["error"]],
        worst_rel_l2_tpN_vs_tp1=worst,
        tp_kernel_widths=routes,
        peak_mem_bytes_per_rank=peaks,
        torch=torch.__version__,
        per_rank=per_rank,
    )
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tp-parity.json").write_text(json.dumps(report, indent=2) + "\n")
    fmt = lambda v: "n/a" if v is None else f"{v:.2e}"  # noqa: E731
    mem = "n/a" if any(p is None for p in peaks) else "/".join(f"{p / 2**30:.2f}" for p in peaks) + " GiB"
    print(
        f"tp-parity {'PASS' if ok else 'FAIL'}: TP={tp} vs TP=1, {args.mode}, {H} heads "
        f"({H // tp}/rank), seq {sq}, top-k {topk_width}, kernel width {routes}, "
        f"rel L2 out {fmt(worst['out'])} dq {fmt(worst['dq'])} dk {fmt(worst['dk'])} "
        f"dW {fmt(worst['dw'])} (tol {args.tol:g}), declined ranks {report['declined_ranks']}, "
        f"peak mem per rank {mem} -> {out_dir / 'tp-parity.json'}",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
