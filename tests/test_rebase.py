"""make rebase (scripts/rebase.py run) against synthetic megatron-core releases made from the pinned
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

from shell import series_py

ROOT = pathlib.Path(__file__).resolve().parents[1]
P10 = "0010-tilelang-sparse-mla-nope-512-and-unaligned-topk.patch"
P20 = "0020-dsa-log-fused-sparse-attention-decline.patch"
TILELANG = "megatron/core/transformer/experimental_attention_variant/ops/tilelang_dsa.py"
DATE = "2030-01-02"
VENV = pathlib.Path(sys.prefix) if (pathlib.Path(sys.prefix) / "bin" / "python").exists() else ROOT / ".venv"

# make rebase's variables, once (GIT: once) read from the environment by rebase.sh
OLD_ENV = ("DRY_RUN", "SHA256", "GIT_COMMIT", "REBASE_SDIST", "REBASE_DATE")

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


def rebase(repo, version, sdist, dry_run=False, options=(), env=None, upstream=None):
    """scripts/rebase.py run VERSION --sdist SDIST --date DATE [--dry-run] [options] in repo."""
    full_env = dict(os.environ, VENV=str(VENV), CACHE=str(repo.parent / "cache"),
                    UPSTREAM=str(upstream or repo.parent / "no-upstream"),
                    GIT_CEILING_DIRECTORIES=str(repo.parent))
    for var in ("PIN_FILE", "PATCHES", "BUILD", "DIST", *OLD_ENV, "GIT"):
        full_env.pop(var, None)
    full_env.update(env or {})
    cmd = [str(VENV / "bin" / "python"), str(repo / "scripts" / "rebase.py"), "run", version,
           "--sdist", str(sdist), "--date", DATE, *(["--dry-run"] if dry_run else []), *options]
    return subprocess.run(cmd, cwd=repo, env=full_env, capture_output=True, text=True, timeout=300)


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


def synthetic_upstream(tmp_path, release_tree):
    """A git repository with one commit holding a release's tree (what upstream/ would be)."""
    up = tmp_path / "synthetic-upstream"
    shutil.copytree(release_tree, up)
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t", GIT_AUTHOR_DATE="2030-01-01T00:00:00Z",
               GIT_COMMITTER_DATE="2030-01-01T00:00:00Z", GIT_CEILING_DIRECTORIES=str(tmp_path))
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "release"]):
        subprocess.run(["git", "-C", str(up), *cmd], check=True, env=env, capture_output=True)
    head = subprocess.run(["git", "-C", str(up), "rev-parse", "HEAD"], check=True, env=env,
                          capture_output=True, text=True).stdout.strip()
    return up, head


def test_git_in_the_environment_has_no_effect_and_git_commit_pairs_the_channels(pinned_sdist, repo,
                                                                                 tmp_path):
    version, sdist = make_release(pinned_sdist, tmp_path, 94, lambda tree: None)
    up, commit = synthetic_upstream(tmp_path, tmp_path / "src-94" / f"megatron_core-{version}")
    # the synthetic commit has no upstream tests/ for the tests-only patches to patch: none here
    for name in series_py.series(repo / "patches"):
        if series_py.tests_only(repo / "patches" / name):
            series_py.drop(repo / "patches" / "series", name)
            (repo / "patches" / name).unlink()
    before = snapshot(repo)
    # GIT (the old way to name the commit, and many a shell's path to git) is not read: the commit
    # it names is not paired, and a path there is no error
    for git in (commit, "/usr/bin/git"):
        res = rebase(repo, version, sdist, dry_run=True, env={"GIT": git}, upstream=up)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"to:   megatron-core {version} (PyPI sdist only; no git commit known)" in res.stdout
        assert "git channel: unknown (no tag core_v" in res.stdout, res.stdout
    # --git-commit pairs the PyPI version with the commit (checked to give the same tree)
    res = rebase(repo, version, sdist, dry_run=True, options=["--git-commit", commit],
                 env={"GIT": "/usr/bin/git"}, upstream=up)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"to:   megatron-core {version} (git {commit})" in res.stdout, res.stdout
    assert f"git channel: {commit} (given as --git-commit {commit})" in res.stdout
    assert f"+MCORE_GIT_COMMIT={commit}" in res.stdout
    first = res.stdout.splitlines()[0]  # the command: this script's options, make's variables
    assert first.startswith(
        f"# scripts/rebase.py run {version} --dry-run --git-commit {commit} --sdist ")
    assert f"(make rebase TO={version} DRY_RUN=1 GIT_COMMIT={commit} REBASE_SDIST=" in first
    assert snapshot(repo) == before
    # a commit that is not there is an error, not a PyPI-only pin
    res = rebase(repo, version, sdist, dry_run=True, options=["--git-commit", "f" * 40],
                 upstream=up)
    assert res.returncode == 1 and f"--git-commit {'f' * 40}: no such commit" in res.stderr
    assert snapshot(repo) == before


def test_the_old_environment_interface_is_refused_not_ignored(repo, tmp_path):
    """DRY_RUN=1 in the environment without --dry-run would rewrite the pin: refused."""
    before = snapshot(repo)
    for var, value, option in (("DRY_RUN", "1", "--dry-run"), ("SHA256", "ab" * 32, "--sha256"),
                               ("REBASE_SDIST", "x.tar.gz", "--sdist"),
                               ("REBASE_DATE", DATE, "--date")):
        cmd = [str(VENV / "bin" / "python"), str(repo / "scripts" / "rebase.py"), "run", "0.19.99"]
        res = subprocess.run(cmd, cwd=repo, env=dict(os.environ, **{var: value}),
                             capture_output=True, text=True)
        assert res.returncode == 1 and f"{var}={value} is in the environment" in res.stderr
        assert option in res.stderr
    assert snapshot(repo) == before and not (repo / "build").exists()


def test_make_rebase_passes_its_variables_as_options():
    def recipe(*args, env=None):
        full = {k: v for k, v in os.environ.items() if k not in (*OLD_ENV, "MAKEFLAGS")}
        make = ["make", "-n", "--no-print-directory", "-C", str(ROOT), "rebase", *args]
        out = subprocess.run(make, env=dict(full, **(env or {})), capture_output=True, text=True,
                             check=True).stdout
        return " ".join(out[out.index("scripts/rebase.py run"):].replace("\\\n", " ").split())
    assert recipe("TO=0.19.2", "DRY_RUN=1", "GIT_COMMIT=abc", "SHA256=00") == (
        'scripts/rebase.py run "0.19.2" --dry-run=1 --sha256 "00" --git-commit "abc"')
    # GIT_COMMIT comes from the command line only (CI systems export their own); GIT is never read
    assert recipe("TO=main", env={"GIT_COMMIT": "abc", "GIT": "/usr/bin/git"}) == (
        'scripts/rebase.py run "main"')
    assert recipe("TO=main", env={"DRY_RUN": "1"}) == 'scripts/rebase.py run "main" --dry-run=1'
