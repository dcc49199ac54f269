"""Reads from the device back to the host (``.item()``, ``.tolist()``, ``bool()``/``int()``/
``float()`` of a tensor, ``nonzero``, ``.cpu()``) are what stall a GPU: the host waits for every
queued kernel. The package's own reads are counted here (those of transformers' models and logits
processors are theirs): a small constant per forward pass, whatever K, mu and the number of rows
(they grew with rows x tokens: a per-row id check in the cache, a stopping check and a probability
per token)."""

import sys

import pytest
import torch
from test_batches import left_padded
from torch.overrides import TorchFunctionMode

import hf_polybasic as hp
from hf_polybasic.testing import PAD, cheap_drafting_costs, prompt, simulated_machine

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy", "equal"}


class HostReads(TorchFunctionMode):
    """Counts reads made by the package's own code (the calling frame's module is hf_polybasic's)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.where: dict[str, int] = {}
        self.names: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        moved_home = name == "to" and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu" and any(
            str(a) == "cpu" for a in (*args[1:], *(kwargs or {}).values()))
        if name in READS or moved_home:
            frame = sys._getframe(1)
            module = frame.f_globals.get("__name__", "")
            if module.startswith("hf_polybasic") and module not in ("hf_polybasic.testing", "hf_polybasic.probe"):
                self.count += 1
                key = f"{module}:{frame.f_code.co_name}"
                self.where[key] = self.where.get(key, 0) + 1
                self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _reads(target, assistants, rows, config, generate=hp.generate, new_tokens=24, do_sample=False):
    prompts = [prompt(4 + 3 * row, seed=600 + row)[0] for row in range(rows)]
    ids, mask = left_padded(prompts)
    with HostReads() as reads:
        out = target.generate(ids, attention_mask=mask, custom_generate=generate, assistant_models=assistants,
                              polybasic_config=config, do_sample=do_sample, max_new_tokens=new_tokens,
                              eos_token_id=None, pad_token_id=PAD, return_dict_in_generate=True)
    return reads, out.polybasic_stats


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("k", [2, 8])
@pytest.mark.parametrize("rows", [1, 4])
def test_reads_per_round_are_a_constant_whatever_k_and_the_rows(k, rows, do_sample, compiled, shared_models):
    """Two models, the constant schedule: a round reads back three times (the drafter's tokens, the
    target's decisions for every row, the stopping criteria's verdicts), plus a few per call; on the
    static, compiled runner as on the dynamic one (its inputs are built from lengths the host knows)."""
    target, draft = shared_models.chain("llama", 2, seed=79)
    config = hp.PolybasicConfig(num_draft_tokens=k, schedule="constant", compile=compiled)
    reads, stats = _reads(target, [draft], rows, config, do_sample=do_sample)
    rounds = stats.levels[0].forward_passes
    assert stats.levels[0].drafted > 0
    assert stats.levels[0].runner == ("static, compiled" if compiled else "dynamic")
    assert reads.count <= 3 * rounds + 4, (reads.where, reads.names)


@pytest.mark.parametrize("mu", [2, 8])
@pytest.mark.parametrize("rows", [1, 3])
def test_reads_per_forward_are_a_constant_in_deeper_chains_and_under_the_cost_aware_schedule(mu, rows, shared_models):
    """Three models: every forward of any level adds at most two reads (an intermediate level's
    decisions and, when its schedule stops blocks by confidence, their probabilities; a drafter's
    tokens once per step when its schedule stops by confidence), none per token or per row."""
    target, middle, draft = shared_models.chain("llama", 3, seed=80)
    for schedule in ("constant", "cost_aware"):
        config = hp.PolybasicConfig(num_draft_tokens=4, block_threshold=mu, schedule=schedule)
        with simulated_machine(cheap_drafting_costs(target, [middle, draft])) as simulated:
            generate = simulated if schedule == "cost_aware" else hp.generate
            reads, stats = _reads(target, [middle, draft], rows, config, generate)
        forwards = sum(level.forward_passes for level in stats.levels)
        assert all(level.drafted > 0 for level in stats.levels[:-1])
        assert reads.count <= 2 * forwards + 4, (schedule, reads.where, reads.names)
