/* The C kernels (src/kvserve/csrc) against plain-C references computed in double, for whichever target the kernels
 * are built for: an ARM64 build runs under qemu-user, where Python and torch do not (tests/kernels/test_aarch64.py
 * links it with kvserve.kernels' ARM64 library and runs it there, and with the native library here). Checked on
 * awkward shapes:
 *
 * - gemm.c: every weight kind (the dtype's, int8, int4) for float32 and bfloat16 products, with a bias, input rows
 *   a stride apart, and gated (SwiGLU), by the build's vector kernel; and gemm_rows, exactly;
 * - kv_codecs.c: store_token's rows of every kind against each format's definition (int8, fp8 and bfloat16 bit
 *   for bit; int4 within a step of its grid);
 * - paged_decode.c: paged_decode and paged_prefill over pages of every kind against softmax(q K^T * scale) V of the
 *   pages' decoded numbers, with a sliding window and a soft cap;
 * - sampling.c: argmax_rows (the first maximum, the first NaN).
 *
 * Each check prints "ok NAME" or "FAIL NAME: what"; then "gemm kernels K dtypes D" (what gemm.c reports), "codecs H"
 * (a hash of every byte the codecs wrote: bit for bit the same on every target, their file computing without fused
 * multiply-adds) and last "checks: N failed: F". The exit status is 1 where any check failed.
 *
 * Build, for the target of the library it is linked with (common.h's macros must be the library's):
 *   CC -O2 -march=TARGET -fopenmp -Isrc/kvserve/csrc tests/kernels/csrc/check_kernels.c LIBRARY.so -lm
 * (or with the sources of src/kvserve/csrc in place of the library). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

int gemm_dtypes(void);
int gemm_kernels(void);
int64_t gemm_packed_size(int kind, int dtype, int n, int k, int gated);
void gemm_pack(const void *w, int kind, int dtype, int n, int k, int gated, void *packed);
int64_t gemm_groups_size(int dtype, int n, int k, int gated);
void gemm_pack_groups(const uint16_t *scales, const uint16_t *mins, int dtype, int n, int k, int gated,
                      uint16_t *out);
void gemm(const void *packed, const void *scales, int kind, const void *bias, int dtype, const void *x, int64_t ldx,
          int m, int k, int n, void *y, int gated, int kernel, int threads);
void gemm_rows(const void *packed, const void *scales, int kind, int dtype, int k, const int64_t *ids, int count,
               void *out, int threads);
int paged_decode(const void *q, int q_kind, int64_t q_stride, void *out, int num_seqs, int num_heads,
                 const int64_t *block_tables, int table_width, const int64_t *context_lens, float scale,
                 const void *pages, int kind, int kvh, int nb, int bs, int d, const void *k_meta, const void *v_meta,
                 const void *summary, int summary_kind, int64_t window, float cap, const int64_t *sparse,
                 int64_t *counts, uint8_t *record);
int paged_prefill(const void *q, int q_kind, int64_t q_stride, void *out, int num_seqs, int num_heads,
                  const int64_t *block_tables, int table_width, const int64_t *context_lens, float scale,
                  const void *pages, int kind, int kvh, int nb, int bs, int d, const void *k_meta, const void *v_meta,
                  const void *summary, int summary_kind, int64_t window, float cap, const int64_t *sparse,
                  int64_t *counts, uint8_t *record, const int64_t *query_starts);

static const char *const KIND_NAMES[] = {"f32", "bf16", "f16", "int8", "fp8", "int4"};
static int checks, failures;
static uint64_t codec_hash = 1469598103934665603ull;     /* FNV-1a */

/* A check's worst number: |got - want| / allowed at its worst, where (at), and how many numbers it compared. */
typedef struct {
    double worst, got, want, allowed;
    long at, count;
} Worst;

static const Worst NONE = {0.0, 0.0, 0.0, 1.0, -1, 0};

static void compare(Worst *w, long at, double got, double want, double allowed) {
    const double off = fabs(got - want) / allowed, ratio = off == off ? off : INFINITY;     /* NaN: the worst */
    if (w->count++ == 0 || ratio > w->worst) *w = (Worst){ratio, got, want, allowed, at, w->count};
}

