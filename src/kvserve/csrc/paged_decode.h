#ifndef KVSERVE_PAGED_DECODE_H
#define KVSERVE_PAGED_DECODE_H

/* Paged decode attention on the CPU: one query token per sequence against its cached K/V, read
 * page by page through the block table and dequantized as they are read (never gathered into a
 * contiguous copy, never dequantized whole). One task per (sequence, KV head): its G query heads
 * share every K/V row it reads. Online softmax a block at a time (FlashAttention's recurrence).
 *
 * Pages are [2][KVH][NB][BS][row] with K at 0 and V at 1. `kind` says what a row holds:
 *   F32, BF16, F16: full-precision numbers (also the layout of the residual slots);
 *   INT8: int8 numbers, one fp16 scale per (head, block, token)        meta [KVH][NB][BS];
 *   FP8:  e4m3 bytes, one fp32 scale per (head, block)                  meta [KVH][NB];
 *   INT4: two numbers a byte (even channel low); K: fp16 (scale, min) per channel of a block,
 *         meta [KVH][NB][2][D]; V: fp16 (scale, min) per token, meta [KVH][NB][2][BS].
 * For quantized kinds, a block with residual_of[block] >= 0 is still filling: its exact rows are in
 * residual [2][KVH][slots][BS][D] of `residual_kind`.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2, INT8 = 3, FP8 = 4, INT4 = 5 };

static inline float bits_to_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }

static inline float f16_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0) {                      /* zero or subnormal: man * 2^-24 */
        float f = (float)man * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    if (exp == 31) return bits_to_float(sign | 0x7f800000u | (man << 13));
    return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
}

/* One row of `kind` as floats. */
static inline void load_row(float *dst, const void *src, int kind, int d) {
    if (kind == F32) {
        memcpy(dst, src, sizeof(float) * d);
    } else if (kind == BF16) {
        const uint16_t *s = src;
        for (int i = 0; i < d; i++) dst[i] = bf16_to_float(s[i]);
    } else {
        const uint16_t *s = src;
        for (int i = 0; i < d; i++) dst[i] = f16_to_float(s[i]);
    }
}

static inline size_t elem_size(int kind) { return kind == F32 ? 4 : kind <= F16 ? 2 : 1; }

typedef struct {
    const void *pages, *residual, *k_meta, *v_meta;
    const int64_t *residual_of;
    int kind, residual_kind, kvh, nb, bs, d, slots;
} Cache;


/* out[g][:] = softmax(q[g] . K^T * scale) V for the `groups` query heads (fp32) that share KV head
 * `h`, over the first `ctx` cached tokens of a sequence whose blocks are `table`. */
void attend_head(const Cache *c, int h, const int64_t *table, int64_t ctx, const float *q, int groups,
                 float scale, float *out);

#endif
