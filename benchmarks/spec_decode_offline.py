"""One stream, in-process: an engine with speculative decoding against the same engine
without, on the grounded workload's prompts (chat template, greedy, the model stops by
itself). Both engines live in this process and run each prompt in turn, alternating which
goes first; printed: output tokens/s of each (prefill included), their ratio, and the
acceptance rate and mean accepted length. Made for proposers that are not cheap (a draft
model), e.g. the int4 copy of the default model drafting for its float32 self:

    .venv/bin/python benchmarks/spec_decode_offline.py --quantization none \\
        --speculative-config '{"method": "draft", "model": "smollm2-135m-instruct",
                               "quantization": "int4", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import json
import random
import time

from llmserve import LLM, SamplingParams
from llmserve.bench.workloads import grounded_requests


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--speculative-config", required=True)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--seed", type=int, default=3)
    args = p.parse_args()
    requests = grounded_requests(random.Random(args.seed), args.num_prompts)
    engines = {"off": LLM(args.model, quantization=args.quantization, kv_cache_memory=0.5),
               "on": LLM(args.model, quantization=args.quantization, kv_cache_memory=0.5,
                         speculative_config=json.loads(args.speculative_config))}
    seconds = {"off": 0.0, "on": 0.0}
    tokens = {"off": 0, "on": 0}
    same = True
    for i, req in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=req.max_tokens)
        outs = {}
        for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
            start = time.perf_counter()
            out = engines[name].chat([{"role": "user", "content": req.prompt}], params)[0]
            seconds[name] += time.perf_counter() - start
            outs[name] = out.outputs[0].token_ids
            tokens[name] += len(outs[name])
        same &= outs["on"] == outs["off"]
    stats = engines["on"].engine.stats()
    off, on = tokens["off"] / seconds["off"], tokens["on"] / seconds["on"]
    drafts, draft_tokens, acc = (stats.spec_num_drafts, stats.spec_draft_tokens,
                                 stats.spec_accepted_tokens)
    print(f"model {args.model} ({args.quantization}), {args.speculative_config}")
    print(f"{len(requests)} grounded prompts one at a time, {tokens['off']} output tokens; "
          f"identical output: {same}")
    print(f"off {off:.1f} tok/s, on {on:.1f} tok/s: {on / off:.2f}x; acceptance "
          f"{acc / max(draft_tokens, 1):.0%}, mean accepted length "
          f"{1 + acc / max(drafts, 1):.2f} ({drafts} verifying steps)")


if __name__ == "__main__":
    main()
