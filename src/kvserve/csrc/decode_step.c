/* A whole decode step of a Llama-family decoder on the CPU in one call: embedding, every layer
 * (RMSNorm, QKV, RoPE, K/V written at their slots, paged attention, over the layer's sliding window where
 * it has one, O, RMSNorm, gate/up and SiLU, down) and the logits, for rows of one new token each: a
 * sequence's one decode token, or one of the several tokens a verification of speculative drafts computes
 * (its rows share the sequence's block table, each attending over one more token than the row before).
 * Gemma 2/3's layers too: (1 + weight) norms in float32, the norms around each sublayer's output, GeGLU,
 * scaled embeddings, soft-capped scores and logits, and Gemma 3's RoPE table of the sliding layers.
 *
 * Decoding a few tokens reads every weight once per step: the step is bound by memory reads, and
 * run op by op from Python it loses as much time again in dispatch and in small-matrix overheads.
 * Here one OpenMP team runs the step: attention by (sequence, KV head) tasks, norms, RoPE and SiLU by
 * sequence, and the linear layers by csrc/gemm.c over their packed copies, which stream the weights
 * at least as fast as matrix-vector products do even for one sequence (the panels are read in order,
 * whole cache lines) and are bound by computing at many. Where gemm.c does not
 * multiply the dtype, matrix-vector products split by rows read the weights as torch keeps them.
 *
 * Weights are float32 or bfloat16 (`dtype`, the kinds of common.h). Each layer's cache holds that dtype, or is
 * quantized (int8, fp8 or int4 pages with their scales: kv/quant.py's codecs): the step's K/V are then written
 * as kv/quant.py writes them, bit for bit (csrc/kv_codecs.c), int4 keys turned by its Hadamard matrix (and
 * the queries alike), and attention reads the pages as csrc/paged_decode.c reads them, dequantizing as it
 * goes. A hybrid cache (kv/hybrid.py) gives each layer group its block tables. The ops between the products
 * compute in float32; in a bfloat16 model every number is rounded
 * to bfloat16 wherever the eager model holds it in bfloat16, so that both compute the same numbers up
 * to the order of the sums. The rows that go into and come out of the GEMMs stay bfloat16 (see
 * widen): converting them in passes of their own would read and write every row twice more, each
 * pass behind a barrier.
 *
 * Under tensor parallelism each rank runs the step on its shard (Model), the team stopping where the layers'
 * partial sums are summed over the ranks (the model's all_reduce, the caller's collective), as the eager model
 * does between its ops.
 */
#include <omp.h>
#include <stddef.h>

#include "common.h"
#include "decode_step.h"

/* The structs' layout as this compiler laid them out, which the Python side's ctypes structures must repeat
 * (kvserve.kernels.check_layout): each struct's size (field ""), then each field's C type and offset. */
#define C_TYPE(x) _Generic((x), int: "int", int64_t: "int64_t", float: "float", void *: "void *", \
                           const void *: "const void *", Proj: "Proj", const Layer *: "const Layer *", \
                           AllReduce: "AllReduce")
