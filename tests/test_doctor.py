"""The doctor (shipped/glm53_doctor.py, in the wheel as megatron.core.glm53_doctor): its fused
call goes through the hook with MCORE_DSA_REQUIRE_FUSED=1 and reports ok / fallback / error, and
its verdict is the last line with the exit code the training image's check relies on. The GPU
itself is stood in for by the kernel-contract reference on CPU; the installed wheel's doctor on
a machine without a GPU is checked in test_wheel.py."""
import pathlib
import sys
import types

import pytest
import torch

from shell import ROOT
from sparse_ref import ReferenceSparseMLA

from megatron.core.transformer.experimental_attention_variant import dsa_kernels
from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa

sys.path.insert(0, str(ROOT / "shipped"))
import glm53_doctor  # noqa: E402


@pytest.fixture
def quiet(monkeypatch):
    monkeypatch.setattr(dsa_kernels, "_ABSORBED_FIRST_CALL_REPORTED", True)
    monkeypatch.delenv("MCORE_DSA_REQUIRE_FUSED", raising=False)


def test_fused_call_ok_through_the_hook(quiet, monkeypatch):
    calls = []

    class Recording(ReferenceSparseMLA):
        @staticmethod
        def apply(q, kv, idx, scale, *save):
            calls.append((tuple(q.shape), tuple(idx.shape)))
            return ReferenceSparseMLA.apply(q, kv, idx, scale)

    monkeypatch.setattr(tilelang_dsa, "SparseMLA", Recording)
    status, text = glm53_doctor.fused_call(heads=16, tokens=64, device="cpu")
    assert status == "ok", text
    assert "16 heads" in text and "top-k 2051" in text
    assert calls == [((1, 64, 16, 512), (1, 64, 1, 2051))]  # the GLM shape, native route
    import os

    assert "MCORE_DSA_REQUIRE_FUSED" not in os.environ  # restored


def test_fused_call_reports_a_decline(quiet, monkeypatch):
    monkeypatch.setattr(tilelang_dsa, "SparseMLA", None)  # kernels unavailable: the hook declines
    status, text = glm53_doctor.fused_call(heads=16, tokens=64, device="cpu")
    assert status == "fallback" and "declined" in text


def test_fused_call_reports_an_error(quiet, monkeypatch):
    class Broken:
        @staticmethod
        def apply(*a):
            raise RuntimeError("nvcc not found")

    monkeypatch.setattr(tilelang_dsa, "SparseMLA", Broken)
    status, text = glm53_doctor.fused_call(heads=16, tokens=64, device="cpu")
    assert status == "error" and "nvcc not found" in text


@pytest.mark.parametrize("status,code,start", [
    ("ok", 0, "verdict: fused path OK ("),
    ("fallback", 1, "verdict: WILL FALL BACK to dense attention: "),
    ("error", 2, "verdict: FUSED CALL FAILS: "),
])
def test_verdict_is_the_last_line_with_its_exit_code(monkeypatch, status, code, start):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Stand-in GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(glm53_doctor, "fused_call", lambda *a, **k: (status, "details"))
    lines = []
    assert glm53_doctor.doctor([], out=lines.append) == code
    assert lines[-1].startswith(start) and "details" in lines[-1]
    assert any(l.startswith("torch ") for l in lines) and any("compute capability 9.0" in l
                                                             for l in lines)


def _manifest(cache, label="glm53nope.99", keys=("a" * 64, "b" * 64), present=1):
    import json

    ns = "0.1.15/linux-x86_64"
    for k in keys[:present]:
        (cache / ns / "kernels" / k).mkdir(parents=True)
    m = dict(label=label, tilelang="0.1.15", target={"kind": "cuda", "arch": "sm_90a"},
             cache_namespace=ns, scales=[512 ** -0.5], kernels=[dict(key=k) for k in keys])
    (cache / f"glm53-kernels-{label}.json").write_text(json.dumps(m))


@pytest.mark.parametrize("target,usable", [
    ('{"arch": "sm_90a", "kind": "cuda"}', True),
    (None, False),
    ('{"kind": "cuda", "arch": "sm_90"}', False),
])
def test_shipped_kernels_line(monkeypatch, tmp_path, target, usable):
    """What the doctor says about the archive `make kernels` builds, unpacked into
    TILELANG_CACHE_DIR: how many of its kernels are there, and what keeps this process from
    finding them (another label or TileLang, TILELANG_DEFAULT_TARGET)."""
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    assert glm53_doctor.shipped_kernels("glm53nope.99").startswith(
        f"shipped kernels: none in TILELANG_CACHE_DIR ({tmp_path}); TileLang compiles")
    _manifest(tmp_path)
    monkeypatch.setattr(glm53_doctor, "_version", lambda *a: "0.1.15")
    if target is None:
        monkeypatch.delenv("TILELANG_DEFAULT_TARGET", raising=False)
    else:
        monkeypatch.setenv("TILELANG_DEFAULT_TARGET", target)
    line = glm53_doctor.shipped_kernels("glm53nope.99")
    assert line.startswith("shipped kernels: 1 of 2 for glm53nope.99 (TileLang 0.1.15, sm_90a,")
    assert ("NOT USABLE" not in line) == usable, line
    assert ("TILELANG_DEFAULT_TARGET is unset" in line) == (target is None)
    other = glm53_doctor.shipped_kernels("glm53nope.100")
    assert "NOT USABLE AS IS: built for glm53nope.99, this build is glm53nope.100" in other
    monkeypatch.setattr(glm53_doctor, "_version", lambda *a: "0.1.16")
    assert "TileLang here is 0.1.16" in glm53_doctor.shipped_kernels("glm53nope.99")


def test_shipped_kernels_line_names_another_sm_count(monkeypatch, tmp_path):
    """Patch 0142 (and 0070's persistent forward): the archive is built for one SM count; on a
    GPU with another the doctor says which kernels miss it; with the same count, or no GPU,
    nothing."""
    import json

    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TILELANG_DEFAULT_TARGET", '{"arch": "sm_90a", "kind": "cuda"}')
    monkeypatch.setattr(glm53_doctor, "_version", lambda *a: "0.1.15")
    _manifest(tmp_path)
    path = tmp_path / "glm53-kernels-glm53nope.99.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), sms=132)))
    for here, said in ((114, True), (132, False), (None, False)):
        line = glm53_doctor.shipped_kernels("glm53nope.99", here)
        assert ("built for 132 SMs, this GPU has 114" in line) == said, line
        assert "NOT USABLE" not in line


def test_usage_without_doctor_subcommand(capsys):
    assert glm53_doctor.main([]) == 2
    assert "usage" in capsys.readouterr().err
