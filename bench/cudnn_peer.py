"""megatron-core's own cuDNN DSA backend (`dsa_kernel_backend="cudnn"`) as a peer of our rows.

It is reached through megatron's public hook, `dsa_kernels.run_fused_absorbed_sparse_attention`,
with a config whose `dsa_kernel_backend` is "cudnn": FlashMLA's sparse prefill for the forward
(heads padded to 64, top-k to a multiple of 512 with -1 on SM90) and cudnn-frontend's
`cudnn.DSA.sparse_attention_backward_wrapper` (CuTe-DSL) for the backward.

One adapter, here and never in the wheel: megatron 0.19 calls
`flash_mla_sparse_fwd(q, kv, indices, scale, d_v=, attn_sink=, topk_length=, indexer_topk=0)`,
FlashMLA's development-branch API. PyPI's sgl-flash-mla 1.0.0 takes neither `attn_sink` nor
`topk_length` nor `indexer_topk`, and on SM90 only its legacy kernel runs (`use_legacy=True`; its
default kernel is SM100-only). The legacy kernel computes the same function whenever
- attn_sink is all -inf (an -inf sink adds exp(-inf) = 0 to every row sum), which is what
  megatron's `_run_sparse_attention_forward` passes, and
- every index at or after topk_length is -1 (the legacy kernel masks -1), which megatron's
  `_prepare_attention_topk_indices` guarantees by compacting the valid entries to the front.
The adapter checks both on its first call (the benchmark's warm-up) and raises if either fails;
after that it passes straight through, so the timed calls carry no extra work or sync. Every
benchmark row also checks the backend's output and gradients against our native route.

Where the packages live: the cuDNN site folder (cudnn-frontend + cutlass-dsl, made by
scripts/pack_cudnn_site.sh) is named by CUDNN_SITE and added with `site.addsitedir`, because
cutlass-dsl puts its `dsl_packages` on sys.path through a .pth file that PYTHONPATH ignores.
flash_mla (sgl-flash-mla) is a plain wheel, installed with the others from .whl/.
"""
import os
import site

SITE_ENV = "CUDNN_SITE"
_LOADED = {}


class LegacyFlashMLASparseFwd:
    """megatron's `flash_mla_sparse_fwd` call on sgl-flash-mla's legacy SM90 kernel (exact under
    the two conditions in the module docstring, checked on the first call)."""

    def __init__(self, flash_mla):
        self.flash_mla = flash_mla
        self.checked = False

    def _check(self, indices, attn_sink, topk_length, indexer_topk):
        import torch

        if indexer_topk:
            raise NotImplementedError("legacy FlashMLA adapter: indexer_topk must be 0")
        if attn_sink is not None and not bool(torch.isneginf(attn_sink).all()):
            raise NotImplementedError("legacy FlashMLA adapter: attn_sink must be all -inf")
        if topk_length is not None:
            pos = torch.arange(indices.size(-1), device=indices.device)
            tail = pos.view(1, 1, -1) >= topk_length.view(-1, 1, 1).to(pos.dtype)
            if bool((indices[tail] != -1).any()):
                raise NotImplementedError(
                    "legacy FlashMLA adapter: indices after topk_length must be -1"
                )
        self.checked = True

    def __call__(self, q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
                 indexer_topk=0):
        if not self.checked:
            self._check(indices, attn_sink, topk_length, indexer_topk)
        return self.flash_mla.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=d_v,
                                                   use_legacy=True)


def load():
    """(megatron's dsa_cudnn_kernels module with the adapter in place, None), or (None, why not)."""
    if "module" in _LOADED:
        return _LOADED["module"], _LOADED["reason"]
    module, reason = None, None
    folder = os.environ.get(SITE_ENV)
    if folder:
        if not os.path.isdir(folder):
            reason = f"{SITE_ENV}={folder} is not a folder"
        else:
            site.addsitedir(folder)
    if reason is None:
        try:
            import cudnn

            cudnn.DSA.sparse_attention_backward_wrapper  # noqa: B018 (the backward it needs)
            import flash_mla

            from megatron.core.transformer.experimental_attention_variant import (
                dsa_cudnn_kernels as module,
            )

            module._flash_mla_sparse_fwd = LegacyFlashMLASparseFwd(flash_mla)
        except Exception as exc:  # noqa: BLE001 (any import failure is a reason to skip)
            module, reason = None, f"cuDNN backend not importable: {type(exc).__name__}: {exc}"
    _LOADED.update(module=module, reason=reason)
    return module, reason


def versions():
    """Versions of the peer's packages (after load()), for the benchmark's provenance."""
    out = {}
    for name in ("cudnn", "flash_mla", "cutlass"):
        try:
            out[name] = getattr(__import__(name), "__version__", "?")
        except Exception:  # noqa: BLE001
            pass
    return out
