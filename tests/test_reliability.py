"""Reliability: the state a call leaves behind, padded batches, what a drafter reports, vocabularies.

Each test here failed before the fix it guards (issue 11).
"""

import pytest
import torch
from hf_polybasic.testing import (
    EOS,
    PAD,
    cheap_drafting_costs,
    make_chain,
    make_target,
    make_tokenizer,
    noisy_copy,
    prompt,
    simulated_machine,
)
from transformers import DynamicCache, GenerationConfig, StoppingCriteria, StoppingCriteriaList

import hf_polybasic as hp
from helpers import assert_every_level_took_part
from hf_polybasic.drafters import Drafter
from hf_polybasic.outputs import pad_token_id
from hf_polybasic.decoding.acceptance import speculative_decision

# a drafter that is the target itself, so every draft is accepted and rounds are long
EVERY_DRAFT_ACCEPTED = hp.PolybasicConfig(num_draft_tokens=8, schedule="constant")


@pytest.fixture
def target_and_copy():
    """A target and an exact copy of it, this test's own (some tests enable the target)."""
    target = make_target("llama", seed=51)
    return target, noisy_copy(target, 0.0, seed=1)


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def _first_new_token_seen_once(reference, prompt_length: int, at_least: int) -> tuple[int, int]:
    """(index, token): the first new token at index >= at_least that does not occur before it."""
    new = reference[0, prompt_length:].tolist()
    index = next(i for i in range(at_least, len(new)) if new[i] not in new[:i])
    return index, new[index]


# --- 1. the returned cache describes exactly the returned sequence ----------------------------------
class CacheLengthRecorder:
    """A streamer that records, after every put, (tokens streamed so far, the cache's length)."""

    def __init__(self, cache):
        self.cache = cache
        self.tokens = 0
        self.seen = []

    def put(self, value):
        self.tokens += value.numel()
        self.seen.append((self.tokens, self.cache.get_seq_length()))

    def end(self):
        pass


def test_cache_holds_the_sequence_minus_its_last_token_after_every_round(target_and_copy):
    target, copy = target_and_copy
    ids = prompt(6, seed=3)
    reference = target.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=None)
    index, stop_token = _first_new_token_seen_once(reference, ids.shape[1], at_least=2)
    cache = DynamicCache(config=target.config)
    recorder = CacheLengthRecorder(cache)
    out = target.generate(
        ids, custom_generate=hp.generate, assistant_models=[copy], polybasic_config=EVERY_DRAFT_ACCEPTED,
        do_sample=False, max_new_tokens=20, eos_token_id=None, past_key_values=cache, streamer=recorder,
        stopping_criteria=StoppingCriteriaList([StopAfterToken(stop_token)]), return_dict_in_generate=True,
    )
    assert out.sequences.shape[1] == ids.shape[1] + index + 1  # stopped inside the first (8-draft) round
    assert out.past_key_values is cache
    # the first put is the prompt (from transformers), then one per round
    assert len(recorder.seen) >= 2
    for streamed, cached in recorder.seen[1:]:
        assert cached == streamed - 1


def test_continuing_from_the_cache_after_a_stop_string_equals_plain_generate(target_and_copy):
    target, copy = target_and_copy
    tokenizer = make_tokenizer()
    ids = prompt(6, seed=4)
    reference = target.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=None)
    index, stop_token = _first_new_token_seen_once(reference, ids.shape[1], at_least=2)
    stop = tokenizer.decode([stop_token])
    hp.enable(target)
    try:
        out = target.generate(
            ids, assistant_models=[copy], polybasic_config=EVERY_DRAFT_ACCEPTED, do_sample=False,
            max_new_tokens=20, eos_token_id=None, stop_strings=[stop], tokenizer=tokenizer,
            return_dict_in_generate=True,
        )
    finally:
        hp.disable(target)
    assert out.sequences.shape[1] == ids.shape[1] + index + 1
    assert out.past_key_values.get_seq_length() == out.sequences.shape[1] - 1
    # the conversation goes on from the returned cache, as the batching how-to shows
    follow = torch.cat([out.sequences, prompt(3, seed=9)], dim=1)
    options = dict(do_sample=False, max_new_tokens=10, eos_token_id=None)
    continued = target.generate(follow, past_key_values=out.past_key_values, **options)
    assert torch.equal(continued, target.generate(follow, **options))


