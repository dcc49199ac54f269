"""Hybrid models (linear-attention, state-space and short-convolution layers beside attention) at
any level of a chain, losslessly (`hf_polybasic.runners.recurrent`).

Tiny random models of each covered family, built in code, whose recurrent layers are amplified
(`hf_polybasic.testing`) so that a state left advanced by a rejected draft changes their output:
greedy output equals plain `generate` with the hybrid as target, middle level and bottom; sampling
follows the target's distribution; after any rollback every recurrent and convolution state is
what feeding the kept tokens makes it. Negative controls (a rollback that leaves the state
advanced, injected into one chain's levels) fail the same tests. Uncovered kinds are refused by name.
"""

import re

import pytest
import torch
from helpers import ALPHA, assert_every_level_took_part, build_models, chi_square_p_value, exact_joint, sample_counts
from transformers import AutoConfig, AutoModelForCausalLM

import hf_polybasic as hp
from hf_polybasic import compat
from hf_polybasic.decoding import loop as engine
from hf_polybasic.runners import recurrent
from hf_polybasic.runners.dynamic import CachedModel
from hf_polybasic.decoding.build import ChainParts
from hf_polybasic.decoding.round import Verifier
from hf_polybasic.generation import make_generate
from hf_polybasic.testing import EOS, PAD, make_target, noisy_copy, prompt

pytestmark = pytest.mark.skipif(
    not compat.HAS_RECURRENT_CACHE_LAYERS, reason="transformers < 5.15 refuses hybrids (tests/test_compat.py)"
)

# every covered family, with the kind of its recurrent layers
FAMILIES = {
    "qwen3_next": "Gated DeltaNet", "qwen3_5_text": "Gated DeltaNet", "qwen3_5_moe_text": "Gated DeltaNet",
    "olmo_hybrid": "Gated DeltaNet", "kimi_linear": "Kimi Delta Attention", "bamba": "Mamba-2", "falcon_h1": "Mamba-2",
    "nemotron_h": "Mamba-2", "granitemoehybrid": "Mamba-2", "zamba2": "Mamba-2", "jamba": "Mamba state-space", "lfm2": "short-convolution",
    "lfm2_moe": "short-convolution", "mamba": "Mamba state-space", "mamba2": "Mamba-2",
    "falcon_mamba": "Mamba state-space",
}
CONFIG = dict(num_draft_tokens=3, block_threshold=4, schedule="constant")
NOISES = (0.05, 0.2, 0.4)


def _chain(shared_models, arch: str, depth: int, layers: int = 2, seed: int = 7) -> tuple:
    """[target, M2, ..., M_depth]: a tiny hybrid and noisy copies of it (partial acceptance)."""

    def make():
        try:
            target = make_target(arch, seed=seed, layers=layers)
        except ValueError as error:  # a family this release does not have (Kimi Linear before 5.16 or so)
            pytest.skip(f"{arch} cannot be built on transformers {compat.TRANSFORMERS_VERSION}: {error}")
        return [target] + [noisy_copy(target, noise, seed + 100 + i) for i, noise in enumerate(NOISES)]

    return shared_models.built(("hybrid", arch, layers, seed), make)[:depth]


def _greedy(target, ids, **options):
    return target.generate(ids, do_sample=False, **options)


def _assert_greedy_equal(target, assistants, ids, budget=28, eos_step=None, generate=hp.generate, **config):
    """Plain generate vs the chain, with an EOS made of the first token the target emits at or after
    ``eos_step`` and not before (a stop inside a block); the chain's statistics."""
    reference = _greedy(target, ids, max_new_tokens=budget, eos_token_id=EOS)
    eos = [EOS]
    new = reference[0, ids.shape[1]:].tolist()
    if eos_step is not None:
        fresh = [token for step, token in enumerate(new) if step >= eos_step and token not in new[:step]]
        if fresh:
            eos = [fresh[0], EOS]
            reference = _greedy(target, ids, max_new_tokens=budget, eos_token_id=eos)
    out = _greedy(
        target, ids, max_new_tokens=budget, eos_token_id=eos, custom_generate=generate, assistant_models=list(assistants),
        polybasic_config=hp.PolybasicConfig(**{**CONFIG, **config}), return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, reference), (reference[0, ids.shape[1]:].tolist(), out.sequences[0, ids.shape[1]:].tolist())
    return out.polybasic_stats


