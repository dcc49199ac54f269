"""The drafter's alternatives, scored by the target beside its drafts (`hf_polybasic.decoding.alternatives`):
the branch forward against separate forwards, greedy output against plain `generate`, with a negative
control, the policy's arithmetic, and the refusals."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers import assert_every_level_took_part

import hf_polybasic as hp
from hf_polybasic.compat import new_dynamic_cache
from hf_polybasic.decoding import alternatives as alt
from hf_polybasic.decoding.build import ChainParts
from hf_polybasic.decoding.protocol import Block
from hf_polybasic.decoding.round import ModelDrafter, Verifier
from hf_polybasic.generation import make_generate
from hf_polybasic.runners import branches
from hf_polybasic.runners.dynamic import CachedModel
from hf_polybasic.testing import EOS, VOCAB, cheap_drafting_costs, make_target, noisy_copy, prompt, simulated_machine

ARCHITECTURES = ["llama", "qwen2"]


def _one_forward_logits(model, ids: torch.LongTensor) -> torch.Tensor:
    """The model's logits after ``ids`` ``[L]``, from a forward of that sequence alone: ``[V]``."""
    with torch.no_grad():
        return model(input_ids=ids.unsqueeze(0)).logits[0, -1].float()


@pytest.mark.parametrize("arch", ARCHITECTURES)
@given(past=st.integers(1, 9), before=st.integers(0, 3), drafts=st.integers(1, 5), per_draft=st.integers(1, 3),
       seed=st.integers(0, 1000))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_each_branch_scores_as_a_forward_of_its_own_sequence(arch, past, before, drafts, per_draft, seed, shared_models):
    """With ``past`` tokens cached and ``before`` more fed ahead of the drafts, the logits after every
    alternative equal those of a forward of the text, the drafts before it and the alternative alone;
    the drafts' logits equal `logits`'; the cache ends holding exactly the sequence."""
    model = shared_models.target(arch, seed=5)
    generator = torch.Generator().manual_seed(seed)
    sequence = torch.randint(0, VOCAB, (past + before + drafts,), generator=generator)
    offered = torch.randint(0, VOCAB, (drafts, per_draft), generator=generator)
    runner = CachedModel(model, new_dynamic_cache(model), role="target")
    runner.logits(sequence[:past], 1)
    logits, branched = runner.logits_with_alternatives(sequence, drafts, offered)
    assert runner.length == sequence.shape[0] and runner.cache.get_seq_length() == sequence.shape[0]
    start = sequence.shape[0] - drafts
    for j in range(drafts + 1):
        expected = _one_forward_logits(model, sequence[: start + j])
        torch.testing.assert_close(logits[j], expected, atol=1e-4, rtol=1e-4)
    for j in range(drafts):
        for i in range(per_draft):
            text = torch.cat([sequence[: start + j], offered[j, i : i + 1]])
            torch.testing.assert_close(branched[j, i], _one_forward_logits(model, text), atol=1e-4, rtol=1e-4)
    # the cache goes on as if the alternatives had never been fed
    after = torch.cat([sequence, torch.tensor([3])])
    torch.testing.assert_close(runner.logits(after, 1)[0], _one_forward_logits(model, after), atol=1e-4, rtol=1e-4)


def test_branch_mask_lets_each_alternative_see_what_its_draft_would():
    """past 2, fed 3 (the last 2 drafts), 2 alternatives per draft: rows of the mask, 1 where seen."""
    mask = branches.branch_mask(2, 3, 2, 2, torch.float32, torch.device("cpu"))[0, 0] == 0
    seen = [[int(value) for value in row] for row in mask]
    assert seen == [
        [1, 1, 1, 0, 0, 0, 0, 0, 0],  # the fed token before the drafts
        [1, 1, 1, 1, 0, 0, 0, 0, 0],  # draft 0
        [1, 1, 1, 1, 1, 0, 0, 0, 0],  # draft 1
        [1, 1, 1, 0, 0, 1, 0, 0, 0],  # alternatives of draft 0: the slots before it, and itself
        [1, 1, 1, 0, 0, 0, 1, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 1, 0],  # alternatives of draft 1: draft 0 too
        [1, 1, 1, 1, 0, 0, 0, 0, 1],
    ]


def _chain(arch: str):
    target = make_target(arch, seed=3)
    return target, noisy_copy(target, 0.8, 1)  # a drafter that misses often, its 2nd choices often right


