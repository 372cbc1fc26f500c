"""The cost of constrained decoding: output tokens/s with a JSON schema and without, through
the server, at several concurrency levels.

One `llmserve serve` process. Each level sends the same extraction requests (chat, greedy)
twice: constrained by a JSON schema, then free, each free request with ignore_eos and
max_tokens set to the tokens its constrained twin produced, so both runs generate exactly
the same tokens per request at the same concurrency and the ratio is the grammar's cost
alone (mask computation, the masking itself, the end forced by the grammar). Runs alternate
(constrained, free, free, constrained) over --repeats pairs so a drift of the machine's
speed cancels; the ratio is of all tokens over all time.

    .venv/bin/python benchmarks/structured_output.py \
        --output benchmarks/results/structured_output.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time

import httpx
from serverproc import LocalServer

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "city", "job", "hobbies"],
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "job": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "maxItems": 3,
                    "items": {"type": "string", "maxLength": 30}}}}
NAMES = ["Ann Berg", "Omar Haddad", "Li Wei", "Sara Costa", "Jon Kim", "Maya Patel",
         "Luis Ortega", "Ines Dupont", "Tom Novak", "Aiko Sato"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Denver", "Krakow", "Lyon"]
JOBS = ["nurse", "baker", "pilot", "teacher", "welder", "architect", "chemist", "farmer"]
HOBBIES = ["chess", "running", "painting", "sailing", "baking", "cycling", "singing", "hiking"]


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name, city, job = rng.choice(NAMES), rng.choice(CITIES), rng.choice(JOBS)
        hobbies = rng.sample(HOBBIES, 2)
        out.append(f"{name} is {rng.randint(19, 80)} years old, lives in {city} and works as "
                   f"a {job}. In free time: {hobbies[0]} and {hobbies[1]}.\n"
                   "Extract name, age, city, job and hobbies as JSON.")
    return out


async def run_level(url: str, model: str, texts: list[str], concurrency: int,
                    constrained: bool, max_tokens: list[int]) -> tuple[list[int], float]:
    """Send every request (at most ``concurrency`` in flight); (completion tokens of each,
    wall seconds)."""
    sem = asyncio.Semaphore(concurrency)
    counts = [0] * len(texts)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": model, "temperature": 0, "max_tokens": max_tokens[i],
                "messages": [{"role": "user", "content": texts[i]}]}
        if constrained:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "person", "schema": SCHEMA}}
        else:
            body["ignore_eos"] = True
        async with sem:
            r = await client.post(f"{url}/v1/chat/completions", json=body)
        r.raise_for_status()
        out = r.json()
        counts[i] = out["usage"]["completion_tokens"]
        if constrained and out["choices"][0]["finish_reason"] == "stop":
            json.loads(out["choices"][0]["message"]["content"])  # it parses

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(len(texts))))
        return counts, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--server-args", default="--kv-cache-memory 1")
    ap.add_argument("--levels", default="1,16")
    ap.add_argument("--requests-per-stream", type=int, default=3)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()

    log_dir = tempfile.mkdtemp(prefix="structured-bench-")
    server = LocalServer(["--model", args.model, *args.server_args.split()],
                         os.path.join(log_dir, "server.log"))
    url = server.url
    try:
        print(f"{'streams':>7} {'requests':>8} {'free tok/s':>10} {'json tok/s':>10} "
              f"{'ratio':>6}  repeats (json/free)")
        results = []
        for level in (int(x) for x in args.levels.split(",")):
            n = max(args.min_requests, level * args.requests_per_stream)
            texts = prompts(n, seed=level)
            warm = [args.max_tokens] * n
            counts, _ = asyncio.run(run_level(url, args.model, texts, level, True, warm))
            tokens = {True: 0, False: 0}
            seconds = {True: 0.0, False: 0.0}
            ratios = []
            for r in range(args.repeats):
                pair = {}
                for constrained in ((True, False) if r % 2 == 0 else (False, True)):
                    got, secs = asyncio.run(run_level(
                        url, args.model, texts, level, constrained,
                        warm if constrained else counts))
                    assert got == counts, "the two runs must generate the same tokens"
                    tokens[constrained] += sum(got)
                    seconds[constrained] += secs
                    pair[constrained] = sum(got) / secs
                ratios.append(pair[True] / pair[False])
            free, con = tokens[False] / seconds[False], tokens[True] / seconds[True]
            row = {"streams": level, "requests": n, "tokens_per_run": sum(counts),
                   "free_tok_s": free, "json_tok_s": con, "ratio": con / free,
                   "repeat_ratios": ratios}
            results.append(row)
            print(f"{level:>7} {n:>8} {free:>10.1f} {con:>10.1f} {con / free:>6.3f}  "
                  + " ".join(f"{x:.3f}" for x in ratios), flush=True)
        if args.output:
            with open(args.output, "w") as f:
                json.dump({"model": args.model, "server_args": args.server_args,
                           "results": results}, f, indent=1)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
