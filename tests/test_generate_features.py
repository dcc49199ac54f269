"""Everything users pass to `generate` keeps meaning what it means in plain `generate`."""

import threading
import warnings

import pytest
import torch
from hf_polybasic import compat
from hf_polybasic.testing import EOS, PAD, make_chain, make_tokenizer, prompt
from transformers.generation import logits_process as lp
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
    TextStreamer,
    pipeline,
)

import hf_polybasic as hp
from helpers import assert_every_level_took_part

# a constant schedule: on these equal-cost tiny models the cost-aware default would rightly back off,
# and the features would only meet plain decoding
CONFIG = hp.PolybasicConfig(num_draft_tokens=3, block_threshold=4, schedule="constant")


@pytest.fixture
def chain(shared_models):
    return shared_models.chain("llama", 3, seed=11)


@pytest.fixture
def own_chain():
    """A chain of this test's own, for tests that enable or change the models."""
    return make_chain("llama", 3, seed=11)


def polybasic(target, assistants, *args, **kwargs):
    """A polybasic call that also proves the chain ran: whenever 2 or more tokens were generated,
    every level drafted and verified (from the call's statistics)."""
    kwargs.setdefault("polybasic_config", CONFIG)
    out = target.generate(*args, custom_generate=hp.generate, assistant_models=assistants, **kwargs)
    if kwargs.get("max_new_tokens", 0) >= 2:  # the first round of such a call drafts at every level
        assert_chain_ran(target)
    return out


def assert_chain_ran(target):
    assert_every_level_took_part(hp.last_stats(target), rejections=False, acceptances=False)


@pytest.fixture
def enabled(own_chain):
    target, *assistants = own_chain
    hp.enable(target)
    yield target, assistants
    hp.disable(target)


# --- budgets, EOS, stopping ------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [dict(max_new_tokens=1), dict(max_new_tokens=17), dict(max_length=14)])
def test_length_budget_is_exact(budget, chain):
    target, *assistants = chain
    ids = prompt(6, seed=2)
    reference = target.generate(ids, do_sample=False, eos_token_id=None, **budget)
    out = polybasic(target, assistants, ids, do_sample=False, eos_token_id=None, **budget)
    assert torch.equal(out, reference)
    expected = budget.get("max_new_tokens", budget.get("max_length", 0) - ids.shape[1])
    assert out.shape[1] - ids.shape[1] == expected


def test_sampling_respects_budget_and_min_new_tokens(chain):
    target, *assistants = chain
    ids = prompt(4, seed=3)
    torch.manual_seed(0)
    for _ in range(5):
        out = polybasic(target, assistants, ids, do_sample=True, max_new_tokens=12, min_new_tokens=12, eos_token_id=EOS)
        assert out.shape[1] == ids.shape[1] + 12
        assert EOS not in out[0, ids.shape[1] :].tolist()


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_stopping_criteria_stop_mid_block(chain):
    target, *assistants = chain
    ids = prompt(5, seed=4)
    reference = target.generate(ids, do_sample=False, max_new_tokens=30, eos_token_id=None)
    stop_token = int(reference[0, ids.shape[1] + 7])
    criteria = StoppingCriteriaList([StopAfterToken(stop_token)])
    expected = target.generate(ids, do_sample=False, max_new_tokens=30, eos_token_id=None, stopping_criteria=criteria)
    out = polybasic(
        target, assistants, ids, do_sample=False, max_new_tokens=30, eos_token_id=None, stopping_criteria=criteria
    )
    assert torch.equal(out, expected)
    assert out[0, -1] == stop_token


def test_stop_strings_with_tokenizer(enabled):
    target, assistants = enabled
    tokenizer = make_tokenizer()
    ids = prompt(5, seed=5)
    reference = target.generate(ids, do_sample=False, max_new_tokens=30, eos_token_id=None)
    word = tokenizer.decode([int(reference[0, ids.shape[1] + 5])])
    options = dict(do_sample=False, max_new_tokens=30, eos_token_id=None, stop_strings=[word], tokenizer=tokenizer)
    expected = target.generate(ids, **options)  # plain: enable() routes only calls with a chain
    out = target.generate(ids, assistant_models=assistants, polybasic_config=CONFIG, **options)
    assert torch.equal(out, expected)
    assert tokenizer.decode(out[0, ids.shape[1] :]).endswith(word)


