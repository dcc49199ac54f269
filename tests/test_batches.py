"""Batches share every forward: one verification per round for all rows, one drafting step for all
rows still drafting. Each row stays exact: greedy rows equal plain generate on the same batch and
the row decoded alone; sampled rows follow the target's distribution, independently."""

import warnings
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from helpers import ALPHA, SETTINGS, STEPS, VOCAB, assert_every_level_took_part, chi_square_p_value, exact_joint
from helpers import assert_rows_as_alone, left_padded
from scipy.stats import chi2_contingency
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_polybasic as hp
from hf_polybasic.decoding import round as levels_round
from hf_polybasic.decoding.build import ChainParts
from hf_polybasic.decoding.round import Verifier
from hf_polybasic.drafters import PromptLookup
from hf_polybasic.decoding.round import ModelDrafter
from hf_polybasic.generation import make_generate
from hf_polybasic.schedule import SCHEDULES, batch_gate
from hf_polybasic.schedule.cost_aware import CostAwareSchedule
from hf_polybasic.schedule.shape_gate import ShapeGate
from hf_polybasic.testing import EOS, PAD, cheap_drafting_costs, prompt, simulated_machine

CONFIG = hp.PolybasicConfig(num_draft_tokens=3, block_threshold=4, schedule="constant")


def batch_equals_plain_and_rows_alone(target, assistants, prompts, ids, mask, options):
    """Decode the left-padded batch through the chain; assert it equals plain batched `generate` and
    each row equals the row generated alone. Returns the chain's output (with its statistics)."""
    plain = target.generate(ids, attention_mask=mask, **options)
    out = target.generate(ids, attention_mask=mask, custom_generate=hp.generate, assistant_models=assistants,
                          polybasic_config=CONFIG, return_dict_in_generate=True, **options)
    assert torch.equal(out.sequences, plain)
    assert_rows_as_alone(target, out.sequences, prompts, ids, options)
    return out


@pytest.mark.parametrize("depth", [2, 3, 4])
@pytest.mark.parametrize("rows", [2, 5, 8])
def test_every_row_of_a_batch_equals_plain_generate_and_the_row_alone(depth, rows, shared_models):
    target, *assistants = shared_models.chain("llama", depth, seed=71)
    prompts = [prompt(3 + (5 * row) % 9, seed=100 + row)[0] for row in range(rows)]
    ids, mask = left_padded(prompts)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=EOS,
                            pad_token_id=PAD)
    eos = int(plain[0, ids.shape[1] + 9])  # a token row 0 produces mid-output: an EOS there, mid-block
    options = dict(do_sample=False, max_new_tokens=24, eos_token_id=[eos, EOS], pad_token_id=PAD)
    out = batch_equals_plain_and_rows_alone(target, assistants, prompts, ids, mask, options)
    stats = out.polybasic_stats
    assert_every_level_took_part(stats, rejections=False, acceptances=False)
    # batched verification ran: each target forward verified several rows
    assert stats.levels[0].verifications >= 2 * stats.levels[0].forward_passes - 2


