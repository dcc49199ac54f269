"""A head checkpoint's files and how its weights get into a head: found in a directory or the Hub's
cache, read as the publisher wrote them (``config.json``; ``model.safetensors`` or ``pytorch_model.bin``,
single or sharded), checked against the verifier, and assigned to a head built on the meta device
with every key accounted for: an unknown key, a missing key or a wrong shape stops the load before
anything is assigned, with the publisher's own key name in the message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

# what a head checkpoint may hold, in the order its publishers' own loaders look for it
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLED, PICKLED_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
HUB_FILES = ["config.json", "model*.safetensors", SAFETENSORS_INDEX, "pytorch_model*.bin", PICKLED_INDEX]


def where(source) -> str:
    return f"draft_head({str(source)!r})"


def checkpoint_directory(source) -> Path:
    """The directory of ``source``: a local directory, or a Hub id resolved by
    `huggingface_hub.snapshot_download` (which answers from the HF cache when the Hub cannot be reached
    or ``HF_HUB_OFFLINE`` is set)."""
    path = Path(str(source)).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(source), allow_patterns=HUB_FILES))
    except Exception as error:  # noqa: BLE001 - any failure: not a directory, and not a Hub head we can read
        raise ValueError(f"{where(source)}: no such local directory, and no Hub repository of that id could be read "
                         f"({type(error).__name__}: {error}); pass a head checkpoint's directory, or a Hub id whose "
                         "files are in the HF cache or can be downloaded") from error


def read_config(directory: Path, source) -> dict:
    """The checkpoint's ``config.json`` as a dict."""
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(f"{where(source)}: {directory} has no config.json; a head checkpoint is a directory with its "
                         "config.json and weights, as its publisher's code writes it")
    return json.loads(path.read_text())


def read_weights(directory: Path, source) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by its key, on the CPU: ``model.safetensors`` (or its shards),
    else ``pytorch_model.bin`` (or its shards, read with ``weights_only``)."""
    from safetensors.torch import load_file

    def pickled(path):
        return torch.load(path, map_location="cpu", weights_only=True)

    for single, index, read in ((SAFETENSORS, SAFETENSORS_INDEX, load_file), (PICKLED, PICKLED_INDEX, pickled)):
        if (directory / single).is_file():
            return dict(read(directory / single))
        if (directory / index).is_file():
            shards = sorted(set(json.loads((directory / index).read_text())["weight_map"].values()))
            return {key: value for shard in shards for key, value in read(directory / shard).items()}
    raise ValueError(f"{where(source)}: {directory} has no weights ({SAFETENSORS} or {PICKLED}, or their shards' "
                     "index)")


@dataclass
class VerifierShape:
    """What a checkpoint must fit of the model it drafts for (its *verifier*)."""

    hidden_size: int
    num_layers: int
    vocab_size: int  # the config's: the ids the head may embed and propose
    embeddings: torch.nn.Module  # shared with the head (read, never a submodule of it)
    lm_head: torch.nn.Module  # shared where the format says so
    output_width: int  # the width of the verifier's logits (the head's logits are as wide)
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, verifier) -> VerifierShape:
        config = verifier.config.get_text_config(decoder=True)
        embeddings, lm_head = verifier.get_input_embeddings(), verifier.get_output_embeddings()
        # a oneDNN-packed LM head (hf_polybasic.models.packed) has no weight: its width and its tensors' device
        width = getattr(lm_head, "out_features", None) or lm_head.weight.shape[0]
        device = next((t.device for t in (*lm_head.parameters(), *lm_head.buffers())), embeddings.weight.device)
        return cls(int(config.hidden_size), int(config.num_hidden_layers), int(config.vocab_size), embeddings, lm_head,
                   int(width), embeddings.weight.dtype, device)


def must_equal(source, what: str, value, expected, whose: str) -> None:
    """Refuse a checkpoint whose ``what`` (a config key, say) is not the verifier's ``expected``."""
    if value != expected:
        raise ValueError(f"{where(source)}: {what} is {value}, but {whose} is {expected}: the head was trained for "
                         "another model; load it with the verifier it was trained for")


def shared_or_own_embedding(state: dict, verifier: VerifierShape, width: int, source) -> torch.nn.Embedding | None:
    """The head's token embedding: the verifier's (None: shared, not copied) unless the checkpoint ships
    ``embed_tokens.weight`` other than the verifier's (then a frozen copy, as the publishers' loaders
    keep what the checkpoint holds). Takes the key out of ``state``."""
    own = state.pop("embed_tokens.weight", None)
    shared = verifier.embeddings.weight
    if own is None:
        if width != shared.shape[1]:
            raise ValueError(f"{where(source)}: the checkpoint has no embed_tokens.weight, and the head's hidden size "
                             f"{width} differs from the verifier's {shared.shape[1]}, so it cannot embed tokens with "
                             "the verifier's embeddings; use the checkpoint as its publisher exported it (with them)")
        return None
    if tuple(own.shape) != (verifier.vocab_size, width):
        raise ValueError(f"{where(source)}: key 'embed_tokens.weight' has shape {list(own.shape)}, expected "
                         f"{[verifier.vocab_size, width]} (the verifier's vocabulary by the head's hidden size)")
    if own.shape == shared.shape and torch.equal(own.to(dtype=shared.dtype, device=shared.device), shared):
        return None
    embedding = torch.nn.Embedding.from_pretrained(own.to(dtype=verifier.dtype, device=verifier.device), freeze=True)
    return embedding


