"""Cheaper copies of a model for the levels of a chain: quantized copies and early exits.

* `quantized_copy(target, method)`: an independent, cheaper copy of the target (the paper's M2 is
  a 4-bit copy of M1). Nothing mutable is shared with the target.
* `early_exit(model, num_layers)`: the model's first layers with its final norm and head, sharing
  the weights (no copy) but used with its own cache: a self-drafting level usable anywhere in a
  chain.

Users reach these, with every other kind of level, through `hf_polybasic.levels`.
"""

from __future__ import annotations

import copy
import warnings

import torch

from . import int4, nf4
from .modules import module_view, replace_modules

__all__ = ["early_exit", "quantized_copy"]

QUANTIZATION_METHODS = ("bf16", "fp16", "int8-dynamic", "int4", "nf4")
# said at every CPU 4-bit copy: exact, but its forwards over many tokens are slow on a CPU
CPU_FOUR_BIT_WARNING = (
    "quantized_copy(method={method!r}) on the CPU: its 4-bit kernels are fast for one token but slow for forwards "
    "over many (a prefill, a verification), so as a middle level under the target it measured 0.6x plain generate "
    "on an AVX-512 CPU (docs: Benchmarks, 'A 4-bit middle level on CPU'). It is the paper's level for GPUs; on a "
    "CPU check a chain with `hf-polybasic plan --four-bit {method} --validate` before relying on it"
)


def quantized_copy(target: torch.nn.Module, method: str = "int8-dynamic", *, group_size: int | None = None
                   ) -> torch.nn.Module:
    """A cheaper copy of ``target`` for use as an intermediate level or drafter.

    ``method`` is one of:

    - ``"bf16"`` / ``"fp16"``: a cast copy (halves memory; fast on GPUs and on CPUs with bf16
      units).
    - ``"int8-dynamic"``: int8 weights with per-channel scales and dynamically quantized
      activations for every ``nn.Linear`` (CPU only), via PyTorch's
      ``torch.ao.quantization.quantize_dynamic``. That API is deprecated in favour of torchao,
      whose int8 weight-only path has no fast CPU kernel yet; it is wrapped here so the rest of
      the package does not depend on it.
    - ``"int4"``: 4-bit integer weights (asymmetric, per group of ``group_size`` input features:
      128 by default, or 32, 64, 256) with bf16 compute through torch's own int4 kernels
      (`hf_polybasic.models.int4`: tinygemm on a CUDA GPU of compute capability 8.0 or newer, its CPU
      twin on the CPU; nothing to install). Made on the device the target is on (the layout is
      the device's), layer by layer. Every linear layer but the output layer needs
      ``out_features`` a multiple of 16 and ``in_features`` a multiple of the group size.
    - ``"nf4"``: 4-bit NormalFloat weights (blocks of 64) with bf16 compute through bitsandbytes
      (``pip install "hf_polybasic[quant4]"``): on the CPU layer by layer (`hf_polybasic.models.nf4`;
      fast where the CPU has AVX512-BF16); on a CUDA GPU through transformers'
      ``BitsAndBytesConfig`` (the target is saved to a temporary directory and reloaded quantized,
      so this needs disk space for one fp checkpoint).

    The 4-bit copies keep the output layer in bf16 and run in bf16. GPTQ/AWQ/GGUF checkpoints that
    are already quantized load as ordinary transformers models and can be passed in
    ``assistant_models`` directly (docs: *Building levels*).
    """
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantized_copy: unknown method {method!r}; choose one of {QUANTIZATION_METHODS}")
    if group_size is not None and method != "int4":
        raise ValueError(f"quantized_copy: group_size is an option of method='int4', not of {method!r}")
    if method == "nf4" and next(target.parameters()).device.type == "cuda":
        return _nf4(target)
    if method == "int4":
        return _int4_copy(target, int4.DEFAULT_GROUP_SIZE if group_size is None else group_size)
    if method == "nf4":
        return _nf4_cpu_copy(target)
    if method in ("bf16", "fp16"):
        return copy.deepcopy(target).to(torch.bfloat16 if method == "bf16" else torch.float16).eval()
    return _int8_dynamic_copy(target)


