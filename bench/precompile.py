"""Compile the TileLang SparseMLA kernels that the GPU tests and the benchmark use, in parallel
processes, before they run: TileLang compiles each kernel shape once (~10-15 s) and caches it on
disk, so the later runs load them. Each worker uses its own cache folder (no two processes write
one entry); the folders are merged into TileLang's cache at the end.

  python bench/precompile.py [--heads 16 32 64] [--native-only TOPK ...]
      [--option-set NAME=VALUE[,NAME=VALUE ...] ...]

--native-only: only the native route at these top-k widths (a benchmark's shapes, not the
tests'); --option-set (repeatable): the native route compiled once more with these
NativeKernelOptions fields (a benchmark row's A/B options), besides the defaults."""
import argparse
import ast
import contextlib
import multiprocessing as mp
import os
import pathlib
import shutil
import sys
import tempfile
import time

SCALE = 512 ** -0.5  # the scale the GPU tests and the benchmark use (kernels are keyed by it)
# (kernel heads, q/k width, top-k width, route): 8 heads run as 16. The 576 kernels take top-k
# padded to 64 (65/127 -> 128, 2051 -> 2112); the native 512 kernels round it to 64 (fwd) and 32
# (bwd) themselves, so 64, 65, 127 and 2051 are four shapes there.
PADDED = [(576, 64), (576, 128), (576, 2112), (576, 2048)]
NATIVE = [(512, 64), (512, 65), (512, 127), (512, 2051)]


# the route the worker process started with (spawned workers import this module afresh)
_STARTED_ROUTE = os.environ.get("MCORE_DSA_TILELANG_NOPE")


def set_route(route):
    """MCORE_DSA_TILELANG_NOPE for one job: its route, else the one the process started with
    (a pool process runs several jobs: not the previous job's)."""
    route = route or _STARTED_ROUTE
    if route:
        os.environ["MCORE_DSA_TILELANG_NOPE"] = route
    else:
        os.environ.pop("MCORE_DSA_TILELANG_NOPE", None)


def work(args):
    heads, width, topk, route, options, cache = args
    os.environ["TILELANG_CACHE_DIR"] = cache
    set_route(route)
    import torch

    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa

    t0 = time.perf_counter()
    held = contextlib.nullcontext()
    if options:  # for this job only (a pool process runs several jobs)
        from megatron.core.transformer.experimental_attention_variant.ops import tilelang_utils

        held = tilelang_utils.override_native_kernel_options(**dict(options))
    with held:
        s = 256
        q = torch.randn(s, 1, heads, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(s, 1, 1, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        idx = torch.randint(0, s, (1, s, topk), device="cuda", dtype=torch.int32)
        out = tilelang_dsa.fused_sparse_mla_absorbed(q, k, idx, SCALE, 512)
        assert out is not None, (heads, width, topk)
        out.float().sum().backward()
        torch.cuda.synchronize()
    return (f"heads {heads} width {width} topk {topk} route {route or '-'}"
            f"{' options ' + str(dict(options)) if options else ''}: {time.perf_counter() - t0:.1f} s")


def compile_in_processes(fn, jobs, timeout=None):
    """Run fn(job + (cache_dir,)) for each job in spawned processes, each with its own TileLang
    cache folder (no two processes write one entry), print what fn returns, then merge the
    folders into TileLang's cache. With a timeout (seconds, all jobs together) the jobs still
    running then are reported and killed: a kernel that hangs on the GPU costs that, not the
    whole run. Returns the number of processes and the jobs (as given) that did not finish."""
    given = [tuple(job) for job in jobs]
    if not given:  # nothing to compile (a pool of no processes is an error)
        return 0, []
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="tl-precompile-"))
    jobs = [job + (str(tmp / f"c{i}"),) for i, job in enumerate(given)]
    procs = min(len(jobs), max(1, (os.cpu_count() or 2) - 2))
    deadline = None if timeout is None else time.monotonic() + timeout
    unfinished = []
    with mp.get_context("spawn").Pool(procs) as pool:
        pending = [(job, pool.apply_async(fn, (full,))) for job, full in zip(given, jobs)]
        for job, res in pending:
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                print(res.get(left), flush=True)
            except mp.TimeoutError:
                print(f"job {job}: not finished after {timeout} s (hung?), killed", flush=True)
                unfinished.append(job)
        if unfinished:
            pool.terminate()
    dest = pathlib.Path(os.environ.get("TILELANG_CACHE_DIR", os.path.expanduser("~/.tilelang/cache")))
    dest.mkdir(parents=True, exist_ok=True)
    for c in tmp.iterdir():
        shutil.copytree(c, dest, dirs_exist_ok=True)
    shutil.rmtree(tmp)
    return procs, unfinished


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, nargs="*", default=[16, 32, 64])
    ap.add_argument("--native-only", type=int, nargs="*", metavar="TOPK")
    ap.add_argument("--option-set", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                    help="also compile with these NativeKernelOptions fields (repeatable)")
    args = ap.parse_args()
    option_sets = [()] + [
        tuple((n, ast.literal_eval(v)) for n, _, v in (o.partition("=") for o in opts.split(",")))
        for opts in args.option_set
    ]
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa

    native = getattr(tilelang_dsa, "NOPE_NATIVE_AVAILABLE", False)
    if args.native_only:
        if not native:
            print("error: --native-only without the native route in this tree", file=sys.stderr)
            return 1
        configs = [(512, t, "native") for t in args.native_only]
    else:
        configs = [(w, t, None) for w, t in PADDED] + (
            [(w, t, "native") for w, t in NATIVE] if native else [])
    jobs = [(h, w, t, route, o) for h in args.heads for w, t, route in configs
            for o in option_sets if route or not o]
    t0 = time.perf_counter()
    procs, _ = compile_in_processes(work, jobs)
    print(f"precompiled {len(jobs)} configurations in {time.perf_counter() - t0:.0f} s with {procs} processes")


if __name__ == "__main__":
    sys.exit(main())