# --- 2. forced EOS in left-padded batches ----------------------------------------------------------
def test_forced_eos_reaches_every_row_of_a_left_padded_batch():
    target, *assistants = make_chain("llama", 3, seed=11)
    tokenizer = make_tokenizer()
    texts = ["hello!there", "ab", "xyz"]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    options = dict(do_sample=False, max_new_tokens=6, eos_token_id=EOS, forced_eos_token_id=EOS, pad_token_id=PAD)
    out = target.generate(
        **batch, custom_generate=hp.generate, assistant_models=assistants, return_dict_in_generate=True,
        polybasic_config=hp.PolybasicConfig(num_draft_tokens=3, block_threshold=4, schedule="constant"), **options,
    )
    assert_every_level_took_part(out.polybasic_stats, rejections=False, acceptances=False)
    out = out.sequences
    width = batch.input_ids.shape[1]
    for row, text in enumerate(texts):
        single = tokenizer(text, return_tensors="pt")
        alone = target.generate(**single, **options)[0, single.input_ids.shape[1] :]
        assert int(alone[-1]) == EOS
        assert torch.equal(out[row, width : width + alone.shape[0]], alone)


# --- 3. drafts the drafter itself gave probability 0 ------------------------------------------------
def test_a_draft_with_probability_zero_under_proposal_and_target_is_never_accepted():
    target_probs = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])  # [k + 1, V]
    draft_probs = torch.tensor([[0.5, 0.5, 0.0]])  # [k, V]: the draft (id 2) has q = 0
    for seed in range(200):
        generator = torch.Generator().manual_seed(seed)
        num_accepted, next_token = speculative_decision(torch.tensor([2]), draft_probs, target_probs, generator).tolist()
        assert num_accepted == 0 and next_token != 2


class ZeroProbabilityDrafter(Drafter):
    """Proposes token 5 but reports probability 0 for it (a buggy custom drafter)."""

    def propose(self, sequence, max_new_tokens):
        if max_new_tokens < 1:
            return sequence[0, :0], None
        log_probs = torch.full((1, 96), -torch.log(torch.tensor(95.0)).item())
        log_probs[0, 5] = -float("inf")
        return torch.tensor([5]), log_probs


class UnnormalizedDrafter(Drafter):
    def propose(self, sequence, max_new_tokens):
        if max_new_tokens < 1:
            return sequence[0, :0], None
        return torch.tensor([5]), torch.zeros(1, 96)  # exp sums to 96, not 1


@pytest.mark.parametrize(
    "drafter, message",
    [(ZeroProbabilityDrafter(), "probability 0 for the token"), (UnnormalizedDrafter(), "sum to 1")],
)
def test_a_drafter_that_misreports_its_proposal_is_a_clear_error(target_and_copy, drafter, message):
    target, _ = target_and_copy
    with pytest.raises(ValueError, match=f"{type(drafter).__name__}.*{message}"):
        target.generate(
            prompt(4), custom_generate=hp.generate, assistant_models=[drafter], do_sample=True, max_new_tokens=4
        )


# --- 4. vocabularies --------------------------------------------------------------------------------
def test_an_assistant_that_cannot_represent_the_targets_tokens_is_refused_by_name():
    target = make_target("llama", seed=4, vocab=96)
    small = make_target("qwen2", seed=5, vocab=50)
    with pytest.raises(ValueError, match=r"assistant_models\[0\] Qwen2ForCausalLM.*50 token ids.*LlamaForCausalLM.*96"):
        target.generate(prompt(4, vocab=50), custom_generate=hp.generate, assistant_models=[small], max_new_tokens=4)


