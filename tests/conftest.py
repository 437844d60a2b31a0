"""Shared test setup: megatron-core is imported from the patched tree build/tree (made by
scripts/prepare_tree.sh if missing), or from what is installed when FROM_INSTALLED=1
(the GPU tests run against the installed wheel that way)."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "tree"

if os.environ.get("FROM_INSTALLED") != "1":
    if not (TREE / "megatron" / "core").is_dir():
        subprocess.run(["bash", str(ROOT / "scripts" / "prepare_tree.sh")], check=True)
    sys.path.insert(0, str(TREE))
