"""The chain as transformers' own `CandidateGenerator`, driven by transformers' assisted loop
(`hp.assisted_generate`, `hp.PolybasicCandidateGenerator`): greedy output equals plain `generate`,
every level rolls back to what the target kept, every release's calling convention is taken, and
calls the loop would decode otherwise are refused. The sampled distribution:
test_assisted_sampling.py.
"""

import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers import assert_every_level_took_part
from transformers import GenerationConfig
from transformers.generation import BaseStreamer, LogitsProcessorList, PrefixConstrainedLogitsProcessor

import hf_polybasic as hp
from hf_polybasic import assisted, compat
from hf_polybasic.candidates import PolybasicCandidateGenerator
from hf_polybasic.drafters import Drafter
from hf_polybasic.testing import (EOS, cheap_drafting_costs, make_chain, make_tokenizer, noisy_copy, prompt,
                                  simulated_machine)


@pytest.fixture(scope="module")
def chain_of(shared_models):
    """(arch, depth) -> the session's shared chain (built once)."""
    return lambda arch, depth: shared_models.chain(arch, depth, seed=7)


def _greedy(target, ids, **kwargs):
    return target.generate(ids, do_sample=False, **kwargs)


# --- greedy: transformers' loop over the chain is plain greedy generate -----------------------------
@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: sliding layers, which the loop must crop
@given(
    depth=st.integers(2, 4),
    k=st.integers(1, 6),
    mu=st.integers(1, 8),
    prompt_length=st.integers(1, 10),
    budget=st.integers(1, 30),
    eos_step=st.one_of(st.none(), st.integers(0, 29)),
    seed=st.integers(0, 1000),
    schedule=st.sampled_from(["constant", "heuristic", "cost_aware"]),
)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_greedy_output_equals_plain_generate(arch, depth, k, mu, prompt_length, budget, eos_step, seed, schedule,
                                             chain_of):
    """Any depth, K, mu, budget and EOS position (a token the target really emits made the EOS, so
    it lands inside blocks); the cost-aware schedule on a simulated machine where drafting pays."""
    target, *assistants = chain_of(arch, depth)
    ids = prompt(prompt_length, seed=seed)
    reference = _greedy(target, ids, max_new_tokens=budget, eos_token_id=EOS)
    eos = EOS
    if eos_step is not None and eos_step < reference.shape[1] - ids.shape[1]:
        eos = int(reference[0, ids.shape[1] + eos_step])
        reference = _greedy(target, ids, max_new_tokens=budget, eos_token_id=[eos, EOS])
    with simulated_machine(cheap_drafting_costs(target, assistants), assisted=True) as simulated:
        out = _greedy(
            target, ids, max_new_tokens=budget, eos_token_id=[eos, EOS],
            custom_generate=simulated if schedule == "cost_aware" else hp.assisted_generate,
            assistant_models=assistants, return_dict_in_generate=True,
            polybasic_config=hp.PolybasicConfig(num_draft_tokens=k, block_threshold=mu, schedule=schedule),
        )
    assert torch.equal(out.sequences, reference)
    assert hp.last_stats(target) is out.polybasic_stats
    if budget >= 2:
        assert_every_level_took_part(out.polybasic_stats, rejections=False, acceptances=False)


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_greedy_output_with_processors_scores_and_a_streamer(depth, chain_of):
    """Prefix-dependent processors; ``output_scores`` are the target's processed scores of plain
    `generate`; a streamer gets the prompt, then exactly the new tokens, then its end."""
    target, *assistants = chain_of("llama", depth)
    ids = prompt(4, seed=3)
    options = dict(max_new_tokens=24, min_new_tokens=20, repetition_penalty=1.3, no_repeat_ngram_size=2,
                   eos_token_id=EOS, return_dict_in_generate=True, output_scores=True)
    reference = _greedy(target, ids, **options)
    streamer = _Collecting()
    out = _greedy(target, ids, custom_generate=hp.assisted_generate, assistant_models=assistants, streamer=streamer,
                  polybasic_config=hp.PolybasicConfig(schedule="constant", num_draft_tokens=3, block_threshold=3),
                  **options)
    assert torch.equal(out.sequences, reference.sequences)
    assert len(out.scores) == len(reference.scores)
    for mine, theirs in zip(out.scores, reference.scores):
        assert torch.allclose(mine, theirs, atol=1e-4)
    assert torch.equal(torch.cat(streamer.pieces), out.sequences[0]) and streamer.ended
    stats = out.polybasic_stats
    assert_every_level_took_part(stats, rejections=False)
    top = stats.levels[0]
    assert top.runner == "transformers" and top.forward_passes == top.verifications > 0
    assert stats.new_tokens == out.sequences.shape[1] - ids.shape[1] == 24