/* A check's outcome: ok where it compared numbers, all within what it allowed. */
static void done(const char *name, const Worst *w) {
    checks++;
    if (w->count > 0 && w->worst <= 1.0) {
        printf("ok %s\n", name);
        return;
    }
    failures++;
    if (w->count == 0) printf("FAIL %s: nothing compared\n", name);
    else printf("FAIL %s: at %ld got %.9g want %.9g (allowed %.3g)\n", name, w->at, w->got, w->want, w->allowed);
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint64_t next_random(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return rng;
}

/* Uniform in [lo, hi). */
static float uniform(float lo, float hi) { return lo + (hi - lo) * (float)(next_random() >> 40) / 16777216.0f; }

static void *zeroed(size_t bytes) {
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return memset(p, 0, (bytes + 63) / 64 * 64);
}

/* Number formats, by their definitions (not the kernels' helpers). */
static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint32_t to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* f as bfloat16, to nearest even: of the two neighbours, the nearer, ties to the even one. */
static uint16_t bf16_of(float f) {
    const uint32_t below = to_bits(f) & 0xffff0000u, above = below + 0x10000u;
    const double a = fabs((double)f - from_bits(below)), b = fabs((double)from_bits(above) - f);
    return (uint16_t)((a < b || (a == b && !(below & 0x10000u)) ? below : above) >> 16);
}

static float bf16_value(uint16_t h) { return from_bits((uint32_t)h << 16); }

static uint16_t f16_of(float f) {
    const _Float16 h = (_Float16)f;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}

static float f16_value(uint16_t u) {
    _Float16 h;
    memcpy(&h, &u, 2);
    return (float)h;
}

/* float8 e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; 0x7f and 0xff are NaN. */
static float fp8_value(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf((float)m, -9);
    return b & 0x80 ? -v : v;
}

/* v (|v| <= 448) as e4m3fn: the nearest code, ties to the even one. */
static uint8_t fp8_of(float v) {
    const float a = fabsf(v);
    int best = 0;
    for (int code = 1; code < 0x7f; code++) {
        const float e = fabsf(fp8_value((uint8_t)code) - a), was = fabsf(fp8_value((uint8_t)best) - a);
        if (e < was || (e == was && !(code & 1))) best = code;
    }
    return (uint8_t)(best | (signbit(v) ? 0x80 : 0));
}

/* Number i of a row of kind F32, BF16 or F16 as a float. */
static float value(const void *p, int kind, int64_t i) {
    if (kind == F32) return ((const float *)p)[i];
    return kind == BF16 ? bf16_value(((const uint16_t *)p)[i]) : f16_value(((const uint16_t *)p)[i]);
}

static void put(void *p, int kind, int64_t i, float f) {
    if (kind == F32) ((float *)p)[i] = f;
    else ((uint16_t *)p)[i] = kind == BF16 ? bf16_of(f) : f16_of(f);
}

static double silu_ref(double x) { return x / (1.0 + exp(-x)); }

#if GEMM_SIMD
/* A random weight [rows][k] of `kind` for products in dtype, as gemm_pack takes it, and the numbers it stands for
 * (wref, double); int8's column scales, int4's scales and minimums ([rows][groups], float16). */
typedef struct {
    void *w;
    float *scales8;
    uint16_t *scales4, *mins4;
    double *ref;
} Weight;

static Weight random_weight(int kind, int dtype, int rows, int k) {
    const int groups = (k + 31) / 32;
    Weight w = {zeroed((size_t)rows * k * (kind == F32 ? 4 : kind == BF16 ? 2 : 1)), NULL, NULL, NULL,
                zeroed(sizeof(double) * rows * k)};
    if (kind == INT8) w.scales8 = zeroed(sizeof(float) * rows);
    if (kind == INT4) w.scales4 = zeroed(2 * (size_t)rows * groups), w.mins4 = zeroed(2 * (size_t)rows * groups);
    for (int r = 0; r < rows; r++) {
        if (kind == INT8) w.scales8[r] = uniform(0.002f, 0.02f);
        for (int g = 0; kind == INT4 && g < groups; g++) {
            w.scales4[r * groups + g] = f16_of(uniform(0.01f, 0.05f));
            w.mins4[r * groups + g] = f16_of(uniform(-0.4f, 0.0f));
        }
        for (int i = 0; i < k; i++) {
            const int64_t at = (int64_t)r * k + i;
            if (kind == INT8) {
                const int8_t q = (int8_t)((int)(next_random() % 255) - 127);
                ((int8_t *)w.w)[at] = q;
                w.ref[at] = (double)q * w.scales8[r];
            } else if (kind == INT4) {
                const uint8_t q = (uint8_t)(next_random() % 16);
                ((uint8_t *)w.w)[at] = q;
                w.ref[at] = (double)q * f16_value(w.scales4[r * groups + i / 32]) + f16_value(w.mins4[r * groups + i / 32]);
            } else {
                put(w.w, dtype, at, uniform(-1.0f, 1.0f));
                w.ref[at] = value(w.w, dtype, at);
            }
        }
    }
    return w;
}

static void free_weight(Weight *w) { free(w->w), free(w->scales8), free(w->scales4), free(w->mins4), free(w->ref); }

/* The build's vector kernel (not AMX's), and its name. */
static int vector_kernel(const char **name) {
    const int bits = gemm_kernels() & ~(1 << GEMM_AMX);
    const int kernel = bits & 1 << GEMM_NEON ? GEMM_NEON : bits & 1 << GEMM_AVX2 ? GEMM_AVX2 : GEMM_AVX512;
    *name = kernel == GEMM_NEON ? "neon" : kernel == GEMM_AVX2 ? "avx2" : "avx512";
    return kernel;
}

/* y = x . W^T + bias (gated: silu(gate) * up) by gemm against the sums in double. Sums of float32 products are
 * allowed 3e-5 of sum |x w| (k up to 1000 in float32, in chunks), a bfloat16 output also its rounding (2^-8). */
static void check_gemm(int dtype, int kind, int m, int k, int n, int gated) {
    const char *kname;
    const int kernel = vector_kernel(&kname), rows = gated ? 2 * n : n, ldx = k + 5;
    Weight w = random_weight(kind, dtype, rows, k);
    const size_t es = elem_size(dtype);
    const int64_t numbers = gemm_packed_size(kind, dtype, rows, k, gated);
    void *packed = zeroed(kind == INT4 ? (size_t)numbers / 2 : (size_t)numbers * elem_size(kind));
    gemm_pack(w.w, kind, dtype, rows, k, gated, packed);
    uint16_t *groups = NULL;
    if (kind == INT4) {
        groups = zeroed(2 * (size_t)gemm_groups_size(dtype, rows, k, gated));
        gemm_pack_groups(w.scales4, w.mins4, dtype, rows, k, gated, groups);
    }
    void *x = zeroed(es * m * ldx), *bias = zeroed(es * rows), *y = zeroed(es * m * n);
    for (int64_t i = 0; i < (int64_t)m * ldx; i++) put(x, dtype, i, uniform(-1.0f, 1.0f));
    for (int i = 0; i < rows; i++) put(bias, dtype, i, uniform(-0.5f, 0.5f));
    gemm(packed, kind == INT8 ? (const void *)w.scales8 : groups, kind, bias, dtype, x, ldx, m, k, n, y, gated, kernel,
         2);
    const double acc = 3e-5, rel = dtype == BF16 ? 1.0 / 256 : 0.0;
    Worst worst = NONE;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double sum[2] = {0, 0}, size[2] = {0, 0};
            for (int half = 0; half <= gated; half++) {
                const int col = j + half * n;
                sum[half] = value(bias, dtype, col), size[half] = fabs(sum[half]);
                for (int kk = 0; kk < k; kk++) {
                    const double p = (double)value(x, dtype, (int64_t)i * ldx + kk) * w.ref[(int64_t)col * k + kk];
                    sum[half] += p, size[half] += fabs(p);
                }
            }
            double want = sum[0], allowed = acc * size[0] + rel * fabs(want) + 1e-6;
            if (gated) {
                const double g = sum[0], u = sum[1], eg = acc * size[0] + rel * fabs(g);
                const double eu = acc * size[1] + rel * fabs(u);
                want = silu_ref(g) * u;
                allowed = 1.1 * eg * fabs(u) + fabs(silu_ref(g)) * eu + 2 * rel * fabs(want) + 1e-6;
            }
            compare(&worst, (long)i * n + j, value(y, dtype, (int64_t)i * n + j), want, allowed);
        }
    char name[128];
    snprintf(name, sizeof(name), "gemm %s %s x %s m=%d k=%d n=%d%s", kname, KIND_NAMES[dtype], KIND_NAMES[kind], m, k,
             n, gated ? " gated" : "");
    done(name, &worst);
    if (!gated) {       /* rows of the packed weight: the numbers it stands for, as dtype rounds them, exactly */
        const int64_t ids[4] = {0, n - 1, n / 2, n > 33 ? 33 : 0};
        void *out = zeroed(es * 4 * k);
        gemm_rows(packed, kind == INT8 ? (const void *)w.scales8 : groups, kind, dtype, k, ids, 4, out, 2);
        Worst exact = NONE;
        for (int r = 0; r < 4; r++)
            for (int kk = 0; kk < k; kk++) {
                /* (int8: q * scale in float32; int4: q * scale is exact in float32, the sum its one rounding) */
                const int64_t at = ids[r] * k + kk;
                float f = (float)w.ref[at];
                if (kind == INT8) f = (float)((const int8_t *)w.w)[at] * w.scales8[ids[r]];
                compare(&exact, (long)r * k + kk, value(out, dtype, (int64_t)r * k + kk),
                        dtype == BF16 ? bf16_value(bf16_of(f)) : f, 1e-30);
            }
        snprintf(name, sizeof(name), "gemm_rows %s x %s k=%d", KIND_NAMES[dtype], KIND_NAMES[kind], k);
        done(name, &exact);
        free(out);
    }
    free_weight(&w), free(packed), free(groups), free(x), free(bias), free(y);
}

