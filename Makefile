# Two commands do everything on a fresh machine (each sets up .venv first, idempotently):
#   make demo   - the main job
#   make test   - the test suite (what CI runs)
#   make mutation - mutation testing of the decoding core (about an hour on 2 cores; not in CI)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-quant4 test-matrix test-torch test-torch-floor test-torch-newest quant4 mutation gpu-check docs serve-docs clean
# the install stamps are files; a test-transformers-<release> run is not
.PRECIOUS: .matrix/transformers-%/.installed

# torch==2.13.0 and transformers==$(NEWEST) are installed first: an unpinned torch would pull a
# multi-GB CUDA build, and the full suite runs on the newest transformers release the package admits.
# The 4-bit extra (quant4: bitsandbytes, for nf4; int4 needs only torch) is NOT installed here, so
# the full suite runs as a plain install does (nf4 refused, naming the extra). It lives in
# .matrix/quant4 (`make quant4`), which only the 4-bit tests put on PYTHONPATH. A venv made before
# is cleaned of it and of torchao, which the extra brought until int4 moved to torch's own kernels
# (transformers imports torchao whenever it is installed, and torchao 0.18 printed load errors and
# torch deprecation warnings on every run, make demo included).
NEWEST := 5.24.0
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0 transformers==$(NEWEST)
	$(BIN)/pip install --quiet -e ".[dev,docs,models,bench]" transformers==$(NEWEST)
	$(BIN)/pip uninstall --quiet --yes torchao bitsandbytes 2>/dev/null || true
	touch $@

demo: $(VENV)/.installed
	$(BIN)/hf-polybasic demo

# The optional extras' requirements as pyproject.toml states them, one a line (for xargs: no shell quoting)
EXTRA = $(BIN)/python -c 'import sys, tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"][sys.argv[1]]))'

# The 4-bit extra beside the venv (bitsandbytes: Python plus prebuilt kernels; --no-deps: torch, numpy
# and packaging come from the venv). Use it with PYTHONPATH=.matrix/quant4 (tests, the nf4 methods of
# bench, plan --four-bit nf4).
QUANT4 := .matrix/quant4
quant4: $(QUANT4)/.installed
$(QUANT4)/.installed: pyproject.toml $(VENV)/.installed
	rm -rf $(QUANT4)
	$(EXTRA) quant4 | xargs $(BIN)/pip install --quiet --no-deps --no-warn-conflicts --target $(QUANT4)
	touch $@

# The full suite runs on the release installed in .venv ($(NEWEST)), alone among the tests (some of
# them time real forwards) but beside the bands' installs (downloads and unpacking, mostly I/O, on
# the core the single-threaded suite leaves idle; their log: .matrix/installs.log); then the runs
# below, two at a time (the 2 cores of CI; each pytest uses one thread), each with a subset chosen
# to keep `make test` within about 20 minutes from a clean clone (docs/compatibility.md):
# - test-quant4: the nf4 tests (and the costs table's nf4 row), with the quant4 extra on PYTHONPATH;
# - test-matrix: one release of every band where the internals we touch changed, each installed
#   beside .venv in .matrix/ (pure-Python wheels, seconds) and put first on PYTHONPATH;
# - test-torch: the two torch bands one after the other, each removed once its tests pass (PyPI's
#   CUDA builds with their NVIDIA libraries: about 4.6 and 5.3 GB installed, and their downloads
#   while pip unpacks; two at once and left behind, a CI run once filled its disk), so `make test`
#   needs about $(TORCH_ROOM_GB) GB free beside .venv and leaves under 2 GB in .matrix:
#   - test-torch-floor: the lowest torch pyproject.toml admits, on the .venv's transformers,
#     installed the same way (it runs on the CPU);
#   - test-torch-newest: the newest torch release (requirements/torch-newest.txt), the same way,
#     while the .venv keeps 2.13.0.
BAND_INSTALLS = $(TORCH_FLOOR_DIR)/.installed $(QUANT4)/.installed \
	$(foreach release,$(MATRIX_RELEASES),.matrix/transformers-$(release)/.installed)
