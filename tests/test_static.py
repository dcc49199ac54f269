"""The static runner (`hf_polybasic.runners.static`): exact against full forwards and plain `generate`,
one compiled graph per width made once, a clear fallback for the models it cannot take.

The oracle (tests/test_oracle.py) also draws static and compiled runners for every architecture;
here are the properties of the runner itself and of what a user of ``cache_implementation="static"``
and ``PolybasicConfig(compile=...)`` sees. Compiled forwards trace with dynamo's ``eager`` backend
(conftest.py), except in the one test of inductor itself.
"""

from __future__ import annotations

import copy
import math
import threading
import warnings

import conftest
import pytest
import torch
from helpers import ALPHA, SAMPLES, SETTINGS, STEPS, VOCAB, assert_every_level_took_part, chi_square_p_value, outcome_counts
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import hf_polybasic as hp
from hf_polybasic import compat
from hf_polybasic.runners import probe, static
from hf_polybasic.runners.dynamic import CachedModel
from hf_polybasic.drafters import PromptLookup
from hf_polybasic.runners.probe import static_problem
from hf_polybasic.runners.static import WIDTHS, StaticRunner, bucket, capacity_for
from hf_polybasic.testing import TINY_ARCHITECTURES, make_target, noisy_copy, prompt, tiny_chain

@pytest.fixture(autouse=True)
def warn_afresh(monkeypatch):
    """Each test sees the chain's once-per-process warnings (another test may have made them)."""
    from hf_polybasic.decoding import build as chain
    monkeypatch.setattr(chain, "_warned_runners", set())


STATIC_ARCHITECTURES = ["llama", "qwen2", "mixtral", "qwen3-moe", "gpt2", "opt"]  # taken on every release tested


def _full(model, sequence: torch.LongTensor, count: int) -> torch.Tensor:
    return CachedModel(model, None, role="reference").logits(sequence, count)


def test_bucket_and_capacity():
    assert [bucket(k) for k in (1, 2, 3, 5, 8, 9, 17, 32, 33, 64, 65)] == [1, 2, 4, 8, 8, 16, 32, 32, 64, 64, 65]
    assert capacity_for(10) == 256 and capacity_for(255 - max(WIDTHS)) == 256 and capacity_for(256 - max(WIDTHS)) == 512
    assert capacity_for(300) == 512 and capacity_for(600) == 1024 and capacity_for(1500) == 2048  # tiers: powers of two


@pytest.mark.parametrize("arch", STATIC_ARCHITECTURES)
def test_architectures_the_static_runner_takes(arch, shared_models):
    target = shared_models.built(("static", arch), lambda: tiny_chain(arch, depth=1))[0]
    assert static_problem(target) is None


def test_mpt_is_taken_where_its_release_takes_a_custom_4d_mask(shared_models):
    """MPT's ALiBi counts key slots, which the static layout keeps equal to positions: taken on
    transformers 5.x; 4.57 checks a 4-D mask against the cache's length and refuses it, by name."""
    target = shared_models.built(("static", "mpt"), lambda: tiny_chain("mpt", depth=1))[0]
    problem = static_problem(target)
    if compat.TRANSFORMERS_VERSION.major >= 5:
        assert problem is None
    else:
        assert "Incorrect 4D attention_mask shape" in problem


@st.composite
def _operations(draw):
    """Per step: each row's next sequence length (grown by 1-9 tokens, or by a catch-up of 60-150, wider
    than the widest width, or cut back by a rollback first) and how many of its last logits are asked."""
    rows = draw(st.integers(1, 3))
    steps = []
    for _ in range(draw(st.integers(2, 6))):
        step = {}
        for row in range(rows):
            if draw(st.booleans()) or not steps or (row == rows - 1 and not step):
                new = draw(st.one_of(st.integers(1, 9), st.integers(60, 150)))
                # (tokens rolled back, new tokens, logits asked: up to 3, or up to 70 across a catch-up's forwards)
                step[row] = (draw(st.integers(0, 5)), new, draw(st.integers(1, min(new, 3 if new < 60 else 70))))
        steps.append(step)
    return rows, steps


