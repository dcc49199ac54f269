"""Trained draft heads as levels (issue 42): a head drafts from the hidden states of the level right above
it, out of the forwards that level runs anyway, rolled back with its cache.

Plain `generate` is the oracle: greedy output identical for one row and left-padded ragged batches, on the
dynamic, static and compiled runners, where reads wait for the device and where they do not, with the head
at the bottom of 2- and 3-level chains and above a `PromptLookup`; sampling against exact enumeration with a
negative control. Heads are distilled on the tiny targets' own states inside the session (seconds), so their
drafts are accepted often and rejected often: every test asserts from the statistics that the head drafted
and its verifier accepted and rejected some of it.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from helpers import (
    ALPHA,
    assert_every_level_took_part,
    chi_square_p_value,
    distilled_head,
    left_padded,
    make_head,
    sample_counts,
)

import hf_polybasic as hp
from hf_polybasic.decoding import round as levels_round
from hf_polybasic.decoding.build import ChainParts
from hf_polybasic.decoding.round import ModelDrafter
from hf_polybasic.generation import make_generate
from hf_polybasic.levels import PromptLookup
from hf_polybasic.runners.features import FeatureStore
from hf_polybasic.runners.head import HeadModel
from hf_polybasic.testing import PAD, prompt, tiny_chain

CONSTANT = dict(schedule="constant", num_draft_tokens=4, block_threshold=3)


@pytest.fixture(scope="module")
def head_chain(shared_models):
    """(target, a noisy copy, a head distilled on the target, a head on three of its layers)."""

    def make():
        target, copy = tiny_chain("llama", 2, seed=3, noises=(0.08,))
        return target, copy, distilled_head(target), distilled_head(target, layers=(1, 2, -1), seed=1)

    return shared_models.built(("heads",), make)


def _generate(target, ids, mask, chain, runner="dynamic", reads="cpu", config=CONSTANT, **options):
    call = dict(assistant_models=list(chain), polybasic_config=hp.PolybasicConfig(**config, compile=runner == "compiled"),
                return_dict_in_generate=True, custom_generate=hp.generate, pad_token_id=PAD, **options)
    if runner == "static":
        call["cache_implementation"] = "static"
    with mock.patch.object(levels_round, "reads_wait", lambda device: reads == "gpu"):
        return target.generate(ids, attention_mask=mask, **call)


SHAPES = {"2 levels": lambda m: [m[2]], "3 levels": lambda m: [m[1], m[2]], "head of 3 layers": lambda m: [m[3]],
          "above a lookup": lambda m: [m[2], PromptLookup(num_tokens=3)]}


@pytest.mark.parametrize("runner, reads", [("dynamic", "cpu"), ("dynamic", "gpu"), ("static", "gpu"), ("compiled", "cpu")])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_output_with_a_head_is_plain_generates(shape, reads, runner, head_chain):
    target = head_chain[0]
    rows = [prompt(length, seed=60 + length)[0] for length in (4, 9, 1, 7)]
    ids, mask = left_padded(rows)
    options = dict(do_sample=False, max_new_tokens=20, repetition_penalty=1.2)
    out = _generate(target, ids, mask, SHAPES[shape](head_chain), runner, reads, **options)
    plain = target.generate(ids, attention_mask=mask, pad_token_id=PAD, **options)
    for index, row in enumerate(rows):  # the row alone is the oracle (the penalty sees batched padding)
        alone = target.generate(row[None], pad_token_id=PAD, **options)[0, row.shape[0]:]
        assert out.sequences[index, ids.shape[1]:ids.shape[1] + alone.shape[0]].tolist() == alone.tolist(), index
    assert plain.shape[0] == out.sequences.shape[0]
    stats = out.polybasic_stats
    # a lookup's drafts are rarely what the head would say: its verifier need not accept any
    print(shape, reads, runner, assert_every_level_took_part(stats, acceptances=shape != "above a lookup"))
    if runner != "dynamic":
        assert stats.levels[-1 if shape != "above a lookup" else -2].runner.startswith("static")


def test_a_distilled_head_is_accepted_on_at_least_half_of_its_drafts(head_chain):
    """The wiring works, not only the refusals: a head distilled for seconds on the tiny target drafts
    what the target samples at least half of the time."""
    target, _, head, _ = head_chain
    ids = prompt(6, seed=8)
    torch.manual_seed(0)
    out = _generate(target, ids, torch.ones_like(ids), [head], do_sample=True, max_new_tokens=48,
                    config=dict(schedule="constant", num_draft_tokens=2))
    level = out.polybasic_stats.levels[0]
    print(out.polybasic_stats)
    assert level.drafted >= 40 and level.accepted >= 0.5 * level.drafted


def test_the_verifier_keeps_features_of_exactly_what_it_holds(head_chain):
    """After a call the level above holds the output minus its last token, and its features are those
    positions' hidden states as a full forward computes them."""
    target, _, head, _ = head_chain
    ids = prompt(5, seed=2)
    seen = {}
    original = HeadModel.forward

    def spy(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    from hf_polybasic.runners import head as head_module
    build = head_module.HeadRunner.__init__

    def keep(self, inner, source, vocab_limit=None):
        build(self, inner, source, vocab_limit)
        seen["source"], seen["store"] = source, self.features

    with mock.patch.object(head_module.HeadRunner, "__init__", keep):
        out = _generate(target, ids, torch.ones_like(ids), [head], do_sample=False, max_new_tokens=12)
    store, sequence = seen["store"], out.sequences[0]
    held = seen["source"].lengths[0]
    assert held == sequence.shape[0] - 1 and store.length(0) == held
    with torch.no_grad():
        full = target(sequence[None, :held], output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(store.read(0, 0, held), full, rtol=1e-4, atol=1e-4)


def test_feature_store_rolls_back_and_continues():
    store = FeatureStore((-1,))
    store.write(0, 0, torch.arange(5.0)[:, None])
    store.truncate(0, 3)
    store.write(0, 3, torch.tensor([[7.0], [8.0]]))
    assert store.length(0) == 5 and store.read(0, 0, 5).flatten().tolist() == [0, 1, 2, 7, 8]
    store.write(0, 1, torch.tensor([[9.0]]))  # a forward from position 1 replaces what followed
    assert store.read(0, 0, 2).flatten().tolist() == [0, 9] and store.length(0) == 2
    store.write(1, 4, torch.tensor([[1.0]]))  # a row whose first 4 positions came cached
    assert (store.known_from(1), store.length(1)) == (4, 5)
    store.release(0)
    assert store.length(0) == 0


@pytest.mark.parametrize("depth, reads", [(2, "cpu"), (3, "cpu"), (2, "gpu"), (3, "gpu")])
def test_sampling_with_a_head_is_the_targets_distribution(depth, reads, distribution_models, exact_distribution,
                                                          shared_models):
    """The head's drafts are sampled from its processed distribution and reported as such; where reads wait
    for the device (``gpu``: its drafts read with the verifier's decision, on static caches) as on the CPU."""
    target, copy = distribution_models[:2]
    head = shared_models.built(("distribution head",), lambda: (distilled_head(target, texts=64, steps=100),))[0]
    chain = [head] if depth == 2 else [copy, head]
    setting = "temperature+top_k+top_p"
    with mock.patch.object(levels_round, "reads_wait", lambda device: reads == "gpu"):
        counts, stats = sample_counts(target, setting, chain, seed=40 + depth, schedule="constant", num_draft_tokens=2,
                                      block_threshold=2, cache_implementation="static" if reads == "gpu" else None)
    print(depth, reads, assert_every_level_took_part(stats))
    assert chi_square_p_value(counts, exact_distribution(setting)) > ALPHA


class RawHeadDrafter(ModelDrafter):
    """The classic bug: report the head's raw logits although its drafts were sampled from the processed distribution."""

    def proposal_probs(self, probs, logits):
        return logits.softmax(-1)


def test_negative_control_a_head_reporting_its_raw_logits(distribution_models, exact_distribution, shared_models):
    target = distribution_models[0]
    head = shared_models.built(("distribution head",), lambda: (distilled_head(target, texts=64, steps=100),))[0]
    setting = "temperature+top_k+top_p"
    counts, stats = sample_counts(target, setting, [head], seed=42, generate=make_generate(ChainParts(
        model_drafter=RawHeadDrafter)), schedule="constant", num_draft_tokens=2)
    assert_every_level_took_part(stats)
    assert chi_square_p_value(counts, exact_distribution(setting)) < ALPHA


def test_a_head_must_sit_right_below_a_model(head_chain):
    target, _, head, _ = head_chain
    ids = prompt(4)
    with pytest.raises(ValueError, match=r"assistant_models\[1\] .* is a draft head: it drafts from the hidden states of "
                                         "the model right above it .* not below a Drafter or another head"):
        _generate(target, ids, torch.ones_like(ids), [head, head], do_sample=False, max_new_tokens=4)


def test_a_random_head_drafts_and_stays_exact(shared_models):
    """Without training (its drafts mostly rejected) the output is still the target's, and the call warns."""
    target = shared_models.target("qwen2", seed=4)
    head = HeadModel(make_head(target), "random")
    ids = prompt(5, seed=1)
    # the target accepts almost none, and the warning's hint is a head's, not a tokenizer mix-up's
    with pytest.warns(UserWarning, match=r"accepted .* drafts from M2 .*trained for another model"):
        out = _generate(target, ids, torch.ones_like(ids), [head], do_sample=False, max_new_tokens=16)
    assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=16, pad_token_id=PAD))
    assert out.polybasic_stats.levels[1].proposed > 0


