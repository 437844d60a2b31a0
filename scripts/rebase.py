"""rebase.py run TO: move the pin to another megatron-core and carry patches/series over
(make rebase TO=...).

  TO = a megatron-core version (0.19.2: PyPI channel) or a Megatron-LM git ref (main, a tag, a
  commit: git channel). pypi:X / git:X force the reading.
For a version, the sdist comes from PyPI (pip, hash-checked), and the script looks for the git
commit whose tree gives the same pristine tree (the core_vX.Y.Z tag, its parents, the release
branch; needs upstream/ filled); found -> both channels are pinned, else the pin is PyPI-only.
For a git ref, the pin is git-only (MCORE_VERSION and MCORE_SDIST_SHA256 empty).
Then, on the new pristine tree, each patch of patches/series in order, fuzz 0, gets one verdict:
  applies cleanly | applied only with offset or fuzz (refreshed, diff shown) |
  already in upstream (its reverse applies with -F0: dropped from series, file deleted) | conflicts
A conflict stops the rebase with exit 3: pin.env and patches/ are left as they were, the work tree
with the .rej files stays in build/rebase-<target>/ and the next step is printed.
On success pin.env, patches/ (refreshed, dropped, Base:/Last-Update: updated) and the upstream/
gitlink (checked out and staged) are rewritten in place; review with git diff / git status.
The verdict table also goes to build/rebase-<target>.log.
Options (make rebase's variables in brackets):
  --dry-run         [DRY_RUN=1] print the table, change nothing (pin, patches/, upstream/ untouched)
  --sha256 HEX      [SHA256=] expected sha256 of the PyPI sdist (else pip's index-checked download
                    is hashed)
  --git-commit REF  [GIT_COMMIT=] pair a PyPI version with this git commit (checked to give the
                    same tree)
  --sdist FILE      [REBASE_SDIST=] use this local sdist instead of PyPI (offline use, tests)
  --date Y-M-D      [REBASE_DATE=] the Last-Update: date (default: today, UTC)
The paths are lib.sh's, with its environment overrides (PIN_FILE, PATCHES, UPSTREAM, BUILD, CACHE,
VENV). The series, the tests-only rule and the patch/quilt options are scripts/series.py's.
"""
import argparse
import datetime
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import series as S  # noqa: E402  (scripts/series.py)
from pinfile import read_pin  # noqa: E402  (scripts/pinfile.py: the one pin reader)

ROOT = pathlib.Path(__file__).resolve().parents[1]
PIN_KEYS = ("MCORE_VERSION", "MCORE_SDIST_SHA256", "MCORE_GIT_COMMIT")
# files the release process stamps (PRE_RELEASE), so they may differ between git and the sdist
STAMPED = {
    "megatron/core/package_info.py",
    "megatron/core/distributed/fsdp/src/megatron_fsdp/package_info.py",
}
VERSION_RE = re.compile(r"^[0-9]+(\.[0-9]+)+((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?$")
# the options that were environment variables: (option, make variable, argparse dest)
OPTIONS = (("--dry-run", "DRY_RUN", "dry_run"), ("--git-commit", "GIT_COMMIT", "git_commit"),
           ("--sha256", "SHA256", "sha256"), ("--sdist", "REBASE_SDIST", "sdist"),
           ("--date", "REBASE_DATE", "date"))
VERDICTS = {  # after a conflict, on the probe tree
    "clean": "applies cleanly",
    "offset": "applied only with offset or fuzz (needs a refresh)",
    "upstream": "already in upstream (its reverse applies with -F0)",
    "conflict": "conflicts",
}


def die(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(1)


def env_path(name, default):
    """lib.sh's ${NAME:-default}."""
    return pathlib.Path(os.environ.get(name) or default)


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def run(cmd, **kw):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)


# ---- pin.env and DEP-3 header rewriting