# --- greedy equality ------------------------------------------------------------------------------
# one family per layer kind in the default run (Gated DeltaNet, Mamba-2, Mamba, short convolution, a
# pure state-space model); every family, depth and more settings under -m slow
# (prompts whose outputs make every verifier of these chains accept and reject drafts)
CORE = [("qwen3_5_text", 2, 3), ("qwen3_5_text", 3, 3), ("qwen3_5_text", 4, 3), ("nemotron_h", 2, 3),
        ("nemotron_h", 3, 3), ("nemotron_h", 4, 3), ("jamba", 3, 3), ("lfm2", 3, 4), ("mamba2", 3, 5)]


@pytest.mark.parametrize("arch, depth, seed", CORE)
def test_hybrid_chains_equal_plain_generate(arch, depth, seed, shared_models):
    """Every level a hybrid (target, middle levels, bottom), an EOS inside a block; every verifier
    accepted and rejected drafts, so every level's state was rolled back."""
    target, *assistants = _chain(shared_models, arch, depth)
    stats = _assert_greedy_equal(target, assistants, prompt(6, seed=seed), eos_step=16)
    assert_every_level_took_part(stats)


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(FAMILIES))
@pytest.mark.parametrize("depth", [2, 3, 4])
@pytest.mark.parametrize("k, mu, prompt_length, eos_step", [(1, 2, 3, None), (4, 6, 40, 9), (2, 3, 12, 0)])
def test_every_hybrid_family_equals_plain_generate(arch, depth, k, mu, prompt_length, eos_step, shared_models):
    """Prompts of 3 to 40 tokens (a context of 32 or more is fed in a forward of its own), stops at
    the first token and mid-block."""
    target, *assistants = _chain(shared_models, arch, depth)
    stats = _assert_greedy_equal(target, assistants, prompt(prompt_length, seed=depth), budget=30, eos_step=eos_step,
                                 num_draft_tokens=k, block_threshold=mu)
    assert_every_level_took_part(stats, rejections=False, acceptances=False)


@pytest.fixture(scope="module")
def mixed(shared_models):
    """A Llama target with a noisy copy of it, and a hybrid with a noisy copy of it."""
    return shared_models.built(("hybrid-mixed",), lambda: [
        llama := make_target("llama", seed=7), noisy_copy(llama, 0.05, 1),
        hybrid := make_target("qwen3_5_text", seed=7), noisy_copy(hybrid, 0.05, 2),
    ])


@pytest.mark.parametrize("position", ["target", "intermediate", "bottom"])
def test_a_hybrid_at_one_level_of_a_transformer_chain(position, mixed):
    llama, llama_copy, hybrid, hybrid_copy = mixed
    chain = {"target": [hybrid, hybrid_copy, llama_copy], "intermediate": [llama, hybrid, llama_copy],
             "bottom": [llama, llama_copy, hybrid]}[position]
    stats = _assert_greedy_equal(chain[0], chain[1:], prompt(5, seed=11), eos_step=13)
    assert_every_level_took_part(stats, rejections=False, acceptances=False)


def test_a_left_padded_batch_of_a_hybrid_is_decoded_row_by_row_and_every_row_is_exact(shared_models):
    target, *assistants = _chain(shared_models, "qwen3_5_text", 3)
    assert "has recurrent layers" in engine.row_by_row_reason(target, assistants)
    reason = recurrent.batch_refusal_reason(assistants[0])
    assert "layer 0 is a Gated DeltaNet linear-attention layer (Qwen3_5GatedDeltaNet)" in reason
    prompts = [prompt(length, seed=20 + length)[0] for length in (3, 9, 6)]
    width = max(p.shape[0] for p in prompts)
    ids = torch.full((len(prompts), width), PAD)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - p.shape[0]:], mask[row, width - p.shape[0]:] = p, 1
    options = dict(do_sample=False, max_new_tokens=20, eos_token_id=EOS, pad_token_id=PAD)
    plain = target.generate(ids, attention_mask=mask, **options)
    eos = int(plain[1, width + 7])  # a token row 1 emits mid-output: its stop falls inside a block
    options["eos_token_id"] = [eos, EOS]
    plain = target.generate(ids, attention_mask=mask, **options)
    out = target.generate(ids, attention_mask=mask, custom_generate=hp.generate, assistant_models=assistants,
                          polybasic_config=hp.PolybasicConfig(**CONFIG), return_dict_in_generate=True, **options)
    assert torch.equal(out.sequences, plain)
    for row, p in enumerate(prompts):
        alone = target.generate(p[None], **options)[0, p.shape[0]:]
        assert torch.equal(out.sequences[row, width : width + alone.shape[0]], alone)
    assert_every_level_took_part(out.polybasic_stats, rejections=False)


