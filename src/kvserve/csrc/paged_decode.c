/* Paged decode attention on the CPU: one query token per sequence against its cached K/V, read
 * page by page through the block table and dequantized as they are read (never gathered into a
 * contiguous copy, never dequantized whole). One task per (sequence, KV head): its G query heads
 * share every K/V row it reads. Online softmax (FlashAttention's recurrence) over steps of a few
 * blocks. Prefill runs the same tasks over tiles of a prompt's tokens (paged_prefill), with the rows of
 * tiles of 16 or more in the lanes of vectors (attend_tile); decode over bfloat16 pages puts keys there
 * instead (attend_one). A layer with a sliding window W attends to the
 * last W positions only (keys (p - W, p] of the query at p): the tasks start at the block of the window's
 * first key, and mask the keys before it; soft-capped scores (Gemma 2) become cap * tanh(s / cap).
 *
 * Pages are [2][KVH][NB][BS][row] with K at 0 and V at 1. `kind` says what a row holds:
 *   F32, BF16, F16: full-precision numbers;
 *   INT8: int8 numbers, one fp16 scale per (head, block, token)        meta [KVH][NB][BS];
 *   FP8:  e4m3 bytes, one fp16 scale per (head, block, token)          meta [KVH][NB][BS];
 *   INT4: two numbers a byte (even channel low), fp16 (scale, min) per (head, block, token)
 *         meta [KVH][NB][2][BS].
 */
#include "common.h"

/* bfloat16 rows read in place, widened as loaded (needs AVX-512's 16-bit masked loads) */
#if AVX512_BW_VL
#define RAW_BF16 1
#else
#define RAW_BF16 0
#endif

/* A block's rows as the arithmetic reads them: floats [n][d], or (RAW_BF16) bfloat16 numbers read
 * where they are, widened as they are loaded. */
typedef struct {
    const void *p;
    int bf16;
} Rows;

/* Rows [0, n) of block `block` of K (which = 0) or V (1), head h: in place where they are float32 (or
 * bfloat16, RAW_BF16), else converted into `tile`. */
static Rows load_block(const Cache *c, int which, int h, int64_t block, int n, float *tile) {
    const int d = c->d, bs = c->bs;
    if (c->kind <= F16) {
        const size_t es = elem_size(c->kind);
        const char *rows = (const char *)c->pages + ((((int64_t)which * c->kvh + h) * c->nb + block) * bs) * d * es;
        if (c->kind == F32) return (Rows){rows, 0};
#if RAW_BF16
        if (c->kind == BF16) return (Rows){rows, 1};
#endif
        for (int t = 0; t < n; t++) load_row(tile + t * d, rows + (size_t)t * d * es, c->kind, d);
        return (Rows){tile, 0};
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
        const uint16_t *scale = (const uint16_t *)meta + hb * bs;
        for (int t = 0; t < n; t++) {
            float s = f16_to_float(scale[t]);
            for (int i = 0; i < d; i++) {
                uint32_t b = rows[t * d + i], bits = ((b & 0x80u) << 24) | ((b & 0x7fu) << 20);
                tile[t * d + i] = bits_to_float(bits) * 0x1p120f * s;
            }
        }
    } else {   /* INT4: (scale, min) [2][BS] */
        const int half = d / 2;
        const uint8_t *rows = (const uint8_t *)c->pages + ((((int64_t)which * c->kvh + h) * c->nb + block) * bs) * half;
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
    return (Rows){tile, 0};
}

/* Asks for the rows of block `block` of K and V, head h, ahead of their use: a block is a few KiB on
 * its own page, so the hardware prefetchers, which stop at page boundaries, never run ahead into
 * it, and each block would otherwise start with a wait on memory. Only the first 16 KiB of a long
 * block (cache_mode "contiguous"): the hardware runs ahead within it. `next`: the block after the one
 * attended to, asked for into L1; else the one after that, asked for into L2 (as non-temporal, it measured
 * a third slower over pages out of cache: docs/kernels.md). Always inlined: GCC drops calls to a function
 * that only prefetches, as having no effect. */
static inline __attribute__((always_inline)) void prefetch_block(const Cache *c, int h, int64_t block,
                                                                 const int next) {
    const int quantized = c->kind > F16;
    const size_t row = quantized ? (c->kind == INT4 ? (size_t)c->d / 2 : (size_t)c->d)
                                 : (size_t)c->d * elem_size(c->kind);
    const size_t bytes = row * c->bs, ask = bytes < 16384 ? bytes : 16384;
    for (int which = 0; which < 2; which++) {
        const char *rows = (const char *)c->pages + (((int64_t)which * c->kvh + h) * c->nb + block) * bytes;
        for (size_t at = 0; at < ask; at += 64) {
            if (next) __builtin_prefetch(rows + at, 0, 3);
            else __builtin_prefetch(rows + at, 0, 2);
        }
    }
}

#ifdef __AVX512F__
/* Sixteen numbers of a block's rows from number `at` on, as floats (lanes outside `mask`: 0). */
static inline __attribute__((always_inline)) __m512 row16(const void *rows, size_t at, __mmask16 mask, const int bf16) {
#if RAW_BF16
    return load16(rows, at, mask, bf16 ? BF16 : F32);
#else
    (void)bf16;
    return _mm512_maskz_loadu_ps(mask, (const float *)rows + at);
#endif
}

/* The sums of acc[0..15] across their lanes, lane i holding acc[i]'s: a transpose-and-add tree of 15
 * additions (reducing each vector alone takes 4 additions and 4 shuffles). */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 acc[16]) {
    __m512 half[8], quarter[4], eighth[2];
    for (int i = 0; i < 8; i++)      /* in each 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 */
        half[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                                _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
    for (int i = 0; i < 4; i++)      /* in each 128-bit lane: that lane's sums of four rows */
        quarter[i] = _mm512_add_ps(_mm512_shuffle_ps(half[2 * i], half[2 * i + 1], 0x44),
                                   _mm512_shuffle_ps(half[2 * i], half[2 * i + 1], 0xee));
    for (int i = 0; i < 2; i++)      /* lanes 0+1 and 2+3, of two vectors */
        eighth[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quarter[2 * i], quarter[2 * i + 1], 0x88),
                                  _mm512_shuffle_f32x4(quarter[2 * i], quarter[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(eighth[0], eighth[1], 0x88),
                         _mm512_shuffle_f32x4(eighth[0], eighth[1], 0xdd));
}

/* e[t] = q . rows[t0 + t] for m <= 16 rows: each row's products summed in a vector, then the sixteen
 * vectors summed across their lanes together (sum16). */
static inline __attribute__((always_inline)) void scores16(const float *q, const void *rows, int t0, int m, int d,
                                                           float *e, const int bf16) {
    const int chunks = (d + 15) / 16;
    const __mmask16 tail = d % 16 ? (__mmask16)((1u << (d % 16)) - 1) : 0xffff;
    __m512 acc[16];
    for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
    for (int c = 0; c < chunks; c++) {
        const __mmask16 mask = c == chunks - 1 ? tail : 0xffff;
        const __m512 qc = _mm512_maskz_loadu_ps(mask, q + c * 16);
        for (int t = 0; t < m; t++)
            acc[t] = _mm512_fmadd_ps(qc, row16(rows, (size_t)(t0 + t) * d + c * 16, mask, bf16), acc[t]);
    }
    _mm512_mask_storeu_ps(e + t0, (__mmask16)((1u << m) - 1), sum16(acc));
}
#endif

/* e[t] = q . rows[t] for the n rows of d numbers. */
static void scores_of(const float *q, Rows rows, int n, int d, float *e) {
#ifdef __AVX512F__
    int t = 0;
    if (rows.bf16) {
        for (; t + 16 <= n; t += 16) scores16(q, rows.p, t, 16, d, e, 1);   /* unrolled */
        if (t < n) scores16(q, rows.p, t, n - t, d, e, 1);
    } else {
        for (; t + 16 <= n; t += 16) scores16(q, rows.p, t, 16, d, e, 0);
        if (t < n) scores16(q, rows.p, t, n - t, d, e, 0);
    }
#else
    const float *r = rows.p;
    for (int t = 0; t < n; t++) {
        float s = 0.0f;
        #pragma omp simd reduction(+:s)
        for (int i = 0; i < d; i++) s += q[i] * r[(size_t)t * d + i];
        e[t] = s;
    }
#endif
}


#if RAW_BF16 && defined(__AVX512BF16__)
#define DOT_BF16 1
/* Numbers [32c, 32c + 32) of a bfloat16 row of d, as pairs for _mm512_dpbf16_ps (past d: 0). */
static inline __attribute__((always_inline)) __m512bh pairs32(const uint16_t *row, int c, int d) {
    const int left = d - 32 * c;
    return (__m512bh)(left >= 32 ? _mm512_loadu_si512(row + 32 * c)
                                 : _mm512_maskz_loadu_epi16((__mmask32)((1u << left) - 1), row + 32 * c));
}

/* e[r][t] = scale * q[r] . k[t] for the query rows r < rows (bfloat16, d apart) and the keys t < n of a
 * block of bfloat16 rows, four rows and four keys at a time, so that each key's numbers are loaded once
 * for four rows and multiplied in pairs by AVX-512 BF16 (whose products of two bfloat16 numbers are
 * exact in float32, as the widened ones are), where scores_of widens each key's numbers again for each
 * row. The scale multiplies the sums, not q, which is then the model's bfloat16 numbers as they are. */
static void scores_bf16(const uint16_t *qb, int rows, const uint16_t *k, int n, int d, float scale, float *e,
                        int stride) {
    const int chunks = (d + 31) / 32;
    const __m512 s = _mm512_set1_ps(scale);
    for (int r0 = 0; r0 < rows; r0 += 4) {
        const uint16_t *q[4];
        for (int r = 0; r < 4; r++) q[r] = qb + (size_t)(r0 + r < rows ? r0 + r : r0) * d;
        for (int t0 = 0; t0 < n; t0 += 4) {
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            for (int c = 0; c < chunks; c++) {
                __m512bh kc[4];
                for (int j = 0; j < 4; j++) kc[j] = pairs32(k + (size_t)(t0 + j < n ? t0 + j : t0) * d, c, d);
                for (int r = 0; r < 4; r++) {
                    const __m512bh qc = pairs32(q[r], c, d);
                    for (int j = 0; j < 4; j++) acc[4 * r + j] = _mm512_dpbf16_ps(acc[4 * r + j], qc, kc[j]);
                }
            }
            const __m512 sums = _mm512_mul_ps(sum16(acc), s);
            const __mmask8 m = (__mmask8)(n - t0 >= 4 ? 15 : (1u << (n - t0)) - 1);
            float *at = e + (size_t)r0 * stride + t0;
            _mm_mask_storeu_ps(at, m, _mm512_extractf32x4_ps(sums, 0));
            if (r0 + 1 < rows) _mm_mask_storeu_ps(at + stride, m, _mm512_extractf32x4_ps(sums, 1));
            if (r0 + 2 < rows) _mm_mask_storeu_ps(at + 2 * stride, m, _mm512_extractf32x4_ps(sums, 2));
            if (r0 + 3 < rows) _mm_mask_storeu_ps(at + 3 * stride, m, _mm512_extractf32x4_ps(sums, 3));
        }
    }
}
#else
#define DOT_BF16 0
#endif

/* One block of the online softmax for each of `rows` query rows: the scores from[r] to valid[r] of the
 * block's scores of row r (at e + r * stride; the causal mask hides the rest, a sliding window those
 * before) become their exponentials less its running maximum m[r], which rises to include them, and
 * their sum joins l[r]; the rest of its n become 0. correction[r] is the factor by which its sums over earlier blocks shrink (about 1e-38,
 * as good as 0, on its first block, where m[r] is -inf). Each step runs for all rows before the next,
 * so that the rows' chains of dependent operations overlap. */
static void softmax_block(float *e, int stride, int n, int rows, const int *from, const int *valid, float *m,
                          float *l, float *correction) {
    float new_max[rows], block_sum[rows];
#ifdef __AVX512F__
    for (int r = 0; r < rows; r++) {
        __m512 top = _mm512_set1_ps(m[r]);
        for (int t = from[r] & ~15; t < valid[r]; t += 16) {
            const __mmask16 mask = lanes16(valid[r] - t) & ~lanes16(from[r] - t);
            top = _mm512_mask_max_ps(top, mask, top, _mm512_maskz_loadu_ps(mask, e + r * stride + t));
        }
        new_max[r] = _mm512_reduce_max_ps(top);
    }
    for (int r = 0; r < rows; r++) {
        const __m512 shift = _mm512_set1_ps(new_max[r]);
        __m512 sum = _mm512_setzero_ps();
        for (int t = 0; t < n; t += 16) {
            const __mmask16 mask = lanes16(n - t), kept = lanes16(valid[r] - t) & ~lanes16(from[r] - t);
            float *at = e + r * stride + t;
            const __m512 p = _mm512_maskz_mov_ps(kept, exp16_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(kept, at),
                                                                                       shift)));
            _mm512_mask_storeu_ps(at, mask, p);
            sum = _mm512_add_ps(sum, p);
        }
        block_sum[r] = _mm512_reduce_add_ps(sum);
    }
#else
    for (int r = 0; r < rows; r++) {
        float *s = e + r * stride, top = m[r], sum = 0.0f;
        const int lo = from[r], kept = valid[r];
        #pragma omp simd reduction(max:top)
        for (int t = lo; t < kept; t++) top = s[t] > top ? s[t] : top;
        #pragma omp simd reduction(+:sum)
        for (int t = lo; t < kept; t++) {
            s[t] = exp_nonpositive(s[t] - top);
            sum += s[t];
        }
        for (int t = 0; t < lo && t < n; t++) s[t] = 0.0f;
        for (int t = kept > lo ? kept : lo; t < n; t++) s[t] = 0.0f;
        new_max[r] = top, block_sum[r] = sum;
    }
#endif
    for (int r = 0; r < rows; r++) {
        /* a row that has seen no key yet (-inf both) has nothing to shrink; -inf - -inf would be NaN */
        correction[r] = new_max[r] == -INFINITY ? 1.0f : exp_nonpositive(m[r] - new_max[r]);
        l[r] = l[r] * correction[r] + block_sum[r];
        m[r] = new_max[r];
    }
}

