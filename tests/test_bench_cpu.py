"""The benchmark's CPU-side logic: the legacy-FlashMLA adapter that lets megatron's cuDNN backend run
on PyPI's sgl-flash-mla (bench/cudnn_peer.py), and the table of rows with their status and the
ours/peer ratios (bench/bench.py). The timed rows themselves need a GPU (make bench)."""
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import cudnn_peer  # noqa: E402


class FakeFlashMLA(types.SimpleNamespace):
    def __init__(self):
        super().__init__(calls=[])

    def flash_mla_sparse_fwd(self, q, kv, indices, sm_scale, d_v=512, use_legacy=False):
        self.calls.append(dict(indices=indices, sm_scale=sm_scale, d_v=d_v, use_legacy=use_legacy))
        return "out", "max_logits", "lse"


def compacted(rows, width, lengths):
    idx = torch.full((rows, 1, width), -1, dtype=torch.int32)
    for r, n in enumerate(lengths):
        idx[r, 0, :n] = torch.arange(n, dtype=torch.int32)
    return idx, torch.tensor(lengths, dtype=torch.int32)


def test_adapter_calls_the_legacy_kernel_with_megatrons_arguments():
    fm = FakeFlashMLA()
    fwd = cudnn_peer.LegacyFlashMLASparseFwd(fm)
    idx, length = compacted(3, 8, [8, 3, 0])
    sink = torch.full((64,), float("-inf"))
    for _ in range(2):
        assert fwd("q", "kv", idx, 0.125, d_v=512, attn_sink=sink, topk_length=length,
                   indexer_topk=0) == ("out", "max_logits", "lse")
    assert [c["use_legacy"] for c in fm.calls] == [True, True]
    assert fm.calls[0]["indices"] is idx and fm.calls[0]["sm_scale"] == 0.125


@pytest.mark.parametrize("bad", ["sink", "tail", "indexer_topk"])
def test_adapter_refuses_what_the_legacy_kernel_would_compute_differently(bad):
    fm = FakeFlashMLA()
    fwd = cudnn_peer.LegacyFlashMLASparseFwd(fm)
    idx, length = compacted(3, 8, [8, 3, 0])
    sink = torch.full((64,), float("-inf"))
    kw = dict(attn_sink=sink, topk_length=length, indexer_topk=0)
    if bad == "sink":
        kw["attn_sink"] = sink.clone().index_fill_(0, torch.tensor([5]), 0.0)
    elif bad == "tail":
        idx[1, 0, 5] = 7  # a valid-looking index after topk_length: the legacy kernel would use it
    else:
        kw["indexer_topk"] = 2048
    with pytest.raises(NotImplementedError):
        fwd("q", "kv", idx, 0.125, **kw)
    assert fm.calls == []


def row(name, heads, ms, gib, **kw):
    key = "fwd_ms" if name.endswith("_fwd") else "fwd_bwd_ms"
    return dict(name=name, dim=512, width=2051, heads=heads, seqlen=32768, status="ok", oom=False,
                peak_extra_gib=gib, **{key: ms}, **kw)


def test_table_has_ratios_and_says_why_a_row_has_no_number(tmp_path):
    import bench

    rows = [row("native", 16, 90.0, 0.5), row("cudnn", 16, 100.0, 16.0, rel_l2_out_vs_native=2e-3,
                                               rel_l2_dq_vs_native=9e-4, rel_l2_dk_vs_native=7e-4),
            row("native", 64, 210.0, 2.0),
            dict(name="cudnn", dim=512, width=2051, heads=64, seqlen=32768, oom=False,
                 status="declined", msg="RuntimeError: DSA fused ... declined for query [...]"),
            row("native_fwd", 16, 13.0, 0.2), row("cudnn_fwd", 16, 30.0, 8.0),
            dict(name="first_call_cold", dim=512, width=2051, heads=16, seqlen=4096, oom=False,
                 status="ok", first_call_s=41.5, shipped_kernels=False)]
    rat = {(r["ours"], r["heads"]): r for r in bench.ratios(rows)}
    assert set(rat) == {("native", 16), ("native_fwd", 16)}  # no ratio against a declined row
    assert math.isclose(rat["native", 16]["time_ratio"], 0.9)
    assert math.isclose(rat["native", 16]["mem_ratio"], 0.5 / 16.0)
    assert "beyond_ratio" not in rat["native", 16]  # rows without results_gib (older runs)
    path = tmp_path / "t.md"
    bench.write_table(rows, ["a note"], path)
    text = path.read_text()
    assert "| cudnn | 512 | 2051 | 64 | 32768 | declined |" in text
    assert "RuntimeError: DSA fused" in text
    assert "rel L2 vs native: out 2.0e-03, dq 9.0e-04, dk 7.0e-04" in text
    assert "| native / cudnn | 16 | 32768 | 0.900 |" in text
    assert "- a note" in text
    assert "| first_call_cold | 512 | 2051 | 16 | 4096 | first call 41.5 s |  |  |  |" in text


