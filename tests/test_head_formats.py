"""Head checkpoints as their publishers write them (issue 42): EAGLE-1/2 as SafeAILab ships them, EAGLE-3 as
SafeAILab and SpecForge write it, and speculators' ``eagle``/``eagle3`` formats.

Each checkpoint is written in code exactly as the publisher's code writes it (`published_heads`: modules
with the published attribute names, so the published key names; the published file names and config
keys), loaded through `draft_head`, and the loaded head's logits and fed-back feature are compared with a
direct transcription of the published forward on the same states. Every mismatch with the verifier is
refused before anything loads. Then a loaded head in chains: greedy output is plain `generate`'s (one
row, a left-padded ragged batch, 2 and 3 levels, dynamic and static runners) and sampling is the
target's distribution, with the statistics showing the head drafted and was accepted and rejected.
"""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch
from helpers import VOCAB, assert_every_level_took_part, chi_square_p_value, left_padded, sample_counts
from published_heads import (
    SafeAILabEagle,
    SafeAILabEagle3,
    SpeculatorsEagle,
    SpeculatorsEagle3,
    _random_,
    llama_fields,
    rope_theta,
    write_pretrained,
    write_safeailab,
)

import hf_polybasic as hp
from hf_polybasic.decoding import round as levels_round
from hf_polybasic.heads.training import distill
from hf_polybasic.testing import PAD, prompt, tiny_chain

draft_head = hp.levels.draft_head


@pytest.fixture(scope="module")
def deep(shared_models):
    """A tiny 8-layer verifier: EAGLE-3's default layers (inputs of 2, L//2, L-3) are three distinct ones."""
    return shared_models.target("llama", seed=7, layers=8)


def _verifier_layers(verifier):
    return verifier.config.num_hidden_layers


def _speculators_config(verifier, kind: str, **fields) -> dict:
    """A speculators config.json (its SpeculatorModelConfig fields, ``transformer_layer_config`` by
    ``to_diff_dict``) for a head of ``verifier``."""
    config = verifier.config
    layer_config = dict(model_type="llama", vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                        intermediate_size=2 * config.hidden_size, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, rms_norm_eps=1e-05, max_position_embeddings=2048,
                        rope_theta=rope_theta(config))
    layer_config.update(fields.pop("layer", {}))
    return dict(speculators_model_type=kind, speculators_version="0.3.0",
                architectures=["Eagle3DraftModel" if kind == "eagle3" else "EagleSpeculator"],
                transformer_layer_config=layer_config,
                speculators_config=dict(algorithm=kind, default_proposal_method="greedy",
                                        proposal_methods=[dict(proposal_type="greedy", speculative_tokens=3)],
                                        verifier=dict(name_or_path="tiny/llama", architectures=["LlamaForCausalLM"])),
                **fields)


def _used_tokens(count: int, vocab: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(vocab, generator=generator)[:count].tolist())


# --- each format, written as published, against a transcription of the published forward --------------
def safeailab_eagle(directory, verifier, bias=True, qkv_bias=None, file="pytorch_model.bin"):
    extra = dict(bias=bias) if bias is not True else {}  # ea_model: fc bias unless config.json says "bias": false
    if qkv_bias is not None:
        extra["qkv_bias"] = qkv_bias
    config = llama_fields(verifier, **extra)
    module = _random_(SafeAILabEagle(config, bias=bias), seed=1)
    with torch.no_grad():  # the trainer's embedding is the verifier's, loaded from its checkpoint
        module.embed_tokens.weight.copy_(verifier.get_input_embeddings().weight)
    return write_safeailab(directory, config, module, skip=(), file=file), module


def safeailab_eagle3(directory, verifier, draft_vocab=64):
    config = llama_fields(verifier, draft_vocab_size=draft_vocab)
    module = _random_(SafeAILabEagle3(config), seed=2)
    module.set_draft_vocabulary(_used_tokens(draft_vocab, config["vocab_size"], seed=3))
    with torch.no_grad():
        module.embed_tokens.weight.copy_(verifier.get_input_embeddings().weight)
    return write_safeailab(directory, config, module), module  # no frozen parameters saved: no embeddings


