"""Draft heads as their publishers' code builds, runs and saves them, transcribed for the format tests
(test_head_formats.py): each module below has the published class's attribute names (so its
``state_dict()`` has the published key names) and a ``forward`` that transcribes the published one in
plain torch (no transformers module, no code of hf_polybasic), and each ``write_*`` writes a checkpoint
directory with the file names and ``config.json`` keys the publisher's code writes.

Transcribed from (read 2026-11-28):

* SafeAILab/EAGLE @ cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b: ``eagle/model/cnets1.py`` (``Model``,
  ``LlamaDecoderLayer``, ``LlamaAttention``, ``LlamaRotaryEmbedding``, ``LlamaRMSNorm``), ``eagle/model/cnets.py``
  (``Model``, ``LlamaDecoderLayeremb``), ``eagle/model/ea_model.py`` (reads ``config.json``'s ``bias``, loads
  ``pytorch_model.bin``, calls the verifier's ``lm_head`` on EAGLE-1's output, ``lm_head(norm(.))`` for
  EAGLE-3), ``eagle/model/modeling_llama_kv.py`` (EAGLE-3 reads the inputs of layers 2, L//2, L-3),
  ``eagle/traineagle3/main.py`` (``save_16bit_model(..., exclude_frozen_parameters=True)``: no embeddings)
  and ``eagle/traineagle3/cnets.py`` (``d2t = used[i] - i``, ``t2d = i in used``).
* sgl-project/SpecForge @ a6b6b0230009d15ec2a97a57384e6f53f0f96946: ``specforge/modeling/draft/llama3_eagle.py``
  (``LlamaForCausalLMEagle3``: ``fc_norm``, ``norm_output``, ``compute_logits``, ``backbone``),
  ``specforge/export/to_hf.py`` and ``to_sglang.py`` (``save_pretrained``, with or without the embeddings),
  ``specforge/algorithms/model_providers.py`` (``eagle_config.eagle_aux_hidden_state_layer_ids``, default
  ``[1, L//2 - 1, L - 4]``: layer outputs, SGLang's ``set_eagle3_layers_to_capture`` adds 1).
* vllm-project/speculators @ c05b95b303f7d4f21e8d7624e0ffa1c2d9b4d73b: ``src/speculators/models/eagle3/core.py``
  (``Eagle3DraftModel``), ``model_definitions.py`` (``Eagle3FirstLayerMixin``), ``config.py``
  (``Eagle3SpeculatorConfig``), ``src/speculators/model.py`` (``DraftVocabMixin``), and, for EAGLE-1,
  ``src/speculators/models/eagle.py`` at 792b9e6c^ (``EagleSpeculator``, removed in 792b9e6c).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn


class LlamaRMSNorm(nn.Module):  # cnets1.py / cnets.py LlamaRMSNorm
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotary(head_dim, base, positions):  # LlamaRotaryEmbedding's cos/sin caches, read at ``positions`` [B, n]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    t = torch.arange(int(positions.max()) + 1, dtype=inv_freq.dtype)
    emb = torch.cat((torch.outer(t, inv_freq),) * 2, dim=-1)
    return emb.cos()[positions].unsqueeze(1), emb.sin()[positions].unsqueeze(1)  # [B, 1, n, head_dim]


class LlamaAttention(nn.Module):
    """cnets1.py LlamaAttention (``qkv_bias`` where the config has it); ``inputs = 2`` is cnets.py's, which
    projects ``2 * hidden``; a ``qwen3`` config adds Qwen3's per-head ``q_norm``/``k_norm`` (speculators'
    Qwen3DecoderEagle3FirstLayer). ``forward``: the causal attention of a prefill, no cache."""

    def __init__(self, config, inputs=1):
        super().__init__()
        self.hidden_size, self.num_heads = config["hidden_size"], config["num_attention_heads"]
        self.head_dim = config.get("head_dim") or self.hidden_size // self.num_heads
        self.num_key_value_heads = config["num_key_value_heads"]
        # the RoPE base where the config keeps it: ``rope_theta`` before transformers 5, ``rope_parameters`` since
        self.rope_theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        bias = config.get("qkv_bias", False)
        self.q_proj = nn.Linear(inputs * self.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(inputs * self.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(inputs * self.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        if config.get("model_type") == "qwen3":
            self.q_norm = LlamaRMSNorm(self.head_dim, eps=config["rms_norm_eps"])
            self.k_norm = LlamaRMSNorm(self.head_dim, eps=config["rms_norm_eps"])

    def forward(self, hidden_states, position_ids):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim)
        if hasattr(self, "q_norm"):  # Qwen3Attention: normed per head, before the rotary embedding
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary(self.head_dim, self.rope_theta, position_ids)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        groups = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # repeat_kv
        weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        causal = torch.full((q_len, q_len), torch.finfo(torch.float32).min).triu(1)  # _make_causal_mask
        weights = nn.functional.softmax(weights + causal, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, inner = config["hidden_size"], config["intermediate_size"]
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """cnets1.py LlamaDecoderLayer: no ``input_layernorm`` at index 0 (speculators' EagleSpeculator: an
    Identity unless ``layernorms``)."""

    def __init__(self, config, index, input_norm=None):
        super().__init__()
        self.self_attn, self.mlp, self.index = LlamaAttention(config), LlamaMLP(config), index
        eps = config.get("rms_norm_eps", 1e-6)
        if input_norm if input_norm is not None else index != 0:
            self.input_layernorm = LlamaRMSNorm(config["hidden_size"], eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(config["hidden_size"], eps=eps)

    def forward(self, hidden_states, position_ids):
        residual = hidden_states
        if hasattr(self, "input_layernorm"):
            hidden_states = self.input_layernorm(hidden_states)
        hidden_states = residual + self.self_attn(hidden_states, position_ids)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaDecoderLayeremb(nn.Module):
    """cnets.py LlamaDecoderLayeremb (SpecForge's LlamaDecoderLayer; speculators' Eagle3FirstLayerMixin,
    with ``norm_before_residual``)."""

    def __init__(self, config, norm_before_residual=False):
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        self.self_attn, self.mlp = LlamaAttention(config, inputs=2), LlamaMLP(config)
        self.hidden_norm = LlamaRMSNorm(config["hidden_size"], eps=eps)
        self.input_layernorm = LlamaRMSNorm(config["hidden_size"], eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(config["hidden_size"], eps=eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, input_emb, hidden_states, position_ids):
        residual = hidden_states
        hidden_states = self.hidden_norm(hidden_states)
        if self.norm_before_residual:
            residual = hidden_states
        input_emb = self.input_layernorm(input_emb)
        hidden_states = residual + self.self_attn(torch.cat((input_emb, hidden_states), dim=-1), position_ids)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def _random_(module, seed, scale=0.3, norms=0.3):
    """Weights drawn at random, ``scale`` N(0, 1), norm weights 1 + ``norms`` N(0, 1), so a wrong key or
    norm shows in the logits (a head about to be distilled starts smaller: 0.05, norms 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            is_norm = name.endswith("norm.weight") or ".fc_norm." in name
            parameter.copy_(1 + norms * noise if is_norm else scale * noise)
    return module


class SafeAILabEagle(nn.Module):
    """cnets1.py Model (EAGLE-1/2): ``embed_tokens``, ``layers``, ``fc``; ``forward`` returns the head's
    hidden and the logits ``ea_model`` gets from it (``head``: the verifier's LM head)."""

    def __init__(self, config, bias=True):
        super().__init__()
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, index) for index in range(config["num_hidden_layers"])])
        self.fc = nn.Linear(2 * config["hidden_size"], config["hidden_size"], bias=bias)

    def forward(self, hidden_states, input_ids, head):
        position_ids = torch.arange(input_ids.shape[1])[None].expand_as(input_ids)
        hidden_states = self.fc(torch.cat((self.embed_tokens(input_ids), hidden_states), dim=-1))
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_ids)
        return head(hidden_states), hidden_states


