"""The wheel's environment variables: each takes only its documented values (anything else is an
error naming them), each is named literally in the code, and the README's one table lists exactly
the variables the patched code reads. MCORE_DSA_CHECK_INDICES=1 (0090) names the first bad index.
The A/B switches are not environment variables: NativeKernelOptions, which the benchmark sets."""
import pathlib
import re

import pytest
import torch

from native_kernels import needs
from shell import ROOT
from sparse_ref import ReferenceSparseMLA
from test_first_call_log import call, fresh_process  # noqa: F401 (a fixture)

from megatron.core.transformer.experimental_attention_variant import dsa_kernels
from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa

TREE_DIR = pathlib.Path(dsa_kernels.__file__).parent  # the patched experimental_attention_variant


def added_lines():
    """The lines our patches add, from patches/ (what the wheel's own code says)."""
    out = []
    for patch in sorted((ROOT / "patches").glob("*.patch")):
        out += [l[1:] for l in patch.read_text().splitlines() if l.startswith("+") and
                not l.startswith("+++")]
    return out


def readme_table():
    """{variable: row} of the README's environment-variable table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = [l for l in section.splitlines() if l.startswith("| `MCORE_")]
    return {re.match(r"\| `(MCORE_[A-Z0-9_]+)`", r).group(1): r for r in rows}


def test_readme_lists_every_variable_the_patched_code_reads():
    read = set()
    for path in TREE_DIR.rglob("*.py"):
        read |= set(re.findall(r"""["'](MCORE_[A-Z0-9_]+)["']""", path.read_text()))
    table = readme_table()
    assert read == set(table), (sorted(read - set(table)), sorted(set(table) - read))
    for row in table.values():
        assert re.search(r"\| (user|upstream's) ", row), f"row says whose it is: {row}"


def test_our_variables_are_named_literally_and_no_ab_switch_is_one():
    code = "\n".join(added_lines())
    # no name built by concatenation (grep must find every variable)
    assert not re.search(r"""(ENV|_ENV)\s*\+\s*["']_""", code)
    upstreams = {v for v, row in readme_table().items() if "| upstream's " in row}
    ours = set(re.findall(r"""["'](MCORE_[A-Z0-9_]+)["']""", code)) - upstreams
    assert ours == {"MCORE_DSA_REQUIRE_FUSED", "MCORE_DSA_TILELANG_NOPE", "MCORE_DSA_CHECK_INDICES"}


@pytest.mark.parametrize("value", ["false", "true", "yes", "2", "on"])
def test_require_fused_takes_only_0_or_1(fresh_process, monkeypatch, value):
    monkeypatch.setenv("MCORE_DSA_REQUIRE_FUSED", value)
    with pytest.raises(ValueError, match="MCORE_DSA_REQUIRE_FUSED must be 0 or 1"):
        call()


@pytest.mark.parametrize("value", ["Native", "nativ", "576", "off"])
def test_nope_route_takes_only_its_three_values(fresh_process, monkeypatch, value):
    monkeypatch.setenv("MCORE_DSA_TILELANG_NOPE", value)
    with pytest.raises(ValueError, match="must be auto, native or padded"):
        call()


@pytest.mark.parametrize("value", ["", "auto", "native", "padded"])
def test_nope_route_values(fresh_process, monkeypatch, value):
    monkeypatch.setenv("MCORE_DSA_TILELANG_NOPE", value)
    assert call() is not None


@needs("0090")
def test_check_indices_names_the_first_bad_index(fresh_process, monkeypatch):
    monkeypatch.setenv("MCORE_DSA_CHECK_INDICES", "1")
    from test_glm_hook import make_inputs, tilelang_config

    query, key, idx = make_inputs(512, 2051, 16)  # sk = 2088
    assert call() is not None  # valid indices pass
    bad = idx.clone()
    bad[0, 2, 7] = key.size(0)  # one past the last key
    bad[0, 3, 0] = -5
    with pytest.raises(ValueError) as err:
        dsa_kernels.run_fused_absorbed_sparse_attention(
            tilelang_config(16), query.detach(), key.detach(), bad, 0.04, 512)
    text = str(err.value)
    assert "topk_indices[0, 2, 7] = 2088" in text and "[0, 2088)" in text
    assert "MCORE_DSA_CHECK_INDICES" in text
    monkeypatch.setenv("MCORE_DSA_CHECK_INDICES", "0")  # off: the kernels get them as they are
    assert dsa_kernels.run_fused_absorbed_sparse_attention(
        tilelang_config(16), query.detach(), key.detach(), bad, 0.04, 512) is not None
    monkeypatch.setenv("MCORE_DSA_CHECK_INDICES", "yes")
    with pytest.raises(ValueError, match="MCORE_DSA_CHECK_INDICES must be 0 or 1"):
        call()


@needs("0050")
def test_native_kernel_options_are_a_python_api_not_the_environment(monkeypatch):
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_utils as tu

    default = tu.native_kernel_options()
    monkeypatch.setenv("MCORE_DSA_TILELANG_NATIVE_SCHEDULE", "0")  # the old switch: no effect
    assert tu.native_kernel_options() == default and default.schedule
    with tu.override_native_kernel_options(schedule=False) as opts:
        assert opts.schedule is False and tu.native_kernel_options() is opts
    assert tu.native_kernel_options() == default
    with pytest.raises(TypeError):
        with tu.override_native_kernel_options(no_such_option=1):
            pass
    assert tu.native_kernel_options() == default
