"""make rebase (scripts/rebase.sh) against synthetic megatron-core releases made from the pinned
sdist (no upstream/ needed, so this runs in CI): one where patch 0010 has landed (dropped), one
that changes the lines 0010 touches (conflict: nothing changes), one with an unrelated line above
0010's hunks (offset: refreshed). Each rebase runs on a copy of scripts/, pin.env and patches/."""
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
P10 = "0010-tilelang-sparse-mla-nope-512-and-unaligned-topk.patch"
P20 = "0020-dsa-log-fused-sparse-attention-decline.patch"
TILELANG = "megatron/core/transformer/experimental_attention_variant/ops/tilelang_dsa.py"
DATE = "2030-01-02"
VENV = pathlib.Path(sys.prefix) if (pathlib.Path(sys.prefix) / "bin" / "python").exists() else ROOT / ".venv"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pinned_sdist():
    out = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_sdist.sh")], check=True,
                         capture_output=True, text=True).stdout
    return pathlib.Path(out.strip().splitlines()[-1])


def make_release(pinned, dest, patch_level, edit):
    """megatron_core-0.19.<patch_level>.tar.gz in dest: the pinned sdist, version bumped, edit(tree)."""
    version = f"0.19.{patch_level}"
    work = dest / f"src-{patch_level}"
    with tarfile.open(pinned) as tar:
        tar.extractall(work, filter="tar")
    (src,) = work.iterdir()
    tree = work / f"megatron_core-{version}"
    src.rename(tree)
    info = tree / "megatron/core/package_info.py"
    text = info.read_text()
    assert text.count("\nPATCH = 0\n") == 1
    info.write_text(text.replace("\nPATCH = 0\n", f"\nPATCH = {patch_level}\n"))
    edit(tree)
    sdist = dest / f"megatron_core-{version}.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(tree, arcname=tree.name)
    return version, sdist


@pytest.fixture
def repo(tmp_path):
    """A copy of what the rebase reads and rewrites, outside any git repository."""
    r = tmp_path / "repo"
    r.mkdir()
    for name in ("scripts", "patches"):
        shutil.copytree(ROOT / name, r / name)
    shutil.copy(ROOT / "pin.env", r / "pin.env")
    return r


def snapshot(repo):
    files = [repo / "pin.env", *sorted((repo / "patches").iterdir())]
    return {f.name: f.read_bytes() for f in files}


def rebase(repo, version, sdist, dry_run=False):
    env = dict(os.environ, VENV=str(VENV), CACHE=str(repo.parent / "cache"),
               UPSTREAM=str(repo.parent / "no-upstream"), REBASE_SDIST=str(sdist),
               REBASE_DATE=DATE, DRY_RUN="1" if dry_run else "0",
               GIT_CEILING_DIRECTORIES=str(repo.parent))
    for var in ("PIN_FILE", "PATCHES", "BUILD", "DIST"):
        env.pop(var, None)
    return subprocess.run(["bash", str(repo / "scripts" / "rebase.sh"), version], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)


def row(stdout, patch):
    (line,) = [l for l in stdout.splitlines() if l.strip().startswith(patch)]
    return line.strip()[len(patch):].strip()


def pin(repo):
    return dict(re.findall(r"^([A-Z_0-9]+)=(.*)$", (repo / "pin.env").read_text(), re.M))


def header(text, field):
    return re.search(rf"^{field}: (.*)$", text, re.M).group(1)


def diff_part(text):
    return text[text.index("\n--- a/") + 1:]


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pin_of(snap):
    return dict(re.findall(r"^([A-Z_0-9]+)=(.*)$", snap["pin.env"].decode(), re.M))


def test_patch_already_upstream_is_dropped(pinned_sdist, repo, tmp_path):
    def land_0010(tree):
        subprocess.run(["patch", "-s", "-d", str(tree), "-p1", "-F0", "-N", "-i", str(ROOT / "patches" / P10)],
                       check=True)
    version, sdist = make_release(pinned_sdist, tmp_path, 91, land_0010)
    before = snapshot(repo)
    res = rebase(repo, version, sdist)
    assert res.returncode == 0, res.stdout + res.stderr
    assert row(res.stdout, P10).startswith("already in upstream"), res.stdout
    assert row(res.stdout, P20) == "applies cleanly", res.stdout
    assert not (repo / "patches" / P10).exists()
    series = (repo / "patches" / "series").read_text()
    assert P10 not in series and P20 in series
    assert series.splitlines()[:2] == before["series"].decode().splitlines()[:2]  # comments kept
    p = pin(repo)
    assert p["MCORE_VERSION"] == version and p["MCORE_SDIST_SHA256"] == sha256(sdist)
    assert p["MCORE_GIT_COMMIT"] == ""  # only the PyPI channel is known
    assert p["LOCAL_LABEL"] == pin_of(before)["LOCAL_LABEL"]
    new20 = (repo / "patches" / P20).read_text()
    assert header(new20, "Base") == f"megatron-core {version} (PyPI sdist only; no git commit known)"
    assert header(new20, "Last-Update") == DATE
    assert diff_part(new20) == diff_part(before[P20].decode())
    log = (repo / "build" / f"rebase-{version}.log").read_text()
    assert "already in upstream" in log and "applies cleanly" in log
    assert not (repo / "build" / f"rebase-{version}").exists()  # work dir cleaned on success