class StopAfterForPrompt(StoppingCriteria):
    """Stops the row that starts with ``prefix`` once it has ``length`` tokens (rows are given one by one)."""

    def __init__(self, prefix, length):
        self.prefix, self.length = prefix, length

    def __call__(self, input_ids, scores, **kwargs):
        row = input_ids[0]
        mine = row.shape[0] >= self.prefix.shape[0] and torch.equal(row[: self.prefix.shape[0]], self.prefix)
        return torch.tensor([bool(mine and row.shape[0] >= self.length)])


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("arch, depth", [("llama", 2), ("llama", 3), ("qwen2", 3), ("gemma3", 2)])
def test_drafts_read_with_the_verifiers_decision_keep_a_batch_equal_to_plain_generate(
        arch, depth, static, drafts_read_with_the_decision, shared_models):
    """Greedy, on a GPU's rules (`Deferred`): each verifier verifies every drafted token, the blocks
    are cut after its read, often (the schedules stop after any token of probability <= 0.6), and a
    left-padded batch of ragged rows still equals plain batched `generate`, through static and
    dynamic caches (gemma3's sliding window keeps the dynamic one)."""
    target, *assistants = shared_models.chain(arch, depth, seed=31)
    prompts = [prompt(3 + 4 * row, seed=310 + row)[0] for row in range(3)]
    ids, mask = left_padded(prompts)
    options = dict(do_sample=False, max_new_tokens=40, eos_token_id=EOS, pad_token_id=PAD)
    if static:
        options["cache_implementation"] = "static"
    plain = target.generate(ids, attention_mask=mask, **{k: v for k, v in options.items()
                                                          if k != "cache_implementation"})
    with simulated_machine(cheap_drafting_costs(target, assistants)) as generate:
        out = target.generate(ids, attention_mask=mask, custom_generate=generate, assistant_models=assistants,
                              return_dict_in_generate=True, **options)
    assert torch.equal(out.sequences, plain)
    assert_every_level_took_part(out.polybasic_stats, rejections=False)
    assert drafts_read_with_the_decision["accepted past the cut"] > 0, drafts_read_with_the_decision
    if static and depth == 3:  # the middle level's rounds ran on the device, a batch of them per read
        assert out.polybasic_stats.levels[1].device_rounds > 0 and drafts_read_with_the_decision["device batches"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@given(depth=st.integers(3, 4), rows=st.integers(1, 4), k=st.integers(1, 8), mu=st.integers(1, 12),
       budget=st.integers(1, 40), eos_step=st.one_of(st.none(), st.integers(0, 39)), seed=st.integers(0, 1000),
       schedule=st.sampled_from(SCHEDULES), compiled=st.booleans())
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_rounds_decided_on_the_device_keep_a_batch_equal_to_plain_generate(
        arch, depth, rows, k, mu, budget, eos_step, seed, schedule, compiled, shared_models):
    """Where reads wait for the device, the level right above a model drafter decides its rounds on
    the device, a batch of them per read (`hf_polybasic.decoding.device_blocks`): any K, mu, budget,
    EOS, schedule and left-padded batch of ragged rows equals plain batched `generate`, static caches
    compiled or not; under the constant schedule the statistics show the rounds ran there."""
    target, *assistants = shared_models.chain(arch, depth, seed=32)
    prompts = [prompt(1 + (seed + 5 * row) % 11, seed=seed + row)[0] for row in range(rows)]
    ids, mask = left_padded(prompts)
    options = dict(do_sample=False, max_new_tokens=budget, pad_token_id=PAD)
    reference = target.generate(ids, attention_mask=mask, eos_token_id=EOS, **options)
    eos = [EOS]
    if eos_step is not None and eos_step < reference.shape[1] - ids.shape[1]:
        eos.append(int(reference[0, ids.shape[1] + eos_step]))  # a token the target really emits ends row 0
        reference = target.generate(ids, attention_mask=mask, eos_token_id=eos, **options)
    config = hp.PolybasicConfig(num_draft_tokens=k, block_threshold=mu, schedule=schedule, compile=compiled)
    with mock.patch.object(levels_round, "reads_wait", lambda device: True), warnings.catch_warnings(), \
            simulated_machine(cheap_drafting_costs(target, assistants)) as simulated:
        warnings.simplefilter("ignore")
        out = target.generate(ids, attention_mask=mask, eos_token_id=eos, cache_implementation="static",
                              custom_generate=simulated if schedule == "cost_aware" else hp.generate,
                              assistant_models=assistants, polybasic_config=config, return_dict_in_generate=True,
                              **options)
    assert torch.equal(out.sequences, reference)
    middle = out.polybasic_stats.levels[depth - 2]
    assert middle.runner.startswith("static")
    DEVICE_ROUNDS[schedule] += middle.device_rounds
    if schedule == "constant" and budget >= 2:
        assert middle.device_rounds > 0, out.polybasic_stats


def _host_and_device_rounds(target, assistants, ids, mask, config, **options):
    """The same greedy call with the middle level's rounds read one by one on the host, then decided
    on the device (`hf_polybasic.decoding.device_blocks`), static caches both times."""
    outs = []
    for waits in (False, True):
        with mock.patch.object(levels_round, "reads_wait", lambda device: waits), warnings.catch_warnings(), \
                simulated_machine(cheap_drafting_costs(target, assistants)) as simulated:
            warnings.simplefilter("ignore")
            outs.append(target.generate(ids, attention_mask=mask, cache_implementation="static", do_sample=False,
                                        custom_generate=simulated, assistant_models=assistants, polybasic_config=config,
                                        return_dict_in_generate=True, pad_token_id=PAD, **options))
    host, device = outs
    assert torch.equal(host.sequences, device.sequences)
    assert host.polybasic_stats.levels[1].device_rounds == 0 and device.polybasic_stats.levels[1].device_rounds > 0
    return host.polybasic_stats, device.polybasic_stats


def _target_counts(stats):
    top = stats.levels[0]
    return top.verifications, top.drafted, top.accepted, top.acceptance_lengths


@pytest.mark.parametrize("rows", [1, 3])
def test_rounds_decided_on_the_device_count_what_the_host_loop_counts(rows, shared_models):
    """A second oracle for the device rounds (greedy output equals plain generate whatever the middle
    level proposes): with a constant K and mu the middle level runs the same rounds on the device as
    the host loop does, so the target receives the same blocks (its counts are equal) and the middle
    level counts the same verifications, all of them on the device; a row ends with an EOS the target
    emits in the batch's last row."""
    target, *assistants = shared_models.chain("llama", 3, seed=33)
    prompts = [prompt(2 + 3 * row, seed=330 + row)[0] for row in range(rows)]
    ids, mask = left_padded(prompts)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40, eos_token_id=None,
                            pad_token_id=PAD)
    eos = [int(plain[-1, ids.shape[1] + 17])]
    config = hp.PolybasicConfig(schedule="constant", num_draft_tokens=3, block_threshold=7)
    host, device = _host_and_device_rounds(target, assistants, ids, mask, config, max_new_tokens=40, eos_token_id=eos)
    assert _target_counts(device) == _target_counts(host)
    assert device.levels[1].verifications == host.levels[1].verifications == device.levels[1].device_rounds