class _Collecting(BaseStreamer):
    def __init__(self):
        self.pieces, self.ended = [], False

    def put(self, value):
        self.pieces.append(value.reshape(-1))

    def end(self):
        self.ended = True


@pytest.mark.parametrize("depth, cache", [(2, None), (3, None), (3, "static")])
def test_greedy_output_where_reads_wait_for_the_device(depth, cache, drafts_read_with_the_decision, chain_of,
                                                      monkeypatch):
    """As on a GPU: a model drafter right under the target leaves its drafts unread (`Deferred`, read
    here since transformers' loop reads nothing with its decision); under a middle level the middle
    reads them with its decision, or, on static caches, decides its rounds on the device. Schedules
    also stop after any token of probability <= 0.6 (the fixture)."""
    from hf_polybasic import candidates

    if cache == "static" and not compat.ASSISTED_DECODING_TAKES_STATIC_CACHE:
        pytest.skip("static caches in transformers' loop: >= 5.24")
    settled, read = [], candidates.settled
    monkeypatch.setattr(candidates, "settled", lambda proposals: settled.append(proposals) or read(proposals))
    target, *assistants = chain_of("llama", depth)
    ids = prompt(5, seed=depth)
    reference = _greedy(target, ids, max_new_tokens=24)
    with simulated_machine(cheap_drafting_costs(target, assistants), assisted=True) as simulated:
        out = _greedy(target, ids, max_new_tokens=24, custom_generate=simulated, assistant_models=assistants,
                      cache_implementation=cache, return_dict_in_generate=True,
                      polybasic_config=hp.PolybasicConfig(block_threshold=3))
    assert torch.equal(out.sequences, reference)
    stats = out.polybasic_stats
    assert_every_level_took_part(stats, rejections=False)
    # the simulated clock charges the target 10 ms a forward: transformers' loop runs one per verification
    assert stats.levels[0].seconds == pytest.approx(0.010 * stats.levels[0].verifications)
    assert all(level.forward_costs for level in stats.levels[1:])  # the schedules priced by the machine's curves
    if depth == 2:
        assert sum(any(p.deferred is not None for p in proposals.values()) for proposals in settled) > 0
    elif cache is None:
        assert drafts_read_with_the_decision["deferred"] > 0
    else:
        assert out.polybasic_stats.levels[1].device_rounds > 0


def test_assistant_model_is_a_chain_of_one(chain_of):
    """transformers' own ``assistant_model=`` beside ``custom_generate=hp.assisted_generate`` (which
    `generate` does not hand the callable) is the chain ``[assistant_model]``."""
    target, m2 = chain_of("llama", 2)
    ids = prompt(5, seed=2)
    reference = _greedy(target, ids, max_new_tokens=20)
    out = _greedy(target, ids, max_new_tokens=20, custom_generate=hp.assisted_generate, assistant_model=m2,
                  return_dict_in_generate=True, polybasic_config=hp.PolybasicConfig(schedule="constant"))
    assert torch.equal(out.sequences, reference)
    assert len(out.polybasic_stats.levels) == 2 and out.polybasic_stats.levels[1].proposed > 0
    with pytest.raises(ValueError, match="both `assistant_model=` and `assistant_models=`"):
        _greedy(target, ids, max_new_tokens=5, custom_generate=hp.assisted_generate, assistant_model=m2,
                assistant_models=[m2])