#ifdef __AVX512F__
/* acc[g][i] += sum over t < n of p[g * p_g + t * p_t] * rows[t][i] for G (a constant, at most 6) query
 * heads g, 64 numbers i at a time: each row is loaded once for all G heads, and the G x 4 sums stay in
 * registers across the rows. shrink (or NULL): factors of the sums so far, acc[g] *= shrink[g] first. */
static inline __attribute__((always_inline)) void add_weighted_rows_of(float *acc, const float *p, int64_t p_g,
                                                                      int64_t p_t, const void *rows, int n, int d,
                                                                      const int G, const int bf16,
                                                                      const float *shrink) {
    for (int i = 0; i < d; i += 64) {
        __mmask16 mask[4];
        __m512 v[6][4];
        for (int j = 0; j < 4; j++) {
            mask[j] = lanes16(d - i - 16 * j);
            for (int g = 0; g < G; g++) {
                v[g][j] = _mm512_maskz_loadu_ps(mask[j], acc + (size_t)g * d + i + 16 * j);
                if (shrink) v[g][j] = _mm512_mul_ps(v[g][j], _mm512_set1_ps(shrink[g]));
            }
        }
        for (int t = 0; t < n; t++) {
            __m512 r[4];
            for (int j = 0; j < 4; j++) r[j] = row16(rows, (size_t)t * d + i + 16 * j, mask[j], bf16);
            for (int g = 0; g < G; g++) {
                const __m512 w = _mm512_set1_ps(p[g * p_g + t * p_t]);
                for (int j = 0; j < 4; j++) v[g][j] = _mm512_fmadd_ps(w, r[j], v[g][j]);
            }
        }
        for (int j = 0; j < 4; j++)
            for (int g = 0; g < G; g++) {
                float *at = acc + (size_t)g * d + i + 16 * j;
                if (mask[j] == 0xffff) _mm512_storeu_ps(at, v[g][j]);   /* masked stores do not forward to loads */
                else _mm512_mask_storeu_ps(at, mask[j], v[g][j]);
            }
    }
}
#endif

/* acc[g][i] += sum over t < n of p[g][t] * rows[t][i], for the d numbers i of each of `groups` query
 * heads (acc [groups][d], p [groups][p_stride]); shrink (or NULL): acc[g] *= shrink[g] first. */
static void add_weighted_rows(float *acc, const float *p, int p_stride, Rows rows, int n, int d, int groups,
                              const float *shrink) {
#ifdef __AVX512F__
    for (int g = 0; g < groups;) {
        const int G = groups - g >= 4 ? 4 : groups - g >= 2 ? 2 : 1;
        float *a = acc + (size_t)g * d;
        const float *pg = p + (size_t)g * p_stride, *sg = shrink ? shrink + g : NULL;
        if (rows.bf16) {
            if (G == 4) add_weighted_rows_of(a, pg, p_stride, 1, rows.p, n, d, 4, 1, sg);
            else if (G == 2) add_weighted_rows_of(a, pg, p_stride, 1, rows.p, n, d, 2, 1, sg);
            else add_weighted_rows_of(a, pg, p_stride, 1, rows.p, n, d, 1, 1, sg);
        } else {
            if (G == 4) add_weighted_rows_of(a, pg, p_stride, 1, rows.p, n, d, 4, 0, sg);
            else if (G == 2) add_weighted_rows_of(a, pg, p_stride, 1, rows.p, n, d, 2, 0, sg);
            else add_weighted_rows_of(a, pg, p_stride, 1, rows.p, n, d, 1, 0, sg);
        }
        g += G;
    }
#else
    const float *r = rows.p;
    for (int g = 0; g < groups; g++) {
        if (shrink)
            for (int i = 0; i < d; i++) acc[(size_t)g * d + i] *= shrink[g];
        for (int t = 0; t < n; t++) {
            #pragma omp simd
            for (int i = 0; i < d; i++) acc[(size_t)g * d + i] += p[(size_t)g * p_stride + t] * r[(size_t)t * d + i];
        }
    }
#endif
}

/* v clamped to [0, n]: keys of n that a query row sees, or rows of a block that a step reads. */
static inline int upto(int64_t v, int n) { return v <= 0 ? 0 : v < n ? (int)v : n; }

/* cap * tanh(s / cap). tanh(x) = sign(x) (1 - e) / (1 + e) with e = e^(-2|x|), where |x| >= 1/8 (1 - e loses
 * at most two bits there); below, its series to x^7 (the next term, 62/2835 x^9, is under 2e-10). */