/* (m, k, n): one row and a few (bfloat16 and int8 chunks read in place), 7 and 17 (chunks widened first, tiles of
 * 3 rows and a rest); k past a chunk and an int4 group or short of them, n not a multiple of a panel's 32 columns. */
static const int GEMM_SHAPES[][3] = {{1, 64, 32}, {3, 100, 70}, {7, 33, 40}, {17, 1000, 130}};

static void check_gemms(void) {
    const int dtypes = gemm_dtypes();
    for (int dtype = F32; dtype <= BF16; dtype++) {
        if (!(dtypes >> dtype & 1)) continue;
        const int kinds[3] = {dtype, INT8, INT4};
        for (int i = 0; i < 3; i++)
            for (size_t s = 0; s < sizeof(GEMM_SHAPES) / sizeof(GEMM_SHAPES[0]); s++)
                for (int gated = 0; gated <= 1; gated++)
                    check_gemm(dtype, kinds[i], GEMM_SHAPES[s][0], GEMM_SHAPES[s][1], GEMM_SHAPES[s][2], gated);
    }
}
#endif

/* A paged cache of `kind` (KV heads, blocks, block size, head_dim) and its memory. */
typedef struct {
    Cache c;
    void *pages;
    uint16_t *k_meta, *v_meta;
} Pages;

