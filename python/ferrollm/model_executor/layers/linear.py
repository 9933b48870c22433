"""Linear layers that shard their weights over the tensor-parallel ranks.

Megatron's split: a ``ColumnParallelLinear`` keeps a slice of the output features, so its output
stays sharded and feeds a ``RowParallelLinear``, which keeps the matching slice of the input
features and all-reduces its partial sums. Attention (qkv -> o) and the MLP (gate_up -> down) each
cost one all-reduce this way.

Every parameter carries a ``weight_loader(param, loaded_weight[, shard_id])`` that copies this
rank's slice of a full checkpoint tensor, so model code loads checkpoints without knowing the rank.

On the CPU a layer keeps its weight in one form (`cpu_weights`): ``begin_cpu_weight`` before
loading makes the loaders hand each slice's rows to it instead of copying them into ``weight``,
and the form is built when the last rows arrive (``finish_cpu_weight`` builds it from ``weight``
for layers filled another way).

A quantized layer (``set_quant_method``) registers its checkpoint tensors (``weight_packed``,
``weight_scale`` ...) as placeholder parameters instead; once one projection's tensors are all in,
its `LinearQuantMethod` turns them into a `qweights` weight, which the same loaders shard and
collect, on any device, into a `QuantizedLinear`.
"""

from __future__ import annotations

import torch
from torch import nn

from ferrollm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from ferrollm.exceptions import CheckpointError, ConfigError
from ferrollm.model_executor.layers.cpu_weights import (
    CpuWeight,
    PackedWeight,
    RowBlocks,
    build_cpu_weight,
    dense_linear,
)
from ferrollm.model_executor.layers.quantization.base_config import LinearQuantMethod
from ferrollm.model_executor.layers.quantization.forms import QuantizedLinear, build_quantized_form
from ferrollm.model_executor.weight_utils import copy_weight, share_or_copy

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
    "divide",
]


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """``numerator // denominator``, raising if it does not divide evenly.

    Raises:
        ConfigError: naming ``what`` and both numbers.
    """
    if numerator % denominator:
        raise ConfigError(
            f"{what} ({numerator}) must be divisible by `tensor_parallel_size` ({denominator})"
        )
    return numerator // denominator


def _check_full_size(loaded_weight: torch.Tensor, dim: int, expected: int, what: str) -> None:
    # Slicing would silently accept a checkpoint tensor that is too large; check the whole size.
    if loaded_weight.shape[dim] != expected:
        raise CheckpointError(
            f"{what}: the checkpoint tensor has shape {tuple(loaded_weight.shape)}, the model "
            f"expects {expected} along dimension {dim}; does config.json match the weights?"
        )


def _param(shape: tuple[int, ...], dtype: torch.dtype | None, loader, device: str | None = None) -> nn.Parameter:
    # torch.empty honours a surrounding `with torch.device(...)`, so models can be built in place.
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader
    return param


