"""Shared fixtures: tiny random models built once per session and shared read-only."""

import os

# cost curves measured during the tests stay in memory: never written to the user's cache
os.environ["HF_POLYBASIC_COSTS"] = ""

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

# The tiny test models gain nothing from intra-op threads; one thread avoids OpenMP spin-waits on
# small, shared CI machines and makes the suite several times faster there.
torch.set_num_threads(1)

# Property tests draw their examples from a fixed seed: the suite gives the same verdict on every
# run (several of them are statistical tests at a fixed significance level).
from hypothesis import settings  # noqa: E402

import helpers  # noqa: E402
from hf_polybasic.decoding import round as levels_round  # noqa: E402
from hf_polybasic.decoding.device_blocks import DeviceBlocks  # noqa: E402
from hf_polybasic.decoding.round import Verifier  # noqa: E402
from hf_polybasic.runners import static  # noqa: E402
from hf_polybasic.schedule import batch_gate  # noqa: E402
from hf_polybasic.schedule.cost_aware import CostAwareSchedule  # noqa: E402
from hf_polybasic.testing import make_chain, make_target  # noqa: E402

# Compiled static runners trace with dynamo (the graphs, their count and their guards are what tests
# check) but skip inductor's code generation, which takes seconds per graph on a CPU; the one test
# of the real backend (test_static.py) restores it for models of its own.
INDUCTOR_COMPILE_OPTIONS = static.compile_options
static.compile_options = lambda device: {"backend": "eager", "dynamic": False}

settings.register_profile("deterministic", derandomize=True, deadline=None)
settings.load_profile("deterministic")


@pytest.fixture(autouse=True)
def forget_what_earlier_calls_taught(monkeypatch):
    """Every test starts as a fresh process would: without the confidence calibrations and chain
    shapes that earlier tests' calls of the same shared models taught (`calibration.remembered`,
    `shape_gate.remembered`), which made a test's path depend on which tests ran before it."""
    from hf_polybasic.schedule import calibration, shape_gate

    monkeypatch.setattr(calibration, "remembered", calibration._Remembered())
    monkeypatch.setattr(shape_gate, "remembered", shape_gate._Memory())


def _fingerprint(model) -> tuple:
    """What a test could change: weights, configs, and attributes such as an `enable` patch."""
    weights = float(sum(p.detach().double().sum() for p in model.parameters()))
    return (
        weights,
        repr(sorted(model.config.to_dict().items())),
        repr(sorted(model.generation_config.to_dict().items())),
        tuple(sorted(key for key in vars(model) if not key.startswith("_") or key.startswith("_hf_polybasic_enabled"))),
    )


class SharedModels:
    """Tiny random models built once per session, shared by every test that asks, and read-only:
    tests that change a model (``hp.enable``, configs) build their own. The session ends by checking
    that no test changed a shared one."""

    def __init__(self):
        self._built: dict[tuple, tuple] = {}
        self._fingerprints: list[tuple] = []

    def _remember(self, key: tuple, models: tuple) -> tuple:
        self._built[key] = models
        self._fingerprints += [(key, index, model, _fingerprint(model)) for index, model in enumerate(models)]
        return models

    def chain(self, arch: str = "llama", depth: int = 3, seed: int = 0) -> tuple:
        """(target, M2, ..., M_depth) from `hf_polybasic.testing.make_chain`."""
        key = ("chain", arch, depth, seed)
        return self._built.get(key) or self._remember(key, tuple(make_chain(arch, depth, seed=seed)))

    def target(self, arch: str = "llama", seed: int = 0, **extra):
        key = ("target", arch, seed, tuple(sorted(extra.items())))
        return (self._built.get(key) or self._remember(key, (make_target(arch, seed=seed, **extra),)))[0]

    def built(self, key: tuple, make) -> tuple:
        """The models ``make()`` builds, built once under ``key``."""
        return self._built.get(key) or self._remember(key, tuple(make()))

    def register(self, key: tuple, models: tuple) -> tuple:
        """Share models built elsewhere (e.g. with special settings) under ``key``."""
        return self._built.get(key) or self._remember(key, tuple(models))

    def changed(self) -> list[str]:
        return [f"{key}[{index}]" for key, index, model, before in self._fingerprints if _fingerprint(model) != before]


@pytest.fixture(scope="session")
def shared_models():
    models = SharedModels()
    yield models
    changed = models.changed()
    assert not changed, f"tests changed shared models (build your own instead): {changed}"


@pytest.fixture(scope="session")
def distribution_models(shared_models) -> tuple:
    """The 8-token target and three assistants of growing noise for the distribution tests."""
    return shared_models.register(("distribution",), helpers.build_models())


@pytest.fixture(scope="session")
def exact_distribution(distribution_models):
    """setting -> P(x1, x2, x3) under the target's processed distribution (computed once each)."""
    cache: dict[str, np.ndarray] = {}

    def exact(setting: str) -> np.ndarray:
        if setting not in cache:
            cache[setting] = helpers.exact_joint(distribution_models[0], setting)
        return cache[setting]

    return exact


@pytest.fixture
def drafts_read_with_the_decision(monkeypatch):
    """Decide as where a read waits for the device: a model drafter's drafts are read back with the
    verifier's decision (`hf_polybasic.decoding.protocol.Deferred`), which verifies every drafted token and keeps
    ``min(accepted, cut)`` of them. The schedules also stop after any token of probability <= 0.6 (a
    stopping rule of the drafts alone, like their own), so cuts are frequent; counts the
    verifications that accepted drafts past the cut (the round then emits the next draft), and
    checks that every token a verifier emits is the same on the host as on the device."""
    monkeypatch.setattr(levels_round, "reads_wait", lambda device: True)
    monkeypatch.setattr(batch_gate, "PLAIN_FIRST_ROUNDS", 0)
    keep = CostAwareSchedule.keep_drafting
    monkeypatch.setattr(CostAwareSchedule, "keep_drafting", lambda self, confidence: keep(self, confidence)
                        and confidence > 0.6)
    counted = {"deferred": 0, "accepted past the cut": 0, "device batches": 0, "device rounds": 0}
    original = Verifier._read

    def counting(self, proposals, decided, scores, deferred):
        settled, reads = original(self, proposals, decided, scores, deferred)
        if deferred is not None:
            counted["deferred"] += len(decided)
            counted["accepted past the cut"] += sum(int(decided[row][0]) > len(settled[row]) for row in decided)
        for row, read in reads.items():  # the host's ids (for stops and EOS) are the device's tokens
            assert read.on_device.tolist() == [read.token], (row, read)
        return settled, reads

    monkeypatch.setattr(Verifier, "_read", counting)
    run = DeviceBlocks.run

    def counting_batches(self, requests):
        counted["device batches"] += 1
        for rounds in run(self, requests):
            counted["device rounds"] += len(rounds)
            yield rounds

    monkeypatch.setattr(DeviceBlocks, "run", counting_batches)
    return counted
