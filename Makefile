# Two entry points: `make explain` (the main job on built-in defaults) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install explain test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch lies on disk; installing it first keeps pip from pulling a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[torch,test,nvrtc,models]'
	# no later install may replace the CPU build
	$(PY) -c "import torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	touch $(STAMP)

install: $(STAMP)

explain: $(STAMP)
	$(VENV)/bin/fusion-planner explain --example mlp-epilogue --device seed-k4

test: $(STAMP)
	$(PY) -m ruff check planner backends rewrite_rules fusion_planner tests benchmarks examples
	$(PY) -m mypy
	$(VENV)/bin/lint-imports
	FUSION_PLANNER_REQUIRE_NVRTC=1 $(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
