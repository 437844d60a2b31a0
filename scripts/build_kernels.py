"""Build the GLM-5.3-Flash SparseMLA and DSA indexer kernels ahead of time, on a machine without a
GPU, as a TileLang kernel-cache directory packed into
dist/glm53-kernels-<label>-tilelang<ver>-sm90a.tar.xz.

  python scripts/build_kernels.py [--heads 16 32 64] [--routes native padded] [--topk 2051]
                                  [--scale S ...] [--sms 132] [--jobs N] [--only KIND ...]
                                  [--index-heads 32 ...] [--index-dim 128] [--index-topk 2048]
                                  [--index-no-relu] [--no-indexer]
  python scripts/build_kernels.py --plan              # the kernels it would build, as JSON
  python scripts/build_kernels.py --check CACHE_DIR   # every kernel of CACHE_DIR's manifest loads
                                                      # from the cache without a compile

Which kernels: the fused hook's own wrappers decide. For each route (native: q/k width 512;
padded: #7617's zero-pad to 576, megatron's own layout), each query-head count and each softmax
scale, one fused forward+backward runs through dsa_kernels.run_fused_absorbed_sparse_attention on
CPU with the kernel getters (_get_*_kernel of ops/tilelang_sparse_mla_{fwd,bwd}.py) replaced by
recorders: what the getters receive there is what they receive on the GPU (the wrappers' own
bucketing, head blocks, schedule and NativeKernelOptions defaults), except the GPU's SM count,
which sets the persistent 16-head forward's CTA count and the 64-row backward's key-block phase
(patch 0142) (--sms, 132 on an H200). The DSA indexer the
same way: for each index head count, dsa_kernels.run_fused_qk_topk (DSAttention without an indexer
loss) and, for each query-head count and scale, run_fused_qk_topk_with_loss (the sparse indexer
loss) and its backward, on CPU with the getters of ops/tilelang_indexer_{fwd,bwd,loss}.py
recording; the wrappers' "fused target/KL kernel fits these tensors" predicates see the tensors
as CUDA tensors (their other conditions decide, as on the GPU). Each distinct getter
call is then made for real in its own process, with TILELANG_DEFAULT_TARGET set to sm_90a and its
own TILELANG_CACHE_DIR: TileLang lowers the kernel, nvcc compiles it, and TileLang stores the
entry under the key it will compute again at run time.

The key (tilelang/cache/kernel_cache.py, KernelCache._generate_key) hashes the kernel's TIR
script, out_idx, the resolved target (str of the tvm Target), the host target, the execution
backend, the pass configs, the compile flags, the TileLang version and the machine (x86_64). A
GPU host computes the same key when its target resolves to {"kind": "cuda", "arch": "sm_90a"}:
TILELANG_DEFAULT_TARGET set to that, or TileLang's auto-detection on an H100/H200 (which needs a
CUDA toolkit directory to be found, see README "Shipped kernels"). The entry holds
executable.so (the host wrapper with the cubin embedded), params.json, the CUDA source and a
manifest of hashes; loading it needs the CUDA driver only, no nvcc.

Reproducible where TileLang is: nvcc writes its input file's path and modification time into the
cubin's line table (-lineinfo), so each compile here runs in a directory named after the source's
hash with the source's mtime fixed, and the tar has sorted members, fixed mtimes and owners. The
backward, delta and dKV-cast kernels then come out byte for byte the same on one machine. The
forward kernels do not: TileLang 0.1.15's lowering names and shares their shared-memory buffers
(AllReduce workspaces, KV halves) differently from run to run, also with PYTHONHASHSEED fixed, so
their CUDA source and binary differ between builds (their key does not: it hashes the TIR).
"""
import argparse
import contextlib
import hashlib
import io
import json
import multiprocessing as mp
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import types

