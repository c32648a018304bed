/* A whole decode step of a Llama-family decoder on the CPU in one call: embedding, every layer
 * (RMSNorm, QKV, RoPE, K/V written at their slots, paged attention, O, RMSNorm, gate/up, SiLU, down)
 * and the logits, for sequences of one new token each.
 *
 * Decoding a few tokens reads every weight once per step: the step is bound by memory reads, and
 * run op by op from Python it loses as much time again in dispatch and in small-matrix overheads.
 * Here one OpenMP team runs the step: matrix-vector products split their rows between the threads,
 * attention its (sequence, KV head) tasks, and norms, RoPE and SiLU the sequences. With more
 * sequences the step is bound by computing: from `gemm_from` on, the layers packed for csrc/gemm.c
 * multiply by it, and the step saves what op by op costs between the GEMMs (dispatch, and each op's
 * own pass over the activations).
 *
 * Weights are row-major [out][in] as torch's Linear keeps them, float32 or bfloat16 (`dtype`, the
 * kinds of common.h), and the cache holds the same dtype. Activations are float32 here; in a
 * bfloat16 model they are rounded to bfloat16 wherever the eager model holds them in bfloat16, so
 * that both compute the same numbers up to the order of the sums.
 */
#include "common.h"

/* A linear layer: its weight [out][in] as torch keeps it, bias (or NULL), and the weight packed for
 * csrc/gemm.c (or NULL: the matrix-vector products only). */
typedef struct {
    const void *w, *b, *packed;
} Proj;

typedef struct {
    Proj qkv, o, gate_up, down;
    const void *input_norm, *post_norm, *q_norm, *k_norm;    /* q_norm, k_norm: Qwen3's, else NULL */
    void *kv;                                                 /* pages [2][KVH][NB][BS][D] */
} Layer;

typedef struct {
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab, dtype;
    int num_blocks, block_size;
    float eps, scale;
    const void *embed, *norm;
    Proj lm_head;
    const Layer *layers;
} Model;

/* out[j] = w . x[j] for the four inputs x[0..3] (three: repeat one), w in the model's dtype: each
 * weight is loaded and converted once for all four. */
static inline void dot4(const void *w, int dtype, int64_t in, const float *const x[4], float out[4]) {
    const float *restrict x0 = x[0], *restrict x1 = x[1], *restrict x2 = x[2], *restrict x3 = x[3];
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    if (dtype == BF16) {
        const uint16_t *r = w;
        #pragma omp simd reduction(+:a0, a1, a2, a3)
        for (int64_t k = 0; k < in; k++) {
            const float v = bf16_to_float(r[k]);
            a0 += v * x0[k], a1 += v * x1[k], a2 += v * x2[k], a3 += v * x3[k];
        }
    } else {
        const float *r = w;
        #pragma omp simd reduction(+:a0, a1, a2, a3)
        for (int64_t k = 0; k < in; k++) {
            const float v = r[k];
            a0 += v * x0[k], a1 += v * x1[k], a2 += v * x2[k], a3 += v * x3[k];
        }
    }
    out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3;
}

/* out[j] = w . x[j] for two inputs. */
static inline void dot2(const void *w, int dtype, int64_t in, const float *restrict x0, const float *restrict x1,
                        float out[2]) {
    float a0 = 0.0f, a1 = 0.0f;
    if (dtype == BF16) {
        const uint16_t *r = w;
        #pragma omp simd reduction(+:a0, a1)
        for (int64_t k = 0; k < in; k++) {
            const float v = bf16_to_float(r[k]);
            a0 += v * x0[k], a1 += v * x1[k];
        }
    } else {
        const float *r = w;
        #pragma omp simd reduction(+:a0, a1)
        for (int64_t k = 0; k < in; k++) a0 += r[k] * x0[k], a1 += r[k] * x1[k];
    }
    out[0] = a0, out[1] = a1;
}

static inline float dot(const void *w, int dtype, int64_t in, const float *restrict x) {
    float a = 0.0f;
    if (dtype == BF16) {
        const uint16_t *r = w;
        #pragma omp simd reduction(+:a)
        for (int64_t k = 0; k < in; k++) a += bf16_to_float(r[k]) * x[k];
    } else {
        const float *r = w;
        #pragma omp simd reduction(+:a)
        for (int64_t k = 0; k < in; k++) a += r[k] * x[k];
    }
    return a;
}