def specforge_eagle3(directory, verifier, ids=(1, 3, 5), draft_vocab=64, fc_norm=True, norm_output=False,
                     own_embedding=False):
    config = llama_fields(verifier, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
                          eagle_config=dict(eagle_aux_hidden_state_layer_ids=list(ids), use_aux_hidden_state=True),
                          fc_norm=fc_norm, norm_output=norm_output, torch_dtype="bfloat16")
    module = _random_(SafeAILabEagle3(config), seed=4)
    module.set_draft_vocabulary(_used_tokens(draft_vocab, config["vocab_size"], seed=5))
    if not own_embedding:
        with torch.no_grad():
            module.embed_tokens.weight.copy_(verifier.get_input_embeddings().weight)
    return write_pretrained(directory, config, module), module  # export_to_hf: with the embeddings


def speculators_eagle3(directory, verifier, ids=(1, 4, 6), draft_vocab=64, layers=2, layer=None, **options):
    options = dict(dict(norm_before_residual=True, norm_before_fc=True, norm_output=True), **options)
    config = _speculators_config(verifier, "eagle3", layer=dict(num_hidden_layers=layers, **(layer or {})),
                                 draft_vocab_size=draft_vocab,
                                 eagle_aux_hidden_state_layer_ids=list(ids), target_hidden_size=None,
                                 embed_requires_grad=False, **options)
    module = _random_(SpeculatorsEagle3(config), seed=6)
    if draft_vocab != verifier.config.vocab_size:
        used = _used_tokens(draft_vocab, verifier.config.vocab_size, seed=7)
        module.d2t.copy_(torch.tensor([token - i for i, token in enumerate(used)]))
        module.t2d.copy_(torch.tensor([i in used for i in range(verifier.config.vocab_size)]))
    with torch.no_grad():
        module.embed_tokens.weight.copy_(verifier.get_input_embeddings().weight)
    return write_pretrained(directory, config, module, skip=("verifier_lm_head", "verifier_norm")), module


def speculators_eagle(directory, verifier, layernorms=True, fusion_bias=True):
    config = _speculators_config(verifier, "eagle", layernorms=layernorms, fusion_bias=fusion_bias,
                                 transformer_layer_architecture="LlamaDecoderLayer")
    module = _random_(SpeculatorsEagle(config), seed=8)
    return write_pretrained(directory, config, module), module


def _states(verifier, ids, layers):
    with torch.no_grad():
        hidden = verifier(ids, output_hidden_states=True).hidden_states
    return torch.cat([hidden[layer] for layer in layers], dim=-1)