@pytest.mark.skipif(not compat.ASSISTED_DECODING_TAKES_STATIC_CACHE, reason="static caches in the loop: >= 5.24")
@pytest.mark.parametrize("asked", ["cache_implementation", "a StaticCache of the caller's"])
def test_greedy_output_on_static_caches(asked, chain_of):
    from transformers import StaticCache

    target, *assistants = chain_of("llama", 3)
    ids = prompt(6, seed=4)
    reference = _greedy(target, ids, max_new_tokens=20)
    static = ({"cache_implementation": "static"} if asked == "cache_implementation" else
              {compat.cache_argument(target): StaticCache(config=target.config, max_cache_len=32)})
    out = _greedy(target, ids, max_new_tokens=20, custom_generate=hp.assisted_generate, **static,
                  assistant_models=assistants, return_dict_in_generate=True,
                  polybasic_config=hp.PolybasicConfig(schedule="constant"))
    assert torch.equal(out.sequences, reference)
    assert [level.runner for level in out.polybasic_stats.levels[1:]] == ["static", "static"]


def test_enabled_model_routes_assistant_models_and_assistant_model_to_the_loop_on_request():
    target, m2, m3 = make_chain("llama", 3, seed=11)
    ids = prompt(5, seed=6)
    reference = _greedy(target, ids, max_new_tokens=16)
    hp.enable(target, loop="transformers")
    try:
        for chain, depth in (({"assistant_models": [m2, m3]}, 3), ({"assistant_model": m2}, 2)):
            out = _greedy(target, ids, max_new_tokens=16, return_dict_in_generate=True, **chain)
            assert torch.equal(out.sequences, reference)
            levels = out.polybasic_stats.levels
            assert levels[0].runner == "transformers" and len(levels) == depth
        with pytest.raises(ValueError, match="both `assistant_model=` and `assistant_models=`"):
            _greedy(target, ids, max_new_tokens=4, assistant_model=m2, assistant_models=[m2, m3])
        with pytest.raises(ValueError, match="`assistant_tokenizer=`"):
            _greedy(target, ids, max_new_tokens=4, assistant_model=m2, assistant_tokenizer=object())
        assert torch.equal(_greedy(target, ids, max_new_tokens=16), reference)  # no chain: plain generate
        hp.enable(target)  # the default loop again: transformers' assisted generation, untouched
        assert torch.equal(_greedy(target, ids, max_new_tokens=16, assistant_model=m2), reference)
    finally:
        hp.disable(target)
    with pytest.raises(ValueError, match="enable\\(loop='hf'\\)"):
        hp.enable(target, loop="hf")


def test_stop_strings_stop_after_the_round_as_transformers_loop_does():
    """What the docs say transformers' loop does differently: a stop string ends the call after the
    round that wrote it, so the output is plain `generate`'s up to the string, then the rest of that
    round (the target's own greedy tokens)."""
    target, m2, m3 = make_chain("llama", 3, seed=12)
    tokenizer = make_tokenizer()
    ids = prompt(5, seed=5)
    reference = _greedy(target, ids, max_new_tokens=30, eos_token_id=None)
    word = tokenizer.decode([int(reference[0, ids.shape[1] + 5])])
    options = dict(max_new_tokens=30, eos_token_id=None, stop_strings=[word], tokenizer=tokenizer)
    expected = _greedy(target, ids, **options)
    hp.enable(target, loop="transformers")
    try:
        out = _greedy(target, ids, assistant_models=[m2, m3], **options,
                      polybasic_config=hp.PolybasicConfig(schedule="constant", num_draft_tokens=4, block_threshold=8))
    finally:
        hp.disable(target)
    assert torch.equal(out[:, : expected.shape[1]], expected)
    assert torch.equal(out, reference[:, : out.shape[1]])
    assert out.shape[1] > expected.shape[1]  # tokens of the round past the stop string


