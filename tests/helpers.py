"""Helpers that several test files share: plain functions and constants, no fixtures (those are in
conftest.py). A test file imports them from here, never from another ``test_*`` module.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hf_polybasic.testing import PAD


# --- batches (test_batches, test_host_reads, test_oracle, test_probe) ------------------------------
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