def test_a_token_beyond_a_slightly_smaller_assistant_is_a_clear_error_not_an_index_error():
    """Within the padding tolerance (1% here: 199 of 200 ids) the check happens when the target
    emits an id the assistant lacks."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class ForceLastId(LogitsProcessor):
        def __call__(self, input_ids, scores):
            forced = torch.full_like(scores, -float("inf"))
            forced[:, 199] = 0
            return forced

    target = make_target("llama", seed=6, vocab=200)
    assistant = make_target("llama", seed=7, vocab=199)
    with pytest.raises(ValueError, match=r"token id 199.*assistant_models\[0\].*199 token ids"):
        target.generate(
            prompt(4), custom_generate=hp.generate, assistant_models=[assistant], do_sample=False, max_new_tokens=4,
            logits_processor=LogitsProcessorList([ForceLastId()]), polybasic_config=hp.PolybasicConfig(schedule="constant"),
        )


def test_a_tokenizer_longer_than_an_assistants_vocabulary_is_refused():
    """Without a tokenizer, 198 of the target's 200 rows pass as padding; the tokenizer says 199
    ids are real, and the assistant lacks one of them."""
    target = make_target("llama", seed=4, vocab=200)
    assistant = make_target("llama", seed=8, vocab=198)
    hp.enable(target)
    try:
        with pytest.raises(ValueError, match=r"tokenizer has 199 ids but assistant_models\[0\].*198"):
            target.generate(
                prompt(4), assistant_models=[assistant], tokenizer=make_tokenizer(vocab=199), max_new_tokens=4
            )
    finally:
        hp.disable(target)


def test_models_that_never_agree_are_reported_not_silently_slow():
    """Two tokenizers of the same size (here: the assistant's ids permuted) pass every size check;
    the acceptance collapses, and the call warns instead of being silently slow."""
    target = make_target("llama", seed=12)
    permuted = noisy_copy(target, 0.0, seed=1)
    order = torch.randperm(96, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        permuted.lm_head.weight.copy_(permuted.lm_head.weight[order])
        permuted.model.embed_tokens.weight.copy_(permuted.model.embed_tokens.weight[order])
    ids = prompt(6, seed=2)
    options = dict(do_sample=False, max_new_tokens=40, eos_token_id=None)
    with pytest.warns(UserWarning, match=r"accepted .* of .* drafts.*share a tokenizer"):
        out = target.generate(ids, custom_generate=hp.generate, assistant_models=[permuted],
                              polybasic_config=hp.PolybasicConfig(schedule="constant"), **options)
    assert torch.equal(out, target.generate(ids, **options))
    # the cost-aware schedule, where drafting would pay if drafts were accepted: it keeps drafting a
    # token a round (a rejected draft this cheap costs 2% of a round) and warns all the same
    with simulated_machine(cheap_drafting_costs(target, [permuted])) as generate:
        with pytest.warns(UserWarning, match=r"accepted 0 of .* drafts.*share a tokenizer"):
            out = target.generate(ids, custom_generate=generate, assistant_models=[permuted], **options)
    assert torch.equal(out, target.generate(ids, **options))


# --- 5. pad fallback ----------------------------------------------------------------------------------
def test_pad_falls_back_to_the_first_eos_id_as_in_transformers():
    assert pad_token_id(GenerationConfig(eos_token_id=[7, 2])) == 7


@pytest.mark.parametrize("kind, hint", [("model", "share a tokenizer"), ("translated", "tokenizer of its own"),
                                        ("head", "trained for another model"), ("drafter", None)])
def test_a_level_that_rarely_agrees_is_warned_about_with_its_kinds_hint(kind, hint):
    """A level the one above accepted almost none of: the warning's hint fits what the level is (a
    translated level or a head is no tokenizer mix-up); a Drafter, which proposes only where it finds
    something to copy, is never warned about."""
    import warnings

    from hf_polybasic.stats import LevelStats, PolybasicStats
    from hf_polybasic.vocabulary import warn_if_levels_disagree

    stats = PolybasicStats(levels=[LevelStats("M1 target", "target", drafted=40, accepted=0, verifications=10),
                                   LevelStats("M2 below", "drafter")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warned = warn_if_levels_disagree(stats, ["model", kind])
    assert warned == (hint is not None)
    assert [hint in str(w.message) for w in caught] == ([True] if hint else [])
    stats.levels[0].accepted = 1  # 2.5%: above the bar
    assert not warn_if_levels_disagree(stats, ["model", kind])



def test_each_level_is_warned_about_as_what_it_is(shared_models):
    """The kinds `warn_if_levels_disagree` is given: an n-gram lookup (never warned about: it proposes only
    where it finds something to copy), another tokenizer's model, a head, a plain model."""
    from hf_polybasic.decoding.loop import _level_kind
    from helpers import make_head
    from hf_polybasic.runners.head import HeadModel

    target = shared_models.target("qwen2", seed=4)
    tokenizer = make_tokenizer()
    assert _level_kind(hp.drafters.PromptLookup()) == "drafter"
    assert _level_kind(hp.levels.translated(noisy_copy(target, 0.1, seed=1), tokenizer, tokenizer)) == "translated"
    assert _level_kind(HeadModel(make_head(target), "random")) == "head"
    assert _level_kind(target) == "model"
