"""Patch 0020: the first call of run_fused_absorbed_sparse_attention in a process logs at INFO
whether the fused backend ran or declined; MCORE_DSA_REQUIRE_FUSED=1 makes a decline an error."""
import logging

import pytest
import torch

from sparse_ref import ReferenceSparseMLA

from megatron.core.transformer.experimental_attention_variant import dsa_kernels
from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa
from test_glm_hook import make_inputs, tilelang_config

LOGGER = dsa_kernels.__name__


@pytest.fixture
def fresh_process(monkeypatch):
    """As if this were the process's first call."""
    monkeypatch.setattr(dsa_kernels, "_ABSORBED_FIRST_CALL_REPORTED", False)
    monkeypatch.delenv("MCORE_DSA_REQUIRE_FUSED", raising=False)
    monkeypatch.setattr(tilelang_dsa, "SparseMLA", ReferenceSparseMLA)


def call(width=512, heads=16, dtype=torch.bfloat16):
    query, key, idx = make_inputs(width, 2051, heads)
    return dsa_kernels.run_fused_absorbed_sparse_attention(
        tilelang_config(heads), query.detach().to(dtype), key.detach().to(dtype), idx, 0.04, 512)


def messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]


def test_first_call_logs_fused_once(fresh_process, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert call() is not None
    assert call() is not None
    msgs = messages(caplog)
    assert len(msgs) == 1, msgs
    assert "fused backend tilelang ran" in msgs[0]
    assert "query [4, 1, 16, 512] bfloat16" in msgs[0] and "topk_indices [1, 4, 2051]" in msgs[0]


def test_first_call_logs_decline_with_shapes_and_reason(fresh_process, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert call(dtype=torch.float16) is None
    assert call() is not None  # later calls add nothing
    msgs = messages(caplog)
    assert len(msgs) == 1, msgs
    assert "fused backend tilelang declined" in msgs[0]
    assert "backend returned None" in msgs[0] and "dense fallback" in msgs[0]
    assert "query [4, 1, 16, 512] float16" in msgs[0]
    assert "MCORE_DSA_REQUIRE_FUSED=1" in msgs[0]


def test_strict_mode_raises_on_decline(fresh_process, monkeypatch):
    monkeypatch.setenv("MCORE_DSA_REQUIRE_FUSED", "1")
    with pytest.raises(RuntimeError) as err:
        call(heads=48)
    text = str(err.value)
    assert "declined" in text and "query [4, 1, 48, 512] bfloat16" in text
    assert "backend returned None" in text and "MCORE_DSA_REQUIRE_FUSED" in text
    # every decline, not only the first call's
    with pytest.raises(RuntimeError):
        call(heads=48)


def test_strict_mode_lets_fused_calls_through(fresh_process, monkeypatch):
    monkeypatch.setenv("MCORE_DSA_REQUIRE_FUSED", "1")
    assert call() is not None


def test_strict_mode_off_with_zero(fresh_process, monkeypatch):
    monkeypatch.setenv("MCORE_DSA_REQUIRE_FUSED", "0")
    assert call(heads=48) is None


def test_strict_mode_when_kernel_unavailable(fresh_process, monkeypatch):
    monkeypatch.setattr(tilelang_dsa, "SparseMLA", None)
    monkeypatch.setenv("MCORE_DSA_REQUIRE_FUSED", "1")
    with pytest.raises(RuntimeError, match="not available"):
        call()
