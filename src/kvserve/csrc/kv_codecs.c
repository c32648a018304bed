/* A token's K or V row written into a layer's pages as kv/quant.py writes it, bit for bit: full-precision rows as
 * they are; quantized ones (csrc/paged_decode.c's kinds INT8, FP8, INT4) by the codec of their kind, each op the
 * op torch runs there, in float32 and rounded where torch rounds (float16 scales to nearest even, numbers half to
 * even), every sum over a row in kv/quant.py's order (row_sum). And the keys' Hadamard rotation (kv/quant.py's
 * rotate_keys_) by the same butterflies.
 *
 * This file is compiled without fused multiply-adds: one rounds a product and a sum once, where torch's two ops
 * round each.
 */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include "common.h"

#define F16_TINY 6.103515625e-05f     /* float16's smallest normal number: the least scale (kv/quant.py's TINY) */

static inline uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* f as float16 bits, to nearest even (past float16's range: infinity), as torch converts. */
static uint16_t f16_bits(float f) {
    const uint32_t u = float_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) return (uint16_t)(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);          /* 65520 and up: rounds past 65504 */
    if (a < 0x38800000u)                                               /* subnormal: whole units of 2^-24 */
        return (uint16_t)(sign | (uint32_t)rintf(bits_to_float(a) * 16777216.0f));
    return (uint16_t)(sign | ((a + 0xfffu + ((a >> 13) & 1u) - (112u << 23)) >> 13));
}

/* f as float8_e4m3fn bits, to nearest even, as torch converts (c10's fp8e4m3fn_from_fp32_value). */
static uint8_t fp8_bits(float f) {
    uint32_t bits = float_bits(f);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t out;
    if (bits >= 1087u << 20) {                  /* 480 and up: NaN */
        out = 0x7f;
    } else if (bits < 121u << 23) {
        /* below 2^-6, e4m3's subnormals: added to 2^14, whose float32 unit is their step (2^-9), f is rounded to
         * whole steps in the sum's low bits */
        const uint32_t denorm = 141u << 23;
        out = (uint8_t)(float_bits(bits_to_float(bits) + bits_to_float(denorm)) - denorm);
    } else {
        const uint32_t odd = (bits >> 20) & 1u;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7ffffu + odd;
        out = (uint8_t)(bits >> 20);
    }
    return out | (uint8_t)(sign >> 24);
}

/* The sum of t[0..n) in kv/quant.py's row_sum order: the second half added to the first (an odd one out kept
 * last) until one number is left; t is overwritten. */
static float row_sum(float *t, int n) {
    while (n > 1) {
        const int half = n / 2;
        for (int i = 0; i < half; i++) t[i] = t[i] + t[i + half];
        if (n % 2) t[half] = t[2 * half];
        n = half + n % 2;
    }
    return t[0];
}

/* Int8PerToken and Fp8PerToken's scale of a row: its largest magnitude over `top`, at least F16_TINY, as float16. */
static uint16_t absmax_scale(const float *x, int d, float top) {
    float most = 0.0f;
    for (int i = 0; i < d; i++) most = fabsf(x[i]) > most ? fabsf(x[i]) : most;
    const float s = most / top;
    return f16_bits(s < F16_TINY ? F16_TINY : s);
}

static void int8_row(const float *x, int d, int8_t *q, uint16_t *scale) {
    *scale = absmax_scale(x, d, 127.0f);
    const float s = f16_to_float(*scale);
    for (int i = 0; i < d; i++) {
        const float v = rintf(x[i] / s);
        q[i] = (int8_t)(v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v);
    }
}

static void fp8_row(const float *x, int d, uint8_t *q, uint16_t *scale) {
    *scale = absmax_scale(x, d, 448.0f);
    const float s = f16_to_float(*scale);
    for (int i = 0; i < d; i++) {
        const float v = x[i] / s;
        q[i] = fp8_bits(v < -448.0f ? -448.0f : v > 448.0f ? 448.0f : v);
    }
}

