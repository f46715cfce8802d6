# Every target sets up its own environment: a virtualenv with the CPU build of torch installed first (a bare
# `torch` requirement would pull a multi-GB CUDA build), then this package with its test extras.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: install demo test test-floors bench clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: install
	$(PY) examples/demo.py

test: install
	$(PY) -m pytest -q tests

# The trainer tests on the lowest versions setup.cfg declares (.ci/floors.txt), in their own virtualenv.
FLOORS_VENV ?= .venv-floors
test-floors:
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/python -m pip install -q --upgrade pip
	$(FLOORS_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(FLOORS_VENV)/bin/python -m pip install -q -r .ci/floors.txt pytest hypothesis
	$(FLOORS_VENV)/bin/python -m pip install -q --no-deps -e .
	$(FLOORS_VENV)/bin/python -m pip check
	$(FLOORS_VENV)/bin/python -m pytest -q tests/test_loss_terms.py tests/test_trainer.py tests/integration/test_drop_in.py tests/test_one_backward.py

# Quick modes, about 15 minutes on 2 CPU cores in all; drop --quick for the full runs (see benchmarks/README.md).
bench: install
	$(PY) benchmarks/step_cost.py --quick
	$(PY) benchmarks/grad_variance.py --quick
	$(PY) benchmarks/compare.py --quick
	$(PY) benchmarks/update_readme.py

clean:
	rm -rf $(VENV) $(FLOORS_VENV) outputs *.egg-info
