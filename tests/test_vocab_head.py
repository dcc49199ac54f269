"""`restricted_vocabulary`: a drafter whose output layer scores a subset S of the ids, still lossless.

The view's logits are the original's on S and -inf elsewhere, for every kind of output layer; the
original model is untouched; S grows with what the model is fed; greedy chains with a restricted
level equal plain generate; sampling through one is distributed as the target's (and a drafter that
samples from the restricted distribution but reports the unrestricted one is caught); positions
where the processors leave no id of S finite are left to the level above.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers import (
    ALPHA,
    SAMPLES,
    SETTINGS,
    STEPS,
    VOCAB,
    assert_every_level_took_part,
    assert_rows_as_alone,
    chi_square_p_value,
    left_padded,
    sample_counts,
)

import hf_polybasic as hp
from hf_polybasic import compat
from hf_polybasic.models import packed as cpu, vocab_head
from hf_polybasic.decoding.build import ChainParts
from hf_polybasic.decoding.round import ModelDrafter
from hf_polybasic.generation import make_generate
from hf_polybasic.levels import quantized_copy, restricted_vocabulary
from hf_polybasic.processing import process_positions
from hf_polybasic.testing import EOS, PAD, make_chain, make_target, prompt
from hf_polybasic.models.vocab_head import RestrictedLinear

KINDS = ["fp32", "bf16", "int8-dynamic", "packed-fp32", "packed-bf16"]
CONSTANT = dict(schedule="constant", num_draft_tokens=3, block_threshold=3)


def build(kind: str, tied: bool):
    model = make_target("qwen2", seed=5, tied=tied)
    if kind == "bf16":
        return model.to(torch.bfloat16)
    if kind == "int8-dynamic":
        return quantized_copy(model, "int8-dynamic")
    if kind.startswith("packed"):
        dtype = torch.bfloat16 if kind == "packed-bf16" else torch.float32
        if not compat.onednn_supports(dtype):
            pytest.skip(f"no oneDNN {dtype} kernels here")
        return cpu.pack_linear_layers(model.to(dtype))
    return model


def outside(ids: torch.LongTensor, width: int) -> torch.Tensor:
    mask = torch.ones(width, dtype=torch.bool)
    mask[ids] = False
    return mask


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_logits_are_the_originals_on_s_and_minus_inf_elsewhere(kind, tied):
    model = build(kind, tied)
    ranking = torch.randperm(96, generator=torch.Generator().manual_seed(1)).tolist()
    for restricted in (restricted_vocabulary(model, keep=30), restricted_vocabulary(model, keep=30, ranking=ranking)):
        assert isinstance(restricted.get_output_embeddings(), RestrictedLinear)
        ids = prompt(7, seed=3)
        with torch.no_grad():
            full, mine = model(ids).logits, restricted(ids).logits  # the prompt's tokens join S first
        kept = restricted.get_output_embeddings().token_ids
        assert mine.shape == full.shape and mine.dtype == full.dtype
        assert set(ids[0].tolist()) <= set(kept.tolist())
        torch.testing.assert_close(mine[..., kept], full[..., kept])  # the same products, maybe summed in another order
        assert bool(torch.isneginf(mine[..., outside(kept, 96)]).all())


def test_the_ranked_rows_of_a_float_head_are_the_shared_weight_itself():
    """No copy of the ranked rows: a change to the original's weight shows in the view's logits
    (rows added later are gathered copies of the few rows they need)."""
    model = make_target("qwen2", seed=5)
    restricted = restricted_vocabulary(model, keep=40, grow=False)
    ids = prompt(4, seed=1)
    with torch.no_grad():
        before = restricted(ids).logits[0, -1, 3]
        model.lm_head.weight[3] *= 2
        after = restricted(ids).logits[0, -1, 3]
    assert torch.allclose(after, 2 * before)


def test_an_int8_head_with_tied_embeddings_keeps_no_copy_of_its_weight():
    tied = restricted_vocabulary(build("int8-dynamic", tied=True), keep=30).get_output_embeddings()
    untied = restricted_vocabulary(build("int8-dynamic", tied=False), keep=30).get_output_embeddings()
    assert tied._rows._stored is None  # rows come from the embedding, re-quantized exactly
    assert untied._rows._stored is not None


@pytest.mark.parametrize("kind", ["fp32", "int8-dynamic"])
def test_the_original_model_is_untouched(kind):
    model = build(kind, tied=True)
    head = model.get_output_embeddings()
    ids = prompt(9, seed=4)
    with torch.no_grad():
        before = model(ids).logits
    options = dict(do_sample=False, max_new_tokens=12, eos_token_id=None)
    reference = model.generate(ids, **options)
    restricted = restricted_vocabulary(model, keep=20)
    with torch.no_grad():
        restricted(ids)
    restricted.generate(ids, **options)
    assert model.get_output_embeddings() is head and not isinstance(head, RestrictedLinear)
    assert not model._forward_pre_hooks and not model._forward_hooks
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert torch.equal(model.generate(ids, **options), reference)
    assert restricted.model is model.model  # the decoder is shared, not copied


def test_s_grows_with_fed_tokens_and_starts_afresh_with_each_sequence():
    model = make_target("qwen2", seed=5)
    restricted = restricted_vocabulary(model, keep=20)
    head = restricted.get_output_embeddings()
    assert set(head.token_ids.tolist()) == set(range(20))  # EOS, BOS and PAD are ids 2, 1, 0
    ids = torch.tensor([[5, 60, 61, 60, 95]])
    out = restricted.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8, eos_token_id=None)
    fed = set(out[0, :-1].tolist())  # every token but the last was fed
    assert fed | set(range(20)) == set(head.token_ids.tolist())
    with torch.no_grad():
        full = model(out).logits[0, -1]
        mine = restricted(out).logits[0, -1]  # no cache: S is kept and the new last token added
    kept = head.token_ids
    torch.testing.assert_close(mine[kept], full[kept])
    assert bool(torch.isneginf(mine[outside(kept, 96)]).all())
    before = len(head)
    assert head.add(torch.tensor([60, 61, 70])) == 1 and len(head) == before + 1  # only the new row is gathered
    restricted.generate(torch.tensor([[7, 8]]), do_sample=False, max_new_tokens=1, eos_token_id=None)
    assert set(head.token_ids.tolist()) == set(range(20))  # a new sequence on an empty cache: S afresh


def test_special_tokens_and_given_ids_are_always_kept():
    from hf_polybasic.testing import make_tokenizer

    model = make_target("qwen2", seed=5)
    model.generation_config.eos_token_id = [EOS, 77]
    restricted = restricted_vocabulary(model, keep=10, tokenizer=make_tokenizer(), always=[90], grow=False)
    assert {77, 90} <= set(restricted.get_output_embeddings().token_ids.tolist())
    with pytest.raises(ValueError, match="keep"):
        restricted_vocabulary(model, keep=0)
    with pytest.raises(ValueError, match="outside"):
        restricted_vocabulary(model, keep=3, ranking=[1, 2, 500])


# --- chains: greedy ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chain():
    return make_chain("qwen2", depth=3, seed=11)


def _greedy_options():
    return dict(do_sample=False, max_new_tokens=40, eos_token_id=None)


@pytest.mark.parametrize("where", ["drafter of 2", "drafter of 3", "intermediate of 3", "both of 3"])
def test_greedy_chains_with_a_restricted_level_equal_plain_generate(where, chain):
    target, mid, draft = chain
    restrict = lambda model: restricted_vocabulary(model, keep=48)  # noqa: E731  half of the 96 ids
    assistants = {
        "drafter of 2": [restrict(mid)],
        "drafter of 3": [mid, restrict(draft)],
        "intermediate of 3": [restrict(mid), draft],
        "both of 3": [restrict(mid), restrict(draft)],
    }[where]
    for seed in range(3):
        ids = prompt(6, seed=seed)
        out = target.generate(ids, custom_generate=hp.generate, assistant_models=assistants,
                              polybasic_config=hp.PolybasicConfig(**CONSTANT), **_greedy_options())
        assert torch.equal(out, target.generate(ids, **_greedy_options()))
        assert_every_level_took_part(hp.last_stats(target), rejections=False)


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_drafter_left_no_token_of_s_proposes_nothing_there(do_sample, chain):
    """bad_words_ids ban every id of S (grow=False keeps S fixed): each draft position has only
    -inf scores, so the drafter proposes nothing and the target decodes alone, exactly."""
    target, mid, _ = chain
    restricted = restricted_vocabulary(mid, keep=24, grow=False)
    banned = [[token] for token in restricted.get_output_embeddings().token_ids.tolist()]
    ids = prompt(6, seed=1)
    options = dict(max_new_tokens=16, eos_token_id=None, bad_words_ids=banned, do_sample=do_sample)
    torch.manual_seed(0)
    out = target.generate(ids, custom_generate=hp.generate, assistant_models=[restricted],
                          polybasic_config=hp.PolybasicConfig(**CONSTANT), **options)
    stats = hp.last_stats(target)
    assert stats.levels[1].proposed == 0
    new = out[0, ids.shape[1]:]
    assert new.shape[0] == 16 and not set(new.tolist()) & {b[0] for b in banned}
    if not do_sample:
        assert torch.equal(out, target.generate(ids, **options))


def test_a_drafter_left_no_token_of_s_at_some_positions_drafts_at_the_others(chain):
    """Only every other position bans S: the drafter drafts where it can and stops where it cannot."""
    target, mid, _ = chain
    restricted = restricted_vocabulary(mid, keep=40, grow=False)
    kept = restricted.get_output_embeddings().token_ids.tolist()
    ids = prompt(6, seed=2)
    options = dict(max_new_tokens=24, eos_token_id=None, do_sample=False)

    class BanSAtOddLengths:
        def __call__(self, input_ids, scores):
            if input_ids.shape[-1] % 2:
                scores = scores.clone()
                scores[..., kept] = float("-inf")
            return scores

    from transformers import LogitsProcessorList

    processors = LogitsProcessorList([BanSAtOddLengths()])
    out = target.generate(ids, custom_generate=hp.generate, assistant_models=[restricted], logits_processor=processors,
                          polybasic_config=hp.PolybasicConfig(**CONSTANT), **options)
    assert torch.equal(out, target.generate(ids, logits_processor=processors, **options))
    assert hp.last_stats(target).levels[1].proposed > 0


def test_a_restricted_intermediate_level_left_nothing_to_sample_says_so(chain):
    target, mid, draft = chain
    restricted = restricted_vocabulary(mid, keep=24, grow=False)
    banned = [[token] for token in restricted.get_output_embeddings().token_ids.tolist()]
    with pytest.raises(ValueError, match="bottom of the chain"):
        target.generate(prompt(6, seed=1), do_sample=True, max_new_tokens=8, eos_token_id=None, bad_words_ids=banned,
                        custom_generate=hp.generate, assistant_models=[restricted, draft],
                        polybasic_config=hp.PolybasicConfig(**CONSTANT))


# --- chains: sampling -------------------------------------------------------------------------------
KEEP = 4  # of the 8 ids: S = {0, 1, 2, 3}, which leaves out tokens the target samples often


def _restricted_of(model):
    return restricted_vocabulary(model, keep=KEEP, grow=False)


def test_s_leaves_out_tokens_the_target_samples(exact_distribution, distribution_models):
    """The distribution tests below are only meaningful if the target samples ids outside S."""
    kept = _restricted_of(distribution_models[1]).get_output_embeddings().token_ids.tolist()
    assert kept == list(range(KEEP))
    joint = exact_distribution("temperature+top_k+top_p").reshape((VOCAB,) * STEPS)
    assert joint[KEEP:].sum() > 0.2  # the first token falls outside S this often


@pytest.mark.parametrize("setting, where", [
    ("temperature+top_k+top_p", "drafter of 2"),
    ("repetition_penalty", "drafter of 3"),
    ("temperature+top_k+top_p", "intermediate of 3"),
])
def test_sampling_through_a_restricted_level_is_the_targets_distribution(setting, where, distribution_models,
                                                                          exact_distribution):
    target, m2, m3, _ = distribution_models
    assistants = {
        "drafter of 2": [_restricted_of(m2)],
        "drafter of 3": [m2, _restricted_of(m3)],
        "intermediate of 3": [_restricted_of(m2), m3],
    }[where]
    counts, stats = sample_counts(target, setting, assistants, seed=11, schedule="constant", num_draft_tokens=2,
                                  block_threshold=2)
    print(setting, where, assert_every_level_took_part(stats))
    assert chi_square_p_value(counts, exact_distribution(setting)) > ALPHA


class UnrestrictedReportDrafter(ModelDrafter):
    """The bug a restricted drafter must not have: it samples from the restricted processed
    distribution (S = the first KEEP ids) but reports the unrestricted one as q."""

    def draw(self, row, grown, logits, *args):
        logits = logits.to(grown.device)
        self._unrestricted = process_positions(self.rules[row].processors, grown, grown.shape[0], logits).softmax(-1)
        restricted = logits.clone()
        restricted[..., KEEP:] = float("-inf")
        return super().draw(row, grown, restricted, *args)

    def proposal_probs(self, probs, logits):
        return self._unrestricted


def test_negative_control_reporting_the_unrestricted_q_is_caught(distribution_models, exact_distribution):
    lossy = make_generate(ChainParts(model_drafter=UnrestrictedReportDrafter))
    setting = "temperature+top_k+top_p"
    counts, stats = sample_counts(distribution_models[0], setting, distribution_models[1:2], seed=11, generate=lossy,
                                  schedule="constant", num_draft_tokens=2)
    assert_every_level_took_part(stats)
    assert chi_square_p_value(counts, exact_distribution(setting)) < ALPHA


def test_sampled_tokens_of_a_restricted_chain_are_ones_the_target_can_sample(distribution_models):
    """A cheap sanity check next to the chi-square test: top_k=5 bounds what may appear."""
    target, m2, *_ = distribution_models
    ids = prompt(3, seed=5, vocab=VOCAB)
    torch.manual_seed(3)
    out = target.generate(ids, custom_generate=hp.generate, assistant_models=[_restricted_of(m2)],
                          polybasic_config=hp.PolybasicConfig(**CONSTANT), do_sample=True, max_new_tokens=STEPS,
                          num_return_sequences=SAMPLES // 10, **SETTINGS["temperature+top_k+top_p"])
    from helpers import assert_target_could_sample

    assert_target_could_sample(target, out, ids.shape[1], top_k=5)


def test_the_coverage_tools_teacher_forced_agreement_is_the_restricted_drafters_own():
    """`python -m benchmarks vocab-coverage --drafter` computes a restricted drafter's greedy agreement from
    one teacher-forced forward; it equals drafting with the `restricted_vocabulary` view itself."""
    from benchmarks.levels_table import greedy_agreement
    from benchmarks.vocab_coverage import drafter_agreement

    target, mid, _ = make_chain("qwen2", 3, seed=3)
    continuations = []
    for seed in range(3):
        ids = prompt(6, seed=seed)
        continuations.append((ids, target.generate(ids, **dict(_greedy_options(), max_new_tokens=20))[0, 6:]))
    fast = drafter_agreement(mid, [ids[0].tolist() for ids, _ in continuations],
                             [out.tolist() for _, out in continuations], [20, 40], special={0, 1, 2}, k=5)
    assert fast["all"] == pytest.approx(greedy_agreement(mid, continuations, 5, 1))
    for keep in (20, 40):
        assert fast[keep] == pytest.approx(greedy_agreement(restricted_vocabulary(mid, keep), continuations, 5, 1))


# --- the default: PolybasicConfig(drafter_vocabulary=...) restricts the bottom model ------------------
def test_the_default_config_drafts_through_a_restricted_view_of_a_wide_bottom_model(chain):
    """drafter_vocabulary=32 on the 96-id tiny chain (the default, 65,536, does the same for
    vocabularies of 131,072 ids and more): the bottom model drafts through one cached view, S grows
    with the text, the output is plain generate's and the model given is untouched."""
    target, mid, draft = chain
    config = hp.PolybasicConfig(**CONSTANT, drafter_vocabulary=32)
    view = vocab_head.drafting_view(draft, 32)
    assert view is vocab_head.drafting_view(draft, 32) and view is not draft
    assert len(view.get_output_embeddings()) >= 32
    for seed in range(3):
        ids = prompt(6, seed=seed + 7)
        out = target.generate(ids, custom_generate=hp.generate, assistant_models=[mid, draft],
                              polybasic_config=config, **_greedy_options())
        assert torch.equal(out, target.generate(ids, **_greedy_options()))
        assert_every_level_took_part(hp.last_stats(target), rejections=False)
        # the view drafted: it was fed this call's prompt (S grew beyond the first 32 ids by it)
        fed = set(ids[0].tolist()) - set(range(32))
        assert fed and fed <= set(view.get_output_embeddings().token_ids.tolist())
    assert type(draft.get_output_embeddings()) is torch.nn.Linear


