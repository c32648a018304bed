"""KVStorage: the preallocated K and V pages of every layer, full precision or quantized, over the pool's blocks.

With several layer groups (kv/groups.py), one block of the pool holds the pages of as many layers as the
largest group: the storage keeps that many page tensors, and layer i's pages are those of its place within
its group (`slots`). With layers kept in the model's dtype among quantized ones (kv_cache_dtype_skip_layers), a
block holds enough tensors of each dtype for any group (`block_spec`), each layer taking one of its own dtype.
A block serves one group at a time, so that copying a block copies every tensor's page.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from kvserve.engine.cpu_memory import zeros
from kvserve.kv.groups import LayerGroup
from kvserve.kv.pages import FullPages, LayerPages, PageFormat, QuantizedPages
from kvserve.kv.quant import rotate_keys_
from kvserve.kv.spec import KVSpec
from kvserve.kv.summaries import PageSummaries


def _full_precision_slots(groups: list[LayerGroup], quantized: set[int]) -> int:
    """Page tensors of a block kept in the model's dtype: those of the group with the most unquantized layers."""
    return max(sum(layer not in quantized for layer in g.layers) for g in groups)


def block_spec(spec: KVSpec, groups: list[LayerGroup]) -> KVSpec:
    """The spec of one block of the pool (its num_layers: the page tensors a block holds), from the model's.

    A block serves one group at a time, and each of its page tensors must hold its layer's pages in that layer's
    dtype whatever the group: with kv_cache_dtype_skip_layers, the block holds as many full-precision tensors as
    any group has unquantized layers, then as many quantized ones as any group has quantized layers (the pool's
    skip_layers are the leading tensors). Without, as many tensors of one kind as the largest group has layers.
    Where the two maxima come from different groups, a block is larger than any one group's pages: the page
    layouts of the two dtypes cannot share bytes, their block axis not leading."""
    quantized = set(spec.quantized_layers)
    full = _full_precision_slots(groups, quantized)
    quant = max(sum(layer in quantized for layer in g.layers) for g in groups)
    return replace(spec, num_layers=full + quant,
                   skip_layers=tuple(range(full)) if spec.kv_cache_dtype != "auto" else ())


def layer_slots(groups: list[LayerGroup], num_layers: int, quantized: set[int] = frozenset()
                ) -> tuple[list[int], list[int]]:
    """For each layer: the page tensor it uses and its group's index. A group's unquantized layers take the
    block's full-precision tensors in order, its `quantized` ones the quantized tensors after those (block_spec)."""
    slots, owner = [0] * num_layers, [0] * num_layers
    first_quantized = _full_precision_slots(groups, quantized)
    for g, group in enumerate(groups):
        full = [layer for layer in group.layers if layer not in quantized]
        quant = [layer for layer in group.layers if layer in quantized]
        for place, layer in [*enumerate(full), *enumerate(quant, first_quantized)]:
            slots[layer], owner[layer] = place, g
    return slots, owner


