"""scripts/gpu_run.sh fails when any job it runs fails (a GPU test, a benchmark, a kernel A/B, a
sanitizer run), and only then: every job is run here with a stand-in python (and a stand-in
compute-sanitizer) that fails on demand, on a machine without a GPU."""
import os
import shutil
import subprocess

import pytest

from shell import ROOT

FAKE_PY = r"""#!/usr/bin/env bash
# stand-in python for gpu_run.sh: FAIL names the job that fails
args="$*"
fail() { [[ " $FAIL " == *" $1 "* ]] && exit 3; exit 0; }
case "$args" in
  *"sys.version_info"*) echo cp312 ;;
  *"import xdist"*) [ -z "${NO_XDIST:-}" ] || exit 1 ;;
  *bench/precompile.py*) [ -z "${PRECOMPILE_LOG:-}" ] || echo "$args" >>"$PRECOMPILE_LOG"; fail precompile ;;
  *bench/bwd_variants.py*) fail variants ;;
  *bench/fwd_variants.py*) fail fwd ;;
  *bench/host_profile.py*) fail host ;;
  *bench/bench.py*) fail bench ;;
  *"-m pytest tests/gpu"*)
    # one [argument] each, so that quoting shows
    [ -z "${TESTS_LOG:-}" ] || { printf '[%s]' "$@"; echo; } >>"$TESTS_LOG"
    echo "1 passed"
    # a pass's own status (WHOLE_STATUS: the whole_gpu pass, PASS_STATUS: the other)
    case "$args" in *"-m whole_gpu"*) st=${WHOLE_STATUS:-0} ;; *) st=${PASS_STATUS:-0} ;; esac
    [ "$st" = 0 ] || exit "$st"
    fail tests ;;
  *bench/sanitize_*) [ -z "${ARGS_LOG:-}" ] || echo "$args" >>"$ARGS_LOG"; fail sanitize ;;
esac
exit 0
"""

FAKE_CS = r"""#!/usr/bin/env bash
# stand-in compute-sanitizer: runs the program (the stand-in python) and reports
[ -z "${ARGS_LOG:-}" ] || echo "compute-sanitizer $2" >>"$ARGS_LOG"
shift 4  # --tool T --error-exitcode 1: the program and its arguments follow
"$@" || exit
# CS_FAIL: the tool finds an error
[ -z "${CS_FAIL:-}" ] || { echo "========= ERROR SUMMARY: 1 error"; exit 1; }
echo "========= ERROR SUMMARY: 0 errors"
"""


def run(tmp_path, jobs, fail="", **env_extra):
    for name, text in (("python", FAKE_PY), ("compute-sanitizer", FAKE_CS)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    (tmp_path / "fake.whl").write_text("")
    env = dict(os.environ, PYTHON=str(tmp_path / "python"), FAIL=fail,
               COMPUTE_SANITIZER=str(tmp_path / "compute-sanitizer"),
               INSTALL_SITE=str(tmp_path / "site"), TEST_WHEEL=str(tmp_path / "fake.whl"),
               **env_extra)
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_run.sh"), jobs, str(tmp_path / "out")],
                          env=env, cwd=ROOT, capture_output=True, text=True)


ALL = "tests variants fwd host bench sanitize"


def test_all_jobs_passing_exit_0(tmp_path):
    proc = run(tmp_path, ALL)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "FAILED" not in proc.stdout


@pytest.mark.parametrize("job", ["tests", "variants", "fwd", "host", "bench", "sanitize"])
def test_any_failed_job_fails_the_command(tmp_path, job):
    proc = run(tmp_path, ALL, fail=job)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "FAILED" in proc.stdout.splitlines()[-1]


def test_a_failed_job_is_not_hidden_by_a_later_passing_one(tmp_path):
    proc = run(tmp_path, ALL, fail="variants")  # the tests job runs after it and passes
    assert proc.returncode != 0
    assert "[FAILED: variants]" in proc.stdout