def test_custom_logits_processor_is_applied_at_every_level(chain):
    class BanToken(LogitsProcessor):
        def __init__(self, token):
            self.token = token

        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[:, self.token] = -float("inf")
            return scores

    target, *assistants = chain
    ids = prompt(5, seed=6)
    plain = target.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=None)
    banned = int(plain[0, ids.shape[1] + 2])
    processors = LogitsProcessorList([BanToken(banned)])
    reference = target.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=None, logits_processor=processors)
    out = polybasic(
        target, assistants, ids, do_sample=False, max_new_tokens=20, eos_token_id=None, logits_processor=processors
    )
    assert torch.equal(out, reference)
    assert banned not in out[0, ids.shape[1] :].tolist()


def test_use_cache_false_gives_the_same_tokens(chain):
    target, *assistants = chain
    ids = prompt(5, seed=7)
    reference = target.generate(ids, do_sample=False, max_new_tokens=15, eos_token_id=None)
    out = polybasic(target, assistants, ids, do_sample=False, max_new_tokens=15, eos_token_id=None, use_cache=False)
    assert torch.equal(out, reference)


# --- outputs ---------------------------------------------------------------------------------------
def test_return_dict_scores_and_logits_match_plain_generate(chain):
    target, *assistants = chain
    ids = prompt(5, seed=8)
    options = dict(
        do_sample=False,
        max_new_tokens=16,
        eos_token_id=None,
        repetition_penalty=1.2,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    reference = target.generate(ids, **options)
    out = polybasic(target, assistants, ids, **options)
    assert isinstance(out, hp.PolybasicGenerateOutput)
    assert torch.equal(out.sequences, reference.sequences)
    assert len(out.scores) == len(out.logits) == 16
    for mine, theirs in zip(out.scores, reference.scores):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(out.logits, reference.logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert out.polybasic_stats.new_tokens == 16
    assert out.past_key_values is not None


def test_plain_tensor_output_exposes_stats_through_last_stats(chain):
    target, *assistants = chain
    out = polybasic(target, assistants, prompt(4), do_sample=False, max_new_tokens=8, eos_token_id=None)
    assert isinstance(out, torch.Tensor)
    stats = hp.last_stats(target)
    assert stats.new_tokens == 8
    assert "M1" in str(stats) and stats.to_dict()["levels"][0]["role"] == "target"


# --- batches ------------------------------------------------------------------------------------------
def test_left_padded_batch_equals_rows_generated_alone(chain):
    target, *assistants = chain
    tokenizer = make_tokenizer()
    texts = ["hello!there", "ab", "xyz"]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    out = polybasic(target, assistants, **batch, do_sample=False, max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD)
    assert out.shape[0] == 3
    for row, text in enumerate(texts):
        single = tokenizer(text, return_tensors="pt")
        alone = target.generate(**single, do_sample=False, max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD)
        new = alone[0, single.input_ids.shape[1] :]
        width = batch.input_ids.shape[1]
        assert torch.equal(out[row, :width], batch.input_ids[row])
        assert torch.equal(out[row, width : width + new.shape[0]], new)
        assert (out[row, width + new.shape[0] :] == PAD).all()


def test_a_prefix_constraint_is_asked_for_each_row_by_its_own_batch_id(chain):
    """prefix_allowed_tokens_fn(batch_id, ids) gets each row's index, as in the batched generate
    (rows decoded one by one were all asked as batch 0)."""
    target, *assistants = chain
    tokenizer = make_tokenizer()
    texts = ["hello!there", "ab", "xyz"]
    allowed = {0: list(range(3, 30)), 1: list(range(30, 60)), 2: list(range(60, 96))}
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    options = dict(do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=PAD)
    out = polybasic(target, assistants, **batch, prefix_allowed_tokens_fn=lambda b, ids: allowed[b], **options)
    width = batch.input_ids.shape[1]
    for row, text in enumerate(texts):
        single = tokenizer(text, return_tensors="pt")
        alone = target.generate(**single, prefix_allowed_tokens_fn=lambda b, ids, r=row: allowed[r], **options)
        assert set(out[row, width:].tolist()) <= set(allowed[row])
        assert torch.equal(out[row, width:], alone[0, single.input_ids.shape[1] :])


def test_encoder_repetition_penalty_sees_each_rows_own_prompt(chain):
    target, *assistants = chain
    tokenizer = make_tokenizer()
    texts = ["hello!there", "ab", "xyz"]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    options = dict(do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=PAD,
                   encoder_repetition_penalty=0.2, encoder_no_repeat_ngram_size=2)
    out = polybasic(target, assistants, **batch, **options)
    width = batch.input_ids.shape[1]
    for row, text in enumerate(texts):
        single = tokenizer(text, return_tensors="pt")
        alone = target.generate(**single, **options)
        assert torch.equal(out[row, width:], alone[0, single.input_ids.shape[1] :])


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("ignore", [None, 3])
def test_repetition_penalty_of_a_left_padded_batch_skips_each_rows_padding(rows, ignore, chain):
    """transformers 5.x gives `RepetitionPenaltyLogitsProcessor` each row's left padding as
    ``prompt_ignore_length`` (a tensor): a batch crashed, and one padded row skipped real prompt
    tokens (its padding was already removed). A user's int counts tokens of the padded batch."""
    target, *assistants = chain
    tokenizer = make_tokenizer()
    texts = ["ab", "hello!there", "xyz"][:rows] if rows > 1 else ["ab"]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    if rows == 1:  # one row with left padding, as a pipeline's batch of one can send it
        batch = tokenizer(["ab", "hello!there"], return_tensors="pt", padding=True)
        batch = {key: value[:1] for key, value in batch.items()}
    options = dict(do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=PAD)
    if ignore is None and compat.REPETITION_PENALTY_SKIPS_ROW_PADDING:
        # generate's own processor, with each row's padding as prompt_ignore_length
        plain = target.generate(**batch, repetition_penalty=1.5, **options)
        assert torch.equal(polybasic(target, assistants, **batch, repetition_penalty=1.5, **options), plain)
        return
    if ignore is None:  # older releases' batched generate also penalizes the pad id: each row as alone
        out = polybasic(target, assistants, **batch, repetition_penalty=1.5, **options)
        width = batch["input_ids"].shape[1]
        for row in range(len(batch["input_ids"])):
            mask = batch["attention_mask"][row].bool()
            alone = target.generate(batch["input_ids"][row, mask][None], repetition_penalty=1.5, **options)
            assert torch.equal(out[row, width:], alone[0, int(mask.sum()) :])
        return
    given = LogitsProcessorList([lp.RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=ignore)])
    out = polybasic(target, assistants, **batch, logits_processor=given, **options)
    # a user's int counts tokens of the padded batch, so plain batched generate also penalizes the pad
    # id of rows padded beyond it; each row is compared with the row alone, its count shifted by the
    # padding it loses (equal to plain batched generate where the count covers the padding)
    width = batch["input_ids"].shape[1]
    for row in range(len(batch["input_ids"])):
        mask = batch["attention_mask"][row].bool()
        padding = int((~mask).sum())
        own = LogitsProcessorList([lp.RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=max(ignore - padding, 0))])
        alone = target.generate(batch["input_ids"][row, mask][None], logits_processor=own, **options)[0, width - padding :]
        assert torch.equal(out[row, width:], alone)


