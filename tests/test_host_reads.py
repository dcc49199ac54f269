"""Reads from the device back to the host (``.item()``, ``.tolist()``, ``bool()``/``int()``/
``float()`` of a tensor, ``nonzero``, ``.cpu()``) are what stall a GPU: the host waits for every
queued kernel. The package's own reads are counted here (those of transformers' models and logits
processors are theirs): a small constant per forward pass, whatever K, mu and the number of rows
(they grew with rows x tokens: a per-row id check in the cache, a stopping check and a probability
per token)."""

import sys
import weakref

import pytest
import torch
from helpers import distilled_head, left_padded
from torch.overrides import TorchFunctionMode

import hf_polybasic as hp
from hf_polybasic.decoding import round as levels_round
from hf_polybasic.decoding.round import next_width
from hf_polybasic.schedule.shape_gate import BYPASSED, DROPPED, IN, OUT_ROUNDS, ShapeGate
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
            self._count(name, sys._getframe(1))
        return func(*args, **(kwargs or {}))

    def _count(self, name: str, frame) -> None:
        """Count the call when ``frame`` (the caller's) is the package's own code."""
        module = frame.f_globals.get("__name__", "")
        if module.startswith("hf_polybasic") and module not in ("hf_polybasic.testing", "hf_polybasic.runners.probe"):
            self.count += 1
            key = f"{module}:{frame.f_code.co_name}"
            self.where[key] = self.where.get(key, 0) + 1
            self.names[name] = self.names.get(name, 0) + 1


FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "full", "arange", "empty"}


class HostWaits(HostReads):
    """Counts, on the CPU, what would make the host wait for a GPU: the reads above, and copies of
    host-built data to the device that are not asynchronous (``torch.tensor(data, device=...)``,
    ``new_tensor``, and ``.to(device)`` without ``non_blocking=True`` of a tensor the host built with
    no device: a copy from pageable memory ends in a stream synchronization). A tensor sent up with
    ``non_blocking=True`` (`hf_polybasic.runners.transfer.upload`: through pinned memory on a GPU) counts as on
    the device from then on."""

    def __init__(self):
        super().__init__()
        self._host: dict[int, weakref.ref] = {}  # tensors the package built on the host, by id

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        upload = (name in ("tensor", "as_tensor") and kwargs.get("device") is not None) or name == "new_tensor" or (
            name == "to" and not kwargs.get("non_blocking") and self._built_here(args[0])
            and any(isinstance(a, (str, torch.device)) for a in (*args[1:], kwargs.get("device"))))
        if upload:
            self._count("upload", sys._getframe(1))
        elif name in READS:
            self._count(name, sys._getframe(1))
        out = func(*args, **kwargs)
        if name in FACTORIES and kwargs.get("device") is None and isinstance(out, torch.Tensor):
            self._host[id(out)] = weakref.ref(out)
        elif name == "to" and kwargs.get("non_blocking") and self._built_here(args[0]):
            del self._host[id(args[0])]  # on the CPU the "uploaded" tensor is the host's own
        return out

    def _built_here(self, tensor) -> bool:
        kept = self._host.get(id(tensor))
        return kept is not None and kept() is tensor


def _reads(target, assistants, rows, config, generate=hp.generate, new_tokens=24, do_sample=False, counter=HostReads,
           **options):
    prompts = [prompt(4 + 3 * row, seed=600 + row)[0] for row in range(rows)]
    ids, mask = left_padded(prompts)
    with counter() as reads:
        out = target.generate(ids, attention_mask=mask, custom_generate=generate, assistant_models=assistants,
                              polybasic_config=config, do_sample=do_sample, max_new_tokens=new_tokens,
                              eos_token_id=None, pad_token_id=PAD, return_dict_in_generate=True, **options)
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


@pytest.fixture
def gpu_rules(monkeypatch):
    """The package decides as on a GPU, where a read waits for the device's queue (a model drafter
    leaves its drafts on the device for the level above to read with its decision); the waits are
    counted on the CPU by `HostWaits`."""
    monkeypatch.setattr(levels_round, "reads_wait", lambda device: True)


