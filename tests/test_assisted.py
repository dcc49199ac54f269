"""The chain as transformers' own `CandidateGenerator`, driven by transformers' assisted loop
(`hp.assisted_generate`, `hp.PolybasicCandidateGenerator`): greedy output equals plain `generate`,
every level rolls back to what the target kept, every release's calling convention is taken, and
calls the loop would decode otherwise are refused. The sampled distribution:
test_assisted_sampling.py.
"""

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers import assert_every_level_took_part
from transformers import GenerationConfig
from transformers.generation import BaseStreamer, LogitsProcessorList

import hf_polybasic as hp
from hf_polybasic import assisted, compat
from hf_polybasic.candidates import PolybasicCandidateGenerator
from hf_polybasic.testing import EOS, cheap_drafting_costs, make_chain, make_tokenizer, prompt, simulated_machine


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
    assert_every_level_took_part(out.polybasic_stats, rejections=False)
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
def test_greedy_output_on_static_caches(chain_of):
    target, *assistants = chain_of("llama", 3)
    ids = prompt(6, seed=4)
    reference = _greedy(target, ids, max_new_tokens=20)
    out = _greedy(target, ids, max_new_tokens=20, cache_implementation="static", custom_generate=hp.assisted_generate,
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
                          return_dict_in_generate=True)
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


# --- what transformers' loop would decode otherwise: refused ----------------------------------------
def test_calls_the_loop_would_get_wrong_are_refused(chain_of):
    target, *assistants = chain_of("llama", 2)
    ids = prompt(4, seed=1)

    def call(ids=ids, **options):
        return target.generate(ids, max_new_tokens=4, custom_generate=hp.assisted_generate,
                               assistant_models=assistants, **options)

    with pytest.raises(ValueError, match="decodes one prompt at a time, got 2"):
        call(torch.cat([ids, ids]))
    with pytest.raises(ValueError, match="num_return_sequences=2"):
        call(do_sample=True, num_return_sequences=2)
    with pytest.raises(ValueError, match="use_cache=False"):
        call(use_cache=False)
    with pytest.raises(ValueError, match="selects one of transformers' own assisted-generation modes"):
        call(prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="num_beams=2"):
        call(num_beams=2)
    with pytest.raises(NotImplementedError, match="`output_hidden_states=True` is not supported"):
        call(output_hidden_states=True, return_dict_in_generate=True)
    if hasattr(GenerationConfig(), "assistant_ensemble_weight"):
        with pytest.raises(ValueError, match="`assistant_ensemble_weight` mixes"):
            call(assistant_ensemble_weight=0.5)
    if not compat.ASSISTED_DECODING_TAKES_STATIC_CACHE:
        with pytest.raises(ValueError, match="takes a static cache from transformers 5.24 on"):
            call(cache_implementation="static")
    with pytest.raises(ValueError, match="hf_polybasic needs `assistant_models="):
        target.generate(ids, max_new_tokens=4, custom_generate=hp.assisted_generate)
    with pytest.raises(ValueError, match="PolybasicCandidateGenerator serves one prompt"):
        PolybasicCandidateGenerator(target, assistants, torch.cat([ids, ids]), LogitsProcessorList(),
                                    GenerationConfig(max_length=10))


def test_a_target_with_recurrent_state_is_refused():
    from hf_polybasic.testing import make_target

    target = make_target("qwen3_next" if compat.TRANSFORMERS_VERSION.major >= 5 else "mamba", seed=1)
    ids = prompt(4, seed=1)
    with pytest.raises(ValueError, match="keeps recurrent state"):
        target.generate(ids, max_new_tokens=4, custom_generate=hp.assisted_generate, assistant_models=[target])