def test_cache_implementation_static_runs_the_chain_static_and_hands_back_its_cache(chain):
    """``cache_implementation="static"`` is honoured, not ignored: every model decodes on a static cache
    (`hf_polybasic.runners.static`), without a warning, and the call hands back what plain generate's holds:
    the output minus its last token (in a `DynamicCache`, which can be continued)."""
    target, *assistants = chain
    ids = prompt(5, seed=14)
    options = dict(do_sample=False, max_new_tokens=10, eos_token_id=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = polybasic(target, assistants, ids, cache_implementation="static", return_dict_in_generate=True, **options)
    assert torch.equal(out.sequences, target.generate(ids, **options))
    assert {level.runner for level in out.polybasic_stats.levels} == {"static"}
    assert type(out.past_key_values).__name__ == "DynamicCache"
    assert out.past_key_values.get_seq_length() == out.sequences.shape[1] - 1


def test_the_returned_cache_no_longer_records_its_past(shared_models):
    target, *assistants = shared_models.chain("gemma3", 3, seed=11)  # sliding-window layers
    out = polybasic(target, assistants, prompt(5, seed=15), do_sample=False, max_new_tokens=12, eos_token_id=None,
                    return_dict_in_generate=True)
    layers = out.past_key_values.layers
    assert not any(getattr(layer, "record_past", False) for layer in layers)


def test_min_new_tokens_counts_new_tokens_of_each_padded_row(chain):
    target, *assistants = chain
    tokenizer = make_tokenizer()
    texts = ["hello!there", "ab", "xyz"]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    singles = [tokenizer(text, return_tensors="pt") for text in texts]
    # the short row "ab" (9 padding tokens in the batch): pick a token it first produces at step
    # k >= 3, make it the EOS and ask for min_new_tokens=k, so alone it stops after exactly k + 1
    # tokens; counting its padding as new tokens would keep it going 9 steps longer
    free = target.generate(**singles[1], do_sample=False, max_new_tokens=12, eos_token_id=None)[0, 2:].tolist()
    k = next(i for i, token in enumerate(free) if i >= 3 and token not in free[:i])
    options = dict(do_sample=False, max_new_tokens=14, min_new_tokens=k, eos_token_id=free[k], pad_token_id=PAD)
    alone = [target.generate(**single, **options)[0, single.input_ids.shape[1] :] for single in singles]
    assert alone[1].shape[0] == k + 1
    out = polybasic(target, assistants, **batch, **options)
    width = batch.input_ids.shape[1]
    for row, tokens in enumerate(alone):
        assert torch.equal(out[row, width : width + tokens.shape[0]], tokens)
        assert (out[row, width + tokens.shape[0] :] == PAD).all()


@pytest.mark.parametrize("lengths", [(1, 5), (1, 1, 3), (1,)])
def test_forced_bos_follows_plain_batched_generate_on_a_padded_row_of_one_token(lengths, chain):
    """``forced_bos_token_id`` forces BOS where the prefix its processor sees is one token long: in a padded
    batch a row of one real token is wider, so plain generate does not force it there (the chain did, and
    the row's tokens then differed); a batch of one-token rows, unpadded, is forced in every row."""
    from helpers import left_padded

    target, *assistants = chain
    prompts = [prompt(length, seed=20 + row)[0] for row, length in enumerate(lengths)]
    ids, mask = left_padded(prompts)
    options = dict(attention_mask=mask, do_sample=False, max_new_tokens=6, pad_token_id=PAD, eos_token_id=None,
                   forced_bos_token_id=EOS + 5)
    expected = target.generate(ids, **options)
    assert torch.equal(polybasic(target, assistants, ids, **options), expected)
    forced = (expected[:, ids.shape[1]] == EOS + 5).tolist()
    assert forced == [ids.shape[1] == 1] * len(lengths)


def test_num_return_sequences_samples_independent_rows(chain):
    target, *assistants = chain
    ids = prompt(4, seed=9)
    torch.manual_seed(1)
    out = polybasic(target, assistants, ids, do_sample=True, max_new_tokens=10, num_return_sequences=4, eos_token_id=None)
    assert out.shape == (4, ids.shape[1] + 10)
    assert len({tuple(row.tolist()) for row in out}) > 1


def test_right_padding_is_a_clear_error(chain):
    target, *assistants = chain
    ids = torch.tensor([[5, 6, 7], [8, 9, PAD]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    with pytest.raises(ValueError, match="left padding"):
        polybasic(target, assistants, ids, attention_mask=mask, do_sample=False, max_new_tokens=3, pad_token_id=PAD)


# --- streamers ----------------------------------------------------------------------------------------
def test_text_streamer_prints_the_generated_text(capsys, chain):
    target, *assistants = chain
    tokenizer = make_tokenizer()
    ids = prompt(4, seed=10)
    out = polybasic(
        target, assistants, ids, do_sample=False, max_new_tokens=10, eos_token_id=None,
        streamer=TextStreamer(tokenizer, skip_prompt=True),
    )
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=10, eos_token_id=None))
    printed = capsys.readouterr().out
    assert printed.strip() == tokenizer.decode(out[0, ids.shape[1] :]).strip()
    assert printed.endswith("\n")  # end() flushes and terminates the line


@pytest.mark.parametrize("route", ["custom_generate", "enable"])
def test_text_iterator_streamer_finishes(route, own_chain):
    target, *assistants = own_chain
    tokenizer = make_tokenizer()
    ids = prompt(4, seed=12)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    options = dict(do_sample=False, max_new_tokens=12, eos_token_id=None, streamer=streamer)
    result = {}
    if route == "enable":
        hp.enable(target)

        def run():
            result["out"] = target.generate(ids, assistant_models=assistants, polybasic_config=CONFIG, **options)
            assert_chain_ran(target)
    else:

        def run():
            result["out"] = polybasic(target, assistants, ids, **options)

    try:
        thread = threading.Thread(target=run)
        thread.start()
        text = "".join(streamer)  # raises queue.Empty instead of hanging if end() is never called
        thread.join()
    finally:
        if route == "enable":
            hp.disable(target)
    assert text.strip() == tokenizer.decode(result["out"][0, ids.shape[1] :]).strip()
    assert torch.equal(result["out"], target.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=None))