def draft_to_target(state: dict, draft_vocab: int, verifier: VerifierShape, source) -> torch.Tensor | None:
    """The verifier's id of each draft id, ``[draft_vocab]``, from the checkpoint's ``d2t`` (an offset:
    target = draft + d2t[draft], as SafeAILab, SpecForge and speculators write it); None where the
    draft vocabulary is the verifier's own (no ``d2t``, or all zeros over the full vocabulary). Takes
    ``d2t`` and ``t2d`` out of ``state`` (``t2d``, target id -> in the draft vocabulary, is checked
    against ``d2t``)."""
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    if d2t is None:
        if draft_vocab != verifier.vocab_size:
            raise ValueError(f"{where(source)}: the checkpoint lacks key 'd2t', which a draft vocabulary of {draft_vocab} "
                             f"ids (draft_vocab_size) within the verifier's {verifier.vocab_size} needs")
        if t2d is not None:
            raise ValueError(f"{where(source)}: the checkpoint has 't2d' but no 'd2t'; the two come together")
        return None
    if tuple(d2t.shape) != (draft_vocab,) or d2t.is_floating_point():
        raise ValueError(f"{where(source)}: key 'd2t' is a {d2t.dtype} tensor of shape {list(d2t.shape)}, expected "
                         f"integer offsets of shape [{draft_vocab}] (draft_vocab_size)")
    target = torch.arange(draft_vocab) + d2t.long()
    if int(target.min()) < 0 or int(target.max()) >= verifier.vocab_size or target.unique().numel() != draft_vocab:
        raise ValueError(f"{where(source)}: key 'd2t' maps draft ids to ids outside 0 .. {verifier.vocab_size - 1} "
                         "(the verifier's vocabulary), or two draft ids to one; it was made for another vocabulary")
    if t2d is not None:
        expected = torch.zeros(verifier.vocab_size, dtype=torch.bool)
        expected[target] = True
        if tuple(t2d.shape) != (verifier.vocab_size,) or not torch.equal(t2d.bool(), expected):
            raise ValueError(f"{where(source)}: key 't2d' (shape {list(t2d.shape)}) does not mark exactly the ids 'd2t' "
                             f"maps to in the verifier's vocabulary of {verifier.vocab_size}")
    if draft_vocab == verifier.vocab_size and not bool(d2t.any()):
        return None
    return target.to(verifier.device)


def assign(module: torch.nn.Module, state: dict, renames: tuple[tuple[str, str], ...], source, kind: str,
           verifier: VerifierShape, ignored: tuple[str, ...] = ()) -> None:
    """Give ``module`` (built on the meta device) the checkpoint's weights: ``state`` by the publisher's key
    names, ``renames`` ((publisher prefix, module prefix), ...) mapping them to the module's. Floating
    tensors take the verifier's dtype and device (as the publishers' loaders cast a head to the
    verifier's). Keys ending in one of ``ignored`` (training-only tensors, buffers computed from the
    config) are skipped. Refuses, before assigning anything, unknown keys, missing keys and wrong shapes."""

    def ours(key: str) -> str:
        for theirs, mine in renames:
            if key.startswith(theirs):
                return mine + key[len(theirs):]
        return key

    def theirs(key: str) -> str:
        for publisher, mine in renames:
            if key.startswith(mine):
                return publisher + key[len(mine):]
        return key

    expected = module.state_dict(keep_vars=True)
    loaded, unknown = {}, []
    for key, value in state.items():
        if ignored and key.endswith(ignored):
            continue
        if ours(key) in expected:
            loaded[ours(key)] = value
        else:
            unknown.append(key)
    missing = [theirs(key) for key in expected if key not in loaded]
    what = f"{where(source)}: the {kind} checkpoint"
    if unknown:
        raise ValueError(f"{what} has keys this format does not have: {_listed(unknown)} (another format, or layers or "
                         "options its config.json does not say); nothing was loaded")
    if missing:
        raise ValueError(f"{what} lacks keys its config.json asks for: {_listed(missing)}; nothing was loaded")
    for key, value in loaded.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ValueError(f"{what}: key {theirs(key)!r} has shape {list(value.shape)}, expected "
                             f"{list(expected[key].shape)} (by its config.json and the verifier); nothing was loaded")
    module.load_state_dict({key: value.to(device=verifier.device, dtype=verifier.dtype if value.is_floating_point()
                                          else value.dtype) for key, value in loaded.items()}, strict=True, assign=True)
    module.to(verifier.device)  # what no checkpoint holds (rotary frequencies, vocabulary maps) goes along
    left = [name for name, tensor in (*module.named_parameters(), *module.named_buffers()) if tensor.is_meta]
    if left:
        raise RuntimeError(f"{what}: {left} were never given values (a bug in hf_polybasic: please report it)")


def _listed(keys: list[str], limit: int = 8) -> str:
    keys = sorted(keys)
    return ", ".join(repr(key) for key in keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
