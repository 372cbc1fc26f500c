#!/usr/bin/env bash
# One session on a lent GPU machine, from the repository root: the CUDA tests, then
# benchmarks/cuda_bench.py, then the HTTP server on the GPU (benchmarks/cuda_server_smoke.py;
# SKIP_TESTS=1, SKIP_BENCH=1 and SERVER=0 skip each; TEST_FILES replaces the test files),
# then, with PROFILE=variant,...,
# benchmarks/cuda_profile.py's kernel table and those variants (PROFILE_TIMEOUT, default 120;
# PROFILE_ARGS, e.g. "--rounds 2"), and with ATTENTION=1 benchmarks/cuda_attention.py (the
# decode attention's time a layer inside a graph; ATTENTION_TIMEOUT, default 120). Expects .gpu/whl (wheels of what the machine's image lacks for the
# engine and the server) and .gpu/tokenizer (SmolLM2's tokenizer, saved), carried along
# (benchmarks/cuda_payload.sh makes them). Writes logs and results to $OUT (default:
# ./cuda-out).
set -uo pipefail
OUT=${OUT:-cuda-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:$PWD:/tmp/site PYTHONUNBUFFERED=1
export LLMSERVE_CPU_KERNELS=0 LLMSERVE_TEST_TOKENIZER=$PWD/.gpu/tokenizer
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider --maxfail="${MAXFAIL:-1}" \
      ${TEST_FILES:-tests/unit/test_triton_ops.py tests/unit/test_triton_linear.py tests/unit/test_triton_attention.py tests/model/test_cuda.py} ${TEST_ARGS:-} \
      2>&1 | tee "$OUT/pytest.log" | tail -25
fi
python3 - <<'PY'  # what the server would import and this machine's image lacks
import importlib.util
mods = ("fastapi uvicorn starlette pydantic sqlalchemy alembic zmq prometheus_client psutil httpx "
        "anyio h11 click platformdirs msgspec llguidance gguf jinja2 opentelemetry yaml "
        "markupsafe mako tqdm annotated_doc").split()
print("missing modules:", [m for m in mods if importlib.util.find_spec(m) is None] or "none")
PY
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/cuda_bench.py --tokenizer .gpu/tokenizer \
      --out "$OUT/cuda_bench.json" ${BENCH_ARGS:-} 2>&1 | grep -v " INFO " | tee "$OUT/bench.log" | tail -20
fi
if [ "${SERVER:-1}" != 0 ]; then  # the HTTP server on the GPU (needs the server's wheels)
  timeout "${SERVER_TIMEOUT:-200}" python3 benchmarks/cuda_server_smoke.py --device cuda \
      --tokenizer .gpu/tokenizer > "$OUT/server.log" 2>&1  # the server's log on a failure
  grep -E "^(ok|FAIL)" "$OUT/server.log"
fi
if [ -n "${PROFILE:-}" ]; then  # where a decode step's GPU time goes, and variants of it
  timeout "${PROFILE_TIMEOUT:-120}" python3 benchmarks/cuda_profile.py --tokenizer .gpu/tokenizer \
      --variants "$PROFILE" --out "$OUT/profile.json" ${PROFILE_ARGS:-} 2>&1 | grep -v " INFO " \
      | tee "$OUT/profile.log" | sed -n 1,40p  # (head would stop the run with SIGPIPE)
fi
if [ "${ATTENTION:-0}" = 1 ]; then  # the decode attention a layer, inside a CUDA graph
  timeout "${ATTENTION_TIMEOUT:-120}" python3 benchmarks/cuda_attention.py \
      --out "$OUT/attention.json" ${ATTENTION_ARGS:-} 2>&1 | tee "$OUT/attention.log" | tail -15
fi