def test_rounds_decided_on_the_device_stop_blocks_by_confidence_where_the_host_loop_does(shared_models, monkeypatch):
    """The middle level's stops by confidence read back with a batch of device rounds: with a fixed mu
    of 8, a stop after any token of probability <= 0.6 and the shape gate holding the chain in, its
    blocks (a function of its own greedy tokens and their probabilities) are the host loop's, so the
    target's counts are too, whatever the drafter drafted in either. One row: in a batch the two loops'
    forwards have other widths, whose rounding can move a probability across the threshold."""
    monkeypatch.setattr(CostAwareSchedule, "length", lambda self: min(self.maximum, 8))
    monkeypatch.setattr(CostAwareSchedule, "keep_drafting", lambda self, confidence: confidence > 0.6)
    monkeypatch.setattr(ShapeGate, "bypassed", property(lambda self: False))
    monkeypatch.setattr(ShapeGate, "dropped", property(lambda self: False))
    monkeypatch.setattr(batch_gate, "PLAIN_FIRST_ROUNDS", 0)
    target, *assistants = shared_models.chain("llama", 3, seed=34)
    ids, mask = left_padded([prompt(5, seed=340)[0]])
    host, device = _host_and_device_rounds(target, assistants, ids, mask, hp.PolybasicConfig(), max_new_tokens=40,
                                           eos_token_id=None)
    assert _target_counts(device) == _target_counts(host)
    assert host.levels[0].verifications > 40 / 8  # blocks were cut by confidence


def test_a_batch_of_device_rounds_is_what_the_mean_acceptance_says_one_more():
    from hf_polybasic.decoding.device_blocks import MAX_ROUNDS, rounds_needed

    assert rounds_needed(8, 2.0, 40) == 5 and rounds_needed(7, 2.0, 40) == 5
    assert rounds_needed(8, None, 40) == 9 and rounds_needed(1, 0.5, 10) == 2  # a round emits a token at least
    assert rounds_needed(8, None, 3) == 3  # never past the budget
    assert rounds_needed(100, 1.0, 100) == MAX_ROUNDS and rounds_needed(0, 3.0, 5) == 1


class _Stops:
    """A schedule that records what it is asked (`keep_drafting`: go on while the confidence is above 0.5)
    and told (`closed_at`); every round proposes (`first_draft_pays`)."""

    def __init__(self):
        self.asked, self.told = [], []

    def first_draft_pays(self, top):
        return True

    def keep_drafting(self, confidence):
        self.asked.append(confidence)
        return confidence > 0.5

    def closed_at(self, confidence):
        self.told.append(confidence)


def _full_block():
    from hf_polybasic.decoding.protocol import Block

    block = Block(frozenset(), budget=3)
    block.extend(torch.tensor([4, 5, 6]), ids=[4, 5, 6])
    return block


def test_a_round_that_closes_a_block_is_still_stopped_by_confidence_before_its_last_token():
    """`IntermediateLevel._stop_within`: a round whose tokens reach the block's budget is asked about
    every token but the one that closes the block (a stop there changes nothing), which it is told
    (`closed_at`: its confidence is the calibration's too); it asked about none, so a long round that
    filled the block skipped the stop (seen with rounds decided on the device)."""
    from hf_polybasic.decoding.round import IntermediateLevel

    for confidences, size, asked, told in [([0.9, 0.1, 0.9], 2, [0.9, 0.1], []),
                                           ([0.9, 0.9, 0.1], 3, [0.9, 0.9], [0.1])]:
        block, schedule = _full_block(), _Stops()
        IntermediateLevel._stop_within(schedule, block, 0, confidences)
        assert (block.size, schedule.asked, schedule.told) == (size, asked, told)


def test_the_draft_that_fills_a_block_read_after_verification_is_told_to_its_schedule_not_asked():
    """`ModelDrafter._cut_by_confidence` (drafts read with the level above's decision) asks `keep_drafting`
    about every kept draft but the one that fills the block, which it tells (`closed_at`), as
    `_keep_step` and the middle level (above) do: the calibration and `proposal_size` see every draft's
    confidence."""
    from types import SimpleNamespace

    block, schedule = _full_block(), _Stops()
    ModelDrafter._cut_by_confidence(SimpleNamespace(_active={0: schedule}, _widths={}), 0, block, [0.9, 0.8, 0.7], 0.9, 3)
    assert (block.size, schedule.asked, schedule.told) == (3, [0.9, 0.8], [0.7])


def test_the_cost_aware_schedule_caps_a_drafter_whose_drafts_never_pass(shared_models):
    """A `Drafter` proposing as many tokens as it may, none of which the target takes: under the
    cost-aware schedule its proposals are capped (its schedule's length is what `DrafterLevel` lets
    it propose): 494 tokens in 60 rounds, where the rest of the budget each round would be 1770."""
    from hf_polybasic.drafters import Drafter

    class Wrong(Drafter):
        def propose(self, sequence, max_new_tokens):
            return torch.full((max_new_tokens,), PAD, dtype=torch.long), None  # the target never emits PAD here

        def rollback_to(self, length):
            pass

        def commit(self):
            pass

    target, draft = shared_models.chain("llama", 2, seed=35)
    ids = prompt(6, seed=350)
    with simulated_machine(cheap_drafting_costs(target, [draft])) as simulated:
        out = target.generate(ids, custom_generate=simulated, assistant_models=[Wrong()], do_sample=False,
                              max_new_tokens=60, eos_token_id=None, pad_token_id=PAD, return_dict_in_generate=True)
    assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=60, eos_token_id=None,
                                                      pad_token_id=PAD))
    top, bottom = out.polybasic_stats.levels
    assert top.accepted == 0
    assert bottom.proposed < 12 * top.verifications  # uncapped: 1770 in 60 rounds (the rest of the budget)


