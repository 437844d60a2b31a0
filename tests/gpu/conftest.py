"""GPU tests: they need CUDA and TileLang, and skip with that reason elsewhere (CI has no GPU).
`make test-gpu` runs them against the installed wheel (FROM_INSTALLED=1)."""
import importlib.util

import pytest
import torch


def _missing():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none here; run make test-gpu on a GPU host)"
    if importlib.util.find_spec("tilelang") is None:
        return "needs TileLang (pip install tilelang==0.1.15)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _missing()
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


# tests/gpu has no __init__.py, so pytest puts only this folder on sys.path; the shared helpers
# (sparse_ref) live one level up.
import pathlib  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
