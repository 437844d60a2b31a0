"""What the kernel tests share: the kernel constants, the tilelang / nvcc skips, and which native
patches the tree must have. A patch that patches/series lists must be in the tree: a test of its
code fails (never skips) when the code is missing, and test_series_features_are_in_the_tree names
the patch. A patch the series does not list (dropped, or a rebase in progress) skips its tests
with that reason."""
import inspect
import os
import shutil
import subprocess
import tempfile

import pytest

from shell import series

from megatron.core.transformer.experimental_attention_variant import dsa_kernels
from megatron.core.transformer.experimental_attention_variant.ops import (
    sparse_mla,
    tilelang_sparse_mla_bwd as bwd_mod,
    tilelang_sparse_mla_fwd as fwd_mod,
    tilelang_utils,
)
from megatron.core.transformer.experimental_attention_variant.ops.tilelang_utils import (
    HAVE_TILELANG,
)

SM90_TARGET = '{"kind": "cuda", "arch": "sm_90"}'
SM90A_TARGET = '{"kind": "cuda", "arch": "sm_90a"}'  # setmaxnreg (warp specialization) needs sm_90a
SM90_MAX_DYN_SMEM = 232448  # 227 KiB, the opt-in per-block maximum on Hopper
SM90_SMEM_PER_SM = 233472  # 228 KiB an SM, of which each resident block also takes 1 KiB
D_V = 512
TAIL = 64
BLOCK_I = 64  # forward index block
BWD_BLOCK = 32  # backward index block
FWD_STAGES = 2

needs_tilelang = pytest.mark.skipif(not HAVE_TILELANG, reason="tilelang is not importable")