class SafeAILabEagle3(nn.Module):
    """cnets.py Model (EAGLE-3), and SpecForge's LlamaForCausalLMEagle3 (``fc_norm``, ``norm_output``):
    ``forward`` on the verifier's states (``fc`` where they are not yet the head's width), returning
    ``lm_head(norm(.))`` (SpecForge ``compute_logits``) over the draft vocabulary and the hidden fed back."""

    def __init__(self, config):
        super().__init__()
        hidden, states = config["hidden_size"], config.get("target_hidden_size") or config["hidden_size"]
        self.embed_tokens = nn.Embedding(config["vocab_size"], hidden)
        self.lm_head = nn.Linear(hidden, config["draft_vocab_size"], bias=False)
        self.midlayer = LlamaDecoderLayeremb(config)
        if config.get("fc_norm"):
            self.fc_norm = nn.ModuleList([LlamaRMSNorm(states, eps=config["rms_norm_eps"]) for _ in range(3)])
        self.fc = nn.Linear(3 * states, hidden, bias=False)
        self.norm = LlamaRMSNorm(hidden, eps=config["rms_norm_eps"])
        self.norm_output = config.get("norm_output", True)
        self.register_buffer("d2t", torch.zeros(config["draft_vocab_size"], dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config["vocab_size"], dtype=torch.bool))

    def forward(self, hidden_states, input_ids):
        position_ids = torch.arange(input_ids.shape[1])[None].expand_as(input_ids)
        inputs_embeds = self.embed_tokens(input_ids)
        if hidden_states.shape[-1] != inputs_embeds.shape[-1]:
            if hasattr(self, "fc_norm"):  # SpecForge project_hidden_states
                chunks = hidden_states.chunk(3, dim=-1)
                hidden_states = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
            hidden_states = self.fc(hidden_states)
        hidden_states = self.midlayer(inputs_embeds, hidden_states, position_ids)
        logits = self.lm_head(self.norm(hidden_states) if self.norm_output else hidden_states)
        return logits, hidden_states

    def set_draft_vocabulary(self, used: list[int]):
        """traineagle3/cnets.py scandata: ``d2t = used[i] - i``, ``t2d = i in used`` (``used`` sorted)."""
        self.d2t.copy_(torch.tensor([token - i for i, token in enumerate(used)]))
        self.t2d.copy_(torch.tensor([i in used for i in range(self.t2d.shape[0])]))


