#!/usr/bin/env bash
# Throughput/latency sweep at concurrency 1, 4, 16 and 64: llmserve against llama.cpp's own
# server (llama-server, built from the sources vendored in llama-cpp-python, 2 threads, as
# many parallel slots as the concurrency), same GGUF, same machine, same workload.
#
#   bash benchmarks/sweep_vs_llama_cpp.sh [OUT_DIR]
#
# Environment: LEVELS (concurrencies, default "1 4 16 64"), INPUT_LEN, OUTPUT_LEN,
# LLMSERVE_ARGS (extra `llmserve serve` options, e.g. "--quantization w8a8
# --kv-cache-dtype int8"), LLAMA_SERVER (a llama-server binary to use instead of building one).
#
# Both servers are started the same way: a fresh process per level, so neither answers any
# level from a prefix cache warmed by another; each level's prompts come from a seed of its
# own (the level), the same seed for both servers. (Before session 18 llmserve stayed up for
# every level with the same seed, and answered part of each level from its prefix cache.)
#
# Writes OUT_DIR/{llmserve,llama-server}/sweep.json, OUT_DIR/compare.md, OUT_DIR/compare.png.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/sweep}
bin=.venv/bin
levels=${LEVELS:-"1 4 16 64"}
input_len=${INPUT_LEN:-256}
output_len=${OUTPUT_LEN:-128}
gguf=$($bin/python -c "from llmserve.models.loader import resolve_model_path as r; print(r('smollm2-135m-instruct'))")
llama_server=${LLAMA_SERVER:-$(bash benchmarks/build_llama_server.sh)}
port=8411
mkdir -p "$out"

prompts_for() { case $1 in 1) echo 6;; 4) echo 8;; *) echo $(( $1 * 2 > 64 ? $1 : $1 * 2 ));; esac; }

wait_ready() {  # url
  for _ in $(seq 1 300); do
    curl -sf "$1" >/dev/null && return 0
    sleep 0.5
  done
  echo "server at $1 did not come up" >&2; return 1
}

point() {  # label c
  $bin/llmserve bench sweep --base-url "http://127.0.0.1:$port" --model smollm2 \
    --concurrency "$2" --num-prompts "$(prompts_for "$2")" --input-len "$input_len" \
    --output-len "$output_len" --warmup 2 --seed "$2" --label "$1" \
    --output-dir "$out/$1/c$2" --no-progress
}

# llmserve: restarted per level, as llama-server is
for c in $levels; do
  # shellcheck disable=SC2086  # LLMSERVE_ARGS is a list of options
  $bin/llmserve serve --port $port --served-model-name smollm2 ${LLMSERVE_ARGS:-} \
    > "$out/llmserve-c$c.log" 2>&1 &
  pid=$!
  wait_ready "http://127.0.0.1:$port/ready"
  point llmserve "$c"
  kill -TERM $pid; wait $pid || true
done

# llama-server: restarted per level with as many slots as the concurrency
for c in $levels; do
  "$llama_server" -m "$gguf" --port $port -t 2 -tb 2 -np "$c" -c $(( c * (input_len + output_len + 64) )) \
    --alias smollm2 > "$out/llama-server-c$c.log" 2>&1 &
  pid=$!
  wait_ready "http://127.0.0.1:$port/health"
  point llama-server "$c"
  kill -TERM $pid; wait $pid || true
done

$bin/python - "$out" $levels <<'PY'
import json, sys
from pathlib import Path
out, levels = Path(sys.argv[1]), sys.argv[2:]
for label in ("llmserve", "llama-server"):
    points = [json.loads((out / label / f"c{c}" / "sweep.json").read_text())["points"][0]
              for c in levels]
    sweep = {"label": label, "points": points}
    (out / label / "sweep.json").write_text(json.dumps(sweep, indent=1))
PY
$bin/llmserve bench compare "$out/llmserve/sweep.json" "$out/llama-server/sweep.json" \
  --output "$out/compare.md" --plot "$out/compare.png" \
  --title "SmolLM2-135M Q4_1, random ${input_len} in / ${output_len} out, 2 cores"