from pinfile import read_pin  # scripts/pinfile.py: the one pin reader

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET = {"kind": "cuda", "arch": "sm_90a"}
TARGET_ENV = json.dumps(TARGET)  # TILELANG_DEFAULT_TARGET's value
ARCH_TAG = "sm90a"
EPOCH = 315532800  # 1980-01-01, as the wheel build's SOURCE_DATE_EPOCH
GLM_TOPK = 2051
GLM_SCALE = 512 ** -0.5  # the doctor's and the benchmark's scale
H200_SMS = 132
INDEXER_BLOCK = 8192  # DSAttention's fused_indexer_block_size default (query rows a call)
# The DSA indexer's shape (MLATransformerConfig dsa_indexer_n_heads, dsa_indexer_head_dim,
# dsa_indexer_topk). GLM-5.3-Flash's values are not known here: these are ASSUMPTIONS in the style
# of GLM-5 (32 index heads) and DeepSeek-V3.2 (64), both with head dim 128 and top-k 2048.
INDEX_HEADS = 32
INDEX_DIM = 128
INDEX_TOPK = 2048
MANIFEST_PREFIX = "glm53-kernels-"
OPS = "megatron.core.transformer.experimental_attention_variant.ops"
# getter (module, name) -> short kind
GETTERS = {
    ("tilelang_sparse_mla_fwd", "_get_sparse_mla_fwd_kernel"): "fwd",
    ("tilelang_sparse_mla_fwd", "_get_sparse_mla_fwd_nope_ws_kernel"): "fwd_ws",
    ("tilelang_sparse_mla_fwd", "_get_sparse_mla_fwd_nope_ws64_kernel"): "fwd_ws64",
    ("tilelang_sparse_mla_bwd", "_get_preprocess_kernel"): "pre",
    ("tilelang_sparse_mla_bwd", "_get_bwd_kernel"): "bwd",
    ("tilelang_sparse_mla_bwd", "_get_bwd_ws64_kernel"): "bwd_ws64",
    ("tilelang_sparse_mla_bwd", "_get_postprocess_kernel"): "post",
    # the DSA indexer (run_fused_qk_topk[_with_loss]): logits, their row-bound mask, backward,
    # and the sparse indexer loss's attention target and KL
    ("tilelang_indexer_fwd", "_get_indexer_fwd_kernel"): "idx_fwd",
    ("tilelang_indexer_fwd", "_get_clean_logits_kernel"): "idx_clean",
    ("tilelang_indexer_bwd", "_get_indexer_bwd_kernel"): "idx_bwd",
    ("tilelang_indexer_loss", "_get_target_kernel"): "idx_target",
    ("tilelang_indexer_loss", "_get_kl_kernel"): "idx_kl",
}
# upstream's variables that change what the wrappers build: the set is built for their defaults
BUILD_KNOBS = ("MCORE_DSA_TILELANG_SEQ_BUCKET", "MCORE_DSA_TILELANG_TOPK_BUCKET",
               "MCORE_DSA_TILELANG_BWD_MAX_BLOCK_H", "MCORE_DSA_TILELANG_NOPE")


def use_tree(tree):
    tree = str(pathlib.Path(tree).resolve())
    if not pathlib.Path(tree, "megatron", "core").is_dir():
        sys.exit(f"error: no patched tree at {tree}: run make tree")
    if tree not in sys.path:
        sys.path.insert(0, tree)


# ------------------------------------------------------------------ plan: what the wrappers build


def _fake_kernel(kind, args, kwargs):
    """A stand-in with the real kernel's outputs (zeros): enough for the wrappers to go on."""
    import torch

    if kind in ("fwd", "fwd_ws", "fwd_ws64"):
        dim = kwargs["dim"] if "dim" in kwargs else args[1]  # both take (heads, dim, ...)

        def kernel(q, kv, indices, *scale):  # scale: a kernel built with runtime_scale (0108)
            return (q.new_zeros(q.shape[:-1] + (dim,)),
                    torch.zeros(q.shape[:-1], dtype=torch.float32))
        return kernel
    if kind == "pre":
        return lambda o, do: torch.zeros(o.shape[:-1], dtype=torch.float32)
    if kind in ("bwd", "bwd_ws64"):  # (q, kv, do, indices, lse, delta, dkv[, scale])
        return lambda q, kv, do, indices, lse, delta, dkv, *scale: torch.zeros_like(q)
    if kind == "post":
        return lambda dkv: dkv.to(torch.bfloat16)
    if kind == "idx_fwd":  # writes Logits [sq, sk] in place
        return lambda q, kv, logits, weights, ks, ke: logits.zero_()
    if kind == "idx_clean":  # -inf outside each row's [ks, ke), in place, as the kernel does
        def clean(logits, ks, ke):
            cols = torch.arange(logits.size(1), device=logits.device)
            outside = (cols < ks.unsqueeze(1)) | (cols >= ke.unsqueeze(1))
            logits.masked_fill_(outside, float("-inf"))
        return clean
    if kind == "idx_bwd":  # (q, k, weights, indices, grad_scores, dq, dweights, dk), in place
        def bwd(q, k, w, indices, grad, dq, dw, dk):
            dq.zero_()
            dw.zero_()
        return bwd
    if kind == "idx_target":  # (query, key, indices) -> target [sq, topk] fp32
        return lambda query, key, indices: torch.zeros(indices.shape, dtype=torch.float32)
    if kind == "idx_kl":  # (target, logits, valid) -> (grad_logits [sq, topk], kl_rows [sq])
        return lambda target, logits, valid: (torch.zeros_like(target),
                                              target.new_zeros(target.shape[:1]))
    raise ValueError(f"no stand-in for kernel kind {kind!r}")


