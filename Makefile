# The two commands of the README:
#   make demo   index the shipped Cranfield sample, search it, check and evaluate the run
#   make test   lint, build the documentation (strict) and run the test suite
#   make docs   build the documentation site into site/ (mkdocs build --strict)
# Both set up a virtual environment in .venv on first use.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of PyTorch is enough for everything but the GPU kernels; override
# TORCH_SPEC (e.g. TORCH_SPEC='torch>=2.4') to take another build.
TORCH_SPEC ?= torch==2.13.0
SAMPLE := data/sample/cranfield
DEMO := .demo

.PHONY: demo pipeline-demo quality test lint docs tables clean

# (setup.py and the C sources: pip install -e . compiles the C modules, the JSONL reader's and the queries')
$(VENV)/.installed: pyproject.toml setup.py src/gpusparse/_jsonl_native.c src/gpusparse/_queries_native.c src/gpusparse/_native_buffers.h
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test,docs]"
	touch $@

demo: $(VENV)/.installed
	rm -rf $(DEMO) && mkdir -p $(DEMO)
	$(BIN)/gpusparse index $(SAMPLE)/corpus.jsonl.gz --output $(DEMO)/cranfield-index
	$(BIN)/gpusparse info $(DEMO)/cranfield-index
	$(BIN)/gpusparse search $(DEMO)/cranfield-index $(SAMPLE)/queries.jsonl.gz --k 1000 --output $(DEMO)/run.trec
	@echo "first lines of $(DEMO)/run.trec:"
	@head -n 5 $(DEMO)/run.trec
	$(BIN)/gpusparse verify $(DEMO)/cranfield-index $(SAMPLE)/queries.jsonl.gz --run $(DEMO)/run.trec
	$(BIN)/gpusparse eval $(DEMO)/run.trec $(SAMPLE)/qrels.tsv

# Text to metrics in one command: encode Cranfield with splade-tiny (from ../shared), index,
# search, evaluate. A few minutes on a 2-core CPU.
SHARED ?= ../shared
pipeline-demo: $(VENV)/.installed
	$(BIN)/gpusparse pipeline $(SHARED)/data/cranfield --model $(SHARED)/models/splade-tiny --output $(DEMO)/pipeline-cranfield

# The README's quality table: the pipeline on the three shared collections.
quality: $(VENV)/.installed
	for c in nfcorpus cranfield cisi; do \
	  $(BIN)/gpusparse pipeline $(SHARED)/data/$$c --model $(SHARED)/models/splade-tiny --output $(DEMO)/pipeline-$$c || exit 1; \
	done

lint: $(VENV)/.installed
	$(BIN)/ruff check src tests scripts bench
	$(BIN)/ruff format --check src tests scripts bench
	$(BIN)/lint-imports --no-cache

# The documentation site (docs/, mkdocs.yml); strict: a broken link or a bad docstring fails.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --quiet

# Rewrite the docs' tables and plots from the newest results in bench/results.
tables: $(VENV)/.installed
	$(BIN)/python bench/render_tables.py

# The mutation check first (each known breakage of the exactness contract must fail a fast
# subset of the suite), then the whole suite, whose summary closes the output.
test: lint docs
	PYTHONPATH=src $(BIN)/python scripts/mutation_check.py
	GPUSPARSE_REQUIRE_NATIVE=1 $(BIN)/python -m pytest -q -rs

clean:
	rm -rf $(VENV) $(DEMO) site .pytest_cache .ruff_cache