class LinearBase(nn.Module):
    """Common state: sizes, this rank and ``weight``/``bias`` registration.

    Args:
        input_size: input features of the full (unsharded) layer.
        output_size: output features of the full layer.
        bias: whether the layer has a bias.
        params_dtype: parameter dtype (default: torch's default dtype).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, params_dtype: torch.dtype | None):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.has_bias = bias

    def _create_params(self, weight_shape: tuple[int, int], bias_size: int) -> None:
        self.weight = _param(weight_shape, self.params_dtype, self.weight_loader)
        if self.has_bias:
            self.bias = _param((bias_size,), self.params_dtype, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        raise NotImplementedError

    # The weight's CPU form (see `cpu_weights`), and the rows collected for it while loading.
    _cpu: CpuWeight | QuantizedLinear | None = None
    _rows: RowBlocks | None = None
    _form: str | None = None
    # Whether the output is a `[gate, up]` pair that feeds `silu(gate) * up` (see `silu_and_mul`).
    gated: bool = False

    def _bias_on_this_rank(self) -> torch.Tensor | None:
        return self.bias

    def begin_cpu_weight(self, form: str | None) -> None:
        """Makes the loaders collect the weight's rows for ``form`` (`cpu_weights.cpu_weight_form`);
        a quantized layer collects them on every device."""
        self._form = "quantized" if self.quant_method is not None else form
        if self._form is not None:
            self._rows = RowBlocks(*self.weight.shape, self.weight.dtype)

    def finish_cpu_weight(self, form: str | None) -> None:
        """Builds the CPU form from ``weight`` where the loaders did not (tests, sharded state)."""
        if self.quant_method is not None:
            return self._flush_quant_pieces()
        if form is not None and self._cpu is None:
            self.begin_cpu_weight(form)
            self._load_rows(self.weight, 0, self.weight.detach(), "weight")

    def _load_rows(self, param: nn.Parameter, first_row: int, src: torch.Tensor, what: str) -> None:
        """Rows ``first_row ..`` of ``param`` from ``src``: to the CPU form's collection where one
        is being built, else copied in place."""
        if param is not self.weight or self._rows is None:
            return copy_weight(param.data.narrow(0, first_row, src.shape[0]), src, what)
        self._rows.add(first_row, src, what)
        if self._rows.complete:
            self._build_cpu_weight()

    def _build_cpu_weight(self) -> None:
        assert self._rows is not None and self._form is not None
        shape = tuple(self.weight.shape)
        if self.quant_method is not None:
            self._cpu = build_quantized_form(self._rows.ordered(), self._device)
            self._drop_quant_params()
        else:
            self._cpu = build_cpu_weight(self._form, self._rows.ordered(), *shape, gated=self.gated)
        self._rows = None
        # The form holds the only copy; `weight` keeps its shape and dtype on the meta device.
        self.weight = _param(shape, self.weight.dtype, self.weight_loader, device="meta")

    # -- quantized layers --------------------------------------------------------------------

    quant_method: LinearQuantMethod | None = None

    def set_quant_method(self, method: LinearQuantMethod, device: torch.device) -> None:
        """Makes the layer load ``method``'s checkpoint tensors (before loading): a placeholder
        parameter per tensor name, on the meta device, whose loader gathers one projection's
        tensors until `LinearQuantMethod.make` can turn them into its quantized weight."""
        self.quant_method = method
        self._device = device
        self._pieces: dict[object, dict[str, torch.Tensor]] = {}
        self._quant_params: dict[int, str] = {}
        shape, dtype = tuple(self.weight.shape), self.weight.dtype
        del self.weight
        # Where the checkpoint has no tensor named "weight", it is a plain attribute, still the
        # target the loaders collect rows for.
        self.weight = torch.empty(shape, dtype=dtype, device="meta")
        for suffix in method.suffixes:
            if suffix == "weight":
                param = self.weight = _param(shape, dtype, None, device="meta")
            else:
                param = _param((0,), method.params_dtype.get(suffix, torch.float32), None, device="meta")
                self.register_parameter(suffix, param)
            param.weight_loader = self._load_quant_piece
            param.optional = suffix in method.optional
            param.quant_piece = True
            self._quant_params[id(param)] = suffix

    def _load_quant_piece(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        method = self.quant_method
        assert method is not None
        pieces = self._pieces.setdefault(shard_id, {})
        pieces[self._quant_params[id(param)]] = loaded
        if len(pieces) == len(method.suffixes):
            self._make_quantized(shard_id)

    def _make_quantized(self, shard_id) -> None:
        assert self.quant_method is not None
        weight = self.quant_method.make(self._pieces.pop(shard_id))
        if getattr(self.quant_method, "presharded", False):  # sharded state: this rank's already
            return self._load_rows(self.weight, 0, weight, "sharded state")
        if shard_id is None:
            self.weight_loader(self.weight, weight)
        else:
            self.weight_loader(self.weight, weight, shard_id)  # type: ignore[call-arg]

    def _flush_quant_pieces(self) -> None:
        """Makes the projections whose optional tensors the checkpoint left out."""
        assert self.quant_method is not None
        required = set(self.quant_method.suffixes) - set(self.quant_method.optional)
        for shard_id in list(self._pieces):
            missing = required - set(self._pieces[shard_id])
            if missing:
                raise CheckpointError(f"the checkpoint lacks {sorted(missing)} of a quantized layer (shard {shard_id})")
            self._make_quantized(shard_id)
        if self._cpu is None:
            raise CheckpointError(f"the quantized layer ({self.extra_repr()}) received no weights")

    def _drop_quant_params(self) -> None:
        for name in [n for n, p in self.named_parameters(recurse=False) if id(p) in self._quant_params
                     and n != "weight"]:
            delattr(self, name)
        self._quant_params = {}

    def quantized_state(self) -> dict[str, torch.Tensor] | None:
        """This rank's quantized weight as sharded state writes it (`saved_state`), or None for a
        float layer."""
        if not isinstance(self._cpu, QuantizedLinear):
            return None
        from ferrollm.model_executor.layers.quantization.saved_state import saved_tensors

        return saved_tensors(self._cpu.saved_weight())

    def dense_weight(self) -> torch.Tensor:
        """The plain ``[out, in]`` weight of this rank, whatever form holds it."""
        return self.weight if self._cpu is None else self._cpu.dense()

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self._cpu is not None:
            return self._cpu.linear(x, bias)
        return dense_linear(x, self.weight, bias)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, bias={self.has_bias}, "
                f"tp={self.tp_rank}/{self.tp_size}")


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 params_dtype: torch.dtype | None = None):
        super().__init__(input_size, output_size, bias, params_dtype)
        self._create_params((output_size, input_size), output_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if param is self.weight and self._rows is not None:
            return self._load_rows(param, 0, loaded_weight, "weight")
        share_or_copy(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """``y = x A^T + b`` with ``A``'s rows (output features) split over the ranks.

    Args:
        input_size: input features.
        output_size: output features of the full layer; divisible by the TP size.
        bias: whether the layer has a bias.
        gather_output: all-gather the output so every rank gets all features.
        params_dtype: parameter dtype.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 gather_output: bool = False, params_dtype: torch.dtype | None = None):
        super().__init__(input_size, output_size, bias, params_dtype)
        self.gather_output = gather_output
        self.output_size_per_partition = divide(output_size, self.tp_size, "output size")
        self._create_params((self.output_size_per_partition, input_size), self.output_size_per_partition)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copies rows ``[rank * n, (rank + 1) * n)`` of the full weight (or bias)."""
        _check_full_size(loaded_weight, 0, self.output_size, "column-parallel weight")
        size = param.shape[0]
        self._load_rows(param, 0, loaded_weight.narrow(0, self.tp_rank * size, size), "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, self.bias)
        return tensor_model_parallel_all_gather(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (e.g. gate and up).

    Each rank holds its slice of every projection, concatenated in order.

    Args:
        input_size: input features.
        output_sizes: output features of each full projection; each divisible by the TP size.
        bias: whether the projections have biases.
        params_dtype: parameter dtype.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True,
                 params_dtype: torch.dtype | None = None):
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            divide(size, get_tensor_model_parallel_world_size(), "projection size")
        super().__init__(input_size, sum(self.output_sizes), bias, params_dtype=params_dtype)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of this ``[gate, up]`` projection in one CPU kernel, where the weight
        was packed for it (``gated`` set before loading); None where the caller must run the
        projection and the activation apart."""
        if isinstance(self._cpu, PackedWeight):
            return self._cpu.silu_and_mul(x, self.bias)
        return None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: int | None = None) -> None:
        """Copies this rank's slice of projection ``loaded_shard_id`` into its place.

        Args:
            param: ``weight`` or ``bias``.
            loaded_weight: the full checkpoint tensor of one projection.
            loaded_shard_id: which projection (index into ``output_sizes``).
        """
        if loaded_shard_id is None:  # a checkpoint that stores the projections fused
            _check_full_size(loaded_weight, 0, self.output_size, "fused weight")
            for shard_id, part in enumerate(loaded_weight.split(self.output_sizes)):
                self.weight_loader(param, part, shard_id)
            return
        what = f"shard {loaded_shard_id}"
        _check_full_size(loaded_weight, 0, self.output_sizes[loaded_shard_id], what)
        size = self.output_sizes[loaded_shard_id] // self.tp_size
        offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
        self._load_rows(param, offset, loaded_weight.narrow(0, self.tp_rank * size, size), what)