def test_the_drafting_view_is_left_out_where_it_would_not_pay_or_change_how_the_model_runs(chain):
    target, mid, draft = chain
    assert vocab_head.drafting_view(draft, 65536) is None  # 96 ids: nothing to cut
    assert vocab_head.drafting_view(draft, 49) is None  # fewer than twice the ids kept
    hooked = make_chain("qwen2", depth=2, seed=3)[1]
    hooked.register_forward_pre_hook(lambda module, args: None)  # accelerate's device hooks sit here
    assert vocab_head.drafting_view(hooked, 32) is None
    lookup = hp.PolybasicConfig(**CONSTANT, drafter_vocabulary=32, prompt_lookup=True)
    from hf_polybasic.request import with_restricted_drafter

    # sampling, a model above a lookup verifies by sampling: it keeps its whole vocabulary
    assert with_restricted_drafter([mid, draft], lookup, samples=True) == [mid, draft]
    copies = hp.drafters.PromptLookup()
    assert with_restricted_drafter([mid, draft, copies], hp.PolybasicConfig(drafter_vocabulary=32), samples=True) == [
        mid, draft, copies]
    assert with_restricted_drafter([copies], hp.PolybasicConfig(drafter_vocabulary=32)) == [copies]
    assert with_restricted_drafter([mid, draft], hp.PolybasicConfig(drafter_vocabulary=None)) == [mid, draft]
    for assistants, config, samples in (([mid, draft], hp.PolybasicConfig(drafter_vocabulary=32), True),
                                        ([mid, draft], lookup, False)):
        restricted = with_restricted_drafter(assistants, config, samples=samples)
        assert restricted[0] is mid and isinstance(restricted[1].get_output_embeddings(), RestrictedLinear)
    restricted = with_restricted_drafter([mid, draft, copies], hp.PolybasicConfig(drafter_vocabulary=32))
    assert restricted[0] is mid and restricted[2] is copies
    assert isinstance(restricted[1].get_output_embeddings(), RestrictedLinear)


