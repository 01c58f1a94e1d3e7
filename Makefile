# Inside the Layer — every task in one place. `make test` sets up what it needs first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ASSETS := book/_vendor/.copied
PYTEST_ARGS ?=

.PHONY: help setup lab test book exercises gpu-check clean

help:
	@echo "make setup      create .venv with the pinned requirements and the course (Node is not needed)"
	@echo "make lab        set up .venv and open JupyterLab on the course"
	@echo "make test       set up, then run the whole test suite (unit, notebooks, exercises, book, browser)"
	@echo "make book       build the web book into _build/html from the stored outputs"
	@echo "make exercises  regenerate exercises/ from solutions/ (nbgrader)"
	@echo "make gpu-check  run every program on this machine's GPUs with NCCL (says so and exits 0 without GPUs)"
	@echo "make determinism  execute every notebook 3 times; fail if any checked text output changes"

# The venv only: Node and npm are needed for the book and the tests, not to run the course.
setup: $(STAMP)

# The venv is made once; it is re-installed only when the pinned requirements change.
# uv installs the same pins in seconds where pip takes about a minute (measured here: 7 s against
# 55 s). uv does not read pip's configuration, so the wheel folders pip is configured with (this
# machine's local CPU build of torch) are handed to it; where uv cannot be had, pip does the work.
# Both write the packages' bytecode at install (pip by default, uv with --compile-bytecode): where
# PYTHONDONTWRITEBYTECODE is set, as on this machine, a process never caches what it compiles, so
# without it every Python process compiled torch afresh (import torch: 3.1 s of CPU here, 1.6 s
# with the bytecode; the test suite starts a few hundred such processes).
PIP_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	( $(BIN)/python -m pip install --quiet uv==0.13.9 && \
	  $(BIN)/python -m uv pip install --quiet --compile-bytecode --python $(BIN)/python $(foreach d,$(PIP_LINKS),--find-links $(d)) \
	    -r requirements.txt ) || $(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

# MathJax for the offline book, from the npm registry (explorers are drawn by book/_ext/static/explorer.js).
node_modules/.package-lock.json: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error

$(ASSETS): node_modules/.package-lock.json
	rm -rf book/_vendor && mkdir -p book/_vendor/mathjax
	cp -r node_modules/mathjax/es5/. book/_vendor/mathjax/
	touch $@

lab: $(STAMP)
	$(BIN)/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) chapters/00_collectives.ipynb

# The course's own modules are compiled too (seconds; only what changed), for the same reason.
test: $(STAMP) $(ASSETS)
	$(BIN)/python -m compileall -q intralayer tests tools
	$(BIN)/python -m pytest $(PYTEST_ARGS)

book: $(STAMP) $(ASSETS)
	$(BIN)/jupyter-book build . --path-output . -W -n --keep-going --all
	@echo "Open _build/html/index.html in a browser (it works offline)."

exercises: $(STAMP)
	$(BIN)/python tools/exercises.py write

gpu-check: $(STAMP)
	$(BIN)/python tools/gpu_check.py

.PHONY: determinism
determinism: $(STAMP)
	$(BIN)/python tools/determinism.py --runs 3

clean:
	rm -rf _build book/_vendor