# --- native MTP layers, through transformers' own MtpModel ----------------------------------------------
def _tiny_deepseek():
    """A tiny DeepSeek-V3 with one MTP layer (transformers' `MtpModel`, its expert tensors initialised:
    built directly they are left empty) and `MtpModel.from_pretrained` answering with it."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                              num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16,
                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1,
                              n_group=1, topk_group=1, num_mtp_layers=1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(7)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # peaked distributions
    mtp = hp.compat.mtp_model_class()(model, 1)
    with torch.no_grad():
        for name, parameter in mtp.named_parameters():
            if not name.startswith(("embed_tokens", "shared_head")):
                parameter.copy_(torch.randn_like(parameter) * 0.2 if parameter.dim() > 1 else torch.ones_like(parameter))
    return model, mtp.eval()


@pytest.fixture(scope="module")
def deepseek(shared_models, monkeypatch_module):
    if hp.compat.mtp_model_class() is None:
        pytest.skip(f"transformers {hp.compat.TRANSFORMERS_VERSION} has no MtpModel (since {hp.compat.MTP_SINCE})")
    model, mtp = _tiny_deepseek()
    shared_models.register(("deepseek mtp",), (model,))  # unchanged by every test
    monkeypatch_module.setattr(type(mtp), "from_pretrained", classmethod(lambda cls, main, **kwargs: mtp))
    return model, mtp


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_the_mtp_level_drafts_what_transformers_mtp_candidate_generator_drafts(deepseek):
    """The same context, the same MTP layer: our level's next-token logits are those of transformers'
    `MTPCandidateGenerator` (its greedy draft is ours)."""
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import MTPCandidateGenerator

    from hf_polybasic.heads.mtp import mtp_head
    from hf_polybasic.runners.dynamic import CachedModel
    from hf_polybasic.runners.head import HeadRunner

    model, _ = deepseek
    for length in (1, 4, 9):
        ids = prompt(length, seed=length, vocab=64)
        with torch.no_grad():
            outputs = model(ids, output_hidden_states=True)
        grown = torch.cat([ids, outputs.logits[:, -1:].argmax(-1)], dim=1)  # the main model's own next token
        generator = MTPCandidateGenerator(model, GenerationConfig(do_sample=False), {})
        generator.is_main_model_prefill = True
        positions = torch.arange(grown.shape[1])[None]
        with torch.no_grad():
            candidates, theirs = generator.get_candidates(grown, model_kwargs={"position_ids": positions},
                                                          model_outputs=outputs, is_first_iteration=False,
                                                          n_last_matches=0)
        head = HeadModel(mtp_head(model))
        source = CachedModel(model, hp.compat.new_dynamic_cache(model), role="target")
        runner = HeadRunner(CachedModel(head, hp.compat.new_dynamic_cache(head), role="head"), source)
        with torch.no_grad():
            ours = runner.logits_rows({0: (grown[0], 1)})[0]
        assert int(ours.argmax(-1)) == int(candidates[0, -1]), length
        torch.testing.assert_close(ours[0], theirs[0, 0].float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("runner", ["dynamic", "static"])
def test_an_mtp_level_is_exact_in_a_batch(runner, deepseek):
    model, _ = deepseek
    head = hp.levels.draft_head("mtp", verifier=model)
    rows = [prompt(length, seed=80 + length, vocab=64)[0] for length in (6, 2, 9)]
    ids, mask = left_padded(rows)
    options = dict(do_sample=False, max_new_tokens=16, eos_token_id=None)
    out = _generate(model, ids, mask, [head], runner, **options)
    assert torch.equal(out.sequences, model.generate(ids, attention_mask=mask, pad_token_id=PAD, **options))
    assert out.polybasic_stats.levels[1].proposed > 0


def test_mtp_is_refused_for_a_model_without_mtp_layers(head_chain):
    with pytest.raises(ValueError, match="no num_mtp_layers"):
        hp.levels.draft_head("mtp", verifier=head_chain[0])


def test_a_second_call_with_a_head_compiles_no_graph(head_chain):
    """Compiled forwards: the level above the head returns its hidden states out of the same graphs, made
    the first time each width comes up; a second call that meets the same widths (the same prompt: the same
    rounds) makes none: nothing of a call (its feature stores, its head runner) is a graph's guard."""
    from torch._dynamo.utils import counters

    target, copy, head, _ = head_chain
    config = dict(schedule="constant", num_draft_tokens=3, block_threshold=3)
    graphs = []
    for seed in (1, 1):
        ids = prompt(7, seed=seed)
        before = counters["stats"]["unique_graphs"]
        out = _generate(target, ids, torch.ones_like(ids), [copy, head], "compiled", config=config, do_sample=False,
                        max_new_tokens=16, eos_token_id=None)
        graphs.append(counters["stats"]["unique_graphs"] - before)
        assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=16, eos_token_id=None,
                                                          pad_token_id=PAD))
        assert [level.runner for level in out.polybasic_stats.levels] == ["static, compiled"] * 3
    assert graphs[0] > 0 and graphs[1] == 0, graphs