static inline float soft_cap1(float s, float cap) {
    const float x = s / cap, a = fabsf(x);
    if (a < 0.125f) {
        const float x2 = x * x;
        return cap * x * (1.0f + x2 * (-1.0f / 3 + x2 * (2.0f / 15 + x2 * (-17.0f / 315))));
    }
    const float e = exp_nonpositive(-2.0f * a);
    return copysignf(cap * (1.0f - e) / (1.0f + e), x);
}

#ifdef __AVX512F__
/* soft_cap1 of sixteen scores. */
static inline __m512 soft_cap16(__m512 s, float cap) {
    const __m512 c = _mm512_set1_ps(cap), one = _mm512_set1_ps(1.0f), x = _mm512_div_ps(s, c);
    const __m512 a = _mm512_abs_ps(x), x2 = _mm512_mul_ps(x, x);
    __m512 series = _mm512_fmadd_ps(x2, _mm512_set1_ps(-17.0f / 315), _mm512_set1_ps(2.0f / 15));
    series = _mm512_fmadd_ps(x2, series, _mm512_set1_ps(-1.0f / 3));
    series = _mm512_mul_ps(a, _mm512_fmadd_ps(x2, series, one));
    const __m512 e = exp16_nonpositive(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
    const __m512 big = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __m512 t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.125f), _CMP_LT_OQ), big, series);
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u));
    return _mm512_mul_ps(c, _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign)));
}
#endif

/* The soft cap on the scores each row sees (row r: from[r] to valid[r], at e + r * stride). */
static void cap_scores(float *e, int stride, int rows, const int *from, const int *valid, float cap) {
    for (int r = 0; r < rows; r++) {
        float *s = e + (size_t)r * stride;
#ifdef __AVX512F__
        for (int t = from[r]; t < valid[r]; t += 16) {
            const __mmask16 m = lanes16(valid[r] - t);
            _mm512_mask_storeu_ps(s + t, m, soft_cap16(_mm512_maskz_loadu_ps(m, s + t), cap));
        }
#else
        for (int t = from[r]; t < valid[r]; t++) s[t] = soft_cap1(s[t], cap);
#endif
    }
}

/* Keys an online-softmax step takes (whole blocks; one where a block is longer): its per-step work
 * (maxima, rescaling the sums) over more keys: 64 keys (four blocks of 16) against one block. */
#define SEGMENT 64

/* The first block that a task's rows see: of the first row's window (its tokens - 1 keys before the last
 * row's, which sees ctx), or 0. */
static inline int64_t first_block(int64_t ctx, int tokens, int64_t window, int bs) {
    const int64_t first_key = ctx - tokens + 1 - window;
    return window && first_key > 0 ? first_key / bs : 0;
}

/* The query rows of a task (row r: token r / groups, head r % groups of q, `kind` F32 or BF16): as
 * float32 times the scale, for scores_of; and (DOT_BF16) as bfloat16, unscaled, for scores_bf16. */
typedef struct {
    float *scaled;
    uint16_t *bf16;
} Queries;

#if DOT_BF16
/* The rows as bfloat16 into qb; 0 where a number of them is not one (q of a float32 model). */
static int bf16_queries(const void *q, int kind, int64_t q_stride, int rows, int groups, int d, uint16_t *qb) {
    uint32_t rest = 0;          /* the low halves of float32 numbers: bfloat16 ones have none */
    for (int r = 0; r < rows; r++) {
        const int64_t at = (r / groups) * q_stride + (r % groups) * d;
        uint16_t *row = qb + (size_t)r * d;
        if (kind == BF16) {
            memcpy(row, (const uint16_t *)q + at, sizeof(uint16_t) * d);
            continue;
        }
        for (int i = 0; i < d; i++) {
            uint32_t bits;
            memcpy(&bits, (const float *)q + at + i, 4);
            rest |= bits & 0xffffu;
            row[i] = (uint16_t)(bits >> 16);
        }
    }
    return !rest;
}
#endif

/* The task's query rows into qs (free both); -1 (and none) where memory for them ran out. */
static int queries(const Cache *c, const void *q, int kind, int64_t q_stride, int rows, int groups, float scale,
                   Queries *qs) {
    const int d = c->d;
    *qs = (Queries){NULL, NULL};
#if DOT_BF16
    if (c->kind == BF16) {
        qs->bf16 = malloc(sizeof(uint16_t) * (size_t)rows * d);
        if (!qs->bf16) return -1;
        if (!bf16_queries(q, kind, q_stride, rows, groups, d, qs->bf16)) free(qs->bf16), qs->bf16 = NULL;
    }
    if (qs->bf16 && c->kind == BF16) return 0;      /* every block is scored in pairs */
#endif
    qs->scaled = malloc(sizeof(float) * (size_t)rows * d);
    if (!qs->scaled) {
        free(qs->bf16), qs->bf16 = NULL;
        return -1;
    }
    for (int r = 0; r < rows; r++) {
        float *row = qs->scaled + (size_t)r * d;
        load_row(row, (const char *)q + ((r / groups) * q_stride + (r % groups) * d) * elem_size(kind), kind, d);
        for (int i = 0; i < d; i++) row[i] *= scale;
    }
    return 0;
}

/* scores[r][t] = scale * q[r] . K[t] for the n keys of a block (at t0 of the step's scores), and the
 * query rows that see any of them (row r: the first seen[r] keys, from the block's first on). */
static void score_block(const Queries *qs, Rows keys, int n, int d, int rows, const int64_t *seen, float scale,
                        float *scores, int stride) {
#if DOT_BF16
    if (keys.bf16 && qs->bf16) {
        scores_bf16(qs->bf16, rows, keys.p, n, d, scale, scores, stride);
        return;
    }
#else
    (void)scale;
#endif
    for (int r = 0; r < rows; r++) {
        const int v = upto(seen[r], n);
        if (v) scores_of(qs->scaled + (size_t)r * d, keys, v, d, scores + (size_t)r * stride);
    }
}

#if AVX512_BW_VL
/* Prefill tiles (16 rows or more) with their rows in the lanes of vectors (RV of them, at most 4):
 * scores as st[t][r] = q[r] . k[t], each key's numbers broadcast against the rows' packed numbers
 * (qt), so that a key's scores for sixteen rows are one vector, summed along d without reductions across
 * lanes; the softmax then runs down the lanes too, and the products with V go six rows at a time over
 * the step's keys (bfloat16: by pairs of keys). The rows' dot products with each key (attend_rows) need a
 * reduction across lanes per key and row, and a softmax across lanes: tiles of many rows avoid both. */
#define TILE_LANES 64

/* st[t][r] for the n keys of a block (rows [n][d] of float32, or bfloat16 scored by pairs), four keys
 * at a time; qt: the rows' numbers (float32: scaled; pairs: unscaled, the sums scaled), [d or d/2][16 RV]. */
static inline __attribute__((always_inline)) void scores_t(const void *qt, const void *keys, int n, int d,
                                                          float scale, float *st, const int RV, const int pairs) {
    const int lanes = 16 * RV, depth = pairs ? d / 2 : d;
    for (int t0 = 0; t0 < n; t0 += 4) {
        const int nk = n - t0 < 4 ? n - t0 : 4;
        __m512 acc[4][4];
        const uint32_t *k[4];
        for (int j = 0; j < 4; j++) {
            k[j] = (const uint32_t *)((const char *)keys + (size_t)(t0 + (j < nk ? j : 0)) * d * (pairs ? 2 : 4));
            for (int v = 0; v < RV; v++) acc[j][v] = _mm512_setzero_ps();
        }
        for (int i = 0; i < depth; i++) {
            __m512 q[4];
            for (int v = 0; v < RV; v++) q[v] = _mm512_loadu_ps((const float *)qt + (size_t)i * lanes + 16 * v);
            for (int j = 0; j < 4; j++) {
                const __m512 kb = _mm512_castsi512_ps(_mm512_set1_epi32((int)k[j][i]));
                for (int v = 0; v < RV; v++)
#if defined(__AVX512BF16__)
                    acc[j][v] = pairs ? _mm512_dpbf16_ps(acc[j][v], (__m512bh)kb, (__m512bh)q[v])
                                      : _mm512_fmadd_ps(kb, q[v], acc[j][v]);
#else
                    acc[j][v] = _mm512_fmadd_ps(kb, q[v], acc[j][v]);
#endif
            }
        }
        for (int j = 0; j < nk; j++)
            for (int v = 0; v < RV; v++)
                _mm512_storeu_ps(st + (size_t)(t0 + j) * lanes + 16 * v,
                                 pairs ? _mm512_mul_ps(acc[j][v], _mm512_set1_ps(scale)) : acc[j][v]);
    }
}

static void scores_t_rv(int rv, const void *qt, const void *keys, int n, int d, float scale, float *st, int pairs) {
#define RV_CASE(R) case R: if (pairs) scores_t(qt, keys, n, d, scale, st, R, 1); \
                           else scores_t(qt, keys, n, d, scale, st, R, 0); break;
    switch (rv) { RV_CASE(1) RV_CASE(2) RV_CASE(3) RV_CASE(4) }
#undef RV_CASE
}

/* Which of the sixteen rows of `sees` and `from` see key t: from <= t < sees. */
static inline __mmask16 sees_key(__m512i from, __m512i sees, int t) {
    const __m512i at = _mm512_set1_epi32(t);
    return _mm512_cmpgt_epi32_mask(sees, at) & _mm512_cmple_epi32_mask(from, at);
}

/* The online softmax over a step's n keys, rows in lanes: row r sees keys from[r] <= t < sees[r] (lanes of
 * the RV vectors); st becomes the exponentials (0 where unseen), m, l the running maxima and sums, corr the
 * factors by which the sums so far shrink. */