#define SIZE_OF(S) {#S, "", "", sizeof(S)}
#define FIELD(S, f) {#S, #f, C_TYPE(((S *)0)->f), offsetof(S, f)}
static const struct {
    const char *type, *field, *c_type;
    size_t at;
} LAYOUT[] = {
    SIZE_OF(Proj), FIELD(Proj, w), FIELD(Proj, b), FIELD(Proj, packed), FIELD(Proj, scales), FIELD(Proj, kind),
    FIELD(Proj, amx_from), FIELD(Proj, widen_from), FIELD(Proj, vnni_from),
    SIZE_OF(Layer), FIELD(Layer, qkv), FIELD(Layer, o), FIELD(Layer, gate_up), FIELD(Layer, down),
    FIELD(Layer, input_norm), FIELD(Layer, post_norm), FIELD(Layer, q_norm), FIELD(Layer, k_norm), FIELD(Layer, kv),
    FIELD(Layer, k_meta), FIELD(Layer, v_meta), FIELD(Layer, kv_kind), FIELD(Layer, rotate_keys),
    FIELD(Layer, summary), FIELD(Layer, summary_kind),
    FIELD(Layer, window), FIELD(Layer, group), FIELD(Layer, local_rope), FIELD(Layer, pre_ff_norm),
    FIELD(Layer, post_ff_norm),
    SIZE_OF(Model), FIELD(Model, num_layers), FIELD(Model, hidden), FIELD(Model, num_heads),
    FIELD(Model, num_kv_heads), FIELD(Model, head_dim), FIELD(Model, rotary_dim), FIELD(Model, intermediate),
    FIELD(Model, vocab),
    FIELD(Model, dtype), FIELD(Model, num_blocks), FIELD(Model, block_size), FIELD(Model, eps), FIELD(Model, scale),
    FIELD(Model, gelu), FIELD(Model, gemma_norms), FIELD(Model, embed_scale), FIELD(Model, attn_cap),
    FIELD(Model, logit_cap),
    FIELD(Model, embed), FIELD(Model, norm), FIELD(Model, lm_head), FIELD(Model, layers), FIELD(Model, vocab_start),
    FIELD(Model, all_reduce),
};
#undef SIZE_OF
#undef FIELD
#undef C_TYPE

/* Entry i of LAYOUT: its struct and field names and the field's C type, and the offset (or size); -1 past the
 * last. */
int64_t struct_layout(int i, const char **type, const char **field, const char **c_type) {
    if (i < 0 || i >= (int)(sizeof(LAYOUT) / sizeof(LAYOUT[0]))) return -1;
    *type = LAYOUT[i].type, *field = LAYOUT[i].field, *c_type = LAYOUT[i].c_type;
    return (int64_t)LAYOUT[i].at;
}

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

/* Rows between the step's linear layers are of the dtype the products take (`gdt`): the model's where
 * csrc/gemm.c multiplies it (bfloat16 rows go straight into and out of the GEMM), else float32 (the
 * matrix-vector products). The ops between widen a row to float32 as they start and round it back as
 * they end, rather than each product having passes (and barriers) of its own to convert its rows. */

/* Row t of `rows` (width numbers each, of dtype) as floats: where it is for float32, else widened into buf. */
static inline float *widen(void *rows, int dtype, int t, int width, float *buf) {
    if (dtype == F32) return (float *)rows + (size_t)t * width;
    load_row(buf, (const uint16_t *)rows + (size_t)t * width, dtype, width);
    return buf;
}

/* f (width floats) as row t of `rows` of dtype, unless it is that row already. */
static inline void narrow(void *rows, int dtype, int t, int width, const float *f) {
    void *row = (char *)rows + (size_t)t * width * elem_size(dtype);
    if (row != (const void *)f) store_row(row, f, dtype, width);
}

/* y = p . x + b for the n rows of x (`in` numbers each) into y (`out` numbers each), rows of gdt: by the
 * packed GEMM where p is packed (gated: silu(gate) * up, `out` numbers of each), else by the matrix-vector
 * products (never gated). Called from every thread; y is whole when it returns. */
static void project(const Proj *p, int gated, int dtype, const void *x, int n, int in, int out, void *y) {
#if GEMM_SIMD
    if (p->packed) {
        gemm_team(p->packed, p->scales, p->kind, p->b, dtype, x, in, n, in, out, y, gated,
                  n >= p->amx_from ? GEMM_AMX : n >= p->widen_from ? GEMM_WIDEN : n >= p->vnni_from ? GEMM_VNNI
                                                                                                  : GEMM_AVX512);
        #pragma omp barrier
        return;
    }
#endif
    (void)gated;
    linear(p->w, p->b, dtype, x, n, in, out, y, out);
}

