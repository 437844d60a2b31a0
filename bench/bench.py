"""H200 benchmark of the DSA sparse-attention paths, side by side in one run (a benchmark, not a
test). Writes JSONL rows, a markdown table and a PNG plot.

  python bench/bench.py --out DIR [--quick] [--configs 16:32768 ...] [--rows native_fwd ...]

Each row: median (and min) of --reps timed calls after one warm-up call, CUDA events; peak memory
allocated during warm-up + timed calls above what was allocated before (the inputs, the output
gradient and the indices are allocated before; the input gradients and everything else during).
results_gib: what every path holds at that peak whatever its kernels (the output, which the caller
keeps through backward, and the input gradients); the ratio table also gives the peak beyond it.

Paths (q/k width, top-k width), all batch 1, one KV head, bf16, causal GLM-5.3-Flash k-pool indices:
  dense         512/2051  megatron-core's dense fallback (dsa._unfused_absorbed_dsa_fn), until OOM
  stock576      576/2048  the unpatched DeepSeek-V3.2 layout through the fused hook (reference)
  padded        512/2051  the patched NoPE path, #7617: zero-pad to 576, -1-pad top-k (fwd+bwd)
  native        512/2051  the native NoPE kernels, no 576 copies (where the wheel has them)
  native_sched0 512/2051  the same with NativeKernelOptions(schedule=False) (without 0050), 32k/16 heads
  native_recompute 512/2051  the same with NativeKernelOptions(save_output=False) (without 0060:
                the backward recomputes the forward, as upstream's SparseMLA does), 32k/16 heads;
                and 32k/8 heads (without 0107: padded heads recompute)
  native_bh32   512/2051  the same with NativeKernelOptions(bwd_max_block_h=32) (without 0100: two
                32-head backward blocks at 64 heads), 32k/64 heads; this row and the dkv rows
                below also set bwd_ws64=False (0113's kernel replaces the head-block backward
                they vary at 32 and 64 heads)
  native_deterministic 512/2051  NativeKernelOptions(bwd_deterministic=True) (0150-0152, what
                megatron's deterministic_mode selects: on the 64-row backward (32/64 kernel heads,
                16 and fewer since 0134/0153) the per-key fp32 form with fine scales, elsewhere
                int64 fixed point); bitwise_repeat (3 calls' dq
                and dk bitwise equal) and grads_sha256; with --fresh-process also
                bitwise_fresh_process (the row again in a new process, the same hash); with
                wip/0138 also native_deterministic_sorted (bwd_deterministic_sort)
  native_deterministic_int64, native_deterministic_int32x2, native_deterministic_fp32,
  native_deterministic_fp32g4, with wip/0168 native_deterministic_int32x2r4 / _int32x2r2
                512/2051  the same with bwd_deterministic_form (0150's one scale;
                0151's scale for each key; _fp32: 0151's power-of-two scales, without 0152's
                fine ones; g4: bwd_deterministic_key_groups=4; r4/r2:
                bwd_deterministic_lane_rows); on the 64-row backward only
                (other head counts, e.g. 128, keep 0150's int64 form whatever the row's name); with wip/0138
                each also as _sorted (bwd_deterministic_sort: the indices sorted by key)
  native_dkv_whole 512/2051  the same with NativeKernelOptions(bwd_dkv_chunks=False) (without 0105:
                the backward's dKV block computed and staged whole), 32k/16 and 64 heads
  native_dkv_staged 512/2051  the same with NativeKernelOptions(bwd_dkv_lines=False) (without 0106:
                dKV chunks staged or added 2 floats at a time), 32k/16, 32 and 64 heads
  native_no_ws64 512/2051  the same with NativeKernelOptions(fwd_ws64=False, bwd_ws64=False)
                (without 0112 and 0113: the forward and backward with 32-row head tiles or
                blocks instead of 64-row tiles and warpgroup roles), 32k/32 and 64 heads;
                checked against the native route
  native_dkv_one_stage 512/2051  the same with NativeKernelOptions(bwd_dkv_two_stages=False)
                (without 0114: 0113's backward with one dKV accumulator), 32k/32 and 64 heads;
                checked against the native route
  native_add_wg 512/2051  with wip/0116 applied: NativeKernelOptions(bwd_add_warpgroup=True) (a third
                warpgroup adds dKV), 32k/32 and 64 heads; checked against the native route
  native_prev_bwd 512/2051  the backward without 0120's and 0121's defaults (no hoisted indices,
                evict_first loads, block phase or index sort; without hoisted indices 0133's row
                pairs are off too), 32 and 64 heads; checked against the native route
  native_head_block_bwd 512/2051  the native route with NativeKernelOptions(bwd_ws64_16_heads=False)
                at 16 heads (without 0134) and bwd_ws64_few_heads=False below 16 (without
                0153): the head-block backward there, at every length; checked against the
                native route
  --ab NAME:FIELD=VALUE,...  512/2051  the native route with these NativeKernelOptions fields (an
                A/B row named NAME, repeatable), every configuration with the native route;
                checked against the native route
  native_wg1_dkv 512/2051  the same with NativeKernelOptions(bwd_wg0_dkv_chunks=0) (without 0115:
                WG1 computes and adds every dKV chunk), 32k/32 and 64 heads; checked against
                the native route
  padded_fwd / native_fwd   the same, forward only
  native_fwd_beside_gemm / native_fwd_cta_beside_gemm  native_fwd with a side stream kept busy by
                8192^3 bf16 GEMMs enqueued before each call (another kernel shares the GPU), with
                the persistent forward and with NativeKernelOptions(fwd_ws_persistent=False), a
                CTA a query (issue #18: the persistent form must not lose there), 32k/16 heads;
                at 32/64 heads the same with fwd_ws64_persistent True / False (0160),
                native_fwd_2waves_beside_gemm with fwd_ws64_persistent=2 (two CTAs an SM)
                and native_fwd_fixed_beside_gemm with fwd_ws64_dynamic=False (0163 off: each
                CTA a fixed share of the queries instead of the next from a counter); with
                0166 native_fwd_fill_beside_gemm with fwd_ws64_counter_reset=False (a new
                counter zeroed by a fill kernel before each call, 0163's way)
  native_fwd_vs_cta_beside_gemm  native_fwd_beside_gemm and native_fwd_cta_beside_gemm timed
                call by call in turns (--pair-reps pairs, as native_fwd_vs_flashmla), each call
                with its own GEMMs enqueued beside it: issue #18's guard as one ratio (the
                beside-GEMM rows taken apart move between rounds more than the two forms
                differ); outputs compared (rel_l2_vs_cta). native_fwd_2waves_vs_cta_beside_gemm,
                native_fwd_fixed_vs_cta_beside_gemm and native_fwd_fill_vs_cta_beside_gemm: the
                same for the two-wave, fixed-share and filled-counter forms (32/64 heads; only
                when --rows names them)
  flashmla_fwd  512/2051  FlashMLA's SM90 sparse prefill (sgl-flash-mla), forward only: heads padded
                to 64 and top-k to a multiple of 128 with -1 before timing; output checked
                against our padded path
  native_fwd_vs_flashmla  native_fwd and flashmla_fwd timed call by call in turns (--pair-reps
                pairs, the order swapped each pair): both medians and the median of the pairs'
                ratios, which the GPU's warming between two rows does not move (issue #18's
                ratio); each call starts on an idle GPU, so its host time (Python, the hook,
                the launches) is in it; the same pairs again with the queue primed by a GPU
                sleep give the GPU's time alone (gpu_ratio_median) and each call's host time
                (host_ms, peer_host_ms); outputs compared (rel_l2_vs_flashmla)
  cudnn / cudnn_fwd 512/2051  megatron-core's own dsa_kernel_backend="cudnn" through the same hook on
                the same MLATransformerConfig (FlashMLA forward + cuDNN CuTe-DSL backward;
                bench/cudnn_peer.py says what it needs); out, dq, dk checked against the native
                route (rel_l2_*_vs_native)

  first_call_cold  512/2051  the first fused fwd+bwd (16 heads, 4k tokens, native route) in a fresh
                process with an empty TileLang cache: what a training job's first step pays for
                compiling the kernels
  first_call_shipped 512/2051  the same with the `make kernels` archive (--kernels, default the one
                dist/glm53-kernels-*.tar.xz) unpacked into the otherwise empty TileLang cache,
                TILELANG_DEFAULT_TARGET set to its target and no nvcc on PATH (issue #19: < 2 s);
                `compiled` counts the kernels TileLang still compiled (0 expected)

Every fused row runs with MCORE_DSA_REQUIRE_FUSED=1, so a decline raises instead of running the dense
fallback. Each row has a status: ok, oom, declined or error (with the message), never a silent gap,
and the run's provenance (megatron-core version and label, a hash of the applied patches, GPU, git
revision, date). `--render JSONL` rewrites the table and plot from rows already measured.
"""
import argparse
import ast
import contextlib
import datetime
import hashlib
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]
from sparse_ref import kpool_indices, rel_l2  # noqa: E402