DEVICE_ROUNDS = {schedule: 0 for schedule in SCHEDULES}


def test_every_schedule_had_rounds_decided_on_the_device():
    """The property above reached the device rounds under every schedule (a test that never ran them
    would compare plain generate with the host loop)."""
    if not any(DEVICE_ROUNDS.values()):
        pytest.skip("the property test did not run in this session")
    assert all(DEVICE_ROUNDS.values()), DEVICE_ROUNDS


def test_a_row_that_stops_leaves_the_batchs_work(shared_models):
    """(With an EOS id, as plain generate pads a stopped row only beside an EOS criterion; none of these
    rows meets EOS within the budget.)"""
    target, draft = shared_models.chain("llama", 2, seed=72)
    prompts = [prompt(5, seed=200 + row)[0] for row in range(4)]
    ids, mask = left_padded(prompts)
    criteria = StoppingCriteriaList([StopAfterForPrompt(prompts[0], prompts[0].shape[0] + 6)])
    out = target.generate(ids, attention_mask=mask, custom_generate=hp.generate, assistant_models=[draft],
                          polybasic_config=CONFIG, return_dict_in_generate=True, do_sample=False, max_new_tokens=30,
                          eos_token_id=EOS, pad_token_id=PAD, stopping_criteria=criteria)
    new = out.sequences[:, ids.shape[1] :]
    assert int((new[0] != PAD).sum()) <= 6 and all(int((r != PAD).sum()) == 30 for r in new[1:])
    top = out.polybasic_stats.levels[0]
    # rounds after row 0 stopped verified three rows, not four
    assert top.verifications < 4 * top.forward_passes


class StopAtTokens(StoppingCriteria):
    """Stops a row at any of ``tokens``; no ``eos_token_id`` attribute: not an EOS criterion to transformers."""

    def __init__(self, tokens):
        self.tokens = torch.tensor(sorted(tokens))

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, -1], self.tokens.to(input_ids.device))


@given(lengths=st.lists(st.integers(1, 7), min_size=2, max_size=4), seed=st.integers(0, 10_000),
       eos=st.sampled_from([None, EOS]), use_cache=st.booleans(), step=st.integers(0, 3))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_rows_a_criterion_stopped_are_laid_out_as_plain_batched_generate_lays_them_out(
        lengths, seed, eos, use_cache, step, shared_models):
    """Plain batched generate pads a row that a stopping criterion ended only beside an EOS criterion
    (``has_eos_stopping_criteria``); with ``eos_token_id=None`` the row goes on with its own tokens until
    every row has stopped (the chain padded it). Rows shared (``use_cache=True``) or decoded one by one
    (``use_cache=False``), with and without an EOS id; the first row stops early, the others when they
    meet its stop token."""
    target, *assistants = shared_models.chain("llama", 3, seed=77)
    prompts = [prompt(length, seed=seed + row)[0] for row, length in enumerate(lengths)]
    ids, mask = left_padded(prompts)
    options = dict(attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=PAD, use_cache=use_cache)
    free = target.generate(ids, eos_token_id=None, **options)[:, ids.shape[1] :]
    criteria = StoppingCriteriaList([StopAtTokens({int(free[0, step])})])
    options.update(eos_token_id=eos, stopping_criteria=criteria, return_dict_in_generate=True, output_scores=True)
    expected = target.generate(ids, **options)
    assume(expected.sequences.shape[1] > ids.shape[1] + step + 1)  # a row went on after the first one stopped
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="hf_polybasic decodes this batch row by row")
        out = target.generate(ids, custom_generate=hp.generate, assistant_models=assistants, polybasic_config=CONFIG,
                              **options)
    assert torch.equal(out.sequences, expected.sequences)
    assert_every_level_took_part(out.polybasic_stats, rejections=False, acceptances=False)
    if eos is None:  # every row has a token at every step: its scores too (a row gone on, those of its own text)
        torch.testing.assert_close(torch.stack(out.scores), torch.stack(expected.scores), rtol=1e-4, atol=1e-4)


def _two_prompt_samples(target, assistants, generate, seed, **config):
    """Rows: 1000 continuations of each of two prompts, sampled in one batch; per prompt the outcome
    index of each of its rows (in row order), and the call's statistics."""
    prompts = [prompt(3, seed=5, vocab=VOCAB)[0], prompt(4, seed=6, vocab=VOCAB)[0]]
    ids, mask = left_padded(prompts)
    torch.manual_seed(seed)
    out = target.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=STEPS, num_return_sequences=1000,
                          custom_generate=generate, assistant_models=list(assistants), pad_token_id=PAD,
                          polybasic_config=hp.PolybasicConfig(**config), return_dict_in_generate=True,
                          **SETTINGS["temperature+top_k+top_p"])
    new = out.sequences[:, ids.shape[1] :].numpy()
    outcomes = np.ravel_multi_index(tuple(new.T), (VOCAB,) * STEPS)
    return [outcomes[:1000], outcomes[1000:]], prompts, out.polybasic_stats


def _p_values(target, outcomes, prompts):
    return [chi_square_p_value(np.bincount(o, minlength=VOCAB**STEPS), exact_joint(target, "temperature+top_k+top_p",
                                                                                     p[None]))
            for o, p in zip(outcomes, prompts)]


