"""Series integrity: every patch is listed once, has its DEP-3 header and stable form, applies to
the pinned tree with fuzz 0 and no offset, and push + pop of the whole series restores the pristine
tree byte for byte. A patch that needs fuzz or lands at an offset fails with a clear message."""
import datetime
import os
import re
import shutil
import subprocess
import sys

import pytest

from shell import ROOT, script, series, series_py, only_touches_tests, tree_digest

PATCHES = ROOT / "patches"


@pytest.fixture(scope="session")
def pristine(tmp_path_factory):
    dest = tmp_path_factory.mktemp("pristine") / "tree"
    script("pristine_tree.sh", dest, check=True)
    return dest


def test_series_lists_every_patch_once():
    names = series()
    assert names, "patches/series is empty"
    assert len(names) == len(set(names)), "a patch is listed twice"
    on_disk = sorted(p.name for p in PATCHES.glob("*.patch"))
    assert sorted(names) == on_disk, "patches/ and patches/series disagree"
    for n in names:
        assert re.fullmatch(r"\d{4}-[a-z0-9][a-z0-9-]*\.patch", n), n
    assert names == sorted(names), "series order must follow the patch numbers"


@pytest.mark.parametrize("name", series())
def test_dep3_header_and_stable_form(name):
    text = (PATCHES / name).read_text()
    header, sep, diff = text.partition("\n--- a/")
    assert sep, f"{name}: no unified diff with a/ b/ paths"
    fields = dict(re.findall(r"^([A-Z][A-Za-z-]+): ?(.*)$", header, re.M))
    for key in ("Description", "Origin", "Last-Update"):
        assert fields.get(key), f"{name}: DEP-3 field {key} missing"
    assert "Forwarded" in fields or "Applied-Upstream" in fields, f"{name}: Forwarded/Applied-Upstream"
    datetime.date.fromisoformat(fields["Last-Update"])
    assert re.match(r"(upstream|backport|vendor|other)\b", fields["Origin"]), fields["Origin"]
    # Upstream-Status in Yocto's vocabulary: Backport only for what upstream accepted (Origin
    # upstream or backport); Submitted and Backport say where; our own changes are Pending.
    status = fields.get("Upstream-Status", "")
    m = re.fullmatch(r"(Pending|Submitted|Accepted|Backport|Denied|Inactive-Upstream|"
                     r"Inappropriate)(?: \[(.+)\])?", status)
    assert m, f"{name}: Upstream-Status {status!r} is not Yocto's vocabulary"
    if m[1] in ("Submitted", "Backport", "Denied", "Inappropriate"):
        assert m[2], f"{name}: Upstream-Status {m[1]} needs [where/why]"
    if m[1] == "Backport":
        assert re.match(r"(upstream|backport)\b", fields["Origin"]), f"{name}: Backport of what?"
    if fields["Origin"].startswith("vendor"):
        assert m[1] in ("Pending", "Submitted", "Inappropriate"), f"{name}: vendor patch is {m[1]}"
    # the Description's body says why (DEP-3 long description)
    assert re.search(r"^Description: .+\n (?:\S.*\n)+", header, re.M), f"{name}: no description body"
    body = "--- a/" + diff
    assert not re.search(r"^Index: |^diff -|^=+$", body, re.M), f"{name}: index lines"
    for line in re.findall(r"^(?:---|\+\+\+) .*$", body, re.M):
        assert re.fullmatch(r"(--- a/|\+\+\+ b/)\S+", line), f"{name}: timestamp or odd path: {line}"
    assert not re.search(r"^\+.*[ \t]$", body, re.M), f"{name}: trailing whitespace added"


def test_series_applies_with_fuzz_0_and_no_offset(pristine, tmp_path):
    tree = tmp_path / "t"
    shutil.copytree(pristine, tree, symlinks=True)
    proc = script("apply_patches.sh", tree)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [l.split()[1] for l in lines] == series()
    assert all(l.split()[0] in ("applied", "skipped") for l in lines), lines
    assert "offset" not in proc.stdout + proc.stderr and "fuzz" not in proc.stdout + proc.stderr


def test_quilt_push_pop_restores_pristine_tree(pristine, tmp_path):
    tree = tmp_path / "t"
    shutil.copytree(pristine, tree, symlinks=True)
    before = tree_digest(tree)
    # tests-only patches (upstream's tests/, git channel only) do not apply to this tree
    (tmp_path / "series").write_text("".join(f"{n}\n" for n in series() if not only_touches_tests(PATCHES / n)))
    env = dict(os.environ, QUILT_PATCHES=str(PATCHES), QUILT_SERIES=str(tmp_path / "series"))
    q = ["quilt", "--quiltrc", "-"]
    push = subprocess.run(q + ["push", "-a", "--fuzz=0"], cwd=tree, env=env, capture_output=True, text=True)
    assert push.returncode == 0, push.stdout + push.stderr
    assert "fuzz" not in push.stdout and "offset" not in push.stdout, push.stdout
    assert tree_digest(tree) != before
    pop = subprocess.run(q + ["pop", "-a"], cwd=tree, env=env, capture_output=True, text=True)
    assert pop.returncode == 0, pop.stdout + pop.stderr
    shutil.rmtree(tree / ".pc", ignore_errors=True)
    assert tree_digest(tree) == before


