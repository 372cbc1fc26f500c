"""Speculative decoding through the server: `--speculative-config` as vLLM takes it, the
same text as without it (streamed and not), and vLLM-named counters on /metrics."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from tests.e2e.conftest import API_KEY, start_server

# Not adaptive: the tiny model's steps last well under a millisecond, and whether the cost
# model expects a gain from drafts there turns on timing noise at start-up.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "adaptive": False}


@pytest.fixture(scope="module")
def spec_server(tiny_path, tmp_path_factory):
    server = start_server(tiny_path, tmp_path_factory.mktemp("spec"), "--max-num-seqs", "16",
                          "--max-model-len", "1024", "--max-num-batched-tokens", "512",
                          "--speculative-config", json.dumps(SPEC))
    yield server
    assert server.stop() == 0


def _prompts() -> list[list[int]]:
    return [list(range(300 + 7 * i, 311 + 7 * i)) * (2 + i % 3) for i in range(6)]


def test_same_text_as_without_speculation_and_counted(spec_server, tiny_server):
    plain = openai.OpenAI(base_url=tiny_server.v1, api_key=API_KEY)
    spec = openai.OpenAI(base_url=spec_server.v1, api_key="unused")
    for prompt in _prompts():
        kw = dict(prompt=prompt, max_tokens=40, temperature=0, logprobs=1)
        want = plain.completions.create(model=tiny_server.model, **kw).choices[0]
        got = spec.completions.create(model=spec_server.model, **kw).choices[0]
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
        assert got.logprobs.tokens == want.logprobs.tokens
        streamed = "".join(
            c.choices[0].text for c in spec.completions.create(
                model=spec_server.model, stream=True, **kw) if c.choices)
        assert streamed == want.text
    m = spec_server.wait_idle()
    drafts = m["llmserve:spec_decode_num_drafts_total"]
    draft_tokens = m["llmserve:spec_decode_num_draft_tokens_total"]
    accepted = m["llmserve:spec_decode_num_accepted_tokens_total"]
    assert 0 < drafts <= draft_tokens and 0 < accepted <= draft_tokens
    per_pos = {k: v for k, v in m.items()
               if k.startswith("llmserve:spec_decode_num_accepted_tokens_per_pos_total")}
    assert per_pos and sum(per_pos.values()) == accepted
    first = next(v for k, v in per_pos.items() if 'position="0"' in k)
    assert first == max(per_pos.values()) and first <= drafts  # position 0 is reached most


@pytest.mark.parametrize("config, message", [
    ('{"method": "eagle"}', "speculative method must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "k": 3}', "unknown speculative config keys ['k']"),
    ("ngram", "not valid JSON"),
])
def test_bad_speculative_config_is_refused_at_start(tiny_path, config, message):
    proc = subprocess.run([sys.executable, "-m", "llmserve.cli", "serve", "--model", tiny_path,
                           "--speculative-config", config], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr and proc.stderr.startswith("llmserve: error:")