def test_ratio_beyond_the_results_every_path_holds(tmp_path):
    """The output and the input gradients count in every path's peak: the table also gives the
    peak beyond them (the kernels' own workspace), where the paths differ."""
    import bench

    rows = [row("native", 64, 85.8, 4.12, results_gib=4.03),
            row("cudnn", 64, 91.3, 16.89, results_gib=4.03)]
    (x,) = bench.ratios(rows)
    assert math.isclose(x["mem_ratio"], 4.12 / 16.89)
    assert math.isclose(x["ours_beyond_gib"], 0.09) and math.isclose(x["peer_beyond_gib"], 12.86)
    assert math.isclose(x["beyond_ratio"], 0.09 / 12.86)
    path = tmp_path / "t.md"
    bench.write_table(rows, [], path)
    assert "| native / cudnn | 64 | 32768 | 0.940 | 85.8 / 91.3 | 0.244 | 4.12 / 16.89 | 0.007 | 0.09 / 12.86 |" \
        in path.read_text()


@pytest.fixture
def no_cuda_sync(monkeypatch):
    """bench's rows synchronize and empty the CUDA cache around each row: no-ops on CPU."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def test_pair_times_ours_and_the_peer_in_turns(no_cuda_sync, tmp_path):
    """native_fwd_vs_flashmla: each rep times both calls, the order swapped every rep, and the
    ratio is the median of the reps' own ratios (a drift that slows both calls cancels)."""
    import bench

    order, clock = [], {"ours": 10.0, "peer": 10.0}

    def call(who):
        def run():
            order.append(who)
        run.who = who
        return run

    def timer(run):
        run()
        clock[run.who] *= 1.1  # the GPU slows through the run: both calls alike
        return clock[run.who] * (0.9 if run.who == "ours" else 1.0)

    def primed(run):  # (GPU ms, host ms, sleep ms): ours 0.8x the peer's GPU time, more host time
        run()
        return (8.0 if run.who == "ours" else 10.0), (0.3 if run.who == "ours" else 0.1), 10.0

    row = bench.measure_pair("native_fwd_vs_flashmla", 512, 32, 32768, 2051,
                             lambda: (call("ours"), call("peer"), lambda: {"rel_l2_vs_flashmla": 2e-5}),
                             4, timer=timer, primed_timer=primed)
    # one untimed call each first, then ours first on even reps and the peer first on odd ones,
    # on an idle GPU and then with the queue primed
    turns = ["ours", "peer", "peer", "ours", "ours", "peer", "peer", "ours"]
    assert order == ["ours", "peer"] + turns + turns
    assert row["status"] == "ok" and row["pair_reps"] == 4
    assert math.isclose(row["ratio_median"], 0.9)
    assert math.isclose(row["fwd_ms"], 0.9 * 10 * (1.1 ** 2 + 1.1 ** 3) / 2)
    assert math.isclose(row["peer_fwd_ms"], 10 * (1.1 ** 2 + 1.1 ** 3) / 2)
    assert math.isclose(row["fwd_ms_min"], 0.9 * 11.0) and math.isclose(row["peer_fwd_ms_min"], 11.0)
    assert row["rel_l2_vs_flashmla"] == 2e-5
    assert math.isclose(row["gpu_ratio_median"], 0.8) and row["gpu_fwd_ms"] == 8.0
    assert row["peer_gpu_fwd_ms"] == 10.0 and row["host_ms"] == 0.3 and row["peer_host_ms"] == 0.1
    assert row["primed_ok"] is True
    path = tmp_path / "t.md"
    bench.write_table([row], [], path)
    text = path.read_text()
    assert f"| native_fwd_vs_flashmla | 512 | 2051 | 32 | 32768 |  | {row['fwd_ms']:.2f} |" in text
    assert (f"in turns with FlashMLA {row['peer_fwd_ms']:.2f} ms: ours / FlashMLA 0.900 (median of 4 "
            "pairs' ratios); queue primed, GPU time alone: 8.00 / 10.00 ms, ours / FlashMLA 0.800; "
            "host 0.30 / 0.10 ms a call; rel L2 vs FlashMLA 2.0e-05") in text