static size_t row_bytes(int kind, int d) { return kind == INT4 ? (size_t)d / 2 : (size_t)d * elem_size(kind); }

static Pages new_pages(int kind, int kvh, int nb, int bs, int d) {
    Pages p = {{0}, zeroed(2 * (size_t)kvh * nb * bs * row_bytes(kind, d)), NULL, NULL};
    if (kind > F16) {
        const size_t meta = 2 * (size_t)kvh * nb * bs * (kind == INT4 ? 2 : 1);
        p.k_meta = zeroed(meta), p.v_meta = zeroed(meta);
    }
    p.c = (Cache){p.pages, p.k_meta, p.v_meta, NULL, kind, kvh, nb, bs, d, F32};
    return p;
}

static void free_pages(Pages *p) { free(p->pages), free(p->k_meta), free(p->v_meta); }

static void hash_bytes(const void *p, size_t n) {
    for (size_t i = 0; i < n; i++) codec_hash = (codec_hash ^ ((const uint8_t *)p)[i]) * 1099511628211ull;
}

/* Row `slot` of K (which 0) or V of KV head h as the pages' format defines its numbers, into x (d floats). */
static void decoded(const Pages *p, int which, int h, int64_t slot, float *x) {
    const Cache *c = &p->c;
    const int d = c->d, bs = c->bs;
    const int64_t block = slot / bs, offset = slot % bs, hb = (int64_t)h * c->nb + block;
    const int64_t at = (((int64_t)which * c->kvh + h) * c->nb + block) * bs + offset;
    const char *row = (const char *)p->pages + at * row_bytes(c->kind, d);
    const uint16_t *meta = which ? p->v_meta : p->k_meta;
    for (int i = 0; i < d; i++) {
        if (c->kind <= F16) {
            x[i] = value(row, c->kind, i);
        } else if (c->kind == INT8) {
            x[i] = (float)((const int8_t *)row)[i] * f16_value(meta[hb * bs + offset]);
        } else if (c->kind == FP8) {
            x[i] = fp8_value(((const uint8_t *)row)[i]) * f16_value(meta[hb * bs + offset]);
        } else {
            const uint8_t b = ((const uint8_t *)row)[i / 2];
            const int q = i % 2 ? b >> 4 : b & 15;
            x[i] = (float)q * f16_value(meta[hb * 2 * bs + offset]) + f16_value(meta[(hb * 2 + 1) * bs + offset]);
        }
    }
}

