"""Check a training image for the GLM-5.3-Flash fused DSA path:

  python -m megatron.core.glm53_patches doctor [--heads 16] [--tokens 4096]

Prints the versions that matter (megatron-core and its patch label, torch and CUDA, TileLang,
flash_mla and cudnn-frontend when present), the GPU, the applied patches and the shipped kernels
found in TILELANG_CACHE_DIR (the archive `make kernels` builds), then makes one small fused forward+backward at the GLM shape (q/k width
512, top-k 2051, one KV head) through dsa_kernels.run_fused_absorbed_sparse_attention with
MCORE_DSA_REQUIRE_FUSED=1, as DSAttention would call it. The last line is the verdict:

  verdict: fused path OK (...)                              exit 0
  verdict: WILL FALL BACK to dense attention: <reason>      exit 1 (the hook declines)
  verdict: FUSED CALL FAILS: <error>                        exit 2 (training would stop)

Shipped with this project's wheel as megatron/core/glm53_doctor.py (not megatron-core source).
"""
import argparse
import importlib
import importlib.metadata
import os
import shutil
import sys
import time

GLM_TOPK = 2051  # 2048 top-k tokens + the query's incomplete k-pool of 4 (GLM-5.3-Flash)


def _version(dist, module=None):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    if module:
        try:
            return getattr(importlib.import_module(module), "__version__", "installed")
        except Exception:  # noqa: BLE001 (a broken install is reported as such)
            return None
    return None


def report(out):
    """Print what is installed; return (torch, manifest or None)."""
    import torch

    import megatron.core as mc

    try:
        from megatron.core import glm53_patches as manifest
    except ImportError:
        manifest = None
    label = manifest.LOCAL_LABEL if manifest else "none (not this project's build)"
    out(f"megatron-core {mc.__version__} (patch label {label})")
    out(f"torch {torch.__version__} (CUDA {torch.version.cuda})")
    for name, dist, module in (("tilelang", "tilelang", "tilelang"),
                               ("flash_mla", "sgl-flash-mla", "flash_mla"),
                               ("cudnn-frontend", "nvidia-cudnn-frontend", None)):
        out(f"{name} {_version(dist, module) or 'not installed'}")
    sms = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        out(f"GPU {torch.cuda.get_device_name()} (compute capability {major}.{minor})")
        sms = torch.cuda.get_device_properties().multi_processor_count
    else:
        out("GPU none (torch.cuda.is_available() is False)")
    if manifest:
        out(f"patches ({len(manifest.PATCHES)}): " + ", ".join(n[:4] for n, _ in manifest.PATCHES))
    out(shipped_kernels(manifest.LOCAL_LABEL if manifest else None, sms))
    return torch, manifest


def shipped_kernels(label, sms=None):
    """The shipped-kernels line: the archive `make kernels` builds (glm53-kernels-<label>-*.tar.xz),
    unpacked into TileLang's cache folder, and whether this process's lookups can reach it (sms:
    this GPU's SM count, None without one)."""
    import glob
    import json

    cache = os.environ.get("TILELANG_CACHE_DIR") or os.path.expanduser("~/.tilelang/cache")
    nvcc = shutil.which("nvcc")
    compiles = ("TileLang compiles each kernel shape at its first call (nvcc "
                f"{'found: ' + nvcc if nvcc else 'NOT on PATH'})")
    found = sorted(glob.glob(os.path.join(glob.escape(cache), "glm53-kernels-*.json")))
    if not found:
        return f"shipped kernels: none in TILELANG_CACHE_DIR ({cache}); {compiles}"
    lines = []
    for path in found:
        try:
            with open(path) as f:
                m = json.load(f)
            keys = [k["key"] for k in m["kernels"]]
            here = sum(os.path.isdir(os.path.join(cache, m["cache_namespace"], "kernels", k))
                       for k in keys)
            what = (f"{here} of {len(keys)} for {m['label']} (TileLang {m['tilelang']}, "
                    f"{m['target'].get('arch')}, softmax scales {m['scales']}) in {cache}")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            lines.append(f"shipped kernels: unreadable manifest {path}: {exc}")
            continue
        problems = []
        if label is not None and m["label"] != label:
            problems.append(f"built for {m['label']}, this build is {label}")
        tilelang = _version("tilelang", "tilelang")
        if tilelang and tilelang != m["tilelang"]:
            problems.append(f"TileLang here is {tilelang}")
        target = os.environ.get("TILELANG_DEFAULT_TARGET")
        try:
            same = target is not None and json.loads(target) == m["target"]
        except ValueError:
            same = False
        if target is None:
            problems.append("TILELANG_DEFAULT_TARGET is unset (TileLang's own detection gives "
                            "the same target only on an H100/H200 where it finds a CUDA folder)")
        elif not same:
            problems.append(f"TILELANG_DEFAULT_TARGET is {target}, not {json.dumps(m['target'])}")
        partly = ""
        if not problems and m.get("sms") and sms and sms != m["sms"]:
            # the persistent 16-head forward's CTA count and the 64-row backward's key-block
            # phase are built for the SM count: those kernels miss the archive on another part
            partly = (f"; built for {m['sms']} SMs, this GPU has {sms}: the 16-head forward and "
                      f"the 16/32/64-head backward are not among them; {compiles}")
        lines.append(f"shipped kernels: {what}" + (
            f"; NOT USABLE AS IS: {'; '.join(problems)}; {compiles}" if problems else partly))
    return "\n".join(lines)


