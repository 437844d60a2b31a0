# glm53 megatron-core patch series. `make wheel`, `make test`; `make help` lists the rest.
SHELL := bash
.DEFAULT_GOAL := help
PY := .venv/bin/python
PYTEST := $(PY) -m pytest

.PHONY: help deps venv tree wheel kernels test test-gpu bench test-upstream refresh check-patches rebase clean

help:
	@echo "make wheel          build dist/megatron_core-<pin>+<label>-cp3{12,13}-*.whl (pinned upstream + patches/)"
	@echo "make kernels        dist/glm53-kernels-<label>-tilelang<ver>-sm90a.tar.xz: the GLM kernels, built without a GPU"
	@echo "make test           CPU test suite (series integrity, GLM-5.3 hook cases, numerics, wheel)"
	@echo "make test-gpu       GPU tests against the built wheel (needs CUDA + TileLang)"
	@echo "make bench          H200 benchmark -> reports/h200-bench.*"
	@echo "make test-upstream  Megatron-LM's own tests for this code on the patched tree (needs upstream/)"
	@echo "make rebase TO=.. [DRY_RUN=1] [GIT_COMMIT=..]  move the pin to a megatron-core version or Megatron-LM git ref"
	@echo "make refresh        re-export patches/ with stable quilt output"
	@echo "make check-patches  dry-run the series against the pin (fuzz 0, no offset)"

# system tools (quilt, GNU patch, xz) from Debian's packages: installed when run as root, else one
# line saying how, before anything is built or tested
deps:
	@bash ci/install-system-deps.sh

venv: deps
	bash scripts/setup_venv.sh
	VENV=$(CURDIR)/.venv313 PYTHON_VERSION=3.13 bash scripts/setup_venv.sh requirements/build.txt

tree: venv
	bash scripts/prepare_tree.sh

wheel: tree
	bash scripts/build_wheel.sh

# The GLM SparseMLA and DSA indexer kernels compiled for sm_90a on this machine (no GPU; nvcc and
# TileLang), as a TileLang kernel-cache archive beside the wheels (README "Shipped kernels").
# SCALES: the softmax scales to build for (default 512**-0.5); HEADS: the query heads per GPU
# (default 8 16 32 64); TOPK: the sparse attention's top-k width (default 2051, GLM's k-pool
# width; megatron's own indexer gives min(dsa_indexer_topk, keys)); SMS: the GPU's SM count
# (default 132, an H200); JOBS. The indexer's shape
# (assumed, not GLM-5.3-Flash's known values): INDEX_HEADS (dsa_indexer_n_heads, default 32),
# INDEX_DIM (dsa_indexer_head_dim, 128), INDEX_TOPK (dsa_indexer_topk, 2048); INDEXER=0 leaves the
# indexer kernels out.
kernels: tree
	$(PY) scripts/build_kernels.py $(if $(SCALES),--scale $(SCALES)) $(if $(HEADS),--heads $(HEADS)) \
	  $(if $(TOPK),--topk $(TOPK)) $(if $(SMS),--sms $(SMS)) $(if $(JOBS),--jobs $(JOBS)) \
	  $(if $(INDEX_HEADS),--index-heads $(INDEX_HEADS)) $(if $(INDEX_DIM),--index-dim $(INDEX_DIM)) \
	  $(if $(INDEX_TOPK),--index-topk $(INDEX_TOPK)) $(if $(filter 0,$(INDEXER)),--no-indexer)

test: wheel
	$(PYTEST) tests

# On a CUDA host with the wheel built (dist/): GPU tests / benchmark against the installed wheel.
test-gpu:
	bash scripts/gpu_run.sh tests reports/gpu-run

bench:
	bash scripts/gpu_run.sh bench reports/gpu-run

# make rebase TO=<version | git ref> [DRY_RUN=1] [SHA256=<hex>] [GIT_COMMIT=<ref>] [REBASE_SDIST=FILE]
# [REBASE_DATE=Y-M-D]: scripts/rebase.py's options. GIT_COMMIT is read from this command line only
# (CI systems export their own GIT_COMMIT); the others also from the environment.
rebase: venv
	$(PY) scripts/rebase.py run "$(TO)" $(if $(DRY_RUN),--dry-run=$(DRY_RUN)) \
	  $(if $(SHA256),--sha256 "$(SHA256)") \
	  $(if $(filter command line,$(origin GIT_COMMIT)),--git-commit "$(GIT_COMMIT)") \
	  $(if $(REBASE_SDIST),--sdist "$(REBASE_SDIST)") $(if $(REBASE_DATE),--date "$(REBASE_DATE)")

test-upstream: venv
	bash scripts/test_upstream.sh

refresh: venv
	bash scripts/refresh_patches.sh

check-patches: venv
	@d=$$(mktemp -d) && trap 'rm -rf "$$d"' EXIT && bash scripts/pristine_tree.sh "$$d/t" >/dev/null && bash scripts/apply_patches.sh --check "$$d/t"

clean:
	rm -rf build dist