# --- pipelines and enable/disable --------------------------------------------------------------------
def test_pipeline_with_enabled_model_and_batch_size_two(enabled):
    target, assistants = enabled
    tokenizer = make_tokenizer()
    pipe = pipeline("text-generation", model=target, tokenizer=tokenizer)
    prompts = ["hello", "ab", "world!", "xyz"]
    options = dict(do_sample=False, max_new_tokens=8, eos_token_id=None, return_full_text=False)
    plain = [pipe(p, **options)[0]["generated_text"] for p in prompts]
    batched = pipe(prompts, batch_size=2, assistant_models=assistants, polybasic_config=CONFIG, **options)
    assert [r[0]["generated_text"] for r in batched] == plain
    assert_chain_ran(target)  # the last batch of the pipeline went through the chain
    top = hp.last_stats(target).levels[0]
    # its two rows shared target forwards (row by row, each row's prefill is a forward of its own: V <= F - 2)
    assert top.verifications >= top.forward_passes


def test_pipeline_without_enable_through_custom_generate(chain):
    target, *assistants = chain
    tokenizer = make_tokenizer()
    pipe = pipeline("text-generation", model=target, tokenizer=tokenizer)
    options = dict(do_sample=False, max_new_tokens=8, eos_token_id=None, return_full_text=False)
    expected = pipe("hello", **options)
    got = pipe("hello", custom_generate=hp.generate, assistant_models=assistants, polybasic_config=CONFIG, **options)
    assert got == expected
    assert_chain_ran(target)