FORMATS = {
    "SafeAILab EAGLE-1 (pytorch_model.bin, fc bias)": (safeailab_eagle, {}),
    "SafeAILab EAGLE-1 for Llama 3 (no fc bias)": (safeailab_eagle, dict(bias=False)),
    "SafeAILab EAGLE-1 with qkv_bias (model.safetensors)": (safeailab_eagle, dict(qkv_bias=True, file="model.safetensors")),
    "SafeAILab EAGLE-3 (default layers, no embeddings)": (safeailab_eagle3, {}),
    "SpecForge EAGLE-3.1 (fc_norm, norm_output false)": (specforge_eagle3, {}),
    "SpecForge EAGLE-3 (own embeddings)": (specforge_eagle3, dict(fc_norm=False, norm_output=True, own_embedding=True)),
    "speculators eagle3 (2 layers, EAGLE-3.1 norms)": (speculators_eagle3, {}),
    "speculators eagle3 (fc_norm, full vocabulary)": (speculators_eagle3, dict(
        norm_before_fc=False, fc_norm=True, norm_output=False, draft_vocab=96, layers=1)),
    "speculators eagle3 (Qwen3 layers)": (speculators_eagle3, dict(
        layer=dict(model_type="qwen3", head_dim=8), norm_before_fc=False, norm_output=False)),
    "speculators eagle (HASS layernorms, fusion bias)": (speculators_eagle, {}),
    "speculators eagle (EAGLE-1)": (speculators_eagle, dict(layernorms=False, fusion_bias=False)),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_loaded_head_computes_the_published_forward(name, deep, tmp_path):
    """The head `draft_head` loads gives the transcribed forward's logits (at the verifier's ids; -inf at
    the ids a reduced draft vocabulary lacks) and feeds back what the published loop feeds back, on the
    verifier's real states at the layers the format reads."""
    write, options = FORMATS[name]
    directory, reference = write(tmp_path / "head", deep, **options)
    head = draft_head(str(directory), verifier=deep).head
    ids = prompt(9, seed=3)
    states = _states(deep, ids, head.feature_layers)
    tokens = ids[:, 1:]  # head position j reads the token at j + 1 and the states of j
    positions = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        ours, fed_back = head(tokens, head.project(states[:, :-1]), position_ids=positions, attention_mask=None,
                              cache=None, use_cache=False)
        if isinstance(reference, SafeAILabEagle):
            theirs, their_hidden = reference(states[:, :-1], tokens, deep.get_output_embeddings())
        elif isinstance(reference, SpeculatorsEagle):
            theirs, their_hidden = reference(states[:, :-1], tokens, deep.get_input_embeddings(),
                                             deep.get_output_embeddings())
        elif isinstance(reference, SpeculatorsEagle3):
            theirs, their_hidden = reference(reference.project(states[:, :-1]), tokens)
        else:
            theirs, their_hidden = reference(states[:, :-1], tokens)
    torch.testing.assert_close(fed_back, their_hidden, rtol=1e-4, atol=1e-4)
    d2t = getattr(reference, "d2t", None)
    if d2t is not None:  # the draft vocabulary's logits at their verifier ids (target = draft + d2t[draft])
        targets = torch.arange(d2t.shape[0]) + d2t
        torch.testing.assert_close(ours[..., targets], theirs, rtol=1e-4, atol=1e-4)
        elsewhere = torch.ones(ours.shape[-1], dtype=torch.bool)
        elsewhere[targets] = False
        assert elsewhere.any() and torch.isneginf(ours[..., elsewhere]).all()
    else:
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    # the second step reads the head's own output as its feature, as every publisher's loop does
    with torch.no_grad():
        ours_next, _ = head(tokens[:, 1:], fed_back[:, :-1], position_ids=positions[:, :-1], attention_mask=None,
                            cache=None, use_cache=False)
        theirs_next = (reference(their_hidden[:, :-1], tokens[:, 1:], deep.get_output_embeddings())
                       if isinstance(reference, SafeAILabEagle) else
                       reference(their_hidden[:, :-1], tokens[:, 1:], deep.get_input_embeddings(),
                                 deep.get_output_embeddings()) if isinstance(reference, SpeculatorsEagle) else
                       reference(their_hidden[:, :-1], tokens[:, 1:]))[0]
    kept = torch.isfinite(ours_next)
    torch.testing.assert_close(ours_next[kept].view(*theirs_next.shape[:-1], -1), theirs_next, rtol=1e-4, atol=1e-4)


def _captured_inputs(verifier, ids, layer_ids):
    """What the publishers' engines collect: the input of each layer in ``layer_ids`` (SafeAILab's
    modeling_llama_kv, vLLM and SGLang append ``hidden_states`` before running layer i), in layer order."""
    captured = {}

    def keep(index):
        def hook(module, args, kwargs):
            captured[index] = args[0] if args else kwargs["hidden_states"]
        return hook

    hooks = [layer.register_forward_pre_hook(keep(index), with_kwargs=True)
             for index, layer in enumerate(verifier.model.layers)]
    try:
        with torch.no_grad():
            verifier(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat([captured[index] for index in sorted(set(layer_ids))], dim=-1)


def test_an_eagle3_head_reads_the_states_its_publisher_captures(deep, tmp_path):
    """SafeAILab: the inputs of layers 2, L//2, L-3; SpecForge: the outputs of its eagle_config ids (SGLang
    captures the input of id + 1), listed in any order; speculators: the inputs of its ids (vLLM)."""
    count, ids = _verifier_layers(deep), prompt(7, seed=4)
    cases = [(safeailab_eagle3(tmp_path / "a", deep)[0], [2, count // 2, count - 3]),
             (specforge_eagle3(tmp_path / "b", deep, ids=(5, 0, 3))[0], [1, 4, 6]),
             (speculators_eagle3(tmp_path / "c", deep, ids=(6, 1, 4))[0], [1, 4, 6])]
    for directory, captured_layers in cases:
        head = draft_head(str(directory), verifier=deep).head
        torch.testing.assert_close(_states(deep, ids, head.feature_layers), _captured_inputs(deep, ids, captured_layers))
    eagle = draft_head(str(safeailab_eagle(tmp_path / "d", deep)[0]), verifier=deep).head
    with torch.no_grad():  # EAGLE-1/2: ea_model hands the head the base model's outputs[0], after the final norm
        last = deep.model(ids).last_hidden_state
    torch.testing.assert_close(_states(deep, ids, eagle.feature_layers), last)


def test_loading_a_head_leaves_the_verifier_alone(deep, tmp_path):
    """The verifier's weights are read, never copied into the head nor changed, and nothing done to the head
    (a cast, training) reaches them."""
    before = {key: value.clone() for key, value in deep.state_dict().items()}
    level = draft_head(str(safeailab_eagle(tmp_path / "h", deep)[0]), verifier=deep)
    verifier_storage = {p.untyped_storage().data_ptr() for p in deep.parameters()}
    assert not verifier_storage & {p.untyped_storage().data_ptr() for p in level.parameters()}
    assert level.head.own_embedding is None  # the shipped embeddings equal the verifier's: shared, not copied
    level.to(torch.float64)
    assert all(p.dtype == torch.float32 for p in deep.parameters())
    after = deep.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[key], after[key]) for key in before)


# --- refusals: nothing half-loads --------------------------------------------------------------------
def _edit(directory, config=None, state=None):
    """Rewrite a checkpoint: ``config(dict)`` and ``state(dict)`` change them in place."""
    path = directory / "config.json"
    if config is not None:
        fields = json.loads(path.read_text())
        config(fields)
        path.write_text(json.dumps(fields))
    if state is not None:
        from safetensors.torch import load_file, save_file

        weights = directory / "model.safetensors"
        if weights.exists():
            tensors = load_file(weights)
            state(tensors)
            save_file(tensors, str(weights))
        else:
            tensors = torch.load(directory / "pytorch_model.bin", weights_only=True)
            state(tensors)
            torch.save(tensors, directory / "pytorch_model.bin")
    return directory


REFUSALS = {
    "hidden size": (safeailab_eagle, dict(config=lambda c: c.update(hidden_size=64)),
                    r"config.json hidden_size is 64, but the verifier's hidden size is 32"),
    "vocabulary": (safeailab_eagle3, dict(config=lambda c: c.update(vocab_size=128)),
                   r"config.json vocab_size is 128, but the verifier's vocab_size is 96"),
    "speculators vocabulary": (speculators_eagle3, dict(config=lambda c: c["transformer_layer_config"].update(
        vocab_size=100)), r"transformer_layer_config.vocab_size is 100, but the verifier's vocab_size is 96"),
    "layer ids past the verifier": (specforge_eagle3, dict(config=lambda c: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids=[1, 3, 7])), r"eagle_config.eagle_aux_hidden_state_layer_ids is \[1, 3, 7\]: "
        r"it must name distinct layers among the verifier's 8 \(0 .. 6\)"),
    "speculators layer ids past the verifier": (speculators_eagle3, dict(config=lambda c: c.update(
        eagle_aux_hidden_state_layer_ids=[1, 4, 8])), r"eagle_aux_hidden_state_layer_ids is \[1, 4, 8\]"),
    "unknown key": (safeailab_eagle, dict(state=lambda s: s.update({"layers.1.mlp.up_proj.weight": torch.zeros(64, 32)})),
                    r"has keys this format does not have: 'layers.1.mlp.up_proj.weight'.*nothing was loaded"),
    "missing key": (safeailab_eagle, dict(state=lambda s: s.pop("fc.bias")),
                    r"lacks keys its config.json asks for: 'fc.bias'; nothing was loaded"),
    "missing midlayer key": (specforge_eagle3, dict(state=lambda s: s.pop("midlayer.hidden_norm.weight")),
                             r"lacks keys its config.json asks for: 'midlayer.hidden_norm.weight'"),
    "wrong shape": (speculators_eagle, dict(state=lambda s: s.update({"fusion_fc.weight": torch.zeros(32, 48)})),
                    r"key 'fusion_fc.weight' has shape \[32, 48\], expected \[32, 64\]"),
    "missing d2t": (safeailab_eagle3, dict(state=lambda s: s.pop("d2t")), r"lacks key 'd2t'"),
    "d2t past the vocabulary": (specforge_eagle3, dict(state=lambda s: s["d2t"].add_(40)),
                                r"'d2t' maps draft ids to ids outside 0 .. 95"),
    "t2d not d2t's": (safeailab_eagle3, dict(state=lambda s: s["t2d"].fill_(True)),
                      r"'t2d' .* does not mark exactly the ids 'd2t' maps to"),
    "another speculators head": (speculators_eagle, dict(config=lambda c: c.update(speculators_model_type="dflash")),
                                 r"speculators_model_type is 'dflash'; draft_head reads speculators' 'eagle' and 'eagle3'"),
    "not a head": (safeailab_eagle, dict(state=lambda s: [s.pop(key) for key in list(s) if key.startswith("layers.")]),
                   r"not a head checkpoint draft_head reads"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_checkpoint_that_does_not_fit_its_verifier_is_refused(name, deep, tmp_path):
    write, edits, message = REFUSALS[name]
    directory = _edit(write(tmp_path / "head", deep)[0], **edits)
    with pytest.raises(ValueError, match=message):
        draft_head(str(directory), verifier=deep)


def test_eagle3_default_layers_need_a_verifier_of_seven_layers(tmp_path, shared_models):
    shallow = shared_models.target("llama", seed=7, layers=4)
    directory = safeailab_eagle3(tmp_path / "head", shallow)[0]
    with pytest.raises(ValueError, match=r"no eagle_config.eagle_aux_hidden_state_layer_ids, and EAGLE-3's default "
                                         r"layers .* only from 7 layers on; the verifier has 4"):
        draft_head(str(directory), verifier=shallow)


def test_missing_files_are_named(deep, tmp_path):
    with pytest.raises(ValueError, match=r"no such local directory, and no Hub repository of that id could be read"):
        draft_head(str(tmp_path / "nowhere" / "x" / "y"), verifier=deep)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no config.json"):
        draft_head(str(tmp_path / "empty"), verifier=deep)
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"has no weights \(model.safetensors or pytorch_model.bin"):
        draft_head(str(tmp_path / "empty"), verifier=deep)


def test_a_sharded_checkpoint_loads_as_one(deep, tmp_path):
    """Shards and their index, as save_pretrained writes a checkpoint over its shard size."""
    from safetensors.torch import load_file, save_file

    directory, _ = specforge_eagle3(tmp_path / "head", deep)
    whole = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    keys, weight_map = sorted(whole), {}
    for index, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2 :]), 1):
        name = f"model-0000{index}-of-00002.safetensors"
        save_file({key: whole[key] for key in part}, str(directory / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    head = draft_head(str(directory), verifier=deep).head
    torch.testing.assert_close(head.fc.weight, whole["fc.weight"])


def test_a_hub_id_loads_offline_from_the_hf_cache(deep, tmp_path, monkeypatch):
    """A Hub id whose files are in the HF cache loads with the Hub out of reach (``HF_HUB_OFFLINE``)."""
    import huggingface_hub

    cache, commit = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    repository = cache / "models--someone--eagle3-head"
    specforge_eagle3(repository / "snapshots" / commit, deep)
    (repository / "refs").mkdir(parents=True)
    (repository / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    level = draft_head("someone/eagle3-head", verifier=deep)
    assert level.head.feature_layers == (2, 4, 6)


# --- a loaded head in chains: exact, and drafting something accepted ---------------------------------
def _samples(target, count: int = 48, length: int = 24) -> torch.LongTensor:
    """``count`` texts the target samples (what a head is distilled on)."""
    torch.manual_seed(0)
    starts = torch.randint(3, target.config.vocab_size, (count, 3))
    return target.generate(starts, attention_mask=torch.ones_like(starts), do_sample=True, max_new_tokens=length,
                           pad_token_id=PAD, eos_token_id=None)


def _tiny_pair():
    return tiny_chain("llama", 2, seed=5, noises=(0.08,), layers=4)


def _trained_by_train_head(shared_models, tmp_path_factory):
    """(target, copy, a speculators EAGLE-3 head trained by `hf_polybasic.training.train_head` on the target's
    answers to prompts and a text file, loaded by draft_head): the head a user trains."""
    from hf_polybasic.testing import make_tokenizer
    from hf_polybasic.training import train_head

    def make():
        target, copy = shared_models.built(("loaded eagle3 pair",), _tiny_pair)
        data = tmp_path_factory.mktemp("train_head_data")
        (data / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": "".join(
            chr(36 + (i * 7 + j * 3 + i * j) % 88) for j in range(4 + i % 5))}) for i in range(48)))
        (data / "notes.txt").write_text("".join(chr(36 + (i * i) % 88) for i in range(200)))
        trained = train_head(target, make_tokenizer(), tmp_path_factory.mktemp("trained") / "head",
                             texts=[data / "notes.txt"], prompts=[data / "prompts.jsonl"], aux_layers=[1, 2, 3],
                             draft_vocab_size=64, seq_len=32, answer_tokens=24, steps=150,
                             lr=1e-2, batch_size=8, progress=False)
        return (trained.level(target),)

    target, copy = shared_models.built(("loaded eagle3 pair",), _tiny_pair)
    return target, copy, shared_models.built(("eagle3 head by train_head",), make)[0]


