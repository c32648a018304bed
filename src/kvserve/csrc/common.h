#ifndef KVSERVE_COMMON_H
#define KVSERVE_COMMON_H

/* What the kernels share: number formats and rounding, RMSNorm as the eager model computes it, the
 * paged cache as attention reads it, a few functions of one number that vectorize, and (AVX-512)
 * sixteen-lane masks and loads. */
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

/* f rounded to bfloat16 (to nearest, ties to even; infinities and NaNs kept): without branches, so
 * that loops of it vectorize. */
static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const uint32_t special = (u & 0xffff0000u) | ((u & 0xffff) ? 0x400000u : 0);
    return bits_to_float((u & 0x7f800000u) == 0x7f800000u ? special : rounded);
}

/* Rounded as a tensor of `dtype` would hold it. */
static inline float as_dtype(float f, int dtype) { return dtype == BF16 ? round_bf16(f) : f; }

static inline void store(void *p, int dtype, int64_t i, float f) {
    if (dtype == BF16) {
        float r = round_bf16(f);
        uint32_t u;
        memcpy(&u, &r, 4);
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
    } else {
        ((float *)p)[i] = f;
    }
}

static inline float param(const void *p, int dtype, int64_t i) {
    return dtype == BF16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* y = v rotated by RoPE (rotate-half layout; s carries the sign of the first half) over d numbers,
 * rounded as the eager model's x.mul_(cos).addcmul_(rolled, sin) rounds: after the product, then
 * after the sum. Rolled by half, the halves swap. */
static inline void rope_row(const float *v, const float *c, const float *s, int d, int dtype, float *y) {
    const int half = d / 2;
    #pragma omp simd
    for (int i = 0; i < half; i++) y[i] = as_dtype(as_dtype(v[i] * c[i], dtype) + v[i + half] * s[i], dtype);
    #pragma omp simd
    for (int i = half; i < d; i++) y[i] = as_dtype(as_dtype(v[i] * c[i], dtype) + v[i - half] * s[i], dtype);
}

/* One row of `kind` as floats. */
static inline void load_row(float *dst, const void *src, int kind, int d) {
    if (kind == F32) {
        memcpy(dst, src, sizeof(float) * d);
    } else if (kind == BF16) {
        const uint16_t *s = src;
        #pragma omp simd
        for (int i = 0; i < d; i++) dst[i] = bf16_to_float(s[i]);
    } else {
        const uint16_t *s = src;
        for (int i = 0; i < d; i++) dst[i] = f16_to_float(s[i]);
    }
}

/* d floats into a row of `kind` F32 or BF16 (rounded). */
static inline void store_row(void *dst, const float *src, int kind, int d) {
    if (kind == F32) {
        memcpy(dst, src, sizeof(float) * d);
    } else {
        uint16_t *s = dst;
        #pragma omp simd
        for (int i = 0; i < d; i++) {
            const float r = round_bf16(src[i]);
            uint32_t u;
            memcpy(&u, &r, 4);
            s[i] = (uint16_t)(u >> 16);
        }
    }
}

static inline size_t elem_size(int kind) { return kind == F32 ? 4 : kind <= F16 ? 2 : 1; }

/* A layer's paged cache: pages [2][KVH][NB][BS][row] of `kind` with their K and V scales where quantized (else
 * NULL), and its keys' summaries (kv/summaries.py: [KVH][NB][2][d] minimums and maximums, of summary_kind F32 or
 * BF16; NULL where not kept). */
typedef struct {
    const void *pages, *k_meta, *v_meta, *summary;
    int kind, kvh, nb, bs, d, summary_kind;
} Cache;

/* 2^f = e^(f ln 2) for f in [-1/2, 1/2] by its series to the 6th power (relative error about 1e-7):
 * (ln 2)^i / i!, the highest power first, for Horner's rule. */
static const float EXP2_SERIES[7] = {1.54035304e-4f, 1.33335581e-3f, 9.61812911e-3f, 5.55041087e-2f,
                                     2.40226507e-1f, 6.93147181e-1f, 1.0f};

/* e^x for x <= 0 (scores less their maximum), as 2^k * 2^f with k an integer: unlike libm's expf, loops
 * of it vectorize. */
static inline float exp_nonpositive(float x) {
    const float t = (x < -87.0f ? -87.0f : x) * 1.44269504f;       /* log2(e): 2^t, t >= -125.5 */
    const float k = (t + 12582912.0f) - 12582912.0f;               /* round to nearest (1.5 * 2^23) */
    const float f = t - k;
    float p = EXP2_SERIES[0];
    for (int i = 1; i < 7; i++) p = p * f + EXP2_SERIES[i];
    return p * bits_to_float((uint32_t)((int32_t)k + 127) << 23);
}

/* x * sigmoid(x), by e^-|x| (so that it vectorizes too). */
static inline float silu(float x) {
    const float z = exp_nonpositive(x < 0.0f ? x : -x);
    return x * (x < 0.0f ? z : 1.0f) / (1.0f + z);
}

/* silu(gate) * up, rounded as the eager model rounds: the SiLU's output, then the product. */
static inline float swiglu(float gate, float up, int dtype) {
    return as_dtype(as_dtype(silu(gate), dtype) * up, dtype);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* The first m of sixteen lanes (none for m <= 0). */
static inline __mmask16 lanes16(int m) { return m >= 16 ? 0xffff : m <= 0 ? 0 : (__mmask16)((1u << m) - 1); }

/* exp_nonpositive of sixteen numbers. */
static inline __m512 exp16_nonpositive(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504f));
    const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(t, k);
    __m512 p = _mm512_set1_ps(EXP2_SERIES[0]);
    for (int i = 1; i < 7; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_SERIES[i]));
    return _mm512_scalef_ps(p, k);      /* p * 2^k */
}