/* y = the model's RMSNorm of x (dim numbers) by weight: Gemma's or the Llama family's. */
static inline void norm(const Model *m, const float *x, const void *weight, int dim, float *y) {
    if (m->gemma_norms) gemma_rms_norm(x, weight, m->dtype, dim, m->eps, y);
    else rms_norm(x, weight, m->dtype, dim, m->eps, y);
}

/* Q/K norms and RoPE of a token's query heads of KV head kh and of its k head, in place in its qkv row
 * (float32), each turned by the Hadamard matrix where the layer's cache stores its keys rotated; then its K and V
 * of that head written at its cache slot, as the layer's pages hold them (store_token). RoPE rotates the first
 * rotary_dim numbers of each head (all of them but under partial RoPE), whose cos/sin tables are rotary_dim wide. */
static void position_and_store(const Model *m, const Layer *l, const Cache *cache, float *qkv, int kh,
                               int64_t position, int64_t slot, const float *cos_table, const float *sin_table) {
    const int d = m->head_dim, rd = m->rotary_dim, nh = m->num_heads, nkv = m->num_kv_heads, dt = m->dtype;
    const int groups = nh / nkv;
    /* the position's float32 cos/sin rounded to the model's dtype, as the eager model casts them */
    float c[rd], s[rd], rotated[rd];
    const float *cos = cos_table + position * rd, *sin = sin_table + position * rd;
    for (int i = 0; i < rd; i++) c[i] = as_dtype(cos[i], dt), s[i] = as_dtype(sin[i], dt);
    for (int i = 0; i <= groups; i++) {
        const int h = i < groups ? kh * groups + i : nh + kh;
        float *head = qkv + (size_t)h * d;
        if (l->q_norm) norm(m, head, h < nh ? l->q_norm : l->k_norm, d, head);
        rope_row(head, c, s, rd, dt, rotated);
        memcpy(head, rotated, sizeof(rotated));
        if (l->rotate_keys) rotate_keys_row(head, d, dt);
    }
    for (int which = 0; which < 2; which++)
        store_token(cache, which, kh, slot, qkv + ((size_t)(nh + which * nkv + kh)) * d);
}