def test_pipeline_with_chat_messages(enabled):
    target, assistants = enabled
    pipe = pipeline("text-generation", model=target, tokenizer=make_tokenizer())
    messages = [{"role": "user", "content": "hello"}]
    options = dict(do_sample=False, max_new_tokens=6, eos_token_id=None)
    expected = pipe(messages, **options)
    assert pipe(messages, assistant_models=assistants, polybasic_config=CONFIG, **options) == expected
    assert_chain_ran(target)


def test_enable_with_a_default_chain_and_disable(own_chain):
    target, *assistants = own_chain
    ids = prompt(5, seed=13)
    plain_generate = target.generate
    reference = target.generate(ids, do_sample=False, max_new_tokens=10, eos_token_id=None)
    hp.enable(target, assistant_models=assistants, polybasic_config=CONFIG)
    try:
        out = target.generate(ids, do_sample=False, max_new_tokens=10, eos_token_id=None)
        assert torch.equal(out, reference)
        assert hp.last_stats(target).levels[1].role == "intermediate"
    finally:
        hp.disable(target)
    assert target.generate.__func__ is plain_generate.__func__
    with pytest.raises(ValueError, match="not enabled"):
        hp.disable(target)


def test_importing_patches_nothing(chain):
    target, *_ = chain
    assert "generate" not in vars(target)