def test_pair_primed_flags_a_host_that_outran_the_sleep(no_cuda_sync, tmp_path):
    """A call that syncs the host (or a sleep too short) leaves the GPU waiting for the host in
    the primed timing too: the row says so instead of passing it off as the GPU's time."""
    import bench

    def make():
        return (lambda: None), (lambda: None), dict

    primed = iter([(9.0, 0.2, 10.0), (10.0, 0.1, 10.0), (10.0, 0.1, 10.0), (9.5, 12.0, 10.0)])
    row = bench.measure_pair("native_fwd_vs_flashmla", 512, 64, 32768, 2051, make, 2,
                             timer=lambda run: 1.0, primed_timer=lambda run: next(primed))
    assert row["status"] == "ok" and row["primed_ok"] is False
    path = tmp_path / "t.md"
    bench.write_table([row], [], path)
    assert "(the host outran the sleep)" in path.read_text()


def test_pair_names_its_peer_in_the_table(no_cuda_sync, tmp_path):
    """native_fwd_vs_cta_beside_gemm: the same pairing against another form of our own forward; the
    table names that peer, and a row measured before rows named their peer still reads FlashMLA."""
    import bench

    def make():
        return (lambda: None), (lambda: None), lambda: {"rel_l2_vs_cta": 0.0}

    times = iter([9.0, 10.0, 10.0, 9.5, 9.0, 12.0])
    row = bench.measure_pair("native_fwd_vs_cta_beside_gemm", 512, 64, 32768, 2051, make, 3,
                             timer=lambda run: next(times), peer_name="CTA a query",
                             primed_timer=lambda run: (1.0, 0.1, 10.0))
    assert row["peer"] == "CTA a query" and row["rel_l2_vs_cta"] == 0.0
    # reps: (ours 9, peer 10), (peer 10, ours 9.5), (ours 9, peer 12)
    assert math.isclose(row["ratio_median"], 0.9)
    old = dict(row, name="native_fwd_vs_flashmla", rel_l2_vs_flashmla=2e-5)
    del old["peer"], old["rel_l2_vs_cta"]
    path = tmp_path / "t.md"
    bench.write_table([row, old], [], path)
    text = path.read_text()
    assert ("in turns with CTA a query 10.00 ms: ours / CTA a query 0.900 (median of 3 pairs' "
            "ratios); queue primed, GPU time alone: 1.00 / 1.00 ms, ours / CTA a query 1.000; "
            "host 0.10 / 0.10 ms a call; rel L2 vs CTA a query 0.0e+00") in text
    assert "in turns with FlashMLA 10.00 ms: ours / FlashMLA 0.900" in text


def test_pair_that_fails_records_why_and_no_number(no_cuda_sync):
    import bench

    def make():
        def boom():
            raise RuntimeError("FlashMLA: no kernel for this shape")
        return (lambda: None), boom, dict

    row = bench.measure_pair("native_fwd_vs_flashmla", 512, 64, 32768, 2051, make, 3,
                             timer=lambda run: run() or 1.0)
    assert row["status"] == "error" and "no kernel for this shape" in row["msg"]
    assert not [k for k in row if k.endswith(("_ms", "_min", "ratio_median"))]


@pytest.mark.parametrize("exc, status", [(RuntimeError("boom"), "error"),
                                         (RuntimeError("DSA fused hook declined"), "declined"),
                                         (torch.OutOfMemoryError("CUDA out of memory"), "oom")])
