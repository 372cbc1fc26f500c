#!/usr/bin/env bash
# The default options against other `llmserve serve` options through the server, llmserve
# alone, the two alternating (this host's speed drifts within minutes: only runs that
# alternate can be compared). The workload of sweep_vs_llama_cpp.sh: 256-token random
# prompts, 128 tokens out, twice as many prompts as streams up to 32 streams (as many past
# that), a fresh server per run, each level's prompts from a seed of its own (the level).
#
#   OTHER_ARGS="--quantization w8a8" bash benchmarks/formats_ab_server.sh [OUT_DIR]
#
# Environment: OTHER_ARGS (the options compared with the defaults; default "--quantization
# w8a8"), LEVELS (streams, default "32 64"), PAIRS (alternations per level, default 2; the
# second pair runs the other options first). Prints a line per run and, per level, the
# defaults' output tokens/s over the other's, pair by pair; raw output under OUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/formats_ab}
bin=.venv/bin
other_args=${OTHER_ARGS:---quantization w8a8}
port=8413
mkdir -p "$out"

run() {  # label streams [serve options...]; prints the output tok/s
  local label=$1 c=$2
  shift 2
  $bin/llmserve serve --port $port --served-model-name smollm2 "$@" > "$out/$label-c$c.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break
    sleep 0.5
  done
  $bin/llmserve bench sweep --base-url "http://127.0.0.1:$port" --model smollm2 \
    --concurrency "$c" --num-prompts $(( c * 2 > 64 ? c : c * 2 )) --input-len 256 \
    --output-len 128 --warmup 2 --seed "$c" --label "$label" --output-dir "$out/$label/c$c" \
    --no-progress > "$out/$label-c$c.txt"
  kill -TERM $pid
  wait $pid || true
  local tps tpot
  tps=$(awk '/output token throughput/ {print $4}' "$out/$label-c$c.txt")
  tpot=$(awk '$1 == "TPOT" {print $3}' "$out/$label-c$c.txt")
  echo "$label, $c streams: $tps output tok/s, TPOT p50 $tpot ms" >&2
  echo "$tps"
}

echo "defaults against: $other_args" >&2
for c in ${LEVELS:-32 64}; do
  ratios=""
  for pair in $(seq 1 "${PAIRS:-2}"); do
    if (( pair % 2 == 1 )); then
      base=$(run "default-p$pair" "$c")
      # shellcheck disable=SC2086  # OTHER_ARGS is a list of options
      other=$(run "other-p$pair" "$c" $other_args)
    else
      # shellcheck disable=SC2086
      other=$(run "other-p$pair" "$c" $other_args)
      base=$(run "default-p$pair" "$c")
    fi
    ratios="$ratios $(awk -v a="$base" -v b="$other" 'BEGIN {printf "%.3f", a / b}')"
  done
  echo "$c streams: defaults / other, output tok/s, per pair:$ratios"
done
