#!/usr/bin/env bash
# test_upstream.sh [PYTEST_ARGS...]: Megatron-LM's own tests for the patched code (make test-upstream).
# Those tests exist only in the git channel, so upstream/ must be filled. Builds, in
# build/upstream-tests/:
#   pristine/  the pin's pristine tree (git channel: pristine_tree.sh) + tests/ of the pinned commit
#   patched/   the same with patches/series applied (tests-only patches apply here, since tests/ exists)
# then runs UPSTREAM_TESTS in patched/ (and, for comparison, in pristine/), and our GLM cases
# (OUR_TESTS) against patched/'s megatron. Prints one summary line per test file; results and
# logs go to build/upstream-tests/results/ (junit-*.xml, pytest-*.log, summary.md).
# Exit status: non-zero when a test that passes on the unpatched tree does not pass on the patched
# one, or when one of our tests fails. (On a CPU host many upstream DSA tests fail or skip on both
# trees because they need CUDA; they are listed, not counted against the patches.)
# Environment:
#   UPSTREAM_TESTS  upstream test paths (default: tests/unit_tests/transformer/experimental_attention_variant)
#   OUR_TESTS       ours (default: tests/test_glm_hook.py tests/test_numerics_cpu.py tests/test_first_call_log.py)
#   BASELINE=0      skip the unpatched run; then any upstream failure fails the target
#   TREE=DIR        use an already-prepared patched tree (megatron/ + tests/), e.g. on a GPU host;
#                   PRISTINE_TREE=DIR adds its unpatched counterpart for the comparison
#   FROM_INSTALLED=1  test the installed megatron-core (pip install dist/*.whl) instead of the
#                   tree's megatron/ (the tests run from a copy of the tree without megatron/)
#   NPROC=N         run the upstream tests under torch.distributed.run with N processes (GPU hosts;
#                   upstream's CI uses 8); rank 0's results are summarised
. "$(dirname "$0")/lib.sh"
py=$VENV/bin/python
[ -x "$py" ] || die "no virtual environment at $VENV: run 'make venv' first"
upstream_tests=${UPSTREAM_TESTS:-tests/unit_tests/transformer/experimental_attention_variant}
our_tests=${OUR_TESTS:-tests/test_glm_hook.py tests/test_numerics_cpu.py tests/test_first_call_log.py}
baseline=${BASELINE:-1}
nproc=${NPROC:-1}
out=$BUILD/upstream-tests
res=$out/results

# upstream's conftest imports click and requests
"$ROOT/scripts/setup_venv.sh" "$ROOT/requirements/upstream-tests.txt"

if [ -n "${TREE:-}" ]; then
  patched=$(cd "$TREE" && pwd)
  [ -d "$patched/tests/unit_tests" ] || die "TREE=$TREE has no tests/unit_tests (upstream's tests)"
  pristine=${PRISTINE_TREE:+$(cd "$PRISTINE_TREE" && pwd)}
  [ -n "$pristine" ] || baseline=0
  note "using the prepared tree $patched${pristine:+ (unpatched: $pristine)}"
else
  submodule_filled ||
    die "make test-upstream runs Megatron-LM's own tests, which only the git channel has, and upstream/ is not filled: git -c protocol.file.allow=always submodule update --init upstream (or run it where it is)"
  [ -n "${MCORE_GIT_COMMIT:-}" ] ||
    die "the pin has no git commit (MCORE_GIT_COMMIT is empty: a PyPI-only pin), so there are no upstream tests for it"
  rm -rf "$out"
  mkdir -p "$out"
  CHANNEL=git "$ROOT/scripts/pristine_tree.sh" "$out/pristine" >/dev/null
  git -C "$UPSTREAM" archive "$MCORE_GIT_COMMIT" tests | tar -x -C "$out/pristine"
  cp -a "$out/pristine" "$out/patched"
  note "applying patches/series to $out/patched (with upstream's tests/)"
  "$ROOT/scripts/apply_patches.sh" "$out/patched" >&2
  patched=$out/patched
  pristine=$out/pristine