@settings(max_examples=12, deadline=None)
@given(arch=st.sampled_from(STATIC_ARCHITECTURES), operations=_operations(), data=st.data())
def test_static_runner_logits_equal_full_forwards(arch, operations, data, shared_models):
    """Rows of different lengths fed together, rolled back and fed other tokens, some more than the
    widest width at once: every logit equals a full forward's over the row's sequence (the runner pads
    to buckets and splits a wider forward into several of the widest; pads never show), and after
    the prefill every forward has a width of `WIDTHS`, compiled or not."""
    target = shared_models.built(("static", arch), lambda: tiny_chain(arch, depth=1))[0]
    rows, steps = operations
    compiled = data.draw(st.booleans())
    runner = StaticRunner(target, "target", capacity_for(6 * 150), rows=rows, compiled=compiled)
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    sequences = {row: torch.randint(3, 90, (1,), generator=generator) for row in range(rows)}
    try:
        for step in steps:
            requests = {}
            for row, (back, new, asked) in step.items():
                kept = max(sequences[row].shape[0] - back, 1)
                runner.rollback_rows({row: min(runner.lengths[row], kept)})
                sequences[row] = torch.cat([sequences[row][:kept], torch.randint(3, 90, (new,), generator=generator)])
                requests[row] = (sequences[row], asked)
            logits = runner.logits_rows(requests)
            for row, (sequence, count) in requests.items():
                torch.testing.assert_close(logits[row], _full(target, sequence, count), rtol=1e-4, atol=1e-4)
        assert set(runner.forward_widths) <= set(WIDTHS)
    finally:
        runner.close()


def test_models_the_static_runner_refuses_say_why(shared_models):
    mistral = shared_models.built(("static", "mistral"), lambda: tiny_chain("mistral", depth=1))[0]
    assert "windowed attention" in static_problem(mistral)
    bloom = shared_models.built(("static", "bloom"), lambda: tiny_chain("bloom", depth=1))[0]
    assert "static cache" in static_problem(bloom)  # BLOOM builds ALiBi from a 2-D mask
    hooked = make_target("llama", seed=5)
    handle = hooked.model.layers[0].register_forward_pre_hook(lambda module, args: None)
    assert static_problem(hooked) is None  # a hook runs as well on a static cache, uncompiled
    assert "forward hooks (model.layers.0" in probe.compile_problem(hooked)
    handle.remove()
    assert probe.compile_problem(hooked) is None
    eager = make_target("llama", seed=6)
    eager.config._attn_implementation = "flash_attention_2"
    assert "takes no explicit attention mask" in static_problem(eager)


def _greedy(target, chain, ids, **options):
    return target.generate(ids, custom_generate=hp.generate, assistant_models=chain, do_sample=False,
                           max_new_tokens=30, return_dict_in_generate=True, **options)


def test_cache_implementation_static_runs_every_model_static(shared_models):
    target, *chain = shared_models.built(("static-chain", "llama"), lambda: tiny_chain("llama", depth=3))
    ids = prompt(6, seed=11)
    out = _greedy(target, [*chain, PromptLookup(num_tokens=3)], ids, cache_implementation="static", eos_token_id=None,
                  polybasic_config=hp.PolybasicConfig(schedule="constant", num_draft_tokens=3, block_threshold=3))
    assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=30, eos_token_id=None))
    assert [level.runner for level in out.polybasic_stats.levels] == ["static"] * 3 + [""]
    assert all(level.forward_passes > 0 for level in out.polybasic_stats.levels[:3])
    # handed back as plain generate hands its cache back: the output minus its last token, continuable
    cache = out.past_key_values
    assert cache.get_seq_length() == out.sequences.shape[1] - 1
    more = target.generate(out.sequences, past_key_values=cache, do_sample=False, max_new_tokens=5, eos_token_id=None)
    assert torch.equal(more, target.generate(ids, do_sample=False, max_new_tokens=35, eos_token_id=None))


def test_calls_after_a_static_call_work(shared_models):
    """transformers (<= 5.14) keeps the StaticCache it built for ``cache_implementation="static"`` and
    reuses it; the chain never fills it, and 5.4 then failed at the next call: it is forgotten."""
    target, *chain = shared_models.built(("static-chain", "llama"), lambda: tiny_chain("llama", depth=3))
    ids = prompt(5, seed=14)
    for _ in range(2):
        out = _greedy(target, chain, ids, cache_implementation="static")
        assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=30))
    assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=30, cache_implementation="static"),
                       out.sequences)