def _without_runtime_scale(getter, args, kwargs):
    """A getter call with runtime_scale (0108: the kernel takes the softmax scale at each call)
    builds the same kernel whatever the scale: record it with sm_scale None, as the getter keys it,
    so every scale of the plan shares that kernel."""
    if getter is None or not kwargs.get("runtime_scale"):
        return args, kwargs
    import inspect

    args, kwargs = list(args), dict(kwargs)
    if "sm_scale" in kwargs:
        kwargs["sm_scale"] = None
    else:
        args[list(inspect.signature(getter).parameters).index("sm_scale")] = None
    return args, kwargs


@contextlib.contextmanager
def _tensors_report_cuda():
    """Every tensor says is_cuda, for the wrappers' "can the fused kernel take these tensors"
    predicates: the plan runs on CPU, and the predicates' other conditions (dtype, shape, top-k
    multiple) are what decides on the GPU."""
    import torch

    torch.Tensor.is_cuda = property(lambda self: True)
    try:
        yield
    finally:
        del torch.Tensor.is_cuda  # the class attribute: TensorBase's own is_cuda again


def _as_on_gpu(predicate):
    def wrapped(*args, **kwargs):
        with _tensors_report_cuda():
            return predicate(*args, **kwargs)
    return wrapped


def _indexer_step(dsa_kernels, config, heads=None, scale=None):
    """One DSA indexer call as DSAttention makes it on the tilelang backend, at config's indexer
    shape (dsa_indexer_n_heads, _head_dim, _topk, _scoring_relu), causal, batch 1, sq = sk =
    the indexer's top-k (so the top-k is that wide, as for any sequence at least that long).
    heads None: run_fused_qk_topk (no indexer loss: forward only). Else
    run_fused_qk_topk_with_loss (dsa_indexer_loss_coeff > 0 with dsa_indexer_use_sparse_loss)
    against the main attention's absorbed NoPE query [sq, 1, heads, 512] and shared latent key
    [sk, 1, 1, 512] at softmax scale `scale`, and the loss's backward."""
    import torch

    from megatron.core.transformer.experimental_attention_variant import dsa_masking

    index_heads, index_dim = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
    index_topk, use_relu = config.dsa_indexer_topk, config.dsa_indexer_scoring_relu
    sq = sk = index_topk
    grad = heads is not None
    q = torch.zeros(sq, 1, index_heads, index_dim, dtype=torch.bfloat16, requires_grad=grad)
    k = torch.zeros(sk, 1, index_dim, dtype=torch.bfloat16, requires_grad=grad)
    weights = torch.zeros(sq, 1, index_heads, dtype=torch.bfloat16, requires_grad=grad)
    starts, ends = dsa_masking.build_fused_indexer_varlen_bounds(
        sq=sq, skv=sk, device=q.device, mask=None, varlen_starts=None, varlen_ends=None,
        key_positions=None)
    what = f"index heads {index_heads}, index head dim {index_dim}, top-k {index_topk}"
    if not grad:
        out = dsa_kernels.run_fused_qk_topk(
            config, q, k, weights, index_topk, starts, ends, block_size=INDEXER_BLOCK,
            use_relu=use_relu)
        if out is None:
            raise RuntimeError(f"the TileLang indexer declined ({what})")
        return
    query = torch.zeros(sq, 1, heads, 512, dtype=torch.bfloat16)
    key = torch.zeros(sk, 1, 1, 512, dtype=torch.bfloat16)
    out = dsa_kernels.run_fused_qk_topk_with_loss(
        config, q, k, weights, index_topk, starts, ends, block_size=INDEXER_BLOCK, query=query,
        key=key, softmax_scale=scale, loss_coeff=1.0,
        pg_collection=types.SimpleNamespace(tp=None), use_relu=use_relu)
    if out is None:
        raise RuntimeError(f"the TileLang indexer with sparse loss declined ({what}, "
                           f"{heads} query heads)")
    out[2].backward()