# --- config stored in the generation config --------------------------------------------------------
def test_config_saved_with_the_model_is_the_default_after_reload(tmp_path, chain):
    import copy

    from transformers import AutoModelForCausalLM

    target, *assistants = chain
    config = hp.PolybasicConfig(num_draft_tokens=2, block_threshold=(3,), schedule="constant")
    fresh = type(target)(copy.deepcopy(target.config)).eval()  # saving writes into the config
    fresh.load_state_dict(target.state_dict())
    config.save_to(fresh.generation_config)
    fresh.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hp.PolybasicConfig.from_generation_config(loaded.generation_config) == config
    out = loaded.generate(
        prompt(4),
        custom_generate=hp.generate,
        assistant_models=assistants,
        do_sample=False,
        max_new_tokens=12,
        eos_token_id=None,
        return_dict_in_generate=True,
    )
    middle = out.polybasic_stats.levels[1]
    # the stored K = 2 is in force: the drafter never proposes more than 2 tokens per round
    assert 0 < middle.drafted <= 2 * middle.verifications
    assert max(middle.acceptance_lengths) <= 3


# --- copies and threads -------------------------------------------------------------------------------
@pytest.mark.parametrize("copier", ["copy", "deepcopy"])
def test_a_copy_of_an_enabled_model_generates_with_itself(copier, own_chain):
    import copy

    target, *assistants = own_chain
    hp.enable(target, polybasic_config=CONFIG)
    try:
        twin = getattr(copy, copier)(target)
        twin.generation_config = copy.deepcopy(target.generation_config)  # a shallow copy shares the modules
        twin.generation_config.bad_words_ids = [[int(t)] for t in target.generate(prompt(5, seed=16), do_sample=False,
                                                                                  max_new_tokens=3)[0, 5:]]
        ids = prompt(5, seed=16)
        options = dict(do_sample=False, max_new_tokens=12, eos_token_id=None)
        own = twin.generate(ids, **options)  # no chain: plain generate of the copy
        assert not torch.equal(own, target.generate(ids, **options))
        assert torch.equal(twin.generate(ids, assistant_models=assistants, **options), own)
        assert hp.last_stats(twin) is not None and hp.last_stats(twin).levels[0].forward_passes > 0
        hp.disable(twin)
        assert torch.equal(twin.generate(ids, **options), own)
    finally:
        hp.disable(target)


def test_quantized_copies_and_early_exits_of_an_enabled_model_are_themselves():
    from hf_polybasic.levels import early_exit, quantized_copy

    target = make_chain("llama", 2, seed=17)[0]
    ids = prompt(5, seed=17)
    options = dict(do_sample=False, max_new_tokens=10, eos_token_id=None)
    expected = {}
    for name, build in (("int8", lambda m: quantized_copy(m, "int8-dynamic")), ("exit", lambda m: early_exit(m, 1))):
        expected[name] = build(target).generate(ids, **options)
    hp.enable(target)
    try:
        for name, build in (("int8", lambda m: quantized_copy(m, "int8-dynamic")), ("exit", lambda m: early_exit(m, 1))):
            assert torch.equal(build(target).generate(ids, **options), expected[name]), name
    finally:
        hp.disable(target)


def test_last_stats_belong_to_the_calling_thread(own_chain):
    """Two threads, one model: each reads the statistics of its own last call, even after the other
    thread's call finished later."""
    target, *assistants = own_chain
    hp.enable(target)
    first_done, second_done = threading.Event(), threading.Event()
    seen = {}

    def call(name, tokens, wait_for, then_set):
        target.generate(prompt(5, seed=18), assistant_models=assistants, polybasic_config=CONFIG,
                        do_sample=False, max_new_tokens=tokens, eos_token_id=None)
        then_set.set()
        if wait_for is not None:
            assert wait_for.wait(60)
        seen[name] = hp.last_stats(target).new_tokens

    try:
        threads = [threading.Thread(target=call, args=("first", 6, second_done, first_done)),
                   threading.Thread(target=lambda: (first_done.wait(60), call("second", 11, None, second_done)))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        hp.disable(target)
    assert seen == {"first": 6, "second": 11}