static void softmax_t(float *st, int n, int rv, const __m512i from[4], const __m512i sees[4], __m512 m[4],
                      __m512 l[4], __m512 corr[4]) {
    const int lanes = 16 * rv;
    for (int v = 0; v < rv; v++) {
        __m512 top = m[v];
        for (int t = 0; t < n; t++) {
            const __mmask16 seen = sees_key(from[v], sees[v], t);
            top = _mm512_mask_max_ps(top, seen, top, _mm512_loadu_ps(st + (size_t)t * lanes + 16 * v));
        }
        /* a row that has seen no key yet (-inf): shifted by 0, not by -inf (-inf - -inf is NaN) */
        const __m512 shift = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(top, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                                                  top, _mm512_setzero_ps());
        __m512 sum = _mm512_setzero_ps();
        for (int t = 0; t < n; t++) {
            const __mmask16 seen = sees_key(from[v], sees[v], t);
            float *at = st + (size_t)t * lanes + 16 * v;
            const __m512 p = _mm512_maskz_mov_ps(seen, exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(at), shift)));
            _mm512_storeu_ps(at, p);
            sum = _mm512_add_ps(sum, p);
        }
        corr[v] = exp16_nonpositive(_mm512_sub_ps(m[v], shift));
        l[v] = _mm512_fmadd_ps(l[v], corr[v], sum);
        m[v] = top;
    }
}

/* The 16 x 16 32-bit numbers of r[0..15] transposed in place (lane j of r[i] becomes lane i of r[j]). */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 16; i += 2) {
        a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4)
        for (int j = 0; j < 2; j++) {
            b[i + j] = _mm512_unpacklo_epi64(a[i + j], a[i + j + 2]);
            b[i + j + 2] = _mm512_unpackhi_epi64(a[i + j], a[i + j + 2]);
        }
    /* b[4g + (0, 2, 1, 3)[c]]: rows 4g..4g+3 of column 4k + c in 128-bit lane k; the lanes then move as a 4 x 4 */
    static const int at[4] = {0, 2, 1, 3};
    for (int c = 0; c < 4; c++) {
        const __m512i x0 = _mm512_shuffle_i32x4(b[at[c]], b[4 + at[c]], 0x88);
        const __m512i x1 = _mm512_shuffle_i32x4(b[at[c]], b[4 + at[c]], 0xdd);
        const __m512i y0 = _mm512_shuffle_i32x4(b[8 + at[c]], b[12 + at[c]], 0x88);
        const __m512i y1 = _mm512_shuffle_i32x4(b[8 + at[c]], b[12 + at[c]], 0xdd);
        r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88), r[8 + c] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
        r[4 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88), r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
    }
}

/* qt[i][r] = src[r][i] for the `rows` rows of `depth` 32-bit numbers (rows past it up to 16 * rv: 0). */
static void pack_rows(const uint32_t *src, int rows, int depth, int rv, uint32_t *qt) {
    const int lanes = 16 * rv;
    for (int v = 0; v < rv; v++)
        for (int i0 = 0; i0 < depth; i0 += 16) {
            __m512i r[16];
            const __mmask16 m = lanes16(depth - i0);
            for (int j = 0; j < 16; j++)
                r[j] = 16 * v + j < rows ? _mm512_maskz_loadu_epi32(m, src + (size_t)(16 * v + j) * depth + i0)
                                         : _mm512_setzero_si512();
            transpose16(r);
            for (int i = 0; i < 16 && i0 + i < depth; i++)
                _mm512_storeu_si512(qt + (size_t)(i0 + i) * lanes + 16 * v, r[i]);
        }
}

#if defined(__AVX512BF16__)
/* Words 0-15 of x (a) and 16-31 (b) interleaved: a0 b0 a1 b1 ..., the pairs (a_i, b_i) as 32-bit lanes. */
static inline __m512i interleave16(__m512i x) {
    const __m512i at = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(at, x);
}

/* The step's probabilities as bfloat16 pairs of keys: pp[t / 2][r] = (p[t][r], p[t + 1][r]) (0 past n). */
static void pair_probabilities(const float *st, int n, int rv, uint32_t *pp) {
    const int lanes = 16 * rv;
    for (int t = 0; t < n; t += 2)
        for (int v = 0; v < rv; v++) {
            const __m512 a = _mm512_loadu_ps(st + (size_t)t * lanes + 16 * v);
            const __m512 b = t + 1 < n ? _mm512_loadu_ps(st + (size_t)(t + 1) * lanes + 16 * v)
                                       : _mm512_setzero_ps();
            _mm512_storeu_si512(pp + (size_t)t / 2 * lanes + 16 * v, interleave16((__m512i)_mm512_cvtne2ps_pbh(b, a)));
        }
}

/* The step's n V rows as pairs of keys: vp[t / 2][i] = (V[t][i], V[t + 1][i]) in rows of dv >= d lanes (0 past d,
 * and past n). Key t is row t % bs of block table[t / bs] of the head's bfloat16 pages v. */
static void pair_rows(const uint16_t *v, const int64_t *table, int bs, int n, int d, int dv, uint32_t *vp) {
    for (int t = 0; t < n; t += 2) {
        const uint16_t *a = v + (table[t / bs] * bs + t % bs) * d;
        const uint16_t *b = t + 1 < n ? v + (table[(t + 1) / bs] * bs + (t + 1) % bs) * d : NULL;
        for (int i = 0; i < dv; i += 16) {
            const __mmask16 m = lanes16(d - i);
            const __m256i lo = _mm256_maskz_loadu_epi16(m, a + i);
            const __m256i hi = b ? _mm256_maskz_loadu_epi16(m, b + i) : _mm256_setzero_si256();
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            _mm512_storeu_si512(vp + (size_t)t / 2 * dv + i, interleave16(both));
        }
    }
}

/* acc[g][i] = acc[g][i] * shrink[g] + sum over pairs k < np of pp[k * p_t + g] . vp[k][i] (each a pair of keys)
 * for G (at most 6) rows g, 64 numbers i at a time, by AVX-512 BF16: add_weighted_rows_of with two keys a
 * product. */
static inline __attribute__((always_inline)) void add_weighted_pairs_of(float *acc, const uint32_t *pp, int64_t p_t,
                                                                       const uint32_t *vp, int np, int d, int dv,
                                                                       const int G, const float *shrink) {
    for (int i = 0; i < d; i += 64) {
        __mmask16 mask[4];
        __m512 v[6][4];
        for (int j = 0; j < 4; j++) {
            mask[j] = lanes16(d - i - 16 * j);
            for (int g = 0; g < G; g++)
                v[g][j] = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask[j], acc + (size_t)g * d + i + 16 * j),
                                        _mm512_set1_ps(shrink[g]));
        }
        for (int k = 0; k < np; k++) {
            __m512bh r[4];
            for (int j = 0; j < 4; j++)
                r[j] = (__m512bh)(i + 16 * j < dv ? _mm512_loadu_si512(vp + (size_t)k * dv + i + 16 * j)
                                                  : _mm512_setzero_si512());
            for (int g = 0; g < G; g++) {
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[k * p_t + g]);
                for (int j = 0; j < 4; j++) v[g][j] = _mm512_dpbf16_ps(v[g][j], w, r[j]);
            }
        }
        for (int j = 0; j < 4; j++)
            for (int g = 0; g < G; g++) {
                float *at = acc + (size_t)g * d + i + 16 * j;
                if (mask[j] == 0xffff) _mm512_storeu_ps(at, v[g][j]);
                else _mm512_mask_storeu_ps(at, mask[j], v[g][j]);
            }
    }
}
#endif

/* attend_rows for a tile of `rows` >= 16 rows over float32 pages, or bfloat16 pages with the rows as
 * bfloat16 (qs->bf16): rows in lanes (scores_t, softmax_t), the products with V by add_weighted_rows_of
 * (float32) or add_weighted_pairs_of (bfloat16). 0, or -1 (out untouched) where memory ran out. */