/* silu of sixteen numbers, as silu() computes it (the reciprocal to float32 precision, not the division). */
static inline __m512 silu16(__m512 x) {
    const __m512 z = exp16_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    const __m512 d = _mm512_add_ps(z, _mm512_set1_ps(1.0f)), r = _mm512_rcp14_ps(d);
    const __m512 inv = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));    /* a Newton step */
    const __m512 sig = _mm512_mul_ps(_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ),
                                                          _mm512_set1_ps(1.0f), z), inv);
    return _mm512_mul_ps(x, sig);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define AVX512_BW_VL 1     /* AVX-512 with its 16-bit lanes and narrower vectors: load16, and gemm.c */
#else
#define AVX512_BW_VL 0
#endif

#if AVX512_BW_VL
/* Sixteen numbers of a row of F32 or BF16 from number i on, as floats (lanes outside m: 0); bfloat16
 * widened as loaded, by a whole-vector load where it can (masked 16-bit loads are slow). */
static inline __attribute__((always_inline)) __m512 load16(const void *row, size_t i, __mmask16 m, int dtype) {
    if (dtype == BF16) {
        const uint16_t *r = (const uint16_t *)row + i;
        const __m256i h = m == 0xffff ? _mm256_loadu_si256((const __m256i *)r) : _mm256_maskz_loadu_epi16(m, r);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)row + i);
}

/* round_bf16 of sixteen numbers. */
static inline __m512 round16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f), top = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    const __m512i rounded = _mm512_and_si512(up, top), exponent = _mm512_set1_epi32(0x7f800000);
    const __mmask16 special = _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, exponent), exponent);
    if (__builtin_expect(special == 0, 1)) return _mm512_castsi512_ps(rounded);
    /* infinities and NaNs: cut to their top half, a NaN kept one by a set mantissa bit */
    const __m512i cut = _mm512_and_si512(u, top);
    const __m512i kept = _mm512_mask_or_epi32(cut, _mm512_test_epi32_mask(u, _mm512_set1_epi32(0xffff)), cut,
                                              _mm512_set1_epi32(0x400000));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(special, rounded, kept));
}

