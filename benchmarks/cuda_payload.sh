#!/usr/bin/env bash
# Prepares .gpu/ (git-ignored) on the development machine, for benchmarks/cuda_session.sh on
# a GPU machine whose image has PyTorch, Triton and transformers but not the rest: wheels for
# Python 3.12 of what the engine and the HTTP server import beyond them, and SmolLM2's
# tokenizer (from the embedded GGUF, which is too large to carry).
set -euo pipefail
PY=${PY:-.venv/bin/python}
mkdir -p .gpu/whl
# The engine's needs, then the HTTP server's (SERVER=0 leaves those out).
pkgs="gguf==0.19.0 llguidance==1.6.1 msgspec==0.22.0"
if [ "${SERVER:-1}" != 0 ]; then
  pkgs="$pkgs fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4
        pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 sniffio==1.3.1
        SQLAlchemy==2.1.9 greenlet==3.5.6 alembic==1.20.1 Mako==1.4.3 platformdirs==4.14.8
        pyzmq==27.3.0 anyio==4.16.0 idna==3.20 h11==0.16.0 click==8.5.1
        prometheus_client==0.26.0 psutil==7.2.2 httpx==0.28.1 httpcore==1.0.9
        certifi==2026.10.19.post1 opentelemetry-api==1.45.2 annotated-doc==0.0.7"
fi
for pkg in $pkgs; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .gpu/whl "$pkg"
done
PYTHONPATH=src:. "$PY" -c "from pathlib import Path
from tests.helpers.tiny_models import smollm2_tokenizer
smollm2_tokenizer().save(Path('.gpu/tokenizer'))"
du -sh .gpu