OPTIONS = st.sampled_from([{}, {"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2, "min_new_tokens": 10}])


@pytest.mark.parametrize("arch", ARCHITECTURES)
@given(prompt_length=st.integers(1, 10), budget=st.integers(1, 30), eos_step=st.one_of(st.none(), st.integers(0, 29)),
       seed=st.integers(0, 1000), per_draft=st.integers(1, 4), k=st.integers(1, 6), options=OPTIONS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_greedy_with_alternatives_equals_plain_generate(arch, prompt_length, budget, eos_step, seed, per_draft, k,
                                                        options, alternatives_chains):
    target, draft = alternatives_chains(arch)
    ids = prompt(prompt_length, seed=seed)
    reference = target.generate(ids, do_sample=False, max_new_tokens=budget, eos_token_id=EOS, **options)
    eos = [EOS]
    if eos_step is not None and eos_step < reference.shape[1] - ids.shape[1]:
        eos = [int(reference[0, ids.shape[1] + eos_step]), EOS]
        reference = target.generate(ids, do_sample=False, max_new_tokens=budget, eos_token_id=eos, **options)
    out = target.generate(ids, do_sample=False, max_new_tokens=budget, eos_token_id=eos, **options,
                          custom_generate=hp.generate, assistant_models=[draft], return_dict_in_generate=True,
                          polybasic_config=hp.PolybasicConfig(num_draft_tokens=k, schedule="constant",
                                                              draft_alternatives=per_draft))
    assert torch.equal(out.sequences, reference)
    level = out.polybasic_stats.levels[0]
    assert level.alternative_hits <= level.alternative_rounds <= level.verifications


@pytest.fixture(scope="module")
def alternatives_chains():
    made = {}
    return lambda arch: made.setdefault(arch, _chain(arch))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_alternatives_emit_more_tokens_per_round(arch, alternatives_chains):
    """Over a few prompts the rounds that caught the target's token among the alternatives emit one
    token more each: fewer target forwards for the same (plain generate's) output."""
    target, draft = alternatives_chains(arch)
    forwards = {}
    for count in (0, 3):
        forwards[count], hits = 0, 0
        for seed in range(4):
            ids = prompt(4, seed=seed)
            out = target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=EOS,
                                  custom_generate=hp.generate, assistant_models=[draft], return_dict_in_generate=True,
                                  polybasic_config=hp.PolybasicConfig(schedule="constant", draft_alternatives=count))
            assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=EOS))
            level = out.polybasic_stats.levels[0]
            forwards[count] += level.verifications
            hits += level.alternative_hits
            assert_every_level_took_part(out.polybasic_stats, acceptances=False)
        assert (hits > 0) == (count > 0)
    assert forwards[3] < forwards[0]


def test_scores_and_logits_of_a_round_that_hit_are_plain_generates(alternatives_chains):
    """The token after a hit comes with the scores and logits it was chosen from, as plain generate reports them."""
    target, draft = alternatives_chains("qwen2")
    ids = prompt(4, seed=2)
    options = dict(do_sample=False, max_new_tokens=24, eos_token_id=EOS, return_dict_in_generate=True,
                   output_scores=True, output_logits=True, repetition_penalty=1.2)
    reference = target.generate(ids, **options)
    out = target.generate(ids, **options, custom_generate=hp.generate, assistant_models=[draft],
                          polybasic_config=hp.PolybasicConfig(schedule="constant", draft_alternatives=3))
    assert out.polybasic_stats.levels[0].alternative_hits > 0
    assert torch.equal(out.sequences, reference.sequences)
    for name in ("scores", "logits"):
        torch.testing.assert_close(torch.stack(getattr(out, name)), torch.stack(getattr(reference, name)),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 3])  # (seed 2's text repeats one token)
def test_an_eos_among_the_alternatives_ends_the_text_there(seed, alternatives_chains):
    """With every other token offered beside each draft, every rejected draft is caught: where the
    target's token there is an EOS, the round ends with it (nothing after an EOS)."""
    target, draft = alternatives_chains("llama")
    ids = prompt(4, seed=seed)
    plain = target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None)
    hits = 0
    for step in range(2, 24, 3):
        eos = int(plain[0, ids.shape[1] + step])
        reference = target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=eos)
        out = target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=eos, custom_generate=hp.generate,
                              assistant_models=[draft], return_dict_in_generate=True,
                              polybasic_config=hp.PolybasicConfig(schedule="constant", draft_alternatives=VOCAB - 1))
        assert torch.equal(out.sequences, reference), step
        hits += out.polybasic_stats.levels[0].alternative_hits
    assert hits > 0


class _Recording(Verifier):
    made: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.made.append(self)


class _RecordingDrafter(ModelDrafter):
    made: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.made.append(self)


