"""Independent references for the tests: the SparseMLA kernel contract in plain PyTorch, and
GLM-5.3-Flash's k-pool top-k indices.

The kernel contract (TileLang SparseMLA in megatron-core 0.19 + patches 0030/0040): q [b, s, h, W],
kv [b, sk, 1, W] with W = 576 (RoPE-tail kernels, K a multiple of 64) or W = 512 (native NoPE
kernels, any K), indices [b, s, 1, K] int32; -1 entries are masked, and (0080, native kernels) so
are entries outside [0, sk); the value is kv[..., :512];
a row with no valid index gives zero output (and so zero gradient). Softmax runs over the K listed
entries, unlike megatron's dense fallback, which masks a dense [sq, sk] row.
"""
import math

import torch

D_QK = 576
D_V = 512
POOL = 4  # tokens per k-pool
TOPK_TOKENS = 2048  # 512 selected pools of 4
KPOOL_WIDTH = TOPK_TOKENS + POOL - 1  # + the query's incomplete tail pool: 2051


def sparse_attention_reference(q, kv, indices, scale, d_v=D_V):
    """Differentiable fp32 reference. q [b,s,h,D], kv [b,sk,1,D], indices [b,s,1,K] -> [b,s,h,d_v]."""
    b, s, h, _ = q.shape
    sk = kv.size(1)
    idx = indices[:, :, 0].long()  # [b, s, K]
    valid = (idx >= 0) & (idx < sk)  # an index outside the keys counts as -1 (0080)
    idx = idx.masked_fill(~valid, -1)
    qf = q.float()
    kf = kv[:, :, 0].float()  # [b, sk, D]
    scores = torch.einsum("bshd,bkd->bhsk", qf, kf) * scale  # dense, then gathered
    gidx = idx.clamp(min=0).unsqueeze(1).expand(b, h, s, idx.size(-1))
    logits = scores.gather(-1, gidx)
    vmask = valid.unsqueeze(1).expand_as(logits)
    logits = logits.masked_fill(~vmask, float("-inf"))
    row_valid = vmask.any(-1, keepdim=True)
    row_max = torch.where(row_valid, logits.amax(-1, keepdim=True), torch.zeros_like(logits[..., :1]))
    p = torch.exp(logits - row_max).masked_fill(~vmask, 0.0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    dense_p = torch.zeros(b, h, s, sk, dtype=p.dtype, device=p.device).scatter_add(-1, gidx, p)
    out = torch.einsum("bhsk,bkd->bshd", dense_p, kf[..., :d_v])
    return out


class ReferenceSparseMLA:
    """Drop-in for ops.sparse_mla.SparseMLA that enforces the kernel's input contract."""

    calls = []

    @staticmethod
    def apply(q, kv, indices, scaling, save_output=False, out_heads=None, deterministic=False):
        """save_output (0060): the real SparseMLA keeps out/lse for backward; the result is the same.
        out_heads (0107, with save_output): only the first out_heads heads of out come back.
        deterministic (0150): a bitwise-reproducible backward; the result is the same."""
        assert isinstance(save_output, bool) and isinstance(deterministic, bool)
        assert out_heads is None or (save_output and 0 < out_heads < q.size(2))
        assert q.dtype == kv.dtype == torch.bfloat16
        width = q.size(-1)
        assert width in (D_QK, D_V) and kv.size(-1) == width, "kernels take width 576 or 512"
        assert indices.dtype == torch.int32
        if width == D_QK:
            assert indices.size(-1) % 64 == 0, "the 576 kernels take top-k padded to 64"
        h = q.size(2)
        # the native kernels take fewer than 16 heads as they are (16-row tiles, the rest zero)
        assert (h >= 16 and h & (h - 1) == 0) or (width == D_V and 0 < h < 16), \
            "kernel head tile is a power of two >= 16"
        assert q.is_contiguous() and kv.is_contiguous() and indices.is_contiguous()
        ReferenceSparseMLA.calls.append((q.shape, kv.shape, indices.shape, scaling))
        out = sparse_attention_reference(q, kv, indices, scaling).to(q.dtype)
        if out_heads is not None:
            out = out[:, :, :out_heads].contiguous()
        return out, None


def causal_random_indices(sq, sk, width, generator, offset=None):
    """[sq, width] int32: distinct random keys <= the row's causal limit, -1 where a row has fewer."""
    offset = sk - sq if offset is None else offset
    rows = []
    for i in range(sq):
        limit = i + offset + 1
        n = min(width, limit)
        keys = torch.randperm(limit, generator=generator)[:n].sort().values
        row = torch.full((width,), -1, dtype=torch.int32)
        row[:n] = keys.to(torch.int32)
        rows.append(row)
    return torch.stack(rows)


def kpool_indices(sq, generator, width=KPOOL_WIDTH, topk_tokens=TOPK_TOKENS, pool=POOL, device="cpu"):
    """GLM-5.3-Flash k-pool top-k indices for causal self-attention, [sq, width] int32.

    Row i sees keys 0..i. Its complete pools are 0..(i+1)//pool - 1; up to topk_tokens/pool of
    them are picked at random (the indexer's choice) and expanded to their tokens in columns
    0..topk_tokens-1, -1 after the last; the incomplete tail pool (the (i+1) % pool newest tokens)
    sits at columns topk_tokens.. (always there, never packed after the pools), -1 where shorter.
    """
    assert width == topk_tokens + pool - 1
    npick = topk_tokens // pool
    rows = torch.arange(sq, device=device)
    complete = (rows + 1) // pool  # complete pools per row
    out = torch.full((sq, width), -1, dtype=torch.int32, device=device)
    chunk = max(1, (1 << 26) // max(1, (sq + pool - 1) // pool))
    npools_max = (sq + pool - 1) // pool
    for r0 in range(0, sq, chunk):
        r1 = min(sq, r0 + chunk)
        scores = torch.rand((r1 - r0, npools_max), generator=generator, device=generator.device)
        scores = scores.to(device)
        pools = torch.arange(npools_max, device=device)
        scores = scores.masked_fill(pools.unsqueeze(0) >= complete[r0:r1].unsqueeze(1), -1.0)
        k = min(npick, npools_max)
        top_scores, top_pools = scores.topk(k, dim=-1)
        top_pools = torch.where(top_scores >= 0, top_pools, torch.full_like(top_pools, npools_max))
        top_pools = top_pools.sort(dim=-1).values  # ascending; invalid (= npools_max) last
        tok = top_pools.unsqueeze(-1) * pool + torch.arange(pool, device=device)
        tok = tok.reshape(r1 - r0, k * pool)
        tok = torch.where(tok < npools_max * pool, tok, torch.full_like(tok, -1))
        out[r0:r1, : k * pool] = tok.to(torch.int32)
        tail_start = complete[r0:r1] * pool
        for t in range(pool - 1):
            pos = tail_start + t
            ok = pos <= rows[r0:r1]
            out[r0:r1, topk_tokens + t] = torch.where(ok, pos, torch.full_like(pos, -1)).to(torch.int32)
    return out


def rel_l2(a, b):
    a = a.float()
    b = b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def default_scale(width):
    return 1.0 / math.sqrt(width)