@pytest.mark.parametrize("lookup", ["given", "added"])
def test_greedy_the_model_above_a_lookup_verifies_through_its_drafting_view(lookup, chain):
    """Greedy, the bottom model above a prompt lookup drafts and verifies its copies through its
    restricted view (`request.with_restricted_drafter`): its argmax over S is only a proposal the
    target decides, so the output is plain generate's, also where a processor bans the view's ranked
    ids (every odd length), which leaves it mostly -inf scores to verify with."""
    target, mid, draft = chain
    view = vocab_head.drafting_view(draft, 32)
    calls = []
    handle = view.get_output_embeddings().register_forward_hook(lambda *args: calls.append(1))

    class BanRankedAtOddLengths:
        def __call__(self, input_ids, scores):
            if input_ids.shape[-1] % 2:
                scores = scores.clone()
                scores[..., :32] = float("-inf")
            return scores

    from transformers import LogitsProcessorList

    config = hp.PolybasicConfig(**CONSTANT, drafter_vocabulary=32, prompt_lookup=lookup == "added")
    assistants = [mid, draft] + ([hp.drafters.PromptLookup(num_tokens=3)] if lookup == "given" else [])
    try:
        for seed, processors in ((3, None), (4, LogitsProcessorList([BanRankedAtOddLengths()]))):
            ids = prompt(12, seed=seed)
            options = dict(_greedy_options(), logits_processor=processors)
            out = target.generate(ids, custom_generate=hp.generate, assistant_models=assistants,
                                  polybasic_config=config, **options)
            assert torch.equal(out, target.generate(ids, **options))
            assert_every_level_took_part(hp.last_stats(target), rejections=False)
    finally:
        handle.remove()
    assert calls  # the view, not the model given, ran as the lookup's verifier
    assert type(draft.get_output_embeddings()) is torch.nn.Linear


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@given(rows=st.integers(1, 4), seed=st.integers(0, 1000), lookup=st.sampled_from(["given", "added"]),
       schedule=st.sampled_from(["constant", "heuristic"]), penalty=st.sampled_from([1.0, 1.3]),
       eos_step=st.one_of(st.none(), st.integers(0, 23)))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_a_batch_through_the_view_above_a_lookup_equals_plain_generate(arch, rows, seed, lookup, schedule, penalty,
                                                                       eos_step, shared_models):
    """Greedy, left-padded ragged rows (full attention, grouped heads, gemma3's sliding window), with a
    repetition penalty and an EOS some row emits mid-output: the chain whose model above a prompt lookup
    verifies through its restricted view decodes each row as plain generate decodes it alone and equals plain
    batched generate where that release keeps the padding out of the penalty, and the view ran. (Schedules that
    always draft: the cost-aware one may let a batch of these tiny models decode plainly, which would
    leave the view unrun.)"""
    target, mid, draft = shared_models.chain(arch, 3, seed=23)
    view = vocab_head.drafting_view(draft, 32)
    assert view is not None  # every tiny architecture here has 96 ids, at least twice the 32 kept
    prompts = [prompt(2 + (7 * row + seed) % 11, seed=seed + row)[0] for row in range(rows)]
    ids, mask = left_padded(prompts)
    options = dict(do_sample=False, max_new_tokens=24, eos_token_id=EOS, pad_token_id=PAD, repetition_penalty=penalty)
    plain = target.generate(ids, attention_mask=mask, **options)
    if eos_step is not None:
        step = min(eos_step, plain.shape[1] - ids.shape[1] - 1)  # within what plain emitted (it may end early)
        options["eos_token_id"] = [int(plain[0, ids.shape[1] + step]), EOS]
        plain = target.generate(ids, attention_mask=mask, **options)
    config = hp.PolybasicConfig(num_draft_tokens=3, block_threshold=4, schedule=schedule, drafter_vocabulary=32,
                                prompt_lookup=lookup == "added")
    assistants = [mid, draft] + ([hp.drafters.PromptLookup(num_tokens=3)] if lookup == "given" else [])
    calls = []
    handle = view.get_output_embeddings().register_forward_hook(lambda *args: calls.append(1))
    try:
        out = target.generate(ids, attention_mask=mask, custom_generate=hp.generate, assistant_models=assistants,
                              polybasic_config=config, **options)
    finally:
        handle.remove()
    # each row as plain generate decodes it alone; and plain batched generate, except where a release hands
    # the left padding to the repetition penalty (the pad id counts as seen: transformers 4.57, test_oracle's
    # TRANSFORMERS_BATCH_QUIRKS, `compat.REPETITION_PENALTY_SKIPS_ROW_PADDING`)
    assert_rows_as_alone(target, out, prompts, ids, options)
    if penalty == 1.0 or compat.REPETITION_PENALTY_SKIPS_ROW_PADDING:
        assert torch.equal(out, plain)
    assert calls  # the view, not the model given, ran above the lookup