def test_refresh_is_a_no_op(tmp_path):
    """Re-exporting the series with the project's quilt settings changes no byte."""
    copy = tmp_path / "patches"
    shutil.copytree(PATCHES, copy)
    proc = script("refresh_patches.sh", env={"PATCHES": str(copy)})
    assert proc.returncode == 0, proc.stderr
    for p in PATCHES.iterdir():
        assert (copy / p.name).read_bytes() == p.read_bytes(), f"refresh changed {p.name}"


def _mutated_series(tmp_path, name, edit):
    copy = tmp_path / "patches"
    shutil.copytree(PATCHES, copy)
    target = copy / name
    target.write_text(edit(target.read_text()))
    return copy


def test_patch_needing_fuzz_fails_clearly(pristine, tmp_path):
    name = series()[0]

    def break_context(text):
        # change the last context line of the first hunk: the hunk then needs fuzz 1
        lines = text.split("\n")
        start = next(i for i, l in enumerate(lines) if l.startswith("@@"))
        end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith(("@@", "--- ")) or i == len(lines) - 1)
        last_ctx = max(i for i in range(start + 1, end) if lines[i].startswith(" "))
        lines[last_ctx] = " # changed context" if lines[last_ctx].strip() else " #"
        return "\n".join(lines)

    patches = _mutated_series(tmp_path, name, break_context)
    tree = tmp_path / "t"
    shutil.copytree(pristine, tree, symlinks=True)
    proc = script("apply_patches.sh", tree, env={"PATCHES": str(patches)})
    assert proc.returncode != 0
    assert f"patches/{name} does not apply with fuzz 0" in proc.stderr
    # GNU patch with its default fuzz 2 would have taken it: the check is what refuses it
    plain = subprocess.run(["patch", "-p1", "--dry-run", "-i", str(patches / name)], cwd=pristine,
                           capture_output=True, text=True)
    assert plain.returncode == 0 and "fuzz" in plain.stdout


def test_patch_at_offset_fails_clearly(pristine, tmp_path):
    name = series()[0]
    target = re.search(r"^\+\+\+ b/(\S+)", (PATCHES / name).read_text(), re.M).group(1)
    tree = tmp_path / "t"
    shutil.copytree(pristine, tree, symlinks=True)
    f = tree / target
    f.write_text("# a line upstream added\n" + f.read_text())
    proc = script("apply_patches.sh", tree)
    assert proc.returncode != 0
    assert f"patches/{name} applies only at an offset" in proc.stderr


def test_check_mode_leaves_tree_untouched(pristine):
    before = tree_digest(pristine)
    proc = script("apply_patches.sh", "--check", pristine)
    assert proc.returncode == 0, proc.stderr
    assert tree_digest(pristine) == before


def test_quilt_push_uses_fuzz_0(tmp_path, pristine):
    """lib.sh's quilt settings refuse what quilt's default (fuzz 2) would accept."""
    name = series()[0]
    patches = _mutated_series(tmp_path, name, lambda t: t.replace(
        "    return topk_out, kl_div * loss_coeff\n", "    return topk_out, kl_div * lossy_coeff\n", 1))
    tree = tmp_path / "t"
    shutil.copytree(pristine, tree, symlinks=True)
    cmd = f'source "{ROOT}/scripts/lib.sh"; quilt push -q'
    proc = subprocess.run(["bash", "-c", cmd], cwd=tree, capture_output=True, text=True,
                          env=dict(os.environ, PATCHES=str(patches)))
    assert proc.returncode != 0, proc.stdout
    # and quilt's own default would have pushed it with fuzz
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUILT_")}
    plain = subprocess.run(["quilt", "--quiltrc", "-", "push"], cwd=tree, capture_output=True,
                           text=True, env=dict(env, QUILT_PATCHES=str(patches)))
    assert plain.returncode == 0 and "fuzz" in plain.stdout, plain.stdout + plain.stderr


def _lib_sh(cmd, patches):
    return subprocess.run(["bash", "-c", f'. "{ROOT}/scripts/lib.sh"; {cmd}'], capture_output=True,
                          text=True, env=dict(os.environ, PATCHES=str(patches)))


