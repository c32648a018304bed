"""Tensor-parallel linear layers (vLLM's and nano-vllm's shape): each holds this rank's shard of its weight, takes
that shard from a checkpoint tensor itself (weight_loader), and sums its products where the split asks it to.

Column-parallel layers split their outputs (each rank computes its share: no collective); a merged one (q/k/v,
gate/up) splits each of its parts, which a checkpoint holds as separate tensors or fused. Row-parallel layers split
their inputs and all-reduce their products. `tp` is the rank's group (parallel/group.py); None: one rank, and each
layer is the Linear it extends, whole, with no collective. How a model splits: parallel/sharding.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvserve.model.layers import GateUpLinear, GeluGateUpLinear, Linear
from kvserve.parallel.group import TensorParallel, place
from kvserve.parallel.sharding import local_kv_heads, rows_per_rank

if TYPE_CHECKING:
    from kvserve.model.loader import CheckpointTensor


def load_rows(dst: torch.Tensor, loaded: CheckpointTensor, start: int) -> None:
    """Rows `start`.. of checkpoint tensor `loaded` into dst, and zeros in the rows past its end (the last rank's
    padding of a split that does not come out even)."""
    rows = max(0, min(len(dst), loaded.shape[0] - start))
    if rows:
        loaded.narrow_into(dst[:rows], 0, start)
    dst[rows:].zero_()


class ParallelLinear(Linear):
    """A Linear on one rank of `tp` (None: the only rank), of this rank's input_size and output_size."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TensorParallel | None):
        self.tp = tp
        self.tp_rank, self.tp_size = place(tp)
        super().__init__(input_size, output_size, bias=bias)


class ColumnParallelLinear(ParallelLinear):
    """Outputs split across the ranks: each holds ceil(output_size / N) rows of the weight and the bias, from its
    rank times that many (the last rank's padded with zeros)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TensorParallel | None = None):
        """output_size: the whole layer's."""
        super().__init__(input_size, rows_per_rank(output_size, place(tp)[1]), bias, tp)

    def weight_loader(self, dst: torch.Tensor, loaded: CheckpointTensor, shard_id: int | None = None) -> None:
        """This rank's rows of checkpoint tensor `loaded` (the weight, or the bias) into dst."""
        load_rows(dst, loaded, self.tp_rank * len(dst))


class MergedColumnParallelLinear(ParallelLinear):
    """Column-parallel layers of one input held as one weight (gate and up): each rank holds its share of each
    part, the parts one after the other."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, tp: TensorParallel | None = None):
        """output_sizes: each part's, the whole layer's (each must split evenly: parallel/sharding.py checks)."""
        self.output_sizes = output_sizes
        self.tp_rank, self.tp_size = place(tp)
        self.local_sizes = [self._local_size(part) for part in range(len(output_sizes))]
        super().__init__(input_size, sum(self.local_sizes), bias, tp)

    def _local_size(self, part: int) -> int:
        return self.output_sizes[part] // self.tp_size

    def _first_row(self, part: int) -> int:
        """Where this rank's rows of a part start in the part's checkpoint tensor."""
        return self.tp_rank * self.local_sizes[part]

    def shard_slice(self, part: int) -> slice:
        """The rows of this rank's weight that hold its share of part `part`."""
        start = sum(self.local_sizes[:part])
        return slice(start, start + self.local_sizes[part])

    def weight_loader(self, dst: torch.Tensor, loaded: CheckpointTensor, shard_id: int | None = None) -> None:
        """This rank's rows of part `shard_id` (checkpoint tensor `loaded`) into their place in dst; shard_id None:
        `loaded` is the checkpoint's fused tensor of every part, one after the other (Phi-3's)."""
        if shard_id is not None:
            loaded.narrow_into(dst[self.shard_slice(shard_id)], 0, self._first_row(shard_id))
        elif self.tp_size == 1:
            loaded.narrow_into(dst)
        else:
            for part in range(len(self.output_sizes)):
                section = sum(self.output_sizes[:part])
                loaded.narrow_into(dst[self.shard_slice(part)], 0, section + self._first_row(part))


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v of an attention layer as one weight, split by heads: each rank's query heads and its KV heads (the
    one its query heads use, replicated, where there are fewer KV heads than ranks)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp: TensorParallel | None = None):
        """num_heads, num_kv_heads: the whole layer's; the attributes of those names are then this rank's."""
        rank, size = place(tp)
        self.head_dim = head_dim
        self.num_heads = num_heads // size
        self.first_kv_head, self.num_kv_heads = local_kv_heads(num_kv_heads, rank, size)
        kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, kv_size, kv_size], bias, tp)

    def _local_size(self, part: int) -> int:
        return (self.num_heads if part == 0 else self.num_kv_heads) * self.head_dim

    def _first_row(self, part: int) -> int:
        return self.tp_rank * self.local_sizes[0] if part == 0 else self.first_kv_head * self.head_dim


class GateUpParallelLinear(MergedColumnParallelLinear, GateUpLinear):
    """gate and up, column-parallel, whose forward is SwiGLU's silu(gate) * up of this rank's share (GateUpLinear's)."""

    def __init__(self, input_size: int, intermediate_size: int, bias: bool = False, tp: TensorParallel | None = None):
        super().__init__(input_size, [intermediate_size, intermediate_size], bias, tp)


class GeluGateUpParallelLinear(MergedColumnParallelLinear, GeluGateUpLinear):
    """gate and up, column-parallel, whose forward is GeGLU's gelu_tanh(gate) * up of this rank's share."""

    def __init__(self, input_size: int, intermediate_size: int, bias: bool = False, tp: TensorParallel | None = None):
        super().__init__(input_size, [intermediate_size, intermediate_size], bias, tp)


class RowParallelLinear(ParallelLinear):
    """Inputs split across the ranks: each holds input_size / N columns of the weight, and its products are summed
    over the ranks (one all-reduce). The bias is rank 0's alone (zeros on the others): added once to the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TensorParallel | None = None):
        """input_size: the whole layer's."""
        super().__init__(input_size // place(tp)[1], output_size, bias, tp)

    def weight_loader(self, dst: torch.Tensor, loaded: CheckpointTensor, shard_id: int | None = None) -> None:
        """This rank's columns of the weight into dst; the bias on rank 0, zeros on the others. Split, the largest
        magnitude of each output column over all its inputs is kept for int8's scales (Linear.column_absmax), so that
        each rank quantizes its inputs' numbers as one rank does."""
        if dst.dim() == 1:
            if self.tp_rank == 0:
                loaded.narrow_into(dst)
            else:
                dst.zero_()
            return
        loaded.narrow_into(dst, 1, self.tp_rank * dst.shape[1])
        if self.tp_size > 1:
            self.column_absmax = loaded.whole(dst.dtype).abs().amax(dim=1).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y if self.tp is None else self.tp.all_reduce(y)