test: $(VENV)/.installed
	@mkdir -p .matrix
	@$(MAKE) --no-print-directory -j2 $(BAND_INSTALLS) > .matrix/installs.log 2>&1 & installs=$$!; \
	$(BIN)/python -m pytest -q; suite=$$?; \
	wait $$installs || { echo "== the bands' installs failed:"; cat .matrix/installs.log; exit 1; }; \
	exit $$suite
	$(MAKE) --no-print-directory -j2 --output-sync=target test-torch test-matrix test-quant4

test-torch:
	$(MAKE) --no-print-directory test-torch-floor
	rm -rf $(TORCH_FLOOR_DIR)
	$(MAKE) --no-print-directory test-torch-newest
	rm -rf $(TORCH_NEWEST_DIR)

# Before a torch band's install: at least $(TORCH_ROOM_GB) GB free on the disk of .matrix (the larger band
# installed, 5.3 GB, and pip's downloads of it beside it), or a clear stop naming what to free
TORCH_ROOM_GB := 9
ROOM_FOR_TORCH = free=$$(df -Pk . | awk 'NR == 2 {print int($$4 / 1048576)}'); [ $$free -ge $(TORCH_ROOM_GB) ] || { \
	echo "make: torch $(1) (PyPI's CUDA build: about 5 GB installed, 8 GB while pip unpacks its download) needs $(TORCH_ROOM_GB) GB free on this disk; df says $$free GB. Free some (an old clone's .matrix/ holds up to 12 GB), then run make test again"; exit 1; }

QUANT4_TESTS := tests/test_four_bit.py tests/test_machine_aware.py::test_the_costs_command_measures_every_variant_and_writes_its_table
test-quant4: $(QUANT4)/.installed
	@echo "== the quant4 extra: $(QUANT4_TESTS)"
	PYTHONPATH=$(QUANT4) $(BIN)/python -m pytest -q -p no:cacheprovider $(QUANT4_TESTS)

# Bands: 4.57 (the oldest with callable custom_generate), 5.0 - 5.4 (per-family recurrent caches),
# 5.5 - 5.14 (no sliding past recording: full layers stand in), 5.15 - 5.17 (sliding layers record
# their past but hand attention all of it: full layers stand in), 5.18 - 5.22 (the last whose batched
# generate penalizes each row's left padding), 5.23 (generate keeps the streamer from
# custom_generate), 5.24 (`cache` renames `past_key_values`; the newest: .venv). Every release runs
# MATRIX_TESTS (the compat checks, greedy equality on every architecture, generate's features,
# batched decoding, greedy equality with a level of another tokenizer, transformers' own assisted loop
# over the chain); the oldest also runs MATRIX_MORE_TESTS (the distribution tests, the restricted
# drafter, all of the translated level's, sampling in transformers' loop, which 4.57 ends at an EOS or
# the budget its own way). `make test-matrix` runs them one after the other (-j2: two at a time).
MATRIX_RELEASES := 4.57.6 5.17.0 5.23.0 5.20.2 5.14.1 5.4.0
MATRIX_TESTS := tests/test_compat.py tests/test_greedy_equality.py tests/test_alternatives.py tests/test_generate_features.py tests/test_batches.py \
	tests/test_translated.py::test_greedy_output_is_plain_generates tests/test_assisted.py
MATRIX_MORE_RELEASES := 4.57.6
MATRIX_MORE_TESTS := tests/test_sampling_distribution.py tests/test_vocab_head.py tests/test_translated.py \
	tests/test_assisted_sampling.py
# the static runner where a release's caches or masks differ for it (4.57: custom 4-D masks checked
# against the cache; 5.4: generate keeps its own static cache on the model; 5.17: the last before 5.18's caches)
STATIC_RELEASES := 4.57.6 5.4.0 5.17.0
STATIC_TESTS := tests/test_static.py -k "not inductor"

test-matrix: $(addprefix test-transformers-,$(MATRIX_RELEASES))

.matrix/transformers-%/.installed: | $(VENV)/.installed
	rm -rf $(@D)
	$(BIN)/pip install --quiet --no-warn-conflicts --target $(@D) "transformers==$*"
	touch $@

test-transformers-%: .matrix/transformers-%/.installed
	@echo "== transformers $*: $(MATRIX_TESTS) $(if $(filter $*,$(MATRIX_MORE_RELEASES)),$(MATRIX_MORE_TESTS))"
	PYTHONPATH=.matrix/transformers-$* $(BIN)/python -m pytest -q -p no:cacheprovider $(MATRIX_TESTS) \
	  $(if $(filter $*,$(MATRIX_MORE_RELEASES)),$(MATRIX_MORE_TESTS))
	$(if $(filter $*,$(STATIC_RELEASES)),PYTHONPATH=.matrix/transformers-$* $(BIN)/python -m pytest -q -p no:cacheprovider $(STATIC_TESTS))