#ifdef __AVX512BF16__
/* y[o] = w[o] . x + b[o] for one bfloat16 input held in floats, by the CPU's bfloat16 dot-product
 * instruction (exact products, float32 sums) on the weights as loaded: converting them to float32
 * first keeps one sequence's step bound by computing, not by memory (1.61 -> 1.48 ms a step
 * measured here). Whole vectors only (masked 16-bit loads are slow on some CPUs): the last numbers
 * of a row, fewer than 64, are added one by one. */
static void linear_bf16_one(const uint16_t *w, const void *b, const float *x, int in, int out, float *y) {
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)in);      /* each thread its own copy */
    for (int i = 0; i < in; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        xb[i] = (uint16_t)(u >> 16);      /* exact: x holds bfloat16 numbers */
    }
    const int whole = in / 64 * 64;
    #pragma omp for schedule(static)
    for (int o = 0; o < out; o++) {
        const uint16_t *r = w + (size_t)o * in;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        for (int k = 0; k < whole; k += 64) {
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(r + k), (__m512bh)_mm512_loadu_si512(xb + k));
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(r + k + 32),
                                  (__m512bh)_mm512_loadu_si512(xb + k + 32));
        }
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
        for (int k = whole; k < in; k++) sum += bf16_to_float(r[k]) * bf16_to_float(xb[k]);
        y[o] = round_bf16(sum + (b ? param(b, BF16, o) : 0.0f));
    }
    free(xb);
}
#endif

/* y[t][o] = w[o] . x[t] + b[o] for n rows of x; the team shares the output rows (call from every
 * thread). The weight is read once: each row meets the inputs four at a time while it is in cache. */
static void linear(const void *w, const void *b, int dtype, const float *x, int n, int in, int out, float *y,
                   int y_stride) {
#ifdef __AVX512BF16__
    if (dtype == BF16 && n == 1) {
        linear_bf16_one(w, b, x, in, out, y);
        return;
    }
#endif
    const size_t row_bytes = (size_t)in * (dtype == BF16 ? 2 : 4);
    #pragma omp for schedule(static)
    for (int o = 0; o < out; o++) {
        const void *row = (const char *)w + (size_t)o * row_bytes;
        const float bias = b ? param(b, dtype, o) : 0.0f;
        if (n == 1) {
            y[o] = as_dtype(dot(row, dtype, in, x) + bias, dtype);
            continue;
        }
        for (int t = 0; t < n; t += 4) {
            const int m = n - t < 4 ? n - t : 4;
            const float *xs[4];
            float r[4];
            for (int j = 0; j < 4; j++) xs[j] = x + (size_t)(t + (j < m ? j : 0)) * in;
            if (m == 2) dot2(row, dtype, in, xs[0], xs[1], r);
            else dot4(row, dtype, in, xs, r);
            for (int j = 0; j < m; j++) y[(size_t)(t + j) * y_stride + o] = as_dtype(r[j] + bias, dtype);
        }
    }
}

#if AVX512_BW_VL
/* yd[t] = p . x[t] + b in the model's dtype, by csrc/gemm.c, for the n rows of x (float32, `in` numbers
 * apart; bfloat16: converted into xd first, exactly, since they hold bfloat16 numbers). Called from every
 * thread of the team; yd is whole when it returns. */
static void gemm_rows(const Proj *p, int dtype, const float *x, int n, int in, int out, void *yd, void *xd) {
    if (dtype == BF16) {
        #pragma omp for schedule(static)
        for (int t = 0; t < n; t++) store_row((uint16_t *)xd + (size_t)t * in, x + (size_t)t * in, BF16, in);
    }
    gemm_team(p->packed, p->b, dtype, dtype == BF16 ? xd : x, in, n, in, out, yd);
    #pragma omp barrier
}
#endif

/* y[t] = p . x[t] + b for the n rows of x (float32, `in` numbers apart) into y (float32, rows `out`
 * apart): by the packed GEMM where the step takes it (`gemm`, and p is packed), else by the
 * matrix-vector products. xd, yd: room for the GEMM's bfloat16 rows. Called from every thread. */