def pin_write(old, new, values, note1, note2):
    """Write NEW: OLD with the pin values replaced; the comment lines under the "# Channel 1" and
    "# Channel 2" headings replaced by note1/note2 (None: keep the old notes; "": drop them)."""
    unknown = set(values) - set(PIN_KEYS)
    if unknown:
        raise ValueError(f"pin_write: unknown keys {sorted(unknown)}")
    notes = {"1": note1, "2": note2}
    out, seen, block = [], set(), None
    for line in pathlib.Path(old).read_text().splitlines():
        m = re.match(r"# Channel ([12])\b", line)
        if m:
            block = m.group(1)
            out.append(line)
            if notes[block]:
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
    """(header, diff) of a quilt patch: the diff starts at the first 'Index:' / 'diff ' line, or
    '--- ' line followed by '+++ '."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith(("Index: ", "diff ")) or (
                line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")):
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


def set_header(patch, base, date, changed):
    """Set the DEP-3 Base: field to BASE, and Last-Update: to DATE when the file changed otherwise
    (a new Base, or changed: a refreshed diff). True when the file was rewritten."""
    p = pathlib.Path(patch)
    text = p.read_text()
    head, diff = split_patch(text)
    new_head = set_field(head, "Base", base)
    if changed or new_head != head:
        new_head = set_field(new_head, "Last-Update", date)
    if new_head + diff == text:
        return False
    p.write_text(new_head + diff)
    return True


# ---- comparing a git commit with an unpacked sdist

def git(gitdir, *args, **kw):
    return subprocess.run(["git", "--git-dir", str(gitdir), *args], capture_output=True, **kw)


def blob_id(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def sdist_blobs(tree):
    tree = pathlib.Path(tree)
    for f in sorted(tree.joinpath("megatron").rglob("*")):
        if f.is_file():
            rel = f.relative_to(tree).as_posix()
            if rel not in STAMPED:
                yield rel, blob_id(f.read_bytes())


def blob_mismatch(tree, gitdir, commit):
    """The megatron/ files of TREE whose bytes differ from (or are missing in) COMMIT, the stamped
    package_info.py files aside (at most 20, then '...')."""
    r = git(gitdir, "ls-tree", "-r", "--full-tree", commit, "--", "megatron")
    if r.returncode:
        return [f"(cannot list {commit}: {r.stderr.decode().strip()})"]
    have = {}
    for line in r.stdout.decode().splitlines():
        meta, path = line.split("\t", 1)
        have[path] = meta.split()[2]
    bad = []
    for rel, oid in sdist_blobs(tree):
        if have.get(rel) != oid:
            bad.append(rel)
            if len(bad) >= 20:
                return bad + ["..."]
    return bad


def missing_blobs(tree, gitdir):
    """The megatron/ files of TREE whose exact bytes are in no object of GITDIR: if any, no commit
    there can match the sdist."""
    files = list(sdist_blobs(tree))
    r = git(gitdir, "cat-file", "--batch-check", input="".join(f"{o}\n" for _, o in files).encode())
    answers = r.stdout.decode().splitlines()
    return [f"{rel} (blob {oid[:10]})" for (rel, oid), answer in zip(files, answers)
            if answer.endswith(" missing")]


def _version(text):
    parts = [re.search(rf"^{k}\s*=\s*(\d+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else ""


def version_of_commit(gitdir, commit):
    """MAJOR.MINOR.PATCH from megatron/core/package_info.py at COMMIT ('' if unreadable)."""
    r = git(gitdir, "show", f"{commit}:megatron/core/package_info.py")
    return "" if r.returncode else _version(r.stdout.decode())


def versions(gitdir, commits):
    """{commit: MAJOR.MINOR.PATCH or ''}, in one git cat-file process."""
    r = git(gitdir, "cat-file", "--batch",
            input="".join(f"{c}:megatron/core/package_info.py\n" for c in commits).encode())
    data, pos, out = r.stdout, 0, {}
    for c in commits:
        end = data.index(b"\n", pos)
        head = data[pos:end].decode().split()
        pos = end + 1
        out[c] = ""
        if len(head) == 3 and head[1] == "blob":
            size = int(head[2])
            out[c] = _version(data[pos:pos + size].decode(errors="replace"))
            pos += size + 1
    return out


# ---- the rebase

class Fail(Exception):
    """An error once the log exists: to the log and stderr, exit 1."""


class Rebase:
    def __init__(self, a):
        self.a = a
        self.pin_file = env_path("PIN_FILE", ROOT / "pin.env")
        self.pin = read_pin(self.pin_file)
        self.upstream = env_path("UPSTREAM", ROOT / "upstream")
        self.build = env_path("BUILD", ROOT / "build")
        self.cache = env_path("CACHE", ROOT / ".cache")
        self.venv = env_path("VENV", ROOT / ".venv")
        self.patches = env_path("PATCHES", ROOT / "patches")
        self.py = self.venv / "bin" / "python"
        self.to = a.to
        self.dry = a.dry_run == "1"
        self.today = a.date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        if self.to.startswith(("pypi:", "git:")):
            self.kind, self.ref = self.to.split(":", 1)
        else:
            self.kind = "pypi" if VERSION_RE.match(self.to) else "git"
            self.ref = self.to
        label = re.sub(rb"[^A-Za-z0-9._-]", b"-", self.ref.encode()).decode()
        self.work = self.build / f"rebase-{label}"
        self.log = self.build / f"rebase-{label}.log"
        self.gitdir = self.build / "rebase-git"
        r = run(["git", "config", "-f", ROOT / ".gitmodules", "submodule.upstream.url"])
        self.url = r.stdout.strip() if r.returncode == 0 else ""
        self.have_history = False
        self.keep_work = False
        self.new_version = self.new_sha = self.new_commit = self.commit_how = self.git_note = ""

    # -- output
    def out(self, text=""):
        """The table and results: stdout and the log."""
        print(text, flush=True)
        with open(self.log, "a") as f:
            f.write(text + "\n")

    def info(self, text):
        with open(self.log, "a") as f:
            f.write(text + "\n")
        print(f"==> {text}", file=sys.stderr, flush=True)

    def to_log(self, text):
        with open(self.log, "a") as f:
            f.write(text)

    def rel(self, path):
        s, root = str(path), f"{ROOT}/"
        return s[len(root):] if s.startswith(root) else s

    def run_logged(self, cmd, **kw):
        """Run cmd with its stdout and stderr appended to the log; True when it succeeded."""
        with open(self.log, "a") as f:
            return subprocess.run([str(c) for c in cmd], stdout=f, stderr=f,
                                  stdin=subprocess.DEVNULL, **kw).returncode == 0

    def command_lines(self):
        """(this script's command line, the make command line) of this run."""
        envs = "".join(f"{v}={os.environ[v]} " for v, default in
                       (("PATCHES", ROOT / "patches"), ("PIN_FILE", ROOT / "pin.env"))
                       if os.environ.get(v) and os.environ[v] != str(default))
        opts, make = "", ""
        for opt, var, dest in OPTIONS:
            value = getattr(self.a, dest)
            if dest == "dry_run":
                if self.dry:
                    opts, make = opts + " --dry-run", make + " DRY_RUN=1"
            elif value:
                opts, make = opts + f" {opt} {value}", make + f" {var}={value}"
        return f"{envs}scripts/rebase.py run {self.to}{opts}", f"make rebase TO={self.to}{make}"

    def diff(self, a, b, label_a, label_b):
        return run(["diff", "-u", "--label", label_a, "--label", label_b, a, b]).stdout.rstrip("\n")

    # -- quilt, patch and the pristine trees
    def quilt(self, *args):
        env = dict(os.environ, **S.QUILT_SETTINGS, QUILT_PATCHES=str(self.wp),
                   QUILT_SERIES=str(self.quilt_series), QUILT_PC=".pc")
        return self.run_logged(["quilt", "--quiltrc", "-", *args], cwd=self.tree, env=env)

    @staticmethod
    def patch(tree, *args):
        """GNU patch in TREE: (succeeded, its output)."""
        p = run(["patch", "-d", tree, *args])
        return p.returncode == 0, (p.stdout + p.stderr).rstrip("\n")

    def pristine(self, channel, version, sha, commit, upstream, sdist, dest):
        """The pristine tree of a pin at dest, by the same pristine_tree.sh (a shadow copy of
        scripts/ outside this repository: its gitlink check, the old pin's, does not apply)."""
        fd, pin = tempfile.mkstemp(prefix="pin.", dir=self.tmp)
        with os.fdopen(fd, "w") as f:
            f.write(f"MCORE_VERSION={version}\nMCORE_SDIST_SHA256={sha}\n"
                    f"MCORE_GIT_COMMIT={commit}\nLOCAL_LABEL={self.pin.get('LOCAL_LABEL', '')}\n")
        env = dict(os.environ, PIN_FILE=pin, UPSTREAM=str(upstream), SDIST=str(sdist),
                   CHANNEL=channel, VENV=str(self.venv), CACHE=str(self.cache),
                   BUILD=str(self.tmp / "build"), DIST=str(self.tmp / "dist"),
                   PATCHES=str(self.patches), GIT_CEILING_DIRECTORIES=str(self.tmp))
        script = self.shadow / "scripts" / "pristine_tree.sh"
        with open(self.log, "a") as f:
            return subprocess.run(["bash", str(script), str(dest)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=f).returncode == 0

    # -- git history: a bare repository in build/ that borrows upstream/'s objects when filled
    def gitq(self, *args, logged=False):
        cmd = ["git", "--git-dir", self.gitdir, "-c", "protocol.file.allow=always", *args]
        return self.run_logged(cmd) if logged else run(cmd)

    def rev(self, r):
        """The commit r names in the rebase's repository, or None."""
        p = self.gitq("rev-parse", "-q", "--verify", f"{r}^{{commit}}")
        return p.stdout.strip() if p.returncode == 0 else None

    def submodule_filled(self):
        return ((self.upstream / ".git").exists()
                and run(["git", "-C", self.upstream, "rev-parse", "HEAD"]).returncode == 0)

    def init_git(self):
        if not self.gitdir.is_dir():
            subprocess.run(["git", "init", "-q", "--bare", str(self.gitdir)], check=True)
        if self.submodule_filled():
            common = run(["git", "-C", self.upstream, "rev-parse", "--path-format=absolute",
                          "--git-common-dir"]).stdout.strip()
            (self.gitdir / "objects" / "info" / "alternates").write_text(f"{common}/objects\n")
            self.have_history = True

    def resolve_ref(self, r):
        """The commit of REF, fetching it from the upstream URL if needed; None if not found."""
        if (re.fullmatch(r"[0-9a-f]{40}", r)
                and self.gitq("cat-file", "-e", f"{r}^{{commit}}").returncode == 0):
            return r
        depth = [] if self.have_history else ["--depth=1"]  # no history to borrow: fetch one commit
        if self.url and self.gitq("fetch", "-q", "--no-tags", *depth, self.url,
                                  f"+{r}:refs/rebase/target", logged=True):
            return self.rev("refs/rebase/target")
        c = self.rev(r)
        if c or not (self.url and re.fullmatch(r"[0-9a-f]{4,40}", r)):
            return c
        self.info(f"fetching all branches and tags of {self.url} to find commit {r}")
        self.gitq("fetch", "-q", "--no-tags", self.url, "+refs/heads/*:refs/rebase/heads/*",
                  "+refs/tags/*:refs/rebase/tags/*", logged=True)
        return self.rev(r)

    def checkout_commit(self, commit, dest):
        """A clean checkout of COMMIT at DEST (for pristine_tree.sh)."""
        if self.gitq("update-ref", f"refs/rebase/co-{commit}", commit).returncode:
            raise Fail(f"could not record {commit} in {self.gitdir}")
        clone = run(["git", "-c", "protocol.file.allow=always", "clone", "-q", "--shared",
                     "--no-checkout", self.gitdir, dest])
        self.to_log("".join(l for l in clone.stderr.splitlines(keepends=True)
                            if "cloned an empty repository" not in l))
        if clone.returncode or not self.run_logged(
                ["git", "-C", dest, "-c", "advice.detachedHead=false", "checkout", "-q", "--detach",
                 commit]):
            raise Fail(f"could not check out {commit} at {dest} (see {self.log})")

    def date_of(self, commit):
        p = self.gitq("log", "-1", "--format=%cs", commit)
        return p.stdout.strip() if p.returncode == 0 else ""

    # -- the new pristine tree
    def sdist(self, ver):
        """(the sdist of VER, the same if it was downloaded else None)"""
        name, sha = f"megatron_core-{ver}.tar.gz", self.a.sha256
        if self.a.sdist:
            if not pathlib.Path(self.a.sdist).is_file():
                raise Fail(f"--sdist {self.a.sdist}: no such file")
            self.info(f"using the local sdist {self.a.sdist} (--sdist)")
            return pathlib.Path(self.a.sdist), None
        cached = self.cache / name
        if sha and cached.is_file() and sha256_of(cached) == sha:
            return cached, None
        dl = self.work / "dl"
        dl.mkdir(parents=True, exist_ok=True)
        pip = [self.py, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
               "--no-deps", "--no-binary", ":all:", "-d", dl]
        if sha:
            (self.work / "req.txt").write_text(f"megatron-core=={ver} --hash=sha256:{sha}\n")
            self.info(f"downloading megatron-core {ver} sdist from PyPI "
                      f"(pip, --require-hashes {sha})")
            if not self.run_logged(pip + ["--require-hashes", "-r", self.work / "req.txt"]):
                raise Fail(f"pip could not download megatron-core=={ver} with sha256 {sha} "
                           f"(see {self.log})")
        else:
            self.info(f"downloading megatron-core {ver} sdist from PyPI (pip checks the index's "
                      "sha256; pass --sha256 (make: SHA256=) to pin it yourself)")
            if not self.run_logged(pip + [f"megatron-core=={ver}"]):
                raise Fail(f"pip could not download the megatron-core=={ver} sdist (no such "
                           f"version on PyPI, or no network; see {self.log})")
        if not (dl / name).is_file():
            raise Fail(f"pip did not produce {name} (got: {' '.join(sorted(os.listdir(dl)))})")
        return dl / name, dl / name

    def find_commit(self, ver, want):
        """The git channel of a PyPI version: which commit gives the sdist's tree? Sets
        new_commit and commit_how, or git_note."""
        new, cands, tried = self.work / "new", [], set()

        def add(r, how):
            c = self.rev(r)
            if c and c not in (x for x, _ in cands):
                cands.append((c, how))

        def try_cands():
            for c, how in list(cands):
                if c in tried:
                    continue
                tried.add(c)
                cv = version_of_commit(self.gitdir, c)
                if cv != want and not self.a.git_commit:
                    self.info(f"candidate {c[:10]} ({how}): its package_info.py says "
                              f"{cv or 'nothing'}, not {ver}")
                    continue
                bad = blob_mismatch(new, self.gitdir, c)
                if bad:
                    self.info(f"candidate {c[:10]} ({how}): differs from the sdist in {len(bad)} "
                              f"file(s), e.g. {bad[0]}")
                    continue
                co, dest = self.tmp / f"co-{c[:12]}", self.tmp / f"git-{c[:12]}"
                self.checkout_commit(c, co)
                if not self.pristine("git", ver, self.new_sha, c, co, "", dest):
                    self.info(f"candidate {c[:10]} ({how}): the git channel does not give version "
                              f"{ver} (see {self.log})")
                    continue
                d = run(["diff", "-r", new, dest])
                if d.returncode == 0:
                    self.new_commit, self.commit_how = c, how
                    self.info(f"git channel: {c[:10]} ({how}) gives the same pristine tree as the "
                              f"{ver} sdist")
                    return True
                first = "\n".join((d.stdout + d.stderr).splitlines()[:3])
                self.info(f"candidate {c[:10]} ({how}): pristine trees differ: {first}")
            return False

        given = self.a.git_commit
        if given:
            self.init_git()
            c = self.resolve_ref(given)
            if not c:
                raise Fail(f"--git-commit {given}: no such commit in upstream/ or at {self.url}")
            add(c, f"given as --git-commit {given}")
            if not try_cands():
                raise Fail(f"--git-commit {given} does not give the same pristine tree as the "
                           f"{ver} sdist (see {self.log})")
        elif not self.submodule_filled():
            self.git_note = "upstream/ is not filled, so no Megatron-LM history was searched"
        else:
            self.init_git()
            missing = missing_blobs(new, self.gitdir)
            if missing:
                self.info(f"the {ver} sdist has files whose exact content is in no commit of the "
                          "local Megatron-LM history:")
                for line in missing[:5]:
                    self.info(f"  {line}")
                self.git_note = (f"{len(missing)} of its megatron/ files are in no commit of the "
                                 "local Megatron-LM history")
            else:
                # 1. the release tags and their parents; 2. release-branch commits of this version
                for t in (f"core_v{ver}", f"v{ver}"):
                    self.gitq("fetch", "-q", "--no-tags", self.url,
                              f"+refs/tags/{t}:refs/rebase/tags/{t}")
                    if self.rev(f"refs/rebase/tags/{t}"):
                        add(f"refs/rebase/tags/{t}", f"tag {t}")
                        add(f"refs/rebase/tags/{t}^", f"the parent of tag {t}")
                        add(f"refs/rebase/tags/{t}^^", f"the grandparent of tag {t}")
                if not try_cands():
                    vmaj, vmin = want.split(".")[:2]
                    for b in (f"core_r{vmaj}.{vmin}.0", f"core_r{ver}"):
                        ref = f"refs/rebase/heads/{b}"
                        if self.gitq("fetch", "-q", "--no-tags", self.url,
                                     f"+refs/heads/{b}:{ref}").returncode:
                            continue
                        commits = self.gitq("rev-list", "--first-parent", "-n", "300",
                                            ref).stdout.split()
                        for c, v in versions(self.gitdir, commits).items():
                            if v == want:
                                add(c, f"on branch {b}")
                    if not try_cands():
                        self.git_note = (f"no tag core_v{ver} / v{ver} (or its parents) nor "
                                         f"release-branch commit of version {ver} gives the "
                                         f"sdist's tree (tried {len(cands)})")
        if not self.new_commit:
            self.info(f"only the PyPI channel is known for {ver}: {self.git_note}")

    def new_tree(self, new):
        """The new pristine tree at NEW and what the new pin will say; the sdist downloaded, if
        any."""
        downloaded = None
        if self.kind == "pypi":
            ver = self.ref
            base = re.split(r"[a-z]", ver, maxsplit=1)[0].split(".") + ["", ""]
            sdist_file, downloaded = self.sdist(ver)
            self.new_version = ver
            self.new_sha = sha256_of(sdist_file)
            if self.a.sha256 and self.new_sha != self.a.sha256:
                raise Fail(f"{sdist_file}: sha256 {self.new_sha}, not --sha256 {self.a.sha256}")
            if not self.pristine("sdist", ver, self.new_sha, "", "/nonexistent", sdist_file, new):
                raise Fail(f"could not lay out the {ver} sdist as a pristine tree (see {self.log})")
            self.find_commit(ver, f"{base[0]}.{base[1]}.{base[2] or 0}")
        else:
            self.init_git()
            if not self.have_history and not self.url:
                raise Fail("no Megatron-LM history: fill upstream/ "
                           "(git submodule update --init upstream)")
            self.new_commit = self.resolve_ref(self.ref)
            if not self.new_commit:
                raise Fail(f"git ref '{self.ref}' not found in upstream/ nor at {self.url}")
            self.commit_how = self.ref
            self.checkout_commit(self.new_commit, self.tmp / "co")
            if not self.pristine("git", "", "", self.new_commit, self.tmp / "co", "", new):
                raise Fail(f"could not lay out Megatron-LM {self.new_commit} as a pristine tree "
                           f"(see {self.log})")
            self.info(f"the pin will be git-only: {self.ref} is Megatron-LM {self.new_commit}, "
                      "which has no PyPI sdist pinned (a release: TO=<version> GIT_COMMIT=<ref> "
                      "pins both channels)")
        v = run([self.py, "-c", "import runpy; print(runpy.run_path("
                 "'megatron/core/package_info.py')['__version__'])"],
                cwd=new, env=dict(os.environ, NO_VCS_VERSION="1"))
        if v.returncode:
            raise Fail(f"cannot read the new tree's package version: {v.stderr.strip()}")
        self.pkg_version = v.stdout.strip()
        return downloaded

    def describe_pin(self, version, commit):
        if version and commit:
            return f"megatron-core {version} (git {commit})"
        if version:
            return f"megatron-core {version} (PyPI sdist only; no git commit known)"
        return f"Megatron-LM git {commit} (package version {self.pkg_version}; no PyPI sdist)"

    def name_pins(self):
        """What the old and new pins are called in the table and in the patch headers."""
        self.old_desc = self.describe_pin(self.pin.get("MCORE_VERSION", ""),
                                          self.pin.get("MCORE_GIT_COMMIT", ""))
        self.base = self.describe_pin(self.new_version, self.new_commit)
        c, c10 = self.new_commit, self.new_commit[:10]
        if self.kind == "git" and c and self.ref != c:
            self.base = (f"Megatron-LM git {c} ({self.ref} on {self.date_of(c)}; package version "
                         f"{self.pkg_version}; no PyPI sdist)")
        if self.kind == "pypi":
            self.short = f"megatron-core {self.new_version}"
        elif self.ref == c:
            self.short = f"Megatron-LM {c10}"
        else:
            self.short = f"Megatron-LM {c10}" + (f" ({self.commit_how})" if self.commit_how else "")

    # -- the series, carried over
    def carry(self):
        """Each patch's verdict (self.rows), with series.py's quilt settings, on copies in the
        work dir; after a conflict, verdicts only, on a probe tree without the conflicting patch."""
        self.tree = tree = self.work / "tree"
        (self.work / "new").rename(tree)
        plist = S.series(self.patches)
        # upstream's tests/ (git channel only), for patches that touch them
        self.tests_added = bool(self.new_commit) and any(
            S.touches_tests(self.patches / p) for p in plist if (self.patches / p).is_file())
        if self.tests_added:
            arch = git(self.gitdir, "archive", self.new_commit, "tests")
            if arch.returncode or subprocess.run(["tar", "-x", "-C", str(tree)],
                                                 input=arch.stdout).returncode:
                raise Fail(f"could not add upstream's tests/ of {self.new_commit} to the tree")
        self.wp = wp = self.work / "patches"
        shutil.copytree(self.patches, wp, symlinks=True)
        self.quilt_series = self.work / "series.pushed"
        self.quilt_series.write_text("")
        (self.work / "quiltrc").write_text(
            "# quilt settings of this rebase (scripts/series.py's stable ones): "
            f"quilt --quiltrc {self.work}/quiltrc ...\n"
            f"QUILT_PATCHES={wp}\nQUILT_SERIES={self.quilt_series}\n"
            + "".join(f'{k}="{v}"\n' for k, v in S.QUILT_SETTINGS.items()))
        self.rows, self.dropped, self.refreshed, self.conflicted = [], [], [], ""
        probe = self.work / "probe"
        for p in plist:
            f = wp / p
            if not f.is_file():
                raise Fail(f"patches/series names {p}, which is not in patches/")
            d, suffix = tree, ""
            if self.conflicted:
                d, suffix = probe, f" [checked without {self.conflicted}]"
            if S.tests_only(f) and not (d / "tests").is_dir():
                self.rows.append((p, "kept, not checked (tests only; no upstream tests/ for this "
                                     f"target: the pin has no git commit){suffix}"))
                continue
            ok, o = self.patch(d, "--dry-run", "-N", *S.PATCH_ARGS, "-i", f)
            if ok:
                verdict = "offset" if re.search("offset|fuzz", o) else "clean"
            else:
                ok_r, r = self.patch(d, "--dry-run", "-R", *S.PATCH_ARGS, "-i", f)
                verdict = "upstream" if ok_r else "conflict"
                self.to_log(f"--- {p}: forward (-F0 -N) dry run:\n{o}\n"
                            f"--- reverse (-R -F0) dry run:\n{r}\n")
            if self.conflicted:
                if verdict in ("clean", "offset"):
                    self.patch(probe, "-N", *S.PATCH_ARGS, "-s", "-i", f)
                self.rows.append((p, VERDICTS[verdict] + suffix))
            elif verdict in ("clean", "offset"):
                self.push(p, verdict, o)
            elif verdict == "upstream":
                S.drop(wp / "series", p)
                f.unlink()
                self.dropped.append(p)
                self.rows.append((p, "already in upstream (its reverse applies with -F0: dropped "
                                     "from series, file deleted)"))
            else:
                self.conflicted = p
                shutil.copytree(tree, probe, symlinks=True)
                ok2, fz = self.patch(tree, "--dry-run", "-N", *S.patch_args(2), "-i", f)
                if ok2:
                    hint = "it would apply with fuzz 2 (the context changed near a hunk)"
                else:
                    failed = re.findall(r"[0-9]+ out of [0-9]+ hunks? FAILED", fz)
                    hint = ",".join(m.replace(" FAILED", " fail") for m in failed)
                    hint += " even with fuzz 2"
                with open(self.quilt_series, "a") as s:
                    s.write(p + "\n")
                self.quilt("push", "-f", "-q")
                self.rows.append((p, f"conflicts ({hint})"))
        shutil.rmtree(probe, ignore_errors=True)

    def push(self, p, verdict, dry_run_output):
        """quilt push a patch that applies; refresh it when it needed an offset or fuzz."""
        with open(self.quilt_series, "a") as s:
            s.write(p + "\n")
        if not self.quilt("push", "-q"):
            raise Fail(f"quilt push {p} failed after a clean dry run (see {self.log})")
        if verdict == "clean":
            self.rows.append((p, "applies cleanly"))
            return
        self.to_log(f"--- {p}: forward dry run (-F0):\n{dry_run_output}\n")
        if not self.quilt("refresh"):
            raise Fail(f"quilt refresh {p} failed (see {self.log})")
        self.refreshed.append(p)
        self.rows.append((p, "applied only with offset or fuzz (refreshed, diff shown)"))

    # -- the table and what follows
    def table(self):
        out = self.out
        out()
        out(f"from: {self.old_desc}")
        out(f"to:   {self.base}")
        if self.kind == "pypi":
            out(f"      PyPI sdist megatron_core-{self.new_version}.tar.gz sha256 {self.new_sha}")
            if self.new_commit:
                out(f"      git channel: {self.new_commit} ({self.commit_how})")
            else:
                out(f"      git channel: unknown ({self.git_note}); the pin would be PyPI-only")
        else:
            out(f"      git-only pin (no PyPI sdist); package version {self.pkg_version}")
        if self.tests_added:
            out(f"      upstream tests/ from {self.new_commit} added to the tree (for tests-only "
                "patches)")
        out()
        w = max((len(n) for n, _ in self.rows), default=0)
        for n, v in self.rows:
            out(f"  {n:<{w}}  {v}")
        out()
        for p in self.refreshed:
            out(f"refreshed {p} (old -> new; only the placement of its hunks moved):")
            out(self.diff(self.patches / p, self.wp / p, f"patches/{p}",
                          f"patches/{p} (refreshed)"))
            out()
        for p in self.dropped:
            origin = next((l for l in (self.patches / p).read_text().splitlines()
                           if l.startswith("Origin:")), "no Origin: field")
            out(f"dropped {p}: its reverse applies with -F0 to the new pristine tree, so "
                f"{self.short} already has this change ({origin}).")
            out(f'  commit message line: "Drop {p}: in upstream since {self.short}"')
            out()

    def report_conflict(self):
        """Nothing changes; the work tree stays, with the next step printed. Exit 3."""
        out, p, short, t = self.out, self.conflicted, self.short, self.rel(self.tree)
        self.keep_work = True
        out(f"CONFLICT: {p} does not apply with fuzz 0 to {short}, and {short} does not have it "
            "either.")
        out("Nothing was changed: pin.env and patches/ are as they were.")
        out(f"The work tree {t} has the series pushed up to {p} (forced), rejected hunks in:")
        for r in sorted(x.relative_to(self.tree).as_posix() for x in self.tree.rglob("*.rej")):
            if not r.startswith(".pc/"):
                out(f"    {t}/{r}")
        out("Next step:")
        out(f"  cd {t}")
        out("  # port each rejected hunk by hand into the file next to its .rej, delete the .rej, "
            "then")
        out(f"  quilt --quiltrc ../quiltrc refresh            # writes {self.rel(self.wp)}/{p}")
        out(f"  cp ../patches/{p} {self.patches}/   # the ported patch (it fits the new pin only)")
        out(f"  {self.command_lines()[1]}   # again, from the top; it must now apply")
        out(f"Log: {self.rel(self.log)}")
        return 3

    def new_pin(self):
        """pin.env as it will be, in the work dir."""
        new_pin, today, c = self.work / "pin.env", self.today, self.new_commit
        if self.kind == "pypi":
            note1 = ""
            if c:
                note2 = (f"{c[:8]} ({self.commit_how}) gives the same pristine tree as the "
                         f"{self.new_version} sdist (make rebase, {today}).")
            else:
                note2 = (f"Empty: no known Megatron-LM commit gives the {self.new_version} sdist's "
                         f"tree (make rebase, {today}), so the pin\nis PyPI-only; the upstream/ "
                         "gitlink is not part of it until this is set (make rebase "
                         f"TO={self.new_version} GIT_COMMIT=<commit>).")
        else:
            note1 = (f"Empty: the pin is git-only: Megatron-LM {c} has no PyPI sdist pinned "
                     f"(make rebase, {today}).")
            note2 = (f"{self.ref} as of {self.date_of(c)}: Megatron-LM {c[:10]}, package version "
                     f"{self.pkg_version} (make rebase, {today}).")
        pin_write(self.pin_file, new_pin, {
            "MCORE_VERSION": self.new_version,
            "MCORE_SDIST_SHA256": self.new_sha if self.new_version else "",
            "MCORE_GIT_COMMIT": c}, note1, note2)
        old_v, new_v = self.pin.get("MCORE_VERSION", ""), self.new_version or self.pkg_version
        if old_v:  # "0.19.0+<label>" in the comments
            new_pin.write_text(re.sub(rf"^(#.*): {re.escape(old_v)}\+<label>",
                                      lambda m: f"{m.group(1)}: {new_v}+<label>",
                                      new_pin.read_text(), flags=re.M))
        return new_pin

    def rewrite(self, downloaded):
        """Success: the strict check (apply_patches.sh, zero offset) on the new tree, then pin.env,
        patches/ and the upstream/ gitlink rewritten (or, in a dry run, only shown)."""
        out, wp = self.out, self.wp
        if not self.quilt("pop", "-a", "-q"):
            raise Fail(f"quilt pop -a failed in {self.tree} (see {self.log})")
        shutil.rmtree(self.tree / ".pc", ignore_errors=True)
        new_pin = self.new_pin()
        for p in S.series(wp):
            set_header(wp / p, self.base, self.today, p in self.refreshed)
        # the series as the build will apply it: must pass apply_patches.sh (fuzz 0, no offset)
        check = ["bash", self.shadow / "scripts" / "apply_patches.sh", "--check", self.tree]
        if not self.run_logged(check, env=dict(os.environ, PIN_FILE=str(new_pin), PATCHES=str(wp),
                                               VENV=str(self.venv))):
            raise Fail("the carried-over series fails apply_patches.sh --check on the new tree "
                       f"(see {self.log})")
        out("pin.env would become:")
        out(self.diff(self.pin_file, new_pin, "pin.env", "pin.env (new)"))
        n_kept = len(self.rows) - len(self.dropped) - len(self.refreshed)
        summary = (f"{n_kept} kept as is, {len(self.refreshed)} refreshed, "
                   f"{len(self.dropped)} dropped")
        if self.dry:
            out()
            out(f"DRY RUN: nothing changed ({summary}). Without --dry-run (DRY_RUN=1) pin.env, "
                "patches/ and the upstream/ gitlink are rewritten.")
            out(f"Log: {self.rel(self.log)}")
            return 0
        gitlink_msg = self.move_gitlink()  # the step that can fail first, then the files
        shutil.copy(new_pin, self.pin_file)
        for p in self.dropped:
            (self.patches / p).unlink(missing_ok=True)
        for p in S.series(wp):
            shutil.copy(wp / p, self.patches / p)
        shutil.copy(wp / "series", self.patches / "series")
        if downloaded:
            self.cache.mkdir(parents=True, exist_ok=True)
            shutil.copy(downloaded, self.cache)
        out()
        out(f"REBASED ({summary}): pin.env and patches/ rewritten; {gitlink_msg}.")
        out(f"LOCAL_LABEL is still {self.pin.get('LOCAL_LABEL', '')}. Review: git status; "
            "git diff. Then: make check-patches && make test.")
        out(f"Log: {self.rel(self.log)}")
        return 0

    def move_gitlink(self):
        """Check out and stage the new upstream/ gitlink; what happened, in words."""
        def gitlink():
            r = run(["git", "-C", ROOT, "ls-files", "-s", "--", "upstream"])
            links = [l.split()[1] for l in r.stdout.splitlines() if l.startswith("160000 ")]
            return links[0] if links else ""

        top = run(["git", "-C", ROOT, "rev-parse", "--show-toplevel"])
        in_repo = (top.returncode == 0 and bool(gitlink())
                   and os.path.realpath(top.stdout.strip()) == os.path.realpath(ROOT))
        c = self.new_commit
        if not in_repo:
            return "upstream/ gitlink unchanged"
        if not c:
            return f"upstream/ gitlink left at {gitlink()} (not part of a PyPI-only pin)"
        if gitlink() == c:
            return "upstream/ gitlink unchanged"
        up = ["git", "-C", self.upstream]
        if self.submodule_filled():
            if run(up + ["status", "--porcelain"]).stdout.strip():
                raise Fail("upstream/ has local changes; clean it before the rebase moves it "
                           "(nothing was changed)")
            if run(up + ["cat-file", "-e", f"{c}^{{commit}}"]).returncode:
                fetch = up + ["-c", "protocol.file.allow=always", "fetch", "-q", self.gitdir,
                              "refs/rebase/pinned"]
                if (self.gitq("update-ref", "refs/rebase/pinned", c).returncode
                        or not self.run_logged(fetch)):
                    raise Fail(f"could not fetch {c} into upstream/ (nothing was changed; "
                               f"see {self.log})")
            checkout = up + ["-c", "advice.detachedHead=false", "checkout", "-q", "--detach", c]
            if run(checkout).returncode:
                raise Fail(f"could not check out {c} in upstream/ (nothing was changed)")
        stage = ["git", "-C", ROOT, "update-index", "--cacheinfo", f"160000,{c},upstream"]
        if run(stage).returncode:
            raise Fail("could not stage the upstream/ gitlink (nothing else was changed)")
        msg = f"upstream/ gitlink -> {c} (staged: git diff --cached upstream)"
        return msg if self.submodule_filled() else msg + "; then: git submodule update upstream"


def cmd_run(a):
    for opt, var, dest in OPTIONS:  # the old environment interface is refused, not ignored
        value, given = os.environ.get(var, ""), getattr(a, dest) or ""
        if value and value != given and var != "GIT_COMMIT":  # CI systems export a GIT_COMMIT
            die(f"{var}={value} is in the environment, but scripts/rebase.py reads only its "
                f"options: pass {opt}{'' if dest == 'dry_run' else ' ' + value} "
                f"(make rebase TO=... {var}={value} does)")
    if not a.to:
        die("usage: make rebase TO=<megatron-core version | Megatron-LM git ref> [DRY_RUN=1] "
            "[SHA256=<hex>] [GIT_COMMIT=<ref>]")
    if a.date:
        try:
            datetime.date.fromisoformat(a.date)
        except ValueError:
            die(f"--date {a.date}: not a Y-M-D date")
    if not shutil.which("patch"):
        die("GNU patch not found. Install it from Debian's packages: apt-get install -y patch")
    if not shutil.which("quilt"):
        die("quilt not found. Install it from Debian's packages: apt-get update && "
            "apt-get install -y quilt")
    rb = Rebase(a)
    if not os.access(rb.py, os.X_OK):
        die(f"no virtual environment at {rb.venv}: run 'make venv' first")
    rb.build.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(rb.work, ignore_errors=True)
    rb.work.mkdir(parents=True)
    rb.tmp = pathlib.Path(tempfile.mkdtemp(prefix="rebase.", dir=os.environ.get("TMPDIR") or None))
    try:
        rb.log.write_text("")
        cmd, make = rb.command_lines()
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        rb.out(f"# {cmd}   ({make}; {now} UTC)")
        # the new pin's pristine trees come from a shadow copy of scripts/ (see pristine())
        rb.shadow = rb.tmp / "root"
        shutil.copytree(ROOT / "scripts", rb.shadow / "scripts", symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
        downloaded = rb.new_tree(rb.work / "new")
        rb.name_pins()
        rb.carry()
        rb.table()
        return rb.report_conflict() if rb.conflicted else rb.rewrite(downloaded)
    except Fail as e:
        print(f"error: {e}", file=sys.stderr)
        rb.to_log(f"error: {e}\n")
        return 1
    finally:
        shutil.rmtree(rb.tmp, ignore_errors=True)
        if not rb.keep_work:
            shutil.rmtree(rb.work, ignore_errors=True)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="scripts/rebase.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="move the pin to TO and carry the series over (make rebase)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("to", metavar="TO", help="a megatron-core version or a Megatron-LM git ref "
                                            "(pypi:X / git:X force the reading)")
    r.add_argument("--dry-run", nargs="?", const="1", default="0", choices=("0", "1"),
                   help="print the table, change nothing (make: DRY_RUN=1)")
    r.add_argument("--git-commit", metavar="REF",
                   help="pair a PyPI version with this Megatron-LM commit (make: GIT_COMMIT=)")
    r.add_argument("--sha256", metavar="HEX",
                   help="expected sha256 of the PyPI sdist (make: SHA256=)")
    r.add_argument("--sdist", metavar="FILE",
                   help="a local sdist instead of PyPI (make: REBASE_SDIST=)")
    r.add_argument("--date", metavar="Y-M-D",
                   help="the Last-Update: date (default today, UTC; make: REBASE_DATE=)")
    a = ap.parse_args(argv)
    return cmd_run(a)


if __name__ == "__main__":
    sys.exit(main())