def test_sampling_keeps_the_model_above_a_lookup_whole_where_its_view_would_have_nothing(chain):
    """Sampling, a verifying level must emit a token wherever the processors allow one. Bad words that
    ban every id but four the view does not start with leave it nothing at the first position: the
    chain keeps the model whole above the lookup and decodes. Negative control: the view itself in
    that place stops the call."""
    target, mid, draft = chain
    ids = prompt(6, seed=5)
    view = vocab_head.drafting_view(draft, 32)
    allowed = [t for t in range(32, 96) if t not in set(ids[0].tolist()) | {EOS}][:4]
    options = dict(do_sample=True, max_new_tokens=8, eos_token_id=None,
                   bad_words_ids=[[t] for t in range(96) if t not in allowed])
    lookup = hp.drafters.PromptLookup(num_tokens=3)
    config = hp.PolybasicConfig(**CONSTANT, drafter_vocabulary=32)
    torch.manual_seed(0)
    out = target.generate(ids, custom_generate=hp.generate, assistant_models=[mid, draft, lookup],
                          polybasic_config=config, **options)
    assert set(out[0, ids.shape[1]:].tolist()) <= set(allowed)
    with pytest.raises(ValueError, match="bottom of the chain"):
        target.generate(ids, custom_generate=hp.generate, assistant_models=[mid, view, lookup],
                        polybasic_config=hp.PolybasicConfig(**CONSTANT, drafter_vocabulary=None), **options)


