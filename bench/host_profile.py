"""Where the host's time goes in one forward call through the fused hook (a profile, not a
test): the calls run with the GPU kept busy by a sleep queued ahead of them, so that no call
waits on the GPU and what is measured is the host's own work (Python, the hook, TileLang's
adapter, the CUDA runtime calls).

  python bench/host_profile.py --out DIR [--heads 16 64] [--tokens 32768] [--calls 50]

Writes DIR/host-profile.txt: for each head count, the median host ms a call without a profiler;
cProfile's top functions by own time; and torch.profiler's CPU-side operations and CUDA runtime
calls (cudaLaunchKernel, cudaFuncSetAttribute, allocations) with their host time a call.
FlashMLA's forward (sgl-flash-mla, from .whl/) is measured the same way where it is installed.
"""

import argparse
import cProfile
import io
import os
import pathlib
import pstats
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

import bench  # noqa: E402  (the same hook, config and inputs as the benchmark's rows)

SLEEP_CYCLES = 200_000_000  # about 0.1 s of GPU sleep: longer than any batch of calls below


def behind_sleep(run):
    """run() with the GPU kept busy by a sleep queued ahead of it, so that nothing run enqueues
    waits on the GPU; then the queue drained."""
    import torch

    torch.cuda._sleep(SLEEP_CYCLES)
    run()
    torch.cuda.synchronize()


def host_ms(call, calls):
    """Median host ms of `calls` calls, each enqueued behind the GPU's sleep."""
    times = []

    def timed_calls():
        for _ in range(calls):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)

    behind_sleep(timed_calls)
    return statistics.median(times)


def profile(name, call, calls, sink):
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    def batch():
        for _ in range(calls):
            call()

    call()
    torch.cuda.synchronize()
    ms = host_ms(call, calls)
    sink.write(f"\n## {name}: host {ms:.3f} ms a call (median of {calls}, GPU busy ahead)\n")
    pr = cProfile.Profile()
    behind_sleep(lambda: pr.runcall(batch))
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(25)
    sink.write(f"\n### cProfile, {calls} calls, by own time\n\n{text.getvalue()}\n")
    # (the queue drained inside: the profiler sees the kernels too)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        behind_sleep(batch)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    sink.write(f"### torch.profiler, {calls} calls, by self CPU time\n\n{table}\n")
    sink.flush()


def main():
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads", type=int, nargs="*", default=[16, 64])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ[bench.REQUIRE_FUSED_ENV] = "1"
    fm, fm_reason = bench.flash_mla()
    from sparse_ref import kpool_indices

    L = args.tokens
    scale = 512 ** -0.5
    with open(out / "host-profile.txt", "w") as sink:
        sink.write(f"# host profile: {bench.provenance()}\n")
        if fm is None:
            sink.write(f"FlashMLA: not measured ({fm_reason})\n")
        g = torch.Generator(device=bench.DEV).manual_seed(L)
        idx = kpool_indices(L, g, device=bench.DEV).unsqueeze(0)
        for heads in args.heads:
            q = torch.randn(L, 1, heads, 512, generator=g, device=bench.DEV).to(torch.bfloat16)
            k = torch.randn(L, 1, 1, 512, generator=g, device=bench.DEV).to(torch.bfloat16)
            fn = bench.hook_fn(heads, "native")

            def ours():
                with torch.no_grad():
                    fn(q, k, idx, scale)

            profile(f"native forward, {heads} heads, {L} tokens", ours, args.calls, sink)
            if fm is not None:
                f = bench.FlashMLAFwd(fm, heads, idx)
                qp, kv = f.prepare(q, k)

                def peer():
                    with torch.no_grad():
                        f(qp, kv, scale)

                profile(f"FlashMLA forward, {heads} heads, {L} tokens", peer, args.calls, sink)
                del f, qp, kv
            del q, k
    print((out / "host-profile.txt").read_text())


if __name__ == "__main__":
    main()