def test_a_compiled_head_makes_graphs_per_width_not_per_round():
    """The head's features are fed outside its compiled forward (`hf_polybasic.runners.head._fed`): a
    traced feed guarded on each round's positions and made a graph per round, until dynamo's recompile
    limit made the head fall back uncompiled (issue 45). Over calls of other prompts and budgets, at
    most two graphs (its forward either side of the feed) per new (model, width), none for a call that
    meets no new width, and every level stays compiled."""
    from torch._dynamo.utils import counters

    target, copy = tiny_chain("llama", 2, seed=5, noises=(0.08,))
    head = distilled_head(target, steps=40)
    seen, graphs, new_pairs = set(), [], []
    for length, budget in [(7, 16), (11, 30), (7, 16)]:  # the third meets no new width
        ids = prompt(length, seed=length)
        before = counters["stats"]["unique_graphs"]
        out = _generate(target, ids, torch.ones_like(ids), [head], "compiled", do_sample=False, max_new_tokens=budget,
                        eos_token_id=None)
        assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=budget, eos_token_id=None,
                                                          pad_token_id=PAD))
        assert [level.runner for level in out.polybasic_stats.levels] == ["static, compiled"] * 2
        pairs = {(index, width) for index, level in enumerate(out.polybasic_stats.levels) for width in level.forward_widths}
        graphs.append(counters["stats"]["unique_graphs"] - before)
        new_pairs.append(len(pairs - seen))
        seen |= pairs
    assert all(made <= 2 * new for made, new in zip(graphs, new_pairs)), (graphs, new_pairs)
    assert graphs[-1] == 0


