"""Shipped kernels (issue #19): scripts/build_kernels.py (`make kernels`) builds the GLM
SparseMLA kernels for sm_90a on a machine without a GPU into a TileLang cache archive, and a GPU
host's first fused call loads them from it instead of compiling.

What a GPU host does is emulated in fresh processes: torch.cuda says "an H200" (compute capability
9.0), nvcc is not on PATH, and either TileLang detects the target itself (TILELANG_DEFAULT_TARGET
unset; a CUDA folder without nvcc is found, as in a CUDA runtime image) or TILELANG_DEFAULT_TARGET
is set and no CUDA toolkit exists at all. In those processes the wheel's own kernel getters
(_get_*_kernel) are called with what the fused hook passes them; nvcc and TileLang's compile path
are traps. The kernels themselves run only on a GPU: tests/gpu and the README's GPU check.
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

import pytest

from native_kernels import bwd_ws64_route_kwargs, has, needs, needs_nvcc, needs_tilelang
from shell import ROOT, pin

import megatron.core

TREE = pathlib.Path(megatron.core.__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "build_kernels.py"
TARGET_ENV = '{"kind": "cuda", "arch": "sm_90a"}'  # what the README tells a user to set
# 2 small kernels of one JIT function: the delta kernel at 16 and 32 heads
SUBSET = ["--only", "pre", "--heads", "16", "32", "--routes", "native"]
SPARSE_MLA_KINDS = {"fwd", "fwd_ws", "fwd_ws64", "pre", "bwd", "bwd_ws64", "post"}

# How the emulated process starts: before tilelang is imported, hide the CUDA toolkit
# (TileLang looks for it once, at import) and make torch.cuda report an H200.
PREAMBLE = r"""
import os, sys
mode = os.environ.pop("AOT_MODE")
if "no-toolkit" in mode:
    _exists = os.path.exists
    _hidden = ("/usr/local/cuda", "/opt/nvidia")
    os.path.exists = lambda p: not os.fspath(p).startswith(_hidden) and _exists(p)
import torch
if mode != "build":
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.current_device = lambda: 0
import tilelang
if "no-toolkit" in mode:
    os.path.exists = _exists
    assert tilelang.env.CUDA_HOME == "", tilelang.env.CUDA_HOME
sys.path[:0] = [os.environ.pop("AOT_TREE"), os.environ.pop("AOT_SCRIPTS")]
import build_kernels
"""

KEYS = PREAMBLE + r"""
import importlib, json, warnings
warnings.filterwarnings("ignore")
out = []
for c in json.load(open(sys.argv[1])):
    mod = importlib.import_module(build_kernels.OPS + "." + c["module"])
    try:
        out.append(build_kernels.lookup_key(mod, c))
    except Exception as e:
        out.append(f"{type(e).__name__}: {e}")