@pytest.fixture(scope="module", params=["SpecForge EAGLE-3, distilled", "trained by train_head"])
def loaded_chain(request, shared_models, tmp_path_factory):
    """(target, a noisy copy, an EAGLE-3 head) on a 4-layer tiny target: a SpecForge head written as SGLang's
    export writes it, loaded and distilled on the target's own samples (its draft vocabulary, 64 of 96 ids, the
    tokens most frequent in those samples, as SafeAILab's trainer picks it); or one `train_head` trained and
    saved in speculators' format (`tests/test_train_head.py`)."""
    if request.param == "trained by train_head":
        return _trained_by_train_head(shared_models, tmp_path_factory)

    def make():
        target, copy = shared_models.built(("loaded eagle3 pair",), _tiny_pair)
        texts = _samples(target)
        frequent = torch.bincount(texts.flatten(), minlength=target.config.vocab_size).argsort(descending=True)[:64]
        config = llama_fields(target, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=64,
                              eagle_config=dict(eagle_aux_hidden_state_layer_ids=[0, 1, 2]), fc_norm=True)
        module = _random_(SafeAILabEagle3(config), seed=9, scale=0.05, norms=0.0)
        module.set_draft_vocabulary(sorted(frequent.tolist()))
        directory = write_pretrained(tmp_path_factory.mktemp("eagle3"), config, module, skip=("embed_tokens",))
        level = draft_head(str(directory), verifier=target)
        distill(level.head, target, texts, steps=150, lr=1e-2)
        return target, copy, level

    return shared_models.built(("loaded eagle3 head",), make)


