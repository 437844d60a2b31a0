"""The built wheel: name and version label, manifest, contents equal to the patched tree,
installable into a fresh environment with the patched behaviour in it, and reproducible."""
import hashlib
import os
import pathlib
import subprocess
import sys
import sysconfig
import zipfile

import pytest

import runpy

from shell import ROOT, only_touches_tests, pin, script, series, submodule_filled

TREE = ROOT / "build" / "tree"
P = pin()
os.environ.setdefault("NO_VCS_VERSION", "1")
BASE = runpy.run_path(str(TREE / "megatron" / "core" / "package_info.py"))["__version__"]
VERSION = f"{BASE}+{P['LOCAL_LABEL']}"
# the wheel's tree has no upstream tests/, so tests-only patches are not applied to it
IN_WHEEL = [n for n in series() if not only_touches_tests(ROOT / "patches" / n)]
STAMPED = {"megatron/core/package_info.py", "megatron/core/glm53_patches.py"}
# this project's own modules, added to the wheel from shipped/
SHIPPED = {f"megatron/core/{p.name}": p for p in (ROOT / "shipped").glob("*.py")}


@pytest.fixture(scope="module")
def wheel():
    found = sorted((ROOT / "dist").glob("megatron_core-*.whl"))
    if not found:  # make test builds it first; a bare pytest run builds it here
        script("build_wheel.sh", check=True)
        found = sorted((ROOT / "dist").glob("megatron_core-*.whl"))
    assert len(found) == 1, found
    return found[0]


def sha(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def test_wheel_name_carries_pin_and_label(wheel):
    assert wheel.name == f"megatron_core-{VERSION}-cp312-cp312-linux_x86_64.whl"
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(f"megatron_core-{VERSION}.dist-info/METADATA").decode()
    assert f"\nVersion: {VERSION}\n" in meta


def test_manifest_lists_applied_patches(wheel):
    with zipfile.ZipFile(wheel) as z:
        ns = {}
        exec(z.read("megatron/core/glm53_patches.py").decode(), ns)
    assert ns["LOCAL_LABEL"] == P["LOCAL_LABEL"] and ns["BASE_VERSION"] == BASE
    assert P.get("MCORE_VERSION") in ("", BASE)
    assert [n for n, _ in ns["PATCHES"]] == IN_WHEEL
    for name, digest in ns["PATCHES"]:
        assert digest == sha(ROOT / "patches" / name)


def test_wheel_modules_equal_the_patched_tree(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith("megatron/") and not n.endswith("/")]
        for n in names:
            if n in STAMPED or n.endswith(".so"):
                continue
            want = SHIPPED[n] if n in SHIPPED else TREE / n
            assert z.read(n) == want.read_bytes(), f"{n} differs from {want}"
        shipped = set(names)
    tree_py = {str(p.relative_to(TREE)) for p in (TREE / "megatron" / "core").rglob("*.py")}
    assert tree_py <= shipped, sorted(tree_py - shipped)[:5]
    assert any(n.startswith("megatron/core/datasets/helpers_cpp") and n.endswith(".so") for n in names)


FRESH_CHECK = r'''
import importlib.metadata, json, sys, torch
import megatron.core as mc
from megatron.core import glm53_patches
from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa
seen = []
class Fake:
    @staticmethod
    def apply(q, kv, idx, scale, *save_output):
        seen.append((tuple(q.shape), tuple(kv.shape), tuple(idx.shape)))
        return torch.zeros(q.shape[:-1] + (512,), dtype=q.dtype), None
tilelang_dsa.SparseMLA = Fake
q = torch.zeros(8, 1, 32, 512, dtype=torch.bfloat16)
k = torch.zeros(2100, 1, 1, 512, dtype=torch.bfloat16)
idx = torch.full((1, 8, 2051), -1, dtype=torch.int32)
out = tilelang_dsa.run_fused_absorbed_sparse_attention(q, k, idx, 0.04, 512)
print(json.dumps(dict(version=mc.__version__, dist=importlib.metadata.version("megatron-core"),
    file=mc.__file__, patches=[n for n, _ in glm53_patches.PATCHES],
    out=None if out is None else list(out.shape), seen=seen)))
'''


def test_wheel_installs_into_fresh_env_with_patched_behaviour(wheel, tmp_path):
    env_dir = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    py = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet",
                    "--no-deps", "--no-index", "--disable-pip-version-check", str(wheel)], check=True)
    # torch and numpy from the dev environment (megatron-core itself only from the wheel)
    fresh_site = pathlib.Path(subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())
    (fresh_site / "_dev_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    proc = subprocess.run([str(py), "-W", "ignore", "-c", FRESH_CHECK], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["version"] == VERSION and info["dist"] == VERSION
    assert info["file"].startswith(str(fresh_site)), info["file"]
    assert info["patches"] == IN_WHEEL
    # the patched hook: at 32 heads 512-wide q/k and 2051 indices reach the native kernels as is
    assert info["out"] == [8, 1, 32, 512]
    assert info["seen"] == [[[1, 8, 32, 512], [1, 2100, 1, 512], [1, 8, 1, 2051]]]
    # the doctor, from the installed wheel: no GPU here, so it says the fused path cannot run,
    # in its last line, and exits non-zero without a traceback
    proc = subprocess.run([str(py), "-W", "ignore", "-m", "megatron.core.glm53_patches", "doctor"],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert lines[-1].startswith("verdict: WILL FALL BACK to dense attention: no CUDA GPU"), lines
    assert lines[0] == f"megatron-core {VERSION} (patch label {P['LOCAL_LABEL']})", lines
    assert any(l.startswith("patches (") for l in lines) and any(l.startswith("GPU none") for l in lines)


def _build_in(tmp, env):
    env = dict(env, BUILD=str(tmp / "build"), DIST=str(tmp / "dist"))
    proc = script("prepare_tree.sh", env=env)
    assert proc.returncode == 0, proc.stderr
    proc = script("build_wheel.sh", env=env)
    assert proc.returncode == 0, proc.stderr
    return pathlib.Path(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_rebuild_elsewhere_gives_the_same_bytes(wheel, tmp_path):
    again = _build_in(tmp_path, {})
    assert again.name == wheel.name
    assert sha(again) == sha(wheel), "two builds from the same pin differ"


@pytest.mark.slow
@pytest.mark.skipif(not submodule_filled(), reason="upstream/ submodule not filled (GitHub unreachable; see README)")
def test_both_channels_give_the_same_wheel(tmp_path):
    shas = {ch: sha(_build_in(tmp_path / ch, {"CHANNEL": ch})) for ch in ("git", "sdist")}
    assert shas["git"] == shas["sdist"]
