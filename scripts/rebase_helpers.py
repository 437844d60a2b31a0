"""Helpers for scripts/rebase.sh (text rewriting and tree comparison). Not a user entry point.

  pin-write OLD NEW KEY=VALUE... [--note1 TEXT] [--note2 TEXT]
      write NEW: OLD with the pin values replaced; the comment lines under the "# Channel 1" and
      "# Channel 2" headings (the notes about the pinned commit) replaced by --note1/--note2
  header PATCH BASE DATE
      set the DEP-3 Base: field to BASE; set Last-Update: to DATE when the file changed otherwise
      (a new Base, a refreshed diff: pass --changed); prints "changed" or "unchanged"
  series-drop SERIES NAME
      remove NAME's line from SERIES (comments and order kept)
  tests-only PATCH
      exit 0 when every file PATCH touches is under tests/
  touches-tests PATCH
      exit 0 when PATCH touches anything under tests/
  blob-mismatch TREE GITDIR COMMIT
      cheap check of a git commit against an unpacked sdist tree: prints the megatron/ files of TREE
      whose bytes differ from (or are missing in) COMMIT, except the package_info.py version stamps
  version-of-commit GITDIR COMMIT
      MAJOR.MINOR.PATCH from megatron/core/package_info.py at COMMIT (empty if unreadable)
  missing-blobs TREE GITDIR
      print the megatron/ files of TREE (an unpacked sdist) whose exact bytes are in no object of
      GITDIR (stamped package_info.py files aside): if any, no commit there can match the sdist
  versions GITDIR < COMMITS
      "COMMIT MAJOR.MINOR.PATCH" for each commit read from stdin (one git cat-file process)
  hunk-lines PATCH
      print the @@ lines of PATCH (to show what a refresh moved)
"""
import hashlib
import pathlib
import re
import subprocess
import sys

PIN_KEYS = ("MCORE_VERSION", "MCORE_SDIST_SHA256", "MCORE_GIT_COMMIT")
# files the release process stamps (PRE_RELEASE), so they may differ between git and the sdist
STAMPED = {
    "megatron/core/package_info.py",
    "megatron/core/distributed/fsdp/src/megatron_fsdp/package_info.py",
}


def pin_write(old, new, assignments, note1, note2):
    values = dict(a.split("=", 1) for a in assignments)
    unknown = set(values) - set(PIN_KEYS)
    if unknown:
        sys.exit(f"pin-write: unknown keys {sorted(unknown)}")
    notes = {"1": note1, "2": note2}
    out, seen, block = [], set(), None
    for line in pathlib.Path(old).read_text().splitlines():
        m = re.match(r"# Channel ([12])\b", line)
        if m:
            block = m.group(1)
            out.append(line)
            if notes[block]:  # None: keep the old notes; "": drop them
                out.extend(f"# {n}" if n else "#" for n in notes[block].split("\n"))
            continue
        if block and line.startswith("#") and notes[block] is not None:
            continue  # an old note of this block: replaced above
        key = line.split("=", 1)[0] if re.match(r"^[A-Z_][A-Z0-9_]*=", line) else None
        if key in values:
            out.append(f"{key}={values[key]}")
            seen.add(key)
        else:
            out.append(line)
        if not line.startswith("#"):
            block = None
    missing = [k for k in values if k not in seen]
    if missing:
        out += [""] + [f"{k}={values[k]}" for k in missing]
    pathlib.Path(new).write_text("\n".join(out) + "\n")


