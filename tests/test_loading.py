"""The bfloat16 copy of a cached checkpoint (`hf_polybasic.cli.loading`), on a tiny model saved
with ``save_pretrained`` in the test: no download."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_polybasic.testing import make_target
from hf_polybasic.cli import loading, models


@pytest.fixture
def saved_model(tmp_path):
    model = make_target("llama", seed=3)
    directory = tmp_path / "tiny-model"
    model.save_pretrained(directory)  # safetensors, float32
    assert list(directory.glob("*.safetensors"))
    return model, directory


def test_bf16_copy_equals_the_source_cast_to_bf16(saved_model, monkeypatch):
    model, directory = saved_model
    monkeypatch.setattr(models, "install", lambda name, cache_dir=None: directory)
    copy_dir = loading.bf16_directory("tiny-model")
    assert copy_dir == directory.with_name("tiny-model" + loading.BF16_SUFFIX)
    assert (copy_dir / loading.BF16_MANIFEST).is_file() and not copy_dir.with_name(copy_dir.name + ".partial").exists()
    assert (copy_dir / "config.json").is_file()

    # the files hold the source's tensors cast to bf16, bit for bit
    source = load_file(str(directory / "model.safetensors"))
    written = load_file(str(copy_dir / "model.safetensors"))
    assert written.keys() == source.keys()
    for name, tensor in source.items():
        assert written[name].dtype == torch.bfloat16
        assert torch.equal(written[name], tensor.to(torch.bfloat16)), name

    # and loading the copy gives the model cast to bf16
    loaded = AutoModelForCausalLM.from_pretrained(copy_dir, dtype=torch.bfloat16, local_files_only=True)
    cast = {name: p.detach().to(torch.bfloat16) for name, p in model.state_dict().items()}
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, cast[name]), name

    # made once: a second call reuses it
    monkeypatch.setattr(loading, "write_bf16_copy", lambda *a: pytest.fail("the copy should have been reused"))
    assert loading.bf16_directory("tiny-model") == copy_dir


def test_reader_streams_one_tensor_at_a_time(tmp_path, monkeypatch):
    path = tmp_path / "shard.safetensors"
    tensors = {"a": torch.randn(4, 3), "b": torch.randn(5).half(), "c": torch.randn(2, 2).bfloat16()}
    save_file(tensors, str(path))
    released = []
    monkeypatch.setattr(loading, "release_file_pages", lambda tensor: released.append(tensor.shape))
    reader = loading._read_safetensors(path)
    seen = {}
    for name, tensor in reader:
        # the previous tensor's pages are handed back as soon as the next one is asked for
        assert len(released) == len(seen)
        seen[name] = tensor.clone()
    assert len(released) == 3
    assert seen.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert seen[name].dtype == tensor.dtype and torch.equal(seen[name], tensor)


def test_reader_refuses_integer_tensors(tmp_path):
    path = tmp_path / "ints.safetensors"
    save_file({"ids": torch.arange(6)}, str(path))
    with pytest.raises(ValueError, match="ids has dtype torch.int64; expected a floating-point tensor"):
        list(loading._read_safetensors(path))
