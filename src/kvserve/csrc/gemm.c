/* y[m][n] = x[m][k] . W[n][k]^T (+ bias[n]): the CPU's linear layers, float32 or bfloat16 (`dtype`: F32
 * or BF16 of common.h), with AVX-512 F, BW and VL (bfloat16: also its BF16 extension). A GotoBLAS-style
 * GEMM over a weight packed once at load: panels of NR = 32 output columns, each stored k-row by k-row
 * (bfloat16: pairs of k rows interleaved, as VDPBF16PS reads them). A tile of up to MR = 14 input rows
 * by one panel keeps its 28 sums in registers while a k-chunk of the panel (32 KiB, in L1) and of the
 * rows (in L2) goes by; the threads share the panels. oneDNN's prepacked GEMM is tuned for large
 * matrices; this one for the few rows of decode steps, where it takes less time, while prefill's
 * thousands of rows run about as fast in either (docs/performance.md). Sums run in float32, in
 * k order within chunks of KC (at a few rows and k of hundreds, float32 errors up to a few times
 * those of torch's GEMM); a bfloat16 output is rounded once, to nearest even.
 *
 * A gated weight (an MLP's gate_proj and up_proj as one [2n, k]) is packed by pairs of panels, gate
 * columns then the same up columns, and multiplied into silu(gate) * up as the sums are written
 * (SwiGLU): the 2n products are never stored, nor read back by a separate activation pass. */
#include "common.h"

#if AVX512_BW_VL

#define NV 2                 /* vectors of 16 columns per panel */
#define NR (16 * NV)
#define MR 14                /* rows per tile: 28 sums + 2 weight vectors + 1 broadcast in 32 registers */
#define MC (18 * MR)         /* rows that share a pass over the panels: their k-chunk stays in L2 */
#define KC 256               /* k per chunk (bfloat16: 512): NR x KC of the panel fills half of L1 */

/* Bits of the dtypes this build multiplies (1 << F32 | 1 << BF16). */
int gemm_dtypes(void) {
#if defined(__AVX512BF16__)
    return 1 << F32 | 1 << BF16;
#else
    return 1 << F32;
#endif
}

/* Panels of a weight of n output columns (gated: n = 2 x its outputs; a pair of panels per 32 outputs). */
static int num_panels(int n, int gated) { return gated ? 2 * ((n / 2 + NR - 1) / NR) : (n + NR - 1) / NR; }

/* Numbers (of the weight's dtype) the packed copy of an [n, k] weight takes. */
int64_t gemm_packed_size(int dtype, int n, int k, int gated) {
    return (int64_t)num_panels(n, gated) * (dtype == BF16 ? (k + 1) / 2 * 2 : k) * NR;
}

/* The weight's row (output column) that column j of panel p holds, or -1 for none (padding). */
static int panel_column(int p, int j, int n, int gated) {
    if (!gated) return p * NR + j < n ? p * NR + j : -1;
    const int half = n / 2, col = p / 2 * NR + j;
    return col < half ? (p % 2) * half + col : -1;
}

/* Where number kk of column j of panel p lies in a packed weight of `depth` k rows a panel (bfloat16: pairs
 * of k rows interleaved, column by column). */
static inline int64_t packed_at(int dtype, int p, int depth, int kk, int j) {
    return dtype == BF16 ? ((int64_t)p * depth + kk / 2 * 2) * NR + 2 * j + kk % 2 : ((int64_t)p * depth + kk) * NR + j;
}

void gemm_pack(const void *w, int dtype, int n, int k, int gated, void *packed) {
    const int panels = num_panels(n, gated), depth = dtype == BF16 ? (k + 1) / 2 * 2 : k;
    const size_t size = elem_size(dtype);
    #pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++)
        for (int kk = 0; kk < depth; kk++)
            for (int j = 0; j < NR; j++) {
                const int col = panel_column(p, j, n, gated);
                const int64_t to = packed_at(dtype, p, depth, kk, j);
                if (col >= 0 && kk < k)
                    memcpy((char *)packed + to * size, (const char *)w + ((int64_t)col * k + kk) * size, size);
                else
                    memset((char *)packed + to * size, 0, size);
            }
}

/* Row `col` of a (not gated) weight [n, k] as floats, from its packed copy: an embedding table whose only copy
 * is the packed weight of the tied lm_head. */
void gemm_row(const void *packed, int dtype, int k, int64_t col, float *out) {
    const int depth = dtype == BF16 ? (k + 1) / 2 * 2 : k, p = (int)(col / NR), j = (int)(col % NR);
    for (int kk = 0; kk < k; kk++) out[kk] = param(packed, dtype, packed_at(dtype, p, depth, kk, j));
}

/* Rows ids[0..count) of a (not gated) weight [n, k], from its packed copy, into out [count, k] of its dtype. */
void gemm_rows(const void *packed, int dtype, int k, const int64_t *ids, int count, void *out, int threads) {
    const int depth = dtype == BF16 ? (k + 1) / 2 * 2 : k;
    const size_t size = elem_size(dtype);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int i = 0; i < count; i++) {
        const int p = (int)(ids[i] / NR), j = (int)(ids[i] % NR);
        for (int kk = 0; kk < k; kk++)
            memcpy((char *)out + ((int64_t)i * k + kk) * size,
                   (const char *)packed + packed_at(dtype, p, depth, kk, j) * size, size);
    }
}

