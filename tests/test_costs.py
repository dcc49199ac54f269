"""The cost-curve store never breaks `generate`: unreadable or foreign files and concurrent writers
fall back to measuring with one warning; measuring can be switched off; measuring one model does not
block another."""

import json
import threading
import warnings
from pathlib import Path

import pytest
import torch

import hf_polybasic as hp
from hf_polybasic.costs import CostCurve, CostCurves, cost_key
from hf_polybasic.generation import make_generate
from hf_polybasic.testing import make_target, noisy_copy, prompt


class CountingMeasure:
    """A measure function that returns a fixed curve and counts its calls (per model key)."""

    def __init__(self):
        self.calls: list[str] = []

    def __call__(self, model, clock=None):
        self.calls.append(cost_key(model))
        return CostCurve({1: 0.01, 2: 0.011, 4: 0.012, 8: 0.014, 16: 0.02})


@pytest.fixture(scope="module")
def model():
    return make_target("llama", seed=51)


def test_a_measured_curve_is_stored_and_found_by_the_next_process(tmp_path, model):
    measure = CountingMeasure()
    first = CostCurves(tmp_path, measure=measure).curve_for(model)
    again = CostCurves(tmp_path, measure=measure).curve_for(model)  # a new process: from disk
    assert measure.calls == [cost_key(model)]
    assert again.points == first.points
    assert [p.name for p in tmp_path.iterdir()] == [f"{cost_key(model)}-every-width.json"]  # no temporary file left


