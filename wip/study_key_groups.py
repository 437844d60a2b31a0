"""Issue #21, wip/0127's "fp32" form with query groups: how much error the integer-valued fp32
dKV adds with g accumulators (query s into s mod g, each with its own per-key bS bound and
scale), against one accumulator and against the int32-lane form. CPU only; reuses
wip/study_fixed_point_bound.py's inputs and its model of the kernel's contributions (bf16 P and
dS, fp32 terms summed over the heads, one a (query, key) pair).

  .venv/bin/python wip/study_key_groups.py --seq 4096 --heads 16 --inputs bench,outliers

For each g the script sums, per (group, key), the bS terms (times the study's P margin) into a
bound B_gj, takes s_gj = floor(log2((L - N_gj / 2) / B_gj)) (L = 2^24 for fp32, 2^31 - 1 for
the lanes), rounds every term x = c 2^s_gj to an integer and reports the accumulated error
(relative L2 against the exact sum of the terms, and the worst key) and the total error against
the fp64 gradient next to the fp32 atomics'. It also checks that every fp32 partial sum stays
exact (the integer sums in fp32 in two orders equal the exact integer sum)."""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import study_fixed_point_bound as st  # noqa: E402


def run(S, H, preset, groups, chunk=64, seed=0):
    t0 = time.time()
    q, k, do, idx = st.make_inputs(S, H, preset, seed)
    pb = st.Problem(q, k, do, idx, st.D**-0.5)
    starts = torch.arange(0, S, chunk)
    starts = starts[torch.randperm(len(starts), generator=torch.Generator().manual_seed(777 + seed))]
    chunks = [(int(a), min(S, int(a) + chunk)) for a in starts]
    G = max(groups)
    # pass 1: exact sums, the fp32 atomics, and the bS terms per (group count, group, key)
    acc = torch.zeros(S + 1, 2, st.D, dtype=torch.float64)  # c64, ck
    acc32 = torch.zeros(S + 1, st.D)
    bnd = {g: torch.zeros(g, S + 1, dtype=torch.float64) for g in groups}
    cnt = {g: torch.zeros(g, S + 1, dtype=torch.float64) for g in groups}
    stored = torch.empty(S, 2 * H, pb.kc, dtype=torch.bfloat16)
    for q0, q1 in chunks:
        keys, ck, c64, terms, _, stored[q0:q1] = pb.chunk(q0, q1)
        acc.index_add_(0, keys, torch.stack([c64, ck.double()], 1))
        acc32.index_add_(0, keys, ck)
        qid = torch.arange(q0, q1).repeat_interleave(pb.kc)
        for g in groups:
            for r in range(g):
                m = qid % g == r
                bnd[g][r] += torch.bincount(keys[m], weights=terms[m, 1], minlength=S + 1)
                cnt[g][r] += torch.bincount(keys[m], minlength=S + 1).double()
    t1 = time.time()
    dK64, dKk = acc[:S, 0], acc[:S, 1]
    nz = dKk.norm(dim=-1) > 0
    out = dict(seq=S, heads=H, preset=preset, pass1_s=round(t1 - t0, 1))
    out["fp32 atomics"] = (st.rel(acc32[:S].double() - dKk, dKk),
                           st.rel(acc32[:S].double() - dK64, dK64))
    schemes = [("fp32", g, st.L24) for g in groups] + [("int32x2", 1, st.L31)]
    rows = []
    for form, g, lim in schemes:
        s = st.shift(bnd[g] * st.P_MARGIN, cnt[g], lim)  # [g, S+1]
        sc = torch.exp2(s).float()
        res = torch.zeros(S + 1, st.D, dtype=torch.float64)  # sum of 2^-s (rint(x) - x)
        ints = torch.zeros(g, S + 1, 2, st.D) if form == "fp32" else None  # fp32 sums, 2 orders
        exact = torch.zeros(g, S + 1, st.D, dtype=torch.float64) if form == "fp32" else None
        for q0, q1 in chunks:
            keys = pb.keys(q0, q1)
            ck = pb.contrib(q0, q1, stored[q0:q1])
            grp = torch.arange(q0, q1).repeat_interleave(pb.kc) % g
            x = ck * sc[grp, keys][:, None]  # exact: a power-of-two scale
            r = torch.round(x)
            res.index_add_(0, keys, (r.double() - x.double()) * torch.exp2(-s[grp, keys]).double()[:, None])
            if form == "fp32":
                for rr in range(g):
                    m = grp == rr
                    ints[rr, :, 0].index_add_(0, keys[m], r[m])
                    part = torch.zeros(S + 1, st.D)
                    part.index_add_(0, keys[m], r[m])
                    ints[rr, :, 1] += part
                    exact[rr].index_add_(0, keys[m], r[m].double())
        err = res[:S]
        row = dict(form=form, groups=g, acc_rel_l2=st.rel(err, dKk),
                   worst_key=st.pct(st.per_key_rel(err, dKk, nz), (100,))[0],
                   total_rel_l2=st.rel(dKk + err - dK64, dK64))
        if form == "fp32":
            row["fp32 sums exact, orders equal"] = (
                bool(torch.equal(ints[:, :, 0].double(), exact)),
                bool(torch.equal(ints[:, :, 0], ints[:, :, 1])))
            row["max |int sum|"] = exact.abs().max().item()
        rows.append(row)
    out["rows"] = rows
    out["total_s"] = round(time.time() - t0, 1)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--inputs", default="bench")
    ap.add_argument("--groups", default="1,2,4,8")
    a = ap.parse_args()
    groups = [int(g) for g in a.groups.split(",")]
    for preset in a.inputs.split(","):
        r = run(a.seq, a.heads, preset, groups)
        print(f"\n### seq {r['seq']}, {r['heads']} heads, inputs '{preset}' "
              f"(pass 1 {r['pass1_s']} s, total {r['total_s']} s)\n")
        acc, tot = r["fp32 atomics"]
        print(f"fp32 atomics (default kernel): accumulation {acc:.2e}, total vs fp64 {tot:.2e}\n")
        print("| form | groups | accumulated rel L2 | worst key | total rel L2 vs fp64 | "
              "fp32 sums exact, orders equal | max abs int sum |")
        print("|---|---|---|---|---|---|---|")
        for w in r["rows"]:
            print(f"| {w['form']} | {w['groups']} | {w['acc_rel_l2']:.2e} | {w['worst_key']:.2e} | "
                  f"{w['total_rel_l2']:.2e} | {w.get('fp32 sums exact, orders equal', '')} | "
                  f"{w.get('max |int sum|', '')} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
