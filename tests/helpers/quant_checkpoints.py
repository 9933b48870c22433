"""Quantized tiny checkpoints written by the formats' own tools, for the quantization tests.

compressed-tensors (what Red Hat AI / Neural Magic publish) is quantized with compressed-tensors
itself: `apply_quantization_config` attaches the scheme, the weight scales (and zero points) come
from the weights' own min/max through compressed-tensors' `calculate_qparams`, static input
scales from a forward pass over random tokens, and `ModelCompressor` writes the packed tensors and
the `quantization_config` that transformers and vLLM read.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import transformers

__all__ = ["COMPRESSED_SCHEMES", "write_compressed_tensors"]

# The preset schemes the tests cover (compressed-tensors' names).
COMPRESSED_SCHEMES = ("W8A8", "W4A16", "W4A16_ASYM", "W8A16", "FP8", "FP8_DYNAMIC", "FP8_BLOCK")


def write_compressed_tensors(model: transformers.PreTrainedModel, scheme: str, folder: Path,
                             group_size: int | None = None,
                             ignore: tuple[str, ...] = ("lm_head",)) -> transformers.PreTrainedModel:
    """Quantizes a float model's linear layers with ``scheme`` and saves it compressed to ``folder``.

    Args:
        model: the float model (modified in place: it holds the quantized weights afterwards).
        scheme: a compressed-tensors preset (see `COMPRESSED_SCHEMES`).
        group_size: replaces the scheme's weight group size (group strategies only).
        ignore: module names left unquantized.

    Returns:
        The reference: a copy of the model before compression, whose layers compressed-tensors
        runs quantized (inputs and weights quantized and dequantized on the fly, with the saved
        scales). transformers reading the folder back is not one for every scheme: it refuses
        W4A16_ASYM's packed zero points, and its W8A8 forward multiplies by the int8 weights
        without their scales (transformers 5.24, compressed-tensors 0.20).
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus, apply_quantization_config,
                                                 preset_name_to_scheme)

    qscheme: QuantizationScheme = preset_name_to_scheme(scheme, ["Linear"])
    if group_size is not None and qscheme.weights.group_size is not None:
        qscheme.weights.group_size = group_size
    config = QuantizationConfig(config_groups={"group_0": qscheme}, ignore=list(ignore),
                                quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is not None:
                _set_weight_qparams(module, args)
        _calibrate_inputs(model)
    reference = copy.deepcopy(model).eval()
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    return reference


def _set_weight_qparams(module: torch.nn.Module, args) -> None:
    from compressed_tensors.quantization.utils import calculate_qparams

    w = module.weight.float()
    strategy = str(args.strategy.value if hasattr(args.strategy, "value") else args.strategy)
    if strategy == "tensor":
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    elif strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif strategy == "group":
        g = w.unflatten(1, (-1, args.group_size))
        lo, hi = g.amin(2), g.amax(2)
    elif strategy == "block":
        bo, bi = args.block_structure
        blocks = w.unflatten(0, (-1, bo)).unflatten(2, (-1, bi))
        lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
    else:
        raise ValueError(f"weight strategy {strategy!r} is not covered by the test fixtures")
    scale, zero_point = calculate_qparams(lo, hi, args)
    module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data = zero_point.to(module.weight_zero_point.dtype).reshape(
            module.weight_zero_point.shape)


def _calibrate_inputs(model: transformers.PreTrainedModel) -> None:
    """Static input scales: each quantized layer's input range over one batch of random tokens."""
    from compressed_tensors.quantization.utils import calculate_qparams

    static = {m: m.quantization_scheme.input_activations for m in model.modules()
              if getattr(getattr(m, "quantization_scheme", None), "input_activations", None) is not None
              and not m.quantization_scheme.input_activations.dynamic}
    if not static:
        return
    ranges: dict[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}

    def observe(module, inputs, _output):
        x = inputs[0].float()
        lo, hi = x.amin().reshape(1), x.amax().reshape(1)
        if module in ranges:
            lo, hi = torch.minimum(lo, ranges[module][0]), torch.maximum(hi, ranges[module][1])
        ranges[module] = (lo, hi)

    hooks = [m.register_forward_hook(observe) for m in static]
    torch.manual_seed(1)
    # The scheme's forward wrapper quantizes inputs with the (zero) scales; measure unquantized.
    status = {m: m.quantization_status for m in static}
    for m in static:
        m.quantization_enabled = False
    model(torch.randint(0, model.config.vocab_size, (2, 24)))
    for m in static:
        m.quantization_enabled = True
    for h in hooks:
        h.remove()
    for module, args in static.items():
        lo, hi = ranges[module]
        scale, zero_point = calculate_qparams(lo, hi, args)
        module.input_scale.data = scale.to(module.input_scale.dtype).reshape(module.input_scale.shape)
        if hasattr(module, "input_zero_point"):
            module.input_zero_point.data = zero_point.to(module.input_zero_point.dtype).reshape(
                module.input_zero_point.shape)
    del status