/* What a panel's last k-chunk writes: y; or (a gated weight's) its gate sums, or silu(gate) * up. */
enum { PLAIN, GATE, SWIGLU };

typedef struct {
    int first, last;        /* the k-chunk starts the sums / ends them (the output is written) */
    int cols;               /* columns of the panel that are real (the last panel may be partial) */
    const void *bias;       /* NULL: none */
    int out;                /* PLAIN, GATE or SWIGLU */
    float *gate;            /* GATE, SWIGLU: the tile's gate sums, as the dtype rounds them, NR a row */
} Chunk;

static inline __attribute__((always_inline)) void begin(__m512 acc[MR][NV]) {
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NV; j++) acc[r][j] = _mm512_setzero_ps();
}


/* v as the dtype holds it: bfloat16 rounded to nearest even (builds with BF16; others multiply only
 * float32). */
static inline __m512 rounded(__m512 v, int dtype) {
#if defined(__AVX512BF16__)
    if (dtype == BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
#else
    (void)dtype;
#endif
    return v;
}

/* The chunk's sums join the earlier chunks' in `partial` (sums of chunks, not one running sum: the
 * rounding error grows with KC, not k), or (last chunk) go with the bias to y. */
static inline __attribute__((always_inline)) void finish(__m512 acc[MR][NV], float *partial, int mr, const Chunk *c,
                                                        int dtype, void *y, int ldy) {
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < NV; j++) {
            __m512 v = c->first ? acc[r][j] : _mm512_add_ps(_mm512_loadu_ps(partial + r * NR + 16 * j), acc[r][j]);
            if (!c->last) {
                _mm512_storeu_ps(partial + r * NR + 16 * j, v);
                continue;
            }
            const __mmask16 m = lanes16(c->cols - 16 * j);
            /* not load16: its whole-vector branch, inlined here, slows the bfloat16 tiles */
            if (c->bias)
                v = _mm512_add_ps(v, dtype == BF16
                    ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                          _mm256_maskz_loadu_epi16(m, (const uint16_t *)c->bias + 16 * j)), 16))
                    : _mm512_maskz_loadu_ps(m, (const float *)c->bias + 16 * j));
            if (c->out != PLAIN) {       /* as swiglu() rounds, the gate and up sums first */
                float *gate = c->gate + r * NR + 16 * j;
                v = rounded(v, dtype);
                if (c->out == GATE) {
                    _mm512_storeu_ps(gate, v);
                    continue;
                }
                v = rounded(_mm512_mul_ps(rounded(silu16(_mm512_loadu_ps(gate)), dtype), v), dtype);
            }
            if (dtype == BF16) {
#if defined(__AVX512BF16__)
                _mm256_mask_storeu_epi16((uint16_t *)y + (int64_t)r * ldy + 16 * j, m,
                                         (__m256i)_mm512_cvtneps_pbh(v));
#endif
            } else {
                _mm512_mask_storeu_ps((float *)y + (int64_t)r * ldy + 16 * j, m, v);
            }
        }
}

/* mr rows of x (ldx apart) by kc rows of a float32 panel; `next`, if any, is prefetched: the chunk the
 * thread takes after this one. */
static inline __attribute__((always_inline)) void tile_f32(const float *panel, const float *next, const float *x,
                                                          int64_t ldx, int kc, int mr, float *partial,
                                                          const Chunk *c, void *y, int ldy) {
    __m512 acc[MR][NV];
    begin(acc);
    for (int kk = 0; kk < kc; kk++) {
        const float *b = panel + (int64_t)kk * NR;
        __m512 bv[NV];
        for (int j = 0; j < NV; j++) {
            if (next) _mm_prefetch((const char *)(next + (int64_t)kk * NR + 16 * j), _MM_HINT_T1);
            bv[j] = _mm512_loadu_ps(b + 16 * j);
        }
        for (int r = 0; r < mr; r++) {
            const __m512 a = _mm512_set1_ps(x[r * ldx + kk]);
            for (int j = 0; j < NV; j++) acc[r][j] = _mm512_fmadd_ps(a, bv[j], acc[r][j]);
        }
    }
    finish(acc, partial, mr, c, F32, y, ldy);
}

