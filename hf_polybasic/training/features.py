"""The teacher's side of training, kept on disk: for every training window, the verifier's hidden
states at the layers the head reads (its real *features*) and its last hidden state (after the final
norm: what its output layer reads), computed once, a batch of windows per forward, and written in
safetensors shards of ``shard_size`` windows. Memory holds one batch and one shard being written;
training reads the windows of one batch back from the shards (`FeatureShards.read`: slices of the
memory-mapped files), so a corpus of any size trains within a bound, and a resumed run or a second
epoch costs no verifier forward.

The verifier's next-token distribution is not stored (a vocabulary-wide row per token): its logits
over the head's draft vocabulary are its output layer's rows of those ids applied to the stored last
hidden state (`TeacherLogits`), which `check_output_layer` confirms is what the model's own logits are
(it refuses models whose logits are not a linear layer over that state: soft-capped or scaled logits).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .. import compat


class FeatureShards:
    """The teacher's states of ``windows`` ``[N, L]`` in ``directory`` (see the module docstring)."""

    def __init__(self, directory: Path, windows: torch.Tensor, shard_size: int):
        self.directory, self.windows, self.shard_size = Path(directory), windows, shard_size
        self.count = windows.shape[0]

    def path(self, shard: int) -> Path:
        return self.directory / f"shard-{shard:05d}.safetensors"

    @property
    def shards(self) -> int:
        return -(-self.count // self.shard_size)

    def write_missing(self, verifier, layers: tuple[int, ...], batch_size: int, progress: bool = True) -> int:
        """Compute and write every shard not yet on disk (a shard appears whole or not at all); returns
        how many were written."""
        from safetensors.torch import save_file
        from tqdm.auto import tqdm

        self.directory.mkdir(parents=True, exist_ok=True)
        missing = [shard for shard in range(self.shards) if not self.path(shard).exists()]
        device = verifier.get_input_embeddings().weight.device
        bar = tqdm(total=self.count, initial=self.count - sum(self._rows(s).numel() for s in missing), desc="features",
                   unit="window", disable=not progress)
        for shard in missing:
            rows = self._rows(shard)
            parts = {"features": [], "last": []}
            for start in range(0, rows.numel(), batch_size):
                ids = self.windows[rows[start : start + batch_size]].long().to(device)
                features, last = teacher_states(verifier, ids, layers)
                parts["features"].append(features.cpu())
                parts["last"].append(last.cpu())
                bar.update(ids.shape[0])
            tensors = {key: torch.cat(value).contiguous() for key, value in parts.items()}
            tensors["input_ids"] = self.windows[rows].contiguous()
            partial = self.path(shard).with_suffix(".partial")
            save_file(tensors, str(partial))
            os.replace(partial, self.path(shard))
        bar.close()
        return len(missing)

    def _rows(self, shard: int) -> torch.Tensor:
        return torch.arange(shard * self.shard_size, min((shard + 1) * self.shard_size, self.count))

    def read(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids [b, L], features [b, L, F], last [b, L, H])`` of the windows ``indices``, read
        from their shards' memory-mapped files (only those rows)."""
        from safetensors import safe_open

        rows: dict[str, list[torch.Tensor]] = {"input_ids": [], "features": [], "last": []}
        for index in indices:
            shard, row = divmod(int(index), self.shard_size)
            with safe_open(str(self.path(shard)), framework="pt") as handle:
                for key in rows:
                    rows[key].append(handle.get_slice(key)[row : row + 1])
        return tuple(torch.cat(rows[key]) for key in ("input_ids", "features", "last"))


def teacher_states(verifier, input_ids: torch.LongTensor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier's features ``[B, L, F]`` (its hidden states ``layers`` selects, concatenated) and
    last hidden state ``[B, L, H]`` over ``input_ids`` ``[B, L]``; one forward, only the last
    position's logits computed where the model allows."""
    keep = {"logits_to_keep": 1} if compat.accepts_logits_to_keep(verifier) else {}
    with torch.no_grad():
        outputs = verifier(input_ids=input_ids, output_hidden_states=True, use_cache=False, **keep)
    hidden = getattr(outputs, "hidden_states", None)
    if not hidden:
        raise ValueError(f"train_head: {type(verifier).__name__} returns no hidden_states when called with "
                         "output_hidden_states=True; a head drafts from the hidden states of its model")
    return torch.cat([hidden[layer] for layer in layers], dim=-1), hidden[-1]


class TeacherLogits:
    """The verifier's logits over the ids ``ids`` ``[D]`` from its last hidden state: its output layer's
    rows of those ids (a float32 copy, ``[D, H]``, and bias), on ``device``."""

    def __init__(self, verifier, ids: torch.Tensor, device):
        weight, bias = self.rows_of(verifier)
        index = ids.to(weight.device)
        self.weight = weight.detach()[index].to(device=device, dtype=torch.float32)
        self.bias = None if bias is None else bias.detach()[index].to(device=device, dtype=torch.float32)

    @staticmethod
    def rows_of(verifier) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The verifier's output layer's ``(weight [V, H], bias or None)``; refuses a layer without a float
        weight (packed, quantized)."""
        layer = verifier.get_output_embeddings()
        weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise ValueError(f"train_head: the model's output layer ({type(layer).__name__}) has no floating-point "
                             "weight (packed or quantized); train the head on the model as loaded, before packing or "
                             "quantizing it")
        return weight, bias if isinstance(bias, torch.Tensor) else None

    def __call__(self, last: torch.Tensor) -> torch.Tensor:  # [B, L, H] -> [B, L, D]
        return torch.nn.functional.linear(last.float(), self.weight, self.bias)


def check_output_layer(verifier, input_ids: torch.LongTensor) -> None:
    """Refuse a verifier whose logits are not its output layer over its last hidden state (the state
    `FeatureShards` keeps): compared on the last position of ``input_ids`` ``[B, L]``."""
    with torch.no_grad():
        outputs = verifier(input_ids=input_ids, output_hidden_states=True, use_cache=False)
        hidden = getattr(outputs, "hidden_states", None)
        if not hidden:
            teacher_states(verifier, input_ids, ())  # raises the error that says so
        logits = outputs.logits[:, -1].float()
        again = verifier.get_output_embeddings()(hidden[-1][:, -1]).float()
    scale = float(logits.abs().max()) or 1.0
    if not torch.allclose(again, logits, rtol=1e-3, atol=1e-3 * scale):
        raise ValueError(f"train_head: {type(verifier).__name__}'s logits are not its output layer applied to its "
                         "last hidden state (soft-capped or scaled logits); train_head distils from that state and "
                         "cannot train a head for this model")
