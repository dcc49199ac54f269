"""Level builders and drafters: exact in 2-, 3- and 4-level chains, greedy and sampled."""

import pytest
import torch
from helpers import ALPHA, assert_every_level_took_part, chi_square_p_value, sample_counts

import hf_polybasic as hp
from hf_polybasic.drafters import Drafter, PromptLookup
from hf_polybasic.levels import early_exit, quantized_copy
from hf_polybasic.testing import make_target, noisy_copy, prompt


@pytest.fixture
def four_layer_target(shared_models):
    return shared_models.target("llama", seed=41, layers=4)


def chain_for(target, kind: str, depth: int):
    """assistant_models of a `depth`-model chain below ``target`` that uses the level `kind`
    (strongest first)."""
    lookup = PromptLookup(max_ngram=3, num_tokens=5)
    noisy = noisy_copy(target, 0.2, seed=1)
    if kind == "prompt_lookup":
        return [[lookup], [noisy, lookup], [quantized_copy(target, "bf16"), noisy, lookup]][depth - 2]
    if kind == "early_exit":
        return [early_exit(target, layers) for layers in range(depth - 1, 0, -1)]
    if kind in ("bf16", "int8-dynamic"):
        copy = quantized_copy(target, kind)
        return [[copy], [copy, noisy], [copy, noisy, lookup]][depth - 2]
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["prompt_lookup", "early_exit", "bf16", "int8-dynamic"])
@pytest.mark.parametrize("depth", [2, 3, 4])
def test_greedy_equality_with_each_level(kind, depth, four_layer_target):
    target = four_layer_target
    assistants = chain_for(target, kind, depth)
    for seed in range(3):
        ids = prompt(6, seed=seed)
        options = dict(do_sample=False, max_new_tokens=40, eos_token_id=None)
        reference = target.generate(ids, **options)
        out = target.generate(
            ids,
            custom_generate=hp.generate,
            assistant_models=assistants,
            polybasic_config=hp.PolybasicConfig(num_draft_tokens=3, block_threshold=4, schedule="constant"),
            return_dict_in_generate=True,
            **options,
        )
        assert torch.equal(out.sequences, reference)
        assert_every_level_took_part(out.polybasic_stats, rejections=False, acceptances=False)
    if kind == "prompt_lookup":  # the random target repeats itself, so lookups do get accepted
        assert out.polybasic_stats.levels[-2].accepted > 0


class UniformDrafter(Drafter):
    """A stochastic custom drafter: each token uniform over the vocabulary, reported honestly."""

    def __init__(self, vocab: int, num_tokens: int = 2, lie: bool = False):
        self.vocab, self.num_tokens, self.lie = vocab, num_tokens, lie

    def propose(self, sequence, max_new_tokens):
        k = min(self.num_tokens, max_new_tokens)
        uniform = torch.full((k, self.vocab), 1.0 / self.vocab)
        if self.lie:  # draws from a peaked distribution but claims uniform: must be caught
            peaked = torch.full((k, self.vocab), 0.02)
            peaked[:, 1] = 1.0
            tokens = torch.multinomial(peaked, 1).squeeze(-1)
        else:
            tokens = torch.multinomial(uniform, 1).squeeze(-1)
        return tokens, uniform.log()


SETTING = "temperature+top_k+top_p"


@pytest.mark.parametrize(
    "name, assistants",
    [
        ("prompt lookup, 2 models", lambda m: [PromptLookup(max_ngram=2, num_tokens=3)]),
        ("prompt lookup, 3 models", lambda m: [m[1], PromptLookup(max_ngram=2, num_tokens=3)]),
        ("early exit + int8 copy, 4 models", lambda m: [
            quantized_copy(m[0], "int8-dynamic"), early_exit(m[0], 1), PromptLookup(num_tokens=2)
        ]),
        ("custom stochastic drafter, 3 models", lambda m: [m[1], UniformDrafter(8)]),
    ],
)
def test_sampling_with_each_level_is_the_target_distribution(name, assistants, exact_distribution, distribution_models):
    counts, stats = sample_counts(distribution_models[0], SETTING, assistants(distribution_models), seed=7,
                                  num_draft_tokens=2, block_threshold=2, schedule="constant")
    assert_every_level_took_part(stats, rejections=not name.startswith("prompt lookup, 2"))
    assert chi_square_p_value(counts, exact_distribution(SETTING)) > ALPHA


def test_negative_control_a_drafter_that_misreports_its_distribution_is_caught(exact_distribution, distribution_models):
    counts, stats = sample_counts(distribution_models[0], SETTING, [UniformDrafter(8, lie=True)], seed=7,
                                  num_draft_tokens=2, schedule="constant")
    assert_every_level_took_part(stats)
    assert chi_square_p_value(counts, exact_distribution(SETTING)) < ALPHA


def _target_and_exact_copies():
    target = make_target("llama", seed=5, logit_scale=1.0)  # near-uniform: an argmax draft is rarely sampled
    return target, noisy_copy(target, 0.0, 1), noisy_copy(target, 0.0, 2)


@pytest.mark.parametrize("depth, verification", [(2, "greedy"), (3, "auto"), (3, "greedy")])
def test_a_drafter_drafts_as_the_level_verifying_it_verifies(depth, verification, shared_models):
    """A model drafter samples its drafts under a level that verifies by sampling (the target always
    does; a middle level under ``verification="auto"``) and drafts by argmax under a middle level that
    verifies greedily: a sampled draft would only lower a greedy level's acceptance, and an argmax one
    a sampling level's. With the drafter an exact copy of the level above it, drafting that way has
    every draft accepted; the other way (near-uniform distributions at temperature 1.5) almost none."""
    target, *copies = shared_models.built(("exact copies", "llama"), _target_and_exact_copies)
    torch.manual_seed(0)
    out = target.generate(prompt(6, seed=3), custom_generate=hp.generate, assistant_models=copies[: depth - 1],
                          do_sample=True, temperature=1.5, max_new_tokens=30, eos_token_id=None,
                          return_dict_in_generate=True, polybasic_config=hp.PolybasicConfig(
                              num_draft_tokens=3, block_threshold=4, schedule="constant", verification=verification))
    above_drafter = out.polybasic_stats.levels[depth - 2]
    assert above_drafter.drafted >= 10 and above_drafter.accepted == above_drafter.drafted


