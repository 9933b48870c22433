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

import numpy as np
import torch
import transformers

__all__ = ["COMPRESSED_SCHEMES", "reference_model", "write_awq", "write_compressed_tensors", "write_fp8", "write_gptq"]

# The preset schemes the tests cover (compressed-tensors' names).
COMPRESSED_SCHEMES = ("W8A8", "W4A16", "W4A16_ASYM", "W8A16", "FP8", "FP8_DYNAMIC", "FP8_BLOCK")


def write_compressed_tensors(model: transformers.PreTrainedModel, scheme: str, folder: Path,
                             group_size: int | None = None,
                             ignore: tuple[str, ...] = ("lm_head",),
                             fp16_scales: bool = False) -> transformers.PreTrainedModel:
    """Quantizes a float model's linear layers with ``scheme`` and saves it compressed to ``folder``.

    Args:
        model: the float model (modified in place: it holds the quantized weights afterwards).
        scheme: a compressed-tensors preset (see `COMPRESSED_SCHEMES`).
        group_size: replaces the scheme's weight group size (group strategies only).
        ignore: module names left unquantized.
        fp16_scales: rounds the weight scales to fp16 values (kept in the model's dtype), as an
            fp16 model's file or a GPTQ one holds them.

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
                _set_weight_qparams(module, args, fp16_scales)
        _calibrate_inputs(model)
    reference = copy.deepcopy(model).eval()
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    return reference


def _set_weight_qparams(module: torch.nn.Module, args, fp16_scales: bool = False) -> None:
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
    if fp16_scales:
        scale = scale.half().float()
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


# -- GPTQ and AWQ, packed here from their documented layouts ----------------------------------
# (gptqmodel and AutoAWQ make them for real but are too heavy for `make test`; the numpy
# dequantization in `_dequantize_groups` is the oracle.)

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _linear_weights(model) -> dict[str, np.ndarray]:
    return {name: p.detach().float().numpy() for name, p in model.state_dict().items()
            if name.rsplit(".", 2)[-2] in _LINEARS and name.endswith(".weight")}


def _quantize_groups(w: np.ndarray, bits: int, group_size: int, g_idx: np.ndarray, sym: bool, rng):
    """Per-group scales and zero points of ``w`` ``[out, in]`` (columns grouped by ``g_idx``)
    and the unsigned values: ``q = clamp(round(w / s) + z, 0, 2^bits - 1)``."""
    out_features, in_features = w.shape
    num_groups = -(-in_features // group_size)  # a last group cut short, as GPTQ tools write it
    qmax = (1 << bits) - 1
    scales = np.zeros((num_groups, out_features), np.float32)
    zeros = np.zeros((num_groups, out_features), np.int64)
    for g in range(num_groups):
        cols = w[:, g_idx == g]
        if sym:
            scales[g] = np.abs(cols).max(1) / ((qmax + 1) // 2 - 1)
            zeros[g] = (qmax + 1) // 2
        else:
            lo, hi = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
            scales[g] = (hi - lo) / qmax
            zeros[g] = np.clip(np.round(-lo / scales[g]), 0, qmax)
    scales = scales.astype(np.float16).astype(np.float32)  # checkpoints store fp16 scales
    q = np.clip(np.round(w / scales[g_idx].T) + zeros[g_idx].T, 0, qmax).astype(np.int64)
    return q, scales, zeros


def _dequantize_groups(q, scales, zeros, g_idx) -> np.ndarray:
    return ((q - zeros[g_idx].T) * scales[g_idx].T).astype(np.float32)


def _pack(values: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """Packs unsigned values into int32 words along ``axis`` (value i of a word at bits i * bits,
    or at ``order.index(i)`` slots)."""
    v = np.moveaxis(values, axis, -1).astype(np.uint32)
    per_word = 32 // bits
    v = v.reshape(*v.shape[:-1], -1, per_word)
    slots = range(per_word) if order is None else [order.index(i) for i in range(per_word)]
    words = np.zeros(v.shape[:-1], np.uint32)
    for i, slot in enumerate(slots):
        words |= v[..., i] << np.uint32(bits * slot)
    return np.moveaxis(words.view(np.int32), -1, axis)


def write_gptq(model, folder: Path, bits: int = 4, group_size: int = 32, desc_act: bool = False,
               sym: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """Saves ``model`` as a GPTQ checkpoint (v1 format: zeros stored minus one); returns the
    dequantized linear weights by parameter name (the reference's weights)."""
    rng = np.random.default_rng(seed)
    tensors, reference = {}, {}
    for name, w in _linear_weights(model).items():
        in_features = w.shape[1]
        group = in_features if group_size == -1 else group_size
        # GPTQ's act order sorts a layer's input columns by their Hessian, which projections that
        # read the same input (q/k/v, gate/up) share: one order per input.
        perm = _input_order(name, in_features, seed) if desc_act else np.arange(in_features)
        g_idx = np.empty(in_features, np.int64)
        g_idx[perm] = np.arange(in_features) // group
        q, scales, zeros = _quantize_groups(w, bits, group, g_idx, sym, rng)
        stem = name[: -len(".weight")]
        tensors[f"{stem}.qweight"] = torch.from_numpy(_pack(q, bits, axis=1).T.copy())  # [in * bits / 32, out]
        tensors[f"{stem}.qzeros"] = torch.from_numpy(_pack(zeros - 1, bits, axis=1))  # [groups, out * bits / 32]
        tensors[f"{stem}.scales"] = torch.from_numpy(scales).half()
        tensors[f"{stem}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        reference[name] = torch.from_numpy(_dequantize_groups(q, scales, zeros, g_idx))
    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym}
    _save(model, folder, tensors, config)
    return reference


def _input_order(name: str, in_features: int, seed: int) -> np.ndarray:
    layer, proj = name.rsplit(".", 3)[0], name.rsplit(".", 2)[-2]
    shared = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}
    key = f"{layer}.{shared.get(proj, proj)}"
    return np.random.default_rng([seed, *key.encode()]).permutation(in_features)