# --- the generator itself -----------------------------------------------------------------------------
@pytest.mark.parametrize("do_sample", [False, True])
def test_after_the_verdict_every_level_holds_the_kept_prefix(do_sample, chain_of):
    """After ``update_candidate_strategy(num_matches)`` every level's cache holds ``start +
    num_matches`` tokens, or what it held if fewer (a level never fed that far), and the next block
    continues the text the loop kept."""
    target, *assistants = chain_of("llama", 4)
    ids = prompt(6, seed=9)
    config = GenerationConfig(do_sample=do_sample, max_length=ids.shape[1] + 40, eos_token_id=None, top_k=None)
    cut = 0
    for num_matches in range(8):
        torch.manual_seed(num_matches)
        generator = PolybasicCandidateGenerator(target, assistants, ids, LogitsProcessorList(), config,
                                                hp.PolybasicConfig(schedule="constant", num_draft_tokens=3,
                                                                   block_threshold=(5, 3)))
        candidates, logits = generator.get_candidates(ids)
        block = candidates.shape[1] - ids.shape[1]
        if num_matches > block:
            break
        assert (logits is None) != do_sample
        if do_sample:
            assert logits.shape == (1, block, target.config.vocab_size) and logits.dtype == torch.float32
            assert torch.allclose(logits.exp().sum(-1), torch.ones(1, block))
        runners = generator.chain.runners[1:]
        before = [runner.lengths[0] for runner in runners]
        generator.update_candidate_strategy(candidates[:, : ids.shape[1] + num_matches + 1], None, num_matches)
        expected = [min(length, ids.shape[1] + num_matches) for length in before]
        assert [runner.lengths[0] for runner in runners] == expected
        assert [compat.cached_tokens(runner.cache) for runner in runners] == expected
        cut += sum(length > ids.shape[1] + num_matches for length in before)
        text = torch.cat([candidates[:, : ids.shape[1] + num_matches], torch.tensor([[5]])], dim=1)
        following, _ = generator.get_candidates(text)
        assert torch.equal(following[:, : text.shape[1]], text)
    assert cut >= 3  # levels held more than was kept, and rolled back


@pytest.mark.parametrize("version", [(), ("first",), ("kw",)])
def test_the_generator_takes_every_releases_calling_convention(version, chain_of):
    """4.57 and 5.4 call ``get_candidates(input_ids)``, 5.0 ``get_candidates(input_ids, is_first_iteration)``,
    5.14 and later may pass keywords."""
    target, *assistants = chain_of("llama", 3)
    ids = prompt(5, seed=1)
    generator = PolybasicCandidateGenerator(target, assistants, ids, LogitsProcessorList(),
                                            GenerationConfig(do_sample=False, max_length=30, eos_token_id=None),
                                            hp.PolybasicConfig(schedule="constant"))
    args, kwargs = {(): ((), {}), ("first",): ((True,), {}),
                    ("kw",): ((), dict(model_kwargs={}, model_outputs=None, is_first_iteration=True,
                                       n_last_matches=0))}[version]
    candidates, _ = generator.get_candidates(ids, *args, **kwargs)
    generator.update_candidate_strategy(candidates, None, 1)
    assert generator.rounds == 1 and generator.stats.levels[0].accepted == 1


def test_the_generator_reads_the_config_stored_in_the_generation_config(chain_of):
    """A `PolybasicConfig` saved into the generation config (`save_to`) rules a call that gives none."""
    target, draft = chain_of("llama", 2)
    ids = prompt(5, seed=3)
    config = GenerationConfig(do_sample=False, max_length=30, eos_token_id=None)
    hp.PolybasicConfig(schedule="constant", num_draft_tokens=2).save_to(config)
    candidates, _ = PolybasicCandidateGenerator(target, [draft], ids, LogitsProcessorList(), config).get_candidates(ids)
    assert candidates.shape[1] - ids.shape[1] == 2


class NarrowDrafter(Drafter):
    """Samples among the first ``width`` ids and reports float64 log-probabilities over them only."""

    stateless = True

    def __init__(self, width: int):
        self.width = width

    def propose(self, sequence, max_new_tokens):
        probs = torch.full((3, self.width), 1.0 / (self.width - 3), dtype=torch.float64)
        probs[:, :3] = 0  # no pad, BOS or EOS
        count = min(3, max_new_tokens)
        return torch.multinomial(probs[:count], 1)[:, 0], probs[:count].log()


