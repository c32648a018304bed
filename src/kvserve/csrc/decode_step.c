/* A whole decode step of a Llama-family decoder on the CPU in one call: embedding, every layer
 * (RMSNorm, QKV, RoPE, K/V written at their slots, paged attention, O, RMSNorm, gate/up, SiLU, down)
 * and the logits, for sequences of one new token each.
 *
 * Decoding a few tokens reads every weight once per step: the step is bound by memory reads, and
 * run op by op from Python it loses as much time again in dispatch and in small-matrix overheads.
 * Here one OpenMP team runs the step: attention by (sequence, KV head) tasks, norms, RoPE and SiLU by
 * sequence, and the linear layers by csrc/gemm.c over their packed copies, which stream the weights
 * faster than matrix-vector products do even for one sequence (float32: 503 against 452 tok/s here;
 * bfloat16 alike, 742 against 737) and are bound by computing at many. Where gemm.c does not
 * multiply the dtype, matrix-vector products split by rows read the weights as torch keeps them.
 *
 * Weights are float32 or bfloat16 (`dtype`, the kinds of common.h), and the cache holds the same
 * dtype. Activations are float32 here; in a
 * bfloat16 model they are rounded to bfloat16 wherever the eager model holds them in bfloat16, so
 * that both compute the same numbers up to the order of the sums.
 */
#include "common.h"

/* A linear layer: its weight packed for csrc/gemm.c, or (packed NULL) the weight [out][in] as torch
 * keeps it, for the matrix-vector products; and its bias (or NULL). */
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

/* y[t][o] = w[o] . x[t] + b[o] for n rows of x; the team shares the output rows (call from every
 * thread). The weight is read once: each row meets the inputs four at a time while it is in cache. */
static void linear(const void *w, const void *b, int dtype, const float *x, int n, int in, int out, float *y,
                   int y_stride) {
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
 * apart; bfloat16: converted into xd first, exactly, since they hold bfloat16 numbers); gated (the MLP's
 * gate_up): silu(gate) * up, `out` numbers each. Called from every thread of the team; yd is whole when
 * it returns. */
static void gemm_rows(const Proj *p, int gated, int dtype, const float *x, int n, int in, int out, void *yd,
                      void *xd) {
    if (dtype == BF16) {
        #pragma omp for schedule(static)
        for (int t = 0; t < n; t++) store_row((uint16_t *)xd + (size_t)t * in, x + (size_t)t * in, BF16, in);
    }
    gemm_team(p->packed, p->b, dtype, dtype == BF16 ? xd : x, in, n, in, out, yd, gated);
    #pragma omp barrier
}
#endif

/* y[t] = p . x[t] + b for the n rows of x (float32, `in` numbers apart) into y (float32, rows `out`
 * apart): by the packed GEMM where p is packed (gated: as gemm_rows), else by the matrix-vector products.
 * xd, yd: room for the GEMM's bfloat16 rows. Called from every thread. */
static void project(const Proj *p, int gated, int dtype, const float *x, int n, int in, int out, float *y, void *xd,
                    void *yd) {
#if AVX512_BW_VL
    if (p->packed) {
        gemm_rows(p, gated, dtype, x, n, in, out, dtype == BF16 ? yd : (void *)y, xd);
        if (dtype == BF16) {
            #pragma omp for schedule(static)
            for (int t = 0; t < n; t++) load_row(y + (size_t)t * out, (uint16_t *)yd + (size_t)t * out, BF16, out);
        }
        return;
    }
#else
    (void)xd, (void)yd;
#endif
    (void)gated;        /* only packed weights are gated */
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

static inline int max3(int a, int b, int c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* logits[t] (in the model's dtype) of the next token after input_ids[t], for n sequences decoding one
 * token each at `positions`, writing their K/V at `slots` and attending over their pages. */
void decode_step(const Model *m, int n, const int64_t *input_ids, const int64_t *positions, const int64_t *slots,
                 const int64_t *block_tables, int table_width, const int64_t *context_lens,
                 const float *cos_table, const float *sin_table, void *logits, int threads) {
    const int hdim = m->hidden, d = m->head_dim, nh = m->num_heads, nkv = m->num_kv_heads;
    const int inter = m->intermediate, dt = m->dtype, q_size = nh * d, qkv_size = (nh + 2 * nkv) * d;
#if AVX512_BW_VL
    const int gemm = m->lm_head.packed != NULL;     /* every layer packed; the logits straight from the GEMM */
#else
    const int gemm = 0;
#endif
    const int widest_in = max3(hdim, q_size, inter), widest_out = max3(qkv_size, hdim, 2 * inter);
    float *x = malloc(sizeof(float) * n * hdim), *h = malloc(sizeof(float) * n * hdim);
    float *qkv = malloc(sizeof(float) * n * qkv_size), *attn = malloc(sizeof(float) * n * q_size);
    float *gate_up = gemm ? NULL : malloc(sizeof(float) * n * 2 * inter), *act = malloc(sizeof(float) * n * inter);
    float *y = malloc(sizeof(float) * n * (gemm || hdim > m->vocab ? hdim : m->vocab));
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
            project(&l->qkv, 0, dt, h, n, hdim, qkv_size, qkv, xd, yd);
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
            project(&l->o, 0, dt, attn, n, q_size, hdim, y, xd, yd);
            #pragma omp for schedule(static)
            for (int t = 0; t < n; t++) {
                for (int i = 0; i < hdim; i++) x[t * hdim + i] = as_dtype(x[t * hdim + i] + y[t * hdim + i], dt);
                rms_norm(x + t * hdim, l->post_norm, dt, hdim, m->eps, h + t * hdim);
            }
            if (gemm) {
                project(&l->gate_up, 1, dt, h, n, hdim, inter, act, xd, yd);
            } else {
                project(&l->gate_up, 0, dt, h, n, hdim, 2 * inter, gate_up, xd, yd);
                #pragma omp for schedule(static)
                for (int t = 0; t < n; t++)
                    for (int i = 0; i < inter; i++) {
                        const float *g = gate_up + (size_t)t * 2 * inter;
                        act[(size_t)t * inter + i] = swiglu(g[i], g[inter + i], dt);
                    }
            }
            project(&l->down, 0, dt, act, n, inter, hdim, y, xd, yd);
            #pragma omp for schedule(static)
            for (int t = 0; t < n; t++)
                for (int i = 0; i < hdim; i++) x[t * hdim + i] = as_dtype(x[t * hdim + i] + y[t * hdim + i], dt);
        }
        #pragma omp for schedule(static)
        for (int t = 0; t < n; t++) rms_norm(x + t * hdim, m->norm, dt, hdim, m->eps, h + t * hdim);
#if AVX512_BW_VL
        if (gemm) gemm_rows(&m->lm_head, 0, dt, h, n, hdim, m->vocab, logits, xd);
        else
#endif
        linear(m->lm_head.w, NULL, dt, h, n, hdim, m->vocab, y, m->vocab);
    }
    if (!gemm)
        for (int64_t i = 0; i < (int64_t)n * m->vocab; i++) store(logits, dt, i, y[i]);
    free(x), free(h), free(qkv), free(attn), free(gate_up), free(act), free(y), free(xd), free(yd);
}

/* y[t] = w . x[t] for n inputs by the step's own matrix-vector product (y and x float32): to test it
 * alone, and for the benchmarks to measure the read bandwidth with it. */
void linear_rows(const void *w, int dtype, const float *x, int n, int in, int out, float *y, int threads) {
    #pragma omp parallel num_threads(threads)
    linear(w, NULL, dtype, x, n, in, out, y, out);
}