print("KEYS " + json.dumps(out))
"""

CHECK = PREAMBLE + r"""
sys.exit(1 if build_kernels.check(sys.argv[1]) else 0)
"""

# mode -> TILELANG_DEFAULT_TARGET (None: unset)
GPU_HOSTS = {
    "h200-auto": None,  # TileLang's own detection: sm_90a on compute capability 9.0
    "h200-explicit-no-toolkit": TARGET_ENV,
    "h200-explicit-reordered-no-toolkit": '{"arch":"sm_90a", "kind":"cuda"}',
}


def _path_without_nvcc():
    dirs = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(d for d in dirs if d and not os.access(os.path.join(d, "nvcc"), os.X_OK))


def _run(code, mode, target, cache, tmp, *args):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TILELANG_", "MCORE_DSA_", "CUDA_HOME", "CUDA_PATH"))}
    env.update(AOT_MODE=mode, AOT_TREE=str(TREE), AOT_SCRIPTS=str(ROOT / "scripts"),
               TILELANG_CACHE_DIR=str(cache), PYTHONWARNINGS="ignore")
    if mode != "build":
        env["PATH"] = _path_without_nvcc()
    if mode == "h200-auto":  # a CUDA folder without nvcc (a CUDA runtime image's /usr/local/cuda)
        cuda = tmp / "cuda-runtime-only"
        (cuda / "lib64").mkdir(parents=True, exist_ok=True)
        env["CUDA_HOME"] = str(cuda)
    if target is not None:
        env["TILELANG_DEFAULT_TARGET"] = target
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def glm_plan(tmp_path_factory):
    """The kernel getter calls of the GLM set, as the hook makes them (build_kernels.py --plan)."""
    proc = subprocess.run([sys.executable, "-W", "ignore", str(SCRIPT), "--tree", str(TREE),
                           "--plan"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(proc.stdout)
    return path, json.loads(proc.stdout)


@needs_tilelang
def test_plan_is_the_glm_set(glm_plan):
    """Every (route, query heads) gets its forward, delta, backward and dKV-cast kernel, as the
    wrappers build them: native 512 (top-k 2051 at run time; the warp-specialized forward at 16
    kernel heads, persistent over an H200's 132 SMs, and at 32 without 0112; 0112/0113's 64-row
    kernels at 32 and 64) and #7617's 576 (top-k padded to 2112). 8 query heads: the 576
    route's kernels as at 16 heads (q padded), the native route's built for 8 heads (0123: 16-row
    tiles with the rows past 8 never stored, the backward's 64-row since 0153; before 0123, as at
    16 but for the delta, 0107). (The
    indexer's kernels of the same plan: the next test.)"""
    _, calls = glm_plan
    calls = [c for c in calls if c["kind"] in SPARSE_MLA_KINDS]
    uses = {}
    for c in calls:
        for u in c["used_by"]:
            assert u["topk"] == 2051 and u["scale"] == 512 ** -0.5
            uses.setdefault((u["route"], u["heads"]), []).append(c)
    assert set(uses) == {(r, h) for r in ("native", "padded") for h in (8, 16, 32, 64)}
    for (route, heads), cs in uses.items():
        kinds = sorted(c["kind"] for c in cs)
        rows64 = route == "native" and heads in (32, 64)
        ws64 = rows64 and has("0112")
        ws = route == "native" and has("0070") and heads in (8, 16, 32) and not ws64
        fwd_kind = "fwd_ws64" if ws64 else "fwd_ws" if ws else "fwd"
        # 0134: the native route's 16 heads take the 64-row backward too (the forward stays 0070's);
        # 0153: and fewer (8)
        bwd_rows64 = rows64 or (route == "native" and heads == 16 and has("0134")) or (
            route == "native" and heads < 16 and has("0153"))
        bwd_kind = "bwd_ws64" if bwd_rows64 and has("0113") else "bwd"
        assert kinds == sorted([bwd_kind, "post", "pre", fwd_kind]), (route, heads)
        kernel_heads = max(heads, 16)
        # 0123: the native kernels are built for the caller's heads (16-row tiles below 16)
        built = heads if route == "native" and has("0123") else kernel_heads
        for c in cs:
            a = dict(zip(["heads", "dim", "tail_dim", "topk"], c["args"]), **c["kwargs"])
            if c["kind"] == "fwd_ws":
                assert c["args"][:3] == [built, 512, 2112 if kernel_heads == 16 else 2176]
                assert c["args"][-1] == (132 if kernel_heads == 16 else 0)  # CTAs: the H200's SMs
            elif c["kind"] == "fwd_ws64":  # top-k a whole number of two 64-index blocks
                assert c["args"][:3] == [kernel_heads, 512, 2176] and c["kwargs"]["runtime_scale"]
            elif c["kind"] == "bwd_ws64":
                assert c["args"] == [built, 512, 2080]
                assert c["kwargs"] == bwd_ws64_route_kwargs(sms=132)  # the plan's --sms
            elif c["kind"] == "fwd":
                assert (a["heads"], a["dim"], a["topk"]) == (kernel_heads, 512, 2112)
                assert a["tail_dim"] == (0 if route == "native" else 64)
                assert a["topk_dynamic"] == (route == "native")
            elif c["kind"] == "bwd":
                assert (a["heads"], a["dim"]) == (built, 512)
                want = (0, 2080) if route == "native" else (64, 2112)
                assert (a["tail_dim"], a["topk"]) == want
            elif c["kind"] == "pre":
                # 0107: native with padded heads computes delta on the caller's heads only
                pre_heads = heads if route == "native" and has("0107") else kernel_heads
                assert c["args"] == [pre_heads, 512]
            else:
                assert c["args"] == [512, 0 if route == "native" else 64, 1]
    # 16, 32 and 64 kernel heads x (fwd, pre, bwd) x 2 routes, pre shared, + 2 dKV casts; 0107:
    # + the native route's 8-head delta
    # 0123: + the native route's 8-head forward and backward
    assert len(calls) == (20 if has("0123") else 18 if has("0107") else 17)


@needs_tilelang
@needs("0108")
def test_native_kernels_serve_every_softmax_scale(glm_plan):
    """0108: the native kernels take the softmax scale at each call, so a set built for two
    scales holds each native kernel once (recorded with sm_scale None, as its getter keys it); the
    576 kernels are built per scale."""
    _, calls = glm_plan
    calls = [c for c in calls if c["kind"] in SPARSE_MLA_KINDS]
    proc = subprocess.run([sys.executable, "-W", "ignore", str(SCRIPT), "--tree", str(TREE),
                           "--plan", "--no-indexer", "--scale", str(512 ** -0.5), "0.1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads(proc.stdout)
    assert {c["kind"] for c in two} <= SPARSE_MLA_KINDS  # --no-indexer

    def native(cs):
        return [c for c in cs if all(u["route"] == "native" for u in c["used_by"])]

    def strip(c):
        return {k: v for k, v in c.items() if k != "used_by"}

    assert [strip(c) for c in native(two)] == [strip(c) for c in native(calls)]
    for c in native(two):
        if c["kind"] in ("fwd", "fwd_ws", "fwd_ws64", "bwd", "bwd_ws64"):
            assert {u["scale"] for u in c["used_by"]} == {512 ** -0.5, 0.1}
    # the 576 route's forward and backward at 16, 32 and 64 kernel heads, once more
    assert len(two) == len(calls) + 6


INDEX_HEADS, INDEX_DIM, INDEX_TOPK = 32, 128, 2048  # build_kernels.py's assumed defaults


@needs_tilelang
def test_plan_has_the_indexer_kernels(glm_plan):
    """The DSA indexer's kernels as DSAttention's tilelang hooks ask for them (assumed indexer
    shape: 32 heads, head dim 128, top-k 2048, scoring ReLU on). Without an indexer loss
    (run_fused_qk_topk): the logits kernel and the row-bound mask. With the sparse indexer loss
    (run_fused_qk_topk_with_loss) also the backward at top-k 2048 (next power of two, a multiple of
    32), the loss's attention target per query-head count and softmax scale (the main attention's
    NoPE q/k, width 512: it runs there) and the KL kernel (top-k a multiple of 256)."""
    _, calls = glm_plan
    idx = [c for c in calls if c["kind"] not in SPARSE_MLA_KINDS]
    by_kind = {}
    for c in idx:
        by_kind.setdefault(c["kind"], []).append(c)
        assert c["module"].startswith("tilelang_indexer_")
        for u in c["used_by"]:
            assert (u["index_heads"], u["index_dim"], u["index_topk"], u["use_relu"]) == (
                INDEX_HEADS, INDEX_DIM, INDEX_TOPK, True)
    assert sorted(by_kind) == ["idx_bwd", "idx_clean", "idx_fwd", "idx_kl", "idx_target"]
    loss_uses = [dict(path="indexer_loss", heads=h, scale=512 ** -0.5, index_heads=INDEX_HEADS,
                      index_dim=INDEX_DIM, index_topk=INDEX_TOPK, use_relu=True)
                 for h in (8, 16, 32, 64)]
    plain_use = dict(path="indexer", index_heads=INDEX_HEADS, index_dim=INDEX_DIM,
                     index_topk=INDEX_TOPK, use_relu=True)
    (fwd,), (clean,), (bwd,), (kl,) = (by_kind[k] for k in ("idx_fwd", "idx_clean", "idx_bwd",
                                                             "idx_kl"))
    assert (fwd["getter"], fwd["args"]) == ("_get_indexer_fwd_kernel", [])
    assert fwd["kwargs"] == {"heads": INDEX_HEADS, "index_dim": INDEX_DIM, "use_relu": True}
    assert (clean["getter"], clean["args"], clean["kwargs"]) == ("_get_clean_logits_kernel", [], {})
    for c in (fwd, clean):
        assert c["used_by"] == [plain_use, *loss_uses]
    assert (bwd["getter"], bwd["args"]) == ("_get_indexer_bwd_kernel", [INDEX_HEADS, INDEX_DIM, 2048])
    assert bwd["kwargs"] == {"use_relu": True}
    assert (kl["getter"], kl["args"], kl["kwargs"]) == ("_get_kl_kernel", [INDEX_TOPK], {})
    for c in (bwd, kl):
        assert c["used_by"] == loss_uses
    targets = by_kind["idx_target"]
    assert [(c["getter"], c["args"], c["kwargs"]) for c in targets] == [
        ("_get_target_kernel", [h, 512, INDEX_TOPK, 512 ** -0.5], {}) for h in (8, 16, 32, 64)]
    assert [c["used_by"] for c in targets] == [[u] for u in loss_uses]
    assert len(idx) == 8


@needs_tilelang
def test_indexer_plan_follows_its_parameters():
    """--index-* reach the wrappers, which decide: 64 index heads, head dim 64, ReLU off; top-k
    1000 gives a 1024-wide backward (padded to a power of two), and neither the fused target (top-k
    not a multiple of 64) nor the KL kernel (of 256): the wrappers compute those in PyTorch, so the
    plan has no such kernels."""
    proc = subprocess.run([sys.executable, "-W", "ignore", str(SCRIPT), "--tree", str(TREE),
                           "--plan", "--heads", "16", "--routes", "native", "--index-heads", "64",
                           "--index-dim", "64", "--index-topk", "1000", "--index-no-relu",
                           "--only", "idx_fwd", "idx_clean", "idx_bwd", "idx_target", "idx_kl"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = json.loads(proc.stdout)
    assert [(c["kind"], c["args"], c["kwargs"]) for c in calls] == [
        ("idx_fwd", [], {"heads": 64, "index_dim": 64, "use_relu": False}),
        ("idx_clean", [], {}),
        ("idx_bwd", [64, 64, 1024], {"use_relu": False}),
    ]


@needs_tilelang
def test_gpu_host_computes_the_keys_the_build_stores(glm_plan, tmp_path):
    """For every kernel of the GLM set, the TileLang cache key a GPU host computes at run time
    (target auto-detected on an H200, or TILELANG_DEFAULT_TARGET set, spelled either way, with no
    CUDA toolkit) equals the key the build process stores it under. The TIR is elaborated, the key
    hashed, nothing compiled. Without a toolkit and without TILELANG_DEFAULT_TARGET, TileLang 0.1.15
    resolves no target at all (cuda/target.py: auto-detection requires a CUDA folder): why the
    README says to set it."""
    path, calls = glm_plan
    keys = {}
    for mode, target in [("build", TARGET_ENV), *GPU_HOSTS.items()]:
        proc = _run(KEYS, mode, target, tmp_path / f"cache-{mode}", tmp_path, path)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("KEYS ")]
        assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
        keys[mode] = json.loads(lines[-1][5:])
    assert all(len(k) == 64 for k in keys["build"]), keys["build"]
    assert len(set(keys["build"])) == len(calls)
    for mode in GPU_HOSTS:
        assert keys[mode] == keys["build"], mode
    proc = _run(KEYS, "h200-auto-no-toolkit", None, tmp_path / "cache-none", tmp_path, path)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("KEYS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    for k in json.loads(lines[-1][5:]):
        assert "No registered target detector found an available target" in k, k


def _build(out, subset=SUBSET):
    proc = subprocess.run([sys.executable, "-W", "ignore", str(SCRIPT), "--tree", str(TREE),
                           "--out", str(out), "--jobs", "2", *subset],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tars = sorted(pathlib.Path(out).glob("glm53-kernels-*.tar.xz"))
    assert len(tars) == 1, tars
    return tars[0], proc.stdout


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """The archive of a 2-kernel subset (the delta kernel at 16 and 32 heads: small, and two
    kernels of one JIT function), built by the script as `make kernels` runs it."""
    return _build(tmp_path_factory.mktemp("kernels-a"))


def _members(tar_path):
    with tarfile.open(tar_path) as tar:
        return tar.getmembers(), json.load(tar.extractfile(
            next(m for m in tar.getmembers() if m.name.startswith("glm53-kernels-"))))


@needs_tilelang
@needs_nvcc
def test_archive_names_tilelang_target_and_label(artifact):
    import tilelang

    path, log = artifact
    label = pin()["LOCAL_LABEL"]
    dev = (ROOT / "requirements" / "dev.txt").read_text()
    pinned = next(l.split("==")[1].strip() for l in dev.splitlines() if l.startswith("tilelang=="))
    assert tilelang.__version__ == pinned
    assert path.name == f"glm53-kernels-{label}-tilelang{pinned}-sm90a.tar.xz"
    members, m = _members(path)
    assert m["label"] == label and m["tilelang"] == pinned
    assert m["megatron_core"] == f"{pin()['MCORE_VERSION']}+{label}"
    assert m["target"] == json.loads(TARGET_ENV) and m["execution_backend"] == "tvm_ffi"
    assert m["cache_namespace"] == f"{pinned}/linux-x86_64"
    assert json.loads(m["env"]["TILELANG_DEFAULT_TARGET"]) == json.loads(TARGET_ENV)
    assert [k["args"] for k in m["kernels"]] == [[16, 512], [32, 512]]
    by_name = {x.name: x for x in members}
    assert [x.name for x in members] == sorted(by_name)  # sorted, fixed time and owner
    owners = {(x.mtime, x.uid, x.gid, x.uname, x.gname) for x in members}
    assert owners == {(315532800, 0, 0, "", "")}
    with tarfile.open(path) as tar:
        for k in m["kernels"]:
            entry = f"{m['cache_namespace']}/kernels/{k['key']}"
            for f in ("executable.so", "params.json", "manifest.json", "device_kernel.cu",
                      "host_kernel.cu"):
                assert by_name[f"{entry}/{f}"].isfile(), f
            import hashlib
            so = tar.extractfile(by_name[f"{entry}/executable.so"]).read()
            assert hashlib.sha256(so).hexdigest() == k["executable_sha256"]
            # the second key of the same entry (TileLang's in-process out_idx rewrite): a link
            alias = by_name[f"{m['cache_namespace']}/kernels/{k['alias_key']}"]
            assert alias.issym() and alias.linkname == k["key"]
    assert "6 of 6 kernel loads" in log  # the build checked its own archive


@needs_tilelang
@needs_nvcc
def test_build_is_reproducible(artifact, tmp_path):
    """The subset (delta kernels) builds to the same bytes twice. The forward kernels do not
    (TileLang's lowering names their shared buffers differently each run: README)."""
    again, _ = _build(tmp_path)
    assert again.read_bytes() == artifact[0].read_bytes()


def _unpack(tar_path, dest):
    dest.mkdir()
    with tarfile.open(tar_path) as tar:
        tar.extractall(dest, filter="data")
    return dest


def _listing(root):
    return sorted((str(p.relative_to(root)), p.is_symlink(), p.stat().st_size if p.is_file() else 0)
                  for p in root.rglob("*"))


def _check_on_gpu_host(archive, tmp_path, mode):
    """--check of a 2-kernel archive on an emulated GPU host: every load without a compile and
    nothing written to the cache. Returns --check's stdout."""
    cache = _unpack(archive, tmp_path / "cache")
    before = _listing(cache)
    proc = _run(CHECK, mode, GPU_HOSTS[mode], cache, tmp_path, cache)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "6 of 6 kernel loads (2 kernels, 3 passes)" in proc.stdout
    assert "TileLang begins to compile" not in text
    assert _listing(cache) == before
    return proc.stdout


@needs_tilelang
@needs_nvcc
@pytest.mark.parametrize("mode", sorted(GPU_HOSTS))
def test_gpu_host_loads_the_shipped_kernels_without_compiling(artifact, tmp_path, mode):
    """Unpacked into an otherwise empty TILELANG_CACHE_DIR, each shipped kernel comes back from
    the wheel's own getter as the shipped entry, with nvcc absent and TileLang's compile path a
    trap: as a process's first kernel, and all in one process (the second kernel of a JIT function
    then has TileLang's rewritten out_idx and loads through the alias). Nothing is written."""
    stdout = _check_on_gpu_host(artifact[0], tmp_path, mode)
    lines = [l for l in stdout.splitlines() if l.startswith("[one process]")]
    _, m = _members(artifact[0])
    # the first delta kernel by its own key, the second through the alias
    assert f"loaded from {m['kernels'][0]['key'][:16]}" in lines[0]
    assert f"loaded from {m['kernels'][1]['alias_key'][:16]}" in lines[1]
    lines = [l for l in stdout.splitlines() if l.startswith("[one process, reversed]")]
    assert f"loaded from {m['kernels'][1]['key'][:16]}" in lines[0]
    assert f"loaded from {m['kernels'][0]['alias_key'][:16]}" in lines[1]


@needs_tilelang
@needs_nvcc
def test_a_host_with_another_target_misses(artifact, tmp_path):
    """The check can fail: with TILELANG_DEFAULT_TARGET naming sm_90 (not sm_90a) every lookup
    misses, and the trap stops the compile."""
    cache = _unpack(artifact[0], tmp_path / "cache")
    proc = _run(CHECK, "h200-explicit-no-toolkit", '{"kind": "cuda", "arch": "sm_90"}', cache,
                tmp_path, cache)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "0 of 6 kernel loads" in proc.stdout
    assert proc.stdout.count("MISS (RuntimeError: a kernel was compiled") == 6


@needs_tilelang
@needs_nvcc
def test_the_doctor_reads_the_archive(artifact, tmp_path, monkeypatch):
    """The doctor's shipped-kernels line, from the archive's own manifest (shipped/glm53_doctor.py
    and build_kernels.py agree on its fields)."""
    sys.path.insert(0, str(ROOT / "shipped"))
    import glm53_doctor

    cache = _unpack(artifact[0], tmp_path / "cache")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(cache))
    monkeypatch.setenv("TILELANG_DEFAULT_TARGET", TARGET_ENV)
    label = pin()["LOCAL_LABEL"]
    line = glm53_doctor.shipped_kernels(label)
    assert line == (f"shipped kernels: 2 of 2 for {label} (TileLang 0.1.15, sm_90a, softmax scales "
                    f"[{512 ** -0.5!r}]) in {cache}"), line
    monkeypatch.delenv("TILELANG_DEFAULT_TARGET")
    line = glm53_doctor.shipped_kernels(label)
    assert "NOT USABLE AS IS: TILELANG_DEFAULT_TARGET is unset" in line


# 2 small indexer kernels: the logits row-bound mask and the sparse loss's KL (out_idx=[-2, -1],
# so it has an alias key)
INDEXER_SUBSET = ["--only", "idx_clean", "idx_kl", "--heads", "16", "--routes", "native"]


@pytest.fixture(scope="module")
def indexer_artifact(tmp_path_factory):
    """The archive of 2 indexer kernels, built by the script as `make kernels` runs it."""
    return _build(tmp_path_factory.mktemp("kernels-idx"), INDEXER_SUBSET)


@needs_tilelang
@needs_nvcc
def test_indexer_kernels_compile_for_sm90a(indexer_artifact):
    """Indexer kernels compile for sm_90a here through the same build (no GPU), land in the
    archive with their getter calls and the indexer's shape in the manifest, and the build's own
    check loads them back without a compile."""
    path, log = indexer_artifact
    members, m = _members(path)
    assert m["indexer"] == {"index_heads": [INDEX_HEADS], "index_dim": INDEX_DIM,
                            "index_topk": INDEX_TOPK, "use_relu": True}
    assert [(k["kind"], k["getter"], k["args"]) for k in m["kernels"]] == [
        ("idx_clean", "_get_clean_logits_kernel", []), ("idx_kl", "_get_kl_kernel", [INDEX_TOPK])]
    by_name = {x.name: x for x in members}
    for k in m["kernels"]:
        assert k["module"].endswith(("ops.tilelang_indexer_fwd", "ops.tilelang_indexer_loss"))
        entry = f"{m['cache_namespace']}/kernels/{k['key']}"
        assert by_name[f"{entry}/executable.so"].isfile()
        assert "sm_90a" in json.dumps(m["target_str"])
        if k["alias_key"] != k["key"]:
            alias = by_name[f"{m['cache_namespace']}/kernels/{k['alias_key']}"]
            assert alias.issym() and alias.linkname == k["key"]
    kl = next(k for k in m["kernels"] if k["kind"] == "idx_kl")
    assert kl["alias_key"] != kl["key"]  # out_idx [-2, -1]: TileLang's rewrite gives a 2nd key
    assert "6 of 6 kernel loads" in log


@needs_tilelang
@needs_nvcc
@pytest.mark.parametrize("mode", sorted(GPU_HOSTS))
def test_gpu_host_loads_the_shipped_indexer_kernels(indexer_artifact, tmp_path, mode):
    """--check on a GPU host (emulated as above): the indexer kernels come back from the wheel's
    own getters as the shipped entries, nvcc absent and the compile path a trap, nothing
    written."""
    _check_on_gpu_host(indexer_artifact[0], tmp_path, mode)