def test_a_failed_row_keeps_no_number_taken_before_the_failure(no_cuda_sync, exc, status):
    import bench


    def body(row):
        row.update(first_call_s=1.0, peak_extra_gib=2.0, fwd_ms=3.0, fwd_ms_min=2.9, status="ok")
        raise exc

    row = bench.guarded(dict(name="native_fwd"), body)
    assert row["status"] == status and row["first_call_s"] == 1.0
    assert not {"peak_extra_gib", "fwd_ms", "fwd_ms_min"} & set(row)


def test_render_rewrites_table_and_plot_from_jsonl(tmp_path):
    rows = [row("native", 16, 90.0, 0.5), row("cudnn", 16, 100.0, 16.0),
            dict(name="first_call_cold", dim=512, width=2051, heads=16, seqlen=4096, oom=False,
                 status="ok", first_call_s=41.5)]
    rows = [dict(r, provenance=dict(label="glm53nope.x", notes=["n1"])) for r in rows]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    subprocess.run([sys.executable, str(ROOT / "bench/bench.py"), "--out", str(tmp_path / "o"),
                    "--render", str(src)], check=True)
    md = (tmp_path / "o/h200-bench.md").read_text()
    assert "label glm53nope.x" in md and "- n1" in md
    assert (tmp_path / "o/h200-bench.png").stat().st_size > 10_000


def test_first_call_shipped_unpacks_the_archive_and_hides_nvcc(tmp_path, monkeypatch):
    """first_call_shipped: the `make kernels` archive unpacked into the fresh process's otherwise
    empty TileLang cache, TILELANG_DEFAULT_TARGET its target, no folder with nvcc on PATH; the row
    keeps the doctor's own time of the fused call and how many kernels TileLang still compiled."""
    import io
    import os
    import tarfile

    import bench

    tools = tmp_path / "cuda-bin"
    tools.mkdir()
    (tools / "nvcc").write_text("#!/bin/sh\n")
    (tools / "nvcc").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    manifest = json.dumps(dict(target={"kind": "cuda", "arch": "sm_90a"})).encode()
    archive = tmp_path / "glm53-kernels-x-tilelang0.1.15-sm90a.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        info = tarfile.TarInfo("glm53-kernels-x.json")
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
    seen = {}

    def runner(cmd, env, **kw):
        seen.update(env=env, files=sorted(os.listdir(env["TILELANG_CACHE_DIR"])))
        out = ("setup cuda_s=0.500 tilelang_import_s=1.250 mcore_import_s=0.125\n"
               "ok 3.25 tilelang backend, NoPE route native, 16 heads, 4096 tokens, top-k 2051: "
               "fwd+bwd in 0.8 s, first call (kernel compiles or cache loads included)\n")
        return subprocess.CompletedProcess(cmd, 0, out, "")

    row = bench.first_call_cold(archive, runner=runner)
    assert seen["files"] == ["glm53-kernels-x.json"]
    assert json.loads(seen["env"]["TILELANG_DEFAULT_TARGET"]) == {"kind": "cuda", "arch": "sm_90a"}
    assert str(tools) not in seen["env"]["PATH"].split(os.pathsep)
    assert row["name"] == "first_call_shipped" and row["status"] == "ok"
    assert (row["first_call_s"], row["fused_s"], row["compiled"]) == (3.25, 0.8, 0)
    assert (row["cuda_s"], row["tilelang_import_s"], row["mcore_import_s"]) == (0.5, 1.25, 0.125)
    assert row["shipped_kernels"] is True and row["archive"] == archive.name
    path = tmp_path / "t.md"
    bench.write_table([row], [], path)
    assert "| first_call_shipped | 512 | 2051 | 16 | 4096 | first call 3.2 s |" in path.read_text()
    assert "fused call 0.8 s, 0 kernels compiled" in path.read_text()


