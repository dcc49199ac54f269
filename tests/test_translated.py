"""A level with a tokenizer of its own (`hf_polybasic.levels.translated`), at any depth, exact.

Tokenizers are trained in code (`hf_polybasic.testing.train_tokenizer`: a byte-level BPE for the
target, a SentencePiece-style Metaspace BPE with byte fallback and a smaller byte-level BPE for the
levels), and the levels are "translated copies" of tiny random targets (the target's layers, and
each shared token's rows copied from its twin's), so their drafts are often accepted. Greedy output
equals plain `generate` for one row and ragged batches, the level at the bottom of two levels, and
at the bottom and in the middle of three; sampling matches the exact enumeration of an 8-token
target, and a level that reports more than it sampled from is caught. The user's models, generation
configs and tokenizers are left as they were (transformers' TLI prunes the assistant's head and
switches its repetition penalty off).
"""

import copy
import random
import re

import pytest
import torch
from helpers import (ALPHA, VOCAB, assert_every_level_took_part, chi_square_p_value, left_padded, sample_counts)
from hypothesis import given
from hypothesis import strategies as st

import hf_polybasic as hp
from hf_polybasic.decoding import build
from hf_polybasic.decoding.build import ChainParts
from hf_polybasic.decoding.round import ModelDrafter
from hf_polybasic.generation import make_generate
from hf_polybasic.runners.text_route import Lookahead, TextRouteRunner, last_settled
from hf_polybasic.runners.translated import TranslatedRunner
from hf_polybasic.testing import (CORPUS, make_target, make_tokenizer, noisy_copy, train_tokenizer, translated_copy)
from hf_polybasic.translation.context import OwnContext
from hf_polybasic.translation.level import shared_vocabulary
from hf_polybasic.translation.tokens import split_complete, token_bytes

CONSTANT = dict(schedule="constant", num_draft_tokens=3, block_threshold=3)


@pytest.fixture(scope="module")
def tokenizers():
    """The target's byte-level BPE and the levels' Metaspace and smaller byte-level BPEs."""
    return {"target": train_tokenizer("byte-level", 400), "metaspace": train_tokenizer("metaspace", 200),
            "byte-level": train_tokenizer("byte-level", 330)}


@pytest.fixture(scope="module")
def models(shared_models, tokenizers):
    """(target, a noisy copy of it (same tokenizer), a translated copy for the Metaspace tokenizer, one
    for the smaller byte-level tokenizer)."""

    def make():
        target = make_target("llama", seed=3, vocab=len(tokenizers["target"]))
        return (target, noisy_copy(target, 0.1, seed=5),
                translated_copy(target, tokenizers["target"], tokenizers["metaspace"], noise=0.05, seed=1),
                translated_copy(target, tokenizers["target"], tokenizers["byte-level"], noise=0.05, seed=2))

    return shared_models.built(("translated", len(tokenizers["target"])), make)


def _level(models, tokenizers, kind="metaspace", route="shared"):
    own = models[2] if kind == "metaspace" else models[3]
    return hp.levels.translated(own, tokenizers[kind], tokenizers["target"], route=route)


CHAINS = {
    "bottom of 2": lambda m, t: [_level(m, t)],
    "bottom of 3": lambda m, t: [m[1], _level(m, t)],
    "middle of 3": lambda m, t: [_level(m, t), m[1]],
    "byte-level, bottom of 2": lambda m, t: [_level(m, t, "byte-level")],
    "text route, bottom of 2": lambda m, t: [_level(m, t, route="text")],
    "text route, bottom of 3": lambda m, t: [m[1], _level(m, t, "byte-level", route="text")],
}
OPTIONS = [dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=2), dict(min_new_tokens=18, eos_token_id=2),
           dict(), dict(repetition_penalty=1.2, bad_words_ids=[[5], [7]]), dict(top_k=1, do_sample=True)]