def test_sanitize_runs_pass_their_arguments_and_keep_each_log(tmp_path):
    """SANITIZE_RUNS' ARGS are comma-separated (a draft's option for the same script), and a
    second run of the same tool and script gets a log of its own."""
    runs = "racecheck:sanitize_native:--quick racecheck:sanitize_native:--quick,--option,x=True"
    proc = run(tmp_path, "sanitize", SANITIZE_RUNS=runs, ARGS_LOG=str(tmp_path / "args"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # each run once without the sanitizer (its kernels compile there), then under it
    one, two = "bench/sanitize_native.py --quick", "bench/sanitize_native.py --quick --option x=True"
    assert (tmp_path / "args").read_text().splitlines() == [
        one, "compute-sanitizer racecheck", one, two, "compute-sanitizer racecheck", two]
    logs = sorted(p.name for p in (tmp_path / "out").glob("sanitizer-*.log"))
    assert logs == ["sanitizer-racecheck-sanitize_native-2.log", "sanitizer-racecheck-sanitize_native.log"]


def test_the_run_without_the_sanitizer_and_the_sanitized_run_share_a_log(tmp_path):
    proc = run(tmp_path, "sanitize", SANITIZE_RUNS="memcheck:sanitize_native:--quick")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = (tmp_path / "out" / "sanitizer-memcheck-sanitize_native.log").read_text()
    assert text.index("without the sanitizer") < text.index("under compute-sanitizer --tool memcheck")
    assert "ERROR SUMMARY: 0 errors" in text


def test_an_error_the_sanitizer_finds_fails_the_job(tmp_path):
    proc = run(tmp_path, "sanitize", SANITIZE_RUNS="memcheck:sanitize_native", CS_FAIL="1")
    assert proc.returncode != 0
    assert "[FAILED: sanitizer memcheck sanitize_native]" in proc.stdout
    assert "its run without the sanitizer" not in proc.stdout


def test_a_script_failing_without_the_sanitizer_fails_the_job_before_it(tmp_path):
    proc = run(tmp_path, "sanitize", fail="sanitize", SANITIZE_RUNS="memcheck:sanitize_native",
               ARGS_LOG=str(tmp_path / "args"))
    assert proc.returncode != 0 and "its run without the sanitizer" in proc.stdout
    assert (tmp_path / "args").read_text().splitlines() == ["bench/sanitize_native.py"]
    assert "without the sanitizer" in (tmp_path / "out" / "sanitizer-memcheck-sanitize_native.log").read_text()


def test_a_failed_precompile_stops_before_the_jobs(tmp_path):
    proc = run(tmp_path, "tests", fail="precompile")
    assert proc.returncode != 0 and "precompile failed" in proc.stderr


def test_upstream_without_carried_tests_fails(tmp_path):
    if (ROOT / ".upt" / "tests").is_dir():
        pytest.skip(".upt/ is carried here; this case needs a tree without it")
    proc = run(tmp_path, "upstream")
    assert proc.returncode != 0 and "no .upt/" in proc.stderr


@pytest.mark.parametrize("wheels", [0, 1, 2])
def test_dist_must_hold_exactly_one_wheel_for_the_python(tmp_path, wheels):
    """Without TEST_WHEEL the script installs dist/'s wheel for its Python: none is an error, and so
    are two (an older build left beside the new one would be measured in its place)."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu_run.sh", root / "scripts" / "gpu_run.sh")
    (root / "dist").mkdir()
    for label in ("glm53nope.1", "glm53nope.2")[:wheels]:
        (root / "dist" / f"megatron_core-0.19.0+{label}-cp312-cp312-linux_x86_64.whl").write_text("")
    (root / "dist" / "megatron_core-0.19.0+glm53nope.3-cp313-cp313-linux_x86_64.whl").write_text("")
    (tmp_path / "python").write_text(FAKE_PY)
    (tmp_path / "python").chmod(0o755)
    env = dict(os.environ, PYTHON=str(tmp_path / "python"), INSTALL_SITE=str(tmp_path / "site"))
    env.pop("TEST_WHEEL", None)
    proc = subprocess.run(["bash", str(root / "scripts" / "gpu_run.sh"), "tests", str(tmp_path / "out")],
                          env=env, cwd=root, capture_output=True, text=True)
    if wheels == 1:
        assert proc.returncode == 0, proc.stderr[-2000:]
    else:
        assert proc.returncode != 0
        assert ("no wheel" if wheels == 0 else "more than one wheel") in proc.stderr


WIP = """--- a/m.py
+++ b/m.py
@@ -1,5 +1,5 @@
 a = 1
 b = 2
-c = 3
+c = 4
 d = 5
 e = 6
"""


@pytest.mark.parametrize("site_text,ok", [
    ("a = 1\nb = 2\nc = 3\nd = 5\ne = 6\n", True),
    ("a = 0\nb = 2\nc = 3\nd = 5\ne = 6\n", False),  # applies only with fuzz 1
])
def test_wip_patches_apply_with_the_series_options(tmp_path, site_text, ok):
    """WIP_PATCHES go onto the installed tree with scripts/series.py's patch options: fuzz 0, so
    a draft whose context no longer matches stops the run instead of landing approximately."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "m.py").write_text(site_text)
    wip = tmp_path / "d.patch"
    wip.write_text(WIP)
    for name, text in (("python", FAKE_PY),):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    (tmp_path / "fake.whl").write_text("")
    env = dict(os.environ, PYTHON=str(tmp_path / "python"), INSTALL_SITE=str(tmp_path / "site"),
               TEST_WHEEL=str(tmp_path / "fake.whl"), WIP_PATCHES=os.path.relpath(wip, ROOT))
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_run.sh"), "tests", str(tmp_path / "out")],
                          env=env, cwd=ROOT, capture_output=True, text=True)
    text = (tmp_path / "site" / "m.py").read_text()
    if ok:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "c = 4" in text
    else:
        assert proc.returncode != 0 and "does not apply" in proc.stderr
        assert text == site_text and not list((tmp_path / "site").glob("*.orig"))


def test_wip_patches_are_all_found_before_any_applies(tmp_path):
    """A WIP_PATCHES entry that names no file (a path, or a file in wip/) stops the run before the
    entries ahead of it are applied: the tree is not left half-patched."""
    (tmp_path / "site").mkdir()
    site_text = "a = 1\nb = 2\nc = 3\nd = 5\ne = 6\n"
    (tmp_path / "site" / "m.py").write_text(site_text)
    wip = tmp_path / "d.patch"
    wip.write_text(WIP)
    (tmp_path / "python").write_text(FAKE_PY)
    (tmp_path / "python").chmod(0o755)
    (tmp_path / "fake.whl").write_text("")
    env = dict(os.environ, PYTHON=str(tmp_path / "python"), INSTALL_SITE=str(tmp_path / "site"),
               TEST_WHEEL=str(tmp_path / "fake.whl"),
               WIP_PATCHES=f"{os.path.relpath(wip, ROOT)} 9999-no-such-draft.patch")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_run.sh"), "tests", str(tmp_path / "out")],
                          env=env, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0 and "no patch 9999-no-such-draft.patch" in proc.stderr
    assert (tmp_path / "site" / "m.py").read_text() == site_text


@pytest.mark.parametrize("given", ["stack", "bare"])
def test_wip_patches_take_stack_and_bare_names(tmp_path, given):
    """WIP_PATCHES=stack means wip/STACK's drafts in order, and a bare name a file in wip/: on a
    fake site the first of them is the one that fails to apply, named by its wip/ path."""
    first = next(line for line in (ROOT / "wip" / "STACK").read_text().splitlines()
                 if line and not line.startswith("#"))
    (tmp_path / "site").mkdir()
    (tmp_path / "python").write_text(FAKE_PY)
    (tmp_path / "python").chmod(0o755)
    (tmp_path / "fake.whl").write_text("")
    env = dict(os.environ, PYTHON=str(tmp_path / "python"), INSTALL_SITE=str(tmp_path / "site"),
               TEST_WHEEL=str(tmp_path / "fake.whl"),
               WIP_PATCHES="stack" if given == "stack" else first)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_run.sh"), "tests", str(tmp_path / "out")],
                          env=env, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0 and f"error: wip/{first} does not apply" in proc.stderr


def test_a_site_it_installed_is_installed_afresh_and_no_other(tmp_path):
    """A warm machine's second call: pip --target would keep the patched files of the first, and
    WIP_PATCHES would meet a patched tree. A folder the script did not install is left alone."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "mine").write_text("")  # no marker: not the script's
    assert run(tmp_path, "tests").returncode == 0
    assert (site / "mine").exists() and (site / ".gpu_run-installed").exists()
    (site / "patched").write_text("")  # left by the first call
    assert run(tmp_path, "tests").returncode == 0
    assert not (site / "patched").exists() and not (site / "mine").exists()
    assert (site / ".gpu_run-installed").exists()


def test_precompile_takes_its_arguments(tmp_path):
    args = "--heads 16 --native-only 2051 --option-set bwd_block_phase_ns=0"
    proc = run(tmp_path, "bench", PRECOMPILE_ARGS=args, PRECOMPILE_LOG=str(tmp_path / "args"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (tmp_path / "args").read_text().splitlines() == [f"bench/precompile.py {args}"]


def test_the_whole_gpu_tests_run_in_a_pass_of_their_own(tmp_path):
    """With pytest-xdist, the tests marked whole_gpu run after the others, in a second pass with
    fewer workers (beside 13 others they ran the card out of memory)."""
    log = tmp_path / "args"
    proc = run(tmp_path, "tests", TESTS_LOG=str(log), GPU_TEST_WORKERS="14", GPU_WHOLE_WORKERS="2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    first, second = log.read_text().splitlines()
    assert "[-n][14][-m][not whole_gpu]" in first and "[-n][2][-m][whole_gpu]" in second
    assert (tmp_path / "out" / "gpu-tests.log").exists()
    assert (tmp_path / "out" / "gpu-tests-whole-gpu.log").exists()
    assert "gpu-tests: 1 passed" in proc.stdout and "gpu-tests-whole-gpu: 1 passed" in proc.stdout


@pytest.mark.parametrize("passes,marks", [("first", ["[not whole_gpu]"]), ("whole", ["[whole_gpu]"]),
                                          ("both", ["[not whole_gpu]", "[whole_gpu]"])])
def test_gpu_test_passes_runs_only_the_pass_asked(tmp_path, passes, marks):
    """GPU_TEST_PASSES=first / whole runs that pass alone (a call too short for both)."""
    log = tmp_path / "args"
    proc = run(tmp_path, "tests", TESTS_LOG=str(log), GPU_TEST_PASSES=passes)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = log.read_text().splitlines()
    assert len(lines) == len(marks) and all(m in line for m, line in zip(marks, lines)), lines


def test_gpu_test_passes_rejects_other_values_before_installing(tmp_path):
    proc = run(tmp_path, "tests", GPU_TEST_PASSES="second")
    assert proc.returncode != 0 and "GPU_TEST_PASSES=second" in proc.stderr
    assert not (tmp_path / "site").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("status,ok", [(0, True), (1, False), (5, False)])
def test_without_xdist_one_pass_runs_every_gpu_test(tmp_path, status, ok):
    log = tmp_path / "args"
    proc = run(tmp_path, "tests", NO_XDIST="1", TESTS_LOG=str(log), PASS_STATUS=str(status))
    assert (proc.returncode == 0) == ok, proc.stdout[-2000:] + proc.stderr[-2000:]
    (only,) = log.read_text().splitlines()
    assert "whole_gpu" not in only and "[-n]" not in only


@pytest.mark.parametrize("first,second,ok", [
    (0, 0, True), (5, 0, True), (0, 5, True),  # -k left one pass empty
    (0, 1, False), (1, 0, False), (5, 5, False), (0, 2, False),
])
def test_either_pass_failing_fails_the_tests_job(tmp_path, first, second, ok):
    proc = run(tmp_path, "tests", PASS_STATUS=str(first), WHOLE_STATUS=str(second))
    assert (proc.returncode == 0) == ok, proc.stdout[-2000:] + proc.stderr[-2000:]
    if not ok:
        assert "FAILED: tests" in proc.stdout


FAKE_SMI = r"""#!/usr/bin/env bash
# stand-in nvidia-smi: the sampler (-lms) prints a header and samples until it is killed
[ -z "${SMI_LOG:-}" ] || echo "$*" >>"$SMI_LOG"
case "$*" in
  *-lms*) echo "timestamp, clocks.sm [MHz]"; while :; do echo "2026/12/08 00:00:00.000, 1980"; sleep 0.05; done ;;