class SpeculatorsEagle3(nn.Module):
    """speculators' Eagle3DraftModel (llama layers): ``forward`` is one TTT step of core.py's loop,
    ``project`` its fc before the loop; returns the logits and the hidden the next step reads."""

    def __init__(self, config):
        super().__init__()
        layer_config = config["transformer_layer_config"]
        hidden, eps = layer_config["hidden_size"], layer_config["rms_norm_eps"]
        count = len(config["eagle_aux_hidden_state_layer_ids"])
        if config["draft_vocab_size"] != layer_config["vocab_size"]:  # DraftVocabMixin: buffers only if reduced
            self.register_buffer("t2d", torch.zeros(layer_config["vocab_size"], dtype=torch.bool))
            self.register_buffer("d2t", torch.zeros(config["draft_vocab_size"], dtype=torch.long))
        self.embed_tokens = nn.Embedding(layer_config["vocab_size"], hidden)
        self.lm_head = nn.Linear(hidden, config["draft_vocab_size"], bias=False)
        self.verifier_lm_head = nn.Linear(hidden, config["draft_vocab_size"], bias=False)  # training only
        self.fc = nn.Linear(count * hidden, hidden, bias=False)
        first = LlamaDecoderLayeremb(layer_config, config.get("norm_before_residual", False))
        later = [LlamaDecoderLayer(layer_config, index, input_norm=True)
                 for index in range(1, layer_config["num_hidden_layers"])]
        self.layers = nn.ModuleList([first, *later])
        self.norm = LlamaRMSNorm(hidden, eps=eps)
        self.verifier_norm = LlamaRMSNorm(hidden, eps=eps)  # training only
        if config.get("norm_before_fc"):
            self.input_norm = LlamaRMSNorm(count * hidden, eps=eps)
        if config.get("fc_norm"):
            self.fc_norm = nn.ModuleList([LlamaRMSNorm(hidden, eps=eps) for _ in range(count)])
        self.norm_output = config.get("norm_output", False)

    def project(self, hidden_states):
        if hasattr(self, "input_norm"):
            hidden_states = self.input_norm(hidden_states)
        if hasattr(self, "fc_norm"):
            chunks = hidden_states.chunk(len(self.fc_norm), dim=-1)
            hidden_states = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(hidden_states)

    def forward(self, hidden_states, input_ids):
        position_ids = 1 + torch.arange(input_ids.shape[1])[None].expand_as(input_ids)  # core.py: 1 + arange
        input_embeds = self.embed_tokens(input_ids)
        hidden_states = self.layers[0](input_embeds, hidden_states, position_ids)
        for layer in self.layers[1:]:
            hidden_states = layer(hidden_states, position_ids)
        if self.norm_output:
            hidden_states = self.norm(hidden_states)
            return self.lm_head(hidden_states), hidden_states
        return self.lm_head(self.norm(hidden_states)), hidden_states