def test_precompile_plans_the_native_shapes_with_each_option_set(monkeypatch):
    """precompile.py --native-only / --option-set: the native route only, each head count once
    with the defaults and once per option set (values parsed as Python literals); without them
    every route and shape of the tests."""
    import precompile
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa

    native = getattr(tilelang_dsa, "NOPE_NATIVE_AVAILABLE", False)
    plans = []
    monkeypatch.setattr(precompile, "compile_in_processes",
                        lambda fn, jobs: (plans.append(list(jobs)), (1, []))[1])
    monkeypatch.setattr(sys, "argv", ["precompile.py", "--heads", "16", "64", "--native-only",
                                      "2051", "--option-set", "bwd_block_phase_ns=0,schedule=False"])
    if not native:
        assert precompile.main() == 1  # no native route in this tree: says so, plans nothing
        assert plans == []
        return
    assert precompile.main() is None
    opts = (("bwd_block_phase_ns", 0), ("schedule", False))
    assert plans == [[(16, 512, 2051, "native", ()), (16, 512, 2051, "native", opts),
                      (64, 512, 2051, "native", ()), (64, 512, 2051, "native", opts)]]
    monkeypatch.setattr(sys, "argv", ["precompile.py"])
    precompile.main()
    assert len(plans[1]) == 3 * (len(precompile.PADDED) + len(precompile.NATIVE))
    assert all(job[4] == () for job in plans[1])


