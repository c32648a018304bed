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
#include "common.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* Rows [0, n) of block `block` of K (which = 0) or V (1), head h, as floats [n][d]: in place where
 * they are float32 already, else converted into `tile`. */
static const float *load_block(const Cache *c, int which, int h, int64_t block, int n, float *tile) {
    const int d = c->d, bs = c->bs;
    if (c->kind <= F16 || (c->residual_of && c->residual_of[block] >= 0)) {
        int kind = c->kind <= F16 ? c->kind : c->residual_kind;
        const char *base = c->kind <= F16 ? c->pages : c->residual;
        int64_t blocks = c->kind <= F16 ? c->nb : c->slots;
        int64_t at = c->kind <= F16 ? block : c->residual_of[block];
        size_t es = elem_size(kind);
        const char *rows = base + ((((int64_t)which * c->kvh + h) * blocks + at) * bs) * d * es;
        if (kind == F32) return (const float *)rows;
        for (int t = 0; t < n; t++) load_row(tile + t * d, rows + (size_t)t * d * es, kind, d);
        return tile;
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
    return tile;
}

/* e[t] = q . rows[t] for the n rows of d numbers. */
static void scores_of(const float *q, const float *rows, int n, int d, float *e) {
#ifdef __AVX512F__
    /* sixteen numbers a step, and each row's sum reduced once (the compiler's `omp simd` reduction
     * adds the lanes one by one: most of the time of a 64-number dot product) */
    for (int t = 0; t < n; t++) {
        const float *k = rows + (size_t)t * d;
        __m512 acc = _mm512_setzero_ps();
        int i = 0;
        for (; i + 16 <= d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), acc);
        if (i < d) {
            const __mmask16 tail = (__mmask16)((1u << (d - i)) - 1);
            acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, q + i), _mm512_maskz_loadu_ps(tail, k + i), acc);
        }
        e[t] = _mm512_reduce_add_ps(acc);
    }
#else
    for (int t = 0; t < n; t++) {
        float s = 0.0f;
        #pragma omp simd reduction(+:s)
        for (int i = 0; i < d; i++) s += q[i] * rows[(size_t)t * d + i];
        e[t] = s;
    }
#endif
}

/* a[i] += sum over t < n of p[t] * rows[t][i], for the d numbers of a. */
static void add_weighted_rows(float *a, const float *p, const float *rows, int n, int d) {
#ifdef __AVX512F__
    /* 64 numbers of a at a time, held in registers across the rows (four chains of additions) */
    for (int i = 0; i < d; i += 64) {
        __mmask16 mask[4];
        __m512 v[4];
        for (int j = 0; j < 4; j++) {
            const int left = d - i - 16 * j;
            mask[j] = left >= 16 ? 0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            v[j] = _mm512_maskz_loadu_ps(mask[j], a + i + 16 * j);
        }
        for (int t = 0; t < n; t++) {
            const __m512 w = _mm512_set1_ps(p[t]);
            const float *r = rows + (size_t)t * d + i;
            for (int j = 0; j < 4; j++) v[j] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(mask[j], r + 16 * j), v[j]);
        }
        for (int j = 0; j < 4; j++) _mm512_mask_storeu_ps(a + i + 16 * j, mask[j], v[j]);
    }
#else
    for (int t = 0; t < n; t++) {
        #pragma omp simd
        for (int i = 0; i < d; i++) a[i] += p[t] * rows[(size_t)t * d + i];
    }
#endif
}

void attend_head(const Cache *c, int h, const int64_t *table, int64_t ctx, const float *q, int groups,
                 float scale, float *out) {
    const int d = c->d, bs = c->bs;
    /* a block's rows can be a whole context (cache_mode "contiguous"): on the heap, not the stack;
     * none for float32 pages, which are read in place */
    float *tile = c->kind == F32 ? NULL : malloc(sizeof(float) * (size_t)bs * d);
    float *scores = malloc(sizeof(float) * (size_t)groups * bs);
    float acc[groups * d], m[groups], l[groups], qs[groups * d];
    memset(acc, 0, sizeof(acc));
    for (int g = 0; g < groups; g++) { m[g] = -INFINITY; l[g] = 0.0f; }
    for (int i = 0; i < groups * d; i++) qs[i] = q[i] * scale;
    for (int64_t start = 0; start < ctx; start += bs) {
        const int64_t block = table[start / bs];
        const int n = ctx - start < bs ? (int)(ctx - start) : bs;
        const float *keys = load_block(c, 0, h, block, n, tile);
        for (int g = 0; g < groups; g++) {
            float *e = scores + g * bs, top = m[g], sum = 0.0f;
            scores_of(qs + g * d, keys, n, d, e);
            #pragma omp simd reduction(max:top)
            for (int t = 0; t < n; t++) top = e[t] > top ? e[t] : top;
            const float correction = expf(m[g] - top);   /* 0 on the first block (m = -inf) */
            l[g] *= correction;
            for (int i = 0; i < d; i++) acc[g * d + i] *= correction;
            #pragma omp simd reduction(+:sum)
            for (int t = 0; t < n; t++) {
                e[t] = exp_nonpositive(e[t] - top);
                sum += e[t];
            }
            l[g] += sum;
            m[g] = top;
        }
        const float *values = load_block(c, 1, h, block, n, tile);
        for (int g = 0; g < groups; g++) add_weighted_rows(acc + g * d, scores + g * bs, values, n, d);
    }
    /* no context (a padding row) leaves l = 0: the output is 0, not 0/0 */
    for (int g = 0; g < groups; g++)
        for (int i = 0; i < d; i++) out[g * d + i] = l[g] > 0.0f ? acc[g * d + i] / l[g] : 0.0f;
    free(tile);
    free(scores);
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
    for (int b = 0; b < num_seqs; b++)
        for (int h = 0; h < kvh; h++) {
            const int64_t at = ((int64_t)b * num_heads + (int64_t)h * groups) * d;
            attend_head(&c, h, block_tables + (int64_t)b * table_width, context_lens[b], q + at, groups, scale,
                        out + at);
        }
}
