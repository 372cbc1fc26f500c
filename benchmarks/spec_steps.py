"""Forward passes needed by each speculative method on the grounded workload, one request at
a time in one engine per method (greedy; the output is the same for every method): steps,
drafts, draft and accepted tokens, and the shared-history hits of ``suffix``. Every
proposal found is verified (the planner's cost model and the guard stand aside: they use
measured times), so the counts compare the proposers alone and do not depend on how busy
the machine is.

    .venv/bin/python benchmarks/spec_steps.py [--methods ngram,suffix] [--num-prompts 24]
"""

from __future__ import annotations

import argparse
import json
import random

from llmserve import LLM, SamplingParams
from llmserve.bench.workloads import grounded_requests
from llmserve.spec_decode import StepCost


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="ngram,suffix")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    requests = grounded_requests(random.Random(args.seed), args.num_prompts)
    print("| method | output tokens | steps | drafts | draft tokens | accepted | shared hits |")
    print("|---|---|---|---|---|---|---|")
    for method in args.methods.split(","):
        llm = LLM(speculative_config={"method": method, "prompt_lookup_max": 4,
                                      "num_speculative_tokens": args.num_speculative_tokens})
        speculator = llm.engine.speculator
        speculator.cost = StepCost([(1, 1.0), (1 << 20, 1.0)])  # rows cost nothing
        speculator.guard = False
        start, tokens = llm.engine.stats().num_steps, 0
        for r in requests:
            out = llm.chat([[{"role": "user", "content": r.prompt}]],
                           SamplingParams(max_tokens=r.max_tokens, temperature=0))
            tokens += len(out[0].outputs[0].token_ids)
        s = llm.engine.stats()
        shared = getattr(speculator.proposer, "shared", None)
        row = dict(method=method, tokens=tokens, steps=s.num_steps - start,
                   drafts=s.spec_num_drafts, draft_tokens=s.spec_draft_tokens,
                   accepted=s.spec_accepted_tokens,
                   shared_hits=None if shared is None else shared.hits)
        print("| " + " | ".join("-" if v is None else str(v) for v in row.values()) + " |",
              flush=True)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
