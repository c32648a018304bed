"""Triton kernels over the paged KV cache: store new K/V, varlen causal prefill, split-KV decode.

Layouts (see kvserve.kv.storage): a layer's cache is [2, kv_heads, num_blocks, page_size, head_dim]
and token t of a sequence lives in page block_table[t // page_size] at offset t % page_size.
Queries, keys and values of the step are [tokens, heads, head_dim] views whose last dim is
contiguous; every other stride is passed in, so the decoder's views of its fused qkv need no copy.

Softmax runs in base 2: scores are pre-multiplied by scale * log2(e) so exp2 (one instruction on
the GPU) replaces exp. Log-sum-exps written by the decode kernel are base 2 as well.

A layer with a sliding window W (window > 0) attends to the last W positions only: the query at p sees
the keys (p - W, p]. The kernels start at the first tile a window reaches, mask the keys before each
row's window, and the decode splits only the window into partitions. Soft-capped scores (Gemma 2's,
SOFT_CAP) become c * tanh(s / c) before the softmax.

head_dim need not be a power of two (80, 96): tiles span the next power of two and the extra
lanes are masked to zero, which adds nothing to q·k and yields nothing in the output.

Quantized pages (a kvserve.kv.pages.QuantizedPages: int8, fp8, int4) are read by the same kernels
compiled with KV_QUANT > 0: each K or V tile is loaded as stored numbers and scales and decoded in
registers (_load_tile); nothing is dequantized ahead of the kernel. KV_QUANT = 0 compiles the full-precision path alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kv.pages import QuantizedPages

LOG2E = 1.4426950408889634
# tl.dot needs every dimension >= 16.
MIN_DOT = 16


# --------------------------------------------------------------------------------------------
# Store
# --------------------------------------------------------------------------------------------

@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_c_kv, stride_c_head, stride_c_page, stride_c_slot,
                     PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per token: copies its K and V for all kv heads into its slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding tokens (vLLM's convention) own no slot
        return
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    # int64 from here on: a whole cache easily exceeds 2**31 elements.
    dst = (cache_ptr + page * stride_c_page + offset * stride_c_slot
           + heads[:, None].to(tl.int64) * stride_c_head + dims[None, :])
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_c_kv, v, mask=mask)


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write K and V [tokens, kv_heads, head_dim] into kv_cache [2, kv_heads, blocks, page, head_dim]
    at slot_mapping (slot = page_id * page_size + offset): the same result as FullPages.write_tokens.
    Negative slots are skipped."""
    tokens, num_kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    _check_last_dim_contiguous(k, v, kv_cache)
    _store_kv_kernel[(tokens,)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *kv_cache.stride()[:4],
        PAGE_SIZE=kv_cache.shape[3], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------

@triton.jit
def _key_pages(k_pos, key_mask, table_row_ptr, row_start, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr):
    """Page and offset in the page (both int64) of each key position.

    PAGED: through the sequence's block table, one page id per key (so any tile size works with
    any page size). Otherwise the keys are the step's own rows row_start + k_pos of a [T, KVH, D]
    tensor (cache_mode "none"), taken as pages of one token (the token stride as the page stride)."""
    if PAGED:
        page = tl.load(table_row_ptr + k_pos // PAGE_SIZE, mask=key_mask, other=0).to(tl.int64)
        return page, (k_pos % PAGE_SIZE).to(tl.int64)
    else:
        page = (row_start + k_pos).to(tl.int64)
        return page, tl.zeros_like(page)


@triton.jit
def _load_tile(data_ptr, meta_ptr, rows, page, slot, key_ok, chans, chan_ok,
               PAGE_SIZE: tl.constexpr, KV_QUANT: tl.constexpr):
    """K or V values of a tile's keys at channels `chans`, in the cache's dtype (KV_QUANT 0) or in
    float32 (quantized); 0 where masked. The per-key arguments (rows, page, slot, key_ok) come as
    [1, N] and chans, chan_ok as [D, 1] to load Kᵀ [D, N], or as [N, 1] and [1, D] to load V [N, D]:
    the same code serves both layouts.

    rows: each key's row offset in data_ptr (page and slot through the data's strides; kv head
    resolved in every pointer). KV_QUANT 0: that is all. Otherwise data_ptr holds the stored
    numbers, meta_ptr the scales of each token (contiguous [blocks, ...] of this head, hence indexed
    by page and slot):
      1 int8: x = q * scale                  (meta [blocks, PAGE_SIZE], float16)
      2 fp8:  x = e4m3(byte) * scale         (meta [blocks, PAGE_SIZE], float16)
      3 int4: x = nibble * scale + min, two channels a byte, channel c in byte c // 2 at bit
              4 * (c % 2)                    (meta [blocks, 2, PAGE_SIZE]: scales, then minimums)
    """
    mask = key_ok & chan_ok
    # one return, after every branch: compiled (unlike interpreted) Triton types each return statement
    # of a function alike, even one in a constexpr branch not taken
    if KV_QUANT == 0:
        x = tl.load(data_ptr + rows + chans, mask=mask, other=0.0)
    elif KV_QUANT == 1:
        x = tl.load(data_ptr + rows + chans, mask=mask, other=0).to(tl.float32)
        x = x * tl.load(meta_ptr + page * PAGE_SIZE + slot, mask=key_ok, other=0.0).to(tl.float32)
    elif KV_QUANT == 2:
        # The interpreter (3.8) bitcasts uint8 to float8e4nv and widens it exactly, as the GPU does
        # (only the NaN bytes 0x7f / 0xff differ, and the codec never writes them).
        byte = tl.load(data_ptr + rows + chans, mask=mask, other=0)
        x = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        x = x * tl.load(meta_ptr + page * PAGE_SIZE + slot, mask=key_ok, other=0.0).to(tl.float32)
    else:
        byte = tl.load(data_ptr + rows + chans // 2, mask=mask, other=0).to(tl.int32)
        x = ((byte >> (4 * (chans % 2))) & 15).to(tl.float32)
        group = meta_ptr + page * (2 * PAGE_SIZE) + slot
        scale = tl.load(group, mask=key_ok, other=0.0).to(tl.float32)
        x = x * scale + tl.load(group + PAGE_SIZE, mask=key_ok, other=0.0).to(tl.float32)
    return x


@triton.jit
def _dot(a, b, IN_FP32: tl.constexpr):
    """a @ b accumulated in fp32. IN_FP32 casts the operands first: Triton's interpreter multiplies
    bfloat16 blocks as their raw uint16 bits (3.8), so under it bf16 tiles go through fp32 (exact:
    a bf16 product fits in fp32). On a GPU bf16 goes straight to the tensor cores."""
    if IN_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _tanh(x):
    """tanh(x) = sign(x) (1 - e) / (1 + e) with e = e^(-2|x|) where |x| >= 1/8 (1 - e loses at most two bits
    there); below, its series to x^7."""
    a = tl.abs(x)
    x2 = x * x
    series = a * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    e = tl.exp2(a * -2.8853900817779268)           # -2 log2(e)
    t = tl.where(a < 0.125, series, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def _attend_tile(q, acc, m_i, l_i, k_ptr, v_ptr, quant, page, slot, stride_page, stride_slot,
                 key_mask, score_mask, qk_scale, soft_cap, dims, dim_mask,
                 PAGE_SIZE: tl.constexpr, KV_QUANT: tl.constexpr,
                 MASK_SCORES: tl.constexpr, DOT_FP32: tl.constexpr, SOFT_CAP: tl.constexpr):
    """One FlashAttention-2 step: scores of the query tile against one key tile, the running max
    m_i and sum l_i updated, the accumulator rescaled once, then P @ V added.

    k_ptr / v_ptr: this kv head's K and V; page, slot [BLOCK_N]: where each key is (_key_pages).
    quant: (K scales, V scales), heads resolved, read when KV_QUANT > 0 (see _load_tile); the
    quantized tiles are rounded to q's dtype (the model's). key_mask [N] guards the loads;
    score_mask ([M, N] or [1, N]: causality, the context's end) is applied to the scores only when
    MASK_SCORES, so the tiles wholly inside the context skip the select. SOFT_CAP: the scores (log2 units)
    are capped at soft_cap (the cap times log2(e)) first. A row that has seen no key yet (a sliding window
    starting later) keeps m_i = -inf and adds nothing."""
    k_meta, v_meta = quant
    rows = page * stride_page + slot * stride_slot
    k = _load_tile(k_ptr, k_meta, rows[None, :], page[None, :], slot[None, :], key_mask[None, :],
                   dims[:, None], dim_mask[:, None], PAGE_SIZE, KV_QUANT)  # Kᵀ
    if KV_QUANT != 0:
        k = k.to(q.dtype)
    s = _dot(q, k, DOT_FP32) * qk_scale                                        # [M, N], log2 units
    if SOFT_CAP:
        s = soft_cap * _tanh(s / soft_cap)
    if MASK_SCORES:
        s = tl.where(score_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)      # no key seen yet: not -inf - -inf
    alpha = tl.exp2(m_i - shift)           # how much the old max overstated: rescale once per tile
    p = tl.exp2(s - shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_tile(v_ptr, v_meta, rows[:, None], page[:, None], slot[:, None], key_mask[:, None],
                   dims[None, :], dim_mask[None, :], PAGE_SIZE, KV_QUANT)
    if KV_QUANT != 0:
        v = v.to(q.dtype)
    # P is rounded to V's dtype, as FlashAttention does, so the tensor cores take both operands.
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
    return acc, m_new, l_i


# Whether the kernels were decorated under TRITON_INTERPRET=1 (read once, at decoration).
_INTERPRETED = not isinstance(_dot, triton.runtime.JITFunction)


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether tl.dot must see fp32 operands: bf16 under the interpreter (see _dot)."""
    return dtype == torch.bfloat16 and _INTERPRETED


# KV_QUANT of each quantized page format; 0 is full precision.
_KV_QUANT = {"int8": 1, "fp8": 2, "int4": 3}


def _quantized_args(layer: QuantizedPages, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """KV_QUANT, the pointers (K scales, V scales) and their strides per head that the kernels take for a
    quantized layer."""
    kv_quant = _KV_QUANT.get(layer.format.name)
    if kv_quant is None:
        raise ValueError(f"no kernel reads {layer.format.name} pages")
    if k is not layer.data[0] or v is not layer.data[1]:
        raise ValueError("k and v must be the quantized layer's data[0] and data[1]")
    k_meta, v_meta = layer.meta
    # _load_tile indexes scales from their shapes, not their strides.
    if not (k_meta.is_contiguous() and v_meta.is_contiguous()):
        raise ValueError("a quantized layer's scales must be contiguous")
    if layer.dtype != q.dtype:
        raise ValueError(f"the layer's model dtype ({layer.dtype}) must be the queries' dtype ({q.dtype})")
    return kv_quant, (k_meta, v_meta), (k_meta.stride(0), v_meta.stride(0))


def _check_last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"the last dimension must be contiguous, got strides {t.stride()}")


# --------------------------------------------------------------------------------------------
# Varlen causal prefill
# --------------------------------------------------------------------------------------------

@triton.jit
def _prefill_quant_kernel(q_ptr, k_ptr, v_ptr, out_ptr,
                          q_start_ptr, q_len_ptr, ctx_len_ptr, table_ptr,
                          k_meta_ptr, v_meta_ptr,
                          stride_qt, stride_qh, stride_ot, stride_oh,
                          stride_k_head, stride_k_page, stride_k_slot, stride_table,
                          stride_km_head, stride_vm_head,
                          qk_scale, window, soft_cap,
                          GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
                          KV_QUANT: tl.constexpr, SOFT_CAP: tl.constexpr):
    """Grid (query tiles, heads, sequences). Query i of a sequence sits at absolute position
    context_len - query_len + i, so a cached prefix (chunked prefill, prefix caching) is attended in
    full and only the new tokens are causal among themselves.

    KV_QUANT > 0 (paged only): k_ptr, v_ptr are a QuantizedPages' stored numbers, k_meta_ptr,
    v_meta_ptr its scales (see _load_tile). KV_QUANT 0 reads neither."""
    tile, head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_len = tl.load(q_len_ptr + seq)
    m_start = tile * BLOCK_M
    if m_start >= q_len:  # the grid covers the longest query; shorter ones end early
        return
    ctx_len = tl.load(ctx_len_ptr + seq)
    q_start = tl.load(q_start_ptr + seq)
    prefix = ctx_len - q_len

    offs_m = m_start + tl.arange(0, BLOCK_M)
    row_mask = offs_m < q_len
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    q_pos = prefix + offs_m

    # GQA: the kernel indexes the shared kv head; K/V are never repeated.
    kv_head = (head // GROUP).to(tl.int64)
    k_head_ptr = k_ptr + kv_head * stride_k_head
    v_head_ptr = v_ptr + kv_head * stride_k_head
    quant = (k_meta_ptr + kv_head * stride_km_head, v_meta_ptr + kv_head * stride_vm_head)
    table_row = table_ptr + seq.to(tl.int64) * stride_table

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Keys before the tile's first query position (and, with a window, within its last row's) are visible
    # to every row: no mask, and whole tiles (they are all < context_len). Before them, from the first tile
    # the first row's window reaches, and after them, up to the last row's position, the keys are masked.
    first_q_pos = prefix + m_start
    unmasked_end = (first_q_pos // BLOCK_N) * BLOCK_N
    keys_end = tl.minimum(ctx_len, first_q_pos + BLOCK_M)
    windowed = window > 0
    window_start = tl.where(windowed, (tl.maximum(first_q_pos - window + 1, 0) // BLOCK_N) * BLOCK_N, 0)
    last_first_key = tl.maximum(first_q_pos + BLOCK_M - window, 0)        # of the tile's last row's window
    unmasked_start = tl.where(windowed, tl.minimum(tl.cdiv(last_first_key, BLOCK_N) * BLOCK_N, unmasked_end), 0)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(window_start, unmasked_start, BLOCK_N):
        k_pos = n0 + offs_n
        key_mask = k_pos < ctx_len   # always true here; keeps the loads uniform
        seen = (k_pos[None, :] > q_pos[:, None] - window) & key_mask[None, :]
        page, slot = _key_pages(k_pos, key_mask, table_row, q_start, PAGE_SIZE, PAGED)
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_head_ptr, v_head_ptr, quant, page, slot,
                                     stride_k_page, stride_k_slot, key_mask, seen, qk_scale, soft_cap, dims,
                                     dim_mask, PAGE_SIZE, KV_QUANT, True, DOT_FP32, SOFT_CAP)
    for n0 in range(unmasked_start, unmasked_end, BLOCK_N):
        k_pos = n0 + offs_n
        key_mask = k_pos < ctx_len   # always true here; keeps the loads uniform
        page, slot = _key_pages(k_pos, key_mask, table_row, q_start, PAGE_SIZE, PAGED)
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_head_ptr, v_head_ptr, quant, page, slot,
                                     stride_k_page, stride_k_slot, key_mask, key_mask, qk_scale, soft_cap, dims,
                                     dim_mask, PAGE_SIZE, KV_QUANT, False, DOT_FP32, SOFT_CAP)
    for n0 in range(unmasked_end, keys_end, BLOCK_N):
        k_pos = n0 + offs_n
        key_mask = k_pos < ctx_len
        seen = (k_pos[None, :] <= q_pos[:, None]) & key_mask[None, :]
        seen = seen & ((k_pos[None, :] > q_pos[:, None] - window) | (window == 0))
        page, slot = _key_pages(k_pos, key_mask, table_row, q_start, PAGE_SIZE, PAGED)
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_head_ptr, v_head_ptr, quant, page, slot,
                                     stride_k_page, stride_k_slot, key_mask, seen, qk_scale, soft_cap, dims,
                                     dim_mask, PAGE_SIZE, KV_QUANT, True, DOT_FP32, SOFT_CAP)

    # Every real row saw its own key, so l_i > 0; a padding row past a window may have seen none.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr,
                    q_start_ptr, q_len_ptr, ctx_len_ptr, table_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_k_head, stride_k_page, stride_k_slot, stride_table,
                    qk_scale, window, soft_cap,
                    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, SOFT_CAP: tl.constexpr):
    """Full-precision K/V: _prefill_quant_kernel with KV_QUANT 0, without the quantized layer's
    arguments (the pointers handed in for them are never read)."""
    _prefill_quant_kernel(q_ptr, k_ptr, v_ptr, out_ptr, q_start_ptr, q_len_ptr, ctx_len_ptr, table_ptr,
                          k_ptr, v_ptr,
                          stride_qt, stride_qh, stride_ot, stride_oh,
                          stride_k_head, stride_k_page, stride_k_slot, stride_table, 0, 0,
                          qk_scale, window, soft_cap, GROUP, PAGE_SIZE, PAGED, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                          DOT_FP32, 0, SOFT_CAP)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      q_starts: torch.Tensor, q_lens: torch.Tensor, ctx_lens: torch.Tensor,
                      block_tables: torch.Tensor | None, max_q_len: int, scale: float,
                      block_m: int = 64, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                      quant: QuantizedPages | None = None, sliding_window: int | None = None,
                      logits_soft_cap: float | None = None) -> None:
    """Causal attention of each sequence's queries, written into out [T, H, D]; within the last
    sliding_window positions and with soft-capped scores, where given.

    q [T, H, D]; q_starts, q_lens, ctx_lens [seqs] int (row of each sequence's first query in q).
    Paged (block_tables [seqs, max_blocks] given): k, v are a layer's K and V pages
    [KVH, blocks, page_size, D] and sequence s attends to its ctx_lens[s] cached tokens.
    Flat (block_tables None): k, v are the step's own [T, KVH, D] and ctx_lens must equal q_lens.
    Quantized pages (paged only): quant is the QuantizedPages and k, v its quant.data[0], quant.data[1]."""
    tokens, num_heads, head_dim = q.shape
    num_seqs = q_lens.shape[0]
    if tokens == 0 or num_seqs == 0:
        return
    _check_last_dim_contiguous(q, k, v, out)
    paged = block_tables is not None
    if paged:
        num_kv_heads, page_size = k.shape[0], k.shape[2]
        head_stride, page_stride, slot_stride = k.stride(0), k.stride(1), k.stride(2)
        table, table_stride = block_tables, block_tables.stride(0)
    else:   # each row a page of one token
        num_kv_heads, page_size = k.shape[1], 1
        head_stride, page_stride, slot_stride = k.stride(1), k.stride(0), 0
        table, table_stride = q_lens, 0   # never read
    if k.stride() != v.stride():
        raise ValueError("k and v must share strides")
    grid = (triton.cdiv(max_q_len, block_m), num_heads, num_seqs)
    consts = {"GROUP": num_heads // num_kv_heads, "PAGE_SIZE": page_size, "PAGED": paged,
              "HEAD_DIM": head_dim, "BLOCK_D": max(MIN_DOT, triton.next_power_of_2(head_dim)),
              "BLOCK_M": block_m, "BLOCK_N": block_n, "DOT_FP32": _dot_in_fp32(q.dtype),
              "SOFT_CAP": logits_soft_cap is not None, "num_warps": num_warps, "num_stages": num_stages}
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), head_stride, page_stride, slot_stride,
               table_stride)
    limits = (scale * LOG2E, sliding_window or 0, (logits_soft_cap or 0.0) * LOG2E)
    if quant is None:
        _prefill_kernel[grid](q, k, v, out, q_starts, q_lens, ctx_lens, table, *strides, *limits, **consts)
        return
    if not paged:
        raise ValueError("quantized K/V are read through block tables")
    kv_quant, pointers, quant_strides = _quantized_args(quant, q, k, v)
    _prefill_quant_kernel[grid](q, k, v, out, q_starts, q_lens, ctx_lens, table, *pointers,
                                *strides, *quant_strides, *limits, KV_QUANT=kv_quant, **consts)


# --------------------------------------------------------------------------------------------
# Split-KV paged decode (flash-decoding)
# --------------------------------------------------------------------------------------------

@triton.jit
def _first_key(ctx_len, window):
    """The first key a decode sees: its window's (window > 0), else 0."""
    return tl.where(window > 0, tl.maximum(ctx_len - window, 0), 0)


@triton.jit
def _decode_partition_quant_kernel(q_ptr, k_ptr, v_ptr, part_out_ptr, part_lse_ptr,
                                   ctx_len_ptr, table_ptr,
                                   k_meta_ptr, v_meta_ptr,
                                   stride_qt, stride_qh,
                                   stride_k_head, stride_k_page, stride_k_slot, stride_table, stride_table_head,
                                   stride_ctx, stride_ctx_head,
                                   stride_po_seq, stride_po_head, stride_po_part,
                                   stride_pl_seq, stride_pl_head,
                                   stride_km_head, stride_vm_head,
                                   qk_scale, window, soft_cap,
                                   GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, PARTITION: tl.constexpr,
                                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                                   BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
                                   KV_QUANT: tl.constexpr, SOFT_CAP: tl.constexpr):
    """Grid (sequences, kv heads, partitions). The GROUP query heads sharing a kv head form the
    query tile (padded to BLOCK_G rows for tl.dot), so each page is read once per kv head. Writes
    the partition's normalized output and its base-2 log-sum-exp. Partitions cover the sequence's keys
    from its window's first (with a window), else from 0.

    KV_QUANT > 0: k_ptr, v_ptr are a QuantizedPages' stored numbers, read with its scales as in
    _prefill_quant_kernel. KV_QUANT 0 reads none of those.

    A sequence's context length and block table may be its KV head's (stride_ctx_head, stride_table_head
    nonzero: sparse attention's choice of blocks, attention/sparse.py), else the sequence's (0)."""
    seq, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx_len = tl.load(ctx_len_ptr + seq * stride_ctx + kv_head * stride_ctx_head)
    start = _first_key(ctx_len, window) + part * PARTITION
    if start >= ctx_len:  # the grid covers the longest context (or window); the merge ignores these
        return
    end = tl.minimum(start + PARTITION, ctx_len)

    groups = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + groups
    head_mask = groups < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_mask[:, None] & dim_mask[None, :], other=0.0)

    kv_head64 = kv_head.to(tl.int64)
    k_head_ptr = k_ptr + kv_head64 * stride_k_head
    v_head_ptr = v_ptr + kv_head64 * stride_k_head
    quant = (k_meta_ptr + kv_head64 * stride_km_head, v_meta_ptr + kv_head64 * stride_vm_head)
    table_row = table_ptr + seq.to(tl.int64) * stride_table + kv_head64 * stride_table_head

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # The one query is the last position: no causal mask, only the context's end, which can only
    # fall in the partition's last tile.
    offs_n = tl.arange(0, BLOCK_N)
    full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        k_pos = n0 + offs_n
        key_mask = k_pos < end   # always true here; keeps the loads uniform
        page, slot = _key_pages(k_pos, key_mask, table_row, 0, PAGE_SIZE, True)
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_head_ptr, v_head_ptr, quant, page, slot,
                                     stride_k_page, stride_k_slot, key_mask, key_mask[None, :], qk_scale, soft_cap,
                                     dims, dim_mask, PAGE_SIZE, KV_QUANT, False, DOT_FP32, SOFT_CAP)
    for n0 in range(full_end, end, BLOCK_N):   # at most one partial tile
        k_pos = n0 + offs_n
        key_mask = k_pos < end
        page, slot = _key_pages(k_pos, key_mask, table_row, 0, PAGE_SIZE, True)
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_head_ptr, v_head_ptr, quant, page, slot,
                                     stride_k_page, stride_k_slot, key_mask, key_mask[None, :], qk_scale, soft_cap,
                                     dims, dim_mask, PAGE_SIZE, KV_QUANT, True, DOT_FP32, SOFT_CAP)

    out = acc / l_i[:, None]
    lse = m_i + tl.log2(l_i)
    po = part_out_ptr + seq * stride_po_seq + heads[:, None] * stride_po_head + part * stride_po_part
    tl.store(po + dims[None, :], out, mask=head_mask[:, None] & dim_mask[None, :])
    tl.store(part_lse_ptr + seq * stride_pl_seq + heads * stride_pl_head + part, lse, mask=head_mask)


@triton.jit
def _decode_partition_kernel(q_ptr, k_ptr, v_ptr, part_out_ptr, part_lse_ptr,
                             ctx_len_ptr, table_ptr,
                             stride_qt, stride_qh,
                             stride_k_head, stride_k_page, stride_k_slot, stride_table, stride_table_head,
                             stride_ctx, stride_ctx_head,
                             stride_po_seq, stride_po_head, stride_po_part,
                             stride_pl_seq, stride_pl_head,
                             qk_scale, window, soft_cap,
                             GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, PARTITION: tl.constexpr,
                             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
                             SOFT_CAP: tl.constexpr):
    """Full-precision pages: _decode_partition_quant_kernel with KV_QUANT 0, without the quantized
    layer's arguments (the pointers handed in for them are never read)."""
    _decode_partition_quant_kernel(q_ptr, k_ptr, v_ptr, part_out_ptr, part_lse_ptr, ctx_len_ptr, table_ptr,
                                   k_ptr, v_ptr,
                                   stride_qt, stride_qh, stride_k_head, stride_k_page, stride_k_slot, stride_table,
                                   stride_table_head, stride_ctx, stride_ctx_head,
                                   stride_po_seq, stride_po_head, stride_po_part, stride_pl_seq, stride_pl_head,
                                   0, 0, qk_scale, window, soft_cap,
                                   GROUP, PAGE_SIZE, PARTITION, HEAD_DIM, BLOCK_D, BLOCK_G, BLOCK_N, DOT_FP32, 0,
                                   SOFT_CAP)


@triton.jit
def _decode_merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, ctx_len_ptr,
                         stride_po_seq, stride_po_head, stride_po_part,
                         stride_pl_seq, stride_pl_head, stride_ot, stride_oh, window, stride_ctx, stride_ctx_head,
                         GROUP: tl.constexpr, PARTITION: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_P: tl.constexpr):
    """Grid (sequences, heads): out = Σ_p exp2(lse_p - max) o_p / Σ_p exp2(lse_p - max), over the
    partitions that exist for this sequence's (or its KV head's) context (or window), in chunks of BLOCK_P."""
    seq, head = tl.program_id(0), tl.program_id(1)
    ctx_len = tl.load(ctx_len_ptr + seq * stride_ctx + (head // GROUP) * stride_ctx_head)
    num_parts = tl.cdiv(ctx_len - _first_key(ctx_len, window), PARTITION)
    lse_base = part_lse_ptr + seq * stride_pl_seq + head * stride_pl_head
    out_base = part_out_ptr + seq * stride_po_seq + head * stride_po_head
    offs_p = tl.arange(0, BLOCK_P)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM

    # Pass 1: the largest lse, so no weight overflows.
    m_vec = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        parts = p0 + offs_p
        m_vec = tl.maximum(m_vec, tl.load(lse_base + parts, mask=parts < num_parts, other=float("-inf")))
    m = tl.max(m_vec, 0)
    # Pass 2: weighted sum of the partial outputs.
    acc = tl.zeros([BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_P], tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        parts = p0 + offs_p
        part_mask = parts < num_parts
        w = tl.exp2(tl.load(lse_base + parts, mask=part_mask, other=float("-inf")) - m)
        o = tl.load(out_base + parts[:, None] * stride_po_part + dims[None, :],
                    mask=part_mask[:, None] & dim_mask[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
        total += w
    # a context of 0 (a CUDA graph's padding row) has no partition: its output is 0, not 0/0
    out = acc / tl.maximum(tl.sum(total, 0), 1e-30)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_mask)


def decode_workspace(num_seqs: int, num_heads: int, head_dim: int, max_ctx_len: int, partition_size: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial outputs [seqs, heads, partitions, D] and log-sum-exps [seqs, heads, partitions], fp32."""
    parts = triton.cdiv(max_ctx_len, partition_size)
    return (torch.empty(num_seqs, num_heads, parts, head_dim, dtype=torch.float32, device=device),
            torch.empty(num_seqs, num_heads, parts, dtype=torch.float32, device=device))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                     ctx_lens: torch.Tensor, block_tables: torch.Tensor, max_ctx_len: int, scale: float,
                     partition_size: int = 512, block_n: int = 64,
                     workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                     num_warps: int = 4, quant: QuantizedPages | None = None, sliding_window: int | None = None,
                     logits_soft_cap: float | None = None) -> None:
    """One query per sequence, q [seqs, H, D], against its ctx_lens[s] cached tokens (the query's
    own included; the last sliding_window of them where given, soft-capped where given) in k_cache,
    v_cache [KVH, blocks, page_size, D]; written into out [seqs, H, D]. The workspace may have room for
    more partitions than this call uses. Each KV head may have its own blocks: block_tables [seqs, KVH, width]
    and ctx_lens [seqs, KVH] (sparse attention's, attention/sparse.py), else [seqs, width] and [seqs].
    Quantized pages: quant is the QuantizedPages and k_cache, v_cache its quant.data[0], quant.data[1].

    The context is cut into partitions of partition_size keys computed by separate programs (so a
    few long sequences still fill the GPU), then merged by log-sum-exp."""
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return
    if partition_size % block_n:
        raise ValueError(f"partition_size {partition_size} must be a multiple of block_n {block_n}")
    _check_last_dim_contiguous(q, k_cache, v_cache, out)
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share strides")
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    if workspace is None:
        workspace = decode_workspace(num_seqs, num_heads, head_dim, max_ctx_len, partition_size, q.device)
    part_out, part_lse = workspace
    block_d = max(MIN_DOT, triton.next_power_of_2(head_dim))
    keys = max_ctx_len if sliding_window is None else min(max_ctx_len, sliding_window)
    grid = (num_seqs, num_kv_heads, triton.cdiv(keys, partition_size))
    per_head = block_tables.dim() == 3
    ctx_strides = (ctx_lens.stride(0), ctx_lens.stride(1) if per_head else 0)
    strides = (q.stride(0), q.stride(1),
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
               block_tables.stride(1) if per_head else 0, *ctx_strides,
               part_out.stride(0), part_out.stride(1), part_out.stride(2),
               part_lse.stride(0), part_lse.stride(1))
    consts = {"GROUP": group, "PAGE_SIZE": k_cache.shape[2], "PARTITION": partition_size,
              "HEAD_DIM": head_dim, "BLOCK_D": block_d,
              "BLOCK_G": max(MIN_DOT, triton.next_power_of_2(group)), "BLOCK_N": block_n,
              "DOT_FP32": _dot_in_fp32(q.dtype), "SOFT_CAP": logits_soft_cap is not None, "num_warps": num_warps}
    limits = (scale * LOG2E, sliding_window or 0, (logits_soft_cap or 0.0) * LOG2E)
    if quant is None:
        _decode_partition_kernel[grid](q, k_cache, v_cache, part_out, part_lse, ctx_lens, block_tables,
                                       *strides, *limits, **consts)
    else:
        kv_quant, pointers, quant_strides = _quantized_args(quant, q, k_cache, v_cache)
        _decode_partition_quant_kernel[grid](q, k_cache, v_cache, part_out, part_lse, ctx_lens, block_tables,
                                             *pointers, *strides, *quant_strides, *limits,
                                             KV_QUANT=kv_quant, **consts)
    _decode_merge_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, ctx_lens,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), sliding_window or 0, *ctx_strides,
        GROUP=group, PARTITION=partition_size, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_P=16, num_warps=1,
    )
