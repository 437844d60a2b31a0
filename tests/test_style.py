"""Code inside the patches reads like upstream's: every megatron/ file the series touches passes
megatron-core's own black configuration (the pinned tree's pyproject.toml: black 26, line length
100, skip-magic-trailing-comma, no string normalization), as the pristine files do."""
import re
import subprocess
import sys

from shell import ROOT, series

TREE = ROOT / "build" / "tree"


def touched():
    files = set()
    for name in series():
        text = (ROOT / "patches" / name).read_text()
        files |= set(re.findall(r"^\+\+\+ b/(megatron/\S+\.py)$", text, re.M))
    return sorted(files)


def test_patched_files_pass_megatrons_black():
    files = touched()
    assert files, "the series touches no megatron/ Python file?"
    proc = subprocess.run([sys.executable, "-m", "black", "--config", str(TREE / "pyproject.toml"),
                           "--check", "--diff", "-q", *files], cwd=TREE, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
