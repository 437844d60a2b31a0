"""The patch series' one owner: how patches/series is read, which patches are tests-only, and the
options every patch and quilt run uses. Python imports it (scripts/rebase.py, tests/); bash calls it
through scripts/lib.sh (series, tests_only, patch_args, quilt). Standard library only.

  series.py [--patches DIR] list              the series in order, one patch name a line
  series.py [--patches DIR] tests-only PATCH  exit 0 when PATCH (a file, or a name in DIR) is
                                              tests-only
  series.py [--patches DIR] check             exit 1 naming each tests-only patch outside the tests
                                              section of the series, or a patch of it that is not
  series.py patch-args                        GNU patch's options (fuzz 0 ...), one a line
  series.py quilt-env                         quilt's settings, NAME=VALUE a line

patches/series: one patch name a line, in the order applied; '#' starts a comment at the start of a
line or after white space; blank lines are ignored; a line may name only the patch (no per-patch
options: every patch gets PATCH_ARGS). The comment line starting with TESTS_SECTION opens the
section of upstream's-test patches, which are the tests-only ones.

Tests-only: a patch that touches at least one file and only files under tests/ (upstream's own
tests, which only the git channel's tree has). It is applied only where the tree has tests/, and is
not in the wheel's manifest. A patch that touches no file (a header without a diff) is not
tests-only: it is applied like any other patch, and fails there.
"""
import argparse
import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FUZZ = 0
TESTS_SECTION = "# upstream's own tests"


def patch_args(fuzz=FUZZ):
    """GNU patch as dpkg uses it: strip a/ b/, no fuzz, batch mode, unified diffs, no reject
    or backup files. Callers add -N / -R / --dry-run."""
    return ("-p1", f"-F{fuzz}", "-t", "-u", "-V", "never", "--no-backup-if-mismatch", "-r", "-")


PATCH_ARGS = patch_args()

# quilt, stable output: no timestamps, no index lines, sorted files, fuzz 0 (quilt's default push
# allows fuzz 2), unified rejects. lib.sh's quilt runs with --quiltrc - so ~/.quiltrc cannot
# change them.
QUILT_SETTINGS = {
    "QUILT_PUSH_ARGS": f"--fuzz={FUZZ}",
    "QUILT_REFRESH_ARGS": "-p ab --no-timestamps --no-index --sort --strip-trailing-whitespace",
    "QUILT_DIFF_ARGS": "-p ab --no-timestamps --no-index --sort",
    "QUILT_PATCH_OPTS": "--unified --reject-format=unified",
    "QUILT_DIFF_OPTS": "--show-c-function",
}
_COMMENT = re.compile(r"(^|\s)#.*")


def patches_dir():
    """patches/, or $PATCHES as lib.sh has it."""
    return pathlib.Path(os.environ.get("PATCHES") or ROOT / "patches")


def _entry(line):
    """The patch a series line names ('' for a comment or blank line)."""
    words = _COMMENT.sub("", line).split()
    if len(words) > 1:
        raise ValueError(f"patches/series: {line.strip()!r}: one patch name a line (no options)")
    return words[0] if words else ""


def entries(patches=None):
    """[(name, in the tests section)] of patches/series, in order."""
    out, tests_section = [], False
    for line in (pathlib.Path(patches or patches_dir()) / "series").read_text().splitlines():
        if line.strip().startswith(TESTS_SECTION):
            tests_section = True
        name = _entry(line)
        if name:
            out.append((name, tests_section))
    return out


def series(patches=None):
    """The patch names of patches/series, in order."""
    return [name for name, _ in entries(patches)]


def drop(series_file, name):
    """Remove NAME's line from a series file, comments and order kept."""
    p = pathlib.Path(series_file)
    lines = p.read_text().splitlines(keepends=True)
    keep = [line for line in lines if _entry(line) != name]
    if len(lines) - len(keep) != 1:
        raise ValueError(f"{name} appears {len(lines) - len(keep)} times in {series_file}")
    p.write_text("".join(keep))


def touched(patch):
    """The files a patch touches: the a/ and b/ paths of each ---/+++ pair, /dev/null aside."""
    lines = pathlib.Path(patch).read_text().splitlines()
    files = []
    for old, new in zip(lines, lines[1:]):
        if old.startswith("--- ") and new.startswith("+++ "):
            for path, prefix in ((old[4:], "a/"), (new[4:], "b/")):
                path = path.split("\t")[0].strip()
                if path != "/dev/null":
                    path = path[len(prefix):] if path.startswith(prefix) else path
                    if path not in files:
                        files.append(path)
    return files


def tests_only(patch):
    """Does the patch touch something, and only upstream's tests/?"""
    files = touched(patch)
    return bool(files) and all(f.startswith("tests/") for f in files)


def touches_tests(patch):
    return any(f.startswith("tests/") for f in touched(patch))


def problems(patches=None):
    """Where the tests section and the tests-only rule disagree."""
    d = pathlib.Path(patches or patches_dir())
    out = []
    for name, in_section in entries(d):
        if not (d / name).is_file():
            out.append(f"patches/series names {name}, which is not in patches/")
        elif tests_only(d / name) and not in_section:
            out.append(f"{name} is tests-only but is listed above the '{TESTS_SECTION}' comment")
        elif in_section and not tests_only(d / name):
            out.append(f"{name} is under the '{TESTS_SECTION}' comment but is not tests-only")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="series.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--patches", type=pathlib.Path,
                    help="the patches folder (default $PATCHES or patches/)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the series in order")
    t = sub.add_parser("tests-only", help="exit 0 when PATCH touches only tests/")
    t.add_argument("patch")
    sub.add_parser("check", help="the tests section holds exactly the tests-only patches")
    sub.add_parser("patch-args", help="GNU patch's options, one a line")
    sub.add_parser("quilt-env", help="quilt's settings, NAME=VALUE a line")
    a = ap.parse_args(argv)
    d = a.patches or patches_dir()
    try:
        if a.cmd == "list":
            for name in series(d):
                print(name)
        elif a.cmd == "tests-only":
            p = pathlib.Path(a.patch)
            return 0 if tests_only(p if p.is_file() else d / a.patch) else 1
        elif a.cmd == "check":
            found = problems(d)
            for line in found:
                print(f"error: {line}", file=sys.stderr)
            return 1 if found else 0
        elif a.cmd == "patch-args":
            print("\n".join(PATCH_ARGS))
        elif a.cmd == "quilt-env":
            print("\n".join(f"{k}={v}" for k, v in QUILT_SETTINGS.items()))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