static int attend_tile(const Cache *c, int h, const int64_t *table, int64_t ctx, const Queries *qs, int tokens,
                        int groups, float scale, int64_t window, float cap, void *out, int kind, int64_t out_stride) {
    const int d = c->d, bs = c->bs, rows = tokens * groups, rv = (rows + 15) / 16, lanes = 16 * rv;
    const int pairs = c->kind == BF16, depth = pairs ? d / 2 : d;      /* bfloat16: qs->bf16, scored by pairs */
    const int per_step = bs >= SEGMENT ? 1 : SEGMENT / bs, span = ctx < bs ? (int)ctx : bs, step = per_step * span;
    float *qt = malloc(sizeof(float) * (size_t)depth * lanes), *st = malloc(sizeof(float) * (size_t)step * lanes);
    /* the step's V rows: as floats, or (pairs) as pairs of keys, with the probabilities' pairs after them */
    float *v_rows = malloc(sizeof(float) * ((size_t)step * d + (size_t)(step / 2 + 1) * (d + 16 + lanes)));
    float *acc = calloc((size_t)rows * d, sizeof(float));
    if (!qt || !st || !v_rows || !acc) {
        free(qt), free(st), free(acc), free(v_rows);
        return -1;
    }
    pack_rows(pairs ? (const uint32_t *)qs->bf16 : (const uint32_t *)qs->scaled, rows, depth, rv, (uint32_t *)qt);
    __m512 m[4], l[4], corr[4];
    __m512i sees[4], from[4];
    for (int v = 0; v < rv; v++) {
        int32_t keys[16], firsts[16];
        for (int j = 0; j < 16; j++) {
            const int r = 16 * v + j;      /* keys row r sees (padding rows: none) */
            keys[j] = r < rows ? (int32_t)(ctx - tokens + 1 + r / groups) : INT32_MIN / 2;
            firsts[j] = window && keys[j] > window ? keys[j] - (int32_t)window : 0;
        }
        sees[v] = _mm512_loadu_si512(keys), from[v] = _mm512_loadu_si512(firsts);
        m[v] = _mm512_set1_ps(-INFINITY), l[v] = _mm512_setzero_ps();
    }
    for (int64_t first = first_block(ctx, tokens, window, bs); first * bs < ctx; first += per_step) {
        const int n = upto(ctx - first * bs, per_step * bs);
        for (int b = 0; b * bs < n; b++) {
            const int64_t block = table[first + b];
            const int nb = upto(n - b * bs, bs);
            const char *k = (const char *)c->pages + ((int64_t)h * c->nb + block) * bs * d * elem_size(c->kind);
            scores_t_rv(rv, qt, k, nb, d, scale, st + (size_t)b * bs * lanes, pairs);
        }
        if (cap > 0.0f)
            for (int64_t i = 0; i < (int64_t)n * lanes; i += 16)
                _mm512_storeu_ps(st + i, soft_cap16(_mm512_loadu_ps(st + i), cap));
        __m512i now[4], now_from[4];
        for (int v = 0; v < rv; v++) {
            now[v] = _mm512_sub_epi32(sees[v], _mm512_set1_epi32((int)(first * bs)));
            now_from[v] = _mm512_sub_epi32(from[v], _mm512_set1_epi32((int)(first * bs)));
        }
        softmax_t(st, n, rv, now_from, now, m, l, corr);
        float shrink[TILE_LANES];      /* applied as the products with V load the sums */
        for (int v = 0; v < rv; v++) _mm512_storeu_ps(shrink + 16 * v, corr[v]);
#if defined(__AVX512BF16__)
        if (pairs) {
            /* by pairs of keys: the probabilities rounded to bfloat16, as the eager model rounds them */
            const int dv = (d + 15) / 16 * 16, np = (n + 1) / 2;
            uint32_t *vp = (uint32_t *)v_rows, *pp = vp + (size_t)np * dv;
            const uint16_t *v = (const uint16_t *)c->pages + ((int64_t)c->kvh + h) * c->nb * bs * d;
            pair_rows(v, table + first, bs, n, d, dv, vp);
            pair_probabilities(st, n, rv, pp);
            for (int r = 0; r < rows; r += 6) {
                float *a = acc + (size_t)r * d;
                switch (rows - r >= 6 ? 6 : rows - r) {
                    case 6: add_weighted_pairs_of(a, pp + r, lanes, vp, np, d, dv, 6, shrink + r); break;
                    case 5: add_weighted_pairs_of(a, pp + r, lanes, vp, np, d, dv, 5, shrink + r); break;
                    case 4: add_weighted_pairs_of(a, pp + r, lanes, vp, np, d, dv, 4, shrink + r); break;
                    case 3: add_weighted_pairs_of(a, pp + r, lanes, vp, np, d, dv, 3, shrink + r); break;
                    case 2: add_weighted_pairs_of(a, pp + r, lanes, vp, np, d, dv, 2, shrink + r); break;
                    default: add_weighted_pairs_of(a, pp + r, lanes, vp, np, d, dv, 1, shrink + r);
                }
            }
            continue;
        }
#endif
        /* the step's V rows as float32, together: once for all the tile's rows */
        for (int b = 0; b * bs < n; b++) {
            const int64_t block = table[first + b];
            const char *v = (const char *)c->pages
                            + (((int64_t)c->kvh + h) * c->nb + block) * bs * d * elem_size(c->kind);
            load_row(v_rows + (size_t)b * bs * d, v, c->kind, upto(n - b * bs, bs) * d);
        }
        for (int r = 0; r < rows; r += 6) {
            float *a = acc + (size_t)r * d;
            const float *p = st + r;
            switch (rows - r >= 6 ? 6 : rows - r) {
                case 6: add_weighted_rows_of(a, p, 1, lanes, v_rows, n, d, 6, 0, shrink + r); break;
                case 5: add_weighted_rows_of(a, p, 1, lanes, v_rows, n, d, 5, 0, shrink + r); break;
                case 4: add_weighted_rows_of(a, p, 1, lanes, v_rows, n, d, 4, 0, shrink + r); break;
                case 3: add_weighted_rows_of(a, p, 1, lanes, v_rows, n, d, 3, 0, shrink + r); break;
                case 2: add_weighted_rows_of(a, p, 1, lanes, v_rows, n, d, 2, 0, shrink + r); break;
                default: add_weighted_rows_of(a, p, 1, lanes, v_rows, n, d, 1, 0, shrink + r);
            }
        }
    }
    float sums[TILE_LANES];
    for (int v = 0; v < rv; v++) _mm512_storeu_ps(sums + 16 * v, l[v]);
    for (int r = 0; r < rows; r++) {
        const __m512 inv = _mm512_set1_ps(sums[r] > 0.0f ? 1.0f / sums[r] : 0.0f);
        char *o = (char *)out + ((r / groups) * out_stride + (r % groups) * d) * elem_size(kind);
        for (int i = 0; i < d; i += 16) {
            const __mmask16 m = lanes16(d - i);
            const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, acc + (size_t)r * d + i), inv);
            store16(o, i, m, kind == BF16 ? round16(v) : v, kind);
        }
    }
    free(qt), free(st), free(acc), free(v_rows);
    return 0;
}
#endif

#if AVX512_BW_VL
/* A decode task (one query token) over bfloat16 pages, keys in the lanes of vectors. Its G query rows see the
 * same keys, so each 16-key chunk of K is transposed once, as 32-bit pairs of numbers (transpose16), and a row's
 * scores for the chunk are one vector summed along d by float32 FMAs, with no sums across lanes (attend_rows
 * needs one per key and row) and no pair products (AVX-512 BF16's issue at half an FMA's rate on the CPUs
 * measured). The products with V load each V row's chunk of 32 numbers once for up to ONE_ROWS rows and widen its
 * even and its odd numbers apart (a shift, a mask: no shuffle), so that the sums hold a chunk's even numbers in
 * one vector and its odd ones in another until the end. K and V rows are found key by key (any block size), and
 * the next 64 keys' rows are asked for into L2 while a step's are used. */
#define ONE_ROWS 8          /* rows a pass keeps the sums of in registers, two vectors each */
#define ONE_NUMBERS 4096    /* G x d at most: the task's sums live on its stack */

/* Where the K rows of keys [key, key + n) of head h are (V's: v_shift numbers on). */
static void key_rows(const Cache *c, int h, const int64_t *table, int64_t key, int n, const uint16_t **rows) {
    const int bs = c->bs, d = c->d;
    const uint16_t *k = (const uint16_t *)c->pages + (int64_t)h * c->nb * bs * d;
    int64_t block = key / bs;
    int at = (int)(key % bs);
    for (int t = 0; t < n; t++) {
        rows[t] = k + (table[block] * bs + at) * d;
        if (++at == bs) at = 0, block++;
    }
}

/* Asks for the K and V rows of keys [t0, t1) of `rows` into L2. */
static inline __attribute__((always_inline)) void ask_rows(const uint16_t *const *rows, int t0, int t1, int d,
                                                          int64_t v_shift) {
    for (int t = t0; t < t1; t++)
        for (int i = 0; i < d; i += 32) {
            __builtin_prefetch(rows[t] + i, 0, 2);
            __builtin_prefetch(rows[t] + v_shift + i, 0, 2);
        }
}

/* st[g][t] = q[g] . K[t] for the G rows q (float32, scaled; d apart) and the 16 keys of kt (pairs transposed:
 * kt[i] lane t holds key t's numbers 2i and 2i + 1). */
static inline __attribute__((always_inline)) void scores_one(const float *q, const __m512i *kt, int d, float *st,
                                                            int stride, const int G) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    __m512 even[ONE_ROWS], odd[ONE_ROWS];
    for (int g = 0; g < G; g++) even[g] = _mm512_setzero_ps(), odd[g] = _mm512_setzero_ps();
    for (int i = 0; i < d / 2; i++) {
        const __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(kt[i], 16));
        const __m512 o = _mm512_castsi512_ps(_mm512_and_si512(kt[i], high));
        for (int g = 0; g < G; g++) {
            even[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[(size_t)g * d + 2 * i]), e, even[g]);
            odd[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[(size_t)g * d + 2 * i + 1]), o, odd[g]);
        }
    }
    for (int g = 0; g < G; g++) _mm512_storeu_ps(st + (size_t)g * stride, _mm512_add_ps(even[g], odd[g]));
}

/* acc[g] = acc[g] * shrink[g] + sum over t < n of p[g][t] V[t] for G rows (acc d apart, p `stride`), over V's 32
 * numbers from number i on, which acc holds from i on as their even numbers, then their odd ones. */