DEV = "cuda"
GIB = 1024 ** 3
NOPE_ENV = "MCORE_DSA_TILELANG_NOPE"  # native | padded (the native patches' switch)
REQUIRE_FUSED_ENV = "MCORE_DSA_REQUIRE_FUSED"  # 0020: a decline raises instead of falling back


def megatron():
    """megatron-core's modules, imported when a run needs them (--render does not)."""
    from megatron.core.transformer.experimental_attention_variant import dsa, dsa_kernels
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return dsa, dsa_kernels, tilelang_dsa, MLATransformerConfig


def provenance():
    """Where a row comes from: the wheel, its patches, the GPU, this repository's revision, the date."""
    import torch

    import megatron.core as mc

    info = dict(megatron_core=mc.__version__, date=datetime.datetime.now(datetime.timezone.utc)
                .strftime("%Y-%m-%dT%H:%M:%SZ"), torch=torch.__version__,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    try:
        from megatron.core import glm53_patches as gp

        info["label"] = gp.LOCAL_LABEL
        info["patches_sha256"] = hashlib.sha256(
            "".join(f"{n} {h}\n" for n, h in gp.PATCHES).encode()).hexdigest()[:16]
    except ImportError:
        info["label"] = None  # an unpatched megatron-core
    try:
        import tilelang

        info["tilelang"] = tilelang.__version__
    except ImportError:
        pass
    # BENCH_GIT_REV: the caller's revision. A lent GPU host's copy of the working tree can carry
    # the .git of an older commit (the session's first), so HEAD there is not what ran: a tree
    # that differs from its HEAD says so with "+modified".
    rev = os.environ.get("BENCH_GIT_REV")
    if not rev:
        try:
            rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
                                 capture_output=True, text=True, check=True).stdout.strip()
            same = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--",
                                   "bench", "scripts", "tests", "wip"], capture_output=True)
            rev += "" if same.returncode == 0 else "+modified"
        except (OSError, subprocess.CalledProcessError):
            rev = "unknown"
    info["git_rev"] = rev
    return info


class RowSink:
    """A JSON-lines file that takes a script's rows one by one as they finish, each printed and
    written with the run's provenance, so a run cut short keeps the rows it finished."""

    def __init__(self, path, mode="w"):
        self.file = open(path, mode)
        self.prov = provenance()

    def __call__(self, row):
        line = json.dumps(dict(row, provenance=self.prov))
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()

    def close(self):
        self.file.close()


def has_native():
    _, _, tilelang_dsa, _ = megatron()

    return bool(getattr(tilelang_dsa, "NOPE_NATIVE_AVAILABLE", False))


def flash_mla():
    try:
        import flash_mla as fm  # noqa: F401

        return fm, None
    except Exception as exc:  # noqa: BLE001
        return None, f"flash_mla not importable: {type(exc).__name__}: {exc}"


_CFG = {}


def cfg(heads, backend="tilelang"):
    """The same MLATransformerConfig for every fused row; only dsa_kernel_backend differs."""
    if (heads, backend) not in _CFG:
        _CFG[heads, backend] = megatron()[3](
            num_layers=1, hidden_size=256, num_attention_heads=heads, kv_lora_rank=512,
            qk_pos_emb_head_dim=0, dsa_kernel_backend=backend)
    return _CFG[heads, backend]


class Declined(RuntimeError):
    pass


def hook_fn(heads, route=None, backend="tilelang"):
    def fn(q, k, idx, scale):
        if route:
            os.environ[NOPE_ENV] = route
        out = megatron()[1].run_fused_absorbed_sparse_attention(cfg(heads, backend), q, k, idx,
                                                                scale, 512)
        if out is None:
            raise Declined("fused hook declined (returned None)")
        return out
    return fn


def native_options(**changes):
    """NativeKernelOptions changed for a block (the A/B rows); a no-op without changes."""
    if not changes:
        return contextlib.nullcontext()
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_utils

    return tilelang_utils.override_native_kernel_options(**changes)


def has_patch_arg(name):
    """Does the installed wheel's SparseMLA.forward take this argument (0107: out_heads)?"""
    import inspect

    try:
        from megatron.core.transformer.experimental_attention_variant.ops import sparse_mla
    except ImportError:
        return False
    return sparse_mla.SparseMLA is not None and name in inspect.signature(
        sparse_mla.SparseMLA.forward).parameters