def test_a_drafters_narrower_distribution_is_reported_over_the_targets_vocabulary(chain_of):
    target = chain_of("llama", 2)[0]
    ids = prompt(5, seed=3)
    config = GenerationConfig(do_sample=True, max_length=30, eos_token_id=None, top_k=None)
    generator = PolybasicCandidateGenerator(target, [NarrowDrafter(20)], ids, LogitsProcessorList(), config,
                                            hp.PolybasicConfig(schedule="constant"))
    candidates, logits = generator.get_candidates(ids)
    assert candidates.shape[1] - ids.shape[1] == 3
    assert logits.shape == (1, 3, target.config.vocab_size) and logits.dtype == torch.float32
    assert torch.allclose(logits[0, :, 3:20].exp(), torch.full((3, 17), 1 / 17))
    assert bool((logits[0, :, :3] == float("-inf")).all()) and bool((logits[0, :, 20:] == float("-inf")).all())


def test_blocks_stop_short_of_the_budget_and_after_an_eos(chain_of):
    """The block leaves the target room for its own token, ends at the first EOS, and is fed to the
    levels without the prompt's left padding, whose processors see row 0 of the call."""
    target, *assistants = chain_of("llama", 3)
    ids = prompt(5, seed=4)
    options = dict(schedule="constant", num_draft_tokens=5, block_threshold=6)

    def block(max_new_tokens, eos=None, padding=0):
        seen = set()

        def allowed(batch_id, sequence):
            seen.add(batch_id)
            return list(range(3, target.config.vocab_size))

        padded = torch.cat([torch.zeros(1, padding, dtype=torch.long), ids], dim=1)
        mask = torch.cat([torch.zeros(1, padding, dtype=torch.long), torch.ones_like(ids)], dim=1)
        config = GenerationConfig(do_sample=False, max_length=padded.shape[1] + max_new_tokens, eos_token_id=eos)
        processors = LogitsProcessorList([PrefixConstrainedLogitsProcessor(allowed, num_beams=1)])
        generator = PolybasicCandidateGenerator(target, assistants, padded, processors, config,
                                                hp.PolybasicConfig(**options), attention_mask=mask)
        candidates, _ = generator.get_candidates(padded)
        assert seen == {0} and generator.padding == padding
        return candidates[0, padded.shape[1] :].tolist()

    free = block(20)
    assert len(free) == 6
    assert block(3) == free[:2]
    assert block(20, eos=free[1]) == free[:2]
    assert block(20, padding=3) == free


@pytest.mark.parametrize("static", [False, True])
def test_the_chain_is_the_one_hp_generate_builds(static, chain_of):
    """The bottom model drafts through its restricted-vocabulary view where `hp.generate` would (not
    on static caches), every model on the runner the call asks for."""
    target, *assistants = chain_of("llama", 3)
    ids = prompt(5, seed=4)
    generator = PolybasicCandidateGenerator(
        target, assistants, ids, LogitsProcessorList(), GenerationConfig(do_sample=False, max_length=20),
        hp.PolybasicConfig(schedule="constant", drafter_vocabulary=32), static=static)
    runners = generator.chain.runners[1:]
    assert (runners[-1].model is assistants[-1]) == static
    assert [type(runner).__name__ for runner in runners] == ["StaticRunner" if static else "CachedModel"] * 2
    generator.finish()


def test_the_calls_forward_costs_refresh_the_curves(chain_of):
    """Under the cost-aware schedule, what the levels' forwards cost in the call refines the stored
    curves (`Chain.finish` with the generator's ``costs``), as after `hp.generate`."""
    from hf_polybasic.costs import CostCurves, cost_key

    class Counting(CostCurves):
        refreshed = 0

        def refresh(self, model, estimate, runner="dynamic"):
            Counting.refreshed += 1
            super().refresh(model, estimate, runner)

    target, draft = chain_of("llama", 2)
    ids = prompt(5, seed=2)
    curves = Counting(directory=None, key=lambda model: f"{cost_key(model)}-{id(model)}")
    generator = PolybasicCandidateGenerator(target, [draft], ids, LogitsProcessorList(),
                                            GenerationConfig(do_sample=False, max_length=20), costs=curves)
    candidates, _ = generator.get_candidates(ids)
    generator.update_candidate_strategy(candidates, None, 0)
    generator.finish()
    assert Counting.refreshed == 2  # the target's curve and the drafter's


