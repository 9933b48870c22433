"""Token embedding and LM head, split over the ranks by vocabulary rows.

The vocabulary is padded so every rank holds the same number of rows, a multiple of 64 (aligned
matmuls, and every TP size that divides the padding works). Padding rows are zero and their
logits are cut off before anyone sees them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


from ferrollm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from ferrollm.model_executor.layers.cpu_weights import CpuWeight, build_cpu_weight, dense_linear
from ferrollm.model_executor.layers.quantization.forms import QuantizedLinear, build_quantized_form
from ferrollm.model_executor.layers.quantization.qweights import GGUFWeight
from ferrollm.model_executor.weight_utils import check_shape, copy_weight, share_or_copy

__all__ = ["DEFAULT_VOCAB_PADDING_SIZE", "ParallelLMHead", "VocabParallelEmbedding", "pad_vocab_size"]

DEFAULT_VOCAB_PADDING_SIZE = 64
# Bytes of the table a head's CPU form is built from at a time.
TABLE_BLOCK_BYTES = 32 << 20


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    """Rounds ``vocab_size`` up to a multiple of ``pad_to``."""
    return -(-vocab_size // pad_to) * pad_to


class VocabParallelEmbedding(nn.Module):
    """Embedding table whose rows are split over the ranks.

    Each rank looks up the ids in its range, zeros the rest, and an all-reduce assembles the
    embeddings.

    Args:
        num_embeddings: vocabulary size of the checkpoint.
        embedding_dim: hidden size.
        params_dtype: parameter dtype (default: torch's default dtype).
        padding_size: each rank's row count is a multiple of this.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 params_dtype: torch.dtype | None = None,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE):
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.org_vocab_size = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size * self.tp_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        weight = torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copies this rank's rows of the full ``[vocab, hidden]`` table; zeros the padding. GGUF
        blocks (`GGUFWeight`) are kept as they are: this rank's rows of the file's mapping."""
        check_shape((self.org_vocab_size, self.embedding_dim), loaded_weight, "vocabulary table")
        num_rows = max(0, min(self.org_vocab_size, self.vocab_end_index) - self.vocab_start_index)
        if isinstance(loaded_weight, GGUFWeight):
            param.gguf = loaded_weight.narrow(0, self.vocab_start_index, num_rows)
            param.data = torch.empty((0, self.embedding_dim), dtype=param.dtype, device=param.device)
            return None
        if self.tp_size == 1 and self.num_embeddings_padded == self.org_vocab_size:
            return share_or_copy(param, loaded_weight, "vocabulary table")
        copy_weight(param.data[:num_rows], loaded_weight.narrow(0, self.vocab_start_index, num_rows))
        param.data[num_rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Looks up ``input_ids`` (any shape); returns ``[*input_ids.shape, hidden]``."""
        if self.tp_size == 1:
            return self._lookup(input_ids)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        out = self._lookup(local_ids).masked_fill(outside[..., None], 0)
        return tensor_model_parallel_all_reduce(out)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        form = getattr(self.weight, "table_form", None)
        if form is not None:
            rows = form.rows(ids)
            return rows if rows.dtype == self.weight.dtype else rows.to(self.weight.dtype)
        blocks = getattr(self.weight, "gguf", None)
        if blocks is None:
            return F.embedding(ids, self.weight)
        # GGUF: decode just the rows looked up, from the file's blocks.
        from ferrollm.kernels.cpu.gguf import embedding

        return embedding(blocks.data, blocks.ggml_type, ids, self.embedding_dim, self.weight.dtype)

    def finish_cpu_weight(self, form: str | None) -> None:
        """GGUF blocks off the CPU become the Triton kernels' integer form on the table's device,
        the table's only copy there (a tied LM head multiplies by it too): the CPU's embedding
        kernel decodes the rows it looks up from the file's blocks, a GPU looks them up in the
        integers (`QuantizedLinear.rows`)."""
        blocks = getattr(self.weight, "gguf", None)
        if blocks is None or self.weight.device.type == "cpu" or hasattr(self.weight, "table_form"):
            return
        self.weight.table_form = build_quantized_form([(0, blocks)], self.weight.device)
        del self.weight.gguf  # the file's pages: no longer read

    def dense_weight(self) -> torch.Tensor:
        """The table, ``[num_embeddings_per_partition, embedding_dim]`` (for saving)."""
        form = getattr(self.weight, "table_form", None)
        if isinstance(form, QuantizedLinear):  # written dense, as before it was kept quantized here
            return form.saved_weight().dequantize().to(self.weight.dtype)
        return self.weight if form is None else form.dense()

    def extra_repr(self) -> str:
        return (f"vocab={self.org_vocab_size} (padded {self.num_embeddings_padded}), "
                f"dim={self.embedding_dim}, tp={self.tp_rank}/{self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection to vocabulary logits, split like :class:`VocabParallelEmbedding`.

    Args:
        num_embeddings: vocabulary size of the checkpoint.
        embedding_dim: hidden size.
        bias: whether the head has a bias.
        params_dtype: parameter dtype.
        padding_size: each rank's row count is a multiple of this.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE):
        super().__init__(num_embeddings, embedding_dim, params_dtype, padding_size)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.num_embeddings_per_partition, dtype=params_dtype),
                                     requires_grad=False)
            self.bias.weight_loader = self._bias_loader
        else:
            self.register_parameter("bias", None)

    def _bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        check_shape((self.org_vocab_size,), loaded_weight, "lm_head bias")
        num_rows = max(0, min(self.org_vocab_size, self.vocab_end_index) - self.vocab_start_index)
        copy_weight(param.data[:num_rows], loaded_weight.narrow(0, self.vocab_start_index, num_rows))

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> None:
        """Shares the input embedding's table (``tie_word_embeddings``)."""
        self.weight = embed_tokens.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied with compute_logits(), not called")

    # The head's CPU form (see `cpu_weights`), built by `finish_cpu_weight` after loading.
    _cpu: CpuWeight | QuantizedLinear | None = None

    def finish_cpu_weight(self, form: str | None) -> None:
        """Builds the head's CPU form from its loaded weight. GGUF blocks are multiplied from the
        file by the block kernels on the CPU, elsewhere by the Triton ones from the table's
        integer form (`VocabParallelEmbedding.finish_cpu_weight`); the ``"rows"`` form reads the
        (tied or own) table itself. A packed form is then the only copy of the table: the
        parameter is emptied, and a tied embedding looks its rows up in the packed form
        (`VocabParallelEmbedding._lookup`).
        On Qwen2-0.5B's tied 545 MB fp32 table that is the difference between holding it once
        and twice."""
        super().finish_cpu_weight(form)
        if isinstance(getattr(self.weight, "table_form", None), QuantizedLinear):
            self._cpu = self.weight.table_form  # GGUF off the CPU (tied or not): the same integers
            return
        blocks = getattr(self.weight, "gguf", None)
        if blocks is not None and self._cpu is None:
            # 8-bit rounding of the last hidden state tipped SmolLM2-135M's greedy text into
            # repetition where llama.cpp's did not: the head meets it with its residual too.
            self._cpu = build_quantized_form([(0, blocks)], torch.device("cpu"), residual_activations=True)
            return
        if form is None or self._cpu is not None:
            return
        table = self.weight.detach()
        # In row blocks: each block's file pages are handed back once packed, so packing a 545 MB
        # table never holds both it and its packed copy whole.
        step = max(1, TABLE_BLOCK_BYTES // max(1, table.shape[1] * table.element_size()))
        blocks = [(first, table[first:first + step]) for first in range(0, table.shape[0], step)]
        self._cpu = build_cpu_weight(form, blocks, *table.shape)
        if hasattr(self._cpu, "rows"):
            self.weight.table_form = self._cpu
            # Emptied in place (as for GGUF), not replaced: a tied embedding holds the same parameter.
            self.weight.data = torch.empty((0, self.embedding_dim), dtype=self.weight.dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits of the given hidden states.

        Args:
            hidden_states: ``[num_tokens, hidden]``, only the rows to sample from.

        Returns:
            float32 ``[num_tokens, vocab_size]``, padding removed.
        """
        if isinstance(self._cpu, QuantizedLinear):  # GGUF: the org_vocab rows this rank holds
            logits = self._cpu.linear(hidden_states, None)
            if self.bias is not None:
                logits = logits + self.bias[: logits.shape[-1]]
            if self.tp_size > 1:  # the gather wants every rank's padded width; one rank only slices
                logits = F.pad(logits, (0, self.num_embeddings_per_partition - logits.shape[-1]))
        elif self._cpu is not None:
            logits = self._cpu.linear(hidden_states, self.bias)
        else:
            logits = dense_linear(hidden_states, self.weight, self.bias)
        logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[..., : self.org_vocab_size].float()