def test_one_reader_of_the_series(tmp_path):
    """Comments (own line, after a tab or spaces, indented), blank lines: scripts/series.py's list,
    lib.sh's series and tests/shell.py's agree."""
    copy = tmp_path / "patches"
    shutil.copytree(PATCHES, copy)
    names = series()
    (copy / "series").write_text("\n".join(
        ["# a comment", "", "   ", f"{names[0]}\t# after a tab", f"  {names[1]}   # after spaces",
         *names[2:], "  # an indented comment", ""]))
    cli = subprocess.run([sys.executable, str(ROOT / "scripts" / "series.py"), "--patches",
                          str(copy), "list"], capture_output=True, text=True, check=True)
    cli = cli.stdout.splitlines()
    sh = _lib_sh("series", copy)
    assert sh.returncode == 0, sh.stderr
    assert series_py.series(copy) == cli == sh.stdout.splitlines() == names
    (copy / "series").write_text(f"{names[0]} -p0\n")  # per-patch options: refused, not misread
    assert _lib_sh("series", copy).returncode != 0


def test_header_only_patch_gets_one_answer_everywhere(pristine, tmp_path):
    """A patch with a header and no diff touches nothing: it is not tests-only for series.py, its
    command line, lib.sh (apply_patches.sh, build_wheel.sh, refresh_patches.sh), tests/shell.py and
    scripts/rebase.py; so the build does not skip it, and fails on it."""
    import rebase  # scripts/rebase.py (on sys.path through shell.py)

    copy = tmp_path / "patches"
    shutil.copytree(PATCHES, copy)
    name = "0200-header-only.patch"
    hdr = copy / name
    hdr.write_text("Description: a header and no diff\n a body\nOrigin: other\n"
                   "Last-Update: 2030-01-01\n")
    with open(copy / "series", "a") as f:
        f.write(f"{name}\n")
    answers = {
        "series.tests_only": series_py.tests_only(hdr),
        "series.py tests-only": subprocess.run([sys.executable, str(ROOT / "scripts" / "series.py"),
                                                "tests-only", str(hdr)]).returncode == 0,
        "lib.sh tests_only": _lib_sh(f'tests_only "{hdr}"', copy).returncode == 0,
        "shell.only_touches_tests": only_touches_tests(hdr),
        "rebase.py": rebase.S.tests_only(hdr),
    }
    assert set(answers.values()) == {False}, answers
    assert rebase.S is series_py
    proc = script("apply_patches.sh", "--check", pristine, env={"PATCHES": str(copy)})
    assert proc.returncode != 0 and f"patches/{name} does not apply" in proc.stderr
    # and it is not where the tests-only patches are listed
    assert any(name in p and "not tests-only" in p for p in series_py.problems(copy))


def test_the_tests_section_lists_exactly_the_tests_only_patches(tmp_path):
    assert series_py.problems(PATCHES) == []
    tests_only = [n for n in series() if only_touches_tests(PATCHES / n)]
    assert tests_only, "no tests-only patch in the series (0900 is one)"
    copy = tmp_path / "patches"
    shutil.copytree(PATCHES, copy)
    text = (copy / "series").read_text()
    (copy / "series").write_text(tests_only[0] + "\n" + text.replace(tests_only[0] + "\n", ""))
    assert [p for p in series_py.problems(copy) if tests_only[0] in p and "above" in p]


def _wip_list(name):
    """The drafts a wip/ list names (comments and blank lines left out)."""
    drafts = [line.split("#")[0].strip() for line in (ROOT / "wip" / name).read_text().splitlines()]
    drafts = [draft for draft in drafts if draft]
    assert drafts, f"wip/{name} lists no draft"
    return drafts


def _series_tree(pristine, tree):
    shutil.copytree(pristine, tree, symlinks=True)
    proc = script("apply_patches.sh", tree)
    assert proc.returncode == 0, proc.stderr
    return tree


def _apply_draft(tree, name):
    """wip/name on tree with the series' patch options (fuzz 0), at no offset, with a DEP-3
    header ended by a line of its own "---" before the first file's diff (the series' patches
    are held to it by series.py; a draft joins the series as it is)."""
    proc = subprocess.run(["patch", "-d", str(tree), *series_py.PATCH_ARGS, "-N", "-i",
                           str(ROOT / "wip" / name)], capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"wip/{name} does not apply on the series: {out}"
    assert "offset" not in out and "fuzz" not in out, f"wip/{name}: {out}"
    head = (ROOT / "wip" / name).read_text().split("\n--- a/")[0].splitlines()
    assert head[0].startswith("Description: ") and head[-1] == "---", f"wip/{name}: {head[-1]!r}"


def test_wip_stack_applies_on_the_series(pristine, tmp_path):
    """The drafts wip/STACK lists (what the next GPU session applies with WIP_PATCHES, in that
    order) apply on top of the series: a draft that a series change broke fails here, on CPU,
    not in a GPU call."""
    tree = _series_tree(pristine, tmp_path / "t")
    for name in _wip_list("STACK"):
        _apply_draft(tree, name)