def _waits(target, assistants, rows, config, new_tokens=48, warm=True, **options):
    """The second call's waits (the first compiles and measures the cost curves), on a simulated
    machine where drafting pays, through a static cache as on a GPU."""
    with simulated_machine(cheap_drafting_costs(target, assistants)) as generate:
        if warm:
            _reads(target, assistants, rows, config, generate, new_tokens, **options)
        return _reads(target, assistants, rows, config, generate, new_tokens, counter=HostWaits, **options)


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("schedule", ["cost_aware", "constant"])
def test_a_two_level_round_waits_for_the_device_once(schedule, rows, static, gpu_rules, shared_models):
    """Under a GPU's rules a round of [drafter] waits once: the target's one read of every row's
    decision, which also reads the drafts the drafter left on the device (the next token stays on the
    device, the stopping criteria are decided from ids the host has, the forwards' positions go up
    without waiting); plus a few per call. Today's default, a constant K, a left-padded batch of 4,
    static (compiled) and dynamic caches."""
    target, draft = shared_models.chain("llama", 2, seed=79)
    config = hp.PolybasicConfig(schedule=schedule, num_draft_tokens=6, compile=static)
    waits, stats = _waits(target, [draft], rows, config, cache_implementation="static" if static else None)
    rounds = stats.levels[0].forward_passes
    assert stats.levels[0].drafted > 0 and stats.levels[0].accepted > 0  # the target verified drafts
    # (the simulated machine's hooks keep the runners uncompiled; test_static counts compiled forwards)
    assert stats.levels[0].runner == ("static" if static else "dynamic")
    assert waits.count <= rounds + 4, (rounds, waits.where, waits.names)


@pytest.mark.parametrize("shape", [IN, BYPASSED, DROPPED])
@pytest.mark.parametrize("rows", [1, 4])
def test_a_three_level_round_waits_for_the_device_at_most_twice(rows, shape, gpu_rules, shared_models, monkeypatch):
    """[middle, drafter] under a GPU's rules and the default config, one row or a left-padded batch
    of 4: a target round waits twice at most. The middle level decides its
    rounds on the device and reads once per batch of them (`hf_polybasic.decoding.device_blocks`:
    the rounds its blocks need, as its mean acceptance length says), the target reads its decision
    once; in the rounds where the shape gate lets a level sit out, the target's read takes the
    drafts with it. ``shape``: the shape the gates start in, for their first rounds (also the in
    shape: a gate goes on with what an earlier call of its chain measured, `ShapeGate.keep`)."""
    start = ShapeGate.__init__

    def at_once(self, *args, **kwargs):
        start(self, *args, **kwargs)
        self.shape, self._left = shape, OUT_ROUNDS

    monkeypatch.setattr(ShapeGate, "__init__", at_once)
    target, middle, draft = shared_models.chain("llama", 3, seed=80)
    config = hp.PolybasicConfig(compile=True)
    waits, stats = _waits(target, [middle, draft], rows, config, cache_implementation="static")
    top, middle_level, bottom = stats.levels
    assert top.drafted > 0 and top.accepted > 0 and middle_level.runner == "static"
    sat_out = {IN: 0, BYPASSED: middle_level.bypassed_rounds, DROPPED: bottom.dropped_rounds}[shape]
    assert sat_out > 0 or shape == IN
    if shape == IN:
        assert middle_level.device_rounds > 0 and middle_level.accepted > 0
    assert waits.count <= 2 * top.forward_passes + 4, (waits.where, waits.names)


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("depth", [2, 3])
def test_a_chain_with_a_head_waits_for_the_device_once_a_verification(depth, rows, static, gpu_rules, shared_models):
    """A trained draft head at the bottom (issue 42) waits no more than a model drafter does: its
    features are the level above's, kept on the device from that level's own forwards, and its drafts
    are read with the level above's decision, once a verification (the target's, and in 3 levels each of
    the middle level's, which decides its rounds on the host with a head below it)."""
    target, middle = shared_models.chain("llama", 2, seed=79)
    head = shared_models.built(("waits head",), lambda: (distilled_head(target),))[0]
    chain = [head] if depth == 2 else [middle, head]
    config = hp.PolybasicConfig(schedule="constant", num_draft_tokens=4, block_threshold=4, compile=static)
    waits, stats = _waits(target, chain, rows, config, cache_implementation="static" if static else None)
    verifications = sum(level.forward_passes for level in stats.levels[:-1])
    assert stats.levels[-2].drafted > 0 and stats.levels[-2].accepted > 0
    assert stats.levels[-1].runner == ("static" if static else "dynamic")
    assert waits.count <= verifications + 4, (verifications, waits.where, waits.names)