def test_ab_rows_parse_name_and_options():
    """bench.py --ab NAME:FIELD=VALUE,...: the row's name and its NativeKernelOptions fields
    (values as Python literals); a malformed one is refused before anything runs."""
    import argparse

    import bench

    assert bench.parse_ab("no_phase:bwd_block_phase_ns=0,bwd_hoist_indices=False") == (
        "no_phase", {"bwd_block_phase_ns": 0, "bwd_hoist_indices": False})
    for bad in ("no_colon", "name:", ":bwd_hoist_indices=False", "name:bwd_hoist_indices"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_ab(bad)


def test_precompile_job_routes_do_not_leak_into_the_next_job(monkeypatch):
    """A pool process runs several precompile jobs: a job without a route gets the route the
    process started with, not the one the job before it set."""
    import precompile

    # set (not deleted) first, so that monkeypatch restores the variable after the test even
    # where it was unset: its delenv records nothing for a variable that is not there
    monkeypatch.setenv("MCORE_DSA_TILELANG_NOPE", "set-by-the-test")
    for started in (None, "padded"):
        monkeypatch.setattr(precompile, "_STARTED_ROUTE", started)
        precompile.set_route("native")
        assert os.environ["MCORE_DSA_TILELANG_NOPE"] == "native"
        precompile.set_route(None)
        assert os.environ.get("MCORE_DSA_TILELANG_NOPE") == started


def test_bwd_variants_build_passes_every_option_a_row_names(monkeypatch):
    """bench/bwd_variants.build() hands the 64-row builder every option of a row's config that the
    builder takes, and refuses one it does not: a row whose option never reaches the builder times
    another kernel than its name says (the _rp rows were built without 0133's row_pairs until
    this was checked)."""
    pytest.importorskip("tilelang")
    import inspect

    import bwd_variants
    from megatron.core.transformer.experimental_attention_variant.ops import (
        tilelang_sparse_mla_bwd as bwd_mod,
    )

    real = bwd_mod.sparse_mla_bwd_ws64
    params = inspect.signature(getattr(real, "func", real)).parameters
    calls = []

    class Recorder:
        func = getattr(real, "func", real)  # what the variants read the signature from

        def __call__(self, *args, **kwargs):
            calls.append((args, kwargs))

    monkeypatch.setattr(bwd_mod, "sparse_mla_bwd_ws64", Recorder())
    monkeypatch.setattr(bwd_variants, "VARIANT_SETS", {"set": "chunks"})
    seen = set()
    for heads in (16, 32, 64):
        for name, cfg in bwd_variants.variants(heads).items():
            if not cfg.get("ws64") or cfg.get("tma_dkv_add"):
                continue
            calls.clear()
            bwd_variants.build(heads, cfg)
            last = cfg
            (args, kwargs), = calls
            assert args[:3] == (heads, 512, cfg["topk"]), name
            for key, value in cfg.items():
                if key in params and key not in bwd_variants.WS64_POSITIONAL:
                    assert kwargs.get(key) == value, (name, key)
                    seen.add(key)
    if "row_pairs" in params:  # 0133's rows
        assert "row_pairs" in seen
    # an option the tree's builder does not take is refused, not dropped
    with pytest.raises(ValueError, match="no_such_option"):
        bwd_variants.build(64, dict(last, no_such_option=True))


def test_fresh_process_check_compares_each_deterministic_row_with_a_new_process(tmp_path):
    """bench.py --fresh-process: each row with grads_sha256 runs again in a child process of the
    script with that row, its shape and its --ab options; bitwise_fresh_process says whether the
    child's hash is the same. A child that fails, or gives another hash, leaves False; rows
    without a hash are left alone."""
    import argparse

    import bench

    rows = [dict(name="native", heads=16, seqlen=32768),
            dict(name="native_deterministic", heads=16, seqlen=32768, grads_sha256="aa"),
            dict(name="det_ab", heads=64, seqlen=4096, grads_sha256="bb"),
            dict(name="native_deterministic", heads=32, seqlen=32768, grads_sha256="cc")]
    args = argparse.Namespace(score_order=True, ab=[("det_ab", {"bwd_deterministic": True})])
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        out = pathlib.Path(cmd[cmd.index("--out") + 1])
        heads = cmd[cmd.index("--configs") + 1].split(":")[0]
        name = cmd[cmd.index("--rows") + 1]
        if heads == "32":  # a child that failed
            return subprocess.CompletedProcess(cmd, 1, "", "boom")
        sha = {"16": "aa", "64": "other"}[heads]
        (out / "h200-bench.jsonl").write_text(json.dumps(dict(name=name, grads_sha256=sha)) + "\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    bench.fresh_process_check(rows, args, run=run)
    assert "bitwise_fresh_process" not in rows[0]
    assert [r.get("bitwise_fresh_process") for r in rows[1:]] == [True, False, False]
    assert len(calls) == 3 and all("--score-order" in c for c in calls)
    assert "--ab=det_ab:bwd_deterministic=True" in calls[1]
    assert not any(c.startswith("--ab") for c in calls[0])


def test_fwd_variants_name_series_options():
    """bench/fwd_variants.py's variants that set a series option are variants, and name the patch
    that adds the option and a value other than its default (a renamed or dropped option fails
    here, not in a GPU call)."""
    import fwd_variants

    series = {p.name[:4]: p.read_text() for p in (ROOT / "patches").glob("0*.patch")}
    for name, sets in fwd_variants.SERIES_OPTIONS.items():
        assert name in fwd_variants.VARIANTS, name
        for field, patch, value in sets:
            assert f"{field}: bool = " in series[patch], (name, field, patch)
            assert f"{field}: bool = {not value}" in series[patch], (name, "not a change", value)


def test_host_profile_writes_a_calls_host_time_and_both_profiles(no_cuda_sync, monkeypatch):
    """bench/host_profile.py (run on a GPU host): its report for one call gives the median host
    ms, cProfile's functions (the call's own among them) and torch.profiler's operations; here on
    CPU with the GPU's sleep stubbed."""
    import io

    import host_profile

    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    x = torch.randn(64, 64)
    ran = []

    def call():
        ran.append(1)
        return x @ x

    sink = io.StringIO()
    host_profile.profile("matmul on the CPU", call, 5, sink)
    text = sink.getvalue()
    assert len(ran) == 1 + 3 * 5  # a warm-up call, then each of the three timings' 5 calls
    ms = float(re.search(r"## matmul on the CPU: host ([0-9.]+) ms a call \(median of 5", text)[1])
    assert 0 < ms < 1000
    assert "### cProfile, 5 calls, by own time" in text and "(call)" in text
    assert "### torch.profiler, 5 calls, by self CPU time" in text and "aten::mm" in text


def test_row_sink_keeps_each_row_as_it_finishes_with_the_runs_provenance(tmp_path, monkeypatch):
    """The variant scripts' rows reach the file one by one (a run cut short by its time limit keeps
    the rows it finished), each with the same provenance; mode "a" adds to an earlier run's file."""
    import bench

    monkeypatch.setattr(bench, "provenance", lambda: dict(label="glm53nope.x"))
    path = tmp_path / "rows.jsonl"
    path.write_text('{"old": 1}\n')
    emit = bench.RowSink(path, "a")
    emit(dict(variant="a", ms=1.0))
    # read before close: the row is already on disk
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"old": 1}, dict(variant="a", ms=1.0, provenance=dict(label="glm53nope.x"))]
    emit(dict(variant="b"))
    emit.close()
    emit = bench.RowSink(path)  # "w": a new run's file
    emit(dict(variant="c"))
    emit.close()
    assert [json.loads(line)["variant"] for line in path.read_text().splitlines()] == ["c"]


