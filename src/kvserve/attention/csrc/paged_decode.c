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

/* Rows [0, n) of block `block` of K (which = 0) or V (1), head h, as floats tile[n][d]. */
static void load_block(const Cache *c, int which, int h, int64_t block, int n, float *tile) {
    const int d = c->d, bs = c->bs;
    if (c->kind <= F16 || (c->residual_of && c->residual_of[block] >= 0)) {
        int kind = c->kind <= F16 ? c->kind : c->residual_kind;
        const char *base = c->kind <= F16 ? c->pages : c->residual;
        int64_t blocks = c->kind <= F16 ? c->nb : c->slots;
        int64_t at = c->kind <= F16 ? block : c->residual_of[block];
        size_t es = elem_size(kind);
        const char *rows = base + ((((int64_t)which * c->kvh + h) * blocks + at) * bs) * d * es;
        for (int t = 0; t < n; t++) load_row(tile + t * d, rows + (size_t)t * d * es, kind, d);
        return;
    }
    const int64_t hb = (int64_t)h * c->nb + block;
    const void *meta = which ? c->v_meta : c->k_meta;
    if (c->kind == INT8) {
        const int8_t *rows = (const int8_t *)c->pages + ((((int64_t)which * c->kvh + h) * c->nb + block) * bs) * d;
        const uint16_t *scale = (const uint16_t *)meta + hb * bs;
        for (int t = 0; t < n; t++) {
            float s = f16_to_float(scale[t]);
            for (int i = 0; i < d; i++) tile[t * d + i] = (float)rows[t * d + i] * s;
        }
    } else if (c->kind == FP8) {
        /* An e4m3 byte's exponent and mantissa bits at the top of a float's exponent and mantissa
         * fields are the same number times 2^-120 (subnormals included); times 2^120 (exact) it is
         * the number, then times the block's scale. */
        const uint8_t *rows = (const uint8_t *)c->pages + ((((int64_t)which * c->kvh + h) * c->nb + block) * bs) * d;
        float s = ((const float *)meta)[hb];
        for (int t = 0; t < n; t++)
            for (int i = 0; i < d; i++) {
                uint32_t b = rows[t * d + i], bits = ((b & 0x80u) << 24) | ((b & 0x7fu) << 20);
                tile[t * d + i] = bits_to_float(bits) * 0x1p120f * s;
            }
    } else {   /* INT4 */
        const int half = d / 2;
        const uint8_t *rows = (const uint8_t *)c->pages + ((((int64_t)which * c->kvh + h) * c->nb + block) * bs) * half;
        if (which == 0) {                /* per channel of the block: (scale, min) [2][D] */
            const uint16_t *m = (const uint16_t *)meta + hb * 2 * d;
            float scale[d], minimum[d];
            for (int i = 0; i < d; i++) { scale[i] = f16_to_float(m[i]); minimum[i] = f16_to_float(m[d + i]); }
            for (int t = 0; t < n; t++)
                for (int j = 0; j < half; j++) {
                    uint8_t b = rows[t * half + j];
                    tile[t * d + 2 * j] = (float)(b & 15) * scale[2 * j] + minimum[2 * j];
                    tile[t * d + 2 * j + 1] = (float)(b >> 4) * scale[2 * j + 1] + minimum[2 * j + 1];
                }
        } else {                         /* per token: (scale, min) [2][BS] */
            const uint16_t *m = (const uint16_t *)meta + hb * 2 * bs;
            for (int t = 0; t < n; t++) {
                float s = f16_to_float(m[t]), lo = f16_to_float(m[bs + t]);
                for (int j = 0; j < half; j++) {
                    uint8_t b = rows[t * half + j];
                    tile[t * d + 2 * j] = (float)(b & 15) * s + lo;
                    tile[t * d + 2 * j + 1] = (float)(b >> 4) * s + lo;
                }
            }
        }
    }
}

/* out[b][h * G + g][:] = softmax(q . K^T * scale) V for each decoding sequence b (fp32 q and out). */
void paged_decode(const float *q, float *out, int num_seqs, int num_heads, const int64_t *block_tables,
                  int table_width, const int64_t *context_lens, float scale,
                  const void *pages, int kind, int kvh, int nb, int bs, int d,
                  const void *k_meta, const void *v_meta,
                  const void *residual, int residual_kind, int slots, const int64_t *residual_of) {
    const Cache c = {pages, residual, k_meta, v_meta, residual_of, kind, residual_kind, kvh, nb, bs, d, slots};
    const int groups = num_heads / kvh;
    #pragma omp parallel for collapse(2) schedule(dynamic)
    for (int b = 0; b < num_seqs; b++) {
        for (int h = 0; h < kvh; h++) {
            /* a block's rows can be a whole context (cache_mode "contiguous"): on the heap, not the stack */
            float *tile = malloc(sizeof(float) * (size_t)bs * d), *scores = malloc(sizeof(float) * (size_t)groups * bs);
            float acc[groups * d], m[groups], l[groups];
            memset(acc, 0, sizeof(acc));
            for (int g = 0; g < groups; g++) { m[g] = -INFINITY; l[g] = 0.0f; }
            const float *qh = q + ((int64_t)b * num_heads + (int64_t)h * groups) * d;
            const int64_t ctx = context_lens[b];
            for (int64_t start = 0; start < ctx; start += bs) {
                const int64_t block = block_tables[(int64_t)b * table_width + start / bs];
                const int n = ctx - start < bs ? (int)(ctx - start) : bs;
                load_block(&c, 0, h, block, n, tile);
                for (int g = 0; g < groups; g++) {
                    float *e = scores + g * bs, top = m[g], sum = 0.0f;
                    for (int t = 0; t < n; t++) {
                        float s = 0.0f;
                        #pragma omp simd reduction(+:s)
                        for (int i = 0; i < d; i++) s += qh[g * d + i] * tile[t * d + i];
                        e[t] = s * scale;
                        top = e[t] > top ? e[t] : top;
                    }
                    const float correction = expf(m[g] - top);   /* 0 on the first block (m = -inf) */
                    l[g] *= correction;
                    for (int i = 0; i < d; i++) acc[g * d + i] *= correction;
                    for (int t = 0; t < n; t++) e[t] = expf(e[t] - top);
                    #pragma omp simd reduction(+:sum)
                    for (int t = 0; t < n; t++) sum += e[t];
                    l[g] += sum;
                    m[g] = top;
                }
                load_block(&c, 1, h, block, n, tile);
                for (int g = 0; g < groups; g++)
                    for (int t = 0; t < n; t++) {
                        const float p = scores[g * bs + t];
                        for (int i = 0; i < d; i++) acc[g * d + i] += p * tile[t * d + i];
                    }
            }
            for (int g = 0; g < groups; g++) {
                float *o = out + ((int64_t)b * num_heads + (int64_t)h * groups + g) * d;
                for (int i = 0; i < d; i++) o[i] = acc[g * d + i] / l[g];
            }
            free(tile);
            free(scores);
        }
    }
}