# --- the state after a rollback -------------------------------------------------------------------
class StaleStates:
    """A deliberately wrong rollback of the recurrent state (transformers' `crop` on such caches,
    issue #49036): the attention layers are cut to the kept tokens, the recurrent and convolution
    states stay advanced past the rejected ones."""

    def __init__(self, inner: recurrent.StateHistory):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def restore(self, length: int) -> int:
        return length


def _states(cache) -> list:
    """Every state of every recurrent layer that has seen a token: (layer, state index, name, tensor)."""
    found = []
    for index in compat.recurrent_layer_indices(cache):
        for state, (seen, conv, rec) in enumerate(compat.read_recurrent_state(cache.layers[index])):
            if seen:
                found += [(index, state, name, t) for name, t in (("conv", conv), ("recurrent", rec)) if t is not None]
    return found


def _fed(model, tokens: torch.LongTensor):
    """A fresh cache fed ``tokens`` in one forward, as the runner's caches are made."""
    cache = compat.new_dynamic_cache(model)
    compat.record_past_states(cache)
    if tokens.shape[0]:
        kwargs = {compat.cache_argument(model): cache}
        if compat.takes_position_ids(model):
            kwargs["position_ids"] = torch.arange(tokens.shape[0])[None]
        model(input_ids=tokens[None], use_cache=True, **kwargs)
    return cache


def _assert_state_is_of(runner, model, tokens: torch.LongTensor) -> None:
    """Every recurrent and convolution state of the runner's cache equals a fresh cache's fed ``tokens``."""
    got, want = _states(runner.cache), _states(_fed(model, tokens))
    assert [key[:3] for key in got] == [key[:3] for key in want]
    for (index, state, name, value), (*_, expected) in zip(got, want):
        torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-5, msg=f"layer {index} {name} state {state}")


def _rollbacks(model, sequence: torch.LongTensor, stale: bool = False) -> None:
    """A prompt, a verification of 6 drafts rolled back to 2 kept, three more rounds (an
    intermediate level's) rolled back across two of them, a prompt of more than 32 tokens: after
    each rollback and each forward, every state is what the kept tokens make it."""
    runner = CachedModel(model, compat.new_dynamic_cache(model), role="test")
    if stale:
        runner.states = StaleStates(runner.states)
    runner.logits(sequence[:8], 1)
    _assert_state_is_of(runner, model, sequence[: runner.length])
    runner.logits(sequence[:15], 7)  # 6 drafts
    runner.rollback_rows({0: 10})  # 2 kept: back to a copy holding at most 10 tokens
    assert runner.length <= 10
    _assert_state_is_of(runner, model, sequence[: runner.length])
    logits = runner.logits(sequence[:14], 4)  # re-feeds what the copy lacks
    torch.testing.assert_close(logits, _full_logits(model, sequence[:14])[-4:], rtol=1e-4, atol=1e-4)
    _assert_state_is_of(runner, model, sequence[:14])
    for end in (17, 20, 23):
        runner.logits(sequence[:end], 3)
    runner.rollback_rows({0: 16})  # across two rounds
    assert runner.length <= 16
    _assert_state_is_of(runner, model, sequence[: runner.length])
    runner.logits(sequence[:18], 2)
    runner.commit()
    _assert_state_is_of(runner, model, sequence[:18])
    runner.logits(sequence[:60], 5)  # 37 new tokens of context: fed in a forward of their own first
    runner.rollback_rows({0: 57})
    assert runner.length == 55  # the copy taken after the context, not the one before it
    _assert_state_is_of(runner, model, sequence[:55])


def _full_logits(model, tokens):
    return model(input_ids=tokens[None]).logits[0].float()


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_after_a_rollback_every_recurrent_state_is_what_the_kept_tokens_make_it(arch, shared_models):
    target = _chain(shared_models, arch, 1)[0]
    _rollbacks(target, prompt(60, seed=4)[0])