def _int8_dynamic_copy(source: torch.nn.Module) -> torch.nn.Module:
    """The copy is built without a full-size float duplicate: everything but the linear layers is
    copied, each linear layer is quantized straight from the source's weights (upcast one layer at a
    time), and only then is the rest cast to float32 (dynamic int8 layers take float32 inputs)."""
    devices = {p.device.type for p in source.parameters()}
    if devices != {"cpu"}:
        raise ValueError(
            f"quantized_copy(method='int8-dynamic') runs on CPU only; the model is on {sorted(devices)}. "
            "On a GPU use method='bf16'/'fp16' or load a 4-bit checkpoint (bitsandbytes, GPTQ)"
        )
    clone = copy.deepcopy(source, memo=_linear_only_tensors(source))  # linear weights referenced, not copied
    quantize_linear_layers(clone)  # now the clone holds none of the source's tensors
    return clone.float().eval()


def _int4_copy(source: torch.nn.Module, group_size: int) -> torch.nn.Module:
    """The int4 copy through torch's own kernels (`hf_polybasic.models.int4`), on the source's device(s):
    every layer's shape is checked (naming it) before anything is copied."""
    devices = {p.device for p in source.parameters()}
    for device in devices:
        int4.check_device(device)
    head = _output_layer(source)
    for name, module in source.named_modules():
        if type(module) is torch.nn.Linear and module is not head:
            try:
                int4.check_shape(module.out_features, module.in_features, group_size)
            except ValueError as error:
                raise ValueError(f"quantized_copy(method='int4'): layer {name!r}: {error}") from None
    return _four_bit_copy(source, "int4", lambda linear: int4.Int4Linear.from_linear(linear, group_size),
                          int4.Int4Linear, warn={d.type for d in devices} == {"cpu"})


def _nf4_cpu_copy(source: torch.nn.Module) -> torch.nn.Module:
    """The nf4 copy on the CPU, layer by layer through bitsandbytes (`hf_polybasic.models.nf4`)."""
    devices = {p.device.type for p in source.parameters()}
    if devices != {"cpu"}:
        raise ValueError(
            f"quantized_copy(method='nf4') on the CPU needs the model on the CPU; it is on {sorted(devices)}. "
            "On a GPU use method='int4' or 'nf4' with the whole model on the GPU, or 'bf16'/'fp16'"
        )
    nf4.require("nf4")  # a clear ImportError naming the extra, before anything is copied
    return _four_bit_copy(source, "nf4", nf4.nf4_linear, nf4.nf4_linear_type())


def _four_bit_copy(source: torch.nn.Module, method: str, convert_linear, layer_type: type, warn: bool = True,
                   stacklevel: int = 4) -> torch.nn.Module:
    """A bf16 copy whose linear layers (all but the output layer) are 4-bit, built layer by layer
    from the source's weights, holding none of the source's tensors. ``convert_linear`` makes one
    4-bit layer of type ``layer_type`` (`int4.Int4Linear`, or bitsandbytes' ``Linear4bit`` for
    nf4), whose tensors are left in their own dtypes. ``stacklevel``: the warning's, counted from
    here (4: quantized_copy's caller, through ``_int4_copy`` or ``_nf4_cpu_copy``)."""
    clone = copy.deepcopy(source, memo=_linear_only_tensors(source))  # linear weights referenced, not copied
    head = _output_layer(clone)

    def convert(linear: torch.nn.Linear) -> torch.nn.Module:
        if linear is head:
            return _float_linear(linear, torch.bfloat16)
        return convert_linear(linear)

    replace_modules(clone, torch.nn.Linear, convert)
    if warn:
        warnings.warn(CPU_FOUR_BIT_WARNING.format(method=method), UserWarning, stacklevel=stacklevel)
    for module in clone.modules():
        if isinstance(module, layer_type):
            continue
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor.is_floating_point() and tensor.dtype != torch.bfloat16:
                cast = tensor.detach().to(torch.bfloat16)
                if isinstance(tensor, torch.nn.Parameter):
                    setattr(module, name, torch.nn.Parameter(cast, requires_grad=False))
                else:
                    module._buffers[name] = cast
    return clone.eval()


def _output_layer(model: torch.nn.Module) -> torch.nn.Module | None:
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def _float_linear(layer: torch.nn.Linear, dtype: torch.dtype) -> torch.nn.Linear:
    """An ``nn.Linear`` in ``dtype`` with copies of ``layer``'s weights (no random initialisation first)."""
    copied = torch.nn.utils.skip_init(torch.nn.Linear, layer.in_features, layer.out_features,
                                      bias=layer.bias is not None, device=layer.weight.device, dtype=dtype)
    with torch.no_grad():
        copied.weight.copy_(layer.weight)
        if layer.bias is not None:
            copied.bias.copy_(layer.bias)
    return copied.requires_grad_(False)