def has_native_option(name):
    """Does the installed wheel's NativeKernelOptions have this field (a draft's rows)?"""
    try:
        from megatron.core.transformer.experimental_attention_variant.ops import tilelang_utils
    except ImportError:
        return False
    fields = getattr(getattr(tilelang_utils, "NativeKernelOptions", None), "__dataclass_fields__", {})
    return name in fields


def dense_fn(q, k, idx, scale):
    return megatron()[0]._unfused_absorbed_dsa_fn(q, k, idx, scale, 512)


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


def gemm_beside(count=24, size=8192):
    """A launcher that keeps a side stream busy with count size^3 bf16 GEMMs (about 1 ms each on
    an H200), enqueued after the work already on the current stream: the call timed right after
    it shares the GPU with them throughout."""
    import torch

    stream = torch.cuda.Stream()
    a, b, c = (torch.randn(size, size, device=DEV).to(torch.bfloat16) for _ in range(3))

    def launch():
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(count):
                torch.matmul(a, b, out=c)

    return launch


def beside_gemm_ways(field, has_dynamic, has_counter_reset=False):
    """The forms of the forward the beside-GEMM rows time, as (row name, NativeKernelOptions):
    persistent (field, the persistent option of the route at these heads) and a CTA a query; for
    0160's 64-row form also two CTAs an SM (two waves) and, where 0163 is in the tree, each CTA
    a fixed share of the queries instead of the next from a counter; where 0166 is, the
    counter filled with zero before each call (a fill kernel just ahead of the forward) instead
    of one the kernel leaves zero."""
    ways = [("native_fwd_beside_gemm", {field: True}),
            ("native_fwd_cta_beside_gemm", {field: False})]
    if field == "fwd_ws64_persistent":
        ways.append(("native_fwd_2waves_beside_gemm", {field: 2}))
        if has_dynamic:
            ways.append(("native_fwd_fixed_beside_gemm", {field: True, "fwd_ws64_dynamic": False}))
        if has_dynamic and has_counter_reset:
            ways.append(("native_fwd_fill_beside_gemm",
                         {field: True, "fwd_ws64_counter_reset": False}))
    return ways


def beside_gemm_pairs(ways, field, rows=None):
    """Each persistent way of beside_gemm_ways() timed in turns with a CTA a query, as (pair row
    name, its options): native_fwd_vs_cta_beside_gemm (the defaults), and only where rows (the
    --rows names) names them, since each takes 40 s or so, native_fwd_2waves_vs_cta_beside_gemm,
    native_fwd_fixed_vs_cta_beside_gemm and native_fwd_fill_vs_cta_beside_gemm."""
    pairs = [(name.replace("_beside_gemm", "_vs_cta_beside_gemm"), way)
             for name, way in ways if way[field] is not False]
    return [(name, way) for name, way in pairs
            if name == "native_fwd_vs_cta_beside_gemm" or name in (rows or ())]


def timed(call, reps):
    import torch

    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


# about 10 ms of GPU sleep at an H100's or H200's clocks: far longer than the host takes to
# enqueue one forward through the hook
PRIME_CYCLES = 20_000_000


def timed_primed(call, cycles=PRIME_CYCLES):
    """One call's GPU time with the host's enqueueing kept out of it, and that host time: the
    stream first sleeps (torch.cuda._sleep) while the host enqueues the call behind it, so the
    start event fires with the call's launches already queued. Returns (GPU ms, host ms, sleep
    ms); a host time above the sleep's means the GPU waited for the host after all."""
    import torch

    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    ev[0].record()
    torch.cuda._sleep(cycles)
    ev[1].record()
    t0 = time.perf_counter()
    call()
    host_ms = (time.perf_counter() - t0) * 1e3
    ev[2].record()
    torch.cuda.synchronize()
    return ev[1].elapsed_time(ev[2]), host_ms, ev[0].elapsed_time(ev[1])


def guarded(row, body):
    """Run body(row), which fills in a row's numbers, on a GPU with nothing left queued or cached
    from the row before; a failure leaves the row its status and why (oom, declined or error) and
    none of the numbers taken before it, which are not its result."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    try:
        body(row)
    except torch.OutOfMemoryError as exc:
        row.update(oom=True, status="oom", msg=str(exc).split("\n")[0][:200])
    except Exception as exc:  # noqa: BLE001 (a row records why it has no number)
        declined = isinstance(exc, Declined) or "declined" in str(exc)
        row.update(oom=False, status="declined" if declined else "error",
                   msg=f"{type(exc).__name__}: {exc}"[:500])
    if row.get("status", "ok") != "ok":
        for k in [k for k in row if k.endswith(("_ms", "_min", "_gib", "ratio_median"))]:
            del row[k]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def measure(name, width, heads, seqlen, topk_width, make_call, reps, fwd_only):
    import torch

    def body(row):
        call, cleanup = make_call()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.perf_counter() - t0, 3)
        row["t_start"] = time.time()  # (to match gpu_run.sh's GPU_SAMPLE_MS samples)
        times = timed(call, reps)
        row["t_end"] = time.time()
        row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
        key = "fwd_ms" if fwd_only else "fwd_bwd_ms"
        row[key] = statistics.median(times)
        row[key + "_min"] = min(times)
        row["oom"] = False
        row["status"] = "ok"
        extra = cleanup()
        if extra:
            row.update(extra)

    return guarded(dict(name=name, dim=width, width=topk_width, heads=heads, seqlen=seqlen), body)


def measure_pair(name, width, heads, seqlen, topk_width, make_pair, reps, timer=None,
                 peer_name="FlashMLA", primed_timer=None):
    """Two forward calls timed call by call in turns (ours first on even reps, the peer first on
    odd ones), so that both see the same clocks and the same neighbours: a ratio taken this way
    does not move with the GPU's warming between two rows. make_pair() gives (ours, peer, check):
    ours and peer run one call each, check() what the row adds after the timed calls. The row's
    fwd_ms is ours (median and min), peer_fwd_ms the peer's, ratio_median the median of the
    per-rep ratios ours / peer; peer_name names the peer in the table. timer(call) -> ms (one
    timed call; CUDA events by default). Each call starts on an idle GPU, so those times include
    the host's enqueueing (Python, the hook, the launches): as a call at the head of an empty
    queue pays it. The same number of pairs is then timed with the queue primed
    (primed_timer(call) -> (GPU ms, host ms, sleep ms), timed_primed by default): gpu_fwd_ms,
    peer_gpu_fwd_ms and gpu_ratio_median are the GPU's time alone, as in a training step whose
    host runs ahead, and host_ms / peer_host_ms what each call held the host (medians);
    primed_ok says every rep's host time was below its sleep."""
    import torch

    timer = timer or (lambda call: timed(call, 1)[0])
    primed_timer = primed_timer or timed_primed

    def in_turns(ours, peer, time_one):
        """reps timings of each call, ours first on even reps and the peer first on odd ones."""
        a, b = [], []
        for rep in range(reps):
            turn = [(ours, a), (peer, b)]
            for call, sink in turn if rep % 2 == 0 else turn[::-1]:
                sink.append(time_one(call))
        return a, b

    def body(row):
        ours, peer, check = make_pair()
        ours()
        peer()
        torch.cuda.synchronize()
        a, b = in_turns(ours, peer, timer)
        row.update(fwd_ms=statistics.median(a), fwd_ms_min=min(a), peer_fwd_ms=statistics.median(b),
                   peer_fwd_ms_min=min(b), ratio_median=statistics.median(x / y for x, y in zip(a, b)),
                   pair_reps=reps, peer=peer_name)
        pa, pb = in_turns(ours, peer, primed_timer)
        row.update(gpu_fwd_ms=statistics.median(t[0] for t in pa),
                   peer_gpu_fwd_ms=statistics.median(t[0] for t in pb),
                   gpu_ratio_median=statistics.median(x[0] / y[0] for x, y in zip(pa, pb)),
                   host_ms=statistics.median(t[1] for t in pa),
                   peer_host_ms=statistics.median(t[1] for t in pb),
                   primed_ok=all(t[1] < t[2] for t in pa + pb), oom=False, status="ok")
        extra = check()
        if extra:
            row.update(extra)

    return guarded(dict(name=name, dim=width, width=topk_width, heads=heads, seqlen=seqlen), body)