/* A row written by store_token (or, float16 pages, which no kernel writes, here), checked against its kind's
 * definition; the codec's bytes join codec_hash. */
static void write_row(Pages *p, int which, int h, int64_t slot, const float *row, Worst *worst) {
    const Cache *c = &p->c;
    const int d = c->d, bs = c->bs;
    const int64_t block = slot / bs, offset = slot % bs, hb = (int64_t)h * c->nb + block;
    const int64_t at = (((int64_t)which * c->kvh + h) * c->nb + block) * bs + offset;
    char *stored = (char *)p->pages + at * row_bytes(c->kind, d);
    if (c->kind == F16) {
        for (int i = 0; i < d; i++) put(stored, F16, i, row[i]);
        return;
    }
    store_token(c, which, h, slot, row);
    hash_bytes(stored, row_bytes(c->kind, d));
    const uint16_t *meta = which ? p->v_meta : p->k_meta;
    float most = 0.0f, lo = row[0], hi = row[0], x[d];
    for (int i = 0; i < d; i++) most = fmaxf(most, fabsf(row[i])), lo = fminf(lo, row[i]), hi = fmaxf(hi, row[i]);
    if (c->kind <= BF16) {
        for (int i = 0; i < d; i++)
            compare(worst, i, value(stored, c->kind, i), c->kind == BF16 ? bf16_value(bf16_of(row[i])) : row[i], 1e-30);
    } else if (c->kind == INT8 || c->kind == FP8) {
        /* scale: float16 of the largest |x| over the format's largest, at least float16's smallest normal number */
        const float top = c->kind == INT8 ? 127.0f : 448.0f, tiny = 6.103515625e-05f;
        const uint16_t scale = meta[hb * bs + offset];
        hash_bytes(&scale, 2);
        compare(worst, -1, scale, f16_of(fmaxf(most / top, tiny)), 1e-30);
        const float s = f16_value(scale);
        for (int i = 0; i < d; i++) {
            const float v = fminf(fmaxf(row[i] / s, -top), top);
            const double got = c->kind == INT8 ? ((const int8_t *)stored)[i] : ((const uint8_t *)stored)[i];
            compare(worst, i, got, c->kind == INT8 ? (double)rintf(v) : (double)fp8_of(v), 1e-30);
        }
    } else {
        /* int4: 16 levels q * scale + min, whose grid is the row's range or less (an end moved inward by 0.45 of a
         * step), stretched to fit the row along itself: each number within a step of the range over 15, and (a row
         * of tiny numbers) of the least scale, float16's smallest normal number */
        hash_bytes(&meta[hb * 2 * bs + offset], 2), hash_bytes(&meta[(hb * 2 + 1) * bs + offset], 2);
        decoded(p, which, h, slot, x);
        const float step = (hi - lo) / 15.0f;
        for (int i = 0; i < d; i++) compare(worst, i, x[i], row[i], step + 1e-3f * most + 6.103515625e-05f);
    }
}

/* Rows of random numbers over several magnitudes (float16's subnormal scales among them) into each kind of pages. */
static void check_codecs(void) {
    const int d = 72, kvh = 2, nb = 3, bs = 5;
    for (int kind = F32; kind <= INT4; kind++) {
        if (kind == F16) continue;       /* written by no kernel */
        Pages p = new_pages(kind, kvh, nb, bs, d);
        Worst worst = NONE;
        float row[72];
        for (int64_t slot = 0; slot < (int64_t)nb * bs; slot++)
            for (int h = 0; h < kvh; h++)
                for (int which = 0; which < 2; which++) {
                    const float magnitude = slot % 5 == 0 ? 1e-6f : slot % 5 == 1 ? 300.0f : 1.0f;
                    for (int i = 0; i < d; i++) row[i] = uniform(-magnitude, magnitude) + (slot % 5 == 3 ? 2.0f : 0.0f);
                    write_row(&p, which, h, slot, row, &worst);
                }
        char name[64];
        snprintf(name, sizeof(name), "store_token %s d=%d", KIND_NAMES[kind], d);
        done(name, &worst);
        free_pages(&p);
    }
}