esac
"""


def test_gpu_sample_ms_samples_while_the_jobs_run_and_stops(tmp_path):
    """GPU_SAMPLE_MS: nvidia-smi samples the clocks and power every n ms into gpu-samples.csv
    while the jobs run, and the sampler is stopped before the script exits (a sampler left
    running would outlive the call); the summary says how many samples. A value that is not a
    whole number of ms is refused before anything is installed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"

    def sampler_left():
        ps = subprocess.run(["pgrep", "-f", str(bin_dir / "nvidia-smi")], capture_output=True,
                            text=True)
        return ps.stdout.strip()

    proc = run(tmp_path, "variants", GPU_SAMPLE_MS="50", PATH=path, SMI_LOG=str(tmp_path / "smi"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    calls = (tmp_path / "smi").read_text()
    assert "-lms 50" in calls and "clocks.sm" in calls and "power.draw" in calls
    samples = (tmp_path / "out" / "gpu-samples.csv").read_text().splitlines()
    assert samples[0].startswith("timestamp") and len(samples) >= 2
    assert "gpu samples: " in proc.stdout.splitlines()[-1]
    assert sampler_left() == "", "the sampler outlived the script"
    (tmp_path / "bad").mkdir()
    (tmp_path / "early").mkdir()
    bad = run(tmp_path / "bad", "variants", GPU_SAMPLE_MS="1e3", PATH=path)
    assert bad.returncode != 0 and "GPU_SAMPLE_MS" in bad.stderr
    assert not (tmp_path / "bad" / "site").exists()  # (refused before the install)
    # a job that stops the script early stops the sampler too
    early = run(tmp_path / "early", "upstream", GPU_SAMPLE_MS="50", PATH=path)
    assert early.returncode != 0
    assert sampler_left() == "", "the sampler outlived the script"
