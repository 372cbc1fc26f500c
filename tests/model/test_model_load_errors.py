"""A model that cannot be used fails in one ModelLoadError (a ValueError) naming the file and
what is wrong in it: metadata that would divide by zero or build an empty model, paths that
cannot be read, and sharded checkpoints whose files do not agree with their index. A stray
or missing shard must never load silently."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from llmserve.errors import ModelLoadError
from llmserve.models.loader import load_model
from tests.helpers.gguf_files import write_llama_gguf


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama-gqa")


def _load(path: Path | str) -> None:
    load_model(str(path), quantization="none")


@pytest.mark.parametrize(("metadata", "message"), [
    ({"llama.attention.head_count": 0}, "num_attention_heads must be a positive integer, got 0"),
    ({"llama.attention.head_count_kv": 0}, "num_key_value_heads must be a positive integer"),
    ({"llama.context_length": 0}, "max_position_embeddings must be a positive integer, got 0"),
    ({"llama.block_count": None}, "incomplete model metadata (no 'llama.block_count')"),
    ({"llama.feed_forward_length": "wide"}, "llama.feed_forward_length must be an integer"),
    ({"general.alignment": 0}, "general.alignment must be a power of two, got 0"),
    ({"general.alignment": 3}, "general.alignment must be a power of two, got 3"),
])
def test_gguf_metadata_that_cannot_build_a_model_is_named(tmp_path, tiny, metadata, message):
    _, hf_model = tiny
    path = tmp_path / "broken.gguf"
    write_llama_gguf(hf_model, path, QT.F32, metadata=metadata)
    with pytest.raises(ModelLoadError) as err:
        _load(path)
    assert str(err.value).startswith(str(path)) and message in str(err.value)


def _hf_copy(tmp_path: Path, tiny, edit=None) -> Path:
    src, _ = tiny
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    if edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(edit(cfg)))
    return dst


@pytest.mark.parametrize(("edit", "message"), [
    (lambda c: [c], "must hold a JSON object, not a list"),
    (lambda c: {**c, "rope_scaling": [8.0]}, "rope_scaling must be an object, got [8.0]"),
    (lambda c: {**c, "hidden_size": -64}, "hidden_size must be a positive integer, got -64"),
    (lambda c: {**c, "num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    (lambda c: {**c, "num_attention_heads": None}, "num_attention_heads is null: it must be an "
                                                   "integer"),
    (lambda c: {**c, "num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
    (lambda c: {**c, "max_position_embeddings": 0}, "max_position_embeddings must be a positive"),
    (lambda c: {**c, "intermediate_size": 1.5}, "intermediate_size must be an integer, got 1.5"),
    (lambda c: {**c, "architectures": "LlamaForCausalLM"}, "architectures must be a list"),
])
def test_hf_configs_that_cannot_build_a_model_are_named(tmp_path, tiny, edit, message):
    path = _hf_copy(tmp_path, tiny, edit)
    with pytest.raises(ModelLoadError) as err:
        _load(path)
    assert str(path / "config.json") in str(err.value) and message in str(err.value)


def test_a_config_that_is_not_utf8_says_so(tmp_path, tiny):
    path = _hf_copy(tmp_path, tiny)
    (path / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ModelLoadError, match="invalid JSON"):
        _load(path)


def test_a_directory_without_tokenizer_files_says_which_it_looked_for(tmp_path, tiny):
    path = _hf_copy(tmp_path, tiny)
    (path / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        _load(path)


def _sharded(tmp_path: Path, tiny_model_dir) -> Path:
    src, _ = tiny_model_dir("llama-gqa", max_shard_size="2MB")
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    assert (dst / "model.safetensors.index.json").is_file()
    return dst


def _first_logits(path: Path) -> torch.Tensor:
    loaded = load_model(str(path), quantization="none")
    from llmserve.runner.scoring import sequence_logits

    return sequence_logits(loaded.model, [1, 400, 500, 600])


def test_a_sharded_checkpoint_loads_the_files_its_index_names(tmp_path, tiny_model_dir, tiny):
    """A stray *.safetensors file beside the shards (a backup, another model's weights) is
    not loaded: the index says which files hold the model, as transformers reads it."""
    path = _sharded(tmp_path, tiny_model_dir)
    want = _first_logits(path)
    other, _ = tiny_model_dir("llama-tied")
    shutil.copy(other / "model.safetensors", path / "zz-backup.safetensors")
    assert torch.equal(_first_logits(path), want)


def test_a_shard_the_index_names_is_named_when_missing(tmp_path, tiny_model_dir):
    path = _sharded(tmp_path, tiny_model_dir)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[0]
    (path / gone).unlink()
    with pytest.raises(ModelLoadError, match=f"named by model.safetensors.index.json are "
                                             f"missing: {gone}"):
        _load(path)


def test_a_corrupt_index_is_refused(tmp_path, tiny_model_dir):
    path = _sharded(tmp_path, tiny_model_dir)
    (path / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}')
    with pytest.raises(ModelLoadError, match="not a safetensors index"):
        _load(path)


def test_a_tensor_in_two_files_without_an_index_is_refused(tmp_path, tiny_model_dir):
    path = _sharded(tmp_path, tiny_model_dir)
    (path / "model.safetensors.index.json").unlink()
    shard = sorted(path.glob("*.safetensors"))[0]
    shutil.copy(shard, path / "zz-copy.safetensors")
    with pytest.raises(ModelLoadError, match="is also in"):
        _load(path)


def test_paths_that_are_not_models_are_named(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelLoadError, match="neither a regular file nor a directory"):
        _load(fifo)  # does not block on opening the pipe
    with pytest.raises(ModelLoadError, match="the model is an empty name"):
        _load("")
    with pytest.raises(ModelLoadError, match="~no-such-user-llmserve"):
        _load("~no-such-user-llmserve/model.gguf")


def test_a_model_path_is_taken_as_a_path_object(tiny):
    from llmserve import LLM

    path, _ = tiny
    assert LLM(path, num_kv_blocks=16).generate([[1, 2, 3]])[0].outputs[0].token_ids


_UNREADABLE = """
import sys
from llmserve.errors import ModelLoadError
from llmserve.models.loader import load_model
for path in sys.argv[1:]:
    try:
        load_model(path, quantization="none")
    except ModelLoadError as e:
        print(e)
    else:
        print("loaded", path)
"""


def test_files_that_cannot_be_read_say_permission_denied(tmp_path, tiny):
    """As a user without read permission (root: with its override dropped by setpriv)."""
    src, hf_model = tiny
    gguf = tmp_path / "noperm.gguf"
    write_llama_gguf(hf_model, gguf, QT.F32)
    locked_dir = tmp_path / "locked"
    shutil.copytree(src, locked_dir)
    inside = locked_dir / "inner.gguf"
    shutil.copy(gguf, inside)
    cfg_locked = shutil.copytree(src, tmp_path / "cfg-locked")
    weights_locked = shutil.copytree(src, tmp_path / "weights-locked")
    for f in (gguf, cfg_locked / "config.json", weights_locked / "model.safetensors"):
        f.chmod(0)
    locked_dir.chmod(0)
    cmd = [sys.executable, "-c", _UNREADABLE]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: every file is readable")
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *cmd]
    paths = [gguf, locked_dir, inside, cfg_locked, weights_locked]
    try:
        out = subprocess.run([*cmd, *map(str, paths)], capture_output=True, text=True,
                             timeout=120, cwd=Path(__file__).parents[2])
    finally:
        locked_dir.chmod(0o755)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == len(paths), out.stderr[-2000:]
    for line in lines:
        assert "Permission denied" in line and "Traceback" not in line, lines
    assert lines[3].startswith(str(cfg_locked / "config.json"))
    assert lines[4].startswith(str(weights_locked / "model.safetensors"))