/* Attention of each query token over its sequence's pages against softmax(q K^T * scale) V of the pages' decoded
 * numbers, in double: decode (one token a sequence) or prefill (the last few tokens of each). */
typedef struct {
    int kind, q_kind, d;
    int64_t window;
    float cap;
    int prefill;
} AttentionCase;

static void check_attention(AttentionCase a) {
    enum { SEQS = 3, KVH = 2, HEADS = 6, BS = 16, NB = 9, WIDTH = 4 };
    const int d = a.d, groups = HEADS / KVH;
    const int64_t ctx[SEQS] = {1, 17, 45}, tokens[SEQS] = {1, a.prefill ? 17 : 1, a.prefill ? 20 : 1};
    const int64_t tables[SEQS][WIDTH] = {{7, 0, 0, 0}, {2, 5, 0, 0}, {8, 1, 4, 6}};
    Pages p = new_pages(a.kind, KVH, NB, BS, d);
    Worst ignored = NONE;
    float row[128];
    for (int s = 0; s < SEQS; s++)
        for (int64_t t = 0; t < ctx[s]; t++)
            for (int h = 0; h < KVH; h++)
                for (int which = 0; which < 2; which++) {
                    for (int i = 0; i < d; i++) row[i] = uniform(-1.0f, 1.0f) * (which ? 1.0f : 2.0f);
                    write_row(&p, which, h, tables[s][t / BS] * BS + t % BS, row, &ignored);
                }
    int64_t starts[SEQS + 1] = {0};
    for (int s = 0; s < SEQS; s++) starts[s + 1] = starts[s] + tokens[s];
    const int64_t total = starts[SEQS], q_stride = HEADS * d + 8, row_size = HEADS * d;
    const size_t es = elem_size(a.q_kind);
    void *q = zeroed(es * total * q_stride), *out = zeroed(es * total * row_size);
    for (int64_t i = 0; i < total * q_stride; i++) put(q, a.q_kind, i, uniform(-1.0f, 1.0f));
    const float scale = 1.0f / sqrtf((float)d);
    int status;
    if (a.prefill)
        status = paged_prefill(q, a.q_kind, q_stride, out, SEQS, HEADS, &tables[0][0], WIDTH, ctx, scale, p.pages,
                               a.kind, KVH, NB, BS, d, p.k_meta, p.v_meta, NULL, F32, a.window, a.cap, NULL, NULL,
                               NULL, starts);
    else
        status = paged_decode(q, a.q_kind, q_stride, out, SEQS, HEADS, &tables[0][0], WIDTH, ctx, scale, p.pages,
                              a.kind, KVH, NB, BS, d, p.k_meta, p.v_meta, NULL, F32, a.window, a.cap, NULL, NULL, NULL);
    /* bfloat16 anywhere: its probabilities or products may be rounded to it (2^-9 of the values' size), and a
     * bfloat16 output is */
    const int bf16 = a.kind == BF16 || a.q_kind == BF16;
    Worst worst = NONE;
    double *scores = zeroed(sizeof(double) * 64);
    float k[128], v[128];
    for (int s = 0; s < SEQS; s++)
        for (int64_t t = 0; t < tokens[s]; t++) {
            const int64_t pos = ctx[s] - tokens[s] + t, first = a.window > 0 && pos + 1 > a.window ? pos + 1 - a.window : 0;
            for (int hq = 0; hq < HEADS; hq++) {
                const int h = hq / groups;
                const int64_t qrow = (starts[s] + t) * q_stride + (int64_t)hq * d;
                double top = -INFINITY, norm = 0.0;
                for (int64_t j = first; j <= pos; j++) {
                    decoded(&p, 0, h, tables[s][j / BS] * BS + j % BS, k);
                    double dot = 0.0;
                    for (int i = 0; i < d; i++) dot += (double)value(q, a.q_kind, qrow + i) * k[i];
                    dot *= scale;
                    scores[j - first] = a.cap > 0 ? a.cap * tanh(dot / a.cap) : dot;
                    top = fmax(top, scores[j - first]);
                }
                double want[128] = {0};
                for (int64_t j = first; j <= pos; j++) {
                    const double e = exp(scores[j - first] - top);
                    norm += e;
                    decoded(&p, 1, h, tables[s][j / BS] * BS + j % BS, v);
                    for (int i = 0; i < d; i++) want[i] += e * v[i];
                }
                const int64_t orow = (starts[s] + t) * row_size + (int64_t)hq * d;
                for (int i = 0; i < d; i++) {
                    const double w = want[i] / norm;
                    compare(&worst, (long)(orow + i), value(out, a.q_kind, orow + i), w,
                            2e-5 + (bf16 ? 4e-3 + fabs(w) / 256 : 0.0));
                }
            }
        }
    char name[128];
    snprintf(name, sizeof(name), "%s %s pages, %s q, d=%d window=%ld cap=%g", a.prefill ? "paged_prefill" : "paged_decode",
             KIND_NAMES[a.kind], KIND_NAMES[a.q_kind], d, (long)a.window, a.cap);
    if (status) compare(&worst, -1, status, 0, 1e-30);      /* out of memory */
    done(name, &worst);
    free(scores), free(q), free(out), free_pages(&p);
}

