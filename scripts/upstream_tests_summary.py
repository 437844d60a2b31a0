"""Per-file summary of pytest JUnit XML results for scripts/test_upstream.sh.

  upstream_tests_summary.py --patched P.xml [--pristine B.xml] [--ours O.xml] [--cuda 0|1]
                            [--markdown OUT.md] [--title TEXT]

Prints one line per test file (passed / failed / errors / skipped, with the reasons), compares the
patched tree with the unpatched one test by test when --pristine is given, and exits 1 when a
test that passes unpatched does not pass patched (a regression), when one of our tests fails,
or (without --pristine) when any upstream test fails.
"""
import argparse
import collections
import re
import sys
import xml.etree.ElementTree as ET

OUTCOMES = ("passed", "failed", "errors", "skipped")


def file_of(classname):
    parts = classname.split(".")
    idx = max((i for i, p in enumerate(parts) if p.startswith("test_")), default=len(parts) - 1)
    return "/".join(parts[: idx + 1]) + ".py"


def reason(elem, cuda):
    msg = (elem.get("message") or "").strip()
    if not msg and elem.text and elem.text.strip():
        msg = elem.text.strip().splitlines()[-1]
    text = msg.splitlines()[0] if msg else ""
    text = re.sub(r"^Skipped: ", "", text)
    text = re.sub(r"\s+", " ", text)[:160]
    if elem.tag in ("failure", "error") and not cuda and re.search(r"torch[./]cuda|NVIDIA driver", elem.text or ""):
        text += " [the traceback goes through torch.cuda: needs a GPU]"
    return text


def load(path, cuda):
    """{test id: (file, outcome, reason)}"""
    results = {}
    for tc in ET.parse(path).iter("testcase"):
        classname = tc.get("classname", "")
        tid = f"{classname}::{tc.get('name')}"
        outcome, why = "passed", ""
        for child in tc:
            if child.tag == "skipped":
                outcome, why = "skipped", reason(child, cuda)
            elif child.tag == "failure":
                outcome, why = "failed", reason(child, cuda)
            elif child.tag == "error":
                # an error in teardown after a pass/fail still counts as an error
                outcome, why = "errors", reason(child, cuda)
        results[tid] = (file_of(classname), outcome, why)
    return results


def per_file(results):
    files = collections.OrderedDict()
    for tid, (f, outcome, why) in sorted(results.items(), key=lambda kv: kv[1][0]):
        entry = files.setdefault(f, {"counts": collections.Counter(), "reasons": collections.Counter()})
        entry["counts"][outcome] += 1
        if outcome != "passed":
            entry["reasons"][(outcome, why)] += 1
    return files


def counts_text(c):
    return ", ".join(f"{c[o]} {o}" for o in OUTCOMES)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--patched", required=True)
    ap.add_argument("--pristine")
    ap.add_argument("--ours")
    ap.add_argument("--cuda", default="0")
    ap.add_argument("--markdown")
    ap.add_argument("--title", default="Megatron-LM tests on the patched tree")
    args = ap.parse_args()
    cuda = args.cuda == "1"

    patched = load(args.patched, cuda)
    pristine = load(args.pristine, cuda) if args.pristine else None
    ours = load(args.ours, cuda) if args.ours else {}
    files = per_file(patched)
    base_files = per_file(pristine) if pristine is not None else {}
    our_files = per_file(ours)

    regressions, fixed, new, gone = [], [], [], []
    if pristine is not None:
        for tid, (f, outcome, why) in sorted(patched.items()):
            if tid not in pristine:
                new.append((tid, outcome))
            elif pristine[tid][1] == "passed" and outcome != "passed":
                regressions.append((tid, outcome, why))
            elif pristine[tid][1] != "passed" and outcome == "passed":
                fixed.append((tid, pristine[tid][1]))
        gone = sorted(t for t in pristine if t not in patched)

    lines = []
    for f, e in list(files.items()) + list(our_files.items()):
        line = f"{f}: {counts_text(e['counts'])}"
        if f in base_files:
            line += f"  (unpatched: {counts_text(base_files[f]['counts'])})"
        lines.append(line)
        for (outcome, why), n in sorted(e["reasons"].items()):
            lines.append(f"    {n} {outcome}: {why}")
    our_bad = [t for t, (_, o, _) in ours.items() if o in ("failed", "errors")]
    up_bad = [t for t, (_, o, _) in patched.items() if o in ("failed", "errors")]
    if pristine is not None:
        lines.append(f"compared with the unpatched tree: {len(regressions)} regressions, {len(fixed)} newly "
                     f"passing, {len(new)} tests only in the patched tree, {len(gone)} only in the unpatched one")
        for tid, outcome, why in regressions:
            lines.append(f"    REGRESSION {tid}: {outcome} ({why})")
        for tid, outcome in new:
            lines.append(f"    new (tests-only patch): {tid}: {outcome}")
        for tid, was in fixed:
            lines.append(f"    newly passing: {tid} (unpatched: {was})")
        for tid in gone:
            lines.append(f"    only unpatched: {tid}")
        ok = not regressions and not our_bad
        verdict = ("OK: no test that passes on the unpatched tree fails on the patched one"
                   if not regressions else f"FAIL: {len(regressions)} regression(s)")
    else:
        ok = not up_bad and not our_bad
        verdict = "OK: all tests passed or skipped" if not up_bad else f"FAIL: {len(up_bad)} upstream test(s) failed"
    if ours:
        verdict += f"; our tests: {len(our_bad)} failed" if our_bad else "; our tests: all passed"
    lines.append(verdict)
    print("\n".join(lines))

    if args.markdown:
        md = [f"## {args.title}", "",
              "| file | passed | failed | errors | skipped |" + (" unpatched (p/f/e/s) |" if pristine is not None else ""),
              "|---|---:|---:|---:|---:|" + ("---|" if pristine is not None else "")]
        for f, e in list(files.items()) + list(our_files.items()):
            c = e["counts"]
            row = f"| `{f}` | {c['passed']} | {c['failed']} | {c['errors']} | {c['skipped']} |"
            if pristine is not None:
                b = base_files.get(f)
                row += (f" {b['counts']['passed']}/{b['counts']['failed']}/{b['counts']['errors']}/"
                        f"{b['counts']['skipped']} |" if b else " (ours) |")
            md.append(row)
        md += ["", "Reasons (not passed):", ""]
        for f, e in list(files.items()) + list(our_files.items()):
            for (outcome, why), n in sorted(e["reasons"].items()):
                md.append(f"- `{f.split('/')[-1]}`: {n} {outcome}: {why}")
        if pristine is not None:
            md += ["", f"Compared with the unpatched tree: {len(regressions)} regressions, {len(fixed)} newly passing, "
                   f"{len(new)} tests only in the patched tree (tests-only patches), {len(gone)} only in the unpatched one.", ""]
            md += [f"- regression: `{t}`: {o} ({w})" for t, o, w in regressions]
            md += [f"- new: `{t}`: {o}" for t, o in new]
            md += [f"- newly passing: `{t}` (unpatched: {w})" for t, w in fixed]
            md += [f"- only unpatched: `{t}`" for t in gone]
        md += ["", verdict, ""]
        with open(args.markdown, "w") as fh:
            fh.write("\n".join(md))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
