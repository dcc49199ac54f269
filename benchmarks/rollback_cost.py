"""``python -m benchmarks rollback-cost``: what rolling back a hybrid model's recurrent state costs per round.

A verification round of a hybrid model that scores k drafts and keeps j of them costs, beyond the
verification forward itself (`hf_polybasic.runners.recurrent`):

* the copy of every recurrent and convolution state before the forward (every round);
* when j < k, the restore of the copy (the layers take the copy's tensors; the attention layers
  are cut), and the j + 1 tokens the next forward re-feeds: it scores k + 2 + j tokens instead of
  k + 1, T(k + 2 + j) - T(k + 1).

Each is timed on its own, as the median of interleaved repeats (every (k, j) in each repeat; the
re-feed as the median difference of back-to-back pairs), after a 64-token context, and reported in milliseconds and as a share of the verification forward T(k + 1)
of the same model without any of it. The model has Qwen3-Next-80B-A3B's layer shapes (hidden 2048;
attention 16 query / 2 key-value heads of 256; Gated DeltaNet 16 key / 32 value heads of 128,
kernel 4; experts 512 wide, 10 routed + 1 shared per token) at reduced depth (``--layers``, default 4:
3 Gated DeltaNet + 1 attention, its 3:1 pattern), with 16 experts instead of 512 and a 16384-token
vocabulary instead of 151936 (per-token compute as in the model; the weights no token touches and
an output layer that would dominate 4 layers are left out), random weights, float32.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from hf_polybasic import compat
from hf_polybasic.costs import hardware
from hf_polybasic.runners.dynamic import CachedModel

CONTEXT = 64


def qwen3_next_shape(layers: int = 4, experts: int = 16, vocab: int = 16384) -> torch.nn.Module:
    """A random model with Qwen3-Next-80B-A3B's layer shapes (see the module's docstring)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_next", vocab_size=vocab, hidden_size=2048, num_hidden_layers=layers, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=experts,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def tiny_shape() -> torch.nn.Module:
    from hf_polybasic.testing import make_target

    return make_target("qwen3_next", seed=0, layers=4)


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


class _Harness:
    """A one-row runner of ``model`` holding a context, put back to it between measurements."""

    def __init__(self, model: torch.nn.Module, vocab: int):
        self.model = model
        self.runner = CachedModel(model, compat.new_dynamic_cache(model), role="measured")
        generator = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(3, vocab, (CONTEXT + 40,), generator=generator)
        self.runner.logits(self.tokens[:CONTEXT], 1)
        self.runner.commit()
        self.states = self.runner.states

    def forward_seconds(self, count: int, keep: int) -> float:
        """One forward of ``count`` new tokens after the context, logits for the last ``keep``, without
        the state copy; then back."""
        self.states.snapshot(CONTEXT)  # (untimed) the way back
        cache = self.runner.cache
        inputs = self.tokens[CONTEXT : CONTEXT + count][None]
        positions = torch.arange(CONTEXT, CONTEXT + count)[None]
        started = time.perf_counter()
        self.model(input_ids=inputs, position_ids=positions, use_cache=True, logits_to_keep=keep,
                   **{compat.cache_argument(self.model): cache})
        seconds = time.perf_counter() - started
        self._back(count)
        return seconds

    def copy_seconds(self) -> float:
        started = time.perf_counter()
        self.states.snapshot(CONTEXT)
        return time.perf_counter() - started

    def restore_seconds(self, forward_tokens: int, kept: int) -> float:
        """After a forward of ``forward_tokens`` tokens, a rollback to ``kept`` of them."""
        self.states.snapshot(CONTEXT)
        inputs = self.tokens[CONTEXT : CONTEXT + forward_tokens][None]
        self.model(input_ids=inputs, position_ids=torch.arange(CONTEXT, CONTEXT + forward_tokens)[None],
                   use_cache=True, logits_to_keep=1, **{compat.cache_argument(self.model): self.runner.cache})
        started = time.perf_counter()
        held = self.states.restore(CONTEXT + kept)
        compat.remove_last_tokens(self.runner.cache, CONTEXT + forward_tokens - held)
        return time.perf_counter() - started

    def _back(self, count: int) -> None:
        self.states.restore(CONTEXT)
        compat.remove_last_tokens(self.runner.cache, count)