def test_the_waits_counter_sees_the_per_token_reads_of_the_cpus_drafter(shared_models):
    """A negative control: on the CPU's rules the cost-aware drafter reads after every drafted token
    (a read costs nothing there), and `HostWaits` counts those reads: well over two per round."""
    target, draft = shared_models.chain("llama", 2, seed=79)
    waits, stats = _waits(target, [draft], 1, hp.PolybasicConfig(compile=True), cache_implementation="static")
    assert stats.levels[1].proposed > 2 * stats.levels[0].forward_passes
    assert waits.where.get("hf_polybasic.decoding.reads:read", 0) >= stats.levels[1].proposed  # `_keep_step`'s
    assert waits.count > 2 * stats.levels[0].forward_passes + 4


def test_the_waits_counter_counts_blocking_uploads():
    """A negative control for the uploads: what blocks on a GPU is counted, what does not is not."""
    from hf_polybasic.runners.transfer import upload

    counted = {}
    for name, expression in {
        "tensor with a device": "torch.tensor([1, 2], device='cpu')",
        "new_tensor": "torch.zeros(2).new_tensor([1.0])",
        "host tensor .to(device)": "torch.tensor([1, 2]).to(torch.device('cpu'))",
        "upload": "upload(torch.tensor([1, 2]), 'cpu')",
        "device factory": "torch.zeros(2, device='cpu')",
        "read": "torch.zeros(2).tolist()",
    }.items():
        with HostWaits() as waits:
            eval(expression, {"__name__": "hf_polybasic.fake", "torch": torch, "upload": upload})  # as the package's
        counted[name] = waits.count
    assert counted == {"tensor with a device": 1, "new_tensor": 1, "host tensor .to(device)": 1, "upload": 0,
                       "device factory": 0, "read": 1}


# --- the host's own decisions: the same as the device's ------------------------------------------
@pytest.mark.parametrize("eos", [[5], [5, 9], []])
@pytest.mark.parametrize("max_length", [7, 9, 30])
def test_host_stops_give_the_criteria_own_verdicts(eos, max_length):
    """`HostStops` keeps as many of a round's tokens as the criteria themselves would: each token's
    prefix checked by the criterion, the first that fires ends the round."""
    from transformers.generation import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

    from hf_polybasic.decoding.loop import HostStops

    criteria = StoppingCriteriaList([MaxLengthCriteria(max_length)] + ([EosTokenCriteria(eos)] if eos else []))
    host = HostStops.of(criteria)
    assert host is not None
    prefix = torch.tensor([3, 4, 6])
    for ids in ([7, 8, 5, 9], [9, 1, 2, 3, 4, 5, 6, 7], [1, 2], [5]):
        expected = None
        for count in range(1, len(ids) + 1):
            grown = torch.cat([prefix, torch.tensor(ids[:count])]).unsqueeze(0)
            if bool(criteria(grown, torch.zeros(1, 10)).any()):
                expected = count
                break
        assert host.first_stop(prefix.shape[0], ids) == expected, (ids, eos, max_length)


def test_host_stops_leave_criteria_of_the_users_own_to_the_device():
    from transformers.generation import MaxLengthCriteria, MaxTimeCriteria, StoppingCriteria, StoppingCriteriaList

    from hf_polybasic.decoding.loop import HostStops

    class Never(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    assert HostStops.of(StoppingCriteriaList([MaxLengthCriteria(10), Never()])) is None
    assert HostStops.of(StoppingCriteriaList([])) is not None
    deadline = HostStops.of(StoppingCriteriaList([MaxTimeCriteria(0.0)]))
    assert deadline.first_stop(3, [1, 2]) == 1  # past its time: the first token ends the round


def test_the_draft_width_follows_where_the_schedule_cut():
    """A drafter that reads once a proposal drafts the power of two above its last cut (room to draft
    on), twice as far when it kept every token, and never less than half its last width."""
    assert [next_width(8, cut) for cut in (1, 2, 3, 4, 5, 7)] == [4, 4, 4, 8, 8, 8]
    assert [next_width(4, cut) for cut in (1, 2, 3)] == [2, 4, 4]
    assert next_width(4, None) == 8 and next_width(16, 1) == 8
