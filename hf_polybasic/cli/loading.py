"""Loading the real models (the one loader of the tools), with as little memory as their use needs.

`load` gives ``(model, tokenizer)`` in float32 or bfloat16, `load_int8` the int8-dynamic model,
`pack` packs a loaded model's linear layers; every tool builds its models through these
(`hf_polybasic.cli.model_sets` for the benchmark's sets). Models are installed on first use
(`hf_polybasic.cli.models`), never from the Hugging Face Hub.

* float32 loads straight from the cached safetensors (memory-mapped: pages become resident only
  when read; the embedding only for the rows of tokens actually used);
* bfloat16 loads from a bfloat16 copy kept next to the float32 cache, made once by streaming the
  file tensor by tensor (loading float32 and casting would hold both: ~10 GB for the 1.5B);
* packing (`hf_polybasic.models.packed`) and int8 quantization (`hf_polybasic.models.copies.quantize_linear_layers`)
  go layer by layer and hand each source weight's pages back to the kernel at once
  (`release_file_pages`), so a packed or quantized model never coexists with its full source.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..models import packed as cpu
from ..models.copies import quantize_linear_layers
from . import models
from .pages import release_file_pages

BF16_SUFFIX = "-bf16"
BF16_MANIFEST = "hf_polybasic_bf16.json"


def _release_weight(layer: torch.nn.Module) -> None:
    release_file_pages(layer.weight)


# --- a bfloat16 copy of the cache ------------------------------------------------------------------
def _read_safetensors(path: Path):
    """(name, float tensor) for every tensor of a safetensors file, one at a time, through the
    safetensors library's own reader (``safe_open``, which maps the file and reads a tensor's pages
    when it is used). Only the tensor being converted is ever in memory: once the caller has moved
    on to the next tensor, the previous one's pages are handed back (`release_file_pages`; without
    that, every page read would stay resident until the file is closed, the whole shard). Use each
    tensor read-only and before asking for the next (copy it, e.g. ``.to(torch.bfloat16)``)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        for name in handle.keys():
            tensor = handle.get_tensor(name)
            if not tensor.is_floating_point():
                raise ValueError(f"{path}: tensor {name} has dtype {tensor.dtype}; expected a floating-point tensor")
            yield name, tensor
            release_file_pages(tensor)


def write_bf16_copy(source: Path, target: Path) -> Path:
    """Write a bfloat16 copy of the safetensors checkpoint directory ``source`` to ``target`` (made
    under a ``.partial`` name and renamed when complete; every other file copied as is), streaming
    each shard tensor by tensor (`_read_safetensors`)."""
    from safetensors.torch import save_file

    manifest = target / BF16_MANIFEST
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for item in source.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy2(item, partial / item.name)
    for shard in sorted(source.glob("*.safetensors")):
        tensors = {key: value.to(torch.bfloat16) for key, value in _read_safetensors(shard)}
        save_file(tensors, str(partial / shard.name), metadata={"format": "pt"})
        del tensors
    (partial / manifest.name).write_text(json.dumps({"source": str(source), "dtype": "bfloat16"}) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def bf16_directory(name: str, cache_dir=None) -> Path:
    """The bfloat16 copy of a cached model, made on first use (a few seconds per GB, streamed)."""
    source = models.install(name, cache_dir=cache_dir)
    target = source.with_name(source.name + BF16_SUFFIX)
    if (target / BF16_MANIFEST).is_file():
        return target
    return write_bf16_copy(source, target)


def load(name: str, dtype: torch.dtype = torch.float32, cache_dir=None):
    """``(model, tokenizer)`` for ``name`` (installed first if needed) in ``dtype``, in eval mode on
    the CPU: float32 straight from the cache, bfloat16 from its bfloat16 copy (no transient float32
    model). Loads with ``HF_HUB_OFFLINE=1`` and ``local_files_only=True``."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"load: dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    from transformers import AutoModelForCausalLM

    path = models.install(name, cache_dir=cache_dir) if dtype == torch.float32 else bf16_directory(name, cache_dir)
    with models.offline():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model.eval(), _tokenizer(path)


def load_tokenizer(name: str, cache_dir=None):
    """The tokenizer of ``name`` alone (installed first if needed; no model is loaded)."""
    return _tokenizer(models.install(name, cache_dir=cache_dir))


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    with models.offline():
        return AutoTokenizer.from_pretrained(path, local_files_only=True)


def pack(model: torch.nn.Module) -> torch.nn.Module:
    """`hf_polybasic.models.packed.pack_linear_layers`, with the file pages of every linear weight handed back
    first and each one's again right after it is packed: packing then reads one layer at a time from
    the file, so memory holds the packed layers and one source layer, never both models."""
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            _release_weight(module)
    return cpu.pack_linear_layers(model, after_each=_release_weight)


def load_int8(name: str, cache_dir=None) -> torch.nn.Module:
    """A cached model with every linear layer in dynamic int8, quantized layer by layer straight
    from the memory-mapped float32 file (its pages handed back as each layer is done)."""
    model, _ = load(name, dtype=torch.float32, cache_dir=cache_dir)
    return quantize_linear_layers(model, after_each=_release_weight).eval()
