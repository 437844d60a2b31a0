#!/usr/bin/env bash
# gpu_run.sh "JOB..." OUTDIR, JOB = tests|bench|all|sanitize|upstream|variants|fwd|host: on a CUDA host, run the
# GPU tests and/or the benchmark (sanitize: compute-sanitizer memcheck/synccheck/racecheck on
# bench/sanitize_*.py; upstream: Megatron-LM's own DSA tests carried in .upt/; variants:
# bench/bwd_variants.py, the backward kernel A/B; fwd: bench/fwd_variants.py, the forward kernel A/B;
# host: bench/host_profile.py, where the host's time a forward call goes) against
# the built wheel (dist/*.whl), installed with its patches into a scratch site folder (no deps: the
# host's torch). TileLang comes from the environment or from .site/tilelang-site.tar.xz
# (scripts/pack_tilelang_site.sh makes it); flash_mla (benchmark peer, optional) from .whl/;
# megatron's cuDNN backend packages (benchmark peer, optional) from the site folder CUDNN_SITE
# (scripts/pack_cudnn_site.sh). Prints a one-line summary at the end. Exits non-zero when any job
# failed (a test, a benchmark row that errored or declined, a variant script, an upstream file).
set -uo pipefail
cd "$(dirname "$0")/.."
what=" ${1:-all} "
has() { [[ $what == *" $1 "* || ( $what == *" all "* && ( $1 == tests || $1 == bench ) ) ]]; }
out=${2:-reports/gpu-run}
passes=${GPU_TEST_PASSES:-both}
case $passes in
  both | first | whole) ;;
  *) echo "error: GPU_TEST_PASSES=$passes: both, first or whole" >&2; exit 1 ;;
esac
[[ -z ${GPU_SAMPLE_MS:-} || $GPU_SAMPLE_MS =~ ^[1-9][0-9]*$ ]] || {
  echo "error: GPU_SAMPLE_MS=$GPU_SAMPLE_MS: a whole number of ms" >&2; exit 1; }
py=${PYTHON:-python3}
site=${INSTALL_SITE:-/tmp/mcore-site}
# a site this script installed before (a warm machine's second call) is installed afresh: pip
# --target keeps files already there, and WIP_PATCHES would then meet a patched tree
[ ! -e "$site/.gpu_run-installed" ] || rm -rf "$site"
mkdir -p "$out" "$site"
# TEST_WHEEL: another wheel (e.g. an unpatched build, to compare upstream's tests against)
if [ -z "${TEST_WHEEL:-}" ]; then
  # exactly one wheel for this Python: an older build left beside the new one is not a choice
  wheels=$(ls dist/megatron_core-*-$("$py" -c "import sys; print(f\"cp{sys.version_info[0]}{sys.version_info[1]}\")")-*.whl 2>/dev/null)
  [ -n "$wheels" ] || { echo "error: no wheel in dist/: run make wheel first" >&2; exit 1; }
  [ "$(echo "$wheels" | wc -l)" = 1 ] || { echo "error: more than one wheel in dist/ for this Python: $(echo $wheels)" >&2; exit 1; }
fi
whl=${TEST_WHEEL:-$wheels}
if ! "$py" -c "import tilelang" 2>/dev/null && [ -f .site/tilelang-site.tar.xz ]; then
  tar -xJf .site/tilelang-site.tar.xz -C "$site"