fi
[ "$baseline" = 1 ] || pristine=''
rm -rf "$res"
mkdir -p "$res"

run_dir_for() {  # the directory pytest runs in: the tree, or a copy without megatron/ (installed wheel)
  if [ "${FROM_INSTALLED:-0}" = 1 ]; then
    local d=$out/run-$2
    rm -rf "$d"
    mkdir -p "$d"
    cp -a "$1/tests" "$d/"
    [ ! -f "$1/pyproject.toml" ] || cp "$1/pyproject.toml" "$d/"
    echo "$d"
  else
    echo "$1"
  fi
}
run_upstream() {  # run_upstream TREE NAME [PYTEST_ARGS...]
  local tree=$1 name=$2 dir rc=0
  shift 2
  dir=$(run_dir_for "$tree" "$name")
  # shellcheck disable=SC2086
  if [ "$nproc" -gt 1 ]; then
    (cd "$dir" && env -u PYTHONPATH "$py" -m torch.distributed.run --nproc-per-node "$nproc" --no-python \
      bash -c 'exec "$0" -m pytest -p no:cacheprovider --junitxml="$1-rank$LOCAL_RANK.xml" "${@:2}"' \
      "$py" "$res/junit-$name" $upstream_tests "$@") >"$res/pytest-$name.log" 2>&1 || rc=$?
    cp "$res/junit-$name-rank0.xml" "$res/junit-$name.xml" 2>/dev/null || true
  else
    (cd "$dir" && env -u PYTHONPATH "$py" -m pytest -p no:cacheprovider --junitxml="$res/junit-$name.xml" \
      $upstream_tests "$@") >"$res/pytest-$name.log" 2>&1 || rc=$?
  fi
  [ -f "$res/junit-$name.xml" ] || die "pytest wrote no results for the $name tree (exit $rc): see $res/pytest-$name.log"
  note "$name tree: $(grep -E '^=+ .*(passed|failed|skipped|error).* =+$' "$res/pytest-$name.log" | tail -n 1 | tr -d '=' | sed 's/^ *//;s/ *$//')"
}

note "running $upstream_tests on the patched tree (log: ${res#"$ROOT"/}/pytest-patched.log)"
run_upstream "$patched" patched "$@"
if [ -n "$pristine" ]; then
  note "running $upstream_tests on the unpatched tree, for comparison (log: ${res#"$ROOT"/}/pytest-pristine.log)"
  run_upstream "$pristine" pristine "$@"
fi

# our GLM cases, with megatron from the patched tree (or the installed wheel)
ours_env=(FROM_INSTALLED=1)
if [ "${FROM_INSTALLED:-0}" != 1 ]; then ours_env+=(PYTHONPATH="$patched"); fi
note "running $our_tests against the patched tree's megatron (log: ${res#"$ROOT"/}/pytest-ours.log)"
# shellcheck disable=SC2086
(cd "$ROOT" && env "${ours_env[@]}" "$py" -m pytest -p no:cacheprovider --junitxml="$res/junit-ours.xml" \
  $our_tests) >"$res/pytest-ours.log" 2>&1 || true
[ -f "$res/junit-ours.xml" ] || die "pytest wrote no results for our tests: see $res/pytest-ours.log"

cuda=$("$py" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
where="$(uname -n), $([ "$cuda" = 1 ] && "$py" -c 'import torch; print(torch.cuda.get_device_name(0))' || echo 'CPU only'), torch $("$py" -c 'import torch; print(torch.__version__)')"
args=(--patched "$res/junit-patched.xml" --ours "$res/junit-ours.xml" --cuda "$cuda" --markdown "$res/summary.md"
  --title "Megatron-LM tests at ${MCORE_GIT_COMMIT:-?} on the patched tree ($where)")
[ -z "$pristine" ] || args+=(--pristine "$res/junit-pristine.xml")
echo "== per-file summary ($where; pin ${MCORE_VERSION:-git-only} ${MCORE_GIT_COMMIT:0:10}; series: $(series | tr '\n' ' '))"
"$py" "$ROOT/scripts/upstream_tests_summary.py" "${args[@]}"