def write_awq(model, folder: Path, group_size: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    """Saves ``model`` as an AWQ checkpoint (GEMM layout, 4 bit, zero points); returns the
    dequantized linear weights by parameter name."""
    rng = np.random.default_rng(seed)
    tensors, reference = {}, {}
    for name, w in _linear_weights(model).items():
        g_idx = np.arange(w.shape[1]) // group_size
        q, scales, zeros = _quantize_groups(w, 4, group_size, g_idx, False, rng)
        stem = name[: -len(".weight")]
        tensors[f"{stem}.qweight"] = torch.from_numpy(_pack(q.T, 4, axis=1, order=AWQ_ORDER))  # [in, out / 8]
        tensors[f"{stem}.qzeros"] = torch.from_numpy(_pack(zeros, 4, axis=1, order=AWQ_ORDER))  # [groups, out / 8]
        tensors[f"{stem}.scales"] = torch.from_numpy(scales).half()
        reference[name] = torch.from_numpy(_dequantize_groups(q, scales, zeros, g_idx))
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    _save(model, folder, tensors, config)
    return reference


def write_fp8(model, folder: Path, block: tuple[int, int] | None = None, static: bool = False) -> dict[str, torch.Tensor]:
    """Saves ``model`` as a ``quant_method: fp8`` checkpoint: e4m3 weights with a per-tensor
    ``weight_scale`` (and ``input_scale`` when ``static``), or block-wise ``weight_scale_inv``;
    returns the dequantized linear weights by parameter name."""
    tensors, reference = {}, {}
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    for name, w in _linear_weights(model).items():
        w = torch.from_numpy(w)
        stem = name[: -len(".weight")]
        if block is None:
            scale = w.abs().max() / fp8_max
            q = (w / scale).to(torch.float8_e4m3fn)
            tensors[f"{stem}.weight_scale"] = scale.reshape(())
            reference[name] = q.float() * scale
            if static:
                tensors[f"{stem}.input_scale"] = torch.tensor(0.05)
        else:
            bo, bi = block
            blocks = w.unflatten(0, (-1, bo)).unflatten(2, (-1, bi))
            scale = blocks.abs().amax((1, 3)) / fp8_max  # [out / bo, in / bi]
            q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
            reference[name] = (q.float() * scale[:, None, :, None]).flatten(2).flatten(0, 1)
            q = q.flatten(2).flatten(0, 1)
            tensors[f"{stem}.weight_scale_inv"] = scale
        tensors[f"{stem}.weight"] = q
    config = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
    if block is not None:
        config["weight_block_size"] = list(block)
    _save(model, folder, tensors, config)
    return reference


def _save(model, folder: Path, tensors: dict[str, torch.Tensor], quant_config: dict) -> None:
    import json

    from safetensors.torch import save_file

    linear = _linear_weights(model)
    for name, p in model.state_dict().items():
        if name not in linear:
            tensors[name] = p.detach().contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    model.config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quant_config
    config["architectures"] = [type(model).__name__]
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def reference_model(model, dequantized: dict[str, torch.Tensor]):
    """A copy of the float ``model`` holding the dequantized weights (the transformers reference)."""
    reference = copy.deepcopy(model).eval()
    with torch.no_grad():
        state = reference.state_dict()
        for name, w in dequantized.items():
            state[name].copy_(w)
    reference.generation_config.eos_token_id = None
    reference.generation_config.pad_token_id = 0
    return reference