/* Int4.fit's candidate grids: how far each moves its lowest and its highest level inward, in steps of the min-max
 * grid (float32, as torch holds kv/quant.py's inward_steps). */
static const float INWARD[4][2] = {{0.0f, 0.0f}, {0.45f, 0.0f}, {0.0f, 0.45f}, {0.45f, 0.45f}};

/* Int4's encode of a row (d even): of the candidate grids, the one that reconstructs it with the least squared
 * error (the first of equals), stretched so that it comes back unshrunk along itself; its levels two a byte (even
 * channel low), its float16 scale and minimum. */
static void int4_row(const float *x, int d, uint8_t *packed, uint16_t *scale, uint16_t *minimum) {
    float lo = x[0], hi = x[0], q[d], kept[d], t[d], best_err = 0.0f, s = 0.0f, m = 0.0f;
    for (int i = 1; i < d; i++) lo = x[i] < lo ? x[i] : lo, hi = x[i] > hi ? x[i] : hi;
    const float step = (hi - lo) / 15.0f;
    for (int g = 0; g < 4; g++) {
        const float low = lo + INWARD[g][0] * step, high = hi - INWARD[g][1] * step, range = (high - low) / 15.0f;
        const float gs = f16_to_float(f16_bits(range < F16_TINY ? F16_TINY : range)), gm = f16_to_float(f16_bits(low));
        for (int i = 0; i < d; i++) {
            const float v = rintf((x[i] - gm) / gs);
            q[i] = v < 0.0f ? 0.0f : v > 15.0f ? 15.0f : v;
            const float e = (gm + q[i] * gs) - x[i];
            t[i] = e * e;
        }
        const float err = row_sum(t, d);
        if (g == 0 || err < best_err) {
            best_err = err, s = gs, m = gm;
            memcpy(kept, q, sizeof(q));
        }
    }
    for (int i = 0; i < d; i++) t[i] = kept[i] * x[i];
    const float qx = row_sum(t, d);
    memcpy(t, x, sizeof(t));
    const float sum = row_sum(t, d);
    for (int i = 0; i < d; i++) t[i] = x[i] * x[i];
    const float xx = row_sum(t, d);
    const float along = s * qx + m * sum, stretch = along > 0.0f ? xx / along : 1.0f, stretched = s * stretch;
    *scale = f16_bits(stretched < F16_TINY ? F16_TINY : stretched);
    *minimum = f16_bits(m * stretch);
    for (int j = 0; j < d / 2; j++) packed[j] = (uint8_t)((int)kept[2 * j] | (int)kept[2 * j + 1] << 4);
}

/* The key row of KV head h at `slot` as it decodes (x, d floats): full-precision numbers as they are; quantized
 * ones times their scales (int4's plus its minimum), in float32 as kv/quant.py's decode(..., torch.float32). */
static void stored_key(const Cache *c, int h, int64_t slot, float *x) {
    const int d = c->d, bs = c->bs;
    const int64_t block = slot / bs, offset = slot % bs, hb = (int64_t)h * c->nb + block;
    const int64_t at = ((int64_t)h * c->nb + block) * bs + offset;     /* K's row */
    const uint16_t *meta = c->k_meta;
    if (c->kind <= F16) {
        load_row(x, (const char *)c->pages + at * d * elem_size(c->kind), c->kind, d);
    } else if (c->kind == INT8) {
        const int8_t *q = (const int8_t *)c->pages + at * d;
        const float s = f16_to_float(meta[hb * bs + offset]);
        for (int i = 0; i < d; i++) x[i] = (float)q[i] * s;
    } else if (c->kind == FP8) {
        /* kv/quant.py's numbers: the byte's bits at the top of a bfloat16's fields, times 2^120 (exact) */
        const uint8_t *q = (const uint8_t *)c->pages + at * d;
        const float s = f16_to_float(meta[hb * bs + offset]);
        for (int i = 0; i < d; i++) {
            const uint32_t b = q[i];
            x[i] = bits_to_float(((b & 0x80u) << 24) | ((b & 0x7fu) << 20)) * 0x1p120f * s;
        }
    } else {
        const uint8_t *q = (const uint8_t *)c->pages + at * (d / 2);
        const float s = f16_to_float(meta[hb * 2 * bs + offset]), lo = f16_to_float(meta[(hb * 2 + 1) * bs + offset]);
        for (int j = 0; j < d / 2; j++) x[2 * j] = (float)(q[j] & 15) * s + lo, x[2 * j + 1] = (float)(q[j] >> 4) * s + lo;
    }
}

