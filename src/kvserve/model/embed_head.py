"""The vocabulary's layers, split across tensor-parallel ranks by rows (vLLM's VocabParallelEmbedding and
ParallelLMHead): each rank holds ceil(vocab / N) rows of the embedding table and of lm_head, from its rank times
that many, the last rank's padded with zeros. `tp` None: one rank, the whole vocabulary, no collective."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvserve.model.layers import Embedding
from kvserve.model.linear import ColumnParallelLinear, load_rows
from kvserve.parallel.group import TensorParallel, place
from kvserve.parallel.sharding import rows_per_rank

if TYPE_CHECKING:
    from kvserve.model.loader import CheckpointTensor


class VocabParallelEmbedding(Embedding):
    """This rank's rows of the embedding table (num_embeddings of them, from vocab_start): a token of another
    rank's rows looks up zeros here, and the ranks' lookups are summed (one all-reduce)."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel | None = None):
        rank, size = place(tp)
        super().__init__(rows_per_rank(vocab_size, size), dim)
        self.tp = tp
        self.vocab_start = rank * self.num_embeddings

    def weight_loader(self, dst: torch.Tensor, loaded: CheckpointTensor, shard_id: int | None = None) -> None:
        """This rank's rows of the checkpoint's table into dst."""
        load_rows(dst, loaded, self.vocab_start)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.num_embeddings)
        x = super().forward(local.masked_fill(elsewhere, 0)).masked_fill_(elsewhere.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)


class ParallelLMHead(ColumnParallelLinear):
    """lm_head, column-parallel over the vocabulary: the logits of this rank's rows, gathered to rank 0 into the
    whole vocabulary's (None on the other ranks), and there soft-capped where the model caps them (Gemma 2)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel | None = None,
                 soft_cap: float | None = None):
        super().__init__(hidden_size, vocab_size, bias=False, tp=tp)
        self.vocab_size, self.soft_cap = vocab_size, soft_cap

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        logits = super().forward(x)
        if self.tp is not None:
            logits = self.tp.gather_logits(logits, self.vocab_size)
            if logits is None:
                return None
        return logits if self.soft_cap is None else torch.tanh(logits / self.soft_cap) * self.soft_cap