def test_sampled_rows_of_a_batch_follow_the_target_each_and_independently(distribution_models):
    target, m2, m3 = distribution_models[:3]
    outcomes, prompts, stats = _two_prompt_samples(target, [m2, m3], hp.generate, seed=21, num_draft_tokens=2,
                                                   block_threshold=2, schedule="constant")
    assert_every_level_took_part(stats)
    assert stats.levels[0].forward_passes < stats.levels[0].verifications / 100  # 2000 rows per forward
    assert min(_p_values(target, outcomes, prompts)) > ALPHA
    # rows are independent: neighbouring rows' first tokens show no association
    first = [o // VOCAB ** (STEPS - 1) for o in outcomes]
    for tokens in first:
        table = np.zeros((VOCAB, VOCAB))
        np.add.at(table, (tokens[0::2], tokens[1::2]), 1)
        table = table[table.sum(1) > 0][:, table.sum(0) > 0]
        assert chi2_contingency(table).pvalue > ALPHA


class RawProposalDrafter(ModelDrafter):
    def proposal_probs(self, probs, logits):
        return logits.softmax(-1)


def test_negative_control_a_lossy_drafter_in_a_batch_is_caught(distribution_models):
    target, m2 = distribution_models[:2]
    lossy = make_generate(ChainParts(model_drafter=RawProposalDrafter))
    outcomes, prompts, stats = _two_prompt_samples(target, [m2], lossy, seed=22, num_draft_tokens=2,
                                                   schedule="constant")
    assert_every_level_took_part(stats)
    assert max(_p_values(target, outcomes, prompts)) < ALPHA


@pytest.mark.parametrize("pays", [False, True])
def test_the_default_schedule_decides_for_the_batch_whether_drafting_pays(pays, shared_models):
    """Costs by every token a forward is fed (all rows): where verifying k tokens of 4 rows costs
    4 k steps no draft pays and the batch decodes plainly, without the drafter ever running; where
    the target's forward is flat, the rows draft."""
    from hf_polybasic.testing import cheap_drafting_costs, simulated_machine

    target, draft = shared_models.chain("llama", 2, seed=73)
    if pays:
        costs = cheap_drafting_costs(target, [draft])
    else:
        costs = {target: lambda tokens: 0.01 * tokens, draft: lambda tokens: 0.005 * tokens}
    ids, mask = left_padded([prompt(n, seed=n)[0] for n in (5, 7, 6, 9)])
    options = dict(do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=PAD)
    with simulated_machine(costs) as generate:
        out = target.generate(ids, attention_mask=mask, custom_generate=generate, assistant_models=[draft],
                              return_dict_in_generate=True, **options)
    assert torch.equal(out.sequences, target.generate(ids, attention_mask=mask, **options))
    stats = out.polybasic_stats
    if pays:
        assert_every_level_took_part(stats, rejections=False, acceptances=False)
    else:
        assert stats.levels[1].forward_passes == 0 and stats.levels[0].drafted == 0
        assert stats.levels[1].paused_rounds == 4 * 12  # every row, every round


# --- the batch's cache and width follow the live rows ------------------------------------------------
class SlotsAtEveryRound:
    """Records, after every commit (once per target round, at every level), each model's slots per
    token of its longest live row."""

    ratios: list = []

    @classmethod
    def record(cls, runner):
        live = [row for row in range(runner.rows) if runner._batch_index[row] is not None]
        longest = max(runner.lengths[row] for row in live)
        cls.ratios.append((runner.role.split()[0], runner.slots / max(longest, 1)))


class RecordingVerifier(Verifier):
    def commit(self):
        super().commit()
        SlotsAtEveryRound.record(self.runner)


class RecordingDrafter(ModelDrafter):
    def commit(self):
        super().commit()
        SlotsAtEveryRound.record(self.runner)


def test_holes_are_compacted_so_caches_grow_with_the_text_not_the_rejections(shared_models):
    """8 ragged rows, 150 tokens, drafts often rejected: at every round every model's cache holds at
    most 1.25 slots per token of its longest row (holes of rejected drafts made the target's 2.9x,
    and the attention and the mask grew with them), and the output is still exact."""
    target, *assistants = shared_models.chain("llama", 3, seed=74)
    prompts = [prompt(2 + (7 * row) % 13, seed=300 + row)[0] for row in range(8)]
    ids, mask = left_padded(prompts)
    options = dict(do_sample=False, max_new_tokens=150, eos_token_id=None, pad_token_id=PAD)
    SlotsAtEveryRound.ratios = []
    generate = make_generate(ChainParts(verifier=RecordingVerifier, model_drafter=RecordingDrafter))
    out = target.generate(ids, attention_mask=mask, custom_generate=generate, assistant_models=assistants,
                          polybasic_config=hp.PolybasicConfig(num_draft_tokens=4, block_threshold=6,
                                                              schedule="constant"), **options)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, **options))
    roles = {role for role, _ in SlotsAtEveryRound.ratios}
    assert roles == {"target", "assistant_models[0]", "assistant_models[1]"}
    assert max(ratio for _, ratio in SlotsAtEveryRound.ratios) <= 1.25


