# qeval: `make run` runs the pipeline on the embedded reference model; `make test` runs the tests.
# Set-up is implicit: the virtual environment is created the first time a target needs it.

PYTHON    ?= python3
VENV      := .venv
PY        := $(VENV)/bin/python
QEVAL     := $(VENV)/bin/qeval
STAMP     := $(VENV)/.installed
MODEL     ?= ref-lm
PRECISIONS ?=
MODELS    := $(patsubst pipelines/models/%.yaml,%,$(wildcard pipelines/models/*.yaml))
# torch first and pinned: this version's CPU wheel is on the machine's disk, and any looser request
# pulls a multi-GB CUDA build (see README, "Set-up").
TORCH     := torch==2.13.0

.PHONY: run test test-fast lint models all quantize evaluate bench serve-bench size gate report ui quality venv browser clean-venv
.DEFAULT_GOAL := run

$(STAMP): pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -c requirements.lock -e '.[dev]'
	@touch $@

venv: $(STAMP)

run: $(STAMP)
	$(QEVAL) run --model ref-lm

all: $(STAMP)
	$(QEVAL) run --model $(MODEL)

# One target per model card: `make ref-lm`, `make llama-3.1-8b-instruct`, ...
$(MODELS): %: $(STAMP)
	$(QEVAL) run --model $@

quantize: $(STAMP)
	$(QEVAL) quantize --model $(MODEL) $(foreach p,$(PRECISIONS),--precision $(p))

bench: $(STAMP)
	$(QEVAL) bench --model $(MODEL) $(foreach p,$(PRECISIONS),--precision $(p))

evaluate: $(STAMP)
	@if [ -z "$(PRECISIONS)" ]; then $(QEVAL) evaluate --model $(MODEL); \
	else for p in $(PRECISIONS); do $(QEVAL) evaluate --model $(MODEL) --precision $$p || exit $$?; done; fi

serve-bench: $(STAMP)
	$(QEVAL) serve-bench --model $(MODEL) $(foreach p,$(PRECISIONS),--precision $(p))

size: $(STAMP)
	$(QEVAL) size --model $(MODEL) $(foreach p,$(PRECISIONS),--precision $(p))

gate: $(STAMP)
	$(QEVAL) gate --model $(MODEL)

report: $(STAMP)
	$(QEVAL) report --model $(MODEL)

models: $(STAMP)
	$(QEVAL) models

ui: $(STAMP)
	$(QEVAL) ui

# The browser test drives Debian's chromium (installed here when missing, with apt-get).
browser:
	@scripts/install-chromium.sh

test: $(STAMP) browser
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The reference model's held-out bits per byte beside a unigram model's (refmodel/README.md).
quality: $(STAMP)
	$(PY) -m refmodel.quality

clean-venv:
	rm -rf $(VENV)