static inline __attribute__((always_inline)) void values_one(float *acc, const float *p, int stride,
                                                            const float *shrink, const uint16_t *const *rows,
                                                            int64_t v_shift, int n, int i, int d, const int G) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    __m512 even[ONE_ROWS], odd[ONE_ROWS];
    for (int g = 0; g < G; g++) {
        const __m512 s = _mm512_set1_ps(shrink[g]);
        even[g] = _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)g * d + i), s);
        odd[g] = _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)g * d + i + 16), s);
    }
    for (int t = 0; t < n; t++) {
        const __m512i v = _mm512_loadu_si512(rows[t] + v_shift + i);
        const __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        const __m512 o = _mm512_castsi512_ps(_mm512_and_si512(v, high));
        for (int g = 0; g < G; g++) {
            const __m512 w = _mm512_set1_ps(p[(size_t)g * stride + t]);
            even[g] = _mm512_fmadd_ps(w, e, even[g]);
            odd[g] = _mm512_fmadd_ps(w, o, odd[g]);
        }
    }
    for (int g = 0; g < G; g++) {
        _mm512_storeu_ps(acc + (size_t)g * d + i, even[g]);
        _mm512_storeu_ps(acc + (size_t)g * d + i + 16, odd[g]);
    }
}

/* The 16 keys of rows[0..n) (n <= 16; past n: 0) as pairs transposed, kt[i] lane t: key t's numbers 2i, 2i + 1. */
static inline __attribute__((always_inline)) void key_pairs(const uint16_t *const *rows, int n, int d, __m512i *kt) {
    for (int i0 = 0; i0 < d / 2; i0 += 16) {
        __m512i r[16];
        for (int t = 0; t < 16; t++) r[t] = t < n ? _mm512_loadu_si512(rows[t] + 2 * i0) : _mm512_setzero_si512();
        transpose16(r);
        for (int i = 0; i < 16; i++) kt[i0 + i] = r[i];
    }
}

/* The switches from a row count to the kernels' constant G (at most ONE_ROWS). */
#define ONE_CASES(CALL) \
    switch (G) { case 8: CALL(8); break; case 7: CALL(7); break; case 6: CALL(6); break; case 5: CALL(5); break; \
                 case 4: CALL(4); break; case 3: CALL(3); break; case 2: CALL(2); break; default: CALL(1); }

/* attend_rows for one query token (rows: its `groups` query heads, q of `kind`, out of `kind`, each d apart) over
 * bfloat16 pages, keys in lanes (above): d a multiple of 32, groups x d at most ONE_NUMBERS. */
static void attend_one(const Cache *c, int h, const int64_t *table, int64_t ctx, const void *q, int kind,
                       int groups, float scale, int64_t window, float cap, void *out) {
    const int d = c->d;
    const int64_t v_shift = (int64_t)c->kvh * c->nb * c->bs * d;
    const int64_t first_key = window && ctx > window ? ctx - window : 0;      /* the first key the token sees */
    float qs[groups * d], acc[groups * d], st[groups * SEGMENT], m[groups], l[groups], corr[groups];
    int from[groups], valid[groups];
    const uint16_t *rows_a[SEGMENT], *rows_b[SEGMENT], **now = rows_a, **next = rows_b;
    __m512i kt[d / 2];
    for (int i = 0; i < groups * d; i += 16)
        _mm512_storeu_ps(qs + i, _mm512_mul_ps(load16(q, i, 0xffff, kind), _mm512_set1_ps(scale)));
    memset(acc, 0, sizeof(float) * (size_t)groups * d);
    for (int g = 0; g < groups; g++) m[g] = -INFINITY, l[g] = 0.0f, from[g] = 0;
    if (ctx > first_key) {
        key_rows(c, h, table, first_key, upto(ctx - first_key, SEGMENT), now);
        ask_rows(now, 0, upto(ctx - first_key, SEGMENT), d, v_shift);
    }
    for (int64_t s = first_key; s < ctx; s += SEGMENT) {
        const int n = upto(ctx - s, SEGMENT), n_next = upto(ctx - s - SEGMENT, SEGMENT);
        if (n_next) key_rows(c, h, table, s + SEGMENT, n_next, next);
        for (int t0 = 0; t0 < n; t0 += 16) {
            /* the next step's rows: 16 keys' with each chunk of this one's, the rest with its last */
            if (n_next) ask_rows(next, upto(t0, n_next), t0 + 16 >= n ? n_next : upto(t0 + 16, n_next), d, v_shift);
            key_pairs(now + t0, upto(n - t0, 16), d, kt);
            for (int g0 = 0; g0 < groups; g0 += ONE_ROWS) {
                const int G = upto(groups - g0, ONE_ROWS);
#define SCORES(R) scores_one(qs + (size_t)g0 * d, kt, d, st + (size_t)g0 * SEGMENT + t0, SEGMENT, R)
                ONE_CASES(SCORES)
#undef SCORES
            }
        }
        for (int g = 0; g < groups; g++) valid[g] = n;        /* every row sees every key of the step */
        if (cap > 0.0f) cap_scores(st, SEGMENT, groups, from, valid, cap);
        softmax_block(st, SEGMENT, n, groups, from, valid, m, l, corr);
        for (int i = 0; i < d; i += 32)
            for (int g0 = 0; g0 < groups; g0 += ONE_ROWS) {
                const int G = upto(groups - g0, ONE_ROWS);
#define VALUES(R) values_one(acc + (size_t)g0 * d, st + (size_t)g0 * SEGMENT, SEGMENT, corr + g0, now, v_shift, n, i, \
                             d, R)
                ONE_CASES(VALUES)
#undef VALUES
            }
        const uint16_t **swap = now;
        now = next, next = swap;
    }
    /* each chunk's even and odd numbers back in order, over the sum (no context, a padding row: 0, not 0/0) */
    const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i top = _mm512_add_epi32(low, _mm512_set1_epi32(8));
    for (int g = 0; g < groups; g++) {
        const __m512 sum = _mm512_set1_ps(l[g]);
        for (int i = 0; i < d; i += 32) {
            const __m512 even = _mm512_loadu_ps(acc + (size_t)g * d + i);
            const __m512 odd = _mm512_loadu_ps(acc + (size_t)g * d + i + 16);
            __m512 v[2] = {_mm512_permutex2var_ps(even, low, odd), _mm512_permutex2var_ps(even, top, odd)};
            for (int j = 0; j < 2; j++) {
                v[j] = l[g] > 0.0f ? _mm512_div_ps(v[j], sum) : _mm512_setzero_ps();
                store16((char *)out + (size_t)g * d * elem_size(kind), i + 16 * j, 0xffff,
                        kind == BF16 ? round16(v[j]) : v[j], kind);
            }
        }
    }
}
#endif

/* Whether attend_rows takes `tokens` query tokens of `groups` heads each over pages of `kind` with keys in lanes
 * (attend_one): decode tokens over bfloat16 pages, d a multiple of 32, groups x d at most ONE_NUMBERS. */
int keys_in_lanes(int kind, int d, int groups, int tokens) {
#if AVX512_BW_VL
    return tokens == 1 && kind == BF16 && d % 32 == 0 && groups * d <= ONE_NUMBERS;
#else
    (void)kind, (void)d, (void)groups, (void)tokens;
    return 0;
#endif
}

/* Attention of `tokens` consecutive query tokens of a sequence (q rows q_stride numbers apart, of
 * `kind` F32 or BF16) over KV head h: token r sees the first ctx - tokens + 1 + r cached tokens (causal;
 * its own are cached already), the last `window` of them where window > 0, its scores soft-capped where
 * cap > 0; each of its `groups` query heads (adjacent in its row) is one row of the work, so that all rows
 * share every K/V block read. out: rows out_stride numbers apart, of `kind`. 0, or -1 (out untouched) where
 * memory ran out. */