# --- the vocabulary the two share, and a row's own text -----------------------------------------------
def test_twins_spell_the_same_text(tokenizers):
    """Byte-level ``Ġx`` and Metaspace ``▁x`` are twins (both spell " x"), as are ``Ċ`` and a raw newline;
    special tokens pair by content, the EOS of each with the other's; a level's logits go to the twins'
    ids and -inf elsewhere."""
    target, own = tokenizers["target"], tokenizers["metaspace"]
    shared = shared_vocabulary(own, target)
    twin = {target.convert_ids_to_tokens(t): own.convert_ids_to_tokens(o) for t, o in
            zip(shared.target_ids.tolist(), shared.own_ids.tolist())}
    assert twin["Ġreturn"] == "▁return" and twin["Ċ"] == "\n" and twin["<|im_end|>"] == "<|im_end|>"
    assert token_bytes(own)[own.convert_tokens_to_ids("<0xE6>")] == b"\xe6"
    assert shared.target_to_own[target.convert_tokens_to_ids("<|endoftext|>")] is None  # no twin by content
    logits = torch.arange(len(own), dtype=torch.float).unsqueeze(0)
    on_target = shared.to_target(logits, len(target))
    assert torch.isfinite(on_target).sum() == len(shared)
    assert torch.equal(on_target[0, shared.target_ids], shared.own_ids.float())


@pytest.mark.parametrize("data, text, held", [(b"caf\xc3", "caf", b"\xc3"), (b"\xe6\x97", "", b"\xe6\x97"),
                                              (b"a\xff b", "a\ufffd b", b""), (b"\xe6\x97\xa5", "\u65e5", b"")])
def test_an_incomplete_character_is_held(data, text, held):
    assert split_complete(data) == (text, held)


def test_the_prompt_is_encoded_once_with_the_levels_own_special_tokens(tokenizers):
    target, own = tokenizers["target"], tokenizers["metaspace"]
    prompt = target.apply_chat_template([{"role": "user", "content": "def push(self, item):"}],
                                        add_generation_prompt=True, return_dict=True)["input_ids"]
    context = OwnContext(shared_vocabulary(own, target), list(prompt))
    text = target.decode(prompt)
    assert context.own == own(text)["input_ids"]  # BOS, <|im_start|> as one token, the text as own tokenizes it
    assert context.own[0] == own.bos_token_id and own.convert_tokens_to_ids("<|im_start|>") in context.own


def _spelled(shared, ids, side):
    table = shared.target_bytes if side == "target" else shared.own_bytes
    return b"".join(table[i] or b"" for i in ids)


