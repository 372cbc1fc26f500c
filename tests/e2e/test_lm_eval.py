"""lm-evaluation-harness against a live server: the README's command (the local-completions
model, which scores each choice with echo and logprobs) on a small multiple-choice task
shipped in tests/e2e/lm_eval_task. Its per-question choices and its accuracy must equal
those scored directly through the offline LLM (the continuation's prompt logprobs summed,
argmax over the choices); nothing is downloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmserve import LLM, SamplingParams
from tests.e2e.conftest import API_KEY

REPO = Path(__file__).resolve().parents[2]
TASK_DIR = Path(__file__).resolve().parent / "lm_eval_task"
TASK = "llmserve_mc"


def _docs() -> list[dict]:
    return [json.loads(line) for line in (TASK_DIR / "questions.jsonl").read_text().splitlines()]


def _context(doc: dict) -> str:
    return f"Question: {doc['question']}\nAnswer:"  # the task's doc_to_text


@pytest.fixture(scope="module")
def tokenizer_dir(smol_tokenizer, tmp_path_factory) -> Path:
    """A Hugging Face tokenizer directory for lm-eval (it counts the context's tokens)."""
    path = tmp_path_factory.mktemp("hf_tokenizer")
    smol_tokenizer.save(path)
    return path


def run_lm_eval(url: str, model: str, tokenizer_dir: Path, tokenized: bool,
                out: Path) -> tuple[float, list[dict]]:
    """Run lm_eval's CLI as the README shows; returns acc and the per-question samples."""
    args = (f"model={model},base_url={url}/v1/completions,tokenizer={tokenizer_dir},"
            f"tokenizer_backend=huggingface,tokenized_requests={tokenized},"
            "num_concurrent=1,max_retries=1")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(out / "datasets"), "OPENAI_API_KEY": API_KEY}
    done = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
         "--tasks", TASK, "--include_path", str(TASK_DIR.relative_to(REPO)),
         "--output_path", str(out / "results"), "--log_samples"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next((out / "results").rglob("results_*.json")).read_text())
    samples_file = next((out / "results").rglob(f"samples_{TASK}_*.jsonl"))
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    return results["results"][TASK]["acc,none"], sorted(samples, key=lambda s: s["doc_id"])


def direct_scores(llm: LLM, docs: list[dict]) -> list[list[float]]:
    """Per question and choice: the log-likelihood of " choice" after the question, from the
    prompt logprobs of one prompt-only request per choice."""
    tok = llm.tokenizer
    prompts, starts = [], []
    for doc in docs:
        context = tok.encode(_context(doc))
        for choice in doc["choices"]:
            whole = tok.encode(f"{_context(doc)} {choice}")
            assert whole[:len(context)] == context  # the choice starts a token of its own
            prompts.append(whole)
            starts.append(len(context))
    outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0))
    flat = [sum(out.prompt_logprobs[j][ids[j]].logprob for j in range(start, len(ids)))
            for out, ids, start in zip(outs, prompts, starts)]
    scores, i = [], 0
    for doc in docs:
        scores.append(flat[i:i + len(doc["choices"])])
        i += len(doc["choices"])
    return scores


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def check_agreement(acc: float, samples: list[dict], scores: list[list[float]],
                    docs: list[dict]) -> None:
    assert [s["doc_id"] for s in samples] == list(range(len(docs)))
    for sample, doc, direct in zip(samples, docs, scores):
        contexts = {a["arg_0"] for a in sample["arguments"].values()}
        assert contexts == {_context(doc)}
        lm_eval_lls = [float(ll) for ll, _ in sample["filtered_resps"]]
        assert lm_eval_lls == pytest.approx(direct, abs=1e-4), doc["question"]
        assert _argmax(lm_eval_lls) == _argmax(direct), doc["question"]
        assert sample["acc"] == float(_argmax(direct) == doc["answer"])
    direct_acc = sum(_argmax(s) == d["answer"] for s, d in zip(scores, docs)) / len(docs)
    assert acc == direct_acc


@pytest.fixture(scope="module")
def tiny_llm(tiny_path) -> LLM:
    return LLM(tiny_path, num_kv_blocks=256, max_model_len=1024)


@pytest.mark.parametrize("tokenized", [True, False], ids=["token-ids", "text"])
def test_lm_eval_on_the_tiny_model_agrees_with_direct_scoring(tiny_server, tiny_llm,
                                                              tokenizer_dir, tokenized,
                                                              tmp_path):
    docs = _docs()
    acc, samples = run_lm_eval(tiny_server.url, tiny_server.model, tokenizer_dir, tokenized,
                               tmp_path)
    check_agreement(acc, samples, direct_scores(tiny_llm, docs), docs)


@pytest.mark.slow
def test_lm_eval_on_smollm2_agrees_with_direct_scoring(real_server, tokenizer_dir, tmp_path):
    docs = _docs()
    acc, samples = run_lm_eval(real_server.url, real_server.model, tokenizer_dir, False,
                               tmp_path)
    llm = LLM(real_server.model)
    check_agreement(acc, samples, direct_scores(llm, docs), docs)
    assert acc >= 0.6  # a real model knows most of these (random choice: 0.25)
