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

    Codecs that quantize whole blocks keep each block still filling exact in the pages of the block
    and of those it borrows: `residuals` is the cache manager's map of them (block -> borrowed blocks),
    which `residual_of` [num_blocks, pieces] mirrors for the kernels at each step.
    """

    def __init__(self, spec: KVSpec, num_blocks: int, device: torch.device,
                 residuals: dict[int, list[int]] | None = None):
        self.spec = spec
        self.block_size = bs = spec.block_size
        self.num_blocks = num_blocks
        quantized = set(spec.quantized_layers)
        shape = (2, spec.num_kv_heads, num_blocks, bs, spec.head_dim)
        self.kv = zeros((spec.num_layers - len(quantized), *shape), spec.dtype, torch.device(device))
        self.residual_of = torch.full((num_blocks if quantized else 0, max(1, spec.residual_pieces)), -1,
                                      dtype=torch.long, device=device)
        self._residuals = residuals if residuals is not None else {}
        self._mirrored: dict[int, list[int]] = {}     # what residual_of holds: the manager's lists
        full = iter(self.kv)
        self.layers = [QuantizedLayer(codecs(spec.kv_cache_dtype), spec.num_kv_heads, num_blocks, bs,
                                      spec.head_dim, spec.dtype, self.residual_of)
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
        """Copy whole pages src -> dst in every layer (copy-on-write), the exact tokens of a block being
        filled included (the pages it borrows, into those its copy borrows)."""
        if not copies:
            return
        src, dst = (list(x) for x in zip(*copies))
        self.kv[:, :, :, dst] = self.kv[:, :, :, src]
        if not self.quantized:
            return
        self._mirror()
        for s, d in copies:
            if s in self._mirrored:
                src += self._mirrored[s]
                dst += self._mirrored[d][:len(self._mirrored[s])]
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
        pages as stored, with their scales; write_blocks puts them back. Only for blocks that are full (a
        block still filling keeps exact tokens elsewhere)."""
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
        plan = self.plan_writes([new_table], [0], [len(keep)])
        for layer in self.layers:
            kv = read_pages(layer, old).flatten(2, 3)[:, :, keep].permute(2, 0, 1, 3)   # [n, 2, KVH, D]
            if isinstance(layer, QuantizedLayer):
                plan.write(layer, kv, slots)
            else:
                self.write(layer, kv, slots)

    def rotate_keys(self, src: list[int], dst: list[int], rotate: Callable[[torch.Tensor], None]) -> None:
        """Write full blocks src into blocks dst with their keys passed through `rotate` (in place,
        [..., head_dim]), in every layer: how `sink` moves its sink tokens next to the window."""
        dev = self.device
        src_t, dst_t = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
        for layer in self.layers:
            pages = read_pages(layer, src_t).clone()             # [2, KVH, n, BS, D]
            rotate(pages[0])
            if isinstance(layer, QuantizedLayer):
                layer.quantize(dst_t, pages)
            else:
                layer[:, :, dst_t] = pages

    def plan_writes(self, tables: list[list[int]], starts: list[int], num_new: list[int]) -> WritePlan | None:
        """Where the step's tokens go in the quantized layers: sequence i writes tokens
        [starts[i], starts[i] + num_new[i]) through block table tables[i]. None: no quantized layer.

        The blocks the step fills read as quantized from now on (the step's attention reads them so);
        the cache manager takes back what they borrowed once the step is done."""
        if not self.quantized:
            return None
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        pieces = max(1, self.spec.residual_pieces)
        if not self.spec.residual_pieces:
            return WritePlan((t([]), t([])), t([]), t([]).view(0, pieces), (t([]), t([])), t([]), t([]))
        self._mirror()
        bs = self.block_size
        exact, filled, filled_new, direct = ([], [], []), ([], []), ([], []), ([], [])
        offset = 0
        for table, start, n in zip(tables, starts, num_new):
            end = start + n
            for j in range(start // bs, -(-end // bs)):
                block, lo, hi = table[j], max(start, j * bs), min(end, (j + 1) * bs)
                tokens = range(offset + lo - start, offset + hi - start)
                if block not in self._mirrored:
                    if lo > j * bs or hi < (j + 1) * bs:
                        raise RuntimeError(f"block {block} is written in part but not held exact; the cache "
                                           "manager holds exact every block that a write leaves part full")
                    direct[0].extend(tokens)
                    direct[1].append(block)
                elif hi < (j + 1) * bs:                  # still part full: the tokens join its exact ones
                    exact[0].extend(tokens)
                    exact[1].extend([self._row(block)] * len(tokens))
                    exact[2].extend(range(lo - j * bs, hi - j * bs))
                else:                                    # fills: quantized from its exact tokens and these
                    filled_new[0].extend(tokens)
                    filled_new[1].extend(range(len(filled[0]) * bs + lo - j * bs, len(filled[0]) * bs + bs))
                    filled[0].append(block)
                    filled[1].append(self._row(block))
            offset += n
        index = self._residual_index(t(exact[1]).view(-1, pieces), t(exact[2]))
        if filled[0]:
            self.residual_of[filled[0]] = -1
        return WritePlan((t(exact[0]), index), t(filled[0]), t(filled[1]).view(-1, pieces),
                         (t(filled_new[0]), t(filled_new[1])), t(direct[0]), t(direct[1]))

    def _residual_index(self, pieces: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Where the numbers of tokens at `offsets` of blocks held exact (in `pieces` [n, P]) are in a
        layer's residual numbers: [n * head_dim], a token's channels in order."""
        layer, d = self.quantized[0], self.spec.head_dim
        numbers = offsets[:, None] * d + torch.arange(d, device=self.device)       # [n, D] within the block
        page = layer.page_numbers
        return (pieces.gather(1, numbers // page) * page + numbers % page).flatten()

    def _row(self, block: int) -> list[int]:
        """residual_of's row of a block held exact: itself, the blocks it borrows, then itself again
        in the places of blocks it has not borrowed yet (read, never written: their numbers exist)."""
        borrowed = self._mirrored[block]
        return [block, *borrowed] + [block] * (self.spec.residual_pieces - 1 - len(borrowed))

    def _mirror(self) -> None:
        """residual_of := the cache manager's blocks held exact and the blocks they borrow; a block the
        step has filled stays quantized (-1) until the manager takes back what it borrowed. Pages that
        join a block's exact tokens are zeroed: until written, they would read as the numbers of
        whatever they held (a quantized block's bytes can read as NaN)."""
        stale = {b: old for b, old in self._mirrored.items() if self._residuals.get(b) is not old}
        new = {b: borrowed for b, borrowed in self._residuals.items() if self._mirrored.get(b) is not borrowed}
        for b in stale:
            del self._mirrored[b]
        if gone := [b for b in stale if b not in new]:
            self.residual_of[gone] = -1
        if not new:
            return
        self._mirrored.update(new)
        self.residual_of[list(new)] = torch.tensor([self._row(b) for b in new], device=self.device)
        fresh = []
        for b, borrowed in new.items():
            old = stale.get(b)
            grown = old is not None and borrowed[:len(old)] == old      # the same block, borrowing more
            fresh += borrowed[len(old):] if grown else [b, *borrowed]
        if fresh:
            at = torch.tensor(fresh, device=self.device)
            for layer in self.quantized:
                _, kvh, nb, _, _ = layer.shape
                layer.residual.view(2, kvh, nb, -1).index_fill_(2, at, 0)

def read_pages(kv_cache: torch.Tensor | QuantizedLayer, ids: torch.Tensor) -> torch.Tensor:
    """K/V pages of blocks `ids` as [2, kv_heads, *ids.shape, block_size, head_dim] (quantized ones
    dequantized: only these blocks)."""
    if isinstance(kv_cache, QuantizedLayer):
        return kv_cache.gather(ids)
    return take_blocks(kv_cache, ids, 2)