def test_the_drafting_view_of_a_model_cast_between_calls_is_made_again():
    """The view holds the rows of the output layer it was made from: after ``model.to(dtype)`` between two
    calls every later call failed (``expected scalar type Float but found BFloat16``). A cast, a move or an
    in-place quantization of the model makes a new view (`hf_polybasic.models.fingerprint`); a model left as
    it was keeps its view."""
    target, mid, draft = make_chain("qwen2", depth=3, seed=12)
    config = hp.PolybasicConfig(**CONSTANT, drafter_vocabulary=32)
    ids = prompt(6, seed=4)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for model in (target, mid, draft):
            model.to(dtype)
        view = vocab_head.drafting_view(draft, 32)
        assert view is vocab_head.drafting_view(draft, 32)
        assert view.get_output_embeddings()(torch.zeros(1, draft.config.hidden_size, dtype=dtype)).dtype == dtype
        out = target.generate(ids, custom_generate=hp.generate, assistant_models=[mid, draft],
                              polybasic_config=config, **_greedy_options())
        assert_every_level_took_part(hp.last_stats(target), rejections=False, acceptances=False)
        if dtype != torch.bfloat16:  # greedy in bf16 is exact only up to the rounding of a batched forward
            assert torch.equal(out, target.generate(ids, **_greedy_options()))


