#!/usr/bin/env bash
# carry_upstream_tests.sh: copy the part of upstream's tests/ that the DSA tests need (patched by the
# series' tests-only patches) from build/upstream-tests/patched (make test-upstream builds it) into
# .upt/, a gitignored folder small enough to carry to a GPU host (scripts/gpu_run.sh upstream).
# Upstream's tests are never committed here.
. "$(dirname "$0")/lib.sh"
src=${TREE:-$BUILD/upstream-tests/patched}
[ -d "$src/tests/unit_tests" ] || die "no $src/tests/unit_tests: run make test-upstream first (needs upstream/)"
rm -rf "$ROOT/.upt"
for f in tests/__init__.py tests/unit_tests/__init__.py tests/unit_tests/conftest.py \
  tests/unit_tests/test_utilities.py tests/unit_tests/dist_checkpointing tests/test_utils/__init__.py \
  tests/test_utils/python_scripts tests/unit_tests/transformer/__init__.py \
  tests/unit_tests/transformer/experimental_attention_variant; do
  [ -e "$src/$f" ] || continue
  mkdir -p "$ROOT/.upt/$(dirname "$f")"
  cp -a "$src/$f" "$ROOT/.upt/$f"
done
find "$ROOT/.upt" -name __pycache__ -prune -exec rm -rf {} +
note "upstream DSA tests in .upt/ ($(du -sh "$ROOT/.upt" | cut -f1)); carry it with .site and dist"