def test_conflict_changes_nothing_and_keeps_rejects(pinned_sdist, repo, tmp_path):
    def clash(tree):
        f = tree / TILELANG
        text = f.read_text()
        old = "    if topk_indices.size(-1) % 64 != 0:\n"
        assert text.count(old) == 1
        f.write_text(text.replace(old, "    if topk_indices.size(-1) % 128 != 0:\n"))
    version, sdist = make_release(pinned_sdist, tmp_path, 92, clash)
    before = snapshot(repo)
    res = rebase(repo, version, sdist)
    assert res.returncode == 3, res.stdout + res.stderr
    assert row(res.stdout, P10).startswith("conflicts"), res.stdout
    assert row(res.stdout, P20).startswith("applies cleanly [checked without"), res.stdout
    assert "Nothing was changed" in res.stdout and "Next step:" in res.stdout
    assert "quilt --quiltrc ../quiltrc refresh" in res.stdout
    assert snapshot(repo) == before
    rej = repo / "build" / f"rebase-{version}" / "tree" / (TILELANG + ".rej")
    assert rej.is_file() and "% 64 != 0" in rej.read_text()
    assert "conflicts" in (repo / "build" / f"rebase-{version}.log").read_text()


def test_offset_is_refreshed_and_dry_run_changes_nothing(pinned_sdist, repo, tmp_path):
    def shift(tree):
        f = tree / TILELANG
        lines = f.read_text().splitlines(keepends=True)
        lines.insert(1, "# an unrelated line above every hunk of 0010\n")
        f.write_text("".join(lines))
    version, sdist = make_release(pinned_sdist, tmp_path, 93, shift)
    before = snapshot(repo)

    dry = rebase(repo, version, sdist, dry_run=True)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert row(dry.stdout, P10) == "applied only with offset or fuzz (refreshed, diff shown)"
    assert row(dry.stdout, P20) == "applies cleanly"
    assert "-@@ -760,6 +760,12 @@" in dry.stdout and "+@@ -761,6 +761,12 @@" in dry.stdout
    assert "DRY RUN: nothing changed" in dry.stdout
    assert snapshot(repo) == before

    res = rebase(repo, version, sdist)
    assert res.returncode == 0, res.stdout + res.stderr
    assert row(res.stdout, P10) == "applied only with offset or fuzz (refreshed, diff shown)"
    old = before[P10].decode().splitlines()
    new = (repo / "patches" / P10).read_text().splitlines()
    assert len(old) == len(new)
    changed = [(a, b) for a, b in zip(old, new) if a != b]
    # a small diff: the hunk headers moved by one line, and the two header fields
    assert {a.split(":")[0] for a, b in changed if not a.startswith("@@")} == {"Base", "Last-Update"}
    hunks = [(a, b) for a, b in changed if a.startswith("@@")]
    assert len(hunks) == 3
    for a, b in hunks:
        o = [int(n) for n in re.findall(r"[-+](\d+),", a)]
        n = [int(n) for n in re.findall(r"[-+](\d+),", b)]
        assert n == [x + 1 for x in o]
    assert not any(l.startswith(("Index:", "====")) or "\t20" in l for l in new)  # no index/timestamps
    assert pin(repo)["MCORE_VERSION"] == version

    # the rebased series passes the build's strict check (fuzz 0, no offset) on the new pin
    env = dict(os.environ, VENV=str(VENV), CACHE=str(tmp_path / "cache"), SDIST=str(sdist),
               UPSTREAM=str(tmp_path / "no-upstream"), GIT_CEILING_DIRECTORIES=str(tmp_path))
    t = tmp_path / "check" / "tree"
    subprocess.run(["bash", str(repo / "scripts" / "pristine_tree.sh"), str(t)], check=True, env=env,
                   capture_output=True)
    chk = subprocess.run(["bash", str(repo / "scripts" / "apply_patches.sh"), "--check", str(t)], env=env,
                         capture_output=True, text=True)
    assert chk.returncode == 0, chk.stdout + chk.stderr