def test_a_model_the_static_runner_refuses_keeps_the_dynamic_cache_with_a_warning(shared_models):
    mistral, *chain = shared_models.built(("static-chain", "mistral"), lambda: tiny_chain("mistral", depth=2))
    ids = prompt(6, seed=12)
    with pytest.warns(UserWarning, match=r"runs target M1 MistralForCausalLM on a dynamic cache: it has windowed"):
        out = _greedy(mistral, chain, ids, cache_implementation="static",
                      polybasic_config=hp.PolybasicConfig(schedule="constant"))
    assert torch.equal(out.sequences, mistral.generate(ids, do_sample=False, max_new_tokens=30))
    assert [level.runner for level in out.polybasic_stats.levels] == ["dynamic", "dynamic"]


def _named_gemmas():
    """A windowed target (layer 0); a copy that loads as another checkpoint (another model kind, the
    same reason); the target's weights windowed in layer 1 instead (the target's kind, another reason)."""
    target = tiny_chain("gemma3", depth=1)[0]
    target.config.name_or_path = "org/tiny-gemma-big"
    other_kind = noisy_copy(target, 0.02, 3)
    other_kind.config.name_or_path = "org/tiny-gemma-small"
    config = type(target.config).from_dict({**target.config.to_dict(), "layer_types": ["full_attention",
                                                                                       "sliding_attention"]})
    other_reason = type(target)(config).eval()
    other_reason.load_state_dict(target.state_dict())
    other_reason.generation_config = copy.deepcopy(target.generation_config)
    return target, other_kind, other_reason


@pytest.mark.parametrize("compiled", [False, True])
def test_models_the_static_runner_refuses_are_named_once_per_kind_and_reason(compiled, shared_models):
    """Each model kind the static runner refuses is named once per reason, by its level, with the
    reason, and with what the rest of the chain does instead (static, or compiled, where it can): in
    the first call the target, another kind refused for the same reason, and the target's kind
    refused for another reason, each at the line that called generate; in a later call none of them
    again."""
    target, *chain = shared_models.built(("static-chain", "named gemma3"), _named_gemmas)
    ids = prompt(6, seed=16)
    said = []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = _greedy(target, chain, ids, cache_implementation="static",
                          polybasic_config=hp.PolybasicConfig(schedule="constant", compile=compiled))
        said.append([str(w.message) for w in caught if str(w.message).startswith("hf_polybasic runs")])
        # said at the caller's line (`hf_polybasic.user_warnings`), the target's as the assistants'
        assert {w.filename for w in caught if str(w.message).startswith("hf_polybasic runs")} <= {__file__}
        assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=30))
    assert len(said[0]) == 3 and said[1] == []
    others = "The other models of the chain run " + ("compiled " if compiled else "") + "on static caches where they can"
    for message, level, layer in zip(said[0], ["target M1 Gemma3ForCausalLM(tiny-gemma-big)",
                                               "assistant_models[0] (M2 Gemma3ForCausalLM(tiny-gemma-small))",
                                               "assistant_models[1] (M3 Gemma3ForCausalLM(tiny-gemma-big))"], [0, 0, 1]):
        assert message.startswith(f"hf_polybasic runs {level} on a dynamic cache" + (", uncompiled" if compiled else "")
                                  + f": it has windowed attention (layer {layer}")
        assert message.endswith(others)


def test_a_hooked_model_runs_static_uncompiled_with_a_warning():
    """A model with forward hooks runs on a static cache, uncompiled, said once per model kind and
    hooked module: a later call with the same hook says nothing, a hook on another module is said."""
    target, m2 = tiny_chain("llama", depth=2, seed=3)
    counted = []
    handle = target.register_forward_pre_hook(lambda module, args: counted.append(1))
    ids = prompt(6, seed=15)
    config = hp.PolybasicConfig(compile=True, schedule="constant")
    with pytest.warns(UserWarning, match=r"runs target M1 LlamaForCausalLM on a static cache, uncompiled: it has forward"
                                         r" hooks \(LlamaForCausalLM:"):
        out = _greedy(target, [m2], ids, polybasic_config=config)
    assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=30))
    assert [level.runner for level in out.polybasic_stats.levels] == ["static", "static, compiled"]
    assert len(counted) >= out.polybasic_stats.levels[0].forward_passes
    for hooked, said in [(target, False), (target.lm_head, True)]:
        handle.remove()
        handle = hooked.register_forward_hook(lambda module, args, output: counted.append(1))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = _greedy(target, [m2], ids, polybasic_config=config)
        runs = [str(w.message) for w in caught if str(w.message).startswith("hf_polybasic runs")]
        assert runs == ([f"hf_polybasic runs target M1 LlamaForCausalLM on a static cache, uncompiled: it has forward"
                         " hooks (lm_head: Python run at every forward, e.g. accelerate's or a counter's)"] if said else [])
        assert out.polybasic_stats.levels[0].runner == "static"
    handle.remove()