def _generate(target, ids, mask, chain, runner="dynamic", draft_tokens=4, **options):
    config = hp.PolybasicConfig(schedule="constant", num_draft_tokens=draft_tokens, block_threshold=3,
                                compile=runner == "compiled")
    call = dict(assistant_models=list(chain), custom_generate=hp.generate, return_dict_in_generate=True,
                pad_token_id=PAD, polybasic_config=config)
    if runner == "static":
        call["cache_implementation"] = "static"
    return target.generate(ids, attention_mask=mask, **call, **options)


@pytest.mark.parametrize("runner", ["dynamic", "static", pytest.param("compiled", marks=pytest.mark.slow)])
@pytest.mark.parametrize("depth", [2, 3])
def test_greedy_output_with_a_loaded_head_is_plain_generates(depth, runner, loaded_chain):
    """One row and a left-padded ragged batch; the head at the bottom of 2 levels (reading the target's
    states) and of 3 (reading the noisy copy's); dynamic, static and compiled runners."""
    target, copy, head = loaded_chain
    chain = [head] if depth == 2 else [copy, head]
    rows = [prompt(length, seed=90 + length)[0] for length in (7, 2, 5)]
    options = dict(do_sample=False, max_new_tokens=16)
    for ids, mask in [(rows[0][None], torch.ones_like(rows[0][None])), left_padded(rows)]:
        out = _generate(target, ids, mask, chain, runner, **options)
        assert torch.equal(out.sequences, target.generate(ids, attention_mask=mask, pad_token_id=PAD, **options))
        print(depth, runner, ids.shape[0], assert_every_level_took_part(out.polybasic_stats))
    assert out.polybasic_stats.levels[-1].runner == {"dynamic": "dynamic", "static": "static",
                                                      "compiled": "static, compiled"}[runner]