class KVStorage:
    """Every page tensor is a LayerPages in its PageFormat: the full-precision ones views of one tensor
    [tensors, 2, kv_heads, num_blocks, block_size, head_dim], the quantized ones (spec.kv_cache_dtype)
    QuantizedPages over the same block ids.

    Heads lead so that gathering a batch's pages yields [kv_heads, seqs, tokens, head_dim] with no
    further copy: the layout the attention matmuls take directly.

    `model_spec` is the model's (every layer, its skip_layers); `spec` becomes the pool's, block_spec's, for the
    layer groups `groups` (default: one group of every layer).
    """

    def __init__(self, model_spec: KVSpec, num_blocks: int, device: torch.device,
                 groups: list[LayerGroup] | None = None):
        groups = groups or [LayerGroup(None, tuple(range(model_spec.num_layers)))]
        self.spec = spec = block_spec(model_spec, groups)
        self.block_size = bs = spec.block_size
        self.num_blocks = num_blocks
        quantized = set(spec.quantized_layers)
        shape = (2, spec.num_kv_heads, num_blocks, bs, spec.head_dim)
        self.kv = zeros((spec.num_layers - len(quantized), *shape), spec.dtype, torch.device(device))
        full = iter(self.kv)
        fmt = PageFormat.of(spec.kv_cache_dtype, spec.dtype)
        self.layers: list[LayerPages] = [
            QuantizedPages(fmt, spec.num_kv_heads, num_blocks, bs, spec.head_dim, torch.device(device))
            if i in quantized else FullPages(next(full)) for i in range(spec.num_layers)]
        self.quantized = [layer for layer in self.layers if layer.format.quantized]
        # each page tensor's key summaries [tensors, KVH, num_blocks, 2, head_dim] (kv/summaries.py), or none
        self.summaries = zeros((spec.num_layers if spec.summaries else 0, spec.num_kv_heads, num_blocks, 2,
                                spec.head_dim), spec.dtype, torch.device(device))
        for layer, data in zip(self.layers, self.summaries):
            layer.summaries = PageSummaries(data, bs)
        self.slots, self.layer_group = layer_slots(groups, model_spec.num_layers, set(model_spec.quantized_layers))

    def layer(self, i: int) -> LayerPages:
        """Model layer i's pages: those of its place in its group."""
        return self.layers[self.slots[i]]

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def nbytes(self) -> int:
        tensors = [self.kv, self.summaries] + [t for layer in self.quantized for t in layer.tensors]
        return sum(t.numel() * t.element_size() for t in tensors)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole pages src -> dst in every layer (copy-on-write), with their summaries."""
        if not copies:
            return
        src, dst = (list(x) for x in zip(*copies))
        self.kv[:, :, :, dst] = self.kv[:, :, :, src]
        self.summaries[:, :, dst] = self.summaries[:, :, src]
        for layer in self.quantized:
            layer.copy_blocks(src, dst)

    def _block_parts(self) -> list[tuple[torch.Tensor, int]]:
        """Every tensor holding blocks, with its block axis: the full-precision pages, then each quantized
        layer's numbers and its K and V scales."""
        parts = [(self.kv, 3)] if len(self.kv) else []
        return parts + [part for layer in self.quantized for part in layer.block_parts()]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The bytes of whole blocks [n, spec.page_bytes_per_block] (a copy): their pages in every layer, quantized
        pages as stored, with their scales; write_blocks puts them back (and summarises them)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        rows = [t.index_select(axis, ids).movedim(axis, 0).reshape(len(block_ids), -1).view(torch.uint8)
                for t, axis in self._block_parts()]
        return torch.cat(rows, 1)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Store bytes of whole blocks [n, spec.page_bytes_per_block] (read_blocks') into blocks `block_ids`, and
        summarise their keys."""
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
        for layer in self.layers:
            layer.summarize_blocks(ids)

    def rewrite(self, old_table: list[int], keep: torch.Tensor, new_table: list[int]) -> None:
        """Copy the tokens at cache positions `keep` (through old_table) to positions 0, 1, ... of
        new_table, in every layer: how an eviction compacts a sequence's cache into fresh blocks."""
        dev = self.device
        pos = torch.arange(len(keep), device=dev)
        new = torch.tensor(new_table, device=dev)
        slots = new[pos // self.block_size] * self.block_size + pos % self.block_size
        old = torch.tensor(old_table, device=dev)
        for layer in self.layers:
            kv = layer.gather(old).flatten(2, 3)[:, :, keep].permute(2, 0, 1, 3)   # [n, 2, KVH, D]
            layer.write_tokens(kv, slots)

    def rotate_keys(self, src: list[int], dst: list[int], rotate: Callable[[torch.Tensor], None]) -> None:
        """Write full blocks src into blocks dst with their keys passed through `rotate` (in place,
        [..., head_dim]), in every layer: how `sink` moves its sink tokens next to the window."""
        dev = self.device
        src_t, dst_t = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
        for layer in self.layers:
            pages = layer.gather(src_t).clone()             # [2, KVH, n, BS, D]
            rotated = layer.format.rotates_keys
            if rotated:
                rotate_keys_(pages[0])       # RoPE turns the model's keys: undo the cache's rotation (its own inverse)
            rotate(pages[0])
            if rotated:
                rotate_keys_(pages[0])
            layer.write_pages(dst_t, pages)