# The torch floor (pyproject.toml: torch>=$(TORCH_FLOOR); the project's GPU machines run it):
# MATRIX_TESTS, the distribution tests, the static runner (its dynamo and inductor) and the int4
# kernels on the .venv's transformers.
TORCH_FLOOR := 2.11.0
TORCH_FLOOR_DIR := .matrix/torch-$(TORCH_FLOOR)
$(TORCH_FLOOR_DIR)/.installed: | $(VENV)/.installed
	rm -rf $(@D)
	@$(call ROOM_FOR_TORCH,$(TORCH_FLOOR))
	$(BIN)/pip install --quiet --no-warn-conflicts --target $(@D) torch==$(TORCH_FLOOR)
	touch $@

test-torch-floor: $(TORCH_FLOOR_DIR)/.installed
	@echo "== torch $(TORCH_FLOOR): $(MATRIX_TESTS) tests/test_sampling_distribution.py tests/test_static.py tests/test_int4.py"
	PYTHONPATH=$(TORCH_FLOOR_DIR) $(BIN)/python -m pytest -q -p no:cacheprovider $(MATRIX_TESTS) \
	  tests/test_sampling_distribution.py tests/test_static.py tests/test_int4.py

# The newest torch release (pyproject.toml admits it: torch>=$(TORCH_FLOOR), no upper bound), asked for
# through requirements/torch-newest.txt (which pins torch==$(TORCH_NEWEST)), on the .venv's
# transformers: the static runner and the compiled one (dynamo, inductor on the CPU), the int4 kernels,
# the oracle and the distribution tests. Bump both together when PyPI serves a newer torch.
TORCH_NEWEST := 2.15.0
TORCH_NEWEST_DIR := .matrix/torch-$(TORCH_NEWEST)
TORCH_NEWEST_TESTS := tests/test_static.py tests/test_int4.py tests/test_oracle.py tests/test_sampling_distribution.py
$(TORCH_NEWEST_DIR)/.installed: requirements/torch-newest.txt | $(VENV)/.installed
	grep -qx 'torch==$(TORCH_NEWEST)' $< || { echo "$< does not pin torch==$(TORCH_NEWEST) (TORCH_NEWEST)"; exit 1; }
	rm -rf $(@D)
	@$(call ROOM_FOR_TORCH,$(TORCH_NEWEST))
	$(BIN)/pip install --quiet --no-warn-conflicts --target $(@D) -r $<
	touch $@

test-torch-newest: $(TORCH_NEWEST_DIR)/.installed
	@echo "== torch $(TORCH_NEWEST): $(TORCH_NEWEST_TESTS)"
	PYTHONPATH=$(TORCH_NEWEST_DIR) $(BIN)/python -m pytest -q -p no:cacheprovider $(TORCH_NEWEST_TESTS)

# mutmut 3 (the `mutation` extra) on a seeded, per-module stratified sample of the mutants of the
# decoding core (modules and tests: [tool.mutmut] in pyproject.toml; sampling and the per-module
# table: tools/mutation.py). Results stay in mutants/ (`python tools/mutation.py report --diffs`).
mutation: $(VENV)/.installed
	$(BIN)/python -c "import mutmut" 2>/dev/null || $(BIN)/pip install --quiet -e ".[mutation]"
	$(BIN)/python tools/mutation.py run --max-children 2

# The prepared GPU check (issue 35; tools/gpu_check.py): the CUDA tests, then on the Llama-3.2-1B shape
# the default chain against plain static generate (first and second call's graphs, host waits per
# round, tok/s, identical outputs), within 8 minutes on one GPU. On a machine without the venv (the
# device machine of a session): PYTHONPATH=. python tools/gpu_check.py --output "$$OUT"
gpu-check: $(VENV)/.installed
	$(BIN)/python tools/gpu_check.py

docs: $(VENV)/.installed
	$(BIN)/mkdocs build --strict

serve-docs: $(VENV)/.installed
	$(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) site .matrix mutants