def test_a_prefilled_static_cache_is_refused():
    from transformers import StaticCache

    target, m2 = tiny_chain("llama", depth=2)
    ids = prompt(6, seed=13)
    cache = StaticCache(config=target.config, max_cache_len=64)
    target(ids, past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="pre-filled StaticCache"):
        _greedy(target, [m2], ids, past_key_values=cache)


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_compiled_forwards_make_one_graph_per_width_once(shared_models):
    """A compiled chain makes a graph the first time each (model, padded width) comes up, so never more
    than one per width of `WIDTHS` for each model, and a call that meets no new width makes none (no
    recompilation per round, per call, per prompt or per budget)."""
    target, *chain = shared_models.built(("static-chain", "qwen2"), lambda: tiny_chain("qwen2", depth=3))
    config = hp.PolybasicConfig(schedule="constant", num_draft_tokens=3, block_threshold=4, compile=True)
    calls = [(prompt(5, seed=1), 30), (prompt(9, seed=2), 30), (prompt(3, seed=3), 20), (prompt(12, seed=4), 40),
             (prompt(70, seed=5), 10)] * 2
    seen = [set() for _ in range(3)]  # widths each model has met in decoding (prefills run uncompiled)
    for ids, budget in calls:
        before = _graphs()
        out = target.generate(ids, custom_generate=hp.generate, assistant_models=chain, polybasic_config=config,
                              do_sample=False, max_new_tokens=budget, return_dict_in_generate=True)
        assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=budget))
        levels = out.polybasic_stats.levels
        assert [level.runner for level in levels] == ["static, compiled"] * 3
        new = sum(len(set(level.forward_widths) - known) for level, known in zip(levels, seen))
        assert _graphs() - before <= new, f"{_graphs() - before} graphs for {new} new widths: compiled again"
        for level, known in zip(levels, seen):
            known.update(level.forward_widths)
    assert all(seen) and calls[-1][0].shape[1] > max(WIDTHS)  # prompts wider than a bucket prefill uncompiled


def test_a_call_compiles_only_the_widths_it_decodes_with():
    """The default (cost-aware) with compiled forwards, counted with dynamo's counters (issue 45): the
    first call measures the models' cost curves through their static runners uncompiled, so every
    graph it makes is a (model, width) its decoding used, on the one cache each model keeps; a second
    call with another prompt length and budget within the same cache tier gets the same caches and
    makes graphs only for widths they have not met; a third in a larger tier (a new cache, whose
    graphs are its own) makes graphs only for widths it decodes with."""
    from hf_polybasic.costs import CostCurves
    from hf_polybasic.generation import make_generate

    target, draft = tiny_chain("llama", depth=2, seed=31)
    generate = make_generate(costs=CostCurves(directory=None))  # curves in memory, measured in the first call

    def compiled_widths() -> dict:
        return {model: set(static._pool[model][1].compiled_widths) for model in (target, draft) if model in static._pool}

    caches, pairs = None, set()
    for length, budget in [(100, 96), (150, 60), (400, 40)]:  # two calls of the 512-slot tier, then 1024
        ids = prompt(length, seed=length)
        before, widths_before = _graphs(), compiled_widths()
        out = target.generate(ids, custom_generate=generate, assistant_models=[draft], do_sample=False,
                              max_new_tokens=budget, return_dict_in_generate=True, eos_token_id=None,
                              polybasic_config=hp.PolybasicConfig(compile=True))
        plain = target.generate(ids, do_sample=False, max_new_tokens=budget, eos_token_id=None)
        assert torch.equal(out.sequences, plain) and plain.shape[1] == length + budget
        levels = out.polybasic_stats.levels
        assert [level.runner for level in levels] == ["static, compiled"] * 2
        widths = compiled_widths()
        kept = {model: static._pool[model][1] for model in widths}
        if caches is not None and capacity_for(length + budget) > caches[target].capacity:
            widths_before, pairs = {}, set()  # a larger tier: new caches
        else:
            assert caches is None or all(kept[model] is caches[model] for model in caches), "a cache made again"
        caches = kept
        decoded = {(model, width) for model, level in zip((target, draft), levels) for width in level.forward_widths}
        made = sum(len(widths[model] - widths_before.get(model, set())) for model in widths)
        assert _graphs() - before == made <= len(decoded - pairs), f"{_graphs() - before} graphs for {decoded - pairs}"
        pairs |= decoded
        assert {(model, width) for model in widths for width in widths[model]} <= pairs, "a width decoding never used"


