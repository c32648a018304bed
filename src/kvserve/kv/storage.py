"""KVStorage: the preallocated K and V pages of every layer, full precision or quantized."""
from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.engine.cpu_memory import zeros
from kvserve.kernels import fallback, function
from kvserve.kv.quant import QuantizedLayer, codecs, rotate_keys_, take_blocks
from kvserve.kv.spec import KVSpec


class KVStorage:
    """Full-precision layers share one tensor [layers, 2, kv_heads, num_blocks, block_size, head_dim];
    quantized layers (spec.kv_cache_dtype) are QuantizedLayers over the same block ids.

    Heads lead so that gathering a batch's pages yields [kv_heads, seqs, tokens, head_dim] with no
    further copy: the layout the attention matmuls take directly.
    """

    def __init__(self, spec: KVSpec, num_blocks: int, device: torch.device):
        self.spec = spec
        self.block_size = bs = spec.block_size
        self.num_blocks = num_blocks
        quantized = set(spec.quantized_layers)
        shape = (2, spec.num_kv_heads, num_blocks, bs, spec.head_dim)
        self.kv = zeros((spec.num_layers - len(quantized), *shape), spec.dtype, torch.device(device))
        full = iter(self.kv)
        self.layers = [QuantizedLayer(codecs(spec.kv_cache_dtype), spec.num_kv_heads, num_blocks, bs,
                                      spec.head_dim, spec.dtype, torch.device(device))
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
        tensors = [self.kv] + [t for layer in self.quantized for t in (layer.pages, *layer.meta)]
        return sum(t.numel() * t.element_size() for t in tensors)

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

    def _block_parts(self) -> list[tuple[torch.Tensor, int]]:
        """Every tensor holding blocks, with its block axis: the full-precision pages, then each quantized
        layer's numbers and its K and V scales."""
        parts = [(self.kv, 3)] if len(self.kv) else []
        for layer in self.quantized:
            parts += [(layer.pages, 2), (layer.meta[0], 1), (layer.meta[1], 1)]
        return parts

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The bytes of whole blocks [n, spec.bytes_per_block] (a copy): their pages in every layer, quantized
        pages as stored, with their scales; write_blocks puts them back."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        rows = [t.index_select(axis, ids).movedim(axis, 0).reshape(len(block_ids), -1).view(torch.uint8)
                for t, axis in self._block_parts()]
        return torch.cat(rows, 1)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Store bytes of whole blocks [n, spec.bytes_per_block] (read_blocks') into blocks `block_ids`."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = data.to(self.device)
        start = 0
        for t, axis in self._block_parts():
            shape = t.shape[:axis] + t.shape[axis + 1:]
            width = shape.numel() * t.element_size()
            rows = data[:, start:start + width].contiguous().view(t.dtype).view(len(block_ids), *shape)
            t.index_copy_(axis, ids, rows.movedim(0, axis))
            start += width
        if start != data.shape[1]:
            raise ValueError(f"{data.shape[1]} bytes a block, but this pool's blocks are {start} bytes")

    def rewrite(self, old_table: list[int], keep: torch.Tensor, new_table: list[int]) -> None:
        """Copy the tokens at cache positions `keep` (through old_table) to positions 0, 1, ... of
        new_table, in every layer: how an eviction compacts a sequence's cache into fresh blocks."""
        dev = self.device
        pos = torch.arange(len(keep), device=dev)
        new = torch.tensor(new_table, device=dev)
        slots = new[pos // self.block_size] * self.block_size + pos % self.block_size
        old = torch.tensor(old_table, device=dev)
        for layer in self.layers:
            kv = read_pages(layer, old).flatten(2, 3)[:, :, keep].permute(2, 0, 1, 3)   # [n, 2, KVH, D]
            if isinstance(layer, QuantizedLayer):
                layer.write_tokens(kv, slots)
            else:
                self.write(layer, kv, slots)

    def rotate_keys(self, src: list[int], dst: list[int], rotate: Callable[[torch.Tensor], None]) -> None:
        """Write full blocks src into blocks dst with their keys passed through `rotate` (in place,
        [..., head_dim]), in every layer: how `sink` moves its sink tokens next to the window."""
        dev = self.device
        src_t, dst_t = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
        for layer in self.layers:
            pages = read_pages(layer, src_t).clone()             # [2, KVH, n, BS, D]
            rotated = isinstance(layer, QuantizedLayer) and layer.rotates_keys
            if rotated:
                rotate_keys_(pages[0])       # RoPE turns the model's keys: undo the cache's rotation (its own inverse)
            rotate(pages[0])
            if rotated:
                rotate_keys_(pages[0])
            if isinstance(layer, QuantizedLayer):
                layer.quantize(dst_t, pages)
            else:
                layer[:, :, dst_t] = pages


def read_pages(kv_cache: torch.Tensor | QuantizedLayer, ids: torch.Tensor) -> torch.Tensor:
    """K/V pages of blocks `ids` as [2, kv_heads, *ids.shape, block_size, head_dim] (quantized ones
    dequantized: only these blocks)."""
    if isinstance(kv_cache, QuantizedLayer):
        return kv_cache.gather(ids)
    return take_blocks(kv_cache, ids, 2)