# --- the pieces -----------------------------------------------------------------------------------
def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    lookup = PromptLookup(max_ngram=3, num_tokens=2)
    sequence = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 6, 7]])
    # "6 7" occurs at 1 and 6 ("5 6 7" would need a 5 before the final "6 7"): latest is 6 -> 1, 2
    tokens, log_probs = lookup.propose(sequence, max_new_tokens=8)
    assert tokens.tolist() == [1, 2] and log_probs is None
    assert lookup.propose(sequence, max_new_tokens=1)[0].tolist() == [1]
    assert lookup.propose(torch.tensor([[1, 2, 3]]), max_new_tokens=4)[0].numel() == 0
    assert lookup.propose(sequence, max_new_tokens=0)[0].numel() == 0


@pytest.mark.parametrize("kwargs", [dict(max_ngram=0), dict(num_tokens=-1), dict(min_ngram=4, max_ngram=3)])
def test_prompt_lookup_validates_its_settings(kwargs):
    with pytest.raises(ValueError, match="PromptLookup"):
        PromptLookup(**kwargs)


def test_early_exit_shares_weights_and_leaves_the_model_alone(four_layer_target):
    target = four_layer_target
    short = early_exit(target, 2)
    assert short.config.num_hidden_layers == 2 and target.config.num_hidden_layers == 4
    assert len(short.model.layers) == 2 and len(target.model.layers) == 4
    assert short.model.layers[1] is target.model.layers[1]
    assert short.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    with pytest.raises(ValueError, match="num_layers"):
        early_exit(target, 4)


def test_hooks_on_the_target_do_not_fire_for_its_early_exit_and_back():
    """A forward counter on the target (the benchmark has one) must not count the view's forwards."""
    target = make_target("llama", seed=42, layers=4)
    short = early_exit(target, 2)
    calls = []
    handles = [target.register_forward_pre_hook(lambda m, a: calls.append("target")),
               short.register_forward_pre_hook(lambda m, a: calls.append("view"))]
    short(prompt(3))
    target(prompt(3))
    for handle in handles:
        handle.remove()
    assert calls == ["view", "target"]


def test_early_exit_of_a_sliding_window_model_is_exact():
    target = make_target("gemma3", seed=5, layers=4)
    ids = prompt(5, seed=2)
    options = dict(do_sample=False, max_new_tokens=30, eos_token_id=None)
    out = target.generate(
        ids, custom_generate=hp.generate, assistant_models=[early_exit(target, 2), early_exit(target, 1)], **options
    )
    assert torch.equal(out, target.generate(ids, **options))


def test_quantized_copy_shares_nothing_mutable(four_layer_target):
    target = four_layer_target
    for method in ("bf16", "fp16", "int8-dynamic"):
        copy = quantized_copy(target, method)
        target_storages = {p.data_ptr() for p in target.parameters()}
        assert not target_storages & {p.data_ptr() for p in copy.parameters()}
    assert next(quantized_copy(target, "bf16").parameters()).dtype == torch.bfloat16
    assert next(target.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="unknown method"):
        quantized_copy(target, "int3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["int8-dynamic", "bf16", "fp16"])
def test_a_copy_of_a_tied_model_is_independent_of_it_both_ways(method, dtype):
    """Qwen2.5 ties lm_head to embed_tokens. A copy must not share the tied tensor: building it
    leaves the target's dtypes alone, and casting the target afterwards leaves the copy working."""
    target = make_target("qwen2", seed=21, tied=True).to(dtype)
    assert target.lm_head.weight is target.model.embed_tokens.weight
    ids = prompt(5, seed=1)
    before = target(ids).logits
    copy = quantized_copy(target, method)
    assert {p.dtype for p in target.parameters()} == {dtype}  # the target is as it was
    assert torch.equal(target(ids).logits, before)
    target_tensors = {id(t) for t in [*target.parameters(), *target.buffers()]}
    assert not target_tensors & {id(t) for t in [*copy.parameters(), *copy.buffers()]}
    expected = copy(ids).logits
    target.to(torch.float16 if dtype == torch.bfloat16 else torch.bfloat16)  # the other order: change the target
    with torch.no_grad():
        for parameter in target.parameters():
            parameter.zero_()
    assert torch.equal(copy(ids).logits, expected)


def test_drafter_must_be_last_and_must_return_valid_proposals(four_layer_target):
    target = four_layer_target
    ids = prompt(4)
    with pytest.raises(ValueError, match="must come last"):
        target.generate(ids, custom_generate=hp.generate, assistant_models=[PromptLookup(), noisy_copy(target, 0.1, 2)])

    class Broken(Drafter):
        def __init__(self, result):
            self.result = result

        def propose(self, sequence, max_new_tokens):
            return self.result

    for result, error, message in [
        (([1, 2], None), TypeError, "1-D LongTensor"),
        ((torch.arange(50), None), ValueError, "max_new_tokens"),
        ((torch.tensor([1, 2]), torch.zeros(3, 96)), ValueError, "shape"),
    ]:
        with pytest.raises(error, match=message):
            target.generate(ids, custom_generate=hp.generate, assistant_models=[Broken(result)], max_new_tokens=5)
