"""Training a head (`hf_polybasic.training.train_head`, issue 46): the files are speculators' EAGLE-3
checkpoint (its config fields, its keys, and its module computes what `draft_head` loads), the head drafts
what the target writes (against the same head untrained), an interrupted run resumes into the head an
uninterrupted one trains, features stream through shards, the draft vocabulary is speculators' choice,
and bad input is refused up front. That chains with a trained head stay exact (greedy: one row, a ragged
batch, 2 and 3 levels, dynamic and static runners) is `test_head_formats.py`'s chain test, parametrized over
a head `train_head` trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from published_heads import SpeculatorsEagle3
from safetensors.torch import load_file

from hf_polybasic.levels import draft_head
from hf_polybasic.testing import PAD, make_tokenizer, prompt
from hf_polybasic.training import train_head
from hf_polybasic.training import features as features_module
from hf_polybasic.training.loop import HeadTrainer
from hf_polybasic.training.speculators import initial_weights, write_checkpoint
from hf_polybasic.training.vocabulary import draft_ids, vocabulary_maps

# speculators' Eagle3SpeculatorConfig fields (models/eagle3/config.py) and SpeculatorModelConfig's
# (config.py), as its config.json holds them; the greedy proposal's fields (proposals/greedy.py)
EAGLE3_FIELDS = {"speculators_model_type", "architectures", "transformer_layer_config", "draft_vocab_size",
                 "norm_before_residual", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_fc",
                 "fc_norm", "norm_output", "embed_requires_grad", "speculators_version", "speculators_config"}
GREEDY_FIELDS = {"proposal_type", "speculative_tokens", "verifier_accept_k", "accept_tolerance"}
TRAINING_ONLY = {"verifier_lm_head.weight", "verifier_norm.weight"}  # Eagle3DraftModel._keys_to_ignore_on_save


def _write_data(directory: Path, prompts: int = 48) -> dict:
    """A prompts JSONL (Spec-Bench's, a chat and plain strings mixed) and a text file of the tiny vocabulary."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(prompts):
        text = "".join(chr(36 + (i * 7 + j * 3 + i * j) % 88) for j in range(4 + i % 5))
        lines.append([{"prompt": text}, {"turns": [text]}, {"messages": [{"role": "user", "content": text}]},
                      text][i % 4])
    (directory / "prompts.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    (directory / "notes.txt").write_text("".join(chr(36 + (i * i) % 88) for i in range(240)))
    return {"texts": [directory / "notes.txt"], "prompts": [directory / "prompts.jsonl"]}


@pytest.fixture(scope="module")
def deep(shared_models):
    """A tiny 8-layer verifier: EAGLE-3's default layers (inputs of 2, 4, 5) are three distinct ones."""
    return shared_models.target("llama", seed=7, layers=8)


@pytest.fixture(scope="module")
def trained(deep, tmp_path_factory):
    """A head trained for seconds on the verifier's greedy answers to 48 prompts and a text file, with a
    draft vocabulary of 64 of the 96 ids."""
    root = tmp_path_factory.mktemp("trained")
    return train_head(deep, make_tokenizer(), root / "head", **_write_data(root / "data"), draft_vocab_size=64,
                      seq_len=32, answer_tokens=24, steps=240, lr=1e-2, batch_size=8, shard_size=16, progress=False)


def test_the_files_are_a_speculators_eagle3_checkpoint(trained, deep):
    """config.json holds every field speculators' config class has, its layer config is a transformers
    Llama config of the verifier's width, and the weights are exactly the keys (and shapes) speculators'
    module saves, the embeddings left out (speculators and vLLM fill them from the verifier)."""
    from transformers import AutoConfig

    config = json.loads((trained.directory / "config.json").read_text())
    assert EAGLE3_FIELDS <= set(config) and config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and config["draft_vocab_size"] == 64
    speculators = config["speculators_config"]
    assert speculators["algorithm"] == "eagle3" and speculators["default_proposal_method"] == "greedy"
    assert [set(method) for method in speculators["proposal_methods"]] == [GREEDY_FIELDS]
    assert set(speculators["verifier"]) == {"name_or_path", "architectures"}
    layers = AutoConfig.for_model(**config["transformer_layer_config"])
    assert layers.model_type == "llama" and layers.hidden_size == deep.config.hidden_size
    assert layers.num_hidden_layers == 1 and layers.vocab_size == deep.config.vocab_size
    saved = load_file(trained.directory / "model.safetensors")
    theirs = SpeculatorsEagle3(config).state_dict()
    assert set(saved) == set(theirs) - TRAINING_ONLY - {"embed_tokens.weight"}
    assert all(tuple(saved[key].shape) == tuple(theirs[key].shape) for key in saved)
    assert saved["d2t"].dtype == torch.long and saved["t2d"].dtype == torch.bool
    assert int(saved["t2d"].sum()) == 64 and saved["fc.weight"].dtype == torch.bfloat16  # speculators saves bf16


def test_speculators_module_on_the_files_computes_what_draft_head_loads(trained, deep):
    """The transcription of speculators' Eagle3DraftModel, given the saved weights (and the verifier's
    embeddings, as its ``load_verifier_weights`` fills them), computes the logits and the fed-back state of
    the head `draft_head` loads from the same files: first step on the verifier's states, second on its own."""
    config = json.loads((trained.directory / "config.json").read_text())
    reference = SpeculatorsEagle3(config)
    missing, unexpected = reference.load_state_dict(load_file(trained.directory / "model.safetensors"), strict=False)
    assert set(missing) == TRAINING_ONLY | {"embed_tokens.weight"} and not unexpected
    with torch.no_grad():
        reference.embed_tokens.weight.copy_(deep.get_input_embeddings().weight)
    head = draft_head(str(trained.directory), verifier=deep).head
    ids = prompt(9, seed=3)
    with torch.no_grad():
        hidden = deep(ids, output_hidden_states=True).hidden_states
        states = torch.cat([hidden[layer] for layer in head.feature_layers], dim=-1)[:, :-1]
        tokens, positions = ids[:, 1:], torch.arange(ids.shape[1] - 1)[None]
        ours, fed_back = head(tokens, head.project(states), position_ids=positions, attention_mask=None, cache=None,
                              use_cache=False)
        theirs, their_hidden = reference(reference.project(states), tokens)
        ours_next, _ = head(tokens[:, 1:], fed_back[:, :-1], position_ids=positions[:, :-1], attention_mask=None,
                            cache=None, use_cache=False)
        theirs_next, _ = reference(their_hidden[:, :-1], tokens[:, 1:])
    targets = torch.arange(64) + reference.d2t
    torch.testing.assert_close(fed_back, their_hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours[..., targets], theirs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours_next[..., targets], theirs_next, rtol=1e-4, atol=1e-4)
    assert torch.isneginf(ours).sum() == ours.shape[1] * (96 - 64)  # the ids it cannot propose


def test_with_save_embeddings_the_files_hold_them_too(deep, tmp_path):
    from hf_polybasic.training.speculators import exported_weights

    root = tmp_path / "run"
    data = _write_data(root / "data", prompts=0)
    result = train_head(deep, make_tokenizer(), root / "head", texts=data["texts"], draft_vocab_size=64, seq_len=16,
                        steps=1, progress=False, save_embeddings=True, save_dtype="float32")
    saved = load_file(result.directory / "model.safetensors")
    config = json.loads((result.directory / "config.json").read_text())
    assert set(saved) == set(SpeculatorsEagle3(config).state_dict()) - TRAINING_ONLY and config["dtype"] == "float32"
    assert torch.equal(saved["embed_tokens.weight"], deep.get_input_embeddings().weight)
    head = draft_head(str(result.directory), verifier=deep).head
    assert head.own_embedding is None  # the verifier's, shared: not a copy
    assert set(exported_weights(head, deep, config, False)) == set(saved) - {"embed_tokens.weight"}


def _agreement(level, target, prompts) -> float:
    """Share of the target's greedy tokens the head drafts, teacher-forced on the target's states."""
    agreed = total = 0
    for ids in prompts:
        text = target.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=PAD)
        with torch.no_grad():
            drafts = level.teacher_forced(text)[0].argmax(-1)  # [L]: the draft of the token after each position
        agreed += int((drafts[ids.shape[1] : -1] == text[0, ids.shape[1] + 1 :]).sum())
        total += text.shape[1] - ids.shape[1] - 1
    return agreed / total


def test_a_trained_head_drafts_what_the_target_writes(trained, deep, tmp_path):
    """Teacher-forced on prompts it never saw, the trained head drafts the target's own greedy token far more
    often than the same head at its initial weights (the negative control: near zero)."""
    config = json.loads((trained.directory / "config.json").read_text())
    ids = torch.arange(64) + load_file(trained.directory / "model.safetensors")["d2t"]
    untrained = write_checkpoint(tmp_path / "untrained", config, initial_weights(config, deep, ids, seed=0))
    prompts = [prompt(length, seed=70 + length) for length in (3, 5, 8)]
    learned = _agreement(trained.level(deep), deep, prompts)
    before = _agreement(draft_head(str(untrained), verifier=deep), deep, prompts)
    print(f"agreement: trained {learned:.2f}, untrained {before:.2f}; loss {trained.losses[0]:.3f} -> "
          f"{trained.losses[-1]:.3f}")
    assert learned >= 0.25 and before <= 0.05
    assert trained.losses[-1] < 0.5 * trained.losses[0]


def test_an_interrupted_run_resumes_into_the_same_head(deep, tmp_path, monkeypatch):
    """A run interrupted (KeyboardInterrupt) in its 4th step resumes from its checkpoint after step 2 and
    ends with the weights, optimizer history and losses of the run never interrupted; another seed does
    not (the negative control). The features stream: shards of at most 2 windows are written, a batch
    reads only its own windows back, and the resumed run computes no feature again."""
    data = _write_data(tmp_path / "data", prompts=8)
    options = dict(draft_vocab_size=64, seq_len=16, answer_tokens=8, steps=6, batch_size=2, shard_size=2,
                   checkpoint_every=2, lr=1e-2, progress=False, **data)
    import safetensors.torch

    written, read = [], []

    real_save, real_read = safetensors.torch.save_file, features_module.FeatureShards.read

    def saving(tensors, path, *args, **kwargs):
        if "features" in tensors:
            written.append(tensors["features"].shape[0])
        return real_save(tensors, path, *args, **kwargs)

    def reading(self, indices):
        read.append(len(indices))
        return real_read(self, indices)

    monkeypatch.setattr(safetensors.torch, "save_file", saving)
    monkeypatch.setattr(features_module.FeatureShards, "read", reading)
    whole = train_head(deep, make_tokenizer(), tmp_path / "whole", **options)
    assert whole.windows >= 8 and written == [2] * (whole.windows // 2) + [1] * (whole.windows % 2)
    assert read == [2] * 6 and len(list((whole.work_dir / "features").iterdir())) == -(-whole.windows // 2)
    shard = load_file(whole.work_dir / "features" / "shard-00001.safetensors")
    states, last = features_module.teacher_states(deep, shard["input_ids"].long(), whole.feature_layers)
    torch.testing.assert_close(shard["features"], states)
    torch.testing.assert_close(shard["last"], last)

    steps, real_step = [], HeadTrainer.step

    def interrupted(self, step):
        steps.append(step)
        if len(steps) == 4:
            raise KeyboardInterrupt
        return real_step(self, step)

    monkeypatch.setattr(HeadTrainer, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_head(deep, make_tokenizer(), tmp_path / "resumed", **options)
    monkeypatch.setattr(HeadTrainer, "step", real_step)
    written.clear()
    resumed = train_head(deep, make_tokenizer(), tmp_path / "resumed", **options)
    assert resumed.resumed_from == 2 and resumed.steps == 6 and written == []
    other = train_head(deep, make_tokenizer(), tmp_path / "other", **dict(options, seed=1))

    def final(run):
        return torch.load(run.work_dir / "checkpoint.pt", weights_only=True)

    for key, value in final(whole)["head"].items():
        assert torch.equal(value, final(resumed)["head"][key]), key
    assert resumed.losses == whole.losses
    whole_files, resumed_files = (load_file(run.directory / "model.safetensors") for run in (whole, resumed))
    assert whole_files.keys() == resumed_files.keys()
    assert all(torch.equal(whole_files[key], resumed_files[key]) for key in whole_files)
    assert not torch.equal(final(whole)["head"]["fc.weight"], final(other)["head"]["fc.weight"])


def _speculators_rule(frequencies: dict[int, int], size: int, vocab: int):
    """speculators' train/vocab_mapping.py ``build_vocab_mappings_from_distribution``, transcribed."""
    ranked = sorted(frequencies, key=lambda token: (-frequencies[token], token))
    chosen = ranked[: min(size, len(ranked))]
    if len(chosen) < size:
        present = set(chosen)
        for token in range(size):
            if token not in present:
                chosen.append(token)
            if len(chosen) >= size:
                break
    chosen.sort()
    d2t = torch.tensor(chosen) - torch.arange(size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


@pytest.mark.parametrize("size", [3, 6, 10])
def test_the_draft_vocabulary_is_the_one_speculators_picks(size):
    """Most frequent first, ties to the lower id, topped up with the lowest unseen ids."""
    counts = torch.tensor([0, 5, 2, 5, 0, 7, 0, 2, 1, 0, 0, 3])
    frequencies = {token: int(count) for token, count in enumerate(counts.tolist()) if count}
    ours = vocabulary_maps(draft_ids(counts, size), counts.numel())
    theirs = _speculators_rule(frequencies, size, counts.numel())
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


class _NoHiddenStates(torch.nn.Module):
    """A causal LM whose forward never returns hidden states."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config, self.generation_config = inner, inner.config, inner.generation_config

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, input_ids, **kwargs):
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(logits=self.inner(input_ids).logits)


def _bad_jsonl(directory: Path, line: str) -> Path:
    path = directory / "bad.jsonl"
    path.write_text(line + "\n")
    return path


BAD_INPUT = {
    "no data": (dict(), r"no texts and no prompts; pass texts="),
    "a path that does not exist": (dict(texts=["{tmp}/nowhere.txt"]), r"texts path '.*nowhere.txt' does not exist"),
    "a folder without text": (dict(texts=["{tmp}/empty"]), r"texts folder '.*empty' holds no file ending in .txt"),
    "a draft vocabulary larger than the vocabulary": (dict(texts=["{tmp}/notes.txt"], draft_vocab_size=97),
                                                      r"draft_vocab_size is 97, but the model's vocabulary has 96 ids"),
    "layers the model lacks": (dict(texts=["{tmp}/notes.txt"], aux_layers=[1, 4, 8]),
                               r"aux_layers \[1, 4, 8\] name layers the model does not have \(it has 8"),
    "too little text": (dict(texts=["{tmp}/notes.txt"], seq_len=1000), r"fewer than seq_len=1000 tokens"),
    "a prompt line of another shape": (dict(prompts=["{tmp}/bad.jsonl"]),
                                       r"bad.jsonl:1: a prompt is a JSON string or an object with \"prompt\""),
    "prompts passed as texts": (dict(texts=["{tmp}/bad.jsonl"]), r"a file of prompts .* goes in prompts"),
    "a bad setting": (dict(texts=["{tmp}/notes.txt"], steps=0), r"steps must be a positive integer, got 0"),
    "a bad save dtype": (dict(texts=["{tmp}/notes.txt"], save_dtype="int8"), r"save_dtype must be one of"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_refused_before_any_work(case, deep, tmp_path):
    options, message = BAD_INPUT[case]
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("abcdefgh" * 20)
    _bad_jsonl(tmp_path, json.dumps({"question": "x"}) if "prompt line" in case else json.dumps({"prompt": "x"}))
    options = {key: [item.format(tmp=tmp_path) for item in value] if key in ("texts", "prompts") else value
               for key, value in options.items()}
    with pytest.raises(ValueError, match=message):
        train_head(deep, make_tokenizer(), tmp_path / "head", progress=False, **options)


def test_models_that_cannot_teach_a_head_are_refused(shared_models, deep, tmp_path):
    from hf_polybasic.levels import quantized_copy

    (tmp_path / "notes.txt").write_text("abcdefgh" * 20)
    texts = [tmp_path / "notes.txt"]
    with pytest.raises(ValueError, match=r"returns no hidden_states when called with output_hidden_states=True"):
        train_head(_NoHiddenStates(deep), make_tokenizer(), tmp_path / "a", texts=texts, progress=False)
    shallow = shared_models.target("llama", seed=7, layers=4)
    with pytest.raises(ValueError, match=r"has 4 layers; EAGLE-3's default layers .* pass aux_layers"):
        train_head(shallow, make_tokenizer(), tmp_path / "b", texts=texts, progress=False)
    with pytest.raises(ValueError, match=r"output layer \(.*\) has no floating-point weight"):
        train_head(quantized_copy(deep, "int8-dynamic"), make_tokenizer(), tmp_path / "c", texts=texts, progress=False)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['stpes'\]"):
        train_head(deep, make_tokenizer(), tmp_path / "d", texts=texts, stpes=3)


def test_a_work_folder_of_other_settings_is_not_resumed(trained, deep):
    with pytest.raises(ValueError, match=r"holds a run with other settings \(.*settings\.seed.*differ\)"):
        train_head(deep, make_tokenizer(), trained.directory, texts=["x"], seed=5)


def test_the_command_line_trains_a_head(tmp_path, capsys):
    from hf_polybasic.cli import main as cli

    (tmp_path / "notes.txt").write_text("abcdefghij" * 40)
    assert cli.main(["train-head", "tiny", "--output", str(tmp_path / "head"), "--texts", str(tmp_path / "notes.txt"),
                     "--steps", "2", "--seq-len", "16", "--draft-vocab-size", "48", "--threads", "1",
                     "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "trained 2 of 2 steps" in printed and "draft vocabulary 48" in printed
    assert json.loads((tmp_path / "head" / "config.json").read_text())["draft_vocab_size"] == 48
    assert cli.main(["train-head", "tiny", "--output", str(tmp_path / "x"), "--texts", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_every_error_train_head_raises_is_on_the_errors_page():
    """Each message the training package raises has its fixed text on docs/reference/errors.md."""
    import ast

    import hf_polybasic.training as training

    page = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "errors.md").read_text()
    found = []
    for path in sorted(Path(training.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                message = node.exc.args[0]
                parts = [message.value] if isinstance(message, ast.Constant) else [
                    part.value for part in getattr(message, "values", []) if isinstance(part, ast.Constant)]
                if parts and parts[0].startswith("train_head"):
                    found.append(path.name)
                    missing = [part for part in parts if len(part.strip()) >= 12 and part not in page]
                    assert not missing, f"{path.name}: {missing} is not on the errors page"
    assert len(found) >= 20  # it read the package's messages


def test_a_head_written_by_transformers_5_keeps_its_rope_base_on_every_release(trained, deep, tmp_path):
    """transformers 5 writes the layer config's RoPE base under rope_parameters only (as speculators' files
    written under it have it); releases before 5 read rope_theta. The head draft_head builds uses the
    written base on the release this runs on (the test matrix runs 4.57 too)."""
    import shutil

    directory = Path(shutil.copytree(trained.directory, tmp_path / "head", ignore=shutil.ignore_patterns("training")))
    config = json.loads((directory / "config.json").read_text())
    layers = config["transformer_layer_config"]
    layers.pop("rope_theta", None)
    layers["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (directory / "config.json").write_text(json.dumps(config))
    head = draft_head(str(directory), verifier=deep).head
    head_dim = deep.config.hidden_size // deep.config.num_attention_heads
    expected = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    torch.testing.assert_close(head.decoder.rotary_emb.inv_freq, expected)


def test_a_trained_head_drafts_for_a_packed_target(trained):
    """The benchmark's targets may have oneDNN-packed linear layers (no ``weight`` on the LM head): the head
    loads for such a target and the chain stays exact."""
    import hf_polybasic as hp
    from hf_polybasic.models import packed
    from hf_polybasic.testing import make_target

    if torch.float32 not in packed.supported_dtypes():
        pytest.skip("oneDNN cannot pack float32 layers on this machine")
    target = packed.pack_linear_layers(make_target("llama", seed=7, layers=8))  # the trained head's verifier, packed
    head = trained.level(target)
    ids, options = prompt(6, seed=75), dict(do_sample=False, max_new_tokens=16, pad_token_id=PAD)
    config = hp.PolybasicConfig(schedule="constant", num_draft_tokens=4)
    out = target.generate(ids, custom_generate=hp.generate, assistant_models=[head], polybasic_config=config,
                          return_dict_in_generate=True, **options)
    assert torch.equal(out.sequences, target.generate(ids, **options))
    assert out.polybasic_stats.levels[0].accepted > 0