def plan(heads=(8, 16, 32, 64), routes=("native", "padded"), topk=GLM_TOPK, scales=(GLM_SCALE,),
         sms=H200_SMS, only=None, tokens=256, index_heads=(INDEX_HEADS,), index_dim=INDEX_DIM,
         index_topk=INDEX_TOPK, index_relu=True, indexer=True):
    """The kernel getter calls one fused fwd+bwd makes for each (route, heads, scale), then (if
    indexer) those of the DSA indexer for each index head count: its forward alone (no indexer
    loss) and, for each (heads, scale), its forward+backward with the sparse indexer loss: a list
    of {"module", "getter", "kind", "args", "kwargs", "used_by"}, one per distinct call, in
    order."""
    import importlib

    import torch

    from megatron.core.transformer.experimental_attention_variant import dsa_kernels
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    mods = {m: importlib.import_module(f"{OPS}.{m}") for m, _ in GETTERS}
    calls, order = {}, []
    saved_env = {k: os.environ.pop(k, None) for k in BUILD_KNOBS + ("MCORE_DSA_REQUIRE_FUSED",)}
    saved, real = [], {}
    try:
        for (m, name), kind in GETTERS.items():
            if not hasattr(mods[m], name):
                continue  # a tree without that kernel (e.g. no warp-specialized forward)

            def recorder(*args, _m=m, _name=name, _kind=kind, **kwargs):
                args, kwargs = _without_runtime_scale(real[_m, _name], args, kwargs)
                key = json.dumps([_m, _name, args, sorted(kwargs.items())])
                if key not in calls:
                    calls[key] = dict(module=_m, getter=_name, kind=_kind, args=list(args),
                                      kwargs=dict(sorted(kwargs.items())), used_by=[])
                    order.append(key)
                use = dict(current)
                if use not in calls[key]["used_by"]:
                    calls[key]["used_by"].append(use)
                return _fake_kernel(_kind, args, kwargs)

            real[m, name] = getattr(mods[m], name)
            saved.append((mods[m], name, real[m, name]))
            setattr(mods[m], name, recorder)
        for name in ("_can_use_fused_sparse_indexer_target", "_can_use_fused_sparse_indexer_kl"):
            saved.append((tilelang_dsa, name, getattr(tilelang_dsa, name)))
            setattr(tilelang_dsa, name, _as_on_gpu(getattr(tilelang_dsa, name)))
        # PyTorch's target where the fused target kernel declines (top-k not a multiple of 64):
        # no kernel in it, and [512, 1024, 512] FP32 gathers on CPU
        saved.append((tilelang_dsa, "_compute_topk_target_chunk_sum",
                      tilelang_dsa._compute_topk_target_chunk_sum))
        tilelang_dsa._compute_topk_target_chunk_sum = lambda *, s0, s1, idx_seq, **_: torch.zeros(
            s1 - s0, idx_seq.size(-1), dtype=torch.float32)
        saved.append((torch.cuda, "get_device_properties", torch.cuda.get_device_properties))
        torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
            multi_processor_count=sms)
        os.environ["MCORE_DSA_REQUIRE_FUSED"] = "1"  # a decline raises: no silent gap in the set
        for route in routes:
            os.environ["MCORE_DSA_TILELANG_NOPE"] = route
            for h in heads:
                for scale in scales:
                    current = dict(route=route, heads=h, topk=topk, scale=scale)
                    config = MLATransformerConfig(
                        num_layers=1, hidden_size=256, num_attention_heads=h, kv_lora_rank=512,
                        qk_pos_emb_head_dim=0, dsa_kernel_backend="tilelang")
                    q = torch.zeros(tokens, 1, h, 512, dtype=torch.bfloat16, requires_grad=True)
                    k = torch.zeros(tokens, 1, 1, 512, dtype=torch.bfloat16, requires_grad=True)
                    rows = torch.arange(tokens, dtype=torch.int32).unsqueeze(1)
                    idx = rows - torch.arange(topk, dtype=torch.int32)
                    idx = torch.where(idx >= 0, idx, torch.full_like(idx, -1)).unsqueeze(0)
                    out = dsa_kernels.run_fused_absorbed_sparse_attention(
                        config, q, k, idx, scale, 512)
                    out.float().sum().backward()
        for ih in index_heads if indexer else ():
            shape = dict(index_heads=ih, index_dim=index_dim, index_topk=index_topk,
                         use_relu=index_relu)
            config = MLATransformerConfig(
                num_layers=1, hidden_size=256, num_attention_heads=16, kv_lora_rank=512,
                qk_pos_emb_head_dim=0, dsa_kernel_backend="tilelang", dsa_indexer_n_heads=ih,
                dsa_indexer_head_dim=index_dim, dsa_indexer_topk=index_topk,
                dsa_indexer_scoring_relu=index_relu)
            current = dict(path="indexer", **shape)
            _indexer_step(dsa_kernels, config)
            for h in heads:
                for scale in scales:
                    current = dict(path="indexer_loss", heads=h, scale=scale, **shape)
                    _indexer_step(dsa_kernels, config, heads=h, scale=scale)
    finally:
        for obj, name, fn in reversed(saved):
            setattr(obj, name, fn)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out = [calls[k] for k in order]
    if only:
        out = [c for c in out if c["kind"] in only]
    return out


# ------------------------------------------------------------------ build: one process a kernel


