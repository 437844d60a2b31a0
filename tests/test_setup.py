"""Set-up is part of the two commands: make installs the system tools it needs as root, and as
another user stops before anything runs with one line saying what to install
(ci/install-system-deps.sh, make deps)."""
import os
import pathlib
import shutil
import subprocess

from shell import ROOT


def _bin_without(tmp_path, missing, uid):
    """A PATH with bash and coreutils, an `id` that reports uid, and no `missing` tools."""
    d = tmp_path / "bin"
    d.mkdir()
    for tool in ("bash", "env", "cat", "quilt", "patch", "xz"):
        found = shutil.which(tool)
        if tool not in missing and found:
            (d / tool).symlink_to(found)
    (d / "id").write_text(f"#!{shutil.which('bash')}\necho {uid}\n")
    (d / "id").chmod(0o755)
    (d / "apt-get").write_text(f"#!{shutil.which('bash')}\necho apt-get \"$@\" >> {tmp_path}/apt.log\n")
    (d / "apt-get").chmod(0o755)
    return str(d)


def run(tmp_path, missing, uid):
    path = _bin_without(tmp_path, missing, uid)
    return subprocess.run([shutil.which("bash"), str(ROOT / "ci" / "install-system-deps.sh")],
                          env=dict(os.environ, PATH=path), capture_output=True, text=True)


def test_missing_quilt_as_a_user_is_one_line_and_a_failure(tmp_path):
    proc = run(tmp_path, {"quilt"}, 1000)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "quilt" in lines[0] and "apt-get install -y quilt" in lines[0]
    assert not (tmp_path / "apt.log").exists()


def test_missing_tools_as_root_are_installed(tmp_path):
    proc = run(tmp_path, {"quilt", "xz"}, 0)
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "apt.log").read_text()
    assert "install -y -qq quilt xz-utils" in log


def test_nothing_missing_does_nothing(tmp_path):
    proc = run(tmp_path, set(), 1000)
    assert proc.returncode == 0 and proc.stderr == ""
    assert not (tmp_path / "apt.log").exists()


def test_make_runs_it_before_the_venv_and_the_build():
    text = (ROOT / "Makefile").read_text()
    assert "venv: deps" in text and "tree: venv" in text and "wheel: tree" in text
    assert "test: wheel" in text