@pytest.mark.parametrize("arch", ["qwen3_5_text", "nemotron_h", "jamba", "lfm2"])
def test_the_state_test_fails_for_a_rollback_that_leaves_the_state_advanced(arch, shared_models):
    target = _chain(shared_models, arch, 1)[0]
    with pytest.raises(AssertionError):
        _rollbacks(target, prompt(60, seed=4)[0], stale=True)


class LeavesStateAdvanced(Verifier):
    """A verifier whose model's rollback leaves the recurrent state advanced (`StaleStates`)."""

    def __init__(self, runner, *args, **kwargs):
        super().__init__(runner, *args, **kwargs)
        if runner.states is not None:
            runner.states = StaleStates(runner.states)


def test_greedy_equality_fails_for_a_rollback_that_leaves_the_state_advanced(shared_models):
    target, *assistants = _chain(shared_models, "qwen3_5_text", 3)
    with pytest.raises(AssertionError):
        _assert_greedy_equal(target, assistants, prompt(6, seed=3), generate=make_generate(ChainParts(verifier=LeavesStateAdvanced)))


# --- the distribution -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hybrid_distribution(shared_models):
    """arch -> (8-token hybrid target, three noisy copies), and its exact 3-token distribution."""
    exact = {}

    def get(arch):
        models = shared_models.built(("distribution", arch), lambda: build_models(arch, layers=2))
        if arch not in exact:
            exact[arch] = exact_joint(models[0], "temperature+top_k+top_p")
        return models, exact[arch]

    return get


def test_a_hybrid_target_and_middle_level_sample_the_target_distribution(hybrid_distribution):
    """Nemotron-H (Mamba-2 + attention) as target, middle level and bottom; 1000 samples, each
    decoded alone (a batch of hybrids goes row by row)."""
    models, exact = hybrid_distribution("nemotron_h")
    counts, stats = sample_counts(models[0], "temperature+top_k+top_p", models[1:3], seed=3, samples=1000,
                                  num_draft_tokens=2, block_threshold=2, schedule="constant")
    print(assert_every_level_took_part(stats))
    assert chi_square_p_value(counts, exact) > ALPHA


def test_the_distribution_test_fails_for_a_rollback_that_leaves_the_state_advanced(hybrid_distribution):
    models, exact = hybrid_distribution("nemotron_h")
    wrong = make_generate(ChainParts(verifier=LeavesStateAdvanced))
    counts, stats = sample_counts(models[0], "temperature+top_k+top_p", models[1:2], seed=3, samples=1000,
                                  generate=wrong, num_draft_tokens=3, schedule="constant")
    assert_every_level_took_part(stats)
    assert chi_square_p_value(counts, exact) < ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_next", "jamba", "lfm2", "mamba2", "falcon_h1"])
def test_every_kind_samples_the_target_distribution(arch, hybrid_distribution):
    models, exact = hybrid_distribution(arch)
    counts, stats = sample_counts(models[0], "temperature+top_k+top_p", models[1:4], seed=5, samples=2000,
                                  num_draft_tokens=2, block_threshold=(3, 2), schedule="constant")
    print(arch, assert_every_level_took_part(stats))
    assert chi_square_p_value(counts, exact) > ALPHA


# --- a cache handed back --------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3_5_text", "jamba"])
def test_a_returned_cache_holds_the_output_but_its_last_token_and_continues_exactly(arch, shared_models):
    """A stop inside a block leaves the target's state at a copy before it; the call feeds the rest
    before handing the cache back, so plain generate (which cannot continue Jamba's Mamba layers
    over several tokens) and the chain both continue it exactly."""
    target, m2 = _chain(shared_models, arch, 2)
    ids = prompt(7, seed=9)
    reference = _greedy(target, ids, max_new_tokens=36, eos_token_id=None)
    for continue_with in (None, [m2]):
        eos = int(reference[0, ids.shape[1] + 10])
        cache = compat.new_dynamic_cache(target)
        first = _greedy(target, ids, max_new_tokens=36, eos_token_id=eos, custom_generate=hp.generate, assistant_models=[m2],
                        polybasic_config=hp.PolybasicConfig(num_draft_tokens=6, schedule="constant"), past_key_values=cache)
        assert torch.equal(first, reference[:, : first.shape[1]])
        assert cache.get_seq_length() == first.shape[1] - 1
        chain = {} if continue_with is None else dict(custom_generate=hp.generate, assistant_models=continue_with)
        more = _greedy(target, first, attention_mask=torch.ones_like(first), max_length=reference.shape[1],
                       eos_token_id=None, past_key_values=cache, **chain)
        assert torch.equal(more, reference)