def test_the_curves_of_a_compiled_chain_price_its_compiled_forwards(monkeypatch):
    """A compiled runner's curve is measured uncompiled (no graph), then priced by compiled forwards: on
    a simulated machine where compiled forwards cost a quarter of uncompiled ones, the schedule's costs
    at the end of the first call, and the stored curves the next call starts from, are the compiled
    costs at every point (a bounded refresh would have left them at half the uncompiled ones)."""
    from hf_polybasic.costs import CostCurves, cost_key
    from hf_polybasic.costs.store import UNCOMPILED_POINTS
    from hf_polybasic.generation import make_generate
    from hf_polybasic.testing import SimulatedClock

    target, draft = tiny_chain("llama", depth=2, seed=32)
    uncompiled, compiled = {target: 0.008, draft: 0.0016}, {target: 0.002, draft: 0.0004}
    clock = SimulatedClock()
    forward_for = static.forward_for

    def charged_forward_for(model, is_compiled, float_mask, layers=None):
        forward = forward_for(model, is_compiled, float_mask, layers)

        def charged(model, *args):
            clock.advance((compiled if is_compiled else uncompiled)[model])
            return forward(model, *args)

        return charged

    monkeypatch.setattr(static, "forward_for", charged_forward_for)
    store = CostCurves(directory=None, key=lambda model: f"{cost_key(model)}-{id(model)}")
    generate = make_generate(clock=clock, costs=store)
    ids = prompt(20, seed=3)
    out = target.generate(ids, custom_generate=generate, assistant_models=[draft], do_sample=False, max_new_tokens=60,
                          eos_token_id=None, return_dict_in_generate=True, polybasic_config=hp.PolybasicConfig(compile=True))
    assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=60, eos_token_id=None))
    for model, level in zip((target, draft), out.polybasic_stats.levels):
        assert level.runner == "static, compiled"
        assert level.forward_costs == pytest.approx({k: compiled[model] for k in level.forward_costs}, rel=0.01)
        curve = store.curve_for(model, runner="compiled")
        assert curve.points == pytest.approx({k: compiled[model] for k in curve.points}, rel=0.01)
        # the points that replays of their own size priced (a width's first forward compiles) are no longer
        # listed as measured uncompiled
        replayed = {min(curve.points, key=lambda k: abs(math.log(k / width)))
                    for width, count in level.forward_widths.items() if count > 1}
        assert replayed and not replayed & set(curve.description[UNCOMPILED_POINTS])


def test_compiled_cost_aware_default_is_exact_and_draws_on_the_compiled_runner(shared_models):
    target, *chain = shared_models.built(("static-chain", "llama"), lambda: tiny_chain("llama", depth=3))
    ids = prompt(7, seed=21)
    out = _greedy(target, chain, ids, polybasic_config=hp.PolybasicConfig(compile=True))
    assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=30))
    assert out.polybasic_stats.levels[0].runner == "static, compiled"


def test_learned_positions_near_their_limit(shared_models):
    """Pads of the last forwards never take a position past a learned position table (GPT-2: 256)."""
    target, *chain = shared_models.built(("static-chain", "gpt2"), lambda: tiny_chain("gpt2", depth=2))
    ids = prompt(236, seed=22)
    out = target.generate(ids, custom_generate=hp.generate, assistant_models=chain, do_sample=False,
                          max_new_tokens=20, cache_implementation="static",
                          polybasic_config=hp.PolybasicConfig(schedule="constant", num_draft_tokens=6))
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=20))


