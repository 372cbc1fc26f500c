"""w8a8's activation groups against one scale per row, batch-64 decode in one process.

The same code loads the model twice: as shipped (a scale per <= 256 inputs in the decoder
layers, per 64 in the output head) and configured as w8a8 was before the groups (one
scale per row, int8's two-level head); then batch-64 decode rates alternate between them.

    .venv/bin/python benchmarks/w8a8_groups_ab.py [kv cache dtype, default int8]
"""
import sys, statistics
sys.path.insert(0, "benchmarks")
from bench_cpu import decode_rate
from llmserve import LLM, SamplingParams
from llmserve.layers.quantization import base, w8a8
kv = sys.argv[1] if len(sys.argv) > 1 else "int8"
opts = dict(max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=64 * 128,
            kv_cache_memory=1.0, enable_prefix_caching=False, quantization="w8a8", kv_cache_dtype=kv)
new = LLM(**opts)
w8a8.W8A8Method.max_group = 10**9  # one scale per row
orig = base.WeightFormat.head_quantization
base.WeightFormat.head_quantization = property(lambda self: "int8")
old = LLM(**opts)
w8a8.W8A8Method.max_group = w8a8.BODY_GROUP
base.WeightFormat.head_quantization = orig
for llm in (new, old):
    llm.generate([[100, 200, 300]], SamplingParams(max_tokens=4))
res = {"new": [], "old": []}
for i in range(5):
    for name, llm in (("old", old), ("new", new)):
        res[name].append(decode_rate(llm, 64, 128, 32, i))
        print(name, round(res[name][-1], 1), flush=True)
for name, v in res.items():
    print(f"{name}: median {statistics.median(v):.1f} max {max(v):.1f} tok/s")
print(f"new/old median {statistics.median(res['new'])/statistics.median(res['old']):.3f}")
