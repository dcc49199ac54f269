"""The training loop: AdamW over the head's trainable weights, one batch of windows per step read back
from the feature shards, the loss of `hf_polybasic.heads.training.head_loss` over the draft vocabulary,
a checkpoint every few steps from which an interrupted run resumes.

A step's batch is a function of the seed and the step alone (window order: a permutation per epoch drawn
from ``seed`` and the epoch), so a resumed run reads the same batches as an uninterrupted one; the
checkpoint holds the head, the optimizer's and the schedule's states, the step, the losses so far and
torch's random state. It is written whole or not at all (a new file renamed over the old), so an
interruption at any moment leaves the last one whole: the resumed run redoes at most
``checkpoint_every`` steps and trains the same head (same seed, same machine) as the run that was not
interrupted.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..heads.training import head_loss
from .features import FeatureShards, TeacherLogits
from .settings import HeadTraining


def learning_rate_factor(step: int, total: int, warmup: float) -> float:
    """The learning rate's factor at ``step`` of ``total``: linear from 0 over the first ``warmup`` share
    of the steps, then cosine down to 0.1 at the last."""
    ramp = max(1, round(warmup * total))
    if step < ramp:
        return (step + 1) / ramp
    progress = (step - ramp) / max(1, total - ramp)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0)))


def window_order(count: int, seed: int, epoch: int) -> torch.Tensor:
    """``[count]``: the order windows are read in during ``epoch``."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed * 7919 + epoch))


@dataclass
class Progress:
    """Where a run stands: steps done, their losses, and whether it was resumed or stopped early."""

    step: int = 0
    total: int = 0
    losses: list[float] = field(default_factory=list)
    resumed_from: int | None = None
    stopped_early: bool = False


class HeadTrainer:
    """Trains ``head`` (float32, on ``device``) against ``teacher`` on the windows of ``shards`` as
    ``settings`` say, checkpointing to ``checkpoint`` and calling ``export()`` whenever it does (the
    head's files then hold the weights of the checkpoint)."""

    def __init__(self, head, teacher: TeacherLogits, shards: FeatureShards, settings: HeadTraining,
                 checkpoint: Path, export: Callable[[], None], device):
        self.head, self.teacher, self.shards, self.settings = head, teacher, shards, settings
        self.checkpoint, self.export, self.device = Path(checkpoint), export, device
        head.lm_head.weight.requires_grad_(settings.train_lm_head)
        self.trainable = [p for p in head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=settings.lr, betas=(0.9, 0.95),
                                           weight_decay=settings.weight_decay)
        self.batches = -(-shards.count // settings.batch_size)  # per epoch
        total = settings.steps or settings.epochs * self.batches
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: learning_rate_factor(step, total, settings.warmup))
        self.progress = Progress(total=total)

    def batch(self, step: int) -> list[int]:
        """The windows step ``step`` reads."""
        epoch, position = divmod(step, self.batches)
        order = window_order(self.shards.count, self.settings.seed, epoch)
        start = position * self.settings.batch_size
        return order[start : start + self.settings.batch_size].tolist()

    def step(self, step: int) -> float:
        ids, features, last = (tensor.to(self.device) for tensor in self.shards.read(self.batch(step)))
        teacher = self.teacher(last).log_softmax(-1)  # [B, L, draft vocabulary]
        loss = head_loss(self.head, ids.long(), features, teacher, passes=self.settings.passes, draft=True)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.trainable, self.settings.max_grad_norm)
        self.optimizer.step()
        self.schedule.step()
        return float(loss.detach())

    def run(self, max_minutes: float | None = None, progress: bool = True) -> Progress:
        """Train from the checkpoint (if any) to the last step, or until ``max_minutes`` have passed
        (then checkpoint and stop: a later run resumes)."""
        from tqdm.auto import tqdm

        self.resume()
        state, started = self.progress, time.monotonic()
        bar = tqdm(total=state.total, initial=state.step, desc="train", unit="step", disable=not progress)
        while state.step < state.total:
            state.losses.append(self.step(state.step))
            state.step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{state.losses[-1]:.3f}")
            late = max_minutes is not None and time.monotonic() - started > 60 * max_minutes
            if state.step % self.settings.checkpoint_every == 0 or state.step == state.total or late:
                self.save()
            if late and state.step < state.total:
                state.stopped_early = True
                break
        bar.close()
        if state.resumed_from == state.total:
            self.export()  # a finished run run again: its files written again
        return state

    def save(self) -> None:
        """The checkpoint, then the head's files (see the module docstring)."""
        state = {"step": self.progress.step, "losses": self.progress.losses, "head": self.head.state_dict(),
                 "optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict(),
                 "rng": torch.get_rng_state()}
        partial = self.checkpoint.with_suffix(".partial")
        torch.save(state, partial)
        os.replace(partial, self.checkpoint)
        self.export()

    def resume(self) -> None:
        if not self.checkpoint.exists():
            return
        state = torch.load(self.checkpoint, map_location=self.device, weights_only=True)
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        torch.set_rng_state(state["rng"].cpu())
        self.progress.step, self.progress.losses = int(state["step"]), list(state["losses"])
        self.progress.resumed_from = self.progress.step