COLD_CALL = r"""
import os, sys, time
t0 = time.perf_counter()
import torch
torch.zeros(1, device="cuda")
t1 = time.perf_counter()
import tilelang
t2 = time.perf_counter()
import megatron.core.transformer.experimental_attention_variant.ops.tilelang_dsa
t3 = time.perf_counter()
sys.path.insert(0, sys.argv[1])
from glm53_doctor import fused_call
status, text = fused_call(heads=16, tokens=4096)
print(f"setup cuda_s={t1 - t0:.3f} tilelang_import_s={t2 - t1:.3f} mcore_import_s={t3 - t2:.3f}")
print(status, round(time.perf_counter() - t0, 3), text)
"""


def first_call_cold(archive=None, runner=subprocess.run):
    """The first fused fwd+bwd of a fresh process with an empty TileLang kernel cache; with
    archive (`make kernels`), that archive unpacked into the cache, TILELANG_DEFAULT_TARGET set to
    its target and no folder with nvcc on PATH."""
    import re
    import tarfile
    import tempfile

    name = "first_call_shipped" if archive else "first_call_cold"
    row = dict(name=name, dim=512, width=2051, heads=16, seqlen=4096, oom=False)
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TILELANG_CACHE_DIR=cache, MCORE_DSA_TILELANG_NOPE="native")
        if archive:
            with tarfile.open(archive) as tar:
                tar.extractall(cache, filter="data")
                manifest = json.load(tar.extractfile(next(
                    m for m in tar.getmembers() if m.name.startswith("glm53-kernels-"))))
            env["TILELANG_DEFAULT_TARGET"] = json.dumps(manifest["target"])
            env["PATH"] = os.pathsep.join(
                d for d in env.get("PATH", "").split(os.pathsep)
                if d and not os.access(os.path.join(d, "nvcc"), os.X_OK))
            row.update(archive=pathlib.Path(archive).name)
        t0 = time.perf_counter()
        proc = runner([sys.executable, "-c", COLD_CALL, str(ROOT / "shipped")], env=env,
                      capture_output=True, text=True)
        row["process_s"] = round(time.perf_counter() - t0, 3)
    last = (proc.stdout.strip().splitlines() or [""])[-1].split(" ", 2)
    if proc.returncode == 0 and last[0] == "ok":
        row.update(status="ok", first_call_s=float(last[1]), shipped_kernels=bool(archive))
        fused = re.search(r"fwd\+bwd in ([0-9.]+) s", last[2] if len(last) > 2 else "")
        if fused:
            row["fused_s"] = float(fused.group(1))  # the doctor's own timer: the call alone
        row["compiled"] = (proc.stdout + proc.stderr).count("TileLang begins to compile kernel")
        # what the process spent before the call: CUDA context, importing TileLang and the ops
        row.update((k, float(v)) for k, v in re.findall(r"(\w+_s)=([0-9.]+)", proc.stdout))
    else:
        row.update(status="error", msg=(proc.stdout + proc.stderr)[-500:])
    print(json.dumps(row), flush=True)
    return row


