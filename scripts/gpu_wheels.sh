#!/usr/bin/env bash
# The wheels scripts/gpu_bench.py needs on a lent GPU machine that has torch and transformers and reaches no
# package index (docs/gpu.md): qeval's configs (pydantic), llm-compressor for the quantize part, lm-eval for the
# evaluate part, at requirements.lock's versions, for that machine's Python 3.12 on x86-64, into .whl/
# (git-ignored). Pure-Python packages published only as source are built into wheels here. --no-deps: the
# machine has the rest (numpy, pandas, pyarrow, scikit-learn, sacrebleu, accelerate, psutil, pyyaml, ...).
#
#   scripts/gpu_wheels.sh            then carry .whl and install it there (docs/gpu.md, "A lent GPU")
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
NAMES="pydantic pydantic_core annotated-types typing-inspection typing_extensions llmcompressor compressed-tensors
       loguru auto-round datasets dill multiprocess lm_eval evaluate pytablewriter DataProperty mbstrdecoder typepy
       tabledata tcolorpy pathvalidate chardet more-itertools"
SOURCE_ONLY="rouge_score sqlitedict word2number"
pin() { grep -i "^$1==" requirements.lock || { echo "no pin for $1 in requirements.lock" >&2; exit 2; }; }
rm -rf .whl && mkdir -p .whl
pins=$(for n in $NAMES; do pin "$n"; done)
# shellcheck disable=SC2086
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $pins
# shellcheck disable=SC2046
"$PY" -m pip wheel --quiet --no-deps -w .whl $(for n in $SOURCE_ONLY; do pin "$n"; done)
du -sh .whl