/* f as the largest bfloat16 at most f (down) or the smallest at least f (up): truncated toward zero, then one step
 * away from zero where that moved it the other way (kv/summaries.py's round_down and round_up). */
static uint16_t bf16_toward(float f, int up) {
    const uint32_t u = float_bits(f), negative = u >> 31;
    uint32_t t = u & 0xffff0000u;
    if ((u & 0xffffu) && negative != (uint32_t)up) t += 0x10000u;
    return (uint16_t)(t >> 16);
}

/* The summary of the key just written at `slot` (kv/summaries.py): the block's minimum and maximum take its row in,
 * or start from it at the block's first token. */
static void summarize_key(const Cache *c, int h, int64_t slot) {
    const int d = c->d, fresh = slot % c->bs == 0;
    float x[d];
    stored_key(c, h, slot, x);
    const int64_t at = ((int64_t)h * c->nb + slot / c->bs) * 2 * d;      /* [KVH][NB][2][d] */
    if (c->summary_kind == F32) {
        float *lo = (float *)c->summary + at, *hi = lo + d;
        for (int i = 0; i < d; i++) {
            lo[i] = fresh || x[i] < lo[i] ? x[i] : lo[i];
            hi[i] = fresh || x[i] > hi[i] ? x[i] : hi[i];
        }
        return;
    }
    uint16_t *lo = (uint16_t *)c->summary + at, *hi = lo + d;
    for (int i = 0; i < d; i++) {
        const uint16_t down = bf16_toward(x[i], 0), up = bf16_toward(x[i], 1);
        lo[i] = fresh || bf16_to_float(down) < bf16_to_float(lo[i]) ? down : lo[i];
        hi[i] = fresh || bf16_to_float(up) > bf16_to_float(hi[i]) ? up : hi[i];
    }
}

void store_token(const Cache *c, int which, int h, int64_t slot, const float *row) {
    const int d = c->d, bs = c->bs;
    const int64_t block = slot / bs, offset = slot % bs, hb = (int64_t)h * c->nb + block;
    const int64_t at = (((int64_t)which * c->kvh + h) * c->nb + block) * bs + offset;     /* the row's place */
    char *pages = (char *)c->pages;           /* (const for the attention that reads them) */
    uint16_t *meta = (uint16_t *)(which ? c->v_meta : c->k_meta);
    if (c->kind <= F16) store_row(pages + at * d * elem_size(c->kind), row, c->kind, d);
    else if (c->kind == INT8) int8_row(row, d, (int8_t *)pages + at * d, meta + hb * bs + offset);
    else if (c->kind == FP8) fp8_row(row, d, (uint8_t *)pages + at * d, meta + hb * bs + offset);
    else int4_row(row, d, (uint8_t *)pages + at * (d / 2), meta + hb * 2 * bs + offset,
                  meta + (hb * 2 + 1) * bs + offset);
    if (which == 0 && c->summary) summarize_key(c, h, slot);
}

void rotate_keys_row(float *x, int d, int dtype) {
    const int n = d & -d;
    const float scale = (float)(1.0 / sqrt((double)n));
    for (int span = 1; span < n; span *= 2)
        for (int start = 0; start < d; start += 2 * span)
            for (int i = start; i < start + span; i++) {
                const float a = x[i], b = x[i + span];
                x[i] = a + b, x[i + span] = a - b;
            }
    for (int i = 0; i < d; i++) x[i] = as_dtype(x[i] * scale, dtype);
}