def test_the_cache_is_compacted_without_changing_any_rows_logits(shared_models):
    from hf_polybasic.runners.dynamic import CachedModel
    from hf_polybasic.compat import new_dynamic_cache

    model = shared_models.chain("llama", 1, seed=75)[0]
    a, b = prompt(12, seed=1)[0], prompt(6, seed=2)[0]
    together = CachedModel(model, new_dynamic_cache(model), "m", rows=2)
    together.logits_rows({0: (a[:10], 1), 1: (b[:3], 1)})
    together.rollback_rows({0: 4})  # a long hole: 10 slots for a row of 4 tokens
    before = together.slots
    logits = together.logits_rows({0: (a[:6], 2), 1: (b, 3)})
    assert together.compactions == 1 and together.slots < before
    alone = CachedModel(model, new_dynamic_cache(model), "m")
    alone.logits(a[:4], 1)
    assert torch.allclose(logits[0], alone.logits(a[:6], 2), atol=1e-5)
    alone.rollback_rows({0: 0})
    assert torch.allclose(logits[1], alone.logits(b, 3), atol=1e-5)


def test_rows_that_stop_leave_every_later_forward(shared_models):
    """4 rows, 3 of them stop after 2 tokens: the later target forwards are one row wide (they
    stayed 4 wide, and the lone survivor was priced as if 4 rows shared them). (With an EOS id: without
    one, plain generate's stopped rows go on; none of these rows meets EOS.)"""
    target, draft = shared_models.chain("llama", 2, seed=76)
    prompts = [prompt(5, seed=400 + row)[0] for row in range(4)]
    ids, mask = left_padded(prompts)
    criteria = StoppingCriteriaList([StopAfterForPrompt(p, p.shape[0] + 2) for p in prompts[1:]])
    from hf_polybasic.runners import probe
    probe.cache_problem(target), probe.rows_problem(target)  # probed (once per model) before the widths are recorded
    widths = []
    handle = target.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[0]),
                                              with_kwargs=True)
    try:
        out = target.generate(ids, attention_mask=mask, custom_generate=hp.generate, assistant_models=[draft],
                              polybasic_config=CONFIG, do_sample=False, max_new_tokens=30, eos_token_id=EOS,
                              pad_token_id=PAD, stopping_criteria=criteria)
    finally:
        handle.remove()
    for row, p in enumerate(prompts):
        alone = target.generate(p[None], do_sample=False, max_new_tokens=30 if row == 0 else 2, eos_token_id=EOS)
        new = alone[0, p.shape[0] :]
        assert torch.equal(out[row, ids.shape[1] : ids.shape[1] + new.shape[0]], new)
        assert (out[row, ids.shape[1] + new.shape[0] :] == PAD).all()
    assert widths[0] == 4 and widths[-1] == 1 and widths.count(1) >= 5


def test_a_rows_share_of_a_forward_is_priced_over_the_rows_still_live():
    from hf_polybasic.decoding.build import BatchShare

    class Runner:
        live_rows = 4

    class Flat:  # T(k) = 1 + k
        last_seconds = 8.0

        def seconds(self, tokens):
            return 1.0 + tokens

    runner = Runner()
    share = BatchShare(Flat(), runner)
    assert share.seconds(2) == pytest.approx((1 + 8) / 4) and share.last_seconds == 2.0
    runner.live_rows = 1
    assert share.seconds(2) == pytest.approx(3.0) and share.last_seconds == 8.0


def test_batched_forwards_do_not_correct_the_one_row_cost_curve(shared_models):
    from hf_polybasic.runners.dynamic import CachedModel
    from hf_polybasic.compat import new_dynamic_cache
    from hf_polybasic.costs import CostCurve, CostEstimate

    model = shared_models.chain("llama", 1, seed=75)[0]
    runner = CachedModel(model, new_dynamic_cache(model), "m", rows=4)
    runner.cost_observer = estimate = CostEstimate(CostCurve({1: 1.0, 4: 1.0}))
    runner.logits_rows({row: (prompt(3, seed=row)[0], 1) for row in range(4)})
    runner.logits_rows({row: (prompt(4, seed=row)[0], 1) for row in range(4)})  # 4 rows x 1 token
    assert estimate.observed == 0 and estimate.last_seconds is not None
    single = CachedModel(model, new_dynamic_cache(model), "m")
    single.cost_observer = estimate
    single.logits(prompt(4, seed=1)[0], 1)
    assert estimate.observed == 1


@pytest.mark.parametrize("k, mu", [(2, 5), (3, (6,))])
def test_prompt_lookup_keeps_k_and_the_configs_last_mu(k, mu, shared_models):
    """PolybasicConfig(prompt_lookup=True) under the constant schedule: the added lookup drafts K
    tokens per round and the model above it hands up blocks of the config's last mu (it got mu =
    32: 30 drafts per target verification, and the lookup drafted its own 8)."""
    depth = 2 if isinstance(mu, int) else 3
    target, *assistants = shared_models.chain("llama", depth, seed=77)
    ids = prompt(6, seed=5).repeat(1, 3)  # a repetitive prompt: the lookup finds copies
    out = target.generate(ids, custom_generate=hp.generate, assistant_models=assistants, do_sample=False,
                          max_new_tokens=40, eos_token_id=None, return_dict_in_generate=True,
                          polybasic_config=hp.PolybasicConfig(prompt_lookup=True, num_draft_tokens=k,
                                                              block_threshold=mu, schedule="constant"))
    assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=None))
    levels = out.polybasic_stats.levels
    last_mu = mu if isinstance(mu, int) else mu[-1]
    lookup_verifier, model_above = levels[-2], levels[-3]
    assert max(length - 1 for length in lookup_verifier.acceptance_lengths) <= k  # K per lookup draft
    # blocks of at least mu, closed by the round that reached it: at most mu - 1 + K + 1 tokens
    assert max(length - 1 for length in model_above.acceptance_lengths) <= last_mu + k
    assert model_above.drafted >= model_above.verifications  # blocks were handed up
    assert_every_level_took_part(out.polybasic_stats, rejections=False, acceptances=False)