def test_the_planner_measures_a_head_on_its_verifiers_features(head_chain):
    """`hp.profile` reads a head as it drafts: teacher-forced on the target's own text with the target's
    hidden states as its features (`HeadModel.teacher_forced`: the logits its runner computes with every
    feature real), so its agreement is the head's; the plan can place it."""
    from hf_polybasic.runners.dynamic import CachedModel
    from hf_polybasic.runners.head import HeadRunner

    target, copy, head, _ = head_chain
    text = target.generate(prompt(12, seed=6), do_sample=False, max_new_tokens=12, pad_token_id=PAD)[0]
    source = CachedModel(target, hp.compat.new_dynamic_cache(target), role="target")
    runner = HeadRunner(CachedModel(head, hp.compat.new_dynamic_cache(head), role="head"), source)
    with torch.no_grad():
        drafting = runner.logits_rows({0: (text, text.shape[0] - 1)})[0]  # every position, features all real
        forced = head.teacher_forced(text[None])[0, 1:]
    torch.testing.assert_close(drafting, forced, rtol=1e-4, atol=1e-4)
    measured = hp.profile(target, {"mid": copy, "head": head}, None, [prompt(6, seed=4), prompt(9, seed=5)],
                          do_sample=False, max_new_tokens=24, repeats=1, progress=False,
                          generate_kwargs=dict(pad_token_id=PAD))
    assert measured.acceptance_rate("target", "head") > 0.2
    assert any("head" in prediction.chain for prediction in hp.plan(measured).ranking)
