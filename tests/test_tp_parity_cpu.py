"""bench/tp_parity.py's logic on CPU: two gloo processes under torch.distributed.run (TP=2),
megatron's DSAttention on the NoPE layout (q/k 512, k-pool top-k 2051, 64 heads, 32 per rank)
with tests/sparse_ref.ReferenceSparseMLA standing in for the TileLang kernel. Checks TP=2 against
TP=1 and the FP32 reference, that no rank declined under MCORE_DSA_REQUIRE_FUSED=1, that a head
count the kernel cannot tile is reported as a decline, and that the script refuses to run with
NVLink multicast settings changed. The real kernels under NCCL are checked on a GPU host."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "tp_parity.py"
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _gloo_reason():
    if not torch.distributed.is_available():
        return "torch.distributed is not available in this torch build"
    if not torch.distributed.is_gloo_available():
        return "torch.distributed has no gloo backend in this torch build"
    return None


pytestmark = pytest.mark.skipif(_gloo_reason() is not None, reason=str(_gloo_reason()))


def _env(**extra):
    env = dict(os.environ)
    env.update(NVLS_OFF)
    env.pop("MCORE_DSA_TILELANG_NOPE", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def _torchrun(nproc, out, *args, timeout=150):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(SCRIPT), "--cpu", "--out", str(out), *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def test_tp2_matches_tp1_and_no_rank_declines(tmp_path):
    proc = _torchrun(2, tmp_path, "--seq", "256")
    tail = (proc.stdout + proc.stderr)[-4000:]
    report_path = tmp_path / "tp-parity.json"
    assert report_path.is_file(), f"no report (rc {proc.returncode}):\n{tail}"
    report = json.loads(report_path.read_text())
    assert proc.returncode == 0, f"rc {proc.returncode}:\n{tail}"
    assert report["ok"] is True
    assert report["tp"] == 2 and report["world_size"] == 2 and report["mode"] == "dsattention"
    assert report["declined_ranks"] == [] and report["error_ranks"] == []
    assert report["env"]["MCORE_DSA_REQUIRE_FUSED"] == "1"
    assert report["shape"]["topk_width"] == 2051 and report["shape"]["qk_width"] == 512
    assert "tp-parity PASS: TP=2 vs TP=1" in proc.stdout
    for r in report["per_rank"]:
        assert r["heads"] == 32 and r["declined"] is None and r["error"] is None
        # the kernel got this rank's 32 heads in the native NoPE layout: width 512, top-k 2051
        (call,) = r["tp_kernel_calls"]
        assert call["q"] == [1, 256, 32, 512] and call["indices"] == [1, 256, 1, 2051]
        (call1,) = r["tp1_kernel_calls"]
        assert call1["q"] == [1, 256, 64, 512]
        assert set(r["compare"]) == {"out", "dq", "dk", "dw"}
        for name, c in r["compare"].items():
            assert c["finite"], name
            assert c["rel_l2_tpN_vs_tp1"] < 1e-2, (name, c)
            assert c["rel_l2_tpN_vs_fp32"] < 1e-2, (name, c)


def test_a_declining_rank_fails_the_run(tmp_path):
    """48 heads over TP=2 is 24 per rank, which the kernel cannot tile: strict mode raises on
    every rank, the report names them, and the exit status is non-zero."""
    proc = _torchrun(2, tmp_path, "--seq", "64", "--heads", "48")
    report = json.loads((tmp_path / "tp-parity.json").read_text())
    assert proc.returncode != 0
    assert report["ok"] is False and report["declined_ranks"] == [0, 1]
    assert "MCORE_DSA_REQUIRE_FUSED=1 is set" in report["per_rank"][1]["declined"]


@pytest.mark.parametrize("name,value", [("NCCL_NVLS_ENABLE", "1"), ("NCCL_NVLS_ENABLE", None),
                                        ("NVSHMEM_DISABLE_NVLS", "0")])
def test_refuses_with_nvlink_multicast_settings_changed(tmp_path, name, value):
    env = _env()
    if value is None:
        env.pop(name)
    else:
        env[name] = value
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "refusing to run: NVLink multicast must stay off" in proc.stderr
    assert not (tmp_path / "tp-parity.json").exists()