@given(st.data())
def test_a_rows_own_text_follows_the_targets_token_by_token(tokenizers, data):
    """Whatever target tokens arrive (bytes of broken characters included), in one piece or after detours
    and rollbacks: the own tokens of every prefix are the same, and spell the target's text (the bytes of
    a character still incomplete held back, the space the level's tokenizer puts before a text aside)."""
    target, own = tokenizers["target"], tokenizers["metaspace"]
    shared = shared_vocabulary(own, target)
    regular = [i for i, spelled in enumerate(shared.target_bytes) if spelled]
    prompt = target(data.draw(st.sampled_from(CORPUS))[:20])["input_ids"]
    tokens = data.draw(st.lists(st.sampled_from(regular), min_size=1, max_size=24))
    whole = OwnContext(shared, prompt)
    whole.follow(prompt + tokens)
    stepwise = OwnContext(shared, prompt)
    for cut in data.draw(st.lists(st.integers(0, len(tokens)), max_size=4)):
        stepwise.follow(prompt + tokens[:cut] + data.draw(st.lists(st.sampled_from(regular), max_size=3)))
        stepwise.truncate(len(prompt) + cut // 2)
    stepwise.follow(prompt + tokens)
    assert stepwise.own == whole.own
    for length in range(len(prompt), len(prompt) + len(tokens) + 1):
        alone = OwnContext(shared, prompt)
        alone.follow(prompt + tokens[: length - len(prompt)])
        assert whole.own[: whole.own_length(length)] == alone.own
    spelled = _spelled(shared, whole.own, "own")[1:] + whole.held
    assert spelled.decode(errors="replace") == _spelled(shared, prompt + tokens, "target").decode(errors="replace")


# --- greedy: plain generate's output ---------------------------------------------------------------------
@pytest.mark.parametrize("shape", list(CHAINS))
def test_greedy_output_is_plain_generates(shape, models, tokenizers):
    """One row and a ragged left-padded batch, with a generate option per shape (a repetition penalty among
    them); each row is compared with the row generated alone. The translated level drafted and was
    accepted (and rejected)."""
    target, tokenizer = models[0], tokenizers["target"]
    options = {**dict(do_sample=False, max_new_tokens=20, pad_token_id=0), **OPTIONS[list(CHAINS).index(shape)]}
    rows = [torch.tensor(tokenizer(text[start:start + length])["input_ids"]) for text, start, length in
            ((CORPUS[0], 0, 30), (CORPUS[4], 4, 9), (CORPUS[7], 0, 40), (CORPUS[2], 10, 3))]
    chain = CHAINS[shape](models, tokenizers)
    config = hp.PolybasicConfig(**CONSTANT)
    alone = [target.generate(row[None], **options)[0, row.shape[0]:] for row in rows]
    one = target.generate(rows[0][None], custom_generate=hp.generate, assistant_models=chain, polybasic_config=config,
                          **options)
    assert one[0, rows[0].shape[0]:].tolist() == alone[0].tolist()
    ids, mask = left_padded(rows)
    out = target.generate(ids, attention_mask=mask, custom_generate=hp.generate, assistant_models=chain,
                          polybasic_config=config, return_dict_in_generate=True, **options)
    for index, expected in enumerate(alone):
        assert out.sequences[index, ids.shape[1]:ids.shape[1] + expected.shape[0]].tolist() == expected.tolist(), index
    print(shape, assert_every_level_took_part(out.polybasic_stats))


def test_a_call_on_static_caches_keeps_the_translated_level_dynamic(models, tokenizers):
    """The target decodes on its static runner, the translated level on its dynamic cache (its own tokens per
    target token vary), said in a warning; the output is plain generate's."""
    target = models[0]
    ids = torch.tensor([tokenizers["target"](CORPUS[3][:25])["input_ids"]])
    options = dict(do_sample=False, max_new_tokens=12, eos_token_id=None)
    with pytest.warns(UserWarning, match="a translated level's own tokens per target token vary"):
        out = target.generate(ids, custom_generate=hp.generate, assistant_models=[_level(models, tokenizers)],
                              cache_implementation="static", return_dict_in_generate=True,
                              polybasic_config=hp.PolybasicConfig(**CONSTANT), **options)
    assert torch.equal(out.sequences, target.generate(ids, **options))
    assert [level.runner for level in out.polybasic_stats.levels] == ["static", "dynamic"]


class _ScriptedModel:
    """An inner runner whose greedy own tokens are ``script``, one per forward (a row's lengths as asked)."""

    model, role, device, rows, forward_passes = None, "drafter", torch.device("cpu"), 1, 0

    def __init__(self, script: list[int], width: int):
        self.script, self.width, self.lengths = script, width, [0]

    def logits_rows(self, asked):
        (row, (own, _)), = asked.items()
        self.lengths[row] = int(own.shape[0])
        logits = torch.zeros(1, self.width)
        logits[0, self.script[self.forward_passes]] = 1.0
        self.forward_passes += 1
        return {row: logits}

    def rollback_rows(self, lengths):
        for row, length in lengths.items():
            self.lengths[row] = length


@pytest.mark.parametrize("text, settled", [("def", True), ("x = 1", True), ("x:", False), ("x.", False),
                                           ("x ", False), ("", False)])
def test_a_last_token_is_settled_unless_whitespace_ends_it_or_a_next_word_or_newline_joins_it(text, settled):
    """A toy pre-tokenizer (words that take a space before them, a colon that takes a newline, a full stop
    that takes the next word): a word or a number stays; a colon may take a newline, a full stop the next
    word, and a space the next word (as Qwen's does)."""

    def encode(text):
        return re.findall(r"\.(?: [a-z]+)?| ?[a-z]+|:\n?|\S|\s", text)

    assert last_settled(encode, text, encode(text)) is settled


def _text_route(tokenizers, script):
    target, own = tokenizers["target"], tokenizers["byte-level"]
    shared = shared_vocabulary(own, target)
    inner = _ScriptedModel(own.convert_tokens_to_ids(script), len(own))
    return shared, inner, TextRouteRunner(inner, shared, len(target)), torch.tensor(target("x = f")["input_ids"])


@pytest.mark.parametrize("script", [["(", ")", "Ġthe"], ["_", "__", "Ġthe"]])
def test_the_text_route_hands_up_a_settled_last_token_and_stops_where_text_retokenizes_it(tokenizers, script):
    """A lookahead's last target token that a next word or a newline leaves as it is (settled) is a
    draft at once (one own forward for one draft, as UAD); where the text that follows still re-tokenizes
    it ('(' then ')' spell '()'; '_' then '__' spell '__', '_'), the level drafts nothing more in that
    round, neither growing on nor drafting from text the row does not hold."""
    shared, inner, runner, prompt = _text_route(tokenizers, script)
    first_target = shared.encode_target(script[0])
    assert last_settled(shared.encode_target, script[0], first_target)
    assert len(first_target) == 1 and shared.encode_target(script[0] + script[1])[0] != first_target[0]
    first = runner.logits_rows({0: (prompt, 1)})[0]
    assert first.argmax(-1).tolist() == first_target and inner.forward_passes == 1
    following = torch.cat([prompt, first.argmax(-1)])
    assert torch.isinf(runner.logits_rows({0: (following, 1)})[0]).all()
    assert inner.forward_passes == 2


def test_the_text_route_holds_an_unsettled_last_token_until_text_confirms_it(tokenizers):
    """A space, which a following word may take, is drafted only once the level's next own token confirms
    it ('Ġ' then 'Ġthe' spell 'Ġ', 'Ġthe' here): two own forwards."""
    shared, inner, runner, prompt = _text_route(tokenizers, ["Ġ", "Ġthe", "Ġthe"])
    assert not last_settled(shared.encode_target, " ", shared.encode_target(" "))
    first = runner.logits_rows({0: (prompt, 1)})[0]
    assert first.argmax(-1).tolist() == shared.encode_target(" ") and inner.forward_passes == 2


def test_the_text_route_drafts_no_token_an_incomplete_character_may_join(tokenizers):
    """Own tokens ' the' and the first byte of 'é': the text so far ends at ' the', whose last token the
    character may still join, so nothing is a draft yet (though a next word and a newline leave it); the
    second byte completes it and the text's tokens are drafts."""
    shared, _, runner, _ = _text_route(tokenizers, [])
    lookahead = Lookahead(base=0)
    own = tokenizers["byte-level"].convert_tokens_to_ids(["Ġthe", "Ã", "©"])
    runner._extend(lookahead, own[0])
    assert lookahead.drafts == shared.encode_target(" the") and last_settled(shared.encode_target, " the",
                                                                             lookahead.drafts)
    runner._extend(lookahead, own[1])
    assert lookahead.drafts == []
    runner._extend(lookahead, own[2])
    assert lookahead.drafts == shared.encode_target(" theé")  # 'Ġthe', then the bytes of 'é' here
    # asked for the draft after ' the' (handed up at once), the level drafts on past the lone first byte
    _, inner, runner, prompt = _text_route(tokenizers, ["Ġthe", "Ã", "©"])
    first = runner.logits_rows({0: (prompt, 1)})[0].argmax(-1)
    second = runner.logits_rows({0: (torch.cat([prompt, first]), 1)})[0]
    assert int(second.argmax()) == lookahead.drafts[1] and inner.forward_passes == 3


# --- sampling: the target's distribution --------------------------------------------------------------------
@pytest.fixture(scope="module")
def distribution_pair(shared_models, distribution_models):
    """The 8-token target's tokenizer (character-level), a Metaspace BPE trained on text of its characters, and
    a translated copy of the target for it."""
    rng = random.Random(0)
    corpus = ["".join(rng.choice('!"#$%') for _ in range(rng.randint(3, 12))) for _ in range(200)]
    target_tokenizer, own_tokenizer = make_tokenizer(VOCAB), train_tokenizer("metaspace", 30, corpus)

    def make():
        own = translated_copy(distribution_models[0], target_tokenizer, own_tokenizer, noise=0.3, seed=7)
        own.generation_config.eos_token_id = None
        return (own,)

    return target_tokenizer, own_tokenizer, shared_models.built(("translated distribution",), make)[0]


SAMPLED = {  # chain, setting
    "bottom of 2": (lambda level, m: [level], "temperature+top_k+top_p"),
    "middle of 3": (lambda level, m: [level, m[2]], "repetition_penalty"),
    "bottom of 3": (lambda level, m: [m[1], level], "min_p"),
    "text route, bottom of 2": (lambda level, m: [level], "temperature+top_k+top_p"),
}
# the bottom of 3 samples as the bottom of 2 does (its greedy output is checked by default)
SLOW_SAMPLED = {"bottom of 3"}


@pytest.mark.parametrize("shape", [pytest.param(shape, marks=pytest.mark.slow) if shape in SLOW_SAMPLED else shape
                                   for shape in SAMPLED])
def test_sampling_is_the_targets_distribution(shape, distribution_pair, distribution_models, exact_distribution):
    target_tokenizer, own_tokenizer, own = distribution_pair
    level = hp.levels.translated(own, own_tokenizer, target_tokenizer, route="text" if "text" in shape else "shared")
    chain, setting = SAMPLED[shape]
    counts, stats = sample_counts(distribution_models[0], setting, chain(level, distribution_models),
                                  seed=len(shape), num_draft_tokens=2, block_threshold=2, schedule="constant")
    print(shape, assert_every_level_took_part(stats))
    assert chi_square_p_value(counts, exact_distribution(setting)) > ALPHA


class ForgetsToRenormalize(TranslatedRunner):
    """Keeps, per row, the share of the level's own probability that its shared tokens hold (where it drafts)."""

    def logits_rows(self, requests):
        self.inside = {}
        original = self.inner.logits_rows

        def keep_share(asked):
            logits = original(asked)
            for row, values in logits.items():
                shared = values[-1:].softmax(-1)[:, self.shared.own_ids.to(values.device)]
                self.inside[row] = shared.sum(-1, keepdim=True)
            return logits

        self.inner.logits_rows = keep_share
        try:
            return super().logits_rows(requests)
        finally:
            del self.inner.logits_rows


class ReportsUnrestricted(ModelDrafter):
    """The bug a translation invites: reporting each shared token's probability within the level's whole
    vocabulary, not within the shared tokens it sampled from (the reported mass sums to less than 1)."""

    def draw(self, row, grown, logits, *args):
        drawn = super().draw(row, grown, logits, *args)
        drawn.probs = drawn.probs * self.runner.inside[row].to(drawn.probs.device)
        return drawn


def test_negative_control_a_level_reporting_its_unrestricted_distribution(distribution_pair, distribution_models,
                                                                           exact_distribution, monkeypatch):
    target_tokenizer, own_tokenizer, own = distribution_pair
    monkeypatch.setattr(build, "TranslatedRunner", ForgetsToRenormalize)
    level = hp.levels.translated(own, own_tokenizer, target_tokenizer)
    setting = "temperature+top_k+top_p"
    counts, stats = sample_counts(distribution_models[0], setting, [level], seed=3, generate=make_generate(ChainParts(
        model_drafter=ReportsUnrestricted)), num_draft_tokens=2, schedule="constant")
    assert_every_level_took_part(stats)
    assert chi_square_p_value(counts, exact_distribution(setting)) < ALPHA


# --- what stays as it was, and what is refused -----------------------------------------------------------------
def _state(model):
    return ([p.detach().clone() for p in model.parameters()], model.config.to_dict(), model.generation_config.to_dict(),
            type(model.get_output_embeddings()), model.get_output_embeddings().weight.shape)


def test_the_users_models_configs_and_tokenizers_are_left_as_they_were(tokenizers):
    """Unlike transformers' TLI, which prunes the assistant's output layer in place and sets its repetition
    penalty to None: a sampled call with a repetition penalty changes nothing of the user's."""
    target = make_target("llama", seed=8, vocab=len(tokenizers["target"]))
    own = translated_copy(target, tokenizers["target"], tokenizers["metaspace"], seed=3)
    own.generation_config.repetition_penalty = 1.1
    before = [_state(target), _state(own)]
    vocabularies = [dict(t.get_vocab()) for t in tokenizers.values()]
    hp.enable(target)
    ids = torch.tensor([tokenizers["target"]("import json")["input_ids"]])
    torch.manual_seed(0)
    target.generate(ids, do_sample=True, max_new_tokens=12, repetition_penalty=1.3, assistant_model=own,
                    tokenizer=tokenizers["target"], assistant_tokenizer=tokenizers["metaspace"])
    hp.disable(target)
    for (weights, *rest), (weights_after, *rest_after) in zip(before, [_state(target), _state(own)]):
        assert all(torch.equal(a, b) for a, b in zip(weights, weights_after)) and rest == rest_after
    assert [dict(t.get_vocab()) for t in tokenizers.values()] == vocabularies


def test_transformers_spelling_of_one_assistant_runs_through_the_chain(models, tokenizers):
    """On an enabled model, ``assistant_model=, tokenizer=, assistant_tokenizer=`` (transformers' UAD / USD)
    becomes the chain ``[translated(assistant, assistant_tokenizer, tokenizer)]``: plain greedy output,
    hf_polybasic's statistics."""
    target = copy.deepcopy(models[0])
    hp.enable(target)
    ids = torch.tensor([tokenizers["target"](CORPUS[1][:30])["input_ids"]])
    options = dict(do_sample=False, max_new_tokens=16, eos_token_id=None)
    out = target.generate(ids, assistant_model=models[2], tokenizer=tokenizers["target"],
                          assistant_tokenizer=tokenizers["metaspace"], **options)
    stats = hp.last_stats(target)
    assert stats is not None and stats.levels[1].name.startswith("M2 translated")
    hp.disable(target)
    assert torch.equal(out, target.generate(ids, **options))


def test_refusals_name_translated(models, tokenizers):
    target, _, own, other = models
    ids = torch.tensor([tokenizers["target"]("x = 1")["input_ids"]])

    def run(chain, **config):
        return target.generate(ids, max_new_tokens=3, custom_generate=hp.generate, assistant_models=chain,
                               polybasic_config=hp.PolybasicConfig(**config))

    with pytest.raises(ValueError, match=r"has 330 token ids .* hf_polybasic\.levels\.translated\(model, its_"):
        run([other])  # a model with another tokenizer, not translated
    with pytest.raises(ValueError, match="only a bottom level can: its drafts are point masses"):
        run([_level(models, tokenizers, route="text"), models[1]])
    with pytest.raises(ValueError, match=r"prompt_lookup=True\) puts a PromptLookup below .*route='text'"):
        run([_level(models, tokenizers, route="text")], prompt_lookup=True)
    with pytest.raises(ValueError, match="was made for a target tokenizer of 456 ids, but the target"):
        run([hp.levels.translated(other, tokenizers["byte-level"], tokenizers["metaspace"])])
    with pytest.raises(ValueError, match="route must be one of"):
        hp.levels.translated(own, tokenizers["metaspace"], tokenizers["target"], route="bytes")
    with pytest.raises(ValueError, match=r"the tokenizer has 456 ids but .* embeds only 330"):
        hp.levels.translated(other, tokenizers["metaspace"], tokenizers["target"])
    with pytest.raises(ValueError, match="`assistant_tokenizer=` goes with `assistant_model=`"):
        enabled = hp.enable(copy.deepcopy(target))
        enabled.generate(ids, max_new_tokens=3, assistant_tokenizer=tokenizers["metaspace"],
                         tokenizer=tokenizers["target"])


def test_a_translated_level_that_rarely_agrees_gets_its_own_hint(models, tokenizers):
    """A translated level the target accepts almost nothing of (a random model): the warning says its tokens
    rarely line up with the target's, not that the chain mixes tokenizers up."""
    target = models[0]
    stranger = make_target("llama", seed=41, vocab=len(tokenizers["metaspace"]))
    level = hp.levels.translated(stranger, tokenizers["metaspace"], tokenizers["target"])
    options = dict(do_sample=False, max_new_tokens=40, eos_token_id=None)
    ids = torch.tensor([tokenizers["target"].encode(CORPUS[0])[:8]])
    with pytest.warns(UserWarning, match=r"accepted .* drafts from M2 translated .*tokenizer of its own"):
        out = target.generate(ids, custom_generate=hp.generate, assistant_models=[level],
                              polybasic_config=hp.PolybasicConfig(schedule="constant"), **options)
    assert torch.equal(out, target.generate(ids, **options))