class QKVParallelLinear(ColumnParallelLinear):
    """The fused query/key/value projection, split over the ranks by attention head.

    When there are fewer KV heads than ranks, each KV head is replicated on
    ``tp_size // total_num_kv_heads`` consecutive ranks.

    Args:
        hidden_size: input features.
        head_size: size of one head.
        total_num_heads: query heads of the full layer; divisible by the TP size.
        total_num_kv_heads: KV heads of the full layer (default: ``total_num_heads``).
        bias: whether q, k and v have biases.
        params_dtype: parameter dtype.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False,
                 params_dtype: torch.dtype | None = None):
        tp_size = get_tensor_model_parallel_world_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads, "num_key_value_heads")
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(hidden_size, output_size, bias, params_dtype=params_dtype)

    @property
    def q_size(self) -> int:
        """Query features on this rank."""
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        """Key (and value) features on this rank."""
        return self.num_kv_heads * self.head_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: str | None = None) -> None:
        """Copies this rank's heads of ``q``, ``k`` or ``v`` into their place.

        Args:
            param: ``weight`` or ``bias``.
            loaded_weight: the full checkpoint tensor of one of q, k, v.
            loaded_shard_id: ``"q"``, ``"k"`` or ``"v"``.
        """
        if loaded_shard_id is None:  # a checkpoint that stores q, k and v fused
            sizes = [n * self.head_size for n in
                     (self.total_num_heads, self.total_num_kv_heads, self.total_num_kv_heads)]
            _check_full_size(loaded_weight, 0, sum(sizes), "fused qkv weight")
            for shard_id, part in zip("qkv", loaded_weight.split(sizes)):
                self.weight_loader(param, part, shard_id)
            return
        what = f"{loaded_shard_id} projection"
        num_heads = self.total_num_heads if loaded_shard_id == "q" else self.total_num_kv_heads
        _check_full_size(loaded_weight, 0, num_heads * self.head_size, what)
        q, kv = self.q_size, self.kv_size
        offset, size, shard_rank = {
            "q": (0, q, self.tp_rank),
            "k": (q, kv, self.tp_rank // self.num_kv_head_replicas),
            "v": (q + kv, kv, self.tp_rank // self.num_kv_head_replicas),
        }[loaded_shard_id]
        self._load_rows(param, offset, loaded_weight.narrow(0, shard_rank * size, size), what)


class RowParallelLinear(LinearBase):
    """``y = x A^T + b`` with ``A``'s columns (input features) split over the ranks.

    The input arrives sharded (from a column-parallel layer); the partial products are summed
    with an all-reduce. The bias is added once, on rank 0, before the reduction.

    Args:
        input_size: input features of the full layer; divisible by the TP size.
        output_size: output features.
        bias: whether the layer has a bias.
        reduce_results: all-reduce the output (turn off to fuse the reduction elsewhere).
        params_dtype: parameter dtype.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 reduce_results: bool = True, params_dtype: torch.dtype | None = None):
        super().__init__(input_size, output_size, bias, params_dtype)
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size, "input size")
        self._create_params((output_size, self.input_size_per_partition), output_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copies columns ``[rank * n, (rank + 1) * n)`` of the weight; the bias whole."""
        if param.dim() == 1:
            return share_or_copy(param, loaded_weight, "bias")
        _check_full_size(loaded_weight, 1, self.input_size, "row-parallel weight")
        if self.tp_size == 1 and self._rows is None:
            return share_or_copy(param, loaded_weight)
        size = param.shape[1]
        self._load_rows(param, 0, loaded_weight.narrow(1, self.tp_rank * size, size), "row-parallel weight")

    def _bias_on_this_rank(self) -> torch.Tensor | None:
        # The partial sums are all-reduced, so only rank 0 adds the bias.
        return self.bias if self.tp_rank == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, self._bias_on_this_rank())
        return tensor_model_parallel_all_reduce(y) if self.reduce_results else y
