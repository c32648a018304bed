/* Greedy sampling's argmax over rows of logits, float32 or bfloat16 (`dtype`: F32 or BF16 of common.h) as the
 * model wrote them: one pass over each row, where torch needs the bfloat16 logits widened first and two
 * passes (its argmax does not vectorize on the CPU). torch's answer: the first maximum, and the first NaN
 * if there is one (NaN counts as the largest). */
#include "common.h"

#if AVX512_BW_VL

/* Numbers asked for ahead of the one read: the logits come straight from the lm_head's GEMM, half of
 * each row in the other core's cache, and the hardware prefetchers fetch those too late (without it, 523
 * us for 64 x 32000 float32 logits after the GEMM; with it, 146; 256 to 1024 ahead all alike). */
#define PREFETCH 512
#define CHAINS 4     /* independent maxima, so that one vector's compare need not wait for the last's */

static int64_t argmax_row(const void *row, int n, int dtype) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 best[CHAINS];
    __m512i where[CHAINS];      /* each lane's first maximum: its first number if all are -inf */
    for (int c = 0; c < CHAINS; c++) best[c] = _mm512_set1_ps(-INFINITY), where[c] = lanes;
    for (int i0 = 0; i0 < n; i0 += 16 * CHAINS)
        for (int c = 0; c < CHAINS; c++) {
            const int i = i0 + 16 * c;
            _mm_prefetch((const char *)row + (int64_t)(i + PREFETCH) * elem_size(dtype), _MM_HINT_T0);
            const __mmask16 m = lanes16(n - i);
            const __m512 v = load16(row, i, m, dtype);
            const __mmask16 nan = _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
            if (nan) return i + __builtin_ctz(nan);
            /* lanes past n never move */
            const __mmask16 up = _mm512_mask_cmp_ps_mask(m, v, best[c], _CMP_GT_OQ);
            best[c] = _mm512_mask_mov_ps(best[c], up, v);
            where[c] = _mm512_mask_mov_epi32(where[c], up, _mm512_add_epi32(lanes, _mm512_set1_epi32(i)));
        }
    float top = -INFINITY;
    for (int c = 0; c < CHAINS; c++) top = fmaxf(top, _mm512_reduce_max_ps(best[c]));
    int64_t at = n;
    for (int c = 0; c < CHAINS; c++) {
        const __mmask16 at_top = _mm512_cmp_ps_mask(best[c], _mm512_set1_ps(top), _CMP_EQ_OQ);
        if (at_top) {
            const int64_t first = _mm512_mask_reduce_min_epi32(at_top, where[c]);
            at = first < at ? first : at;
        }
    }
    return at;
}
#else
static int64_t argmax_row(const void *row, int n, int dtype) {
    int64_t at = 0;
    float top = -INFINITY;
    for (int i = 0; i < n; i++) {
        const float v = param(row, dtype, i);
        if (v != v) return i;
        if (v > top) top = v, at = i;
    }
    return at;
}
#endif

/* out[r] = the argmax of row r of x [rows][n], rows `stride` numbers apart. */
void argmax_rows(const void *x, int rows, int n, int64_t stride, int dtype, int64_t *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if ((int64_t)rows * n >= 1 << 16)
    for (int r = 0; r < rows; r++) out[r] = argmax_row((const char *)x + r * stride * elem_size(dtype), n, dtype);
}