def _nvcc():
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    for cand in (shutil.which("nvcc"), os.path.join(cuda_home, "bin", "nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


needs_nvcc = pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (PATH, CUDA_HOME/bin)")


def ptxas_sm90a(src, cubin):
    """TileLang's CUDA `src` compiled for sm_90a with nvcc into the file `cubin`; returns what nvcc
    and ptxas say (-Xptxas -v: registers, spills, shared memory, and performance notes such as
    C7514, which -w leaves in; nvcc's own warnings off). Raises RuntimeError with it when nvcc
    fails. (Shared by the codegen tests and bench/ptxas_report.py.)"""
    from tilelang.env import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    with tempfile.TemporaryDirectory() as tmp:
        cu = os.path.join(tmp, "k.cu")
        with open(cu, "w") as f:
            f.write(src)
        cmd = [_nvcc() or "nvcc", "--cubin", "-std=c++20", "-w", "-O3",
               "-gencode", "arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
               "-I" + TILELANG_TEMPLATE_PATH, "-I" + CUTLASS_INCLUDE_DIR, "-o", cubin, cu]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if out.returncode:
        raise RuntimeError(out.stdout + out.stderr)
    return out.stdout + out.stderr


def round_up(x, m):
    return (x + m - 1) // m * m


def _takes(fn, name):
    import inspect

    fn = getattr(fn, "func", fn)  # tilelang_jit keeps the builder in .func
    return name in inspect.signature(fn).parameters


def _has_arg(jit_fn, name):
    return HAVE_TILELANG and _takes(jit_fn, name)


def _has_forward_arg(name):
    return sparse_mla.SparseMLA is not None and _takes(sparse_mla.SparseMLA.forward, name)


def _has_option(field):
    """Does the tree's NativeKernelOptions have this field?"""
    options = getattr(tilelang_utils, "NativeKernelOptions", None)
    return options is not None and field in options.__dataclass_fields__


# patch number -> (what it adds, is it in the tree)
FEATURES = {
    "0050": ("NativeKernelOptions.schedule", lambda: hasattr(tilelang_utils, "NativeKernelOptions")),
    "0060": ("SparseMLA(save_output=)", lambda: _has_forward_arg("save_output")),
    "0070": ("the warp-specialized native forward",
             lambda: hasattr(fwd_mod, "_get_sparse_mla_fwd_nope_ws_kernel")),
    "0080": ("_index_in_kv", lambda: hasattr(tilelang_utils, "_index_in_kv")),
    "0090": ("MCORE_DSA_CHECK_INDICES", lambda: hasattr(dsa_kernels, "_check_topk_indices")),
    "0100": ("NativeKernelOptions.bwd_max_block_h", lambda: _has_option("bwd_max_block_h")),
    "0105": ("NativeKernelOptions.bwd_dkv_chunks", lambda: _has_option("bwd_dkv_chunks")),
    "0106": ("NativeKernelOptions.bwd_dkv_lines", lambda: _has_option("bwd_dkv_lines")),
    "0107": ("SparseMLA(out_heads=)", lambda: _has_forward_arg("out_heads")),
    "0108": ("the kernels' runtime_scale", lambda: _has_arg(bwd_mod.bwd, "runtime_scale")),
    "0112": ("NativeKernelOptions.fwd_ws64", lambda: _has_option("fwd_ws64")),
    "0113": ("NativeKernelOptions.bwd_ws64", lambda: _has_option("bwd_ws64")),
    "0114": ("NativeKernelOptions.bwd_dkv_two_stages", lambda: _has_option("bwd_dkv_two_stages")),
    "0115": ("NativeKernelOptions.bwd_wg0_dkv_chunks", lambda: _has_option("bwd_wg0_dkv_chunks")),
    "0120": ("NativeKernelOptions.bwd_hoist_indices", lambda: _has_option("bwd_hoist_indices")),
    "0121": ("NativeKernelOptions.bwd_block_phase_ns", lambda: _has_option("bwd_block_phase_ns")),
    "0123": ("native kernels below 16 heads",
             lambda: HAVE_TILELANG and "pad_rows" in inspect.getsource(bwd_mod.bwd.func)),
    "0133": ("NativeKernelOptions.bwd_ws64_row_pairs", lambda: _has_option("bwd_ws64_row_pairs")),
    "0134": ("NativeKernelOptions.bwd_ws64_16_heads", lambda: _has_option("bwd_ws64_16_heads")),
    "0141": ("NativeKernelOptions.bwd_wg0_dkv_chunks defaulting to 1",
             lambda: _has_option("bwd_wg0_dkv_chunks")
             and tilelang_utils.NativeKernelOptions().bwd_wg0_dkv_chunks == 1),
    "0142": ("NativeKernelOptions.bwd_block_phase_queries",
             lambda: _has_option("bwd_block_phase_queries")),
    "0150": ("NativeKernelOptions.bwd_deterministic", lambda: _has_option("bwd_deterministic")),
    "0151": ("NativeKernelOptions.bwd_deterministic_form",
             lambda: _has_option("bwd_deterministic_form")),
    "0152": ("NativeKernelOptions.bwd_deterministic_fine_scales",
             lambda: _has_option("bwd_deterministic_fine_scales")),
    "0153": ("NativeKernelOptions.bwd_ws64_few_heads", lambda: _has_option("bwd_ws64_few_heads")),
    "0154": ("NativeKernelOptions.fwd_ws64_smem_store", lambda: _has_option("fwd_ws64_smem_store")),
    "0160": ("NativeKernelOptions.fwd_ws64_persistent", lambda: _has_option("fwd_ws64_persistent")),
    "0161": ("NativeKernelOptions.fast_exp2", lambda: _has_option("fast_exp2")),
    "0162": ("NativeKernelOptions.fwd_ws64_shared_mask",
             lambda: _has_option("fwd_ws64_shared_mask")),
    "0163": ("NativeKernelOptions.fwd_ws64_dynamic", lambda: _has_option("fwd_ws64_dynamic")),
    "0164": ("NativeKernelOptions.fwd_ws64_stage_out", lambda: _has_option("fwd_ws64_stage_out")),
    "0166": ("NativeKernelOptions.fwd_ws64_counter_reset",
             lambda: _has_option("fwd_ws64_counter_reset")),
}


def bwd_ws64_route_kwargs(sms=132):
    """The keyword arguments the native route gives 0113's builder by default, on a device of
    `sms` SMs, with the series' patches in the tree."""
    kwargs = {"dkv_stages": 2} if has("0114") else {}
    if has("0115"):  # WG0's dKV chunks: two, one since 0141
        kwargs.update(wg0_dkv_chunks=1 if has("0141") else 2)
    if has("0120"):  # hoisted indices, evict_first loads
        kwargs.update(hoist_indices=True, evict_first_loads=True)
    if has("0142"):  # the query's phase, the SMs a phase turn
        kwargs.update(block_phase_ns=0, block_phase_queries=sms)
    elif has("0121"):  # the timer phase
        kwargs.update(block_phase_ns=8000)
    if has("0133"):  # the row-pair adds
        kwargs.update(row_pairs=True)
    if has("0161"):  # exp2 as ex2.approx.ftz
        kwargs.update(fast_exp2=True)
    return kwargs


def fwd_ws64_route_kwargs(sms=132):
    """The keyword arguments the native route gives 0112's builder by default (besides the
    runtime scale), on a device of `sms` SMs, with the series' patches in the tree."""
    kwargs = {"smem_store": True} if has("0154") else {}
    if has("0160"):  # persistent, one CTA an SM
        kwargs.update(ctas=sms)
    for number, arg in (("0161", "fast_exp2"), ("0162", "shared_mask"), ("0163", "dynamic"),
                        ("0164", "stage_out"), ("0166", "counter_reset")):
        if has(number):
            kwargs[arg] = True
    return kwargs


def listed(number):
    return any(name.startswith(number + "-") for name in series())


def has(number):
    """Is patch `number`'s code to be tested: listed in patches/series (then it must be in the
    tree) or present anyway."""
    return listed(number) or FEATURES[number][1]()


def needs(number):
    what = FEATURES[number][0]
    return pytest.mark.skipif(
        not has(number), reason=f"patch {number} ({what}) is not in patches/series or the tree")


def needs_draft(draft, field):
    """Skip unless the wip draft `draft` (its NativeKernelOptions.`field`) is applied to the tree
    (WIP_PATCHES on a GPU, a stacked tree on CPU)."""
    return pytest.mark.skipif(
        not _has_option(field), reason=f"{draft} (NativeKernelOptions.{field}) is not applied")
