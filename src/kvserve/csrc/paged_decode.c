#include "paged_decode.h"

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

void attend_head(const Cache *c, int h, const int64_t *table, int64_t ctx, const float *q, int groups,
                 float scale, float *out) {
    const int d = c->d, bs = c->bs;
    /* a block's rows can be a whole context (cache_mode "contiguous"): on the heap, not the stack */
    float *tile = malloc(sizeof(float) * (size_t)bs * d), *scores = malloc(sizeof(float) * (size_t)groups * bs);
    float acc[groups * d], m[groups], l[groups];
    memset(acc, 0, sizeof(acc));
    for (int g = 0; g < groups; g++) { m[g] = -INFINITY; l[g] = 0.0f; }
    for (int64_t start = 0; start < ctx; start += bs) {
        const int64_t block = table[start / bs];
        const int n = ctx - start < bs ? (int)(ctx - start) : bs;
        load_block(c, 0, h, block, n, tile);
        for (int g = 0; g < groups; g++) {
            float *e = scores + g * bs, top = m[g], sum = 0.0f;
            for (int t = 0; t < n; t++) {
                float s = 0.0f;
                #pragma omp simd reduction(+:s)
                for (int i = 0; i < d; i++) s += q[g * d + i] * tile[t * d + i];
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
        load_block(c, 1, h, block, n, tile);
        for (int g = 0; g < groups; g++)
            for (int t = 0; t < n; t++) {
                const float p = scores[g * bs + t];
                for (int i = 0; i < d; i++) acc[g * d + i] += p * tile[t * d + i];
            }
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