def run(args):
    import torch

    import cudnn_peer

    torch.manual_seed(0)
    lengths16 = [4096, 8192, 16384, 32768, 65536] if not args.quick else [4096, 32768]
    configs = [(16, L) for L in lengths16] + [(h, 32768) for h in (8, 32, 64)]
    if args.configs:  # a subset, as HEADS:TOKENS
        configs = [tuple(int(x) for x in c.split(":")) for c in args.configs]
    os.environ[REQUIRE_FUSED_ENV] = "1"  # every fused row: a decline raises, no silent fallback
    fm, fm_reason = flash_mla()
    cudnn_mod, cudnn_reason = cudnn_peer.load()
    native = has_native()
    rows, notes = [], []
    if not native:
        notes.append("native: not measured (this wheel has no native NoPE kernels)")
    if fm is None:
        notes.append(f"flashmla_fwd: skipped ({fm_reason})")
    if cudnn_mod is None:
        notes.append(f"cudnn, cudnn_fwd: {cudnn_reason}")
    dense_oom = {}
    idx_cache = {}
    if not args.rows or "first_call_cold" in args.rows:
        rows.append(first_call_cold())
    if not args.rows or "first_call_shipped" in args.rows:
        archives = [args.kernels] if args.kernels else sorted(
            (ROOT / "dist").glob("glm53-kernels-*.tar.xz"))
        if len(archives) == 1:
            rows.append(first_call_cold(archives[0]))
        else:
            notes.append(f"first_call_shipped: not measured ({len(archives)} archives in dist/; "
                         "make kernels, or --kernels FILE)")
    for heads, L in configs:
        if L not in idx_cache:
            idx_cache.clear()
            g = torch.Generator(device=DEV).manual_seed(L)
            idx_cache[L] = kpool_indices(L, g, device=DEV).unsqueeze(0)
            if args.score_order:  # each query's indices shuffled, as an indexer's top-k gives them
                perm = torch.rand(idx_cache[L].shape, generator=g, device=DEV).argsort(dim=-1)
                idx_cache[L] = idx_cache[L].gather(-1, perm).contiguous()
        idx = idx_cache[L]
        g = torch.Generator(device=DEV).manual_seed(L + heads)
        q512 = torch.randn(L, 1, heads, 512, generator=g, device=DEV).to(torch.bfloat16)
        k512 = torch.randn(L, 1, 1, 512, generator=g, device=DEV).to(torch.bfloat16)
        do = torch.randn(L, 1, heads, 512, generator=g, device=DEV).to(torch.bfloat16)
        scale = 512 ** -0.5

        def fwd_bwd(fn, q0, k0, ix, fwd_only=False, ref=None, options=None, repeat=False,
                    beside=None):
            """make() for measure(); with ref = (out, dq, dk) of the native route, the row gets
            the relative L2 of its results against it, from one more call after the timed ones
            (so holding them does not change the measured peak). options: NativeKernelOptions
            fields for the whole fwd+bwd (the A/B rows). repeat: three more calls, and the row
            says whether their dq and dk are bitwise equal (bitwise_repeat) and gives a hash of
            dq and dk to compare across processes (grads_sha256). beside: a callable that
            enqueues other work on a side stream before each call (gemm_beside)."""
            def make():
                q = q0.detach().clone().requires_grad_(not fwd_only)
                k = k0.detach().clone().requires_grad_(not fwd_only)
                launch = beside() if beside else None

                def call(keep=None):
                    q.grad = k.grad = None
                    if launch is not None:
                        launch()
                    with native_options(**(options or {})):
                        if fwd_only:
                            with torch.no_grad():
                                out = fn(q, k, ix, scale)
                        else:
                            out = fn(q, k, ix, scale)
                            out.backward(do)
                    if keep is not None:
                        keep.update(out=out.detach(), dq=q.grad, dk=k.grad)

                def check():
                    # what every path holds at its peak whatever its kernels: the output (the
                    # caller keeps it through backward) and the input gradients
                    held = q0.shape[:-1].numel() * 512 * 2
                    if not fwd_only:
                        held += q0.numel() * q0.element_size() + k0.numel() * k0.element_size()
                    res = {"results_gib": held / GIB}
                    if repeat:
                        runs = []
                        for _ in range(3):
                            got = {}
                            call(got)
                            torch.cuda.synchronize()
                            runs.append((got["dq"].clone(), got["dk"].clone()))
                        res["bitwise_repeat"] = all(
                            torch.equal(a[0], runs[0][0]) and torch.equal(a[1], runs[0][1])
                            for a in runs[1:])
                        res["grads_sha256"] = hashlib.sha256(
                            runs[0][0].view(torch.int16).cpu().numpy().tobytes()
                            + runs[0][1].view(torch.int16).cpu().numpy().tobytes()).hexdigest()[:16]
                        del runs
                    if ref is None:
                        return res
                    got = {}
                    call(got)
                    torch.cuda.synchronize()
                    res["rel_l2_out_vs_native"] = rel_l2(got["out"], ref[0])
                    if not fwd_only:
                        res.update(rel_l2_dq_vs_native=rel_l2(got["dq"], ref[1]),
                                   rel_l2_dk_vs_native=rel_l2(got["dk"], ref[2]))
                    return res
                return call, check
            return make

        def native_results():
            """(out, dq, dk) of one native-route call, for a row's cross-check against it; made
            just before that row, not held across the other rows (their measured peaks)."""
            got = {}
            fwd_bwd(hook_fn(heads, "native"), q512, k512, idx)()[0](got)
            return got["out"], got["dq"], got["dk"]

        def wanted(name):
            return not args.rows or name in args.rows or name in dict(args.ab)

        def add(name, width, topk_width, make, fwd_only=False):
            if not wanted(name):
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
            if heads == 16 and L == 32768:  # A/B of patch 0050 (schedule)
                add("native_sched0", 512, 2051, fwd_bwd(hook_fn(heads, "native"), q512, k512, idx,
                                                         options=dict(schedule=False)))
            if L == 32768 and (heads == 16 or (heads == 8 and has_patch_arg("out_heads"))):
                # A/B of patches 0060 (saved output) and, at 8 heads, 0107 (with padded heads)
                add("native_recompute", 512, 2051, fwd_bwd(hook_fn(heads, "native"), q512, k512,
                                                            idx, options=dict(save_output=False)))
            # the head-block backward's own A/B rows: 0113's kernel off where it serves
            head_block = dict(bwd_ws64=False) if has_native_option("bwd_ws64") else {}
            if heads == 64 and L == 32768:  # A/B of patch 0100 (one 64-head backward block)
                add("native_bh32", 512, 2051, fwd_bwd(hook_fn(heads, "native"), q512, k512, idx,
                                                       options=dict(head_block, bwd_max_block_h=32)))
            # 0150-0152 (issue #21): the deterministic backward (the route's form,
            # native_deterministic), the other forms (_int64, _int32x2, _fp32 without 0152's fine
            # scales, _fp32g4), each with wip/0138's sorted indices too (_sorted), checked against
            # the default native backward's results
            forms = {"": {}} if has_native_option("bwd_deterministic") else {}
            if has_native_option("bwd_deterministic_form"):
                coarse = ({"bwd_deterministic_fine_scales": False}
                          if has_native_option("bwd_deterministic_fine_scales") else {})
                forms.update({
                    "_int64": dict(bwd_deterministic_form="int64"),
                    "_int32x2": dict(bwd_deterministic_form="int32x2"),
                    "_fp32": dict(bwd_deterministic_form="fp32", **coarse),
                    "_fp32g4": dict(bwd_deterministic_form="fp32", bwd_deterministic_key_groups=4)})
            if has_native_option("bwd_deterministic_lane_rows"):  # wip/0168: rows traded
                forms.update({f"_int32x2r{n}": dict(bwd_deterministic_form="int32x2",
                                                    bwd_deterministic_lane_rows=n) for n in (4, 2)})
            sorts = {"": {}}
            if has_native_option("bwd_deterministic_sort"):
                sorts["_sorted"] = dict(bwd_deterministic_sort=True)
            for form, form_options in forms.items():
                for sort, sort_options in sorts.items():
                    row = f"native_deterministic{form}{sort}"
                    if wanted(row):  # (before native_results(), which costs a call)
                        add(row, 512, 2051, fwd_bwd(
                            hook_fn(heads, "native"), q512, k512, idx, repeat=True,
                            options=dict(bwd_deterministic=True, **form_options, **sort_options),
                            ref=native_results()))
            if heads in (16, 64) and L == 32768:  # A/B of patch 0105 (dKV in column chunks)
                add("native_dkv_whole", 512, 2051, fwd_bwd(
                    hook_fn(heads, "native"), q512, k512, idx,
                    options=dict(head_block, bwd_dkv_chunks=False)))
            if heads in (16, 32, 64) and L == 32768 and has_native_option("bwd_dkv_lines"):
                # A/B of patch 0106 (the line-ordered dKV add from registers)
                add("native_dkv_staged", 512, 2051, fwd_bwd(
                    hook_fn(heads, "native"), q512, k512, idx,
                    options=dict(head_block, bwd_dkv_lines=False)))
            if heads in (32, 64) and L == 32768 and has_native_option("bwd_dkv_two_stages"):
                # A/B of patch 0114 (two dKV accumulator stages in 0113's backward)
                add("native_dkv_one_stage", 512, 2051, fwd_bwd(
                    hook_fn(heads, "native"), q512, k512, idx,
                    options=dict(bwd_dkv_two_stages=False), ref=native_results()))
            if heads in (32, 64) and L == 32768 and has_native_option("bwd_wg0_dkv_chunks"):
                # A/B of patch 0115 (WG0 takes two of each block's dKV chunks)
                add("native_wg1_dkv", 512, 2051, fwd_bwd(
                    hook_fn(heads, "native"), q512, k512, idx,
                    options=dict(bwd_wg0_dkv_chunks=0), ref=native_results()))
            # A/B of patch 0134 (16 heads on 0113's 64-row backward) and of 0153 (fewer heads),
            # every length
            head_block = ("bwd_ws64_16_heads" if heads == 16 else
                          "bwd_ws64_few_heads" if heads < 16 else None)
            if head_block and has_native_option(head_block) and wanted("native_head_block_bwd"):
                add("native_head_block_bwd", 512, 2051, fwd_bwd(
                    hook_fn(heads, "native"), q512, k512, idx,
                    options={head_block: False}, ref=native_results()))
            if heads in (32, 64) and L == 32768 and has_native_option("bwd_add_warpgroup"):
                # wip/0116 (a draft): the backward with an add warpgroup
                add("native_add_wg", 512, 2051, fwd_bwd(
                    hook_fn(heads, "native"), q512, k512, idx,
                    options=dict(bwd_add_warpgroup=True), ref=native_results()))
            if heads in (32, 64) and has_native_option("bwd_block_phase_ns") and wanted(
                    "native_prev_bwd"):
                # A/B of patches 0120 and 0121: 0113's backward as before them (no hoisted
                # indices, no evict_first loads, no block phase and no index sort; 0142's
                # query phase off too)
                no_query_phase = (dict(bwd_block_phase_queries=0)
                                  if has_native_option("bwd_block_phase_queries") else {})
                add("native_prev_bwd", 512, 2051, fwd_bwd(
                    hook_fn(heads, "native"), q512, k512, idx,
                    options=dict(bwd_hoist_indices=False, bwd_evict_first_loads=False,
                                 bwd_block_phase_ns=0, **no_query_phase),
                    ref=native_results()))
            for ab_name, ab_options in args.ab:
                # --ab: the native route with these NativeKernelOptions fields, side by side
                add(ab_name, 512, 2051, fwd_bwd(
                    hook_fn(heads, "native"), q512, k512, idx,
                    options=ab_options, ref=native_results()))
            if heads in (32, 64) and L == 32768 and has_native_option("bwd_ws64"):
                # A/B of patches 0112 and 0113 (64-row tiles with warpgroup roles)
                add("native_no_ws64", 512, 2051, fwd_bwd(
                    hook_fn(heads, "native"), q512, k512, idx,
                    options=dict(fwd_ws64=False, bwd_ws64=False), ref=native_results()))
        add("padded_fwd", 512, 2051, fwd_bwd(hook_fn(heads, "padded"), q512, k512, idx, True), True)
        if native:
            add("native_fwd", 512, 2051, fwd_bwd(hook_fn(heads, "native"), q512, k512, idx, True), True)
            # the persistent forward and a CTA a query with another kernel beside them: 0070's
            # at 16 heads, 0160's 64-row one at 32/64 heads where the tree has it (the other
            # options at their defaults)
            field = {16: "fwd_ws_persistent", 32: "fwd_ws64_persistent",
                     64: "fwd_ws64_persistent"}.get(heads)
            if field and L == 32768 and has_native_option(field):
                ways = beside_gemm_ways(field, has_native_option("fwd_ws64_dynamic"),
                                        has_native_option("fwd_ws64_counter_reset"))
                for name, way in ways:
                    add(name, 512, 2051, fwd_bwd(
                        hook_fn(heads, "native"), q512, k512, idx, True, beside=gemm_beside,
                        options=way), True)
                for pair_name, way in beside_gemm_pairs(ways, field, args.rows):
                    if not wanted(pair_name):
                        continue

                    def make_cta_pair(way=way):
                        # each call enqueues its own GEMMs before it, as in the rows above
                        ours_call, cta_call = (fwd_bwd(
                            hook_fn(heads, "native"), q512, k512, idx, True, beside=gemm_beside,
                            options=options)()[0] for options in (way, {field: False}))

                        def check():
                            got, cta = {}, {}
                            ours_call(got)
                            cta_call(cta)
                            return {"rel_l2_vs_cta": rel_l2(got["out"], cta["out"])}

                        return ours_call, cta_call, check
                    rows.append(measure_pair(pair_name, 512, heads, L, 2051, make_cta_pair,
                                             args.pair_reps, peer_name="CTA a query"))
        if wanted("cudnn") or wanted("cudnn_fwd"):
            if cudnn_mod is None:
                for name in ("cudnn", "cudnn_fwd"):
                    if wanted(name):
                        rows.append(dict(name=name, dim=512, width=2051, heads=heads, seqlen=L,
                                         oom=False, status="unavailable", msg=cudnn_reason))
            else:
                ref = native_results() if native else None  # for the peer's cross-check
                cudnn = hook_fn(heads, backend="cudnn")
                add("cudnn", 512, 2051, fwd_bwd(cudnn, q512, k512, idx, ref=ref))
                add("cudnn_fwd", 512, 2051, fwd_bwd(cudnn, q512, k512, idx, True, ref=ref), True)
                del ref
        if fm is not None and (wanted("flashmla_fwd") or wanted("native_fwd_vs_flashmla")):
            with torch.no_grad():
                os.environ[NOPE_ENV] = "padded"
                ours = hook_fn(heads, "padded")(q512, k512, idx, scale)

            def fm_call():
                """FlashMLA's forward on this config's inputs, prepared before timing: its adapter,
                the call, and the last call's output for our heads ([tokens, 1, heads, 512])."""
                f = FlashMLAFwd(fm, heads, idx)
                qp, kv = f.prepare(q512, k512)
                holder = {}

                def call():
                    with torch.no_grad():
                        holder["out"] = f(qp, kv, scale)
                return f, call, lambda: holder["out"][:, : heads].unsqueeze(1)

            def make_fm():
                f, call, out = fm_call()

                def check():
                    return {"rel_l2_vs_padded": rel_l2(out(), ours), "flashmla_heads": f.hp,
                            "flashmla_topk": f.idx.size(-1)}
                return call, check
            add("flashmla_fwd", 512, 2051, make_fm, True)
            if native and wanted("native_fwd_vs_flashmla"):

                def make_pair():
                    ours_call = fwd_bwd(hook_fn(heads, "native"), q512, k512, idx, True)()[0]
                    _, peer_call, peer_out = fm_call()
                    got = {}

                    def check():
                        ours_call(got)
                        peer_call()
                        return {"rel_l2_vs_flashmla": rel_l2(got["out"], peer_out())}

                    return ours_call, peer_call, check
                rows.append(measure_pair("native_fwd_vs_flashmla", 512, heads, L, 2051, make_pair,
                                         args.pair_reps))
            del ours
        del q512, k512, do
        os.environ.pop(NOPE_ENV, None)
    return rows, notes