@pytest.mark.parametrize("value", [0, -3, True, 2.5, "65536"])
def test_drafter_vocabulary_must_be_none_or_a_positive_int(value):
    with pytest.raises(ValueError, match="PolybasicConfig.drafter_vocabulary must be None or an int >= 1"):
        hp.PolybasicConfig(drafter_vocabulary=value)


def test_sampling_with_the_default_restricted_drafter_is_the_targets_distribution(distribution_models,
                                                                                  exact_distribution):
    target, m2, *_ = distribution_models
    setting = "temperature+top_k+top_p"
    counts, stats = sample_counts(target, setting, [m2], seed=13, schedule="constant", num_draft_tokens=2,
                                  drafter_vocabulary=KEEP)
    assert_every_level_took_part(stats)
    assert chi_square_p_value(counts, exact_distribution(setting)) > ALPHA


@pytest.mark.parametrize("kind", ["fp32", "int8-dynamic", "packed-fp32"])
def test_a_biased_output_layer_keeps_its_bias_on_s(kind):
    model = make_target("qwen2", seed=5, tied=False)
    with torch.no_grad():
        model.lm_head.bias = torch.nn.Parameter(torch.randn(96, generator=torch.Generator().manual_seed(2)) * 3)
    if kind == "int8-dynamic":
        model = quantized_copy(model, "int8-dynamic")
    elif kind == "packed-fp32":
        if not compat.onednn_supports(torch.float32):
            pytest.skip("no oneDNN fp32 kernels here")
        model = cpu.pack_linear_layers(model)
    restricted = restricted_vocabulary(model, keep=30)
    ids = prompt(7, seed=3)  # fed ids join S as rows gathered later: the bias of those rows too
    with torch.no_grad():
        full, mine = model(ids).logits, restricted(ids).logits
    kept = restricted.get_output_embeddings().token_ids
    assert len(kept) > 30
    torch.testing.assert_close(mine[..., kept], full[..., kept])