static inline int max3(int a, int b, int c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* Row t of x (the residual stream) RMSNormed by `weight` into row t of rows (gdt); buf: a float row. */
static void norm_row(const Model *m, const float *x, int t, const void *weight, void *rows, int gdt, float *buf) {
    const int hdim = m->hidden;
    float *h = gdt == F32 ? (float *)rows + (size_t)t * hdim : buf;
    norm(m, x + (size_t)t * hdim, weight, hdim, h);
    narrow(rows, gdt, t, hdim, h);
}

/* Row t of `added` (gdt, the stream's width), first normed by `before` where not NULL (Gemma's norm of a
 * sublayer's output), added to row t of x (the residual stream), as the eager model rounds; then that row
 * RMSNormed by `weight` into row t of `normed` (gdt). buf: two float rows. */
static void add_and_norm(const Model *m, float *x, int t, void *added, const void *before, const void *weight,
                         void *normed, int gdt, float *buf) {
    const int hdim = m->hidden;
    const float *o = widen(added, gdt, t, hdim, buf);
    if (before) {
        norm(m, o, before, hdim, buf + hdim);
        o = buf + hdim;
    }
    for (int i = 0; i < hdim; i++) x[t * hdim + i] = as_dtype(x[t * hdim + i] + o[i], m->dtype);
    norm_row(m, x, t, weight, normed, gdt, buf);
}

/* A row's sparse attention in a step (kv/sparse.py): its options (params: Quest.params, budget < 0 where it has
 * none, or NULL), and where its reads are counted (decode_blocks): counts, and its row of the layer's record (or
 * NULL). */
typedef struct {
    const int64_t *params;
    int64_t *counts;
    uint8_t *record;
} SparseTask;

/* The heads of KV head kh of row t: its q, k and v heads (row t of the qkv rows, of gdt) into qkv (float32 rows),
 * their RoPE, and its K/V written at its cache slot. The first task of the step's attention: its heads are no
 * other task's. */
static void store_task(const Model *m, const Layer *l, const Cache *cache, int t, int kh, const void *rows, int gdt,
                       float *qkv, int64_t position, int64_t slot, const float *cos_table, const float *sin_table) {
    const int d = m->head_dim, nh = m->num_heads, nkv = m->num_kv_heads, groups = nh / nkv;
    const size_t qkv_size = (size_t)(nh + 2 * nkv) * d, q = (size_t)kh * groups * d;
    float *own = qkv + t * qkv_size;
    if (gdt != F32) {
        const uint16_t *row = (const uint16_t *)rows + t * qkv_size;
        load_row(own + q, row + q, gdt, groups * d);
        for (int which = 0; which < 2; which++)
            load_row(own + (size_t)(nh + which * nkv + kh) * d, row + (size_t)(nh + which * nkv + kh) * d, gdt, d);
    }
    position_and_store(m, l, cache, own, kh, position, slot, cos_table, sin_table);
}

/* The attention of row t's query heads of KV head kh (their qkv rows as store_task left them) over its pages, the
 * last ctx of its table's tokens (the blocks decode_blocks chooses, under sparse attention in a full-attention layer
 * from the row's dense_layers on), into its row of out (gdt). The second task of the step's attention, once every
 * row's K/V are in the pages: rows of one sequence (a verification's several tokens) read each other's. 0, or -1
 * where the attention's memory ran out. */
static int attend_task(const Model *m, const Layer *l, int li, const Cache *cache, int t, int kh, int gdt,
                       const float *qkv, const int64_t *table, int64_t ctx, void *out, SparseTask sparse) {
    const int d = m->head_dim, nh = m->num_heads, nkv = m->num_kv_heads, groups = nh / nkv;
    const size_t qkv_size = (size_t)(nh + 2 * nkv) * d, q = (size_t)kh * groups * d;
    const size_t at = (size_t)t * nh * d + q;
    float local[groups * d], *o = gdt == F32 ? (float *)out + at : local;
    const float *own = qkv + t * qkv_size;
    const int64_t *p = sparse.params;
    Blocks b = {table, ctx, NULL};
    if (p && p[0] >= 0 && !l->window &&
        decode_blocks(cache, kh, table, ctx, own + q, groups, li < p[3] ? 0 : p[0], p[1], p[2], sparse.counts,
                      sparse.record, &b))
        return -1;
    const int status = attend_head(cache, kh, b.table, b.ctx, own + q, groups, m->scale, l->window, m->attn_cap, o);
    free(b.owned);
    if (status) return -1;
    for (int i = 0; i < groups * d; i++) o[i] = as_dtype(o[i], m->dtype);
    if (o == local) store_row((uint16_t *)out + at, o, gdt, groups * d);
    return 0;
}

/* cap * tanh(x / cap), rounded as the eager model rounds each op in dtype. */
static inline float soft_cap(float x, float cap, int dtype) {
    return as_dtype(as_dtype(tanhf(as_dtype(x / cap, dtype)), dtype) * cap, dtype);
}

/* Under tensor parallelism, rows (`count` numbers of gdt) summed over the ranks: by the thread that called the
 * step (the one that holds the caller's interpreter), while the team waits at the barrier. Float rows of a bfloat16
 * model are rounded as the eager model's all-reduce of its bfloat16 rows rounds them. Once one fails (the step is
 * then discarded, and its caller raises why), the rest are skipped. Called from every thread. */
static void all_reduce(const Model *m, void *rows, int64_t count, int gdt, int *broken) {
    #pragma omp master
    {
        if (!*broken && m->all_reduce(rows, count, gdt)) *broken = 1;
        if (gdt == F32 && m->dtype != F32)
            for (int64_t i = 0; i < count; i++) ((float *)rows)[i] = as_dtype(((float *)rows)[i], m->dtype);
    }
    #pragma omp barrier
}

/* logits[t] (in the model's dtype) of the next token after input_ids[t], for n rows of one token each at
 * `positions`, attending over their pages: every row's K/V of a layer are written before any row of it attends,
 * so that rows of one sequence (a verification's tokens, at consecutive positions and slots, each with a context
 * one longer) see each other as a prompt's tokens would. A hybrid cache (kv/groups.py) has a block table
 * per layer group: layer l writes its K/V at slots[g][t] and reads block_tables[g] ([n][table_widths[g]])
 * of its group g = l->group (one group: g = 0 for every layer). RoPE's cos and sin: the tables of every
 * layer but those with local_rope, which read local_cos and local_sin. Sparse attention (kv/sparse.py): sparse
 * [n][4] holds each sequence's Quest.params (a budget < 0: none; NULL: no sequence has it), their reads counted
 * into sparse_counts and (unless NULL) sparse_record [layers][n][record_width], which the step zeroes first (the
 * table's entries each layer's tasks read, decode_blocks). 0, or -1 where memory ran out (the logits and the
 * step's K/V are then not all written). */
int decode_step(const Model *m, int n, const int64_t *input_ids, const int64_t *positions,
                 const int64_t *const *slots, const int64_t *const *block_tables, const int *table_widths,
                 const int64_t *context_lens, const float *cos_table, const float *sin_table,
                 const float *local_cos, const float *local_sin, const int64_t *sparse, int64_t *sparse_counts,
                 uint8_t *sparse_record, int record_width, void *logits, int threads) {
    const int hdim = m->hidden, d = m->head_dim, nh = m->num_heads, nkv = m->num_kv_heads;
    const int inter = m->intermediate, dt = m->dtype, q_size = nh * d, qkv_size = (nh + 2 * nkv) * d;
#if GEMM_SIMD
    const int gemm = m->lm_head.packed != NULL;     /* every layer packed; the logits straight from the GEMM */
#else
    const int gemm = 0;
#endif
    const int gdt = gemm ? dt : F32, widest = max3(hdim, qkv_size, inter);
    const size_t es = elem_size(gdt);
    float *x = malloc(sizeof(float) * n * hdim);
    /* a: the products' inputs (and down's output), b: their outputs (and down's input), of gdt */
    void *a = malloc(es * n * (hdim > q_size ? hdim : q_size)), *b = malloc(es * n * widest);
    float *qkv = gdt == F32 ? b : malloc(sizeof(float) * n * qkv_size);     /* q, k, v as floats */
    /* gate and up rows (gdt) where the gated GEMM does not apply the activation as it writes them */
    const int fused = gemm && !m->gelu;
    void *gate_up = fused ? NULL : malloc(es * n * 2 * inter);
    float *y = gemm ? NULL : malloc(sizeof(float) * n * m->vocab);
    float *rows = malloc(sizeof(float) * 2 * widest * threads);              /* two float rows per thread */
    int failed = !x || !a || !b || !qkv || (!fused && !gate_up) || (!gemm && !y) || !rows, broken = 0;
    if (failed) goto done;
    if (sparse_record) memset(sparse_record, 0, (size_t)m->num_layers * n * record_width);
    for (int t = 0; t < n; t++) {
        const int64_t id = input_ids[t] - m->vocab_start;
        if (id < 0 || id >= m->vocab) {         /* another rank's row: its lookup, summed with ours */
            memset(x + (size_t)t * hdim, 0, sizeof(float) * hdim);
            continue;
        }
#if GEMM_SIMD
        if (!m->embed) {            /* the table's only copy is the tied lm_head's packed weight */
            const Proj *head = &m->lm_head;
            gemm_row(head->packed, head->scales, head->kind, dt, hdim, id, x + (size_t)t * hdim);
        } else
#endif
        for (int i = 0; i < hdim; i++) x[t * hdim + i] = param(m->embed, dt, id * hdim + i);
        if (m->embed_scale != 1.0f)
            for (int i = 0; i < hdim; i++) x[t * hdim + i] = as_dtype(x[t * hdim + i] * m->embed_scale, dt);
    }
    if (m->all_reduce && m->all_reduce(x, (int64_t)n * hdim, F32)) broken = 1;
    #pragma omp parallel num_threads(threads)
    {
        float *row = rows + (size_t)omp_get_thread_num() * 2 * widest;
        #pragma omp for schedule(static)
        for (int t = 0; t < n; t++) norm_row(m, x, t, m->layers[0].input_norm, a, gdt, row);
        for (int li = 0; li < m->num_layers; li++) {
            const Layer *l = &m->layers[li];
            const Cache cache = {l->kv, l->k_meta, l->v_meta, l->summary, l->kv_kind, nkv, m->num_blocks,
                                 m->block_size, d, l->summary_kind};
            const int64_t *table = block_tables[l->group], *slot = slots[l->group];
            const int width = table_widths[l->group];
            const float *cos = l->local_rope ? local_cos : cos_table, *sin = l->local_rope ? local_sin : sin_table;
            project(&l->qkv, 0, dt, a, n, hdim, qkv_size, b);
            #pragma omp for collapse(2) schedule(static)
            for (int t = 0; t < n; t++)
                for (int kh = 0; kh < nkv; kh++)
                    store_task(m, l, &cache, t, kh, b, gdt, qkv, positions[t], slot[t], cos, sin);
            /* every row's K/V are written (the loop's barrier) before any row attends */
            #pragma omp for collapse(2) schedule(dynamic)
            for (int t = 0; t < n; t++)
                for (int kh = 0; kh < nkv; kh++) {
                    const SparseTask sparse_task = {
                        sparse ? sparse + 4 * t : NULL, sparse_counts,
                        sparse_record ? sparse_record + ((int64_t)li * n + t) * record_width : NULL};
                    if (attend_task(m, l, li, &cache, t, kh, gdt, qkv, table + (int64_t)t * width, context_lens[t], a,
                                    sparse_task)) {
                        /* the rest of the step still runs (every thread must meet the barriers), and is discarded */
                        #pragma omp atomic write
                        failed = 1;
                    }
                }
            project(&l->o, 0, dt, a, n, q_size, hdim, b);
            if (m->all_reduce) all_reduce(m, b, (int64_t)n * hdim, gdt, &broken);
            /* Gemma: the attention's output normed (post_norm) before it joins the stream, the MLP's input
             * by pre_ff_norm */
            const void *before = l->pre_ff_norm ? l->post_norm : NULL;
            #pragma omp for schedule(static)
            for (int t = 0; t < n; t++)
                add_and_norm(m, x, t, b, before, before ? l->pre_ff_norm : l->post_norm, a, gdt, row);
            if (fused) {
                project(&l->gate_up, 1, dt, a, n, hdim, inter, b);
            } else {
                project(&l->gate_up, 0, dt, a, n, hdim, 2 * inter, gate_up);
                #pragma omp for schedule(static)
                for (int t = 0; t < n; t++)
                    for (int i = 0; i < inter; i++) {
                        const int64_t g = (int64_t)t * 2 * inter + i;
                        const float gate = param(gate_up, gdt, g), up = param(gate_up, gdt, g + inter);
                        store(b, gdt, (int64_t)t * inter + i, m->gelu ? geglu(gate, up, dt) : swiglu(gate, up, dt));
                    }
            }
            project(&l->down, 0, dt, b, n, inter, hdim, a);
            if (m->all_reduce) all_reduce(m, a, (int64_t)n * hdim, gdt, &broken);
            /* the residual (Gemma: the MLP's output normed first), and the next layer's input norm (or the
             * final norm) */
            const void *next = li + 1 < m->num_layers ? m->layers[li + 1].input_norm : m->norm;
            #pragma omp for schedule(static)
            for (int t = 0; t < n; t++) add_and_norm(m, x, t, a, l->post_ff_norm, next, a, gdt, row);
        }
        project(&m->lm_head, 0, dt, a, n, hdim, m->vocab, gemm ? logits : (void *)y);
        if (!gemm) {
            #pragma omp for schedule(static)
            for (int64_t i = 0; i < (int64_t)n * m->vocab; i++) store(logits, dt, i, y[i]);
        }
        if (m->logit_cap > 0.0f) {
            #pragma omp for schedule(static)
            for (int64_t i = 0; i < (int64_t)n * m->vocab; i++)
                store(logits, dt, i, soft_cap(param(logits, dt, i), m->logit_cap, dt));
        }
    }
done:
    free(x), free(a), free(gate_up), free(y), free(rows);
    if (qkv != b) free(qkv);
    free(b);
    return failed ? -1 : 0;
}

/* `steps` greedy decode steps of n sequences in one call: each step's argmax is the next step's input, and
 * its K/V go at the next slot of the sequence's table in each of the `groups` layer groups (decode_step),
 * whose tables hold blocks for all the steps. input_ids, positions and context_lens are the first step's,
 * and advance in place; tokens [steps][n]; logits: room for one step's; sparse attention as in decode_step (the
 * record: the last step's). 0, or -1 where memory ran out (the steps stop there). Not for a tensor-parallel
 * shard: the argmax is over its own vocab rows. */
int decode_steps(const Model *m, int n, int steps, int64_t *input_ids, int64_t *positions, int groups,
                  const int64_t *const *block_tables, const int *table_widths, int64_t *context_lens,
                  const float *cos_table, const float *sin_table, const float *local_cos, const float *local_sin,
                  const int64_t *sparse, int64_t *sparse_counts, uint8_t *sparse_record, int record_width,
                  void *logits, int64_t *tokens, int threads) {
    const int bs = m->block_size;
    int64_t *slots = malloc(sizeof(int64_t) * n * groups);
    const int64_t **slot_rows = malloc(sizeof(int64_t *) * groups);
    int status = slots && slot_rows ? 0 : -1;
    for (int g = 0; g < groups && status == 0; g++) slot_rows[g] = slots + (int64_t)g * n;
    for (int s = 0; s < steps && status == 0; s++) {
        for (int g = 0; g < groups; g++)
            for (int t = 0; t < n; t++) {
                const int64_t at = context_lens[t] - 1;     /* the new token's place in the cache */
                slots[(int64_t)g * n + t] = block_tables[g][(int64_t)t * table_widths[g] + at / bs] * bs + at % bs;
            }
        status = decode_step(m, n, input_ids, positions, slot_rows, block_tables, table_widths, context_lens,
                             cos_table, sin_table, local_cos, local_sin, sparse, sparse_counts, sparse_record,
                             record_width, logits, threads);
        if (status) break;
        argmax_rows(logits, n, m->vocab, m->vocab, m->dtype, tokens + (int64_t)s * n, threads);
        for (int t = 0; t < n; t++) input_ids[t] = tokens[(int64_t)s * n + t], positions[t]++, context_lens[t]++;
    }
    free(slots), free(slot_rows);
    return status;
}

/* y[t] = w . x[t] for n inputs by the step's own matrix-vector product (y and x float32): to test it
 * alone, and for the benchmarks to measure the read bandwidth with it. */
void linear_rows(const void *w, int dtype, const float *x, int n, int in, int out, float *y, int threads) {
    #pragma omp parallel num_threads(threads)
    linear(w, NULL, dtype, x, n, in, out, y, out);
}
