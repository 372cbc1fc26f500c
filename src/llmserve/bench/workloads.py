"""Request workloads. Prompts are text made of common English words (about one token per
word in byte-level BPE vocabularies), so the tool needs no tokenizer and works against any
server; the real prompt and output lengths come back in each response's usage.

Every workload is a deterministic function of its parameters and ``seed``: two runs with
the same arguments send the same requests.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from functools import cache
from importlib import resources
from pathlib import Path

WORKLOADS = ("random", "sharegpt", "shared-prefix", "long", "grounded", "jsonl")


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_words: int
    max_tokens: int


@dataclass(frozen=True)
class WorkloadSpec:
    name: str = "random"
    num_requests: int = 100
    input_len: int = 256  # random / long: prompt words
    output_len: int = 128  # random / long / shared-prefix: max_tokens
    range_ratio: float = 0.0  # random: lengths uniform in [len * (1 - r), len * (1 + r)]
    prefix_len: int = 512  # shared-prefix: words of the shared system prompt
    num_prefixes: int = 1  # shared-prefix: distinct shared prompts
    jsonl_path: str | None = None  # jsonl: one {"prompt": ..., "max_tokens": ...} a line
    seed: int = 0

    def __post_init__(self) -> None:
        """The ranges the flags of ``llmserve bench`` allow (named by their flags)."""
        for flag, value, least in (("--num-prompts", self.num_requests, 1),
                                   ("--input-len", self.input_len, 1),
                                   ("--output-len", self.output_len, 1),
                                   ("--prefix-len", self.prefix_len, 0),
                                   ("--num-prefixes", self.num_prefixes, 1)):
            if value < least:
                raise ValueError(f"{flag} must be >= {least}, got {value}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"--range-ratio must be in [0, 1): lengths are drawn from "
                             f"[len * (1 - r), len * (1 + r)]; got {self.range_ratio}")

    def describe(self) -> str:
        if self.name == "grounded":
            return (f"grounded: {self.num_requests} requests, tasks {', '.join(GROUNDED_TASKS)} "
                    f"in turn over the texts of bench/grounded.txt, seed {self.seed}")
        if self.name == "sharegpt":
            return (f"sharegpt-like: {self.num_requests} requests, {sharegpt_description()} "
                    f"(prompt lengths in words), seed {self.seed}")
        fields = {k: v for k, v in asdict(self).items() if v is not None}
        return ", ".join(f"{k}={v}" for k, v in fields.items())


# Means match ShareGPT as the vLLM paper reports it (Kwon et al., SOSP 2023: 161 input and
# 338 output tokens on average): lognormal sigma 0.9 puts the mean at 1.5x the median.
_SHAREGPT = dict(p_median=110, p_sigma=0.9, p_min=4, p_max=1024,
                 o_median=230, o_sigma=0.9, o_min=4, o_max=2048)


def sharegpt_lengths(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    """ShareGPT-like (prompt, output) lengths: lognormal, many short turns, a long tail.
    Shared by the HTTP workload (words) and the offline benchmark (token ids)."""
    s = _SHAREGPT
    prompts = [_clip(rng.lognormvariate(math.log(s["p_median"]), s["p_sigma"]), s["p_min"],
                     s["p_max"]) for _ in range(n)]
    outputs = [_clip(rng.lognormvariate(math.log(s["o_median"]), s["o_sigma"]), s["o_min"],
                     s["o_max"]) for _ in range(n)]
    return prompts, outputs


def sharegpt_description() -> str:
    s = _SHAREGPT
    return (f"prompt ~ lognormal(median {s['p_median']}, sigma {s['p_sigma']}) in "
            f"[{s['p_min']}, {s['p_max']}], output tokens ~ lognormal(median {s['o_median']}, "
            f"sigma {s['o_sigma']}) in [{s['o_min']}, {s['o_max']}]")


def level_seed(seed: int, index: int) -> int:
    """The seed of a sweep's index-th level: each level gets prompts of its own."""
    return seed + 7919 * index


def build_workload(spec: WorkloadSpec) -> list[BenchRequest]:
    if spec.name not in WORKLOADS:
        raise ValueError(f"unknown workload {spec.name!r}; choose from {', '.join(WORKLOADS)}")
    rng = random.Random(spec.seed)
    n = spec.num_requests
    if spec.name == "jsonl":
        return _from_jsonl(spec)
    if spec.name == "grounded":
        return grounded_requests(rng, n)
    if spec.name == "sharegpt":
        prompts, outputs = sharegpt_lengths(rng, n)
        return [BenchRequest(_text(rng, p), p, o) for p, o in zip(prompts, outputs)]
    if spec.name == "shared-prefix":
        prefixes = [_text(rng, spec.prefix_len) for _ in range(spec.num_prefixes)]
        out = []
        for i in range(n):
            tail = max(1, spec.input_len)
            out.append(BenchRequest(f"{prefixes[i % len(prefixes)]}\n\n{_text(rng, tail)}",
                                    spec.prefix_len + tail, spec.output_len))
        return out
    length = spec.input_len if spec.name == "random" else max(spec.input_len, 2048)
    lo = max(1, int(length * (1 - spec.range_ratio)))
    hi = max(lo, int(length * (1 + spec.range_ratio)))
    out_lo = max(1, int(spec.output_len * (1 - spec.range_ratio)))
    out_hi = max(out_lo, int(spec.output_len * (1 + spec.range_ratio)))
    reqs = []
    for _ in range(n):
        p = rng.randint(lo, hi)
        reqs.append(BenchRequest(_text(rng, p), p, rng.randint(out_lo, out_hi)))
    return reqs


