# Two entry points: `make explain` (the main job on built-in defaults) and `make test`.
# `make explain` installs only the planner and its light dependencies; `make test` (or `make install`)
# adds torch, the test tools, cupy's NVRTC and transformers.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CORE := $(VENV)/.core-installed
STAMP := $(VENV)/.installed

.PHONY: install explain test lint clean

$(CORE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $(CORE)

$(STAMP): $(CORE)
	# the CPU build of torch lies on disk; installing it first keeps pip from pulling a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[torch,test,nvrtc,models,ray]'
	# no later install may replace the CPU build
	$(PY) -c "import torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	touch $(STAMP)

install: $(STAMP)

explain: $(CORE)
	$(VENV)/bin/fusion-planner explain --example mlp-epilogue --device seed-k4

test: $(STAMP)
	$(PY) -m ruff check planner backends rewrite_rules fusion_planner tests benchmarks examples
	$(PY) -m mypy
	$(VENV)/bin/lint-imports
	FUSION_PLANNER_REQUIRE_NVRTC=1 $(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
