"""Batches share every forward: one verification per round for all rows, one drafting step for all
rows still drafting. Each row stays exact: greedy rows equal plain generate on the same batch and
the row decoded alone; sampled rows follow the target's distribution, independently."""

import numpy as np
import pytest
import torch
from distribution import ALPHA, SETTINGS, STEPS, VOCAB, assert_every_level_took_part, chi_square_p_value, exact_joint
from scipy.stats import chi2_contingency
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_polybasic as hp
from hf_polybasic.chain import ChainParts
from hf_polybasic.drafting import ModelDrafter
from hf_polybasic.integration import make_generate
from hf_polybasic.testing import EOS, PAD, prompt

CONFIG = hp.PolybasicConfig(num_draft_tokens=3, block_threshold=4, schedule="constant")


def left_padded(prompts):
    """input_ids and attention_mask of left-padded prompts (1-D tensors)."""
    width = max(p.shape[0] for p in prompts)
    ids = torch.full((len(prompts), width), PAD)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - p.shape[0] :] = p
        mask[row, width - p.shape[0] :] = 1
    return ids, mask


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
    plain = target.generate(ids, attention_mask=mask, **options)
    out = target.generate(ids, attention_mask=mask, custom_generate=hp.generate, assistant_models=assistants,
                          polybasic_config=CONFIG, return_dict_in_generate=True, **options)
    assert torch.equal(out.sequences, plain)
    for row, p in enumerate(prompts):
        alone = target.generate(p[None], **options)[0, p.shape[0] :]
        assert torch.equal(out.sequences[row, ids.shape[1] : ids.shape[1] + alone.shape[0]], alone)
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


def test_a_row_that_stops_leaves_the_batchs_work(shared_models):
    target, draft = shared_models.chain("llama", 2, seed=72)
    prompts = [prompt(5, seed=200 + row)[0] for row in range(4)]
    ids, mask = left_padded(prompts)
    criteria = StoppingCriteriaList([StopAfterForPrompt(prompts[0], prompts[0].shape[0] + 6)])
    out = target.generate(ids, attention_mask=mask, custom_generate=hp.generate, assistant_models=[draft],
                          polybasic_config=CONFIG, return_dict_in_generate=True, do_sample=False, max_new_tokens=30,
                          eos_token_id=None, pad_token_id=PAD, stopping_criteria=criteria)
    new = out.sequences[:, ids.shape[1] :]
    assert int((new[0] != PAD).sum()) <= 6 and all(int((r != PAD).sum()) == 30 for r in new[1:])
    top = out.polybasic_stats.levels[0]
    # rounds after row 0 stopped verified three rows, not four
    assert top.verifications < 4 * top.forward_passes


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


@pytest.mark.parametrize("arch", ["qwen3_5_text", "nemotron_h", "jamba", "lfm2"])
def test_every_row_of_a_hybrid_batch_equals_plain_generate_and_the_row_alone(arch, shared_models):
    """A chain of hybrid models (Gated DeltaNet, Mamba-2, Mamba, short convolution; issue 25) decodes a
    left-padded batch row by row (`hf_polybasic.recurrent.batch_refusal_reason`), each row exact,
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
    plain = target.generate(ids, attention_mask=mask, **options)
    out = target.generate(ids, attention_mask=mask, custom_generate=hp.generate, assistant_models=assistants,
                          polybasic_config=CONFIG, return_dict_in_generate=True, **options)
    assert torch.equal(out.sequences, plain)
    for row, p in enumerate(prompts):
        alone = target.generate(p[None], **options)[0, p.shape[0] :]
        assert torch.equal(out.sequences[row, ids.shape[1] : ids.shape[1] + alone.shape[0]], alone)
    assert_every_level_took_part(out.polybasic_stats, rejections=False, acceptances=False)