# --- refusals -------------------------------------------------------------------------------------
def _tiny(model_type: str, **config):
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**common, **config})).eval()


REFUSED = {
    "rwkv": (dict(num_hidden_layers=2, attention_hidden_size=32), r"layer 0 is an RWKV time-mix recurrent layer \(RwkvSelfAttention\).*outside any cache"),
    "recurrent_gemma": (dict(num_hidden_layers=3, lru_width=32, head_dim=8, block_types=["recurrent", "recurrent", "attention"]),
                        r"layer 0 is an RG-LRU \(Griffin\) recurrent layer \(RecurrentGemmaRecurrentBlock\).*inside the model's modules"),
    "xlstm": (dict(num_hidden_layers=2, embedding_dim=32, num_heads=2), r"layer 0 is an mLSTM recurrent layer \(xLSTMBlock\).*xLSTMCache"),
    "minimax": (dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], head_dim=8, num_local_experts=2,
                     num_experts_per_tok=1), r"layer 0 is a lightning \(linear\) attention layer \(MiniMaxLightningAttention\).*MiniMaxCache"),
}


@pytest.mark.parametrize("model_type", sorted(REFUSED))
@pytest.mark.parametrize("role", ["target", "assistant"])
def test_uncovered_recurrent_layers_are_refused_by_their_kind(model_type, role):
    config, message = REFUSED[model_type]
    try:
        model = _tiny(model_type, **config)
    except Exception as error:  # pragma: no cover - a release whose tiny configuration does not build
        pytest.skip(f"{model_type} does not build tiny on this release: {error}")
    target, assistant = (model, noisy_copy(model, 0.1, 1)) if role == "target" else (make_target("llama"), model)
    who = "target M1" if role == "target" else r"assistant_models\[0\]"
    with pytest.raises(ValueError, match=f"{who}.*{message}.*rolls back these kinds: Gated DeltaNet"):
        target.generate(prompt(4), max_new_tokens=4, custom_generate=hp.generate, assistant_models=[assistant])


def test_an_unknown_recurrent_layer_is_refused_with_its_class():
    """A layer the config calls linear attention, of a class hf_polybasic does not know."""
    model = make_target("llama", seed=1)
    model.config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer 0 is a recurrent layer \(LlamaDecoderLayer\).*not a kind hf_polybasic knows"):
        model.generate(prompt(4), max_new_tokens=4, custom_generate=hp.generate, assistant_models=[noisy_copy(model, 0.1, 1)])


def test_a_cache_without_recurrent_layers_for_a_hybrid_is_refused(shared_models):
    from transformers import DynamicCache

    target, m2 = _chain(shared_models, "qwen3_5_text", 2)
    with pytest.raises(ValueError, match=r"layer 0 is a Gated DeltaNet.*cache holds no layer there.*DynamicCache\(config="):
        target.generate(prompt(4), max_new_tokens=4, custom_generate=hp.generate, assistant_models=[m2],
                        past_key_values=DynamicCache())


def test_a_prefilled_cache_of_a_pure_state_space_model_is_refused(shared_models):
    target, m2 = _chain(shared_models, "mamba2", 2)
    cache = compat.new_dynamic_cache(target)
    target(prompt(4), cache_params=cache, use_cache=True)
    with pytest.raises(ValueError, match="without attention layers and already holds a state"):
        target.generate(prompt(5), max_new_tokens=4, custom_generate=hp.generate, assistant_models=[m2], cache_params=cache)


def test_layer_kinds_are_found_by_layer():
    layers = recurrent.recurrent_layers(make_target("nemotron_h", layers=4))
    assert [(layer.index, layer.kind, layer.module) for layer in layers] == [
        (0, recurrent.MAMBA2, "NemotronHMamba2Mixer"), (2, recurrent.MAMBA2, "NemotronHMamba2Mixer")]
    assert recurrent.recurrent_layers(make_target("llama")) == []
    assert recurrent.batch_refusal_reason(make_target("llama")) is None
    assert re.search("Mamba state-space, short-convolution", recurrent.covered_kinds())