#if defined(__AVX512BF16__)
/* k rows kk, kk + 1 of a bfloat16 panel into the sums: x's pair of numbers broadcast as one 32-bit lane. */
static inline __attribute__((always_inline)) void step_bf16(__m512 acc[MR][NV], const uint16_t *b,
                                                           const uint16_t *next, const uint16_t *x, int64_t ldx,
                                                           int kk, int mr, int odd) {
    __m512bh bv[NV];
    for (int j = 0; j < NV; j++) {
        if (next) _mm_prefetch((const char *)(next + (int64_t)kk * NR + 32 * j), _MM_HINT_T1);
        bv[j] = (__m512bh)_mm512_loadu_si512(b + (int64_t)kk * NR + 32 * j);
    }
    for (int r = 0; r < mr; r++) {
        uint32_t pair = x[r * ldx + kk];       /* odd: the last k row, its pair's second number zero */
        if (!odd) memcpy(&pair, x + r * ldx + kk, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
        for (int j = 0; j < NV; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, bv[j]);
    }
}

/* As tile_f32, for a bfloat16 panel, two k rows a step. */
static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *panel, const uint16_t *next,
                                                           const uint16_t *x, int64_t ldx, int kc, int mr,
                                                           float *partial, const Chunk *c, void *y, int ldy) {
    __m512 acc[MR][NV];
    begin(acc);
    int kk = 0;
    for (; kk + 1 < kc; kk += 2) step_bf16(acc, panel, next, x, ldx, kk, mr, 0);
    if (kk < kc) step_bf16(acc, panel, next, x, ldx, kk, mr, 1);
    finish(acc, partial, mr, c, BF16, y, ldy);
}
#endif

/* One tile, its row count a constant in each case, so that the sums stay in registers. */
static void tile(int dtype, const void *panel, const void *next, const void *x, int64_t ldx, int kc, int mr,
                 float *partial, const Chunk *c, void *y, int ldy) {
    (void)dtype;        /* a build without BF16 multiplies float32 only */
#if defined(__AVX512BF16__)
#define ROWS_BF16(R) if (dtype == BF16) { tile_bf16(panel, next, x, ldx, kc, R, partial, c, y, ldy); break; }
#else
#define ROWS_BF16(R)
#endif
#define ROWS(R) case R: ROWS_BF16(R) tile_f32(panel, next, x, ldx, kc, R, partial, c, y, ldy); break;
    switch (mr) {
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7)
        ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14)
    }
#undef ROWS
#undef ROWS_BF16
}

/* gemm's share of one thread of a team: call from every thread of a parallel region; y is whole once
 * they have all returned and met at a barrier (this ends without one). y has n columns; a gated
 * weight holds 2n (packed with gated set) and y = silu(gate) * up. */
void gemm_team(const void *packed, const void *bias, int dtype, const void *x, int64_t ldx, int m, int k, int n,
               void *y, int gated) {
    const int panels = num_panels(gated ? 2 * n : n, gated), depth = dtype == BF16 ? (k + 1) / 2 * 2 : k;
    const int kc_max = dtype == BF16 ? 2 * KC : KC, per_unit = gated ? 2 : 1;
    const size_t size = elem_size(dtype);
    float partial[MC * NR] __attribute__((aligned(64))), gate[MC * NR] __attribute__((aligned(64)));
    for (int m0 = 0; m0 < m; m0 += MC) {
        const int mb = m - m0 < MC ? m - m0 : MC, groups = (mb + MR - 1) / MR;
        /* units of work: a panel, or a gated weight's pair, whose NR columns of y it writes */
        #pragma omp for schedule(static) nowait
        for (int u = 0; u < panels / per_unit; u++)
            for (int p = u * per_unit; p < (u + 1) * per_unit; p++) {
                const char *panel = (const char *)packed + (int64_t)p * depth * NR * size;
                const int out = gated ? (p % 2 ? SWIGLU : GATE) : PLAIN;
                const int64_t bias_at = (gated && p % 2 ? n : 0) + (int64_t)u * NR;
                for (int k0 = 0; k0 < k; k0 += kc_max) {
                    const int kc = k - k0 < kc_max ? k - k0 : kc_max;
                    const Chunk c = {k0 == 0, k0 + kc >= k, n - u * NR < NR ? n - u * NR : NR,
                                     bias ? (const char *)bias + bias_at * size : NULL, out, gate};
                    /* the thread's next chunk: this panel's next k-chunk, else the next panel's first */
                    const char *next = c.last ? (p + 1 < panels ? panel + (int64_t)depth * NR * size : NULL)
                                              : panel + (int64_t)(k0 + kc) * NR * size;
                    for (int g = 0, r0 = 0; g < groups; g++) {
                        const int mr = mb / groups + (g < mb % groups);
                        Chunk rows = c;
                        rows.gate = gate + r0 * NR;
                        tile(dtype, panel + (int64_t)k0 * NR * size, g == 0 ? next : NULL,
                             (const char *)x + ((m0 + r0) * ldx + k0) * size, ldx, kc, mr, partial + r0 * NR, &rows,
                             (char *)y + ((int64_t)(m0 + r0) * n + u * NR) * size, n);
                        r0 += mr;
                    }
                }
            }
    }
}

/* y [m, n] (row stride n) = x [m, k] (row stride ldx) . W^T + bias, W packed by gemm_pack (gated: W
 * [2n, k] and y = silu(gate) * up, gate and up each with their half of the bias). */
void gemm(const void *packed, const void *bias, int dtype, const void *x, int64_t ldx, int m, int k, int n, void *y,
          int gated, int threads) {
    #pragma omp parallel num_threads(threads)
    gemm_team(packed, bias, dtype, x, ldx, m, k, n, y, gated);
}
#else
int gemm_dtypes(void) { return 0; }
#endif