def ratios(rows):
    """native / cudnn and native_fwd / cudnn_fwd (time and peak extra memory) per (heads, tokens),
    from rows of one run."""
    by = {(r["name"], r["heads"], r["seqlen"]): r for r in rows if r.get("status", "ok") == "ok"}
    out = []
    for (name, heads, L), r in by.items():
        peer = {"native": "cudnn", "native_fwd": "cudnn_fwd"}.get(name)
        if peer is None or (peer, heads, L) not in by:
            continue
        c = by[peer, heads, L]
        key = "fwd_ms" if name.endswith("_fwd") else "fwd_bwd_ms"
        x = dict(ours=name, peer=peer, heads=heads, seqlen=L, time_ratio=r[key] / c[key],
                 mem_ratio=r["peak_extra_gib"] / c["peak_extra_gib"], ours_ms=r[key],
                 peer_ms=c[key], ours_gib=r["peak_extra_gib"], peer_gib=c["peak_extra_gib"])
        if "results_gib" in r and "results_gib" in c:
            # the peak beyond the output and gradients, which no path can go below
            x.update(ours_beyond_gib=r["peak_extra_gib"] - r["results_gib"],
                     peer_beyond_gib=c["peak_extra_gib"] - c["results_gib"])
            x["beyond_ratio"] = x["ours_beyond_gib"] / x["peer_beyond_gib"]
        out.append(x)
    return out