class SpeculatorsEagle(nn.Module):
    """speculators' EagleSpeculator (llama ``transformer_layer_config``): ``embedding_layernorm`` and
    ``pre_lm_head_layernorm`` where ``layernorms``; embeddings and LM head are the verifier's."""

    def __init__(self, config):
        super().__init__()
        layer_config, layernorms = config["transformer_layer_config"], config.get("layernorms", False)
        hidden, eps = layer_config["hidden_size"], layer_config["rms_norm_eps"]
        if layernorms:
            self.embedding_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.fusion_fc = nn.Linear(2 * hidden, hidden, bias=config.get("fusion_bias", False))
        self.transformer = LlamaDecoderLayer(layer_config, 0, input_norm=layernorms)
        if layernorms:
            self.pre_lm_head_layernorm = LlamaRMSNorm(hidden, eps=eps)

    def forward(self, hidden_states, input_ids, embed_tokens, lm_head):
        position_ids = torch.arange(input_ids.shape[1])[None].expand_as(input_ids)
        inputs_embeds = embed_tokens(input_ids)
        if hasattr(self, "embedding_layernorm"):
            inputs_embeds = self.embedding_layernorm(inputs_embeds)
        hidden_states = self.transformer(self.fusion_fc(torch.cat([inputs_embeds, hidden_states], dim=-1)), position_ids)
        out = self.pre_lm_head_layernorm(hidden_states) if hasattr(self, "pre_lm_head_layernorm") else hidden_states
        return lm_head(out), hidden_states


# --- configs and files, as each publisher writes them ---------------------------------------------------
def rope_theta(config) -> float:
    """The RoPE base of a transformers config (``rope_parameters`` from transformers 5, ``rope_theta`` before)."""
    parameters = getattr(config, "rope_parameters", None)
    return parameters["rope_theta"] if parameters else config.rope_theta


def llama_fields(verifier, **extra) -> dict:
    """The Llama config fields of a one-layer head of ``verifier``'s width (as EAGLE's train configs,
    e.g. SafeAILab/EAGLE eagle/train/EAGLE-LLaMA3-Instruct-8B, write them)."""
    config = verifier.config
    fields = dict(architectures=["LlamaForCausalLM"], bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                  hidden_act="silu", hidden_size=config.hidden_size, initializer_range=0.02,
                  intermediate_size=2 * config.hidden_size, max_position_embeddings=2048, model_type="llama",
                  num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, pad_token_id=0,
                  rms_norm_eps=1e-05, tie_word_embeddings=False, torch_dtype="float16",
                  transformers_version="4.28.1", use_cache=True, vocab_size=config.vocab_size,
                  rope_theta=rope_theta(config))
    fields.update(extra)
    return fields


def write_safeailab(directory: Path, config: dict, module: nn.Module, skip=("embed_tokens",),
                    file: str = "pytorch_model.bin") -> Path:
    """``config.json`` and ``pytorch_model.bin`` (torch.save of the state dict) as SafeAILab ships heads;
    ``skip``: key prefixes left out (EAGLE-3's trainer saves no frozen parameter: no embeddings)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    state = {key: value.clone() for key, value in module.state_dict().items() if not key.startswith(tuple(skip))}
    if file.endswith(".bin"):
        torch.save(state, directory / file)
    else:
        save_file(state, str(directory / file), metadata={"format": "pt"})
    return directory


def write_pretrained(directory: Path, config: dict, module: nn.Module, skip=()) -> Path:
    """What ``save_pretrained`` writes (SpecForge's exports, speculators' models): ``config.json`` and
    ``model.safetensors`` with ``{"format": "pt"}`` metadata; ``skip``: key prefixes it leaves out."""
    return write_safeailab(directory, config, module, skip, file="model.safetensors")