static void project(const Proj *p, int dtype, const float *x, int n, int in, int out, float *y, int gemm,
                    void *xd, void *yd) {
#if AVX512_BW_VL
    if (gemm && p->packed) {
        gemm_rows(p, dtype, x, n, in, out, dtype == BF16 ? yd : (void *)y, xd);
        if (dtype == BF16) {
            #pragma omp for schedule(static)
            for (int t = 0; t < n; t++) load_row(y + (size_t)t * out, (uint16_t *)yd + (size_t)t * out, BF16, out);
        }
        return;
    }
#else
    (void)gemm, (void)xd, (void)yd;
#endif
    linear(p->w, p->b, dtype, x, n, in, out, y, out);
}

/* x[:] rotated by RoPE in place, by the float32 cos/sin of its position rounded to the model's dtype
 * (as the eager model casts them). */
static void rope(float *x, const float *cos, const float *sin, int d, int dtype) {
    float c[d], s[d], rotated[d];
    for (int i = 0; i < d; i++) c[i] = as_dtype(cos[i], dtype), s[i] = as_dtype(sin[i], dtype);
    rope_row(x, c, s, d, dtype, rotated);
    memcpy(x, rotated, sizeof(rotated));
}

/* Q/K norms and RoPE of token t's q and k heads, then its K and V written at its cache slot. */
static void position_and_store(const Model *m, const Layer *l, float *qkv, int64_t position, int64_t slot,
                               const float *cos_table, const float *sin_table) {
    const int d = m->head_dim, nh = m->num_heads, nkv = m->num_kv_heads, dt = m->dtype;
    const float *cos = cos_table + position * d, *sin = sin_table + position * d;
    for (int h = 0; h < nh + nkv; h++) {
        float *head = qkv + (size_t)h * d;
        if (l->q_norm) rms_norm(head, h < nh ? l->q_norm : l->k_norm, dt, d, m->eps, head);
        rope(head, cos, sin, d, dt);
    }
    const int64_t block = slot / m->block_size, offset = slot % m->block_size;
    for (int which = 0; which < 2; which++)
        for (int h = 0; h < nkv; h++) {
            const float *src = qkv + ((size_t)(nh + which * nkv + h)) * d;
            const int64_t row = ((((int64_t)which * nkv + h) * m->num_blocks + block) * m->block_size + offset) * d;
            for (int i = 0; i < d; i++) store(l->kv, dt, row + i, src[i]);
        }
}

/* logits[t] (in the model's dtype) of the next token after input_ids[t], for n sequences decoding one
 * token each at `positions`, writing their K/V at `slots` and attending over their pages. From
 * `gemm_from` sequences on, the layers the model packed for csrc/gemm.c run by it: there the weights
 * are read once for many rows and the step is bound by computing, not by reading them. */
