"""Run the project's scripts from tests, with environment overrides."""
import hashlib
import os
import pathlib
import stat
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import series as series_py  # noqa: E402  (scripts/series.py: the one series reader)
from pinfile import read_pin  # noqa: E402  (scripts/pinfile.py: the one pin reader)


def script(name, *args, env=None, check=False, cwd=None):
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / name), *map(str, args)],
        env=full_env, cwd=cwd, capture_output=True, text=True,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def tree_digest(root):
    """{relative path: (mode, sha256)} for every file under root."""
    root = pathlib.Path(root)
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and ".pc" not in p.relative_to(root).parts:
            mode = stat.S_IMODE(p.stat().st_mode)
            out[str(p.relative_to(root))] = (oct(mode), hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def series():
    """patches/series in order, as scripts/series.py reads it."""
    return series_py.series(ROOT / "patches")


def pin():
    """pin.env's values, as scripts/pinfile.py (the one reader) gives them."""
    return read_pin()


def submodule_filled():
    return (ROOT / "upstream" / ".git").exists() and subprocess.run(
        ["git", "-C", str(ROOT / "upstream"), "rev-parse", "HEAD"], capture_output=True
    ).returncode == 0


def only_touches_tests(patch):
    """Is the patch tests-only (upstream's tests/, which only the git channel's tree has)? The rule
    is scripts/series.py's."""
    return series_py.tests_only(patch)
