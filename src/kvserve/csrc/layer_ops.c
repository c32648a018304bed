/* Ops of a decoder layer between its matmuls, for the model run op by op on the CPU (prefill, and
 * decode steps of more sequences than the native step takes): the residual addition fused with the
 * RMSNorm after it, RoPE in place, and the K/V writes at their cache slots. torch runs each as
 * several passes with a dispatch each (RMSNorm: add, square, mean, add eps, rsqrt, two products;
 * RoPE: a rolled copy, a product, a multiply-add); here each is one pass, rounded where the eager
 * model rounds (`dtype`: F32 or BF16 of common.h). Rows are shared between the threads when there
 * are enough of them. */
#include <omp.h>

#include "common.h"

#define PARALLEL_FROM (1 << 16)     /* numbers: below this, one thread is faster than waking more */

/* residual[t] += x[t] (x NULL: no addition), then out[t] = RMSNorm(residual[t]) * weight, for n rows
 * of dim numbers. 0, or -1 (nothing written) where memory ran out. */
int add_rms_norm(const void *x, void *residual, const void *weight, void *out, int n, int dim, float eps,
                 int dtype, int threads) {
    const size_t row_bytes = (size_t)dim * elem_size(dtype);
    const size_t stride = ((size_t)dim + 15) / 16 * 16;      /* whole cache lines, for the vector loops */
    float *rows = aligned_alloc(64, sizeof(float) * 3 * stride * threads);     /* three rows per thread */
    if (!rows) return -1;
    #pragma omp parallel num_threads(threads) if ((int64_t)n * dim >= PARALLEL_FROM)
    {
        float *sum = rows + 3 * stride * omp_get_thread_num(), *add = sum + stride, *y = add + stride;
        #pragma omp for schedule(static)
        for (int t = 0; t < n; t++) {
            char *r = (char *)residual + t * row_bytes;
#if AVX512_BW_VL
            (void)add;
            for (int i = 0; i < dim; i += 16) {
                const __mmask16 m = lanes16(dim - i);
                __m512 v = load16(r, i, m, dtype);
                if (x) {
                    v = _mm512_add_ps(v, load16((const char *)x + t * row_bytes, i, m, dtype));
                    if (dtype == BF16) v = round16(v);
                    store16(r, i, m, v, dtype);
                }
                _mm512_storeu_ps(sum + i, v);
            }
            rms_norm(sum, weight, dtype, dim, eps, y);
            for (int i = 0; i < dim; i += 16)      /* y is rounded as the dtype holds it */
                store16((char *)out + t * row_bytes, i, lanes16(dim - i), _mm512_loadu_ps(y + i), dtype);
#else
            load_row(sum, r, dtype, dim);
            if (x) {
                load_row(add, (const char *)x + t * row_bytes, dtype, dim);
                #pragma omp simd
                for (int i = 0; i < dim; i++) sum[i] = as_dtype(sum[i] + add[i], dtype);
                store_row(r, sum, dtype, dim);
            }
            rms_norm(sum, weight, dtype, dim, eps, y);
            store_row((char *)out + t * row_bytes, y, dtype, dim);
#endif
        }
    }
    free(rows);
    return 0;
}

/* x[t][h] rotated in place by RoPE (rotate-half layout; sin carries the sign of the first half) for
 * the `heads` heads of d numbers that start each of n rows `stride` numbers apart; cos and sin [n][d]. */
void rope(void *x, int64_t stride, int n, int heads, int d, const void *cos, const void *sin, int dtype,
          int threads) {
    const size_t es = elem_size(dtype);
    #pragma omp parallel for num_threads(threads) schedule(static) if ((int64_t)n * heads * d >= PARALLEL_FROM)
    for (int t = 0; t < n; t++) {
        float c[d], s[d], v[d], y[d];
        load_row(c, (const char *)cos + (int64_t)t * d * es, dtype, d);
        load_row(s, (const char *)sin + (int64_t)t * d * es, dtype, d);
        for (int h = 0; h < heads; h++) {
            char *row = (char *)x + (t * stride + (int64_t)h * d) * es;
            load_row(v, row, dtype, d);
            rope_row(v, c, s, d, dtype, y);
            store_row(row, y, dtype, d);
        }
    }
}

/* The K and V [n][2][kvh][d] of n tokens (rows `stride` numbers apart) written to pages
 * [2][kvh][nb][bs][d] at their slots (block * bs + offset), elements of `es` bytes; a slot outside
 * the pages (a padding token's -1) writes nothing. */
void store_kv(const void *kv, int64_t stride, int n, int kvh, int d, const int64_t *slots, void *pages, int64_t nb,
              int bs, int es) {
    for (int t = 0; t < n; t++)
        for (int which = 0; which < 2 && slots[t] >= 0 && slots[t] < nb * bs; which++)
            for (int h = 0; h < kvh; h++) {
                const int64_t page_row = (((int64_t)which * kvh + h) * nb * bs + slots[t]) * d;
                memcpy((char *)pages + page_row * es, (const char *)kv + (t * stride + ((int64_t)which * kvh + h) * d) * es,
                       (size_t)d * es);
            }
}