def test_a_static_runner_has_curves_of_its_own_measured_through_it(tmp_path, model):
    """A compiled static runner's T(k) is another curve (padded widths, graphs): kept under its own key
    and measured through the static runner uncompiled (no graph for a width decoding may never use),
    every point listed as such until compiled forwards price it; the dynamic one's is untouched."""
    from hf_polybasic.costs.store import UNCOMPILED_POINTS

    kinds = []

    def measure(model, clock=None, runner="dynamic", capacity=None):
        kinds.append(runner)
        return CostCurve({1: 0.01, 2: 0.01, 4: 0.01, 8: 0.01, 16: 0.02})

    store = CostCurves(tmp_path, measure=measure)
    store.curve_for(model, runner="compiled")
    store.curve_for(model)
    store.curve_for(model, runner="compiled")
    assert kinds == ["static", "dynamic"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{cost_key(model)}-compiled.json", f"{cost_key(model)}-every-width.json"]
    stored = CostCurves(tmp_path, measure=measure).curve_for(model, runner="compiled")  # a new process: from disk
    assert stored.description == {"runner": "compiled", UNCOMPILED_POINTS: [1, 2, 4, 8, 16]}


def test_measuring_through_a_static_runner_pads_to_its_widths(model):
    from hf_polybasic.costs import measure_curve
    from hf_polybasic.costs.measure import measuring_runner
    from hf_polybasic.runners.static import StaticRunner

    assert isinstance(measuring_runner(model, "static", 64), StaticRunner)
    curve = measure_curve(model, tokens=(1, 3), context=8, repeats=1, runner="static")
    assert curve.description["runner"] == "static" and set(curve.points) == {1, 3}
    with pytest.raises(ValueError, match="runner must be one of"):
        measuring_runner(model, "graphs", 64)


@pytest.mark.parametrize(
    "content",
    ['[]', 'null', '"a string"', '{"format": 1, "points": [1, 2]}', '{"format": 1, "points": {"a": 1}}',
     '{"format": 1, "points": {"1": -3}}', '{"format": 1, "points": {"1": 0.1}, "context": {}}', '{"form', ''],
)
def test_a_file_that_is_not_a_curve_is_measured_again_with_one_warning(tmp_path, model, content):
    path = tmp_path / f"{cost_key(model)}-every-width.json"
    path.write_text(content)
    measure = CountingMeasure()
    store = CostCurves(tmp_path, measure=measure)
    with pytest.warns(UserWarning, match="could not read the cost curve") as caught:
        curve = store.curve_for(model)
    assert len(caught) == 1 and measure.calls == [cost_key(model)]
    assert CostCurve.from_dict(json.loads(path.read_text())).points == curve.points  # replaced by a good one


def test_an_unreadable_directory_falls_back_to_measuring(tmp_path, model, monkeypatch):
    real_is_file = Path.is_file

    def refused(self):
        if self.parent == tmp_path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_is_file(self)

    monkeypatch.setattr(Path, "is_file", refused)
    measure = CountingMeasure()
    with pytest.warns(UserWarning, match="could not read the cost curve.*Permission denied"):
        curve = CostCurves(tmp_path, measure=measure).curve_for(model)
    assert curve is not None and len(measure.calls) == 1


def test_generate_runs_on_a_store_it_can_neither_read_nor_write(tmp_path, model, monkeypatch):
    blocked = tmp_path / "a-file-not-a-directory"
    blocked.write_text("")
    generate = make_generate(costs=CostCurves(blocked / "costs", measure=CountingMeasure()))
    ids = prompt(5, seed=2)
    options = dict(do_sample=False, max_new_tokens=8, eos_token_id=None)
    with pytest.warns(UserWarning, match="could not store a cost curve"):
        out = model.generate(ids, custom_generate=generate, assistant_models=[noisy_copy(model, 0.05, 1)], **options)
    assert torch.equal(out, model.generate(ids, **options))


def test_a_call_refreshes_the_curves_of_the_runners_its_forwards_went_through(model):
    """What a call's forwards cost moves the curve of the runner they went through, for the next
    call: a dynamic call's the dynamic curves, a static call's (``cache_implementation="static"``)
    the static ones, not the dynamic ones (a static runner's T(k) is another curve)."""
    draft = noisy_copy(model, 0.05, 1)
    costs, runners = {model: 0.01, draft: 0.001}, []  # drafting pays: both models run, their forwards timed

    def measure(measured, clock=None, runner="dynamic", capacity=None):
        runners.append(runner)
        return CostCurve({k: costs[measured] * (1 + 0.01 * k) for k in (1, 2, 4, 8, 16)})

    store = CostCurves(None, measure=measure, key=lambda m: f"{cost_key(m)}-{id(m)}")
    generate = make_generate(costs=store)
    ids, options = prompt(5, seed=4), dict(do_sample=False, max_new_tokens=12, eos_token_id=None)
    model.generate(ids, custom_generate=generate, assistant_models=[draft], **options)
    learned = {m: store.curve_for(m).observations for m in (model, draft)}
    assert all(learned.values())
    model.generate(ids, custom_generate=generate, assistant_models=[draft], cache_implementation="static", **options)
    assert all(store.curve_for(m, runner="static").observations > 0 for m in (model, draft))
    assert {m: store.curve_for(m).observations for m in (model, draft)} == learned
    assert runners == ["dynamic"] * 2 + ["static"] * 2


def test_concurrent_writers_never_leave_a_torn_or_temporary_file(tmp_path, model):
    key = cost_key(model)
    curves = [CostCurve({1: 0.01 * (i + 1), 16: 0.02 * (i + 1)}, description={"pad": "x" * 20000}) for i in range(4)]
    errors, seen = [], []

    def write(store, curve):
        for _ in range(30):
            store._save(key, curve)

    def read(writers):
        # while any writer runs, then once after them all (a loaded machine may schedule the writers late)
        while True:
            done = not any(writer.is_alive() for writer in writers)
            path = tmp_path / f"{key}.json"
            if path.exists():
                try:
                    seen.append(CostCurve.from_dict(json.loads(path.read_text())).points[1])
                except (OSError, ValueError) as error:
                    errors.append(error)
            if done:
                return

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a writer tripping over another one would warn
        writers = [threading.Thread(target=write, args=(CostCurves(tmp_path), c)) for c in curves]
        threads = [*writers, threading.Thread(target=read, args=(writers,))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors
    assert seen and set(seen) <= {c.points[1] for c in curves}
    assert [p.name for p in tmp_path.iterdir()] == [f"{key}.json"]


@pytest.mark.parametrize("how", ["config", "environment"])
def test_measuring_can_be_switched_off(tmp_path, model, monkeypatch, how):
    measure = CountingMeasure()
    generate = make_generate(costs=CostCurves(tmp_path, measure=measure))
    config = hp.PolybasicConfig(measure_costs=False) if how == "config" else hp.PolybasicConfig()
    if how == "environment":
        monkeypatch.setenv("HF_POLYBASIC_MEASURE_COSTS", "0")
    ids = prompt(5, seed=3)
    options = dict(do_sample=False, max_new_tokens=12, eos_token_id=None)
    out = model.generate(ids, custom_generate=generate, assistant_models=[noisy_copy(model, 0.05, 1)],
                         polybasic_config=config, return_dict_in_generate=True, **options)
    assert measure.calls == [] and not list(tmp_path.iterdir())
    assert torch.equal(out.sequences, model.generate(ids, **options))
    assert all(level.forward_costs is None for level in out.polybasic_stats.levels)  # went by the call's timings
    with pytest.raises(ValueError, match="measure_costs must be True or False"):
        hp.PolybasicConfig(measure_costs="no")


def test_measuring_one_model_does_not_block_another(tmp_path, model):
    other = make_target("llama", seed=52, layers=3)  # another shape: another key
    assert cost_key(other) != cost_key(model)
    started, release = threading.Event(), threading.Event()

    def slow_measure(measured, clock=None):
        if measured is model:
            started.set()
            assert release.wait(30)
        return CostCurve({1: 0.01, 16: 0.02})

    store = CostCurves(None, measure=slow_measure)
    first = threading.Thread(target=store.curve_for, args=(model,))
    first.start()
    assert started.wait(30)
    done = threading.Event()
    second = threading.Thread(target=lambda: (store.curve_for(other), done.set()))
    second.start()
    finished_while_blocked = done.wait(10)
    release.set()
    first.join()
    second.join()
    assert finished_while_blocked


def test_the_schedule_prices_each_width_as_measured_and_a_slowed_timing_by_a_longer_one():
    """An unpacked fp32 forward of the 1.5B over 3 tokens costs 1.45x one over 4 (MKL's row blocks,
    docs/speed.md): the schedule must see that to draft past it. A timing over twice a longer
    forward's was slowed by something else and is priced at the longer one's. (A least-squares line
    through the points priced T(1) at 1.5x its cost where T(2) = 2 T(1).)"""
    from hf_polybasic.costs import CostEstimate

    fp32 = {1: 0.43, 2: 0.87, 3: 1.26, 4: 0.86, 5: 0.86, 6: 0.90, 7: 1.21, 8: 0.78}
    estimate = CostEstimate(CostCurve(fp32))
    assert [estimate.seconds(k) for k in fp32] == pytest.approx(list(fp32.values()))
    assert estimate.seconds(3) > 1.4 * estimate.seconds(4) and estimate.seconds(1) == pytest.approx(0.43)
    slowed = CostEstimate(CostCurve({1: 0.120, 2: 0.500, 4: 0.094, 8: 0.122, 16: 0.167}))
    assert slowed.seconds(2) == pytest.approx(0.094) and slowed.seconds(1) == pytest.approx(0.120)
    assert slowed.seconds(32) == pytest.approx(0.167 + (0.167 - 0.122) / 8 * 16)


def test_one_slowed_forward_barely_moves_its_width_and_forwards_that_agree_move_it_far():
    """On a flat curve a token more costs a fortieth of a step (bf16 1.5B on an AVX-512 CPU: T(1) 0.245 s,
    6.6 ms a width more), while one forward's timing on a shared machine is off by a tenth or more: a
    width one slowed forward priced alone looked twice as dear as its neighbour (T(3) 0.505 s against
    T(2) 0.304 s, a call's estimate on the AMD AVX-512 machine), and the schedule stopped drafting
    there. A width's own correction is shrunk towards the whole curve's (`POINT_PRIOR`): one slowed
    forward moves it a little, and the whole curve with it; forwards at that width that agree, among
    forwards at others (a kernel's real step, 1.45x), move it over half the way within the call (on a
    logarithmic scale; the call's refresh of the stored curve then moves it on, call after call)."""
    from hf_polybasic.costs import CostEstimate

    flat = CostCurve({k: 0.245 + 0.0066 * (k - 1) for k in range(1, 18)})
    estimate = CostEstimate(flat)
    for _ in range(2):
        for k in flat.points:
            estimate.observe(k, flat.seconds(k))
    estimate.observe(3, 2 * flat.seconds(3))
    assert estimate.seconds(3) / estimate.seconds(2) < 1.25
    assert estimate.seconds(2) / flat.seconds(2) == pytest.approx(estimate.seconds(4) / flat.seconds(4))
    for _ in range(10):
        for k in (2, 3, 4):
            estimate.observe(k, (1.45 if k == 3 else 1.0) * flat.seconds(k))
    assert estimate.seconds(3) / estimate.seconds(2) > 1.45 ** 0.5


def test_past_a_dense_curve_the_trend_comes_from_half_its_width_and_no_cost_is_negative():
    """Past the last point of a curve measured at every width, the line runs from the last point at or
    below half the last width, not from the last neighbour: a step between the last two widths (T(17)
    above a flat T(1..16)) is one step, not a slope of a step per token. Below the first point the
    line never goes under zero."""
    from hf_polybasic.costs.curve import interpolate_cost

    dense = {k: 1.0 for k in range(1, 17)} | {17: 1.9}
    assert interpolate_cost(dense, 20) == pytest.approx(1.9 + 0.9 / 9 * 3)  # from k = 8, not from 16
    assert interpolate_cost({1: 0.1, 2: 1.0}, 0) == 0.0


def test_refreshes_from_call_after_call_converge_on_what_forwards_cost():
    """A benchmark's hundreds of calls refresh a stored curve again and again. With a noisy pair of
    measured points (T(2) above T(4)) each refresh used to scale the raw points by the ratio
    against their nondecreasing fit, which kept the pair's ratio forever and drove points to
    nonsense (a stored T(4) of 7 ns on the benchmark machine); now the points converge on the
    observed costs, keep no timing over twice a longer one's and move at most MAX_REFRESH_FACTOR per call."""
    import math

    from hf_polybasic.costs import CostCurve, CostEstimate
    from hf_polybasic.costs.curve import SLOWED, unslowed
    from hf_polybasic.costs.store import MAX_REFRESH_FACTOR

    model = make_target("llama", seed=3)
    truth = {1: 0.10, 2: 0.11, 4: 0.12, 8: 0.15, 16: 0.20}
    measured = CostCurve(points={1: 0.10, 2: 0.40, 4: 0.001, 8: 0.15, 16: 0.20})
    store = CostCurves(None, measure=lambda *args, **kwargs: measured)
    curve = store.curve_for(model)
    for call in range(30):
        before = dict(curve.points)
        estimate = CostEstimate(curve)
        for tokens in (1, 2, 3, 4, 5, 8, 12, 16) * 8:
            estimate.observe(tokens, truth[min(truth, key=lambda k: abs(math.log(k) - math.log(tokens)))])
        store.refresh(model, estimate)
        ks = sorted(curve.points)
        assert all(curve.points[a] <= SLOWED * curve.points[b] * (1 + 1e-9) for i, a in enumerate(ks) for b in ks[i + 1:])
        smooth = dict(zip(ks, unslowed([before[k] for k in ks])))  # what the predictions used
        assert all(1 / MAX_REFRESH_FACTOR - 1e-9 <= curve.points[k] / smooth[k] <= MAX_REFRESH_FACTOR + 1e-9 for k in ks)
    for k, seconds in truth.items():
        assert curve.points[k] == pytest.approx(seconds, rel=0.15)


def test_a_stored_curve_refreshed_by_noisy_forwards_call_after_call_stays_near_their_costs():
    """Forwards timed a tenth off either way (a shared machine), thirty a call at a decoding's mix of
    widths, a hundred calls: each refresh moves a width by its own correction, and when one forward was
    all a width had, the stored curve took that forward's noise and kept some of it call after call
    (here the stored widths ended 11 % off, as a spread of log errors, against the first measurement's
    3 %; the stored curve of a day of benchmarks on the AMD AVX-512 machine had T(3) 0.319 s above T(5)
    0.268 s). With a width's correction shrunk towards the whole curve's they end 3 % off."""
    import math
    import random
    import statistics

    from hf_polybasic.costs import CostEstimate

    truth = {k: 0.245 + 0.0066 * (k - 1) for k in range(1, 18)}
    widths = [1] * 3 + [2] * 6 + [3] * 5 + [4] * 4 + [5] * 3 + [6] * 2 + [7, 8, 9, 10, 12, 14, 17]
    rng = random.Random(0)
    measured = CostCurve({k: seconds * math.exp(rng.gauss(0, 0.03)) for k, seconds in truth.items()})
    store = CostCurves(None, measure=lambda *args, **kwargs: measured)
    model = make_target("llama", seed=3)
    curve = store.curve_for(model)
    for _ in range(100):
        estimate = CostEstimate(curve)
        for _ in range(30):
            k = rng.choice(widths)
            estimate.observe(k, truth[k] * math.exp(rng.gauss(0, 0.1)))
        store.refresh(model, estimate)
    error = statistics.pstdev(math.log(curve.points[k] / truth[k]) for k in truth)
    assert error < 0.05


def test_compiled_forwards_price_a_curve_measured_uncompiled_in_full():
    """A compiled runner's points measured uncompiled take what one call's compiled forwards cost, in
    full (however few, however far from the uncompiled measurement: MAX_REFRESH_FACTOR does not hold
    them back), the points those forwards priced leave the list, and from then on a point moves as
    any other (bounded); a curve measured compiled keeps the bounded refresh."""
    from hf_polybasic.costs import CostEstimate
    from hf_polybasic.costs.store import MAX_REFRESH_FACTOR, UNCOMPILED_POINTS

    model = make_target("llama", seed=4)
    store = CostCurves(None, measure=lambda *args, **kwargs: CostCurve({1: 0.04, 2: 0.04, 4: 0.04, 8: 0.05, 16: 0.06}))
    curve = store.curve_for(model, runner="compiled")
    estimate = CostEstimate(curve)
    for tokens in (4, 4, 8):  # compiled forwards ten times cheaper, at widths 4 and 8 only
        estimate.observe(tokens, curve.seconds(tokens) / 10)
    store.refresh(model, estimate, runner="compiled")
    assert curve.points == pytest.approx({1: 0.004, 2: 0.004, 4: 0.004, 8: 0.005, 16: 0.006})
    assert curve.description[UNCOMPILED_POINTS] == [1, 2, 16]
    again = CostEstimate(curve)
    for tokens in (1, 2, 16):  # compiled forwards at the other widths, as the curve says
        again.observe(tokens, curve.seconds(tokens))
    store.refresh(model, again, runner="compiled")
    assert curve.description[UNCOMPILED_POINTS] == []
    before, third = dict(curve.points), CostEstimate(curve)
    for tokens in (4, 4):  # listed no more: two forwards ten times cheaper move every point a little
        third.observe(tokens, curve.seconds(tokens) / 10)
    store.refresh(model, third, runner="compiled")
    assert curve.points == pytest.approx({k: v * 0.1 ** (2 / 50) for k, v in before.items()})
    measured_compiled = CostCurves(None, measure=lambda *args, **kwargs: CostCurve({1: 0.04, 2: 0.04}))
    other = measured_compiled.curve_for(model)  # the dynamic runner's: no uncompiled points
    estimate = CostEstimate(other)
    for _ in range(60):
        estimate.observe(1, 0.004)
    measured_compiled.refresh(model, estimate)
    assert other.points[1] == pytest.approx(0.04 / MAX_REFRESH_FACTOR)