def split_patch(text):
    """(header, diff) of a quilt patch: the diff starts at the first '--- ' / 'Index:' / 'diff ' line."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith(("--- ", "Index: ", "diff ")) and (
            line.startswith(("Index: ", "diff ")) or (i + 1 < len(lines) and lines[i + 1].startswith("+++ "))
        ):
            return "".join(lines[:i]), "".join(lines[i:])
    return text, ""


def set_field(header, name, value):
    pat = re.compile(rf"^{re.escape(name)}:[^\n]*$", re.M)
    if pat.search(header):
        return pat.sub(lambda _m: f"{name}: {value}", header, count=1)
    # append after the last field line of the first paragraph
    parts = header.split("\n\n", 1)
    first = parts[0].rstrip("\n") + f"\n{name}: {value}"
    return first + ("\n\n" + parts[1] if len(parts) > 1 else "\n\n")


def header(patch, base, date, changed):
    p = pathlib.Path(patch)
    text = p.read_text()
    head, diff = split_patch(text)
    new_head = set_field(head, "Base", base)
    if changed or new_head != head:
        new_head = set_field(new_head, "Last-Update", date)
    if new_head + diff != text:
        p.write_text(new_head + diff)
        print("changed")
    else:
        print("unchanged")


def series_drop(series, name):
    p = pathlib.Path(series)
    out, dropped = [], 0
    for line in p.read_text().splitlines(keepends=True):
        entry = re.sub(r"\s#.*", "", line).strip()
        if entry and not line.lstrip().startswith("#") and entry.split()[0] == name:
            dropped += 1
            continue
        out.append(line)
    if dropped != 1:
        sys.exit(f"series-drop: {name} appears {dropped} times in {series}")
    p.write_text("".join(out))


def touched(patch):
    return [l[6:].split("\t")[0].strip() for l in pathlib.Path(patch).read_text().splitlines()
            if l.startswith("+++ b/")]


def git(gitdir, *args, **kw):
    return subprocess.run(["git", "--git-dir", gitdir, *args], capture_output=True, check=False, **kw)


def blob_id(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def blob_mismatch(tree, gitdir, commit):
    tree = pathlib.Path(tree)
    r = git(gitdir, "ls-tree", "-r", "--full-tree", commit, "--", "megatron")
    if r.returncode:
        print(f"(cannot list {commit}: {r.stderr.decode().strip()})")
        return
    have = {}
    for line in r.stdout.decode().splitlines():
        meta, path = line.split("\t", 1)
        have[path] = meta.split()[2]
    bad = 0
    for f in sorted(tree.joinpath("megatron").rglob("*")):
        if not f.is_file():
            continue
        rel = f.relative_to(tree).as_posix()
        if rel in STAMPED:
            continue
        if have.get(rel) != blob_id(f.read_bytes()):
            print(rel)
            bad += 1
            if bad >= 20:
                print("...")
                return


def sdist_blobs(tree):
    tree = pathlib.Path(tree)
    for f in sorted(tree.joinpath("megatron").rglob("*")):
        if f.is_file():
            rel = f.relative_to(tree).as_posix()
            if rel not in STAMPED:
                yield rel, blob_id(f.read_bytes())


def missing_blobs(tree, gitdir):
    files = list(sdist_blobs(tree))
    r = git(gitdir, "cat-file", "--batch-check",
            input="".join(f"{oid}\n" for _, oid in files).encode())
    answers = r.stdout.decode().splitlines()
    for (rel, oid), answer in zip(files, answers):
        if answer.endswith(" missing"):
            print(f"{rel} (blob {oid[:10]})")


def version_of_commit(gitdir, commit):
    r = git(gitdir, "show", f"{commit}:megatron/core/package_info.py")
    if r.returncode:
        return
    ns = {}
    for key in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(rf"^{key}\s*=\s*(\d+)", r.stdout.decode(), re.M)
        if not m:
            return
        ns[key] = m.group(1)
    print(f"{ns['MAJOR']}.{ns['MINOR']}.{ns['PATCH']}")


def versions(gitdir):
    commits = sys.stdin.read().split()
    r = git(gitdir, "cat-file", "--batch",
            input="".join(f"{c}:megatron/core/package_info.py\n" for c in commits).encode())
    data, pos = r.stdout, 0
    for c in commits:
        end = data.index(b"\n", pos)
        head = data[pos:end].decode().split()
        pos = end + 1
        version = ""
        if len(head) == 3 and head[1] == "blob":
            size = int(head[2])
            text = data[pos:pos + size].decode(errors="replace")
            pos += size + 1
            parts = [re.search(rf"^{k}\s*=\s*(\d+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
            if all(parts):
                version = ".".join(m.group(1) for m in parts)
        print(c, version)


def main(argv):
    cmd, args = argv[0], argv[1:]
    if cmd == "pin-write":
        note1 = note2 = None
        rest = []
        i = 0
        while i < len(args):
            if args[i] in ("--note1", "--note2"):
                if args[i] == "--note1":
                    note1 = args[i + 1]
                else:
                    note2 = args[i + 1]
                i += 2
            else:
                rest.append(args[i])
                i += 1
        pin_write(rest[0], rest[1], rest[2:], note1, note2)
    elif cmd == "header":
        changed = "--changed" in args
        args = [a for a in args if a != "--changed"]
        header(*args, changed=changed)
    elif cmd == "series-drop":
        series_drop(*args)
    elif cmd == "tests-only":
        files = touched(args[0])
        sys.exit(0 if files and all(f.startswith("tests/") for f in files) else 1)
    elif cmd == "touches-tests":
        sys.exit(0 if any(f.startswith("tests/") for f in touched(args[0])) else 1)
    elif cmd == "blob-mismatch":
        blob_mismatch(*args)
    elif cmd == "version-of-commit":
        version_of_commit(*args)
    elif cmd == "missing-blobs":
        missing_blobs(*args)
    elif cmd == "versions":
        versions(*args)
    elif cmd == "hunk-lines":
        for line in pathlib.Path(args[0]).read_text().splitlines():
            if line.startswith(("@@", "+++ ")):
                print(line)
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main(sys.argv[1:])