@contextlib.contextmanager
def _deterministic_nvcc(base):
    """Make TileLang's nvcc call reproducible: nvcc records its input's path and mtime in the
    cubin's line table, and TileLang compiles from a random temporary directory. Compile in
    BASE/<sha256 of the source> (locked, so two builds of one source wait for each other) with
    the source's mtime at EPOCH. Changes nothing TileLang keys on or loads."""
    import fcntl

    from tilelang.contrib import nvcc
    from tvm.contrib import utils as tvm_utils

    orig_compile, orig_utils, orig_subprocess = nvcc.compile_cuda, nvcc.utils, nvcc.subprocess

    class Utils:
        def __init__(self, path):
            self.path = path

        def tempdir(self, custom_path=None, keep_for_debug=None):
            return tvm_utils.TempDirectory(custom_path=custom_path or self.path,
                                           keep_for_debug=keep_for_debug)

        def __getattr__(self, name):
            return getattr(tvm_utils, name)

    class Subprocess:
        def Popen(self, cmd, *a, **k):  # noqa: N802 (subprocess's name)
            if cmd and str(cmd[-1]).endswith(".cu"):
                os.utime(cmd[-1], (EPOCH, EPOCH))
            return subprocess.Popen(cmd, *a, **k)

        def __getattr__(self, name):
            return getattr(subprocess, name)

    def compile_cuda(code, *a, **k):
        os.makedirs(base, exist_ok=True)
        path = os.path.join(base, hashlib.sha256(code.encode()).hexdigest()[:24])
        with open(path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            shutil.rmtree(path, ignore_errors=True)
            nvcc.utils = Utils(path)
            try:
                return orig_compile(code, *a, **k)
            finally:
                nvcc.utils = orig_utils
                shutil.rmtree(path, ignore_errors=True)

    nvcc.compile_cuda, nvcc.subprocess = compile_cuda, Subprocess()
    try:
        yield
    finally:
        nvcc.compile_cuda, nvcc.subprocess = orig_compile, orig_subprocess


def forget_kernels(mod, out_idx=None):
    """Drop every compiled kernel a process holds in memory for module mod's kernels (megatron's
    LRU dicts, the JIT functions' own caches, TileLang's KernelCache), so the next getter call
    goes to TileLang's disk cache as a fresh process would. out_idx: {JIT function name: out_idx}
    to put back (TileLang 0.1.15 rewrites a JIT function's out_idx in place at its first disk-cache
    load, see _keys)."""
    from collections import OrderedDict

    from tilelang.cache import _dispatch_map
    from tilelang.jit import JITImpl

    for cache in _dispatch_map.values():
        cache._memory_cache.clear()
    for name, value in vars(mod).items():
        if isinstance(value, JITImpl):
            value._kernel_cache.clear()
            value._call_form_cache.clear()
            if out_idx is not None and name in out_idx:
                idx = out_idx[name]
                value.out_idx = list(idx) if isinstance(idx, list) else idx
        elif isinstance(value, OrderedDict) and name.endswith("_kernel_cache"):
            value.clear()


def jit_out_idx(mod):
    """{name: out_idx} of module mod's JIT functions, as their decorators set them."""
    from tilelang.jit import JITImpl

    return {n: (list(v.out_idx) if isinstance(v.out_idx, list) else v.out_idx)
            for n, v in vars(mod).items() if isinstance(v, JITImpl)}


class _Lookup(Exception):
    pass


def _lookup(mod, call):
    """(key, out_idx, number of kernel parameters) of TileLang's disk-cache lookup for call in this
    process's state, without loading or compiling anything; out_idx is the JIT function's own
    list."""
    from tilelang.cache.kernel_cache import KernelCache

    def stop(self, key, backend_context, out_idx=None, pass_configs=None, compile_flags=None,
             func=None, verbose=False):
        raise _Lookup(key, out_idx, len(func.params))

    orig = KernelCache._load_kernel_from_disk
    KernelCache._load_kernel_from_disk = stop
    try:
        getattr(mod, call["getter"])(*call["args"], **call["kwargs"])
    except _Lookup as found:
        return found.args
    finally:
        KernelCache._load_kernel_from_disk = orig
    raise RuntimeError(f"{_describe(call)} did not look up TileLang's disk cache")


def lookup_key(mod, call):
    """The disk-cache key TileLang computes for call in this process's state."""
    return _lookup(mod, call)[0]


def _keys(mod, call):
    """The key of call's kernel in a fresh process, and its key once another kernel of the same
    JIT function has been loaded from the disk cache in the process. TileLang 0.1.15 loads an
    entry with the JIT function's own out_idx list, and TVMFFIKernelAdapter.from_database
    legalizes that list in place (negative indices become positive: jit/adapter/tvm_ffi.py
    from_database, jit/adapter/base.py _legalize_result_idx), so the function's later keys hash the
    positive out_idx. The archive keeps each entry under both keys (the second a symbolic link).
    Computed before the kernel is compiled: a compile changes what a later elaboration of the same
    call gives in this process (TileLang 0.1.15 renamed the warp-specialized forward's thread
    variable)."""
    key, out_idx, nparams = _lookup(mod, call)
    if not isinstance(out_idx, list) or all(i >= 0 for i in out_idx):
        return key, key
    saved = list(out_idx)
    out_idx[:] = [i + nparams if i < 0 else i for i in out_idx]  # what _legalize_result_idx does
    try:
        return key, lookup_key(mod, call)
    finally:
        out_idx[:] = saved


def _build_one(job):
    """In a fresh process: make one getter call for real into its own cache folder."""
    call, cache, tree, nvcc_base = job
    os.environ["TILELANG_CACHE_DIR"] = cache
    os.environ["TILELANG_DEFAULT_TARGET"] = TARGET_ENV
    for k in BUILD_KNOBS:
        os.environ.pop(k, None)
    use_tree(tree)
    import importlib
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    mod = importlib.import_module(f"{OPS}.{call['module']}")
    key, alias = _keys(mod, call)
    t0 = time.perf_counter()
    with _deterministic_nvcc(nvcc_base):
        kernel = getattr(mod, call["getter"])(*call["args"], **call["kwargs"])
    seconds = round(time.perf_counter() - t0, 1)
    if kernel._tilelang_cache_key != key:
        raise RuntimeError(f"{_describe(call)}: stored under {kernel._tilelang_cache_key}, "
                           f"looked up as {key}")
    return dict(key=key, alias_key=alias, seconds=seconds)


def namespace():
    """TileLang's cache folder for this version and machine, relative to TILELANG_CACHE_DIR."""
    from tilelang.cache.kernel_cache import KernelCache

    return KernelCache._get_cache_namespace()


def build(calls, cache, tree, jobs):
    """Compile every call into cache (a TileLang cache folder); returns the calls with their key."""
    cache = pathlib.Path(cache)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="glm53-kernels-"))
    nvcc_base = os.path.join(tempfile.gettempdir(), "glm53-kernels-nvcc")
    try:
        work = [(c, str(tmp / f"c{i}"), str(tree), nvcc_base) for i, c in enumerate(calls)]
        procs = max(1, min(len(work), jobs))
        print(f"building {len(work)} kernels for {TARGET_ENV} with {procs} processes", flush=True)
        t0 = time.perf_counter()
        results = []
        with mp.get_context("spawn").Pool(procs, maxtasksperchild=1) as pool:
            for call, res in zip(calls, pool.imap(_build_one, work)):
                print(f"  {call['kind']:7} {_describe(call)}: {res['seconds']} s, key "
                      f"{res['key'][:16]}", flush=True)
                results.append(dict(call, **res))
        ns = namespace()
        for (_, c, _, _), r in zip(work, results):
            src = pathlib.Path(c, ns, "kernels", r["key"])
            if not (src / "executable.so").is_file():
                raise SystemExit(f"error: TileLang did not store {_describe(r)} at {src}")
            dest = cache / ns / "kernels" / r["key"]
            if not dest.exists():
                shutil.copytree(src, dest)
            alias = cache / ns / "kernels" / r["alias_key"]
            if r["alias_key"] != r["key"] and not alias.is_symlink():
                alias.symlink_to(r["key"], target_is_directory=True)
        (cache / ns / ".staging").mkdir(parents=True, exist_ok=True)
        print(f"built in {time.perf_counter() - t0:.0f} s", flush=True)
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _describe(call):
    parts = [repr(a) for a in call["args"]] + [f"{k}={v!r}" for k, v in call["kwargs"].items()]
    return f"{call['getter']}({', '.join(parts)})"