def test_the_policy_learns_from_every_round_that_offered_them(alternatives_chains):
    target, draft = alternatives_chains("qwen2")
    _Recording.made.clear()
    costs = {**cheap_drafting_costs(target, [draft]), target: lambda tokens: 0.010}
    with simulated_machine(costs, parts=ChainParts(verifier=_Recording)) as simulated:
        out = target.generate(prompt(4, seed=3), do_sample=False, max_new_tokens=30, eos_token_id=EOS,
                              custom_generate=simulated, assistant_models=[draft], return_dict_in_generate=True)
    policy, level = _Recording.made[-1].alternatives, out.polybasic_stats.levels[0]
    assert level.alternative_hits > 0
    # every round's tokens, a hit's one more included: the streamer's bursts (examples/streaming.py)
    assert sum(level.acceptance_lengths) == out.polybasic_stats.new_tokens
    assert level.mean_acceptance_length == pytest.approx(level.verifications and sum(level.acceptance_lengths)
                                                         / level.verifications)
    assert (policy.rounds, policy.hits) == (level.alternative_rounds, level.alternative_hits)


def test_unpriced_auto_leaves_the_drafter_alone(alternatives_chains):
    """Under a schedule that measures no costs, ``"auto"`` offers nothing, and the drafter ranks nothing."""
    target, draft = alternatives_chains("llama")
    _RecordingDrafter.made.clear()
    generate = make_generate(ChainParts(model_drafter=_RecordingDrafter))
    out = target.generate(prompt(4), do_sample=False, max_new_tokens=10, custom_generate=generate,
                          assistant_models=[draft], return_dict_in_generate=True,
                          polybasic_config=hp.PolybasicConfig(schedule="constant"))
    assert out.polybasic_stats.levels[0].alternative_rounds == 0
    assert _RecordingDrafter.made[-1].alternatives == 0


def test_a_count_is_refused_where_reads_wait_for_the_device(drafts_read_with_the_decision, alternatives_chains):
    target, draft = alternatives_chains("llama")
    with pytest.raises(ValueError, match="draft_alternatives=2: .*the CPU"):
        target.generate(prompt(4), do_sample=False, max_new_tokens=5, custom_generate=hp.generate,
                        assistant_models=[draft], polybasic_config=hp.PolybasicConfig(draft_alternatives=2))


class _WrongMask:
    """A negative control: the alternatives see every draft (a plain causal mask over the branch)."""

    def __init__(self, monkeypatch):
        def causal(past, fed, drafts, per_draft, dtype, device):
            total = past + fed + drafts * per_draft
            rows = torch.arange(fed + drafts * per_draft).unsqueeze(1) + past
            mask = torch.where(torch.arange(total).unsqueeze(0) <= rows, 0.0, torch.finfo(dtype).min).to(dtype)
            return mask.view(1, 1, fed + drafts * per_draft, total)

        monkeypatch.setattr("hf_polybasic.runners.branches.branch_mask", causal)


def test_the_equality_test_fails_when_alternatives_see_the_drafts_after_them(monkeypatch, alternatives_chains):
    target, draft = alternatives_chains("llama")
    _WrongMask(monkeypatch)
    differ = 0
    for seed in range(6):
        ids = prompt(4, seed=seed)
        reference = target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=EOS)
        out = target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=EOS, custom_generate=hp.generate,
                              assistant_models=[draft],
                              polybasic_config=hp.PolybasicConfig(schedule="constant", draft_alternatives=3))
        differ += not torch.equal(out, reference)
    assert differ


def test_auto_offers_them_where_the_targets_cost_is_flat_and_not_where_it_is_steep(alternatives_chains):
    target, draft = alternatives_chains("llama")
    ids = prompt(4, seed=1)
    reference = target.generate(ids, do_sample=False, max_new_tokens=30, eos_token_id=EOS)
    rounds = {}
    for name, cost in {"flat": lambda tokens: 0.010, "steep": lambda tokens: 0.010 * tokens}.items():
        costs = {**cheap_drafting_costs(target, [draft]), target: cost}
        with simulated_machine(costs) as simulated:
            out = target.generate(ids, do_sample=False, max_new_tokens=30, eos_token_id=EOS, custom_generate=simulated,
                                  assistant_models=[draft], return_dict_in_generate=True)
        assert torch.equal(out.sequences, reference)
        rounds[name] = out.polybasic_stats.levels[0].alternative_rounds
    assert rounds["flat"] > 0 and rounds["steep"] == 0


def test_hit_finds_the_targets_token_among_the_alternatives_of_the_rejected_draft():
    offered = [[5, 6], [7, 8]]
    assert alt.hit(0, 6, offered) == 1
    assert alt.hit(1, 7, offered) == 0
    assert alt.hit(1, 5, offered) is None  # offered at another position
    assert alt.hit(2, 5, offered) is None  # every draft kept: the target's token was no rejection


def test_next_best_leaves_out_the_drawn_token():
    scores = torch.tensor([[0.1, 3.0, 2.0, -1.0, 2.5]])
    assert alt.next_best(scores, torch.tensor([1]), 2).tolist() == [4, 2]
    assert alt.next_best(scores, torch.tensor([2]), 9).tolist() == [1, 4, 0, 3]