def _linear_only_tensors(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """A deepcopy memo of the tensors only ``nn.Linear`` layers hold, mapped to themselves (not
    copied, as quantization replaces them). A tensor that another module also holds (a tied
    ``lm_head``/``embed_tokens``) is left out: the copy needs its own."""
    elsewhere = {
        id(tensor)
        for module in model.modules()
        if type(module) is not torch.nn.Linear
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    }
    return {
        id(tensor): tensor
        for module in model.modules()
        if type(module) is torch.nn.Linear
        for tensor in (module.weight, module.bias)
        if tensor is not None and id(tensor) not in elsewhere
    }


@torch.no_grad()
def quantize_linear_layers(model: torch.nn.Module, after_each=None) -> torch.nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) with a dynamically quantized int8 layer
    (per-channel weight scales, PyTorch's ``torch.ao.nn.quantized.dynamic.Linear``), one layer at a
    time: a layer's float weight is upcast, quantized and released before the next, so memory never
    holds a second full-size copy. ``after_each(old_layer)`` runs after each replacement (e.g. to
    release the old weight's memory). Returns ``model``; its other parameters keep their dtype."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
        from torch.ao.quantization import per_channel_dynamic_qconfig

        def convert(child: torch.nn.Linear) -> torch.nn.Module:
            layer = child if child.weight.dtype == torch.float32 else _float32_linear(child)
            if layer is child and child.bias is not None:
                # the quantized layer keeps its bias tensor as given: give it one of its own (a copy
                # must not change when the model it was made from is cast or changed in place)
                layer.bias = torch.nn.Parameter(child.bias.detach().clone(), requires_grad=False)
            layer.qconfig = per_channel_dynamic_qconfig
            quantized = DynamicLinear.from_float(layer)
            if after_each is not None:
                after_each(child)
            return quantized

        replace_modules(model, torch.nn.Linear, convert)
    return model


def _float32_linear(layer: torch.nn.Linear) -> torch.nn.Linear:
    """A float32 ``nn.Linear`` with ``layer``'s weights (no random initialisation first)."""
    return _float_linear(layer, torch.float32)


def _nf4(model: torch.nn.Module) -> torch.nn.Module:
    if not torch.cuda.is_available():
        raise ValueError(
            "quantized_copy(method='nf4') needs a CUDA GPU (bitsandbytes 4-bit kernels); on CPU use 'int8-dynamic'"
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise ImportError("quantized_copy(method='nf4') needs bitsandbytes: pip install bitsandbytes") from error
    import tempfile

    from transformers import BitsAndBytesConfig

    device = next(model.parameters()).device
    device = device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory(prefix="hf_polybasic_nf4_") as directory:
        model.save_pretrained(directory)
        quantized = type(model).from_pretrained(directory, quantization_config=config, device_map={"": device})
    quantized.generation_config = copy.deepcopy(model.generation_config)
    return quantized.eval()


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if base is None or not isinstance(getattr(base, "layers", None), torch.nn.ModuleList):
        raise TypeError(
            f"early_exit supports decoder-only transformers models whose decoder keeps its blocks in "
            f"`.{getattr(model, 'base_model_prefix', 'model')}.layers` (Llama, Qwen2, Mistral, Gemma 3, ...); "
            f"{type(model).__name__} does not"
        )
    return base


def early_exit(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """The first ``num_layers`` decoder layers of ``model`` plus its final norm and LM head.

    The returned model shares every weight with ``model`` (nothing is copied) but is a separate
    module with its own config, so it gets its own cache in a chain.
    """
    base = _decoder(model)
    total = len(base.layers)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers < total:
        raise ValueError(f"early_exit: num_layers must be an int in [1, {total - 1}] for this model, got {num_layers!r}")
    config = copy.deepcopy(model.config)
    text_config = config.get_text_config(decoder=True)
    text_config.num_hidden_layers = num_layers
    if getattr(text_config, "layer_types", None) is not None:
        text_config.layer_types = list(text_config.layer_types[:num_layers])

    short_base = module_view(base)
    short_base.layers = torch.nn.ModuleList(list(base.layers[:num_layers]))
    short_base.config = text_config
    view = module_view(model)
    setattr(view, getattr(model, "base_model_prefix", "model"), short_base)
    view.config = config
    return view