def test_threads_decode_with_one_model_at_once(shared_models):
    """Calls at once never share a static cache (a call takes one from the pool or makes its own). Each
    passes an empty StaticCache of its own: transformers' ``cache_implementation="static"`` keeps one
    cache per model, which concurrent calls of some releases (5.4) trip over before ours begins."""
    from transformers import StaticCache

    target, *chain = shared_models.built(("static-chain", "llama"), lambda: tiny_chain("llama", depth=3))
    prompts = [prompt(5 + index, seed=30 + index) for index in range(4)]
    expected = [target.generate(ids, do_sample=False, max_new_tokens=30) for ids in prompts]
    results, errors = {}, []

    def work(index):
        try:
            results[index] = target.generate(
                prompts[index], custom_generate=hp.generate, assistant_models=chain, do_sample=False,
                max_new_tokens=30, **{compat.cache_argument(target): StaticCache(config=target.config, max_cache_len=64)},
                polybasic_config=hp.PolybasicConfig(schedule="constant"))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for index, ids in enumerate(prompts):
        assert torch.equal(results[index], expected[index])


def test_a_model_cast_between_static_calls_gets_caches_of_its_new_dtype():
    """A pooled cache has the dtype and device of the model's keys when it was made: after
    ``model.to(torch.bfloat16)`` the next calls failed in ``SlotLayer.update`` (``scatter(): Expected self.dtype
    to be equal to src.dtype``), one per model. A cache is found again only for the model as it was
    (`hf_polybasic.models.fingerprint`); one left as it was keeps its cache (and graphs)."""
    target, draft = tiny_chain("llama", depth=2, seed=33)
    ids = prompt(6, seed=12)
    options = dict(do_sample=False, max_new_tokens=30, eos_token_id=None)
    kept = None
    for dtype in (torch.float32, torch.float32, torch.float64):
        for model in (target, draft):
            model.to(dtype)
        out = _greedy(target, [draft], ids, cache_implementation="static", eos_token_id=None,
                      polybasic_config=hp.PolybasicConfig(schedule="constant", num_draft_tokens=3))
        assert torch.equal(out.sequences, target.generate(ids, **options))
        assert [level.runner for level in out.polybasic_stats.levels] == ["static", "static"]
        cache = static._pool[target][1]
        assert cache.layers[0].keys.dtype == dtype
        assert (cache is kept) is (dtype == torch.float32 and kept is not None)
        kept = cache