@pytest.mark.parametrize("seconds, expected", [
    (lambda tokens: 1.0, True),  # flat: free tokens
    (lambda tokens: 1.0 + 0.01 * tokens, True),  # 1.09 / 1.03 = 1.058 < (2 + 0.2) / 2 = 1.1
    (lambda tokens: 1.0 + 0.02 * tokens, False),  # 1.18 / 1.06 = 1.113 > 1.1
    (lambda tokens: float(tokens), False),
])
def test_alternatives_pay_where_the_wider_forward_costs_less_than_the_tokens_they_add(seconds, expected):
    assert alt.alternatives_pay(seconds, 3, 6, 2.0, 0.2) is expected
    assert not alt.alternatives_pay(lambda tokens: 1.0, 3, 6, 2.0, 0.0)  # free, but they never hit: no


def test_the_policy_offers_none_unpriced_and_learns_its_hit_rate():
    assert alt.AlternativesPolicy(3, auto=True, seconds=None).per_draft(4, 5, 2.0) == 0
    assert alt.AlternativesPolicy(2, auto=False, seconds=None).per_draft(4, 5, 2.0) == 2
    assert alt.AlternativesPolicy(2, auto=False, seconds=None).per_draft(0, 1, 2.0) == 0
    policy = alt.AlternativesPolicy(3, auto=True, seconds=lambda tokens: 1.0 + 0.004 * tokens)
    assert policy.per_draft(3, 4, 2.0) == 3  # prior 1/3 hits a round: 1.052 < 1.167
    for _ in range(30):
        policy.observe(False)
    assert policy.per_draft(3, 4, 2.0) == 0  # 1 / 33 a round: 1.052 > 1.015
    assert (policy.rounds, policy.hits) == (30, 0)
    steep = alt.AlternativesPolicy(3, auto=True, seconds=lambda tokens: 1.0 + 0.021 * tokens)
    assert steep.per_draft(3, 4, 2.0) == 0  # 1.273 / 1.084 = 1.174 > (2 + 1/3) / 2
    for _ in range(10):
        steep.observe(True)
    assert steep.per_draft(3, 4, 2.0) == 3  # 11 / 13 a round


def test_tokens_per_round_start_from_the_prior():
    assert alt.tokens_per_round(0, 0) == alt.PRIOR_TOKENS_PER_ROUND
    assert alt.tokens_per_round(9, 3) == 3.0


def test_a_block_keeps_the_alternatives_of_the_tokens_it_keeps():
    block = Block(frozenset({9}), budget=3)
    block.extend(torch.tensor([1, 2, 3, 4]), ids=[1, 2, 3, 4], alternatives=[[5], [6], [7], [8]])
    assert block.proposal().alternatives == [[5], [6], [7]]  # cut at the budget
    block.truncate(2)
    assert block.proposal().alternatives == [[5], [6]]
    ended = Block(frozenset({2}), budget=4)
    ended.extend(torch.tensor([1, 2, 3]), ids=[1, 2, 3], alternatives=[[5], [6], [7]])
    assert ended.proposal().alternatives == [[5], [6]]  # cut after the EOS


@pytest.mark.parametrize("value", [-1, True, 1.5, "three"])
def test_config_refuses_a_count_that_is_not_auto_or_a_whole_number(value):
    with pytest.raises(ValueError, match="draft_alternatives"):
        hp.PolybasicConfig(draft_alternatives=value)


@pytest.mark.parametrize("case, reason", [
    ("sampling", "greedy decoding"),
    ("three models", "model drafter that proposes to the target"),
    ("batch", "one row"),
    ("windowed", "windowed layers"),
])
def test_a_count_the_chain_cannot_score_is_refused_with_the_reason(case, reason, alternatives_chains):
    target, draft = alternatives_chains("llama")
    assistants, options, ids, config = [draft], {"do_sample": False}, prompt(4), {}
    if case == "sampling":
        options = {"do_sample": True}
    elif case == "three models":  # ungated: its middle level always hands blocks up
        assistants, config = [noisy_copy(target, 0.3, 2), draft], {"schedule": "constant"}
    elif case == "batch":
        ids = torch.cat([ids, prompt(4, seed=2)])
    else:
        target = make_target("gemma3", seed=3)
        assistants = [noisy_copy(target, 0.8, 1)]
    with pytest.raises(ValueError, match=f"draft_alternatives=2: .*{reason}"):
        target.generate(ids, max_new_tokens=5, custom_generate=hp.generate, assistant_models=assistants,
                        polybasic_config=hp.PolybasicConfig(draft_alternatives=2, **config), **options)
