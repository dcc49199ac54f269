"""Helpers that several test files share: plain functions and constants, no fixtures (those are in
conftest.py). A test file imports them from here, never from another ``test_*`` module.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import hf_polybasic as hp
from hf_polybasic.testing import PAD, make_target, noisy_copy, prompt


# --- batches (test_batches, test_host_reads, test_oracle, test_probe, test_vocab_head) ------------
def left_padded(prompts, width: int | None = None):
    """input_ids and attention_mask of left-padded prompts (1-D tensors), ``width`` wide (default:
    the longest prompt)."""
    width = max(p.shape[0] for p in prompts) if width is None else width
    ids = torch.full((len(prompts), width), PAD)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - p.shape[0] :] = p
        mask[row, width - p.shape[0] :] = 1
    return ids, mask


def assert_rows_as_alone(target, sequences: torch.Tensor, prompts, ids: torch.Tensor, options: dict) -> None:
    """Each row of a left-padded batch's output (``sequences`` [rows, width + m], ``ids`` [rows, width]
    its input) is its input, then what plain `generate` emits for the row alone under ``options``, then
    pad tokens to the batch's end (the longest row's)."""
    width = ids.shape[1]
    alone = [target.generate(p[None], **options)[0, p.shape[0] :] for p in prompts]
    assert sequences.shape[1] == width + max(new.shape[0] for new in alone)
    for row, new in enumerate(alone):
        assert torch.equal(sequences[row, :width], ids[row])
        assert torch.equal(sequences[row, width : width + new.shape[0]], new), f"row {row}"
        assert bool((sequences[row, width + new.shape[0] :] == PAD).all())


# --- theory: Monte Carlo simulators (test_theory, test_theory_costs) -------------------------------
def leading_true(mask: np.ndarray) -> np.ndarray:
    """Length of the leading run of True along the last axis."""
    return np.cumprod(mask, axis=-1).sum(-1)


def simulate_accepted(rng: np.random.Generator, p: float, n: int, size: int) -> np.ndarray:
    """Accepted drafts of `size` verifications: independent coins with P(accept) = p, stop at the first reject."""
    return leading_true(rng.random((size, n)) < p)


def simulate_three_models(rng, p_top: float, p_mid: float, k: int, mu: int, cycles: int) -> dict[str, np.ndarray]:
    """Per verification of M1 in the staged algorithm (see docs/concepts.md).

    M3 drafts k tokens (k forwards), M2 verifies them (1 forward, emits accepted + 1) and repeats
    until it holds at least mu tokens; M1 verifies that block (1 forward, emits accepted + 1).
    Acceptance is i.i.d. per token: p_mid for M2 on M3's drafts, p_top for M1 on M2's tokens.
    """
    emitted = simulate_accepted(rng, p_mid, k, cycles * mu).reshape(cycles, mu) + 1  # per M2 round
    held = np.cumsum(emitted, axis=1)
    rounds = (held < mu).sum(1) + 1  # M2 rounds until the block holds >= mu tokens
    block = held[np.arange(cycles), rounds - 1]
    accepted = np.minimum(simulate_accepted(rng, p_top, mu + k, cycles), block)
    forwards = np.stack([np.ones(cycles), rounds, k * rounds], axis=-1)
    return {"tokens": accepted + 1, "forwards": forwards, "block": block}


# --- quantized copies (test_int4, test_four_bit) ---------------------------------------------------
def assert_independent_of_its_source(copy, target, ids) -> None:
    """Whatever is done to ``target`` later (its weights zeroed, cast), ``copy`` computes the same."""
    expected = copy(ids).logits
    with torch.no_grad():
        for parameter in target.parameters():
            parameter.zero_()
    target.to(torch.float16)
    assert torch.equal(copy(ids).logits, expected)


# --- a tiny GGUF (test_models, test_compat) --------------------------------------------------------
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 32, 64, 2, 4, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_gguf(path: Path) -> None:
    """A random llama GGUF that transformers' ``gguf_file=`` loader accepts."""
    gguf = pytest.importorskip("gguf")
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(0)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = list(bytes_to_unicode().values()) + ["Ġt", "he"] + specials
    vocab, head_dim = len(tokens), HIDDEN // HEADS

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(128)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_embedding_length(HIDDEN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - len(specials)) + [3] * len(specials))  # 3 = control
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(vocab - 3)
    writer.add_eos_token_id(vocab - 1)
    writer.add_pad_token_id(vocab - 3)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def dense(name, *shape):
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32) * 0.3)

    def q8(name, *shape):  # stored as Q8_0 blocks, dequantized on load
        data = rng.standard_normal(shape).astype(np.float32) * 0.3
        writer.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    dense("token_embd.weight", vocab, HIDDEN)
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        q8(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN)
        q8(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        dense(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        dense(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        q8(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        q8(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        q8(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    dense("output.weight", vocab, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# --- the distribution tests: an 8-token target, its exact processed distribution over 3-token
# continuations (plain `generate`'s own scores are the oracle), sampling through a chain, and a
# chi-square goodness-of-fit test -----------------------------------------------------------------
VOCAB = 8
STEPS = 3
SAMPLES = 2000
ALPHA = 1e-3

SETTINGS = {
    "temperature+top_k+top_p": dict(temperature=0.8, top_k=5, top_p=0.9),
    "repetition_penalty": dict(repetition_penalty=1.8, top_k=0),
    "min_p": dict(min_p=0.15, temperature=1.2, top_k=0),
}


def build_models(arch: str = "llama", layers: int = 2) -> tuple:
    """An 8-token target and three noisy copies of it (noise 0.3, 0.6, 0.9); no EOS. ``arch``: any of
    `hf_polybasic.testing.make_target`'s, e.g. a hybrid model (test_hybrid.py)."""
    target = make_target(arch, seed=3, vocab=VOCAB, logit_scale=1.5, layers=layers)
    target.generation_config.eos_token_id = None  # every sample has exactly STEPS tokens
    copies = [noisy_copy(target, noise, seed) for seed, noise in enumerate((0.3, 0.6, 0.9), 1)]
    for model in copies:
        model.generation_config.eos_token_id = None
    return (target, *copies)


def exact_joint(target, setting: str, ids=None) -> np.ndarray:
    """P(x1, x2, x3) after ``ids`` (default: the tests' 3-token prompt) under the target's processed
    distribution, from plain generate's own scores."""
    ids = prompt(3, seed=5, vocab=VOCAB) if ids is None else ids
    options = SETTINGS[setting]

    def next_probs(prefix: tuple[int, ...]) -> np.ndarray:
        full = torch.cat([ids, torch.tensor([prefix], dtype=torch.long)], dim=1) if prefix else ids
        # an explicit mask: otherwise generate masks prompt tokens equal to pad_token_id (0 here)
        out = target.generate(
            full, attention_mask=torch.ones_like(full), do_sample=True, max_new_tokens=1, output_scores=True, return_dict_in_generate=True, **options
        )
        return out.scores[0][0].double().softmax(-1).numpy()

    joint = np.zeros((VOCAB,) * STEPS)
    first = next_probs(())
    for x1 in range(VOCAB):
        if first[x1] == 0:
            continue
        second = next_probs((x1,))
        for x2 in range(VOCAB):
            if second[x2] == 0:
                continue
            joint[x1, x2] = first[x1] * second[x2] * next_probs((x1, x2))
    return joint.reshape(-1)


def sample_counts(target, setting: str, assistants, seed: int, generate=hp.generate, samples: int = SAMPLES,
                  cache_implementation: str | None = None, **config):
    """Histogram over the 512 outcomes of ``samples`` continuations of ``target`` sampled through the
    chain (``generate``: the `custom_generate` callable, e.g. one built from deliberately wrong parts,
    or one on a simulated machine), and the call's `PolybasicStats` (to prove every level took part)."""
    ids = prompt(3, seed=5, vocab=VOCAB)
    torch.manual_seed(seed)
    out = target.generate(
        ids,
        cache_implementation=cache_implementation,
        do_sample=True,
        max_new_tokens=STEPS,
        num_return_sequences=samples,
        custom_generate=generate,
        assistant_models=list(assistants),
        polybasic_config=hp.PolybasicConfig(**config),
        return_dict_in_generate=True,
        **SETTINGS[setting],
    )
    return outcome_counts(out.sequences[:, ids.shape[1] :], samples), out.polybasic_stats


def assert_every_level_took_part(stats, rejections: bool = True, acceptances: bool = True) -> str:
    """Fail unless the chain ran the algorithm it is meant to test: every level below the target
    handed up tokens, every level above the bottom verified drafts from the level below (the
    target and each intermediate level), with ``acceptances`` accepted some of them and, with
    ``rejections``, every verifier also rejected some (so the residual path of speculative sampling ran too). Returns one line per level
    (drafted/accepted/proposed/paused), for the record."""
    lines = []
    for index, level in enumerate(stats.levels):
        lines.append(
            f"{level.name.split()[0]}: drafted {level.drafted}, accepted {level.accepted}, "
            f"proposed {level.proposed}, paused {level.paused_rounds}"
        )
        if index > 0:
            assert level.proposed > 0, f"{level.name} never handed a token up: " + "; ".join(lines)
        if index < len(stats.levels) - 1:
            assert level.drafted > 0 and level.verifications > 0, f"{level.name} never verified a draft: " + "; ".join(lines)
            if acceptances:
                assert level.accepted > 0, f"{level.name} never accepted a draft: " + "; ".join(lines)
            if rejections:
                assert level.accepted < level.drafted, f"{level.name} never rejected a draft: " + "; ".join(lines)
    return "; ".join(lines)


def outcome_counts(new_tokens: torch.Tensor, samples: int = SAMPLES) -> np.ndarray:
    new = new_tokens.numpy()
    assert new.shape == (samples, STEPS)
    return np.bincount(np.ravel_multi_index(tuple(new.T), (VOCAB,) * STEPS), minlength=VOCAB**STEPS)


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; outcomes expected fewer than 5 times are pooled into one cell."""
    expected = probs / probs.sum() * counts.sum()
    possible = expected > 0
    if counts[~possible].sum():
        return 0.0  # the chain produced an outcome the target never would
    counts, expected = counts[possible], expected[possible]
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum()) if small.any() else counts
    expected = np.append(expected[~small], expected[small].sum()) if small.any() else expected
    return float(chisquare(observed, expected).pvalue)


def assert_target_could_sample(target, sequences, prompt_length: int, top_k: int) -> None:
    """Every new token is one the target itself can sample there: its logit is at least the k-th
    largest at that prefix. That is what transformers' top-k leaves possible (`TopKLogitsWarper`
    removes only scores below the k-th value, so every id tied with it stays: in bf16 exact ties are
    common); a leaked draft of an assistant or a stale cache would break it."""
    for row in sequences:
        logits = target(row.unsqueeze(0)).logits[0, prompt_length - 1 : -1]  # row j predicts new token j
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        new = row[prompt_length:].to(logits.device)
        chosen = logits.gather(-1, new.unsqueeze(-1))
        below = ((chosen < kth) | (chosen == float("-inf"))).squeeze(-1)
        assert not bool(below.any()), (
            f"a sampled token the target gives probability 0: new token {int(below.nonzero()[0])} "
            f"(id {int(new[below][0])}) is below the target's {top_k}-th largest logit there"
        )


# --- trained draft heads (test_heads) -------------------------------------------------------------------
def make_head(verifier, layers=(-1,), seed: int = 0):
    """A `TinyHead` for ``verifier`` (random weights; `distilled_head` trains one)."""
    from transformers import LlamaConfig, LlamaModel

    from hf_polybasic import compat
    from hf_polybasic.heads.base import DraftHead

    class Head(DraftHead):
        def __init__(self):
            super().__init__()
            config = verifier.config.get_text_config(decoder=True)
            width = config.hidden_size
            self.feature_layers, self.hidden_size = tuple(layers), width
            self.vocab_size = verifier.get_output_embeddings().weight.shape[0]
            self.decoder_config = LlamaConfig(vocab_size=self.vocab_size, hidden_size=width,
                                              intermediate_size=2 * width, num_hidden_layers=1,
                                              num_attention_heads=4, num_key_value_heads=2)
            self.decoder_config._attn_implementation = "sdpa"
            self.fc = torch.nn.Linear(2 * width, width)
            self.combine = torch.nn.Linear(len(layers) * width, width) if len(layers) > 1 else None
            self.inner = LlamaModel(self.decoder_config)
            self.inner.embed_tokens, self.inner.norm = None, torch.nn.Identity()
            self._shared = (verifier.get_input_embeddings(), verifier.get_output_embeddings())  # not submodules

        def project(self, features):
            return features if self.combine is None else self.combine(features)

        def forward(self, input_ids, features, *, position_ids, attention_mask, cache, use_cache=True):
            embed, lm_head = self._shared
            x = self.fc(torch.cat([embed(input_ids).to(features.dtype), features], -1))
            hidden = self.inner(inputs_embeds=x, position_ids=position_ids, attention_mask=attention_mask,
                                use_cache=use_cache, **{compat.cache_argument(self.inner): cache}).last_hidden_state
            return lm_head(hidden).float(), hidden

    torch.manual_seed(seed)
    return Head().eval()


def distilled_head(verifier, layers=(-1,), texts: int = 48, length: int = 24, steps: int = 150, seed: int = 0):
    """A `make_head` head distilled on ``verifier``'s own samples (seconds on a tiny model), wrapped as a level."""
    from hf_polybasic.heads.training import distill
    from hf_polybasic.runners.head import HeadModel

    core = make_head(verifier, layers, seed)
    torch.manual_seed(seed)
    vocab = verifier.config.get_text_config(decoder=True).vocab_size
    starts = torch.randint(3, vocab, (texts, 3))
    samples = verifier.generate(starts, attention_mask=torch.ones_like(starts), do_sample=True,
                                max_new_tokens=length, pad_token_id=PAD, eos_token_id=None)
    distill(core, verifier, samples, steps=steps, lr=1e-2, seed=seed)
    return HeadModel(core, name=f"tiny head {layers}", verifier=verifier)


# --- compiled forwards that fail (test_compile_fallback, test_gpu_path) ----------------------------
COMPILE_FAILURES = ("compile", "capture", "first replay", "recompile limit")


def inject_compile_failure(monkeypatch, failure: str, victim) -> None:
    """Make compiled forwards of ``victim`` fail as ``failure`` (one of `COMPILE_FAILURES`) does:

    * "compile": the backend raises while it compiles one of the victim's graphs (as inductor or Triton
      do), so dynamo raises its ``BackendCompilerFailed`` from the call (other models' graphs run as
      dynamo traced them: the eager backend);
    * "capture" / "first replay": the compiled forward raises at the second run of a width (where
      mode "reduce-overhead" captures its CUDA graph) / at the third (its first replay), after writing
      NaN at every slot it writes (what a failed run may leave behind), in the middle of a call whose
      earlier forwards ran compiled;
    * "recompile limit": dynamo's own limit is one graph per forward and the runner's own count is
      off, so every model's second width meets dynamo's limit (``FailOnRecompileLimitHit``): every
      model that decodes with two widths fails, whoever ``victim`` is.
    """
    from hf_polybasic.runners import static

    if failure == "compile":
        victims = {id(p) for p in victim.parameters()}

        def failing_backend(graph, example_inputs):  # other models' graphs run as dynamo traced them
            if any(id(x) in victims for x in example_inputs):
                raise RuntimeError("injected: Triton compilation failed (an inductor error at compile)")
            return graph.forward

        monkeypatch.setattr(static, "compile_options", lambda device: {"backend": failing_backend, "dynamic": False})
    elif failure == "recompile limit":
        monkeypatch.setattr(static, "GRAPHS_PER_MODEL", 1)
        monkeypatch.setattr(static, "_may_make_graph", lambda model, role: True)
    elif failure in ("capture", "first replay"):
        failing_run = 2 if failure == "capture" else 3
        forward_for = static.forward_for

        def failing_forward_for(model, compiled, float_mask, layers=None):
            forward = forward_for(model, compiled, float_mask, layers)
            if not (compiled and model is victim):
                return forward
            runs: dict[int, int] = {}

            def failing(model, input_ids, position_ids, slots, cache):
                width = input_ids.shape[1]
                runs[width] = runs.get(width, 0) + 1
                if runs[width] == failing_run:
                    rows = slots.shape[0]
                    for layer in cache.layers:
                        for tensor in (layer.keys, layer.values):
                            index = slots.view(rows, 1, width, 1).expand(rows, tensor.shape[1], width, tensor.shape[3])
                            tensor.scatter_(2, index, torch.full(index.shape, float("nan"), dtype=tensor.dtype,
                                                                  device=tensor.device))
                    raise RuntimeError(f"injected: CUDA error: operation failed during the {failure} of a graph")
                return forward(model, input_ids, position_ids, slots, cache)

            return failing

        monkeypatch.setattr(static, "forward_for", failing_forward_for)
    else:
        raise ValueError(f"failure must be one of {COMPILE_FAILURES}, got {failure!r}")
