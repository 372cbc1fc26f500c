"""The offline benchmark's three modes on a tiny model: each generates exactly the tokens
it should (padded static batches compute their longest member's length in every row) and
the engine's KV pool is intact after each."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from llmserve.bench.offline import MODES, offline_table, padded_lengths, run_mode, run_offline


def test_padded_lengths_are_each_batch_longest():
    assert padded_lengths([3, 9, 2, 5, 7], 2) == [9, 9, 5, 5, 7]
    assert padded_lengths([4], 64) == [4]


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="modes must be some of continuous"):
        run_offline("unused", 1, 0, 1.0, 1, 16, modes=("fast",))


@pytest.mark.parametrize("mode", MODES)
def test_modes_generate_the_workload(tiny_model_dir, mode):
    path, _ = tiny_model_dir("llama-gqa")
    prompts = [[17 + i + j for j in range(n)] for i, n in enumerate([5, 40, 12, 70, 3])]
    output_lens = [6, 2, 11, 4, 9]
    r = run_mode(str(path), mode, prompts, output_lens, kv_cache_memory=0.01,
                 max_num_seqs=2, max_num_batched_tokens=32, quantization="none")
    assert r.output_tokens == sum(output_lens)  # (run_mode checks what it generated)
    assert r.prompt_tokens == 130
    if mode == "static-padded":  # batches {6,2}, {11,4}, {9}: rows run 6, 11 and 9 steps
        assert r.steps >= 6 + 11 + 9
    assert 0 < r.paged_utilization_at_peak <= 1


def test_sliding_windows_are_reported_as_memory_saved(tiny_model_dir):
    """Gemma 3 (window 32): long sequences hold fewer blocks than with every layer global,
    and the utilization counts only what the held blocks store."""
    path, _ = tiny_model_dir("gemma3")
    prompts = [[17 + i + j for j in range(n)] for i, n in enumerate([150, 90, 200])]
    r = run_mode(str(path), "continuous", prompts, [40, 60, 30], kv_cache_memory=0.01,
                 max_num_seqs=3, max_num_batched_tokens=64, quantization="none")
    assert 0.5 < r.paged_utilization_at_peak <= 1
    assert r.peak_kv_blocks_without_windows > 1.5 * r.peak_kv_blocks_used
    report = {"results": [asdict(r)], "ratios": {}}
    assert "less KV memory" in offline_table(report)
