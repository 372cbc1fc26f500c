#!/usr/bin/env bash
# Install llama-cpp-python (llama.cpp's own Python bindings, built from source with the
# CPU's native instruction set) into its own virtual environment, apart from llmserve's.
# Prints the environment's python. Reused when already there.
set -euo pipefail
venv=${LLAMA_CPP_VENV:-$HOME/.cache/llmserve/llama-cpp-venv}
version=${LLAMA_CPP_PYTHON_VERSION:-}
if "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then echo "$venv/bin/python"; exit 0; fi
python3.11 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip >&2
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$venv/bin/python" -m pip install --quiet --no-cache-dir \
    "llama-cpp-python${version:+==$version}" >&2
echo "$venv/bin/python"