fi
extra=$(ls .whl/*.whl 2>/dev/null || true)
"$py" -m pip install --quiet --no-deps --no-index --disable-pip-version-check --target "$site" "$whl" $extra || exit 1
touch "$site/.gpu_run-installed"
# WIP_PATCHES: patches from wip/ applied to the installed tree (kernel drafts not in the series)
# with the series' own patch options (scripts/series.py: fuzz 0, no backup or reject files).
# Each is a path, a file name in wip/, or "stack" (wip/STACK's drafts in order); all are found
# before any is applied.
wip=()
for p in ${WIP_PATCHES:-}; do
  if [ "$p" = stack ]; then
    mapfile -t -O ${#wip[@]} wip < <(grep -v '^#' wip/STACK | grep . | sed 's|^|wip/|')
  elif [ -f "$p" ]; then wip+=("$p")
  elif [ -f "wip/$p" ]; then wip+=("wip/$p")
  else echo "error: WIP_PATCHES: no patch $p (a path, or a file in wip/)" >&2; exit 1; fi
done
if [ ${#wip[@]} -gt 0 ]; then
  mapfile -t pargs < <(python3 scripts/series.py patch-args)
  [ ${#pargs[@]} -gt 0 ] || { echo "error: scripts/series.py patch-args printed nothing" >&2; exit 1; }
fi
for p in "${wip[@]}"; do
  patch -d "$site" "${pargs[@]}" -N -i "$PWD/$p" >/dev/null || { echo "error: $p does not apply (fuzz 0)" >&2; exit 1; }
done
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} FROM_INSTALLED=1 PYTHONUNBUFFERED=1
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  "$py" -c "import torch, tilelang; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'tilelang', tilelang.__version__)"
  "$py" -c "import megatron.core as m, megatron.core.glm53_patches as p; print('megatron-core', m.__version__, [n for n, _ in p.PATCHES])"
  "$py" -c "import flash_mla; print('flash_mla', flash_mla.__version__)" 2>&1 | tail -n 1
  "$py" -c "import sys; sys.path.insert(0, 'bench'); import cudnn_peer; m, why = cudnn_peer.load(); print('cudnn backend:', why or cudnn_peer.versions())" 2>&1 | tail -n 1
} | tee "$out/env.txt"
# PRECOMPILE=0: jobs that compile their own kernels (variants, upstream on an unpatched wheel);
# PRECOMPILE_ARGS: precompile.py's arguments (a benchmark's shapes and A/B options only)
[ "${PRECOMPILE:-1}" = 0 ] || "$py" bench/precompile.py ${PRECOMPILE_ARGS:-} 2>&1 | tee "$out/precompile.log" || { echo "error: precompile failed" >&2; exit 1; }
rc=0 summary=""
failed() { rc=1; summary="$summary [FAILED: $1]"; }
# GPU_SAMPLE_MS=n: nvidia-smi samples the SM and memory clocks, the power draw and limit and the
# temperature every n ms into $out/gpu-samples.csv while the jobs run (bwd_variants.py's and
# bench.py's timed rows carry their start and end times), to tell a row that ran at lower clocks
# (a power or thermal limit) from one that did more work
sampler=
if [ -n "${GPU_SAMPLE_MS:-}" ]; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu \
    --format=csv,nounits -lms "$GPU_SAMPLE_MS" >"$out/gpu-samples.csv" 2>&1 &
  sampler=$!
  trap 'kill "$sampler" 2>/dev/null' EXIT  # (a job that stops the script early too)
fi
xdist=$("$py" -c "import xdist" 2>/dev/null && echo yes)  # pytest-xdist, carried in .whl/
if has variants; then
  timeout "${VARIANTS_TIMEOUT:-300}" "$py" bench/bwd_variants.py --out "$out" ${BWD_ARGS:-} 2>&1 | tee "$out/bwd-variants.log" || failed variants
  summary="$summary; variants: $(wc -l <"$out/bwd-variants.jsonl" 2>/dev/null || echo 0) rows"
fi
if has fwd; then
  timeout "${FWD_TIMEOUT:-200}" "$py" bench/fwd_variants.py --out "$out" ${FWD_ARGS:-} 2>&1 | tee "$out/fwd-variants.log" || failed fwd
  summary="$summary; fwd variants: $(wc -l <"$out/fwd-variants.jsonl" 2>/dev/null || echo 0) rows"
fi
if has host; then
  # where the host's time a forward call goes (HOST_ARGS: e.g. --heads 16 64 --calls 30)
  timeout "${HOST_TIMEOUT:-200}" "$py" bench/host_profile.py --out "$out" ${HOST_ARGS:-} >"$out/host-profile.log" 2>&1 || failed host
  summary="$summary; host profile: $(grep -c '^## ' "$out/host-profile.txt" 2>/dev/null || echo 0) calls profiled"
fi
if has tests; then
  # the tests are many small launches: spread them over processes sharing the GPU (pytest-xdist
  # from .whl/; the kernels are in TileLang's disk cache from precompile.py). The tests marked
  # whole_gpu (a dense reference, 32k tokens, processes of their own) take many GiB each: beside
  # 13 other workers they ran the 80 GB card out of memory, even one at a time (run 29a), so
  # they run in a second pass with few workers (GPU_WHOLE_WORKERS) and nothing else beside them.
  # GPU_TEST_K: a pytest -k expression (a subset of the tests, when device time is short); a
  # pass it leaves empty is not a failure (pytest's 5), both passes empty are.
  gpu_tests() {  # NAME PYTEST-ARGS...: one pass into $out/NAME.log and .xml; pytest's status in st
    local name=$1
    shift
    "$py" -m pytest tests/gpu -q -rA -p no:cacheprovider --durations=12 "$@" ${GPU_TEST_K:+-k "$GPU_TEST_K"} \
      --junitxml="$out/$name.xml" 2>&1 | tee "$out/$name.log"
    st=${PIPESTATUS[0]}
    summary="$summary; $name: $(tail -n 1 "$out/$name.log")"
  }
  # GPU_TEST_PASSES=first|whole: only that pass (a pass left out counts as empty), for a call
  # too short for both (run 31e: the first pass and its precompile took 383 s of 540)
  if [ -n "$xdist" ]; then
    st1=5 st2=5
    if [ "$passes" != whole ]; then
      gpu_tests gpu-tests -n "${GPU_TEST_WORKERS:-6}" -m "not whole_gpu"
      st1=$st
    fi
    if [ "$passes" != first ]; then
      gpu_tests gpu-tests-whole-gpu -n "${GPU_WHOLE_WORKERS:-3}" -m whole_gpu
      st2=$st
    fi
  else
    gpu_tests gpu-tests
    st1=$st st2=5
  fi
  case "$st1 $st2" in
    "5 5") failed "tests (none selected)" ;;
    "0 0" | "0 5" | "5 0") ;;
    *) failed tests ;;
  esac
fi
if has upstream; then
  # upstream's own DSA tests (carried in .upt/ by scripts/carry_upstream_tests.sh) against the
  # installed wheel, one file at a time under torch.distributed.run (their helpers expect it);
  # the kernels were compiled by precompile.py above, the rest compile here: allow minutes a file
  [ -d .upt/tests ] || { echo "error: no .upt/: run scripts/carry_upstream_tests.sh here first" >&2; exit 1; }
  d=tests/unit_tests/transformer/experimental_attention_variant
  # test_dsa_tilelang_kernels.py needs no process group: a first pass with pytest-xdist (carried
  # in .whl/) compiles its kernels in parallel into TileLang's disk cache for the torchrun pass
  if [ -n "$xdist" ]; then
    (cd .upt && timeout "${UPSTREAM_WARMUP_TIMEOUT:-300}" "$py" -m pytest "$d/test_dsa_tilelang_kernels.py" -q -rfEs -p no:cacheprovider \
      -n "${UPSTREAM_WORKERS:-12}") >"$out/upstream-xdist-warmup.log" 2>&1
    summary="$summary; xdist warm-up pass: $(grep -E '(passed|failed|error)' "$out/upstream-xdist-warmup.log" | tail -n 1)"
  fi
  for f in ${UPSTREAM_FILES:-test_dsa_tilelang_kernels test_absorbed_mla test_attention_variant_dsa}; do
    (cd .upt && timeout "${UPSTREAM_TIMEOUT:-400}" "$py" -m torch.distributed.run --nproc_per_node 1 \
      -m pytest "$d/$f.py" -q -rfEs -p no:cacheprovider --junitxml="$out/upstream-$f.xml") >"$out/upstream-$f.log" 2>&1 ||
      failed "upstream $f"
    summary="$summary; $f: $(grep -E '(passed|failed|error)' "$out/upstream-$f.log" | tail -n 1)"
  done
fi
if has sanitize; then
  # compute-sanitizer with --error-exitcode: an error it finds, a failed check in the script or a
  # run that does not finish in SANITIZE_TIMEOUT seconds fails the job (and the command)
  cs=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
  # SANITIZE_RUNS: TOOL:SCRIPT[:ARGS] each, ARGS comma-separated
  # (racecheck:sanitize_native:--quick,--option,bwd_add_warpgroup=True)
  n=0
  for run in ${SANITIZE_RUNS:-memcheck:sanitize_native memcheck:sanitize_ws synccheck:sanitize_ws racecheck:sanitize_ws}; do
    IFS=: read -r tool prog arg <<<"$run"
    IFS=, read -ra sargs <<<"$arg"
    n=$((n + 1))
    log="$out/sanitizer-$tool-$prog.log"
    [ ! -e "$log" ] || log="$out/sanitizer-$tool-$prog-$n.log"  # the same tool and script again
    # first without the sanitizer, into the same log: the script's kernels compile here into
    # TileLang's disk cache (compiling under racecheck outlasted a 150 s limit in run 29a), and
    # its own checks run once uninstrumented
    echo "== $prog ${sargs[*]}: without the sanitizer" >"$log"
    if ! timeout "${SANITIZE_TIMEOUT:-400}" "$py" "bench/$prog.py" "${sargs[@]}" >>"$log" 2>&1; then
      failed "sanitizer $tool $prog (its run without the sanitizer)"
      continue
    fi
    echo "== $prog ${sargs[*]}: under compute-sanitizer --tool $tool" >>"$log"
    # no caching allocator: an access past a tensor that stays inside a cached segment would be
    # invisible to memcheck
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZE_TIMEOUT:-400}" "$cs" --tool "$tool" --error-exitcode 1 "$py" "bench/$prog.py" "${sargs[@]}" \
      >>"$log" 2>&1 || failed "sanitizer $tool $prog"
    summary="$summary; $tool $prog ${arg:+($arg)}: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -n 1)"
  done
fi
if has bench; then
  "$py" bench/bench.py --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" || failed bench
  summary="$summary; bench: $(wc -l <"$out/h200-bench.jsonl" 2>/dev/null || echo 0) rows in $out"
fi
if [ -n "$sampler" ]; then
  kill "$sampler" 2>/dev/null
  summary="$summary; gpu samples: $(($(wc -l <"$out/gpu-samples.csv") - 1))"
fi
echo "SUMMARY: $summary (exit $rc)"
exit $rc