# ------------------------------------------------------------------ manifest, tar, check


def manifest(results, label, args):
    import tilelang

    from tilelang.backend.module import create_backend_context

    ctx = create_backend_context(TARGET, None, "auto")
    ns = namespace()
    kernels = []
    for r in results:
        entry = pathlib.Path(args.cache_dir) / ns / "kernels" / r["key"]
        files = json.loads((entry / "manifest.json").read_text())["files"]
        kernels.append(dict(key=r["key"], alias_key=r["alias_key"], kind=r["kind"],
                            module=f"{OPS}.{r['module']}", getter=r["getter"], args=r["args"],
                            kwargs=r["kwargs"], used_by=r["used_by"],
                            executable_sha256=files["executable.so"]["sha256"]))
    p = read_pin()
    return dict(
        format=1,
        what="TileLang kernel cache: the GLM-5.3-Flash SparseMLA and DSA indexer kernels of a "
             "megatron-core build",
        label=label,
        megatron_core=f"{p['MCORE_VERSION']}+{label}",
        patches_sha256=_patches_sha256(),
        tilelang=tilelang.__version__,
        target=TARGET,
        target_str=str(ctx.target),
        target_host=str(ctx.target_host),
        execution_backend=ctx.execution_backend.name,
        cache_namespace=ns,
        sms=args.sms,
        topk=args.topk,
        scales=args.scale,
        routes=args.routes,
        query_heads=args.heads,
        indexer=None if args.no_indexer else dict(
            index_heads=args.index_heads, index_dim=args.index_dim, index_topk=args.index_topk,
            use_relu=not args.index_no_relu),
        env={"TILELANG_CACHE_DIR": "the folder this archive is unpacked into",
             "TILELANG_DEFAULT_TARGET": TARGET_ENV},
        kernels=sorted(kernels, key=lambda k: (k["kind"], json.dumps(k["args"]), k["key"])),
    )