def test_bwd_variants_only_names_a_variant_of_the_set_or_stops_with_the_names(monkeypatch, tmp_path, capsys):
    """bench/bwd_variants.py --only with a name the --set has at none of the --heads stops before
    compiling anything, naming the set's variants (it once reached a pool of no processes, whose
    error said nothing of the cause); an empty compile list is no error for the pool helper."""
    import bwd_variants
    import precompile

    monkeypatch.setattr(bwd_variants, "VARIANT_SETS", {})
    monkeypatch.setattr(sys, "argv", ["bwd_variants.py", "--out", str(tmp_path / "o"), "--heads",
                                      "16", "--only", "native_static", "native_ws64_s2_w2"])
    monkeypatch.setattr(bwd_variants, "compile_in_processes",
                        lambda *a, **k: pytest.fail("compiled with a variant that does not exist"))
    with pytest.raises(SystemExit) as exc:
        bwd_variants.main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--only native_ws64_s2_w2: no such variant in --set schedule at heads 16" in err
    assert "native_static" in err.split("there:")[1]
    assert not (tmp_path / "o").exists()
    assert precompile.compile_in_processes(lambda job: pytest.fail("ran a job"), []) == (0, [])


def test_beside_gemm_pairs_time_each_persistent_form_against_a_cta_a_query():
    """Issue #18's guard in turns for every persistent form the beside-GEMM rows take apart: the
    default, two CTAs an SM and (with 0163) the fixed shares at 32/64 heads; the CTA-a-query
    form is the peer, never a pair of its own."""
    import bench

    field = "fwd_ws64_persistent"
    ways = bench.beside_gemm_ways(field, has_dynamic=True)
    assert dict(ways)["native_fwd_cta_beside_gemm"] == {field: False}
    extra = ["native_fwd_2waves_vs_cta_beside_gemm", "native_fwd_fixed_vs_cta_beside_gemm"]
    pairs = bench.beside_gemm_pairs(ways, field, extra)
    assert pairs == [("native_fwd_vs_cta_beside_gemm", {field: True}),
                     ("native_fwd_2waves_vs_cta_beside_gemm", {field: 2}),
                     ("native_fwd_fixed_vs_cta_beside_gemm",
                      {field: True, "fwd_ws64_dynamic": False})]
    assert [n for n, _ in bench.beside_gemm_pairs(bench.beside_gemm_ways(field, False), field,
                                                  extra)] == [
        "native_fwd_vs_cta_beside_gemm", "native_fwd_2waves_vs_cta_beside_gemm"]
    # the other forms' pairs only where --rows names them (a whole run takes the default's alone)
    for rows in (None, [], ["native_fwd_vs_cta_beside_gemm", "native_fwd"]):
        assert bench.beside_gemm_pairs(ways, field, rows) == pairs[:1]
    assert bench.beside_gemm_pairs(ways, field, extra[1:]) == pairs[:1] + pairs[2:]
    # 0166: the filled counter's pair, where the option is in the tree and --rows names it
    fill = ("native_fwd_fill_vs_cta_beside_gemm", {field: True, "fwd_ws64_counter_reset": False})
    ways166 = bench.beside_gemm_ways(field, True, has_counter_reset=True)
    assert bench.beside_gemm_pairs(ways166, field, extra + [fill[0]]) == pairs + [fill]
    assert bench.beside_gemm_pairs(ways166, field, extra) == pairs
    assert bench.beside_gemm_ways(field, False, has_counter_reset=True) == bench.beside_gemm_ways(
        field, False)
    # 16 heads: 0070's persistent form against its CTA a query, nothing else
    assert bench.beside_gemm_pairs(bench.beside_gemm_ways("fwd_ws_persistent", True),
                                   "fwd_ws_persistent", extra) == [
        ("native_fwd_vs_cta_beside_gemm", {"fwd_ws_persistent": True})]