def test_what_cannot_be_restricted_is_named():
    class NoHead(torch.nn.Module):
        def get_output_embeddings(self):
            return None

    with pytest.raises(TypeError, match="restricted_vocabulary: NoHead has no output layer"):
        restricted_vocabulary(NoHead())
    model = make_target("qwen2", seed=5, tied=False)
    model.lm_head = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(32, 96))  # not a plain nn.Linear
    model.lm_head.out_features = 96
    with pytest.raises(TypeError, match=r"supported are float nn.Linear, dynamic int8 \(hf_polybasic.* and "
                                        r"oneDNN-packed \(hf_polybasic\.models\.packed\.pack_linear_layers\) layers"):
        restricted_vocabulary(model)
    stray = make_target("qwen2", seed=5, tied=False)
    outside_layer = torch.nn.Linear(32, 96)
    stray.get_output_embeddings = lambda: outside_layer  # a layer the model's own tree does not hold
    with pytest.raises(TypeError, match="restricted_vocabulary: the output layer is not a submodule of the model"):
        restricted_vocabulary(stray)
    assert not stray._forward_pre_hooks  # and the model is left as it was: no hook, no view


def test_a_model_without_input_embeddings_is_restricted_without_them():
    """Rows gathered later come from the weight itself: no input embedding is needed."""
    from types import SimpleNamespace

    class Bare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config, self.head = SimpleNamespace(), torch.nn.Linear(4, 96)

        def get_output_embeddings(self):
            return self.head

    restricted = restricted_vocabulary(Bare(), keep=10)
    assert isinstance(restricted.get_output_embeddings(), RestrictedLinear)
    assert restricted.get_output_embeddings().token_ids.tolist() == list(range(10))


def test_bos_and_decoder_start_ids_are_always_kept():
    model = make_target("qwen2", seed=5)
    model.config.bos_token_id, model.config.decoder_start_token_id = 91, 92
    kept = restricted_vocabulary(model, keep=10, grow=False).get_output_embeddings().token_ids.tolist()
    assert {91, 92} <= set(kept)