def _patches_sha256():
    """sha256 over 'name sha256' lines of the series' patches (bench.py's provenance hash)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import series as series_py

    rows = "".join(f"{n} {hashlib.sha256((ROOT / 'patches' / n).read_bytes()).hexdigest()}\n"
                   for n in series_py.series(ROOT / "patches")
                   if not series_py.tests_only(ROOT / "patches" / n))
    return hashlib.sha256(rows.encode()).hexdigest()[:16]


def write_tar(cache, path):
    """cache's files as a .tar.xz with sorted members, fixed mtime and owner: same bytes for
    the same files. Symbolic links (the alias keys) stay links."""
    import lzma

    cache = pathlib.Path(cache)
    paths = []
    for top, dirs, files in os.walk(cache):  # does not follow the links
        paths += [pathlib.Path(top, n) for n in dirs + files]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for p in sorted(paths, key=lambda p: p.relative_to(cache).as_posix()):
            info = tar.gettarinfo(str(p), p.relative_to(cache).as_posix())
            info.mtime, info.uid, info.gid, info.uname, info.gname = EPOCH, 0, 0, "", ""
            if info.issym():
                info.mode = 0o777
                tar.addfile(info)
            elif info.isdir():
                info.mode = 0o755
                tar.addfile(info)
            else:
                info.mode = 0o644
                with open(p, "rb") as f:
                    tar.addfile(info, f)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(lzma.compress(buf.getvalue(), format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64,
                                  preset=6))
    tmp.replace(path)


def check(cache_dir, out=print):
    """Load every kernel of cache_dir's manifest through its getter, with TILELANG_CACHE_DIR =
    cache_dir and this process's own target resolution, nvcc and TileLang's compile path replaced
    by a trap. Two passes: "fresh" (each kernel as a process's first kernel: in-memory caches and
    the JIT functions' out_idx put back before each) and "one process" (all kernels in a row, as
    one process that builds several kernels of one JIT function does). Returns the number of
    kernels that did not load from their shipped entry."""
    import importlib
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    cache_dir = pathlib.Path(cache_dir).resolve()
    manifests = sorted(cache_dir.glob(MANIFEST_PREFIX + "*.json"))
    if len(manifests) != 1:
        out(f"error: {len(manifests)} manifests ({MANIFEST_PREFIX}*.json) in {cache_dir}")
        return 1
    m = json.loads(manifests[0].read_text())
    if pathlib.Path(os.environ.get("TILELANG_CACHE_DIR", "~")).expanduser().resolve() != cache_dir:
        out(f"error: TILELANG_CACHE_DIR must be {cache_dir} (set before tilelang is imported)")
        return 1
    import tilelang
    from tilelang.contrib import nvcc
    from tilelang.jit.kernel import JITKernel

    if tilelang.__version__ != m["tilelang"]:
        out(f"error: TileLang {tilelang.__version__} here, the kernels are for {m['tilelang']}")
        return 1

    def trap(*a, **k):
        raise RuntimeError("a kernel was compiled, not loaded from the shipped cache")

    nvcc.compile_cuda = trap
    JITKernel._compile_and_create_adapter = trap
    mods = {k["module"]: importlib.import_module(k["module"]) for k in m["kernels"]}
    out_idx = {name: jit_out_idx(mod) for name, mod in mods.items()}
    bad = 0
    passes = [("fresh", m["kernels"]), ("one process", m["kernels"]),
              ("one process, reversed", m["kernels"][::-1])]
    for pass_name, kernels in passes:
        for name, mod in mods.items():
            forget_kernels(mod, out_idx[name])
        for k in kernels:
            mod = mods[k["module"]]
            if pass_name == "fresh":
                forget_kernels(mod, out_idx[k["module"]])
            want = (cache_dir / m["cache_namespace"] / "kernels" / k["key"]).resolve()
            t0 = time.perf_counter()
            try:
                kernel = getattr(mod, k["getter"])(*k["args"], **k["kwargs"])
                got = pathlib.Path(kernel._tilelang_cache_path)
                ok = got.resolve() == want
                what = f"loaded from {got.name[:16]}" if ok else f"MISS (entry {got.name[:16]})"
            except Exception as exc:  # noqa: BLE001 (reported per kernel)
                ok, what = False, f"MISS ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
            bad += not ok
            out(f"[{pass_name}] {k['kind']:7} {k['key'][:16]} {what} in "
                f"{time.perf_counter() - t0:.2f} s")
    n = len(passes) * len(m["kernels"])
    out(f"{n - bad} of {n} kernel loads ({len(m['kernels'])} kernels, {len(passes)} passes) from "
        f"{cache_dir} without a compile")
    return bad


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=str(ROOT / "build" / "tree"))
    ap.add_argument("--out", default=str(ROOT / "dist"), help="where the .tar.xz goes")
    ap.add_argument("--heads", type=int, nargs="+", default=[8, 16, 32, 64],
                    help="query heads per GPU (the 576 route runs 8 as 16)")
    ap.add_argument("--routes", nargs="+", default=["native", "padded"],
                    choices=["native", "padded"])
    ap.add_argument("--topk", type=int, default=GLM_TOPK)
    ap.add_argument("--scale", type=float, nargs="+", default=[GLM_SCALE],
                    help="softmax scales (each kernel is built for one; default 512**-0.5)")
    ap.add_argument("--sms", type=int, default=H200_SMS,
                    help="SMs of the GPU (the persistent 16-head forward launches one CTA each; "
                         "the 64-row backward's key-block phase turns every that many queries)")
    ap.add_argument("--index-heads", type=int, nargs="+", default=[INDEX_HEADS],
                    help="DSA indexer heads, dsa_indexer_n_heads (default 32: an assumption)")
    ap.add_argument("--index-dim", type=int, default=INDEX_DIM,
                    help="DSA indexer head dim, dsa_indexer_head_dim (default 128: an assumption)")
    ap.add_argument("--index-topk", type=int, default=INDEX_TOPK,
                    help="DSA indexer top-k, dsa_indexer_topk (default 2048: an assumption)")
    ap.add_argument("--index-no-relu", action="store_true",
                    help="dsa_indexer_scoring_relu=False (default: True, megatron's default)")
    ap.add_argument("--no-indexer", action="store_true",
                    help="only the SparseMLA kernels, not the DSA indexer's")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", nargs="+", choices=sorted(set(GETTERS.values())),
                    help="build only these kernel kinds (a subset, for tests)")
    ap.add_argument("--plan", action="store_true", help="print the kernel calls and stop")
    ap.add_argument("--check", metavar="CACHE_DIR",
                    help="load every kernel of an unpacked archive without compiling")
    args = ap.parse_args(argv)
    if args.check:  # the patched tree if there is one, else the installed wheel (a GPU host)
        if pathlib.Path(args.tree, "megatron", "core").is_dir():
            use_tree(args.tree)
        return 1 if check(args.check) else 0
    use_tree(args.tree)
    calls = plan(args.heads, args.routes, args.topk, args.scale, args.sms, args.only,
                 index_heads=args.index_heads, index_dim=args.index_dim,
                 index_topk=args.index_topk, index_relu=not args.index_no_relu,
                 indexer=not args.no_indexer)
    if args.plan:
        print(json.dumps(calls, indent=1))
        return 0
    import tilelang

    label = read_pin()["LOCAL_LABEL"]
    name = f"glm53-kernels-{label}-tilelang{tilelang.__version__}-{ARCH_TAG}.tar.xz"
    with tempfile.TemporaryDirectory(prefix="glm53-kernel-cache-") as cache:
        args.cache_dir = cache
        results = build(calls, cache, args.tree, args.jobs)
        m = manifest(results, label, args)
        (pathlib.Path(cache) / f"{MANIFEST_PREFIX}{label}.json").write_text(
            json.dumps(m, indent=1, sort_keys=True) + "\n")
        env = dict(os.environ, TILELANG_CACHE_DIR=cache, TILELANG_DEFAULT_TARGET=TARGET_ENV)
        proc = subprocess.run([sys.executable, __file__, "--tree", args.tree, "--check", cache],
                              env=env, capture_output=True, text=True)
        print(proc.stdout, end="")
        if proc.returncode:
            sys.exit(f"error: the built cache does not load without a compile:\n{proc.stderr}")
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_tar(cache, out / name)
    digest = hashlib.sha256((out / name).read_bytes()).hexdigest()
    print(f"{out / name}: {len(m['kernels'])} kernels, sha256 {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
