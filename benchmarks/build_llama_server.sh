#!/usr/bin/env bash
# Build llama.cpp's own server (llama-server) from the llama.cpp sources vendored in the
# llama-cpp-python source distribution on PyPI. Nothing of it is committed: it lands in
# ${LLAMA_CPP_DIR:-$HOME/.cache/llmserve/llama.cpp}. Prints the binary's path.
set -euo pipefail
dest=${LLAMA_CPP_DIR:-$HOME/.cache/llmserve/llama.cpp}
version=${LLAMA_CPP_PYTHON_VERSION:-}
bin="$dest/build/bin/llama-server"
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi
mkdir -p "$dest"
work=$(mktemp -d)
python3 -m pip download --quiet --no-deps --no-binary :all: -d "$work" \
    "llama-cpp-python${version:+==$version}" >&2
tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src=$(ls -d "$work"/llama_cpp_python-*/vendor/llama.cpp)
cp -r "$src"/. "$dest"/
cmake -S "$dest" -B "$dest/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build "$dest/build" --target llama-server -j "$(nproc)" >&2
rm -rf "$work"
echo "$bin"