static void check_attentions(void) {
    static const AttentionCase cases[] = {
        {F32, F32, 64, 0, 0.0f, 0},  {BF16, BF16, 64, 0, 0.0f, 0}, {BF16, F32, 72, 0, 0.0f, 0},
        {F16, F32, 64, 0, 0.0f, 0},  {INT8, F32, 64, 20, 0.0f, 0}, {FP8, BF16, 72, 0, 5.0f, 0},
        {INT4, F32, 64, 0, 0.0f, 0}, {BF16, BF16, 64, 0, 0.0f, 1}, {F32, F32, 72, 12, 0.0f, 1},
        {INT8, BF16, 64, 0, 0.0f, 1},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) check_attention(cases[i]);
}

/* argmax_rows: the first maximum of each row, the first NaN where there is one; rows a stride apart, n not a
 * multiple of any vector's lanes. */
static void check_argmax(void) {
    enum { ROWS = 5, N = 1003, STRIDE = N + 5 };
    for (int dtype = F32; dtype <= BF16; dtype++) {
        void *x = zeroed(elem_size(dtype) * ROWS * STRIDE);
        int64_t want[ROWS] = {0}, got[ROWS];
        for (int r = 0; r < ROWS; r++)
            for (int i = 0; i < N; i++) put(x, dtype, (int64_t)r * STRIDE + i, r == 2 ? -INFINITY : uniform(-5.0f, 5.0f));
        put(x, dtype, 1 * STRIDE + 700, 9.0f), put(x, dtype, 1 * STRIDE + 301, 9.0f);        /* a tie: the first */
        put(x, dtype, 3 * STRIDE + 900, NAN), put(x, dtype, 3 * STRIDE + 650, NAN);          /* the first NaN */
        put(x, dtype, 4 * STRIDE + N - 1, 7.0f);                                             /* the last number */
        for (int r = 0; r < ROWS; r++) {
            float top = -INFINITY;
            for (int i = 0; i < N; i++) {
                const float f = value(x, dtype, (int64_t)r * STRIDE + i);
                if (f != f) {
                    want[r] = i;
                    break;
                }
                if (f > top) top = f, want[r] = i;
            }
        }
        argmax_rows(x, ROWS, N, STRIDE, dtype, got, 2);
        Worst worst = NONE;
        for (int r = 0; r < ROWS; r++) compare(&worst, r, (double)got[r], (double)want[r], 1e-30);
        char name[64];
        snprintf(name, sizeof(name), "argmax_rows %s n=%d", KIND_NAMES[dtype], N);
        done(name, &worst);
        free(x);
    }
}

int main(void) {
#if GEMM_SIMD
    check_gemms();
#endif
    check_codecs();
    check_attentions();
    check_argmax();
    printf("gemm kernels %d dtypes %d\n", gemm_kernels(), gemm_dtypes());
    printf("codecs %016llx\n", (unsigned long long)codec_hash);
    printf("checks: %d failed: %d\n", checks, failures);
    return failures ? 1 : 0;
}
