# The two commands of the README:
#   make demo   index the shipped Cranfield sample and search it
#   make test   lint and run the test suite
# Both set up a virtual environment in .venv on first use.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of PyTorch is enough for everything but the GPU kernels; override
# TORCH_SPEC (e.g. TORCH_SPEC='torch>=2.4') to take another build.
TORCH_SPEC ?= torch==2.13.0
SAMPLE := data/sample/cranfield
DEMO := .demo

.PHONY: demo test lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	rm -rf $(DEMO) && mkdir -p $(DEMO)
	$(BIN)/gpusparse index $(SAMPLE)/corpus.jsonl.gz --output $(DEMO)/cranfield-index
	$(BIN)/gpusparse info $(DEMO)/cranfield-index
	$(BIN)/gpusparse search $(DEMO)/cranfield-index $(SAMPLE)/queries.jsonl.gz --k 1000 --output $(DEMO)/run.trec
	@echo "first lines of $(DEMO)/run.trec:"
	@head -n 5 $(DEMO)/run.trec

lint: $(VENV)/.installed
	$(BIN)/ruff check src tests scripts bench
	$(BIN)/ruff format --check src tests scripts bench

test: lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) $(DEMO) .pytest_cache .ruff_cache