def _no_drafting_pays(target, draft):
    return {target: lambda tokens: 0.01 * tokens, draft: lambda tokens: 0.005 * tokens}


def test_without_cost_curves_the_batch_gate_times_plain_rounds_and_sits_out(shared_models):
    """measure_costs=False (no stored curve): the gate had no plain rate to compare with and never
    paused, where drafting cannot pay (4.7x the time of the same call with curves)."""
    from hf_polybasic.testing import simulated_machine

    target, draft = shared_models.chain("llama", 2, seed=73)
    ids, mask = left_padded([prompt(n, seed=n)[0] for n in (5, 7, 6, 9)])
    options = dict(do_sample=False, max_new_tokens=40, eos_token_id=None, pad_token_id=PAD)
    seconds = {}
    for measure in (True, False):
        with simulated_machine(_no_drafting_pays(target, draft)) as generate:
            out = target.generate(ids, attention_mask=mask, custom_generate=generate, assistant_models=[draft],
                                  polybasic_config=hp.PolybasicConfig(measure_costs=measure),
                                  return_dict_in_generate=True, **options)
        assert torch.equal(out.sequences, target.generate(ids, attention_mask=mask, **options))
        seconds[measure] = out.polybasic_stats.seconds
        assert out.polybasic_stats.levels[1].paused_rounds > 0
    assert seconds[False] < 1.5 * seconds[True]


def test_a_batch_sat_out_from_the_start_never_prefills_the_drafter(shared_models):
    from hf_polybasic.testing import simulated_machine

    target, draft = shared_models.chain("llama", 2, seed=73)
    with simulated_machine(_no_drafting_pays(target, draft)) as generate:
        out = target.generate(prompt(6, seed=8), custom_generate=generate, assistant_models=[draft],
                              num_return_sequences=4, do_sample=True, max_new_tokens=8, eos_token_id=None,
                              return_dict_in_generate=True)
    assert out.sequences.shape[0] == 4
    assert out.polybasic_stats.levels[1].forward_passes == 0


def test_a_batch_whose_drafter_costs_a_target_step_never_drafts(shared_models):
    """A memory-bound target (a forward of any width costs one step) and a drafter as dear per step:
    verifying several rows' drafts would be free, but drafting them costs what the plain steps they
    replace do, so the batch's up-front check (which prices the drafter's steps from its curve, not
    as free) sits the batch out from the start: the drafter is never prefilled."""
    from hf_polybasic.testing import simulated_machine

    target, draft = shared_models.chain("llama", 2, seed=73)
    ids, mask = left_padded([prompt(n, seed=n)[0] for n in (5, 7, 6, 9)])
    options = dict(do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=PAD)
    with simulated_machine({target: lambda tokens: 0.01, draft: lambda tokens: 0.01}) as generate:
        out = target.generate(ids, attention_mask=mask, custom_generate=generate, assistant_models=[draft],
                              return_dict_in_generate=True, **options)
    assert torch.equal(out.sequences, target.generate(ids, attention_mask=mask, **options))
    assert out.polybasic_stats.levels[1].forward_passes == 0


# --- statistics as a second oracle -------------------------------------------------------------------
COUNTS = ("verifications", "drafted", "accepted", "proposed")


@pytest.mark.parametrize("schedule", ["constant", "heuristic"])
@pytest.mark.parametrize("chain_shape", ["2 models", "3 models", "4 models", "2 models + lookup", "3 models + lookup"])
def test_a_batchs_counts_per_level_are_the_sum_of_its_rows_decoded_alone(chain_shape, schedule, shared_models):
    """Under a schedule that looks only at the row's own history (constant; heuristic, whose lengths
    differ from row to row, so rows stop drafting at different steps) every row of a batch runs
    exactly the rounds it runs alone, so each level's verifications, drafted, accepted and proposed
    tokens add up over the rows. Outputs cannot show a level below the target going wrong (its
    mistakes only lower acceptance); these counts do."""
    depth = int(chain_shape[0])
    target, *assistants = shared_models.chain("llama", depth, seed=78)
    if "lookup" in chain_shape:
        assistants = [*assistants, PromptLookup(max_ngram=2, num_tokens=3)]
    prompts = [prompt(3 + (4 * row) % 7, seed=500 + row)[0].repeat(2) for row in range(5)]  # repeats: lookups hit
    ids, mask = left_padded(prompts)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, eos_token_id=EOS,
                            pad_token_id=PAD)
    eos = int(plain[1, ids.shape[1] + 7])  # a token a row produces mid-output ends rows at different lengths
    options = dict(do_sample=False, max_new_tokens=20, eos_token_id=[eos, EOS], pad_token_id=PAD,
                   custom_generate=hp.generate, assistant_models=assistants, return_dict_in_generate=True,
                   polybasic_config=hp.PolybasicConfig(num_draft_tokens=3, block_threshold=4, schedule=schedule))
    batch = target.generate(ids, attention_mask=mask, **options).polybasic_stats
    alone = [target.generate(p[None], **options).polybasic_stats for p in prompts]
    for index, level in enumerate(batch.levels):
        for count in COUNTS:
            assert getattr(level, count) == sum(getattr(stats.levels[index], count) for stats in alone), (
                f"{level.name}: {count}")
        assert sorted(level.acceptance_lengths) == sorted(n for s in alone for n in s.levels[index].acceptance_lengths)
    assert_every_level_took_part(batch, rejections=False)