static int attend_rows(const Cache *c, int h, const int64_t *table, int64_t ctx, const void *q, int kind,
                       int64_t q_stride, int tokens, int groups, float scale, int64_t window, float cap, void *out,
                       int64_t out_stride) {
    const int d = c->d, bs = c->bs, rows = tokens * groups;
#if AVX512_BW_VL
    if (keys_in_lanes(c->kind, d, groups, tokens)) {
        attend_one(c, h, table, ctx, q, kind, groups, scale, window, cap, out);
        return 0;
    }
#endif
    Queries qs;
    if (queries(c, q, kind, q_stride, rows, groups, scale, &qs)) return -1;
#if AVX512_BW_VL
    if (rows >= 16 && rows <= TILE_LANES && d % 2 == 0 && (c->kind == F32 || (c->kind == BF16 && qs.bf16))) {
        const int status = attend_tile(c, h, table, ctx, &qs, tokens, groups, scale, window, cap, out, kind,
                                       out_stride);
        free(qs.scaled), free(qs.bf16);
        return status;
    }
#endif
    const int per_step = bs >= SEGMENT ? 1 : SEGMENT / bs, span = ctx < bs ? (int)ctx : bs, step = per_step * span;
    /* a block's rows can be a whole context (cache_mode "contiguous"): on the heap, not the stack;
     * none for float32 pages, which are read in place */
    float *tile = c->kind == F32 ? NULL : malloc(sizeof(float) * (size_t)span * d);
    float *scores = malloc(sizeof(float) * (size_t)rows * step), *acc = calloc((size_t)rows * d, sizeof(float));
    if ((!tile && c->kind != F32) || !scores || !acc) {
        free(tile), free(scores), free(acc), free(qs.scaled), free(qs.bf16);
        return -1;
    }
    float m[rows], l[rows], correction[rows];
    int valid[rows], from[rows];
    int64_t seen[rows];
    for (int r = 0; r < rows; r++) m[r] = -INFINITY, l[r] = 0.0f;
    const int64_t start = first_block(ctx, tokens, window, bs);
    if (ctx > start * bs) prefetch_block(c, h, table[start], 1);
    if (ctx > (start + 1) * bs) prefetch_block(c, h, table[start + 1], 0);
    for (int64_t first = start; first * bs < ctx; first += per_step) {
        const int n = upto(ctx - first * bs, per_step * bs);
        for (int b = 0; b * bs < n; b++) {
            const int64_t at = (first + b) * bs;
            const int nb = upto(n - b * bs, bs);
            if (at + bs < ctx) prefetch_block(c, h, table[first + b + 1], 1);
            if (at + 2 * bs < ctx) prefetch_block(c, h, table[first + b + 2], 0);
            for (int r = 0; r < rows; r++) seen[r] = ctx - tokens + 1 + r / groups - at;
            score_block(&qs, load_block(c, 0, h, table[first + b], nb, tile), nb, d, rows, seen, scale,
                        scores + b * bs, step);
        }
        for (int r = 0; r < rows; r++) {
            const int64_t sees = ctx - tokens + 1 + r / groups - first * bs;
            valid[r] = upto(sees, n), from[r] = window ? upto(sees - window, n) : 0;
        }
        if (cap > 0.0f) cap_scores(scores, step, rows, from, valid, cap);
        softmax_block(scores, step, n, rows, from, valid, m, l, correction);
        for (int b = 0; b * bs < n; b++) {      /* the first block's pass shrinks the sums so far */
            const int nb = upto(n - b * bs, bs);
            add_weighted_rows(acc, scores + b * bs, step, load_block(c, 1, h, table[first + b], nb, tile), nb, d, rows,
                              b == 0 ? correction : NULL);
        }
    }
    /* no context (a padding row) leaves l = 0: the output is 0, not 0/0 */
    for (int r = 0; r < rows; r++) {
        const int64_t o = (r / groups) * out_stride + (r % groups) * d;
#if AVX512_BW_VL
        const __m512 sum = _mm512_set1_ps(l[r]);
        for (int i = 0; i < d; i += 16) {
            const __mmask16 m = lanes16(d - i);
            const __m512 v = l[r] > 0.0f ? _mm512_div_ps(_mm512_maskz_loadu_ps(m, acc + (size_t)r * d + i), sum)
                                         : _mm512_setzero_ps();
            store16((char *)out + o * elem_size(kind), i, m, kind == BF16 ? round16(v) : v, kind);
        }
#else
        for (int i = 0; i < d; i++) store(out, kind, o + i, l[r] > 0.0f ? acc[(size_t)r * d + i] / l[r] : 0.0f);
#endif
    }
    free(tile), free(scores), free(acc), free(qs.scaled), free(qs.bf16);
    return 0;
}

int attend_head(const Cache *c, int h, const int64_t *table, int64_t ctx, const float *q, int groups,
                float scale, int64_t window, float cap, float *out) {
    return attend_rows(c, h, table, ctx, q, F32, 0, 1, groups, scale, window, cap, out, 0);
}

/* Sparse decode attention (kv/sparse.py): a task's choice of blocks by Quest's bound. Per block, its summary (the
 * element-wise minimum and maximum of its keys) bounds the score of the query heads g of the task over its keys
 * by sum_g sum_i max(q_gi min_i, q_gi max_i) = pos . max - neg . min, where pos_i and neg_i sum the positive and the
 * negative parts of the heads' q_gi: two dot products of d numbers a block, whatever the heads. */

/* pos . max - neg . min of a block's summary (F32 or BF16 rows [2][d]: minimums, then maximums). */
static inline __attribute__((always_inline)) float block_bound(const void *summary, int kind, const float *pos,
                                                               const float *neg, int d) {
#if AVX512_BW_VL
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 16) {
        const __mmask16 m = lanes16(d - i);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, pos + i), load16(summary, (size_t)d + i, m, kind), acc);
        acc = _mm512_fnmadd_ps(_mm512_maskz_loadu_ps(m, neg + i), load16(summary, i, m, kind), acc);
    }
    return _mm512_reduce_add_ps(acc);
#else
    float acc = 0.0f;
    for (int i = 0; i < d; i++) acc += pos[i] * param(summary, kind, d + i) - neg[i] * param(summary, kind, i);
    return acc;
#endif
}

/* How many blocks ahead block_bounds asks for the summaries it reads, as the pages are asked for ahead of their use. */
#define BOUNDS_AHEAD 16

/* A block's summary (`row` bytes) asked for, to be read soon. */
static inline void prefetch_summary(const char *summary, size_t row) {
    for (size_t at = 0; at < row; at += 64) __builtin_prefetch(summary + at, 0, 3);
}

/* bound[j]: block_bound of block table[j]'s summary, for j in [0, n) (summaries: rows of `row` bytes from `head`).
 * Four blocks at a time, whose sums (each a chain of dependent adds, in block_bound's order) overlap. */
static void block_bounds(const char *head, size_t row, int kind, const int64_t *table, int64_t n, const float *pos,
                         const float *neg, int d, float *bound) {
    for (int64_t a = 0; a < BOUNDS_AHEAD && a < n; a++) prefetch_summary(head + (size_t)table[a] * row, row);
    int64_t j = 0;
#if AVX512_BW_VL
    for (; j + 4 <= n; j += 4) {
        for (int64_t a = j + BOUNDS_AHEAD; a < j + BOUNDS_AHEAD + 4 && a < n; a++)
            prefetch_summary(head + (size_t)table[a] * row, row);
        const char *s[4];
        __m512 acc[4];
        for (int b = 0; b < 4; b++) s[b] = head + (size_t)table[j + b] * row, acc[b] = _mm512_setzero_ps();
        for (int i = 0; i < d; i += 16) {
            const __mmask16 m = lanes16(d - i);
            const __m512 p = _mm512_maskz_loadu_ps(m, pos + i), g = _mm512_maskz_loadu_ps(m, neg + i);
            for (int b = 0; b < 4; b++) {
                acc[b] = _mm512_fmadd_ps(p, load16(s[b], (size_t)d + i, m, kind), acc[b]);
                acc[b] = _mm512_fnmadd_ps(g, load16(s[b], i, m, kind), acc[b]);
            }
        }
        for (int b = 0; b < 4; b++) bound[j + b] = _mm512_reduce_add_ps(acc[b]);
    }
#endif
    for (; j < n; j++) {
        if (j + BOUNDS_AHEAD < n) prefetch_summary(head + (size_t)table[j + BOUNDS_AHEAD] * row, row);
        bound[j] = block_bound(head + (size_t)table[j] * row, kind, pos, neg, d);
    }
}

/* The k-th highest of x[0..n) (0 < k <= n), x reordered: Hoare's selection, median of three. */
static float kth_highest(float *x, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    const int64_t want = k - 1;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        float t;
        if (x[mid] > x[lo]) t = x[mid], x[mid] = x[lo], x[lo] = t;
        if (x[hi] > x[lo]) t = x[hi], x[hi] = x[lo], x[lo] = t;
        if (x[hi] > x[mid]) t = x[hi], x[hi] = x[mid], x[mid] = t;
        const float pivot = x[mid];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (x[i] > pivot) i++;
            while (pivot > x[j]) j--;
            if (i <= j) t = x[i], x[i] = x[j], x[j] = t, i++, j--;
        }
        if (want <= j) hi = j;          /* the k-th lies within [lo, j] */
        else if (want >= i) lo = i;     /* [lo, i) all rank above it */
        else break;                     /* (j, i) holds the pivot's equals: the k-th among them */
    }
    return x[want];
}

/* A block's bytes in one KV head: its K and V rows and their scales (the pages' layout above). */
static int64_t block_bytes(const Cache *c) {
    const int64_t numbers = (int64_t)c->bs * c->d;
    if (c->kind == INT8 || c->kind == FP8) return 2 * (numbers + 2 * c->bs);     /* an fp16 scale a row */
    if (c->kind == INT4) return 2 * (numbers / 2 + 4 * c->bs);                    /* fp16 (scale, min) a row */
    return 2 * numbers * (int64_t)elem_size(c->kind);
}

/* k clamped to [0, n]. */
static inline int64_t clamp_blocks(int64_t k, int64_t n) { return k < 0 ? 0 : k > n ? n : k; }

/* kv/sparse.py's rule (attention/sparse.py's choose_blocks applies it too): choosing k of a task's n middle blocks
 * pays where the bytes it skips, n - k blocks of page_bytes, exceed those it reads to choose, a summary of
 * summary_bytes for each of the n; else the task reads them all. */
static inline int selection_pays(int64_t n, int64_t k, int64_t page_bytes, int64_t summary_bytes) {
    return (n - k) * page_bytes > n * summary_bytes;
}

/* Counts a task's reads (decode_blocks). */
static void count_reads(const Blocks *b, int64_t ctx, int bs, int64_t *counts, uint8_t *record, const int64_t *table) {
    const int64_t read = (b->ctx + bs - 1) / bs, total = (ctx + bs - 1) / bs;
    #pragma omp atomic update
    counts[0] += read;
    #pragma omp atomic update
    counts[1] += total;
    if (!record) return;
    for (int64_t j = 0, at = 0; j < read; j++) {     /* the table's index of each block read (both in order) */
        while (table[at] != b->table[j]) at++;
        #pragma omp atomic update
        record[at]++;
        at++;
    }
}