def test_a_loaded_head_drafts_what_the_target_samples(shared_models, tmp_path_factory):
    """The wiring from the checkpoint on works: a SafeAILab EAGLE-1 checkpoint, loaded and distilled for
    seconds on the tiny target's samples, is accepted on at least half of its drafts where the target samples."""

    def make():
        target = tiny_chain("llama", 1, seed=3)[0]
        config = llama_fields(target, bias=False)
        module = _random_(SafeAILabEagle(config, bias=False), seed=9, scale=0.05, norms=0.0)
        with torch.no_grad():
            module.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        level = draft_head(str(write_safeailab(tmp_path_factory.mktemp("eagle"), config, module, skip=())), verifier=target)
        distill(level.head, target, _samples(target), steps=150, lr=1e-2)
        return target, level

    target, head = shared_models.built(("loaded eagle head",), make)
    ids = prompt(6, seed=8)
    torch.manual_seed(0)
    out = _generate(target, ids, torch.ones_like(ids), [head], draft_tokens=2, do_sample=True, max_new_tokens=48)
    level = out.polybasic_stats.levels[0]
    print(out.polybasic_stats)
    assert level.drafted >= 40 and level.accepted >= 0.5 * level.drafted


@pytest.mark.parametrize("write", [safeailab_eagle, safeailab_eagle3, specforge_eagle3, speculators_eagle,
                                   speculators_eagle3])