def write_table(rows, notes, path):
    lines = ["| path | q/k width | top-k | heads | tokens | fwd+bwd ms | fwd ms | peak extra GiB | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        status = r.get("status", "oom" if r.get("oom") else "ok")
        bad = {"oom": "OOM"}.get(status, status)
        fb = f"{r['fwd_bwd_ms']:.1f}" if "fwd_bwd_ms" in r else (bad if status != "ok" else "")
        fo = f"{r['fwd_ms']:.2f}" if "fwd_ms" in r else ""
        if r["name"] in ("first_call_cold", "first_call_shipped") and "first_call_s" in r:
            fb = f"first call {r['first_call_s']:.1f} s"
        mem = f"{r['peak_extra_gib']:.2f}" if "peak_extra_gib" in r else ("" if status == "ok" else bad)
        note = []
        if "rel_l2_vs_padded" in r:
            note.append(f"rel L2 vs padded {r['rel_l2_vs_padded']:.1e}")
        vs = [f"{t} {r[f'rel_l2_{t}_vs_native']:.1e}" for t in ("out", "dq", "dk")
              if f"rel_l2_{t}_vs_native" in r]
        if vs:
            note.append("rel L2 vs native: " + ", ".join(vs))
        peer = r.get("peer", "FlashMLA")  # pair rows measured before the field was written
        if "ratio_median" in r:
            note.append(f"in turns with {peer} {r['peer_fwd_ms']:.2f} ms: ours / {peer} "
                        f"{r['ratio_median']:.3f} (median of {r['pair_reps']} pairs' ratios)")
        if "gpu_ratio_median" in r:
            note.append(f"queue primed, GPU time alone: {r['gpu_fwd_ms']:.2f} / "
                        f"{r['peer_gpu_fwd_ms']:.2f} ms, ours / {peer} {r['gpu_ratio_median']:.3f}"
                        f"{'' if r['primed_ok'] else ' (the host outran the sleep)'}; host "
                        f"{r['host_ms']:.2f} / {r['peer_host_ms']:.2f} ms a call")
        if "rel_l2_vs_flashmla" in r:
            note.append(f"rel L2 vs FlashMLA {r['rel_l2_vs_flashmla']:.1e}")
        if "rel_l2_vs_cta" in r:
            note.append(f"rel L2 vs CTA a query {r['rel_l2_vs_cta']:.1e}")
        if r["name"] == "first_call_shipped" and "fused_s" in r:
            note.append(f"fused call {r['fused_s']:.1f} s, {r.get('compiled')} kernels compiled")
        if status not in ("ok", "oom") and r.get("msg"):
            note.append(r["msg"][:160].replace("|", "/").replace("\n", " "))
        lines.append(f"| {r['name']} | {r['dim']} | {r['width']} | {r['heads']} | {r['seqlen']} "
                     f"| {fb} | {fo} | {mem} | {'; '.join(note)} |")
    rat = ratios(rows)
    if rat:
        lines += ["", "Ours / megatron-core's cuDNN backend, same run (below 1: ours is faster / leaner):", "",
                  "| ours / peer | heads | tokens | time ratio | ms ours / peer | memory ratio | GiB ours / peer "
                  "| beyond output and grads: ratio | GiB ours / peer |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for x in sorted(rat, key=lambda x: (x["ours"], x["heads"], x["seqlen"])):
            beyond = (f"{x['beyond_ratio']:.3f} | {x['ours_beyond_gib']:.2f} / {x['peer_beyond_gib']:.2f}"
                      if "beyond_ratio" in x else " | ")
            lines.append(f"| {x['ours']} / {x['peer']} | {x['heads']} | {x['seqlen']} | "
                         f"{x['time_ratio']:.3f} | {x['ours_ms']:.1f} / {x['peer_ms']:.1f} | "
                         f"{x['mem_ratio']:.3f} | {x['ours_gib']:.2f} / {x['peer_gib']:.2f} | {beyond} |")
    prov = rows[0].get("provenance") if rows else None
    if prov:
        lines += ["", "Run: " + ", ".join(f"{k} {v}" for k, v in prov.items() if k != "notes")]
    lines += [""] + [f"- {n}" for n in notes]
    path.write_text("\n".join(lines) + "\n")


def plot(rows, path):
    try:
        import matplotlib
    except ImportError:
        print(f"{path}: not drawn (no matplotlib here; bench.py --render JSONL draws it elsewhere)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def ok(r):
        timed = "fwd_bwd_ms" in r or "fwd_ms" in r
        return timed and r.get("status", "oom" if r.get("oom") else "ok") == "ok"

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(19, 5))
    names = sorted({r["name"] for r in rows}, key=lambda n: [r["name"] for r in rows].index(n))
    for n in names:
        by_heads = sorted([r for r in rows if r["name"] == n and r["seqlen"] == 32768 and ok(r)
                           and "fwd_bwd_ms" in r], key=lambda r: r["heads"])
        if len(by_heads) > 1:
            c.plot([r["heads"] for r in by_heads], [r["fwd_bwd_ms"] for r in by_heads], marker="o",
                   label=n)
        rs = sorted([r for r in rows if r["name"] == n and r["heads"] == 16 and ok(r)],
                    key=lambda r: r["seqlen"])
        if not rs:
            continue
        xs = [r["seqlen"] for r in rs]
        if "fwd_bwd_ms" in rs[0]:
            a.plot(xs, [r["peak_extra_gib"] for r in rs], marker="o", label=n)
        b.plot(xs, [r.get("fwd_bwd_ms", r.get("fwd_ms")) for r in rs], marker="o",
               linestyle="-" if "fwd_bwd_ms" in rs[0] else "--", label=n + (" (fwd+bwd)" if "fwd_bwd_ms" in rs[0] else ""))
    for ax, title, yl, xl in ((a, "peak extra memory, fwd+bwd (16 heads)", "GiB", "tokens"),
                              (b, "time (16 heads); dashed = forward only", "ms", "tokens"),
                              (c, "fwd+bwd time at 32k tokens by heads", "ms", "query heads")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xl)
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


def render(jsonl, out):
    """The table and plot again from rows already measured (no GPU)."""
    rows = [json.loads(line) for line in pathlib.Path(jsonl).read_text().splitlines() if line.strip()]
    notes = rows[0].get("provenance", {}).get("notes", []) if rows else []
    write_table(rows, notes, out / "h200-bench.md")
    plot(rows, out / "h200-bench.png")


def parse_ab(text):
    """--ab's NAME:FIELD=VALUE[,FIELD=VALUE] as (NAME, {FIELD: VALUE})."""
    name, sep, opts = text.partition(":")
    if not sep or not name or not opts:
        raise argparse.ArgumentTypeError(f"expected NAME:FIELD=VALUE[,FIELD=VALUE], got {text!r}")
    options = {}
    for opt in opts.split(","):
        field, eq, value = opt.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {opt!r} in {text!r}")
        options[field] = ast.literal_eval(value)
    return name, options


def fresh_process_check(rows, args, run=subprocess.run):
    """--fresh-process: each row with grads_sha256 (the deterministic rows) measured once more by a
    new process of this script (a new CUDA context, allocator and kernel load), its dq and dk
    hash compared with this process's: the row gains bitwise_fresh_process. A child that fails
    or gives no hash leaves False."""
    for row in rows:
        if "grads_sha256" not in row:
            continue
        name = row["name"]
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, __file__, "--out", tmp, "--reps", "1",
                   "--configs", f"{row['heads']}:{row['seqlen']}", "--rows", name]
            cmd += ["--score-order"] if args.score_order else []
            cmd += [f"--ab={ab}:" + ",".join(f"{k}={v!r}" for k, v in opts.items())
                    for ab, opts in args.ab if ab == name]
            done = run(cmd, capture_output=True, text=True)
            path = pathlib.Path(tmp) / "h200-bench.jsonl"
            got = [json.loads(line) for line in path.read_text().splitlines()
                   if line.strip()] if done.returncode == 0 and path.exists() else []
        hashes = [r.get("grads_sha256") for r in got if r["name"] == name]
        row["bitwise_fresh_process"] = hashes == [row["grads_sha256"]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pair-reps", type=int, default=20,
                    help="timed pairs of the rows that take two forwards in turns "
                         "(native_fwd_vs_flashmla, native_fwd_vs_cta_beside_gemm)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--configs", nargs="*", help="only these HEADS:TOKENS, e.g. 16:32768")
    ap.add_argument("--rows", nargs="*", help="only these row names, e.g. native_fwd flashmla_fwd")
    ap.add_argument("--score-order", action="store_true",
                    help="shuffle each query's k-pool indices (an indexer's top-k gives them in "
                    "score order; the generator sorts them)")
    ap.add_argument("--ab", action="append", default=[], type=parse_ab,
                    metavar="NAME:FIELD=VALUE[,FIELD=VALUE]",
                    help="also a row NAME: the native route with these NativeKernelOptions fields "
                    "(repeatable), checked against the native route")
    ap.add_argument("--fresh-process", action="store_true",
                    help="the deterministic rows (grads_sha256) once more in a new process: "
                    "bitwise_fresh_process says whether its dq and dk are this process's")
    ap.add_argument("--render", metavar="JSONL", help="only rewrite the table and plot from JSONL")
    ap.add_argument("--kernels", metavar="ARCHIVE",
                    help="the make-kernels archive for first_call_shipped (default: dist/'s one)")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.render:
        render(args.render, out)
        return 0
    prov = provenance()
    rows, notes = run(args)
    if args.fresh_process:
        fresh_process_check(rows, args)
    prov["notes"] = notes
    with open(out / "h200-bench.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(dict(r, provenance=prov)) + "\n")
    render(out / "h200-bench.jsonl", out)
    print("\n".join(notes))
    bad = [r for r in rows if r.get("status") in ("error", "declined")
           or r.get("bitwise_repeat") is False or r.get("bitwise_fresh_process") is False]
    for r in bad:
        why = r.get("msg") if r.get("status") != "ok" else "not bitwise reproducible"
        print(f"{r['name']} {r['heads']} heads {r['seqlen']}: {r['status']}: {why}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