/* Sixteen floats that the row's dtype holds exactly (bfloat16: rounded already, round16) into a row of F32 or
 * BF16 from number i on (lanes outside m: not written). */
static inline __attribute__((always_inline)) void store16(void *row, size_t i, __mmask16 m, __m512 v, int dtype) {
    if (dtype == BF16) {
        const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
        if (m == 0xffff) _mm256_storeu_si256((__m256i *)((uint16_t *)row + i), h);
        else _mm256_mask_storeu_epi16((uint16_t *)row + i, m, h);
    } else {
        _mm512_mask_storeu_ps((float *)row + i, m, v);
    }
}
#endif

/* y = RMSNorm(x) * weight over `dim` numbers, rounded as the eager model rounds. */
static inline void rms_norm(const float *x, const void *weight, int dtype, int dim, float eps, float *y) {
#if AVX512_BW_VL
    __m512 squares = _mm512_setzero_ps();
    for (int i = 0; i < dim; i += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(lanes16(dim - i), x + i);
        squares = _mm512_fmadd_ps(v, v, squares);
    }
    const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(squares) / dim + eps);
    const __m512 scale = _mm512_set1_ps(inv);
    for (int i = 0; i < dim; i += 16) {
        const __mmask16 m = lanes16(dim - i);
        const __m512 v = _mm512_maskz_loadu_ps(m, x + i), w = load16(weight, i, m, dtype);
        /* bfloat16: the normalised number is rounded before the weight scales it (as in transformers) */
        const __m512 out = dtype == BF16 ? round16(_mm512_mul_ps(w, round16(_mm512_mul_ps(v, scale))))
                                         : _mm512_mul_ps(_mm512_mul_ps(v, scale), w);
        _mm512_mask_storeu_ps(y + i, m, out);
    }
#else
    float ss = 0.0f;
    #pragma omp simd reduction(+:ss)
    for (int i = 0; i < dim; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / dim + eps);
    for (int i = 0; i < dim; i++) {
        const float w = param(weight, dtype, i);
        /* bfloat16: the normalised number is rounded before the weight scales it (as in transformers) */
        y[i] = dtype == BF16 ? round_bf16(w * round_bf16(x[i] * inv)) : x[i] * inv * w;
    }
#endif
}

/* y = RMSNorm(x) * (1 + weight) over `dim` numbers: Gemma's norm, all in float32 and rounded once to dtype,
 * as the eager model's GemmaRMSNorm computes it. */
static inline void gemma_rms_norm(const float *x, const void *weight, int dtype, int dim, float eps, float *y) {
    float ss = 0.0f;
    #pragma omp simd reduction(+:ss)
    for (int i = 0; i < dim; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / dim + eps);
    for (int i = 0; i < dim; i++) y[i] = as_dtype(x[i] * inv * (param(weight, dtype, i) + 1.0f), dtype);
}

/* gelu_tanh(gate) * up (GeGLU, Gemma's MLP), rounded as the eager model rounds: the GELU's output, then the
 * product. The GELU as torch's approximate="tanh" writes it: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
static inline float geglu(float gate, float up, int dtype) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f, cube = gate * gate * gate;
    const float gelu = 0.5f * gate * (1.0f + tanhf(beta * (gate + kappa * cube)));
    return as_dtype(as_dtype(gelu, dtype) * up, dtype);
}

/* out[g][:] = softmax(q[g] . K^T * scale) V for the `groups` query heads (fp32) that share KV head
 * `h`, over the first `ctx` cached tokens of a sequence whose blocks are `table` (the last `window` of
 * them where window > 0), its scores s soft-capped to cap * tanh(s / cap) where cap > 0; 0, or -1 (out
 * untouched) where memory ran out. */
int attend_head(const Cache *c, int h, const int64_t *table, int64_t ctx, const float *q, int groups,
                 float scale, int64_t window, float cap, float *out);

/* The blocks one decode task reads (decode_blocks): `table`'s first blocks holding `ctx` tokens; `owned`, the
 * memory of a selection to free (or NULL). */