def _from_jsonl(spec: WorkloadSpec) -> list[BenchRequest]:
    if not spec.jsonl_path:
        raise ValueError("the jsonl workload needs --dataset PATH")
    try:
        text = Path(spec.jsonl_path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(f"--dataset: cannot read {spec.jsonl_path}: {reason}") from None
    reqs = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
            max_tokens = int(row.get("max_tokens", spec.output_len))
            if not isinstance(prompt, str) or max_tokens < 1:
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            raise ValueError(f"{spec.jsonl_path}:{i + 1}: expected a JSON object with a "
                             "'prompt' (a string) and optionally 'max_tokens' (an integer "
                             ">= 1)") from None
        reqs.append(BenchRequest(prompt, len(prompt.split()), max_tokens))
    if not reqs:
        raise ValueError(f"{spec.jsonl_path}: no prompts")
    return [reqs[i % len(reqs)] for i in range(spec.num_requests)]


def _clip(x: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, int(x)))


@cache
def _words() -> tuple[str, ...]:
    text = resources.files("llmserve.bench").joinpath("words.txt").read_text()
    return tuple(w for w in text.split() if w)


def _text(rng: random.Random, n_words: int) -> str:
    words = _words()
    return " ".join(rng.choice(words) for _ in range(n_words))


# ---- input-grounded tasks: the answer copies much of the prompt ---------------------------

GROUNDED_TASKS = ("edit", "summarize", "answer", "code")


@dataclass(frozen=True)
class _Text:
    kind: str  # passage | code
    title: str
    body: str
    questions: tuple[str, ...]


@cache
def _grounded_texts() -> tuple[_Text, ...]:
    raw = resources.files("llmserve.bench").joinpath("grounded.txt").read_text()
    texts, head, lines = [], None, []

    def close():
        if head is not None:
            kind, title = (x.strip() for x in head.split(":", 1))
            body = [ln for ln in lines if not ln.startswith("Q: ")]
            questions = tuple(ln[3:] for ln in lines if ln.startswith("Q: "))
            texts.append(_Text(kind, title, "\n".join(body).strip("\n"), questions))

    for line in raw.splitlines():
        if line.startswith("=== "):
            close()
            head, lines = line[4:], []
        elif head is not None and not line.startswith("#"):
            lines.append(line)
    close()
    return tuple(texts)


def _with_typos(rng: random.Random, text: str, count: int) -> str:
    """Swap two neighbouring letters in ``count`` words of 5+ letters."""
    words = text.split(" ")
    candidates = [i for i, w in enumerate(words) if w.isalpha() and len(w) >= 5]
    for i in rng.sample(candidates, min(count, len(candidates))):
        w = words[i]
        j = rng.randrange(1, len(w) - 2)
        words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def grounded_requests(rng: random.Random, n: int) -> list[BenchRequest]:
    """Edit a passage (fix typos), summarize it, answer a question from it, rewrite code:
    in turn, each over a text drawn at random from the shipped ones."""
    passages = [t for t in _grounded_texts() if t.kind == "passage"]
    code = [t for t in _grounded_texts() if t.kind == "code"]
    out = []
    for i in range(n):
        task = GROUNDED_TASKS[i % len(GROUNDED_TASKS)]
        if task == "code":
            t = rng.choice(code)
            action = rng.choice(["Add type hints and a docstring to", "Rename the variables "
                                 "to clearer names in", "Add comments explaining each step "
                                 "of"])
            prompt = (f"{action} the following Python code. Reply with the complete "
                      f"code only.\n\n```python\n{t.body}\n```")
            max_tokens = 2 * len(t.body.split()) + 64
        else:
            t = rng.choice(passages)
            if task == "edit":
                prompt = ("Correct the spelling mistakes in the following text. Reply with "
                          "the whole corrected text and nothing else.\n\n"
                          + _with_typos(rng, t.body, 4))
                max_tokens = int(1.5 * len(t.body.split())) + 32
            elif task == "summarize":
                prompt = f"Summarize the following text in three sentences.\n\n{t.body}"
                max_tokens = 128
            else:
                prompt = ("Answer the question using only the text below; quote the "
                          f"sentence that answers it.\n\n{t.body}\n\nQuestion: "
                          f"{rng.choice(t.questions)}")
                max_tokens = 96
        out.append(BenchRequest(prompt, len(prompt.split()), max_tokens))
    return out