def test_other_formats_stay_exact_in_a_chain(write, shared_models, tmp_path):
    """Random-weight heads of the other layouts, loaded and run: the output is still the target's."""
    target = shared_models.target("llama", seed=7, layers=8)
    level = draft_head(str(write(tmp_path / "head", target)[0]), verifier=target)
    ids = prompt(5, seed=1)
    out = _generate(target, ids, torch.ones_like(ids), [level], do_sample=False, max_new_tokens=12)
    assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=PAD))
    assert out.polybasic_stats.levels[1].proposed > 0


@pytest.mark.parametrize("reads", ["cpu", pytest.param("gpu", marks=pytest.mark.slow)])
def test_sampling_with_a_loaded_head_is_the_targets_distribution(reads, distribution_models, exact_distribution,
                                                                 shared_models, tmp_path_factory):
    """A speculators EAGLE-3 head over 6 of the 8 ids (the other two -inf in its logits), loaded and
    distilled: chi-square against exact enumeration; where reads wait for the device (``gpu``: drafts read with
    the verifier's decision, static caches) as on the CPU (dynamic caches)."""
    target = distribution_models[0]

    def make():
        directory = tmp_path_factory.mktemp("speculators")
        speculators_eagle3(directory, target, ids=(0, 1), draft_vocab=6, layers=1)
        level = draft_head(str(directory), verifier=target)
        torch.manual_seed(1)
        texts = torch.randint(0, VOCAB, (64, 3))
        texts = target.generate(texts, attention_mask=torch.ones_like(texts), do_sample=True, max_new_tokens=12,
                                pad_token_id=PAD)
        distill(level.head, target, texts, steps=100, lr=1e-2)
        return (level,)

    (head,) = shared_models.built(("distribution speculators head",), make)
    setting = "temperature+top_k+top_p"
    with mock.patch.object(levels_round, "reads_wait", lambda device: reads == "gpu"):
        counts, stats = sample_counts(target, setting, [head], seed=47, schedule="constant", num_draft_tokens=2,
                                      block_threshold=2, cache_implementation="static" if reads == "gpu" else None)
    print(assert_every_level_took_part(stats))
    assert chi_square_p_value(counts, exact_distribution(setting)) > 1e-3