def test_a_call_that_raises_gives_its_static_caches_back():
    """A call that raises mid-decoding gives its caches back to the pool as one that ends does (they were
    lost, and the next call made new ones: their compiled graphs made again)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Fails(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            raise RuntimeError("a criterion failed")

    target, draft = tiny_chain("llama", depth=2, seed=34)
    ids = prompt(6, seed=13)
    config = hp.PolybasicConfig(schedule="constant", num_draft_tokens=3)
    _greedy(target, [draft], ids, cache_implementation="static", polybasic_config=config)
    caches = [static._pool[model][1] for model in (target, draft)]
    with pytest.raises(RuntimeError, match="a criterion failed"):
        _greedy(target, [draft], ids, cache_implementation="static", polybasic_config=config,
                stopping_criteria=StoppingCriteriaList([Fails()]))
    assert [static._pool[model][1] for model in (target, draft)] == caches
    out = _greedy(target, [draft], ids, cache_implementation="static", polybasic_config=config)
    assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=30))
    assert [static._pool[model][1] for model in (target, draft)] == caches


def test_inductor_compiled_chain_equals_plain_generate(monkeypatch):
    """The real backend, once (seconds per graph on a CPU): exact, and compiled once."""
    monkeypatch.setattr(static, "compile_options", conftest.INDUCTOR_COMPILE_OPTIONS)
    target = make_target("llama", seed=41)
    draft = noisy_copy(target, 0.1, seed=42)
    config = hp.PolybasicConfig(schedule="constant", num_draft_tokens=3, compile=True)
    ids = prompt(6, seed=1)
    counts = []
    for _ in range(3):  # the first call's prefills allocate (uncompiled); the third meets no new width
        out = _greedy(target, [draft], ids, polybasic_config=config)
        assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=30))
        counts.append(_graphs())
    assert counts[2] == counts[1]
    assert out.polybasic_stats.levels[1].runner == "static, compiled"


# --- sampling -------------------------------------------------------------------------------------------
def _static_sample_counts(models, setting: str, seed: int, generate=hp.generate, **options):
    ids = prompt(3, seed=5, vocab=VOCAB)
    torch.manual_seed(seed)
    out = models[0].generate(
        ids, do_sample=True, max_new_tokens=STEPS, num_return_sequences=SAMPLES, custom_generate=generate,
        assistant_models=list(models[1:]), return_dict_in_generate=True, **SETTINGS[setting], **options)
    return outcome_counts(out.sequences[:, ids.shape[1] :]), out.polybasic_stats


@pytest.mark.parametrize("runner", ["static", "compiled"])
def test_static_chain_samples_the_target_distribution(runner, distribution_models, exact_distribution):
    setting = "temperature+top_k+top_p"
    config = hp.PolybasicConfig(schedule="constant", num_draft_tokens=2, block_threshold=2,
                                compile=runner == "compiled")
    extra = {"cache_implementation": "static"} if runner == "static" else {}
    counts, stats = _static_sample_counts(distribution_models[:3], setting, seed=7, polybasic_config=config, **extra)
    print(runner, assert_every_level_took_part(stats))
    assert {level.runner for level in stats.levels} == {"static, compiled" if runner == "compiled" else "static"}
    assert chi_square_p_value(counts, exact_distribution(setting)) > ALPHA


def test_negative_control_a_mask_that_sees_one_slot_too_far(distribution_models, exact_distribution, monkeypatch):
    """A static mask off by one (each token also sees the slot after its own: the next draft, a pad or a
    stale token) fails the same test: it has the power to see a static runner's mistakes. (A rollback
    that does nothing would not: every forward re-feeds from the first position whose logits it needs,
    and the target's is always its last emitted token, so no stale slot is ever seen; only a level
    below the target can lag, and what it computes changes acceptance, never the output.)"""
    monkeypatch.setattr(static, "visible_slots", lambda slots, capacity: torch.arange(
        capacity, device=slots.device).view(1, 1, 1, -1) <= slots.unsqueeze(1).unsqueeze(-1) + 1)
    setting = "temperature+top_k+top_p"
    config = hp.PolybasicConfig(schedule="constant", num_draft_tokens=2, block_threshold=2)
    counts, stats = _static_sample_counts(distribution_models[:3], setting, seed=7, polybasic_config=config,
                                          cache_implementation="static")
    assert_every_level_took_part(stats)
    assert chi_square_p_value(counts, exact_distribution(setting)) < ALPHA


def test_compile_options_capture_cuda_graphs_on_a_gpu_only():
    """What ``compile=`` asks of torch.compile (the suite's own patch swaps it for the eager backend)."""
    options = conftest.INDUCTOR_COMPILE_OPTIONS
    assert options(torch.device("cuda")) == {"mode": "reduce-overhead", "dynamic": False}
    assert options("cpu") == {"mode": None, "dynamic": False}


def test_a_model_past_its_graph_limit_runs_new_widths_uncompiled_and_says_so(monkeypatch):
    """`GRAPHS_PER_MODEL` graphs made, a forward of a new width runs uncompiled (exact all the same),
    said in a warning once; widths that have their graph keep replaying it."""
    monkeypatch.setattr(static, "GRAPHS_PER_MODEL", 2)
    monkeypatch.setattr(static, "_warned_graph_limit", set())
    target = tiny_chain("llama", depth=1, seed=33)[0]
    runner = StaticRunner(target, "target", capacity_for(64), compiled=True)
    sequence = torch.randint(3, 90, (40,), generator=torch.Generator().manual_seed(3))
    try:
        runner.logits_rows({0: (sequence[:5], 1)})  # the prefill: uncompiled, no graph
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            before = _graphs()
            for end in (6, 8, 12, 20, 21, 23):  # widths 1, 2, 4, 8, then 1 and 2 again
                logits = runner.logits_rows({0: (sequence[:end], 1)})
                torch.testing.assert_close(logits[0], _full(target, sequence[:end], 1), rtol=1e-4, atol=1e-4)
        limit = [w for w in caught if "compiled graphs (GRAPHS_PER_MODEL" in str(w.message)]
        assert len(limit) == 1, [str(w.message) for w in caught]
        assert _graphs() - before == 2 and runner.cache.compiled_widths == {1, 2}
    finally:
        runner.close()