def measure(model: torch.nn.Module, vocab: int, ks: Sequence[int] = (2, 4, 8, 16), repeats: int = 5) -> dict:
    """For each k and kept j in (0, k // 2, k): the median milliseconds of the verification forward
    T(k + 1), of the state copy, of the restore, and of the re-fed tokens' extra forward time
    T(k + 2 + j) - T(k + 1) (the median of differences of back-to-back pairs, in alternating order,
    which cancels most of a shared machine's drift), and the rollback's cost per round (ms and % of
    T(k + 1))."""
    harness = _Harness(model, vocab)
    cases = [(k, j) for k in ks for j in sorted({0, k // 2, k})]
    verify = {k: [] for k in ks}
    extra = {case: [] for case in cases if case[1] < case[0]}
    copy, restore = [], {case: [] for case in extra}
    harness.forward_seconds(max(ks) + 1, max(ks) + 1)  # warm-up
    for repeat in range(repeats):
        for k, j in cases if repeat % 2 == 0 else cases[::-1]:
            if j == k:
                verify[k].append(harness.forward_seconds(k + 1, k + 1))
                continue
            if (repeat + j) % 2 == 0:
                alone = harness.forward_seconds(k + 1, k + 1)
                refed = harness.forward_seconds(k + 2 + j, k + 1)
            else:
                refed = harness.forward_seconds(k + 2 + j, k + 1)
                alone = harness.forward_seconds(k + 1, k + 1)
            verify[k].append(alone)
            extra[(k, j)].append(refed - alone)
            copy.append(harness.copy_seconds())
            harness.states.commit()
            if repeat < 3:
                restore[(k, j)].append(harness.restore_seconds(k + 1, j + 1))
    copy_ms = _median_ms(copy)
    rows = []
    for k, j in cases:
        verify_ms = _median_ms(verify[k])
        restore_ms = _median_ms(restore[(k, j)]) if j < k else 0.0
        refeed_ms = _median_ms(extra[(k, j)]) if j < k else 0.0
        cost_ms = copy_ms + restore_ms + refeed_ms
        rows.append(dict(k=k, kept=j, verify_ms=verify_ms, copy_ms=copy_ms, restore_ms=restore_ms,
                         refed_tokens=j + 1 if j < k else 0, refeed_ms=refeed_ms, rollback_ms=cost_ms,
                         rollback_percent=100 * cost_ms / verify_ms))
    state_bytes = sum(
        tensor.numel() * tensor.element_size()
        for index in compat.recurrent_layer_indices(harness.runner.cache)
        for _, conv, rec in compat.read_recurrent_state(harness.runner.cache.layers[index])
        for tensor in (conv, rec) if tensor is not None
    )
    machine = hardware.describe_machine()
    return dict(rows=rows, state_bytes=state_bytes, repeats=repeats, threads=torch.get_num_threads(),
                cpu=machine.get("cpu"), cpu_flags=machine.get("cpu_flags"))


def markdown(result: dict) -> str:
    lines = [
        f"Recurrent state copied per round: {result['state_bytes'] / 2**20:.1f} MiB; medians of {result['repeats']} "
        f"interleaved repeats; torch threads: {result['threads']}; CPU {result['cpu']}, flags {' '.join(result['cpu_flags'] or [])}.",
        "",
        "| k | kept | T(k+1) ms | copy ms | restore ms | re-fed tokens | re-feed ms | rollback ms | % of T(k+1) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['k']} | {row['kept']} | {row['verify_ms']:.1f} | {row['copy_ms']:.2f} | {row['restore_ms']:.2f} | "
            f"{row['refed_tokens']} | {row['refeed_ms']:.1f} | {row['rollback_ms']:.1f} | {row['rollback_percent']:.1f}% |"
        )
    return "\n".join(lines)


def run_rollback_cost(tiny: bool, layers: int, ks: Sequence[int], repeats: int, out: str | None,
                      threads: int | None = None) -> str:
    if threads:
        torch.set_num_threads(threads)
    if not compat.HAS_RECURRENT_CACHE_LAYERS:
        raise SystemExit(f"rollback-cost needs transformers >= 5.15 (found {compat.TRANSFORMERS_VERSION})")
    model = tiny_shape() if tiny else qwen3_next_shape(layers)
    vocab = model.config.vocab_size
    with torch.no_grad():
        result = measure(model, vocab, ks, repeats)
    result["model"] = "tiny qwen3_next" if tiny else f"Qwen3-Next layer shapes, {layers} layers, float32"
    table = markdown(result)
    if out is not None:
        directory = Path(out)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "rollback_cost.json").write_text(json.dumps(result, indent=1))
        (directory / "rollback_cost.md").write_text(table + "\n")
    return f"{result['model']}\n{table}"