@pytest.mark.parametrize("arch", ["qwen3_5_text", "nemotron_h", "jamba", "lfm2"])
def test_every_row_of_a_hybrid_batch_equals_plain_generate_and_the_row_alone(arch, shared_models):
    """A chain of hybrid models (Gated DeltaNet, Mamba-2, Mamba, short convolution; issue 25) decodes a
    left-padded batch row by row (`hf_polybasic.runners.recurrent.batch_refusal_reason`), each row exact,
    with an EOS inside a block of one row."""
    from hf_polybasic import compat
    from hf_polybasic.testing import make_target, noisy_copy

    if not compat.HAS_RECURRENT_CACHE_LAYERS:
        pytest.skip("transformers < 5.15 refuses hybrid models")

    def chain():
        target = make_target(arch, seed=7)
        return target, noisy_copy(target, 0.05, 1), noisy_copy(target, 0.2, 2)

    target, *assistants = shared_models.built(("batch-hybrid", arch), chain)
    prompts = [prompt(3 + 4 * row, seed=300 + row)[0] for row in range(3)]
    ids, mask = left_padded(prompts)
    options = dict(do_sample=False, max_new_tokens=20, eos_token_id=EOS, pad_token_id=PAD)
    plain = target.generate(ids, attention_mask=mask, **options)
    options["eos_token_id"] = [int(plain[2, ids.shape[1] + 8]), EOS]  # a token row 2 emits mid-output
    out = batch_equals_plain_and_rows_alone(target, assistants, prompts, ids, mask, options)
    assert_every_level_took_part(out.polybasic_stats, rejections=False, acceptances=False)


def test_a_single_row_runner_has_nothing_to_release_or_prefill_repeated(shared_models):
    """release_rows and prefill_repeated are batch operations: a one-row runner keeps its row and
    refuses a repeated prefill with a message naming the runner."""
    from hf_polybasic.runners.dynamic import CachedModel
    from hf_polybasic.compat import new_dynamic_cache

    model = shared_models.chain("llama", 1, seed=75)[0]
    single = CachedModel(model, new_dynamic_cache(model), "the one row")
    single.logits(prompt(4, seed=1)[0], 1)
    single.release_rows([0])
    assert single.live_rows == 1
    with pytest.raises(ValueError, match="the one row: prefill_repeated needs an empty runner of 1 rows"):
        CachedModel(model, new_dynamic_cache(model), "the one row").prefill_repeated({0: prompt(4, seed=1)[0]}, 1)


def test_a_runner_of_two_rows_or_more_needs_an_empty_cache_of_its_own(shared_models):
    """A batch's runner lays every row's tokens out in one cache of its own (holes, masks): from the
    smallest batch on it refuses a cache that already holds tokens, or none (``use_cache=False``,
    which the chain decodes row by row), naming the model, rather than decode from a wrong layout."""
    from hf_polybasic import compat
    from hf_polybasic.runners.dynamic import CachedModel
    from hf_polybasic.compat import new_dynamic_cache

    model = shared_models.chain("llama", 1, seed=75)[0]
    prefilled = new_dynamic_cache(model)
    model(prompt(4, seed=1), use_cache=True, **{compat.cache_argument(model): prefilled})
    for cache in (None, prefilled):
        with pytest.raises(ValueError, match="the batch: a batch of rows needs an empty cache of its own"):
            CachedModel(model, cache, "the batch", rows=2)
    assert CachedModel(model, new_dynamic_cache(model), "the batch", rows=2).lengths == [0, 0]


def test_a_runner_without_a_cache_holds_no_tokens_until_it_is_fed(shared_models):
    """``use_cache=False``: the runner feeds the whole sequence at every forward, and its ``lengths``
    (what the levels read as the tokens it holds) count none before its first forward, then the
    sequence it was last fed, as a runner with a cache does."""
    from hf_polybasic.runners.dynamic import CachedModel
    from hf_polybasic.compat import new_dynamic_cache

    model = shared_models.chain("llama", 1, seed=75)[0]
    sequence = prompt(6, seed=2)[0]
    for cache in (None, new_dynamic_cache(model)):
        runner = CachedModel(model, cache, "the one row")
        assert runner.lengths == [0]
        logits = runner.logits(sequence, 2)
        assert runner.lengths == [6]
        assert torch.allclose(logits, model(sequence[None]).logits[0, -2:], atol=1e-5)


def test_a_drafter_reporting_nan_log_probs_is_refused():
    from hf_polybasic.decoding.round import check_drafter_output

    log_probs = torch.log(torch.full((2, 8), 1 / 8))
    log_probs[1, 3] = float("nan")
    with pytest.raises(ValueError, match="log_probs with NaN or \\+inf"):
        check_drafter_output("Mine", torch.tensor([1, 2]), log_probs, limit=4)
    check_drafter_output("Mine", torch.tensor([1, 2]), torch.log(torch.full((2, 8), 1 / 8)), limit=4)