int decode_blocks(const Cache *c, int h, const int64_t *table, int64_t ctx, const float *q, int groups,
                  int64_t budget, int64_t sinks, int64_t recent, int64_t *counts, uint8_t *record, Blocks *out) {
    const int d = c->d, bs = c->bs;
    const int64_t nb = (ctx + bs - 1) / bs;
    const size_t row = (size_t)2 * d * elem_size(c->summary_kind);    /* a block's summary: [2][d] */
    *out = (Blocks){table, ctx, NULL};
    const int64_t first = sinks <= 0 ? 0 : (sinks + bs - 1) / bs < nb ? (sinks + bs - 1) / bs : nb;
    const int64_t last = (ctx - recent) / bs > first ? (ctx - recent) / bs : first;   /* the recent blocks' first */
    const int64_t n = last - first, k = clamp_blocks(budget / bs - first - (nb - last), n);
    if (budget > 0 && ctx > budget && c->summary && selection_pays(n, k, block_bytes(c), (int64_t)row)) {
        int64_t *sel = malloc(sizeof(int64_t) * (size_t)(first + k + nb - last) + sizeof(float) * (size_t)(2 * n));
        if (!sel) return -1;
        float *bound = (float *)(sel + first + k + nb - last), *ranked = bound + n;
        float pos[d], neg[d];
        for (int i = 0; i < d; i++) pos[i] = neg[i] = 0.0f;
        for (int g = 0; g < groups; g++)
            for (int i = 0; i < d; i++) {
                const float v = q[(size_t)g * d + i];
                pos[i] += v > 0.0f ? v : 0.0f, neg[i] += v < 0.0f ? -v : 0.0f;
            }
        block_bounds((const char *)c->summary + (size_t)h * c->nb * row, row, c->summary_kind, table + first, n, pos,
                     neg, d, bound);
        int64_t m = 0;
        for (int64_t j = 0; j < first; j++) sel[m++] = table[j];
        if (k > 0) {
            /* the k highest, in table order: every bound above the k-th, then its equals, the earlier first */
            memcpy(ranked, bound, sizeof(float) * (size_t)n);
            const float kth = kth_highest(ranked, n, k);
            int64_t ties = k;
            for (int64_t j = 0; j < n; j++) ties -= bound[j] > kth;
            /* (at most k, whatever a NaN in the bounds does to the comparisons) */
            for (int64_t j = 0, left = k; j < n && left > 0; j++)
                if (bound[j] > kth || (bound[j] == kth && ties-- > 0)) sel[m++] = table[first + j], left--;
        }
        for (int64_t j = last; j < nb; j++) sel[m++] = table[j];
        *out = (Blocks){sel, (m - 1) * bs + (ctx - (nb - 1) * bs), sel};   /* the last block: the context's last */
    }
    if (budget >= 0 && counts) count_reads(out, ctx, bs, counts, record, table);
    return 0;
}

/* attend_rows for one decode token of a sequence (q of q_kind, its heads adjacent) over the blocks decode_blocks
 * chooses with the sequence's sparse options `params` (budget, sinks, recent, as kv/sparse.py's Quest.params; NULL:
 * none). 0, or -1 where memory ran out. */
static int attend_decode(const Cache *c, int h, const int64_t *table, int64_t ctx, const void *q, int q_kind,
                         int groups, float scale, int64_t window, float cap, void *out, const int64_t *params,
                         int64_t *counts, uint8_t *record) {
    if (!params || params[0] < 0 || window)      /* no sparse attention (a sliding window's layer: none) */
        return attend_rows(c, h, table, ctx, q, q_kind, 0, 1, groups, scale, window, cap, out, 0);
    float rows[groups * c->d];
    load_row(rows, q, q_kind, groups * c->d);
    Blocks b;
    if (decode_blocks(c, h, table, ctx, rows, groups, params[0], params[1], params[2], counts, record, &b)) return -1;
    const int status = attend_rows(c, h, b.table, b.ctx, q, q_kind, 0, 1, groups, scale, 0, cap, out, 0);
    free(b.owned);
    return status;
}

/* out[b][h * G + g][:] = softmax(q . K^T * scale) V for each decoding sequence b: q and out of
 * `q_kind` F32 or BF16, each sequence's q heads adjacent, sequences q_stride numbers apart in q and
 * contiguous in out; over the last `window` keys where window > 0, soft-capped where cap > 0. Under sparse
 * attention (sparse: [num_seqs][4], each sequence's kv/sparse.py Quest.params, its budget 0 in a dense layer; NULL:
 * none), over the blocks decode_blocks chooses, counted into counts and record ([num_seqs][table_width], or NULL).
 * 0, or -1 where memory ran out (out is then not all written). */
int paged_decode(const void *q, int q_kind, int64_t q_stride, void *out, int num_seqs, int num_heads,
                  const int64_t *block_tables, int table_width, const int64_t *context_lens, float scale,
                  const void *pages, int kind, int kvh, int nb, int bs, int d,
                  const void *k_meta, const void *v_meta, const void *summary, int summary_kind,
                  int64_t window, float cap, const int64_t *sparse, int64_t *counts, uint8_t *record) {
    const Cache c = {pages, k_meta, v_meta, summary, kind, kvh, nb, bs, d, summary_kind};
    const int groups = num_heads / kvh;
    const size_t es = elem_size(q_kind);
    int failed = 0;
    #pragma omp parallel for collapse(2) schedule(dynamic)
    for (int b = 0; b < num_seqs; b++)
        for (int h = 0; h < kvh; h++) {
            int stop;
            #pragma omp atomic read
            stop = failed;
            if (stop) continue;         /* the call fails: no task left need run */
            const int64_t head = (int64_t)h * groups * d;
            if (attend_decode(&c, h, block_tables + (int64_t)b * table_width, context_lens[b],
                              (const char *)q + (b * q_stride + head) * es, q_kind, groups, scale, window, cap,
                              (char *)out + ((int64_t)b * num_heads * d + head) * es, sparse ? sparse + 4 * b : NULL,
                              counts, record ? record + (int64_t)b * table_width : NULL)) {
                #pragma omp atomic write
                failed = 1;
            }
        }
    return failed ? -1 : 0;
}

/* out[t][h * G + g][:] = causal attention of every query token t of a step over its sequence's pages,
 * where the step's K/V are written already: sequence s has query tokens [query_starts[s],
 * query_starts[s + 1]), the last of its context_lens[s] cached tokens (a prompt's chunk after a cached
 * prefix, or a decode's one token). Tasks are tiles of a few consecutive tokens of a sequence and one
 * KV head, so that each K/V block read serves tokens x G query rows. q (rows q_stride apart) and out
 * (contiguous) of q_kind; the arguments are paged_decode's (its sparse attention for the decodes, whose tiles are
 * of one token), and query_starts. 0, or -1 where memory ran out (out is then not all written). */
int paged_prefill(const void *q, int q_kind, int64_t q_stride, void *out, int num_seqs, int num_heads,
                   const int64_t *block_tables, int table_width, const int64_t *context_lens, float scale,
                   const void *pages, int kind, int kvh, int nb, int bs, int d,
                   const void *k_meta, const void *v_meta, const void *summary, int summary_kind,
                   int64_t window, float cap, const int64_t *sparse, int64_t *counts, uint8_t *record,
                   const int64_t *query_starts) {
    const Cache c = {pages, k_meta, v_meta, summary, kind, kvh, nb, bs, d, summary_kind};
    const int groups = num_heads / kvh, per_tile = groups >= 64 ? 1 : 64 / groups;
    const size_t es = elem_size(q_kind);
    int64_t num_tiles = 0;
    for (int s = 0; s < num_seqs; s++) num_tiles += (query_starts[s + 1] - query_starts[s] + per_tile - 1) / per_tile;
    int64_t *tile_start = malloc(sizeof(int64_t) * (size_t)(num_tiles + 1));
    int *tile_seq = malloc(sizeof(int) * (size_t)(num_tiles + 1));
    if (!tile_start || !tile_seq) {
        free(tile_start), free(tile_seq);
        return -1;
    }
    int failed = 0;
    int64_t at = 0;
    for (int s = 0; s < num_seqs; s++)
        for (int64_t t = query_starts[s]; t < query_starts[s + 1]; t += per_tile) tile_seq[at] = s, tile_start[at++] = t;
    const int64_t num_tasks = num_tiles * kvh, row = (int64_t)num_heads * d;
    /* the latest tiles first: they attend to the most keys */
    #pragma omp parallel for schedule(dynamic)
    for (int64_t i = 0; i < num_tasks; i++) {
        int stop;
        #pragma omp atomic read
        stop = failed;
        if (stop) continue;         /* the call fails: no task left need run */
        const int64_t tile = (num_tasks - 1 - i) / kvh, t0 = tile_start[tile];
        const int h = (int)((num_tasks - 1 - i) % kvh), s = tile_seq[tile];
        const int64_t end = query_starts[s + 1], tokens = end - t0 < per_tile ? end - t0 : per_tile;
        /* keys its last token sees: the cache less the sequence's query tokens after it */
        const int64_t ctx = context_lens[s] - (end - t0 - tokens);
        const int64_t head = (int64_t)h * groups * d;
        const int64_t *table = block_tables + (int64_t)s * table_width, *params = sparse ? sparse + 4 * s : NULL;
        const void *qt = (const char *)q + (t0 * q_stride + head) * es;
        void *ot = (char *)out + (t0 * row + head) * es;
        /* a decode under sparse attention (its one token), else the tile's causal attention */
        const int status = params && params[0] >= 0
            ? attend_decode(&c, h, table, ctx, qt, q_kind, groups, scale, window, cap, ot, params, counts,
                            record ? record + (int64_t)s * table_width : NULL)
            : attend_rows(&c, h, table, ctx, qt, q_kind, q_stride, (int)tokens, groups, scale, window, cap, ot, row);
        if (status) {
            #pragma omp atomic write
            failed = 1;
        }
    }
    free(tile_start), free(tile_seq);
    return failed ? -1 : 0;
}
