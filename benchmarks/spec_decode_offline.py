"""One stream, in-process: engines with speculative decoding against the same engine
without, on the grounded workload's prompts (chat template, greedy, the model stops by
itself). All engines live in this process and run each prompt in turn, rotating which
goes first; printed: output tokens/s of each (prefill included), the ratio of each
speculating engine to the plain one, and its acceptance rate and mean accepted length. Made
for proposers that are not cheap (a draft model), e.g. the int4 copy of the default model
drafting for its float32 self:

    .venv/bin/python benchmarks/spec_decode_offline.py --quantization none \\
        --speculative-config '{"method": "draft", "model": "smollm2-135m-instruct",
                               "quantization": "int4", "num_speculative_tokens": 4}'

``--speculative-config`` may be given more than once: each is its own engine, measured in
the same rotation (an A/B of two configurations against one baseline).
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
    p.add_argument("--speculative-config", action="append", required=True)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--kv-cache-dtype", default="auto", help="every engine's (and draft's)")
    p.add_argument("--dtype", default=None,
                   help="the dense weights' dtype of every engine (float32, bfloat16)")
    args = p.parse_args()
    requests = grounded_requests(random.Random(args.seed), args.num_prompts)
    configs = {"off": None} | {f"on{j + 1}": json.loads(c)
                               for j, c in enumerate(args.speculative_config)}
    engines = {name: LLM(args.model, quantization=args.quantization, kv_cache_memory=0.5,
                         kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype,
                         speculative_config=c)
               for name, c in configs.items()}
    names = list(engines)
    seconds = dict.fromkeys(names, 0.0)
    tokens = dict.fromkeys(names, 0)
    same = dict.fromkeys(names, True)
    for i, req in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=req.max_tokens)
        outs = {}
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.perf_counter()
            out = engines[name].chat([{"role": "user", "content": req.prompt}], params)[0]
            seconds[name] += time.perf_counter() - start
            outs[name] = out.outputs[0].token_ids
            tokens[name] += len(outs[name])
        for name in names:
            same[name] &= outs[name] == outs["off"]
    off = tokens["off"] / seconds["off"]
    print(f"model {args.model} ({args.quantization}); {len(requests)} grounded prompts one "
          f"at a time, {tokens['off']} output tokens; off {off:.1f} tok/s")
    for name in names[1:]:
        stats = engines[name].engine.stats()
        on = tokens[name] / seconds[name]
        drafts, draft_tokens, acc = (stats.spec_num_drafts, stats.spec_draft_tokens,
                                     stats.spec_accepted_tokens)
        print(f"{name} {json.dumps(configs[name])}")
        print(f"  on {on:.1f} tok/s: {on / off:.2f}x; identical output: {same[name]}; "
              f"acceptance {acc / max(draft_tokens, 1):.0%}, mean accepted length "
              f"{1 + acc / max(drafts, 1):.2f} ({drafts} verifying steps)")
        proposer = engines[name].engine.speculator.proposer
        if getattr(proposer, "guessed", 0):
            print(f"  prompt-lookup guesses checked by the draft: {proposer.guessed}, "
                  f"confirmed {proposer.guesses_kept} "
                  f"({proposer.guesses_kept / proposer.guessed:.0%})")


if __name__ == "__main__":
    main()