void decode_step(const Model *m, int n, const int64_t *input_ids, const int64_t *positions, const int64_t *slots,
                 const int64_t *block_tables, int table_width, const int64_t *context_lens,
                 const float *cos_table, const float *sin_table, void *logits, int gemm_from, int threads) {
    const int hdim = m->hidden, d = m->head_dim, nh = m->num_heads, nkv = m->num_kv_heads;
    const int inter = m->intermediate, dt = m->dtype, q_size = nh * d, qkv_size = (nh + 2 * nkv) * d;
    const int gemm = n >= gemm_from;
#if AVX512_BW_VL
    const int head_gemm = gemm && m->lm_head.packed;       /* the logits straight from the GEMM */
#else
    const int head_gemm = 0;
#endif
    const int widest_in = inter > hdim ? (inter > q_size ? inter : q_size) : (hdim > q_size ? hdim : q_size);
    const int widest_out = 2 * inter > qkv_size ? (2 * inter > hdim ? 2 * inter : hdim) : qkv_size;
    float *x = malloc(sizeof(float) * n * hdim), *h = malloc(sizeof(float) * n * hdim);
    float *qkv = malloc(sizeof(float) * n * qkv_size), *attn = malloc(sizeof(float) * n * q_size);
    float *gate_up = malloc(sizeof(float) * n * 2 * inter), *act = malloc(sizeof(float) * n * inter);
    float *y = malloc(sizeof(float) * n * (head_gemm || hdim > m->vocab ? hdim : m->vocab));
    void *xd = gemm && dt == BF16 ? malloc(2 * (size_t)n * widest_in) : NULL;
    void *yd = gemm && dt == BF16 ? malloc(2 * (size_t)n * widest_out) : NULL;
    for (int t = 0; t < n; t++)
        for (int i = 0; i < hdim; i++) x[t * hdim + i] = param(m->embed, dt, input_ids[t] * hdim + i);
    #pragma omp parallel num_threads(threads)
    {
        for (int li = 0; li < m->num_layers; li++) {
            const Layer *l = &m->layers[li];
            const Cache cache = {l->kv, NULL, NULL, NULL, NULL, dt, 0, nkv, m->num_blocks, m->block_size, d, 0};
            #pragma omp for schedule(static)
            for (int t = 0; t < n; t++) rms_norm(x + t * hdim, l->input_norm, dt, hdim, m->eps, h + t * hdim);
            project(&l->qkv, dt, h, n, hdim, qkv_size, qkv, gemm, xd, yd);
            #pragma omp for schedule(static)
            for (int t = 0; t < n; t++)
                position_and_store(m, l, qkv + (size_t)t * qkv_size, positions[t], slots[t], cos_table, sin_table);
            #pragma omp for collapse(2) schedule(dynamic)
            for (int t = 0; t < n; t++)
                for (int kh = 0; kh < nkv; kh++) {
                    const int groups = nh / nkv;
                    float *o = attn + (size_t)t * q_size + (size_t)kh * groups * d;
                    attend_head(&cache, kh, block_tables + (int64_t)t * table_width, context_lens[t],
                                qkv + (size_t)t * qkv_size + (size_t)kh * groups * d, groups, m->scale, o);
                    for (int i = 0; i < groups * d; i++) o[i] = as_dtype(o[i], dt);
                }
            project(&l->o, dt, attn, n, q_size, hdim, y, gemm, xd, yd);
            #pragma omp for schedule(static)
            for (int t = 0; t < n; t++) {
                for (int i = 0; i < hdim; i++) x[t * hdim + i] = as_dtype(x[t * hdim + i] + y[t * hdim + i], dt);
                rms_norm(x + t * hdim, l->post_norm, dt, hdim, m->eps, h + t * hdim);
            }
            project(&l->gate_up, dt, h, n, hdim, 2 * inter, gate_up, gemm, xd, yd);
            #pragma omp for schedule(static)
            for (int t = 0; t < n; t++)
                for (int i = 0; i < inter; i++) {
                    const float *g = gate_up + (size_t)t * 2 * inter;
                    act[(size_t)t * inter + i] = as_dtype(as_dtype(silu(g[i]), dt) * g[inter + i], dt);
                }
            project(&l->down, dt, act, n, inter, hdim, y, gemm, xd, yd);
            #pragma omp for schedule(static)
            for (int t = 0; t < n; t++)
                for (int i = 0; i < hdim; i++) x[t * hdim + i] = as_dtype(x[t * hdim + i] + y[t * hdim + i], dt);
        }
        #pragma omp for schedule(static)
        for (int t = 0; t < n; t++) rms_norm(x + t * hdim, m->norm, dt, hdim, m->eps, h + t * hdim);
#if AVX512_BW_VL
        if (head_gemm) gemm_rows(&m->lm_head, dt, h, n, hdim, m->vocab, logits, xd);
        else
#endif
        linear(m->lm_head.w, NULL, dt, h, n, hdim, m->vocab, y, m->vocab);
    }
    if (!head_gemm)
        for (int64_t i = 0; i < (int64_t)n * m->vocab; i++) store(logits, dt, i, y[i]);
    free(x), free(h), free(qkv), free(attn), free(gate_up), free(act), free(y), free(xd), free(yd);
}

/* y[t] = w . x[t] for n inputs by the step's own matrix-vector product (y and x float32): to test it
 * alone, and for the benchmarks to measure the read bandwidth with it. */
void linear_rows(const void *w, int dtype, const float *x, int n, int in, int out, float *y, int threads) {
    #pragma omp parallel num_threads(threads)
    linear(w, NULL, dtype, x, n, in, out, y, out);
}