def causal_indices(tokens, topk, device):
    """Row r attends to keys r, r-1, ..., r-topk+1 (distinct, -1 where there are fewer)."""
    import torch

    cols = torch.arange(topk, device=device, dtype=torch.int32)
    rows = torch.arange(tokens, device=device, dtype=torch.int32).unsqueeze(1)
    idx = rows - cols
    return torch.where(idx >= 0, idx, torch.full_like(idx, -1)).unsqueeze(0)


def fused_call(heads=16, tokens=4096, device="cuda"):
    """One fused fwd+bwd through the hook with MCORE_DSA_REQUIRE_FUSED=1:
    ("ok", details) | ("fallback", reason) | ("error", message)."""
    import torch

    from megatron.core.transformer.experimental_attention_variant import dsa_kernels
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=heads,
                                  kv_lora_rank=512, qk_pos_emb_head_dim=0,
                                  dsa_kernel_backend="tilelang")
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(tokens, 1, heads, 512, generator=g, device=device).to(torch.bfloat16)
    k = torch.randn(tokens, 1, 1, 512, generator=g, device=device).to(torch.bfloat16)
    q.requires_grad_()
    k.requires_grad_()
    idx = causal_indices(tokens, GLM_TOPK, device)
    saved = os.environ.get("MCORE_DSA_REQUIRE_FUSED")
    os.environ["MCORE_DSA_REQUIRE_FUSED"] = "1"
    t0 = time.perf_counter()
    try:
        out = dsa_kernels.run_fused_absorbed_sparse_attention(config, q, k, idx, 512 ** -0.5, 512)
        out.float().sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
    except RuntimeError as exc:
        text = str(exc).split("\n")[0]
        if "declined" in text:
            return "fallback", text
        return "error", f"{type(exc).__name__}: {text}"
    except Exception as exc:  # noqa: BLE001 (whatever would stop a training step)
        return "error", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        if saved is None:
            os.environ.pop("MCORE_DSA_REQUIRE_FUSED", None)
        else:
            os.environ["MCORE_DSA_REQUIRE_FUSED"] = saved
    seconds = time.perf_counter() - t0
    finite = all(bool(torch.isfinite(t.float()).all()) for t in (out, q.grad, k.grad))
    if not finite:
        return "error", "the fused call returned non-finite values"
    route = os.environ.get("MCORE_DSA_TILELANG_NOPE", "auto") or "auto"
    return "ok", (f"tilelang backend, NoPE route {route}, {heads} heads, {tokens} tokens, top-k "
                  f"{GLM_TOPK}: fwd+bwd in {seconds:.1f} s, first call (kernel compiles or cache loads "
                  "included)")


def doctor(argv=None, out=print):
    ap = argparse.ArgumentParser(prog="python -m megatron.core.glm53_patches doctor")
    ap.add_argument("--heads", type=int, default=16, help="query heads per GPU (default 16)")
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args(argv)
    try:
        torch, _ = report(out)
    except Exception as exc:  # noqa: BLE001 (an image without torch or megatron-core)
        out(f"verdict: FUSED CALL FAILS: cannot import what the check needs: {exc}")
        return 2
    if not torch.cuda.is_available():
        out("verdict: WILL FALL BACK to dense attention: no CUDA GPU here (the fused kernels "
            "need one)")
        return 1
    status, text = fused_call(args.heads, args.tokens)
    if status == "ok":
        out(f"verdict: fused path OK ({text})")
        return 0
    if status == "fallback":
        out(f"verdict: WILL FALL BACK to dense attention: {text}")
        return 1
    out(f"verdict: FUSED CALL FAILS: {text}")
    return 2


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "doctor":
        print("usage: python -m megatron.core.glm53_patches doctor [--heads N] [--tokens N]",
              file=sys.stderr)
        return 2
    return doctor(argv[1:])
