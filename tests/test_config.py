"""`PolybasicConfig`: validated on construction, serialisable, stored in a GenerationConfig."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import GenerationConfig

import hf_polybasic as hp


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_draft_tokens=0), "num_draft_tokens"),
        (dict(num_draft_tokens=2.5), "num_draft_tokens"),
        (dict(num_draft_tokens=True), "num_draft_tokens"),
        (dict(block_threshold=0), "block_threshold"),
        (dict(block_threshold=()), "empty"),
        (dict(block_threshold=(3, -1)), "block_threshold"),
        (dict(verification="typical"), "verification"),
    ],
)
def test_impossible_values_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hp.PolybasicConfig(**kwargs)


def test_defaults_work_and_lists_become_tuples():
    assert hp.PolybasicConfig().thresholds_for(2) == (8, 8)
    assert hp.PolybasicConfig(block_threshold=[3, 4]).block_threshold == (3, 4)
    assert hp.PolybasicConfig().thresholds_for(0) == ()


@given(
    k=st.integers(1, 64),
    mu=st.one_of(st.integers(1, 64), st.lists(st.integers(1, 64), min_size=1, max_size=4)),
    verification=st.sampled_from(["auto", "greedy"]),
)
def test_json_round_trip(k, mu, verification):
    config = hp.PolybasicConfig(num_draft_tokens=k, block_threshold=mu, verification=verification)
    assert hp.PolybasicConfig.from_json(config.to_json()) == config
    assert hp.PolybasicConfig.from_dict(config.to_dict()) == config


def test_unknown_fields_are_an_error():
    with pytest.raises(ValueError, match="no field"):
        hp.PolybasicConfig.from_dict({"num_draft_tokens": 3, "mu": 2})


def test_generation_config_round_trip(tmp_path):
    generation_config = GenerationConfig(do_sample=True)
    assert hp.PolybasicConfig.from_generation_config(generation_config) is None
    config = hp.PolybasicConfig(num_draft_tokens=6, block_threshold=(10, 5))
    config.save_to(generation_config)
    generation_config.save_pretrained(tmp_path)
    assert hp.PolybasicConfig.from_generation_config(GenerationConfig.from_pretrained(tmp_path)) == config


def test_generation_config_with_garbage_is_a_type_error():
    generation_config = GenerationConfig()
    generation_config.polybasic_config = "fast please"
    with pytest.raises(TypeError, match="polybasic_config"):
        hp.PolybasicConfig.from_generation_config(generation_config)


def test_prompt_lookup_puts_a_free_level_below_the_bottom_model(shared_models):
    import torch

    import hf_polybasic as hp
    from hf_polybasic.drafters import AddedPromptLookup, PromptLookup
    from hf_polybasic.request import with_prompt_lookup
    from hf_polybasic.testing import prompt

    target, draft = shared_models.chain("llama", 2, seed=5)
    ids = prompt(6, seed=1)
    options = dict(do_sample=False, max_new_tokens=30, eos_token_id=None)
    reference = target.generate(ids, **options)
    for config, levels in ((hp.PolybasicConfig(prompt_lookup=True), 3), (hp.PolybasicConfig(), 2)):
        out = target.generate(ids, custom_generate=hp.generate, assistant_models=[draft], polybasic_config=config,
                              return_dict_in_generate=True, **options)
        assert torch.equal(out.sequences, reference)
        assert len(out.polybasic_stats.levels) == levels
    assert out.polybasic_stats.levels[-1].role == "drafter"
    added = with_prompt_lookup([draft], hp.PolybasicConfig(prompt_lookup=True))[-1]
    # it copies only after a 3-token match: after shorter ones it was mostly wrong (`ADDED_LOOKUP_NGRAM`)
    assert isinstance(added, AddedPromptLookup) and (added.min_ngram, added.max_ngram) == (3, 3)
    assert added.propose(torch.tensor([[5, 6, 7, 8, 9, 1, 6, 7]]), 4)[0].numel() == 0
    assert added.propose(torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7]]), 4)[0].tolist() == [8, 9, 5, 6]
    with_lookup = hp.PolybasicConfig(prompt_lookup=True, block_threshold=(4, 4), schedule="constant")
    out = target.generate(ids, custom_generate=hp.generate, assistant_models=[draft, draft, PromptLookup()],
                          polybasic_config=with_lookup, return_dict_in_generate=True, **options)
    assert len(out.polybasic_stats.levels) == 4  # the caller's lookup is the bottom: nothing added
    with pytest.raises(ValueError, match="prompt_lookup must be True or False"):
        hp.PolybasicConfig(prompt_lookup=None)