def test_the_loops_hook_is_removed_after_the_call_even_one_that_fails(chain_of):
    target, *assistants = chain_of("llama", 2)
    ids = prompt(4, seed=2)
    _greedy(target, ids, max_new_tokens=6, custom_generate=hp.assisted_generate, assistant_models=assistants)
    assert "_get_candidate_generator" not in vars(target)

    class Failing(PolybasicCandidateGenerator):
        def get_candidates(self, input_ids, *args, **kwargs):
            raise RuntimeError("drafting failed")

    with pytest.raises(RuntimeError, match="drafting failed"), pytest.MonkeyPatch.context() as patch:
        patch.setattr(assisted, "PolybasicCandidateGenerator", Failing)
        _greedy(target, ids, max_new_tokens=6, custom_generate=hp.assisted_generate, assistant_models=assistants)
    assert "_get_candidate_generator" not in vars(target)


def test_two_threads_on_one_model_each_get_their_own_chain(chain_of):
    target, m2, m3 = chain_of("llama", 3)
    ids = prompt(5, seed=8)
    reference = _greedy(target, ids, max_new_tokens=20)
    results, errors = {}, []

    def run(name, chain):
        try:
            out = _greedy(target, ids, max_new_tokens=20, custom_generate=hp.assisted_generate, assistant_models=chain,
                          return_dict_in_generate=True, polybasic_config=hp.PolybasicConfig(schedule="constant"))
            results[name] = (out.sequences, len(out.polybasic_stats.levels))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(name, chain)) for name, chain in (("two", [m3]), ("three", [m2, m3]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert results["two"][1] == 2 and results["three"][1] == 3
    assert all(torch.equal(sequences, reference) for sequences, _ in results.values())
    assert "_get_candidate_generator" not in vars(target)


@pytest.mark.parametrize("given", ["none", "generate's"])
def test_the_loop_gets_a_cache_it_can_crop(given, chain_of):
    """`compat.use_assisted_loop_cache`: on a sliding-window model the cache transformers' loop gets
    can be cropped after more tokens than the window (the cache `generate` lays out for a "greedy"
    call cannot, up to 5.13; 5.0 leaves it to the model's forward); a cache holding tokens is kept."""
    from transformers import DynamicCache

    target = chain_of("gemma3", 2)[0]
    name = compat.OUTPUT_CACHE_FIELD
    kwargs = {} if given == "none" else {name: DynamicCache(config=target.config.get_text_config(decoder=True))}
    compat.use_assisted_loop_cache(target, GenerationConfig(max_length=32), kwargs)
    cache = kwargs[name]
    if hasattr(cache, "activate_past_recording"):  # what the loop does first, from 5.14 on
        cache.activate_past_recording()
    ids = prompt(14, seed=3)  # the window is 6
    target(ids, **{compat.cache_argument(target): cache}, use_cache=True)
    cache.crop(-4)  # as the loop crops rejected drafts
    assert compat.cached_tokens(cache) == 10
    kept = {name: cache}
    compat.use_assisted_loop_cache(target, GenerationConfig(max_length=32), kept)
    assert kept[name] is cache


# --- what transformers' loop would decode otherwise: refused, as the errors page says -----------------
ERRORS_PAGE = (Path(__file__).resolve().parent.parent / "docs" / "reference" / "errors.md").read_text()


def refused(call, error, *placeholders, begins: str = ""):
    """Run ``call``: it raises ``error`` with a message that ``begins`` so and the errors page
    quotes, where each ``(value, name)`` of ``placeholders`` reads ``<name>``."""
    with pytest.raises(error) as raised:
        call()
    message = str(raised.value)
    assert message.startswith(begins), message
    for value, name in placeholders:
        message = message.replace(str(value), f"<{name}>", 1)
    assert f"{error.__name__}: {message}\n" in ERRORS_PAGE, message


def test_calls_the_loop_would_get_wrong_are_refused(chain_of):
    target, *assistants = chain_of("llama", 2)
    ids = prompt(4, seed=1)

    def call(ids=ids, **options):
        return lambda: target.generate(ids, max_new_tokens=4, custom_generate=hp.assisted_generate,
                                       assistant_models=assistants, **options)

    refused(call(torch.cat([ids, ids])), ValueError, (2, "n"), begins="transformers' assisted loop")
    refused(call(do_sample=True, num_return_sequences=2), ValueError, (2, "n"), begins="num_return_sequences")
    refused(call(use_cache=False), ValueError)
    refused(call(output_hidden_states=True, return_dict_in_generate=True), NotImplementedError,
            ("output_hidden_states", "output_attentions | output_hidden_states"))
    with pytest.raises(ValueError, match="selects one of transformers' own assisted-generation modes"):
        call(prompt_lookup_num_tokens=3)()
    with pytest.raises(ValueError, match="num_beams=2"):
        call(num_beams=2)()
    if hasattr(GenerationConfig(), "assistant_ensemble_weight"):
        refused(call(assistant_ensemble_weight=0.5), ValueError)
    if not compat.ASSISTED_DECODING_TAKES_STATIC_CACHE:
        refused(call(cache_implementation="static"), ValueError, (compat.TRANSFORMERS_VERSION, "version"))
    refused(lambda: target.generate(ids, max_new_tokens=4, custom_generate=hp.assisted_generate), ValueError)
    refused(lambda: target.generate(ids, max_new_tokens=5, custom_generate=hp.assisted_generate,
                                    assistant_model=assistants[0], assistant_models=assistants), ValueError)
    refused(lambda: PolybasicCandidateGenerator(target, assistants, torch.cat([ids, ids]), LogitsProcessorList(),
                                                GenerationConfig(max_length=10)), ValueError, (2, "n"))
    check = assisted.check_assisted_call  # what generate itself refuses first, or never passes a callable
    refused(lambda: check(target, ids, LogitsProcessorList(), GenerationConfig(), True, {}), NotImplementedError)
    refused(lambda: check(target, ids, LogitsProcessorList(), GenerationConfig(), False, {"pixel_values": None}),
            ValueError, ("'pixel_values'", "names"))


def test_an_assistant_that_does_not_decode_on_its_cache_is_named():
    import transformers as tf

    from hf_polybasic.runners import probe

    llama = make_chain("llama", 1, seed=4)[0]
    torch.manual_seed(0)
    gpt = tf.OpenAIGPTLMHeadModel(tf.OpenAIGPTConfig(vocab_size=llama.config.vocab_size, n_positions=64, n_embd=32,
                                                     n_layer=1, n_head=4)).eval()
    draft = noisy_copy(llama, 0.2, seed=5)
    if probe.cache_problem(gpt) is None:
        pytest.skip("this release's OpenAI-GPT passes the probe")
    with pytest.raises(ValueError, match=r"^assistant_models\[0\] \(M2 OpenAIGPTLMHeadModel\) cannot be part"):
        llama.generate(prompt(4), max_new_tokens=4, custom_generate=hp.assisted_generate, assistant_models=[gpt, draft])


def test_enable_takes_one_of_two_loops():
    target = make_chain("llama", 1, seed=13)[0]
    refused(lambda: hp.enable(target, loop="hf"), ValueError, ("'hf'", "value"))
    hp.enable(target, loop="transformers")
    try:
        refused(lambda: target.generate(prompt(3), max_new_tokens=4, assistant_model=target,
                                        assistant_tokenizer=object()), ValueError)
    finally:
        hp.disable(target)


@pytest.mark.parametrize("arch", ["lfm2", "mamba"])
def test_a_target_with_recurrent_state_is_refused(arch):
    """LFM2's short convolutions and Mamba's whole model keep state the loop cannot crop."""
    from hf_polybasic.runners.recurrent import recurrent_layers
    from hf_polybasic.testing import make_target

    target = make_target(arch, seed=1)
    ids = prompt(4, seed=1)
    refused(lambda: target.generate(ids, max_new_tokens=4, custom_generate=hp.assisted_generate,
                                    assistant_models=[target]),
            ValueError, (type(target).__name__, "class"),
            (recurrent_layers(target)[0].describe(), "layer i is its kind | class is stateful"))
