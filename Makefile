# Two commands do everything on a fresh machine (each sets up .venv first, idempotently):
#   make demo   - the main job
#   make test   - the test suite (what CI runs)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test docs serve-docs clean

# torch==2.13.0 is installed first: an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev,docs,models,bench]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/hf-polybasic demo

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

docs: $(VENV)/.installed
	$(BIN)/mkdocs build --strict

serve-docs: $(VENV)/.installed
	$(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) site
