# Two commands do everything on a fresh machine (each sets up .venv first, idempotently):
#   make demo   - the main job
#   make test   - the test suite (what CI runs)
#   make mutation - mutation testing of the decoding core (about an hour on 2 cores; not in CI)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-matrix mutation docs serve-docs clean

# torch==2.13.0 is installed first: an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev,docs,models,bench,quant4]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/hf-polybasic demo

# The full suite runs on the transformers release installed in .venv (the newest supported); a
# representative subset (greedy equality on every architecture, the distribution tests, generate's
# features incl. streamers and pipelines, batched decoding, the compat checks) runs again on older releases, each
# installed beside it in .matrix/ (pure-Python wheels, seconds) and put first on PYTHONPATH.
MATRIX_RELEASES := 4.57.6 5.4.0 5.14.1
MATRIX_TESTS := tests/test_compat.py tests/test_greedy_equality.py tests/test_sampling_distribution.py \
	tests/test_generate_features.py tests/test_batches.py tests/test_vocab_head.py

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q
	$(MAKE) --no-print-directory test-matrix

test-matrix: $(VENV)/.installed
	@for release in $(MATRIX_RELEASES); do \
	  dir=.matrix/transformers-$$release; \
	  if [ ! -f $$dir/.installed ]; then \
	    rm -rf $$dir && $(BIN)/pip install --quiet --no-warn-conflicts --target $$dir "transformers==$$release" \
	      && touch $$dir/.installed || exit 1; \
	  fi; \
	  echo "== transformers $$release: $(MATRIX_TESTS)"; \
	  PYTHONPATH=$$dir $(BIN)/python -m pytest -q -p no:cacheprovider $(MATRIX_TESTS) || exit 1; \
	done

# mutmut 3 (the `mutation` extra) on a seeded, per-module stratified sample of the mutants of the
# decoding core (modules and tests: [tool.mutmut] in pyproject.toml; sampling and the per-module
# table: tools/mutation.py). Results stay in mutants/ (`python tools/mutation.py report --diffs`).
mutation: $(VENV)/.installed
	$(BIN)/python -c "import mutmut" 2>/dev/null || $(BIN)/pip install --quiet -e ".[mutation]"
	$(BIN)/python tools/mutation.py run --max-children 2

docs: $(VENV)/.installed
	$(BIN)/mkdocs build --strict

serve-docs: $(VENV)/.installed
	$(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) site .matrix mutants
