"""The built wheel: name and version label, manifest, contents equal to the patched tree,
installable into a fresh environment with the patched behaviour in it, and reproducible."""
import hashlib
import os
import pathlib
import re
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


PYTHONS = ("cp312", "cp313")  # megatron-core 0.19.0 on PyPI ships these two


@pytest.fixture(scope="module")
def wheels():
    """{python tag: wheel} from dist/."""
    found = sorted((ROOT / "dist").glob("megatron_core-*.whl"))
    if not found:  # make test builds them first; a bare pytest run builds them here
        script("build_wheel.sh", check=True)
        found = sorted((ROOT / "dist").glob("megatron_core-*.whl"))
    by_tag = {w.name.split("-")[2]: w for w in found}
    assert sorted(by_tag) == list(PYTHONS) and len(found) == len(PYTHONS), found
    return by_tag


@pytest.fixture(scope="module")
def wheel(wheels):
    """The wheel of the Python running the tests (cp312)."""
    return wheels[f"cp{sys.version_info[0]}{sys.version_info[1]}"]


def sha(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def test_wheel_names_carry_pin_label_python_and_manylinux_tag(wheels):
    for py, wheel in wheels.items():
        m = re.fullmatch(rf"megatron_core-{re.escape(VERSION)}-{py}-{py}-(manylinux_2_(\d+)_x86_64)\.whl",
                         wheel.name)
        assert m, wheel.name
        with zipfile.ZipFile(wheel) as z:
            meta = z.read(f"megatron_core-{VERSION}.dist-info/METADATA").decode()
            tags = z.read(f"megatron_core-{VERSION}.dist-info/WHEEL").decode()
        assert f"\nVersion: {VERSION}\n" in meta
        assert f"Tag: {py}-{py}-{m.group(1)}" in tags and "linux_x86_64" not in tags.replace(m.group(1), "")
        # the tag is the one the extension's symbol versions allow, no lower
        shown = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)],
                               capture_output=True, text=True).stdout
        assert f'consistent with the following platform tag: "{m.group(1)}"' in " ".join(shown.split())


def test_the_two_wheels_differ_only_in_the_extension_module(wheels):
    contents = {}
    for py, wheel in wheels.items():
        with zipfile.ZipFile(wheel) as z:
            contents[py] = {n: z.read(n) for n in z.namelist()
                            if not n.endswith(".so") and not n.endswith((".dist-info/WHEEL", ".dist-info/RECORD"))}
            sos = [n for n in z.namelist() if n.endswith(".so")]
        assert len(sos) == 1 and f"cpython-{py[2:]}-x86_64-linux-gnu" in sos[0], sos
    assert contents["cp312"] == contents["cp313"]


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
    """{file name: sha256} of the wheels built in tmp."""
    env = dict(env, BUILD=str(tmp / "build"), DIST=str(tmp / "dist"))
    proc = script("prepare_tree.sh", env=env)
    assert proc.returncode == 0, proc.stderr
    proc = script("build_wheel.sh", env=env)
    assert proc.returncode == 0, proc.stderr
    return {pathlib.Path(l).name: sha(l) for l in proc.stdout.strip().splitlines()}


@pytest.mark.slow
def test_rebuild_elsewhere_gives_the_same_bytes(wheels, tmp_path):
    again = _build_in(tmp_path, {})
    assert again == {w.name: sha(w) for w in wheels.values()}, "two builds from the same pin differ"


@pytest.mark.slow
@pytest.mark.skipif(not submodule_filled(), reason="upstream/ submodule not filled (GitHub unreachable; see README)")
def test_both_channels_give_the_same_wheel(tmp_path):
    shas = {ch: _build_in(tmp_path / ch, {"CHANNEL": ch}) for ch in ("git", "sdist")}
    assert shas["git"] == shas["sdist"]


def test_cp313_wheel_installs_into_a_fresh_python_313(wheels, tmp_path):
    """No torch for 3.13 here: the cp313 wheel installs with its metadata and manifest, and its own
    extension module (the part that differs from cp312) loads and works."""
    base = subprocess.run([str(ROOT / ".venv313" / "bin" / "python"), "-c",
                           "import sys; print(sys._base_executable)"],
                          capture_output=True, text=True, check=True).stdout.strip()
    env_dir = tmp_path / "fresh313"
    subprocess.run([base, "-m", "venv", str(env_dir)], check=True)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--disable-pip-version-check", str(wheels["cp313"])], check=True)
    check = r"""
import importlib.machinery, importlib.metadata, json, pathlib, runpy, sys, sysconfig
site = pathlib.Path(sysconfig.get_paths()["purelib"])
so = next((site / "megatron/core/datasets").glob("helpers_cpp*.so"))
spec = importlib.util.spec_from_file_location("helpers_cpp", so)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
manifest = runpy.run_path(str(site / "megatron/core/glm53_patches.py"))
print(json.dumps(dict(version=importlib.metadata.version("megatron-core"), so=so.name,
    label=manifest["LOCAL_LABEL"], patches=[n for n, _ in manifest["PATCHES"]],
    functions=sorted(n for n in dir(mod) if not n.startswith("_"))[:3])))
"""
    proc = subprocess.run([str(py), "-c", "import importlib.util\n" + check], cwd=tmp_path,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["version"] == VERSION and info["label"] == P["LOCAL_LABEL"]
    assert info["patches"] == IN_WHEEL and "cpython-313" in info["so"] and info["functions"]
