"""KVStorage: the preallocated K and V pages of every layer, full precision or quantized."""
from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.engine.cpu_memory import zeros
from kvserve.kernels import fallback, function
from kvserve.kv.quant import QuantizedLayer, WritePlan, codecs, take_blocks
from kvserve.kv.spec import KVSpec


class KVStorage:
    """Full-precision layers share one tensor [layers, 2, kv_heads, num_blocks, block_size, head_dim];
    quantized layers (spec.kv_cache_dtype) are QuantizedLayers over the same block ids.

    Heads lead so that gathering a batch's pages yields [kv_heads, seqs, tokens, head_dim] with no
    further copy: the layout the attention matmuls take directly.

    With quantized layers, each block still being filled has a residual slot: `residual_slots`
    full-precision blocks (the engine gives one per sequence that can run, and a spare).
    `ref_counts` (the BlockPool's) tells which blocks were freed, so that their slots return.
    """

    def __init__(self, spec: KVSpec, num_blocks: int, device: torch.device, residual_slots: int = 0,
                 ref_counts: list[int] | None = None):
        self.spec = spec
        self.block_size = bs = spec.block_size
        self.num_blocks = num_blocks
        quantized = set(spec.quantized_layers)
        shape = (2, spec.num_kv_heads, num_blocks, bs, spec.head_dim)
        self.kv = zeros((spec.num_layers - len(quantized), *shape), spec.dtype, torch.device(device))
        self.residual = torch.zeros(len(quantized), 2, spec.num_kv_heads, residual_slots if quantized else 0, bs,
                                    spec.head_dim, dtype=spec.dtype, device=device)
        self.residual_of = torch.full((num_blocks if quantized else 0,), -1, dtype=torch.long, device=device)
        self._slot_of: dict[int, int] = {}
        self._free_slots = list(range(self.residual.shape[3]))
        self._ref_counts = ref_counts
        full, quant = iter(self.kv), iter(self.residual)
        self.layers = [QuantizedLayer(codecs(spec.kv_cache_dtype), spec.num_kv_heads, num_blocks, bs,
                                      spec.head_dim, next(quant), self.residual_of)
                       if i in quantized else next(full) for i in range(spec.num_layers)]
        self.quantized = [layer for layer in self.layers if isinstance(layer, QuantizedLayer)]

    def layer(self, i: int) -> torch.Tensor | QuantizedLayer:
        """Layer i's cache: pages [2, kv_heads, num_blocks, block_size, head_dim], or a QuantizedLayer."""
        return self.layers[i]

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def nbytes(self) -> int:
        tensors = [self.kv, self.residual] + [t for layer in self.quantized for t in (*layer.data, *layer.meta)]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def filling_blocks(self):
        """Blocks whose tokens are in residual slots (some may have been freed since the last step)."""
        return self._slot_of.keys()

    @staticmethod
    def write(kv_cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store new tokens' K and V [tokens, 2, kv_heads, head_dim] at their slots: on the CPU by a C loop
        of row copies (fewer passes than index_copy_), from rows in which each token's K/V heads are adjacent
        (a step's are views of its qkv rows; others, such as an eviction's gathered tokens, are copied so)."""
        tokens, _, kvh, d = kv.shape
        fn = function("store_kv") if kv_cache.device.type == "cpu" else None
        if fn is None or kv.dtype != kv_cache.dtype or not kv_cache.is_contiguous():
            if kv_cache.device.type == "cpu":
                fallback("store_kv", "the kernels are not built" if fn is None else
                         "the pages are not contiguous, or not of the K/V's dtype")
            pages = kv_cache.view(2, kv_cache.shape[1], -1, kv_cache.shape[-1])
            pages.index_copy_(2, slot_mapping, kv.permute(1, 2, 0, 3))
            return
        if not (kv.stride(3) == 1 and kv.stride(2) == d and kv.stride(1) == kvh * d):
            kv = kv.contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        fn(kv.data_ptr(), kv.stride(0), tokens, kvh, d, slots.data_ptr(), kv_cache.data_ptr(), kv_cache.shape[2],
           kv_cache.shape[3], kv.element_size())

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole pages src -> dst in every layer (copy-on-write)."""
        if not copies:
            return
        src, dst = (list(x) for x in zip(*copies))
        self.kv[:, :, :, dst] = self.kv[:, :, :, src]
        for layer in self.quantized:
            layer.copy_blocks(src, dst)
        if self.quantized:
            self._collect_freed()
            for s, d in copies:
                if s in self._slot_of:
                    slot = self._slot_of.get(d)
                    if slot is None:
                        slot = self._take_slot(d)
                        self.residual_of[d] = slot
                    self.residual[:, :, :, slot] = self.residual[:, :, :, self._slot_of[s]]

    def rewrite(self, old_table: list[int], keep: torch.Tensor, new_table: list[int]) -> None:
        """Copy the tokens at cache positions `keep` (through old_table) to positions 0, 1, ... of
        new_table, in every layer: how an eviction compacts a sequence's cache into fresh blocks."""
        dev = self.device
        pos = torch.arange(len(keep), device=dev)
        new = torch.tensor(new_table, device=dev)
        slots = new[pos // self.block_size] * self.block_size + pos % self.block_size
        old = torch.tensor(old_table, device=dev)
        plan = self.plan_writes([new_table], [0], [len(keep)])
        for layer in self.layers:
            kv = read_pages(layer, old).flatten(2, 3)[:, :, keep].permute(2, 0, 1, 3)   # [n, 2, KVH, D]
            if isinstance(layer, QuantizedLayer):
                plan.write(layer, kv)
            else:
                self.write(layer, kv, slots)

    def rotate_keys(self, src: list[int], dst: list[int], rotate: Callable[[torch.Tensor], None]) -> None:
        """Write full blocks src into blocks dst with their keys passed through `rotate` (in place,
        [..., head_dim]), in every layer: how `sink` moves its sink tokens next to the window."""
        dev = self.device
        src_t, dst_t = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
        self._forget(dst)
        for layer in self.layers:
            pages = read_pages(layer, src_t).clone()             # [2, KVH, n, BS, D]
            rotate(pages[0])
            if isinstance(layer, QuantizedLayer):
                layer.quantize(dst_t, pages)
            else:
                layer[:, :, dst_t] = pages

    def plan_writes(self, tables: list[list[int]], starts: list[int], num_new: list[int]) -> WritePlan | None:
        """Where the step's tokens go in the quantized layers: sequence i writes tokens
        [starts[i], starts[i] + num_new[i]) through block table tables[i]. None: no quantized layer."""
        if not self.quantized:
            return None
        self._collect_freed()
        bs = self.block_size
        before, filled, direct, opening = ([], []), ([], []), ([], []), []
        offset = 0
        for table, start, n in zip(tables, starts, num_new):
            end = start + n
            for j in range(start // bs, -(-end // bs)):
                block, lo, hi = table[j], max(start, j * bs), min(end, (j + 1) * bs)
                tokens = range(offset + lo - start, offset + hi - start)
                slot = self._slot_of.get(block)
                if slot is None and lo > j * bs:
                    raise RuntimeError(f"block {block} holds tokens but no residual slot")
                if slot is None:
                    if hi == (j + 1) * bs:
                        direct[0].extend(tokens)
                        direct[1].append(block)
                    else:
                        opening.append((block, tokens, lo - j * bs))
                    continue
                before[0].extend(tokens)
                before[1].extend(range(slot * bs + lo - j * bs, slot * bs + hi - j * bs))
                if hi == (j + 1) * bs:
                    filled[0].append(slot)
                    filled[1].append(block)
            offset += n
        self._release(filled[1])
        after = ([], [])
        for block, tokens, first in opening:
            slot = self._take_slot(block)
            after[0].extend(tokens)
            after[1].extend(range(slot * bs + first, slot * bs + first + len(tokens)))
        if opening:
            taken = [b for b, _, _ in opening]
            self.residual_of[taken] = torch.tensor([self._slot_of[b] for b in taken], device=self.residual_of.device)
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.residual.device)  # noqa: E731
        return WritePlan((t(before[0]), t(before[1])), (t(after[0]), t(after[1])), t(filled[0]), t(filled[1]),
                         t(direct[0]), t(direct[1]))

    def _take_slot(self, block: int) -> int:
        if not self._free_slots:
            raise RuntimeError(f"all {self.residual.shape[3]} residual slots are in use; the engine gives "
                               "one to each sequence it may run (max_num_seqs)")
        slot = self._free_slots.pop()
        self._slot_of[block] = slot
        return slot

    def _release(self, blocks: list[int]) -> None:
        """Return the slots of these blocks; they read as quantized from now on."""
        for b in blocks:
            self._free_slots.append(self._slot_of.pop(b))
        if blocks:
            self.residual_of[blocks] = -1

    def _forget(self, blocks: list[int]) -> None:
        """Blocks about to be written whole: a slot left from an earlier owner must not shadow them."""
        self._release([b for b in blocks if b in self._slot_of])

    def _collect_freed(self) -> None:
        """Return the slots of blocks that were freed while filling (their sequence ended)."""
        if self._ref_counts is not None:
            self._release([b for b in self._slot_of if self._ref_counts[b] == 0])


def read_pages(kv_cache: torch.Tensor | QuantizedLayer, ids: torch.Tensor) -> torch.Tensor:
    """K/V pages of blocks `ids` as [2, kv_heads, *ids.shape, block_size, head_dim] (quantized ones
    dequantized: only these blocks)."""
    if isinstance(kv_cache, QuantizedLayer):
        return kv_cache.gather(ids)
    return take_blocks(kv_cache, ids, 2)