typedef struct {
    const int64_t *table;
    int64_t ctx;
    int64_t *owned;
} Blocks;

/* csrc/paged_decode.c: the blocks the decode task of KV head h of a sequence (blocks `table`, ctx cached tokens)
 * reads for its `groups` query heads q (rows of d floats): under sparse attention (kv/sparse.py) with budget > 0
 * and ctx > budget, the blocks of the first `sinks` tokens, those of the last `recent`, and the others of the
 * highest bounds by the cache's summaries up to budget tokens in whole blocks, in table order; else (budget 0:
 * dense, budget < 0: no sparse attention, or a choice that skips fewer bytes than it reads: kv/sparse.py's
 * selection_pays) the table itself. Where budget >= 0 it counts them: counts[0] += blocks
 * read, counts[1] += blocks of the context, and record[j] += 1 for each block j read (record NULL: none), both
 * atomically (the sequence's other tasks count into them too). 0, or -1 where memory ran out. */
int decode_blocks(const Cache *c, int h, const int64_t *table, int64_t ctx, const float *q, int groups,
                  int64_t budget, int64_t sinks, int64_t recent, int64_t *counts, uint8_t *record, Blocks *out);

/* csrc/kv_codecs.c: a token's row (d floats, numbers of the model's dtype) as K (which = 0) or V (1) of KV head h
 * at cache slot `slot` (block * bs + offset), written as the pages' kind holds it: as it is, or quantized by
 * kv/quant.py's codec of that kind, bit for bit; a key also into its block's summary, where the cache keeps them
 * (as kv/summaries.py's PageSummaries.add_tokens takes it in, bit for bit). */
void store_token(const Cache *c, int which, int h, int64_t slot, const float *row);
/* csrc/kv_codecs.c: x (d floats) times the block Hadamard matrix of kv/quant.py's rotate_keys_, in place, as it
 * computes it, rounded to dtype. */
void rotate_keys_row(float *x, int d, int dtype);

/* csrc/sampling.c's argmax of each row of x [rows][n] (rows `stride` numbers apart). */
void argmax_rows(const void *x, int rows, int n, int64_t stride, int dtype, int64_t *out, int threads);

/* csrc/gemm.c's kernels where the build has AVX2, FMA and F16C (x86-64-v3) but not AVX-512's 16-bit lanes: its
 * AVX2 tiles */
#if !AVX512_BW_VL && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define AVX2_FMA 1
#include <immintrin.h>
#else
#define AVX2_FMA 0
#endif
/* csrc/gemm.c's kernels where the build targets ARM64, whose every CPU has NEON (AdvSIMD): its NEON tiles */
#if defined(__aarch64__) && defined(__ARM_NEON)
#define NEON_FMA 1
#include <arm_neon.h>
#else
#define NEON_FMA 0
#endif
#define GEMM_SIMD (AVX512_BW_VL || AVX2_FMA || NEON_FMA)      /* csrc/gemm.c multiplies (gemm_dtypes) */

#if GEMM_SIMD
/* csrc/gemm.c's kernels: AVX-512's tiles, or AMX's, or (AVX2 builds) AVX2's, or (ARM64 builds) NEON's; and for
 * quantized weights AVX-512's tiles of int8 rows (VNNI) or of the weight widened to the dtype (WIDEN) (see there). */
enum { GEMM_AVX512 = 0, GEMM_AMX = 1, GEMM_AVX2 = 2, GEMM_NEON = 3, GEMM_VNNI = 4, GEMM_WIDEN = 5 };

/* csrc/gemm.c's share of one thread of a team (see there). */
void gemm_team(const void *packed, const void *scales, int kind, const void *bias, int dtype, const void *x,
               int64_t ldx, int m, int k, int n, void *y, int gated, int kernel);
/* Row `col` of a weight [n, k] (not gated) as floats, from its packed copy (csrc/gemm.c). */
void gemm_row(const void *packed, const void *scales, int kind, int dtype, int k, int64_t col, float *out);
#endif

#endif