def test_the_benchmarks_synthetic_eagle3_head_agrees_as_built(tmp_path):
    """`benchmarks.synthetic.build_eagle3_head` (a GPU check times a head row with it): written as speculators
    writes EAGLE-3, loaded through draft_head, its greedy draft is the target's on about the set fraction of
    the target's own greedy tokens, and a chain with it is exact, its drafts accepted and rejected."""
    from benchmarks.synthetic import build_eagle3_head, build_target, random_prompts

    target, construction = build_target("tiny", "cpu", torch.float32, draft_layers=2, draft_agreement=0.8, seed=0)
    level, built = build_eagle3_head(target, tmp_path / "head", agreement=0.6, seed=1)
    hidden = target.config.hidden_size
    assert built.layers == level.head.feature_layers == (1, 2, 3)
    assert level.head.fc.weight.shape == (hidden, 3 * hidden) and level.head.lm_head.weight.shape[0] == built.draft_vocab_size
    agreed = total = 0
    for prompt_ids in random_prompts([8, 12, 16], construction.vocab_size, seed=2, key_tokens=8):
        ids = torch.tensor([prompt_ids])
        text = target.generate(ids, max_new_tokens=48, do_sample=False, pad_token_id=PAD, eos_token_id=None)
        with torch.no_grad():  # the head's draft after each generated token, every feature the target's
            drafts = level.teacher_forced(text)[0].argmax(-1)  # [L]: position j's draft of the token at j + 1
        agreed += int((drafts[ids.shape[1] : -1] == text[0, ids.shape[1] + 1 :]).sum())
        total += text.shape[1] - ids.shape[1] - 1
        out = _generate(target, ids, torch.ones_like(ids), [level], do_sample=False, max_new_tokens=48,
                        eos_token_id=None)
        assert torch.equal(out.sequences, text)
        assert_every_level_took_part(out.polybasic_stats)
    assert agreed / total == pytest.approx(0.6, abs=0.12), (agreed, total)
