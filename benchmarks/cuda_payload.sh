#!/usr/bin/env bash
# Prepares .gpu/ (git-ignored) on the development machine, for benchmarks/cuda_session.sh on
# a GPU machine whose image has PyTorch, Triton and transformers but not the rest: wheels for
# Python 3.12 of gguf, llguidance and msgspec, and SmolLM2's tokenizer (from the embedded
# GGUF, which is too large to carry).
set -euo pipefail
PY=${PY:-.venv/bin/python}
mkdir -p .gpu/whl
for pkg in gguf==0.19.0 llguidance==1.6.1 msgspec==0.22.0; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .gpu/whl "$pkg"
done
PYTHONPATH=src:. "$PY" -c "from pathlib import Path
from tests.helpers.tiny_models import smollm2_tokenizer
smollm2_tokenizer().save(Path('.gpu/tokenizer'))"
du -sh .gpu
