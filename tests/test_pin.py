"""The pin and its two channels; bad input is refused before anything is unpacked or built."""
import os
import pathlib
import shutil
import subprocess

import pytest

from shell import ROOT, pin, script, submodule_filled, tree_digest

needs_submodule = pytest.mark.skipif(
    not submodule_filled(),
    reason="upstream/ submodule not filled (GitHub unreachable here; README: 'The git channel')",
)


def test_gitlink_is_the_pinned_commit():
    if not pin()["MCORE_GIT_COMMIT"]:
        pytest.skip("PyPI-only pin (MCORE_GIT_COMMIT empty): the gitlink is not part of it")
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-s", "upstream"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "160000", "upstream/ must be a submodule gitlink"
    assert out[1] == pin()["MCORE_GIT_COMMIT"]
    assert "github.com/NVIDIA/Megatron-LM" in (ROOT / ".gitmodules").read_text()


def test_pin_values_are_well_formed():
    import re

    p = pin()
    sdist = bool(p["MCORE_VERSION"]) and re.fullmatch(r"[0-9a-f]{64}", p["MCORE_SDIST_SHA256"])
    git = re.fullmatch(r"[0-9a-f]{40}", p["MCORE_GIT_COMMIT"])
    assert sdist or git, "the pin names neither channel"
    assert bool(p["MCORE_VERSION"]) == bool(p["MCORE_SDIST_SHA256"]), "version and sha256 go together"
    assert not p["MCORE_GIT_COMMIT"] or git
    assert re.fullmatch(r"[a-z][a-z0-9]*\.[0-9]+", p["LOCAL_LABEL"]), p["LOCAL_LABEL"]


@pytest.fixture(scope="module")
def sdist():
    return pathlib.Path(script("fetch_sdist.sh", check=True).stdout.strip())


def test_sdist_matches_pin(sdist):
    import hashlib
    assert hashlib.sha256(sdist.read_bytes()).hexdigest() == pin()["MCORE_SDIST_SHA256"]


def test_corrupt_sdist_refused_before_unpacking(sdist, tmp_path):
    bad = tmp_path / sdist.name
    data = bytearray(sdist.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    dest = tmp_path / "tree"
    proc = script("pristine_tree.sh", dest, env={"CHANNEL": "sdist", "SDIST": str(bad),
                                                  "TMPDIR": str(tmp_path)})
    assert proc.returncode != 0
    assert "does not match the pinned" in proc.stderr and "refusing to unpack" in proc.stderr
    assert not dest.exists()
    assert not list(tmp_path.glob("mcore-pristine.*")), "scratch left behind"


def test_wrong_pinned_hash_refuses_cached_file(sdist, tmp_path):
    """A pin whose sha256 does not match the bytes (here: the cache holds the real file)."""
    pin_file = tmp_path / "pin.env"
    text = (ROOT / "pin.env").read_text().replace(pin()["MCORE_SDIST_SHA256"], "0" * 64)
    pin_file.write_text(text)
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(sdist, cache / sdist.name)
    dest = tmp_path / "tree"
    proc = script("pristine_tree.sh", dest, env={"CHANNEL": "sdist", "PIN_FILE": str(pin_file),
                                                  "CACHE": str(cache)})
    assert proc.returncode != 0 and "does not match the pinned " + "0" * 64 in proc.stderr
    assert not dest.exists()


def test_missing_python312_says_how_to_get_it(tmp_path):
    proc = subprocess.run(["bash", "-c", f'. "{ROOT}/scripts/lib.sh"; find_python312'],
                          env=dict(os.environ, PYTHON312=str(tmp_path / "nope" / "python3.12")),
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "not a working Python 3.12" in proc.stderr
    # nothing on PATH, no pyenv: the message names the ways to get one
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("dirname", "sed", "cut", "sha256sum", "awk", "git"):
        (bindir / tool).symlink_to(shutil.which(tool))
    env = {"PATH": str(bindir), "HOME": str(tmp_path)}
    if pathlib.Path("/usr/bin/python3.12").exists():
        pytest.skip("this machine has /usr/bin/python3.12, which the search always finds")
    proc = subprocess.run([shutil.which("bash"), "-c", f'. "{ROOT}/scripts/lib.sh"; find_python312'],
                          env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "python3.12 not found" in proc.stderr and "pyenv install 3.12" in proc.stderr


def test_missing_quilt_says_how_to_get_it(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("dirname",):
        (bindir / tool).symlink_to(shutil.which(tool))
    proc = subprocess.run([shutil.which("bash"), "-c", f'. "{ROOT}/scripts/lib.sh"; need_quilt'],
                          env={"PATH": str(bindir), "HOME": str(tmp_path)}, capture_output=True, text=True)
    assert proc.returncode != 0 and "apt-get install -y quilt" in proc.stderr


def test_missing_venv_is_a_clear_error(tmp_path):
    proc = script("pristine_tree.sh", tmp_path / "t", env={"VENV": str(tmp_path / "novenv")})
    assert proc.returncode != 0 and "make venv" in proc.stderr


def test_unknown_channel_refused(tmp_path):
    proc = script("pristine_tree.sh", tmp_path / "t", env={"CHANNEL": "svn"})
    assert proc.returncode != 0 and "CHANNEL must be" in proc.stderr


def test_git_channel_without_submodule_is_a_clear_error(tmp_path):
    proc = script("pristine_tree.sh", tmp_path / "t",
                  env={"CHANNEL": "git", "UPSTREAM": str(tmp_path / "empty")})
    assert proc.returncode != 0 and "upstream/ is not filled" in proc.stderr


@needs_submodule
def test_both_channels_give_the_same_tree(tmp_path):
    trees = {}
    for channel in ("git", "sdist"):
        dest = tmp_path / channel
        proc = script("pristine_tree.sh", dest, env={"CHANNEL": channel})
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == channel
        trees[channel] = tree_digest(dest)
    assert trees["git"] == trees["sdist"]


@needs_submodule
def test_dirty_submodule_refused(tmp_path):
    clone = tmp_path / "up"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(ROOT / "upstream"), str(clone)],
                   check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", pin()["MCORE_GIT_COMMIT"]], check=True)
    dest = tmp_path / "t"
    ok = script("pristine_tree.sh", dest, env={"CHANNEL": "git", "UPSTREAM": str(clone)})
    assert ok.returncode == 0, ok.stderr
    shutil.rmtree(dest)
    (clone / "setup.py").write_text("# local edit\n")
    proc = script("pristine_tree.sh", dest, env={"CHANNEL": "git", "UPSTREAM": str(clone)})
    assert proc.returncode != 0 and "has local changes" in proc.stderr and not dest.exists()
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", "HEAD~1"], check=True, capture_output=True)
    proc = script("pristine_tree.sh", dest, env={"CHANNEL": "git", "UPSTREAM": str(clone)})
    assert proc.returncode != 0 and "not the pinned" in proc.stderr and not dest.exists()
