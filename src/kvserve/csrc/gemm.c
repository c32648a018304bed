/* y[m][n] = x[m][k] . W[n][k]^T (+ bias[n]): the CPU's linear layers, float32 or bfloat16 (`dtype`: F32
 * or BF16 of common.h), with AVX-512 F, BW and VL (bfloat16: also its BF16 extension), AVX2 and FMA, or NEON. A
 * GotoBLAS-style GEMM over a weight packed once at load: panels of NR = 32 output columns, each stored k-row by
 * k-row (bfloat16 in AVX-512 builds: pairs of k rows interleaved, as VDPBF16PS and AMX's TDPBF16PS read them; and
 * k padded with zeros to a whole number of AMX tile depths, 32). Two kernels read the same panels (`kernel`), or
 * in a build without AVX-512 another one:
 *
 * - AVX512: a tile of up to MR = 14 input rows by one panel keeps its 28 sums in registers while a
 *   k-chunk of the panel (32 KiB, in L1) and of the rows (in L2) goes by; the threads share the panels.
 * - AMX (bfloat16, where the CPU has AMX and the OS grants this process its tile data: gemm_kernels):
 *   16 or 32 rows by one panel in 2 or 4 tiles of sums, fed 32 k at a time from two tiles of the rows
 *   and two of the panel. Its tiles do 16 times the multiplications per instruction, and win from a few
 *   rows on; which kernel runs at which row count is measured at start-up (kvserve.model.gemm_choice).
 * - AVX2 (builds without AVX-512's 16-bit lanes that have AVX2, FMA and F16C: x86-64-v3): every k-chunk of a
 *   panel widened to float32 once, in L1, then tiles of up to 3 rows by the panel over it (see its section).
 * - NEON (ARM64 builds): AVX2's design in NEON's 128-bit vectors (see its section).
 *
 * Sums run in float32, in k order within chunks of KC (at a few rows and k of hundreds, float32 errors
 * up to a few times those of torch's GEMM); a bfloat16 output is rounded once, to nearest even.
 *
 * Weight-only int8 (`kind` INT8): the panels hold the weight's numbers as int8, in the layout of the
 * dtype the products take, with a float32 scale per output column. A thread widens each chunk of a panel
 * it multiplies into the dtype (exactly: |q| <= 127), in L1, and the sums are scaled as they are written:
 * the products are those of the dequantized weight q * scale, up to the order of the sums.
 *
 * Weight-only int4 (`kind` INT4), group-wise: two numbers a byte (0..15), and for each group of G4 k rows
 * of a panel its columns' scales and minimums (float16). Bfloat16 products by AVX-512 (tile_int4, with VNNI):
 * x is put in fixed point per group (split_rows), VPDPBUSD sums q . x over a group exactly in integers, and
 * each group's sums become sum(x q) scale + min sum(x): the products are those of the dequantized weight
 * q * scale + min in float32, up to the order of the sums and x's fixed point (24 bits a group). Float32
 * products, and AMX's tiles, take each chunk widened to the dequantized weight rounded to the dtype: the
 * products of that weight.
 *
 * Two more AVX-512 kernels multiply quantized weights (bfloat16 products), candidates of the measured choice
 * beside the one above (kvserve.model.gemm_choice):
 * - VNNI (with VNNI and VBMI): x itself quantized, each group of G4 numbers of a row to int8 with a float32 scale
 *   of its own (max |x| / 127, as llama.cpp's Q8_0 blocks), and the weight's bytes multiplied by x's with
 *   VPDPBUSD, exactly in int32 over a group: the products are those of the dequantized weight by x rounded to
 *   its group's int8 (each number off by at most half its group's scale, max |x| / 254: see quantize_rows).
 *   One VPDPBUSD does the work of two VDPBF16PS, and no weight is widened.
 * - WIDEN: every k-chunk of a panel widened to the dequantized weight rounded to bfloat16, once, in L1, and
 *   multiplied by VDPBF16PS for every row of the pass (int4: the products AMX's take).
 *
 * A gated weight (an MLP's gate_proj and up_proj as one [2n, k]) is packed by pairs of panels, gate
 * columns then the same up columns, and multiplied into silu(gate) * up as the sums are written
 * (SwiGLU): the 2n products are never stored, nor read back by a separate activation pass. */
#include "common.h"

#if GEMM_SIMD
#if AVX512_BW_VL && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define AMX 0
#endif

#define NR 32                /* output columns per panel */
#if AVX512_BW_VL
#define NV (NR / 16)         /* vectors of 16 columns per panel */
#define MR 14                /* rows per tile: 28 sums + 2 weight vectors + 1 broadcast in 32 registers */
#define KC 256               /* k per chunk (bfloat16: 512): NR x KC of the panel fills half of L1 */
#elif AVX2_FMA
#define NV8 (NR / 8)         /* AVX2: vectors of 8 columns per panel */
#define MR 3                 /* rows per tile: 12 sums + 3 broadcasts + 1 weight vector in 16 registers */
#define KC 128               /* k per chunk, widened to float32: NR x KC floats fill half of a 32 KiB L1 */
#else
#define NV4 (NR / 4)         /* NEON: vectors of 4 columns per panel */
#define MR 3                 /* rows per tile: 24 sums + 3 broadcasts + 2 weight vectors in 32 registers */
#define KC 128               /* k per chunk, widened to float32: NR x KC floats fill half of a 32 KiB L1 */
#endif
#define MC (126 / MR * MR)   /* rows that share a pass over the panels: read by every panel, they stay in L2 */
#define KT 32                /* k of an AMX tile (bfloat16): a panel's k is padded to a multiple of it */
/* bfloat16 panels hold pairs of k rows interleaved, as AVX-512's VDPBF16PS and AMX's tiles read them; AVX2 and NEON
 * builds widen every chunk to float32, and every dtype's panels hold their numbers k row by k row, as float32's */
#define PAIRED AVX512_BW_VL

static int amx_granted;     /* the OS lets this process use AMX's tile data (gemm_kernels asked) */

/* Bits of the kernels this build can run in this process: 1 << GEMM_AVX512 (AVX2 builds: 1 << GEMM_AVX2; ARM64
 * builds: 1 << GEMM_NEON), with the quantized weights' 1 << GEMM_WIDEN and 1 << GEMM_VNNI where the build has
 * their instructions, and 1 << GEMM_AMX where the CPU has AMX (BF16) and the OS grants its tile state (asked
 * here, once: call before gemm runs AMX). */
int gemm_kernels(void) {
#if AMX
    if (!amx_granted) amx_granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#endif
    int quantized = 0;      /* the quantized weights' own kernels (tiles of int8 rows need VBMI's byte shuffles) */
#if AVX512_BW_VL && defined(__AVX512BF16__)
    quantized |= 1 << GEMM_WIDEN;
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
    quantized |= 1 << GEMM_VNNI;
#endif
#endif
    return 1 << (AVX512_BW_VL ? GEMM_AVX512 : AVX2_FMA ? GEMM_AVX2 : GEMM_NEON) | (amx_granted ? 1 << GEMM_AMX : 0) |
           quantized;
}

/* Bits of the dtypes this build multiplies (1 << F32 | 1 << BF16): AVX-512 builds multiply bfloat16 with its
 * BF16 extension, AVX2 and NEON builds widen it to float32. */
int gemm_dtypes(void) {
#if defined(__AVX512BF16__) || !AVX512_BW_VL
    return 1 << F32 | 1 << BF16;
#else
    return 1 << F32;
#endif
}

/* Panels of a weight of n output columns (gated: n = 2 x its outputs; a pair of panels per 32 outputs). */
static int num_panels(int n, int gated) { return gated ? 2 * ((n / 2 + NR - 1) / NR) : (n + NR - 1) / NR; }

/* k rows of a panel: bfloat16 pads k to whole AMX tiles (the rows past k are zeros). */
static int panel_depth(int dtype, int k) { return dtype == BF16 ? (k + KT - 1) / KT * KT : k; }

/* Numbers (of `kind`; INT4: two a byte) the packed copy of an [n, k] weight takes, laid out for products in
 * dtype. */
int64_t gemm_packed_size(int kind, int dtype, int n, int k, int gated) {
    (void)kind;
    return (int64_t)num_panels(n, gated) * panel_depth(dtype, k) * NR;
}

#define G4 32        /* k rows of an int4 group: a chunk and an AMX tile hold whole groups */

/* Groups of an int4 weight's k rows, each with NR scales and NR minimums a panel. */
static int int4_groups(int dtype, int k) { return (panel_depth(dtype, k) + G4 - 1) / G4; }

/* Float16 numbers an int4 weight's scales and minimums take (gemm_pack_groups). */
int64_t gemm_groups_size(int dtype, int n, int k, int gated) {
    return (int64_t)num_panels(n, gated) * int4_groups(dtype, k) * 2 * NR;
}

/* Where number i of a packed int4 weight lies (packed_at's order): its byte, and whether in the high half.
 * bfloat16 products (PAIRED): blocks of four k rows (128 numbers) of 64 bytes, byte 4c + t holding k row t of column c
 * in its low half and of column c + 16 in its high half, so that a byte-wise mask (columns 0-15) or a shift
 * and a mask (16-31) gives 16 32-bit lanes of four k rows each, as VPDPBUSD reads them (tile_int4). float32:
 * a unit of a k row (32 numbers, 16 bytes), byte j its number j in the low half and j + 16 in the high half (so
 * too bfloat16 products in AVX2 and NEON builds). */
static inline int64_t int4_byte(int dtype, int64_t i, int *high) {
    if (dtype == BF16 && PAIRED) {    /* i: packed_at's index, pairs of k rows interleaved column by column */
        const int v = (int)(i % 128), j = v % 64 / 2, t = 2 * (v / 64) + v % 2;
        *high = j >= 16;
        return i / 128 * 64 + 4 * (j % 16) + t;
    }
    const int v = (int)(i % NR);
    *high = v >= NR / 2;
    return i / NR * (NR / 2) + v % (NR / 2);
}

/* The weight's row (output column) that column j of panel p holds, or -1 for none (padding). */
static int panel_column(int p, int j, int n, int gated) {
    if (!gated) return p * NR + j < n ? p * NR + j : -1;
    const int half = n / 2, col = p / 2 * NR + j;
    return col < half ? (p % 2) * half + col : -1;
}

/* int8 numbers for bfloat16 products are widened 64 at a time (a pair of k rows of a panel) by byte lookups
 * (VBMI's VPERMI2B: the high and low bytes of each |q| as bfloat16) whose two halves are then interleaved
 * 128-bit lane by lane (VPUNPCKLBW, VPUNPCKHBW): so the 64 are stored in the order those lanes take them.
 * Elsewhere (no VBMI) they are widened through float32, in their own order. */
#if defined(__AVX512VBMI__) && defined(__AVX512BF16__)
#define INT8_BY_BYTES 1
#else
#define INT8_BY_BYTES 0
#endif

/* int4 numbers for bfloat16 products are multiplied as bytes by x in fixed point (VNNI's VPDPBUSD: tile_int4);
 * elsewhere (no VNNI) each chunk is widened, as for float32 products. */
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define INT4_BY_VNNI 1
#else
#define INT4_BY_VNNI 0
#endif
/* The VNNI kernel (x in int8): int8 panels' bytes are reordered for VPDPBUSD as they are read (VBMI's VPERMB). */
#define INT8_ROWS (INT4_BY_VNNI && INT8_BY_BYTES)

/* Where number v (of 64) of a pair of k rows lies as stored (INT8_BY_BYTES): the unpacks take bytes 8l..8l+7
 * of 128-bit lane l to the low half of the pair, the next 8 to the high half. */
static inline int int8_order(int v) { return v < 32 ? v / 8 * 16 + v % 8 : (v - 32) / 8 * 16 + 8 + v % 8; }

/* Where number kk of column j of panel p lies in a packed weight of `kind` for products in dtype, `depth` k
 * rows a panel (bfloat16, PAIRED: pairs of k rows interleaved, column by column; int8 for them: see int8_order). */
static inline int64_t packed_at(int kind, int dtype, int p, int depth, int kk, int j) {
    if (dtype != BF16 || !PAIRED) return ((int64_t)p * depth + kk) * NR + j;
    const int64_t pair = ((int64_t)p * depth + kk / 2 * 2) * NR;
    const int v = 2 * j + kk % 2;
    return pair + (kind == INT8 && INT8_BY_BYTES ? int8_order(v) : v);
}

/* w [n, k] of `kind` (the dtype's, INT8, or INT4: one number 0..15 a byte) packed for products in dtype. */
void gemm_pack(const void *w, int kind, int dtype, int n, int k, int gated, void *packed) {
    const int panels = num_panels(n, gated), depth = panel_depth(dtype, k);
    const size_t size = elem_size(kind);
    #pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++) {
        if (kind == INT4) memset((uint8_t *)packed + (int64_t)p * depth * NR / 2, 0, (size_t)depth * NR / 2);
        for (int kk = 0; kk < depth; kk++)
            for (int j = 0; j < NR; j++) {
                const int col = panel_column(p, j, n, gated), real = col >= 0 && kk < k;
                const int64_t to = packed_at(kind, dtype, p, depth, kk, j);
                if (kind == INT4) {
                    int high;
                    const int64_t byte = int4_byte(dtype, to, &high);
                    const uint8_t q = real ? ((const uint8_t *)w)[(int64_t)col * k + kk] & 15 : 0;
                    ((uint8_t *)packed)[byte] |= (uint8_t)(q << (high ? 4 : 0));
                } else if (real) {
                    memcpy((char *)packed + to * size, (const char *)w + ((int64_t)col * k + kk) * size, size);
                } else {
                    memset((char *)packed + to * size, 0, size);
                }
            }
    }
}

/* An int4 weight's scales and minimums, [n][groups] each (float16), as the panels' groups hold them: for each
 * panel and group of G4 k rows, its NR columns' scales, then their minimums (padding: zeros). */
void gemm_pack_groups(const uint16_t *scales, const uint16_t *mins, int dtype, int n, int k, int gated,
                      uint16_t *out) {
    const int panels = num_panels(n, gated), groups = int4_groups(dtype, k), given = (k + G4 - 1) / G4;
    for (int p = 0; p < panels; p++)
        for (int g = 0; g < groups; g++)
            for (int j = 0; j < NR; j++) {
                const int col = panel_column(p, j, n, gated), real = col >= 0 && g < given;
                uint16_t *at = out + ((int64_t)p * groups + g) * 2 * NR + j;
                at[0] = real ? scales[(int64_t)col * given + g] : 0;
                at[NR] = real ? mins[(int64_t)col * given + g] : 0;
            }
}

/* Number kk of column j of panel p of a packed weight of `kind` (INT8: times its column's scale; INT4: times
 * its group's scale, plus its minimum) as a float. */
static inline float packed_value(const void *packed, const void *scales, int kind, int dtype, int p, int k, int kk,
                                 int j, int64_t col) {
    const int depth = panel_depth(dtype, k);
    const int64_t i = packed_at(kind, dtype, p, depth, kk, j);
    if (kind == INT8) return ((const int8_t *)packed)[i] * ((const float *)scales)[col];
    if (kind != INT4) return param(packed, kind, i);
    int high;
    const uint8_t byte = ((const uint8_t *)packed)[int4_byte(dtype, i, &high)];
    const uint16_t *group = (const uint16_t *)scales + ((int64_t)p * int4_groups(dtype, k) + kk / G4) * 2 * NR + j;
    return (float)(high ? byte >> 4 : byte & 15) * f16_to_float(group[0]) + f16_to_float(group[NR]);
}

/* Row `col` of a (not gated) weight [n, k] from its packed copy (products in dtype), as floats that dtype holds
 * (a quantized weight's rounded there, as gemm_rows stores them): an embedding table whose only copy is the
 * packed weight of the tied lm_head. */
void gemm_row(const void *packed, const void *scales, int kind, int dtype, int k, int64_t col, float *out) {
    const int p = (int)(col / NR), j = (int)(col % NR);
    for (int kk = 0; kk < k; kk++) out[kk] = as_dtype(packed_value(packed, scales, kind, dtype, p, k, kk, j, col), dtype);
}

/* Rows ids[0..count) of a (not gated) weight [n, k], from its packed copy, into out [count, k] of dtype (a
 * quantized weight's dequantized numbers, rounded to dtype). */
void gemm_rows(const void *packed, const void *scales, int kind, int dtype, int k, const int64_t *ids, int count,
               void *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int i = 0; i < count; i++) {
        const int p = (int)(ids[i] / NR), j = (int)(ids[i] % NR);
        for (int kk = 0; kk < k; kk++)
            store(out, dtype, (int64_t)i * k + kk, packed_value(packed, scales, kind, dtype, p, k, kk, j, ids[i]));
    }
}

#if AVX512_BW_VL
/* The scales and minimums of an int4 group (NR of each, float16) as two vectors of each: columns 0-15 and
 * 16-31. */
static inline void int4_group(const uint16_t *group, __m512 s[2], __m512 m[2]) {
    for (int j = 0; j < NV; j++) {
        s[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(group + 16 * j)));
        m[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(group + NR + 16 * j)));
    }
}

/* k rows k0 .. k0 + rows (bfloat16: k0 and rows multiples of 4) of an int4 panel (its bytes, and its groups'
 * scales and minimums) dequantized, q * scale + min rounded to dtype, into `to` in the panel's order. (q * scale
 * is exact in float32, 4 bits by 11: the one rounding is the sum's, fused or not.) bfloat16: a block of four k
 * rows is first reordered k row by k row (16 bytes each, as float32's), and each pair of rows interleaved
 * column by column as it is stored. */
static void widen_int4(const uint8_t *panel, const uint16_t *groups, int k0, int rows, int dtype, void *to) {
    __m512 s[2], m[2];
    const __m512i nibble = _mm512_set1_epi32(15);
#if defined(__AVX512BF16__)
    if (dtype == BF16) {
        /* byte 4c + t of each 128-bit lane to 4t + c (VPSHUFB), then dword 4L + t to 4t + L (VPERMD) */
        const __m512i in_lanes = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
        const __m512i by_rows = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                               6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        for (int kk = k0; kk < k0 + rows; kk += 4) {
            if (kk == k0 || kk % G4 == 0) int4_group(groups + (int64_t)(kk / G4) * 2 * NR, s, m);
            uint8_t block[64] __attribute__((aligned(64)));
            const __m512i packed = _mm512_loadu_si512(panel + (int64_t)(kk / 4) * 64);
            _mm512_store_si512(block, _mm512_permutexvar_epi32(by_rows, _mm512_shuffle_epi8(packed, in_lanes)));
            uint16_t *out = (uint16_t *)to + (int64_t)(kk - k0) * NR;
            for (int pair = 0; pair < 2; pair++) {
                __m512 w[2][NV];      /* its k rows, columns 0-15 and 16-31 */
                for (int t = 0; t < 2; t++) {
                    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(block + 16 * (2 * pair + t))));
                    w[t][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, nibble)), s[0], m[0]);
                    w[t][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), s[1], m[1]);
                }
                for (int j = 0; j < NV; j++)
                    _mm512_storeu_si512(out + pair * 2 * NR + 32 * j,
                                        _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(w[1][j], w[0][j])));
            }
        }
        return;
    }
#endif
    for (int kk = k0; kk < k0 + rows; kk++) {
        if (kk == k0 || kk % G4 == 0) int4_group(groups + (int64_t)(kk / G4) * 2 * NR, s, m);
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(panel + (int64_t)kk * NR / 2)));
        _mm512_storeu_ps((float *)to + (int64_t)(kk - k0) * NR,
                         _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, nibble)), s[0], m[0]));
        _mm512_storeu_ps((float *)to + (int64_t)(kk - k0) * NR + 16,
                         _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), s[1], m[1]));
    }
}

#if INT8_BY_BYTES
/* bfloat16 of 0..127, its high bytes and its low bytes, 64 a register (the tables of widen64). */
typedef struct {
    __m512i high[2], low[2];
} Int8Tables;

static inline Int8Tables int8_tables(void) {
    uint8_t high[128], low[128];
    for (int i = 0; i < 128; i++) {
        const float f = (float)i;
        uint32_t u;
        memcpy(&u, &f, 4);
        high[i] = (uint8_t)(u >> 24), low[i] = (uint8_t)(u >> 16);
    }
    return (Int8Tables){{_mm512_loadu_si512(high), _mm512_loadu_si512(high + 64)},
                        {_mm512_loadu_si512(low), _mm512_loadu_si512(low + 64)}};
}

/* 64 int8 numbers (a pair of k rows of a panel, as stored: int8_order) as bfloat16, in pair order, into to:
 * the bytes of |q| looked up, the sign bit or-ed on. */
static inline __attribute__((always_inline)) void widen64(const Int8Tables *t, const int8_t *from, uint16_t *to) {
    const __m512i q = _mm512_loadu_si512(from), a = _mm512_abs_epi8(q);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t->high[0], a, t->high[1]), q,
                                                 _mm512_set1_epi8((char)0x80), 0xF8);     /* hi | (q & 0x80) */
    const __m512i lo = _mm512_permutex2var_epi8(t->low[0], a, t->low[1]);
    _mm512_storeu_si512(to, _mm512_unpacklo_epi8(lo, hi));
    _mm512_storeu_si512(to + 32, _mm512_unpackhi_epi8(lo, hi));
}
#endif

/* `count` int8 numbers (a multiple of 64) of a panel as dtype's, in the panel's order, into `to`: exact, |q| <=
 * 127 (BF16: builds with its extension). `next`, if any, is prefetched: what the thread widens next. */
static void widen_int8(const int8_t *from, const int8_t *next, int64_t count, int dtype, void *to) {
#if INT8_BY_BYTES
    if (dtype == BF16) {
        const Int8Tables t = int8_tables();
        for (int64_t i = 0; i < count; i += 64) {
            if (next) _mm_prefetch((const char *)(next + i), _MM_HINT_T1);
            widen64(&t, from + i, (uint16_t *)to + i);
        }
        return;
    }
#endif
    for (int64_t i = 0; i < count; i += 32) {
        if (next && i % 64 == 0) _mm_prefetch((const char *)(next + i), _MM_HINT_T1);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(from + i))));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(from + i + 16))));
        if (dtype == BF16) {
#if defined(__AVX512BF16__)
            _mm512_storeu_si512((uint16_t *)to + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
#endif
        } else {
            _mm512_storeu_ps((float *)to + i, lo);
            _mm512_storeu_ps((float *)to + i + 16, hi);
        }
    }
}

#endif

/* Memory of a thread's own, kept from call to call (grown as needed). */
typedef struct {
    void *data;
    size_t bytes;
} Scratch;

#if INT4_BY_VNNI
static __thread Scratch fixed_rows;     /* an int4 weight's: x's rows in fixed point (split_rows) */
#endif
#if AVX512_BW_VL
static __thread Scratch spread;         /* a pass's rows of x, SPREAD bytes further apart than k numbers */
#endif

/* Whether ok holds on every thread of the team: one answer, the same on every thread, so that where one thread's
 * memory ran out its whole team takes the same other way (a thread that went into other worksharing loops than its
 * team's would leave theirs waiting, or their work undone). Called from every thread of the team, which it waits
 * for. (Unused where the build has neither AMX nor VNNI.) */
static __attribute__((unused)) int team_all(int ok) {
    int failed = 0, *shared;
    #pragma omp single copyprivate(shared)
    shared = &failed;                   /* the flag of the thread that ran the single, for all to see */
    if (!ok) {
        #pragma omp atomic write
        *shared = 1;
    }
    #pragma omp barrier
    int any;
    #pragma omp atomic read
    any = *shared;
    #pragma omp barrier                 /* that thread's flag outlives every thread's read of it */
    return !any;
}

/* At least `bytes` of s, from a 64-byte boundary; NULL where memory ran out. (Unused in NEON and AVX2 builds.) */
static __attribute__((unused)) void *scratch(Scratch *s, size_t bytes) {
    if (bytes > s->bytes) {
        free(s->data);
        s->bytes = (bytes + 63) / 64 * 64;
        s->data = aligned_alloc(64, s->bytes);
        if (!s->data) s->bytes = 0;
    }
    return s->data;
}


#if AVX512_BW_VL
#define SPREAD 64            /* bytes between the end of a row's numbers and the next row in spread_rows' copy */
/* The mb rows of a pass (*rows, *ld numbers apart, k numbers of `size` bytes each) copied into the thread's own
 * memory with rows SPREAD bytes further apart, and *rows, *ld pointed at the copy: where a row takes a whole number
 * of 4 KiB, a tile's rows at one k would share one set of L1 (8 or 12 ways for its 14 rows) and evict each other
 * at every step. Kept as they are where memory runs out (the products are the same). */
static void spread_rows(const char **rows, int64_t *ld, int mb, int k, size_t size) {
    const int64_t stride = ((int64_t)k * size + 63) / 64 * 64 + SPREAD;
    char *copy = scratch(&spread, (size_t)mb * stride);
    if (!copy) return;
    for (int r = 0; r < mb; r++) memcpy(copy + r * stride, *rows + r * *ld * size, (size_t)k * size);
    *rows = copy;
    *ld = stride / size;
}
#endif

/* What a panel's last k-chunk writes: y; or (a gated weight's) its gate sums, or silu(gate) * up. */
enum { PLAIN, GATE, SWIGLU };

typedef struct {
    int first, last;        /* the k-chunk starts the sums / ends them (the output is written) */
    int cols;               /* columns of the panel that are real (the last panel may be partial) */
    const void *bias;       /* NULL: none */
    const float *scale;     /* the panel's columns' scales (an int8 weight), or NULL */
    int out;                /* PLAIN, GATE or SWIGLU */
    float *gate;            /* GATE, SWIGLU: the tile's gate sums, as the dtype rounds them, NR a row */
} Chunk;

#if AVX512_BW_VL
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

/* Vector j of row r of a tile's whole sums, v, into y with the bias: or (a gated weight's) its gate sums,
 * or silu(gate) * up. */
static inline __attribute__((always_inline)) void emit(__m512 v, int r, int j, const Chunk *c, int dtype, void *y,
                                                      int ldy) {
    const __mmask16 m = lanes16(c->cols - 16 * j);
    if (c->scale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, c->scale + 16 * j));
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
            return;
        }
        v = rounded(_mm512_mul_ps(rounded(silu16(_mm512_loadu_ps(gate)), dtype), v), dtype);
    }
    if (dtype == BF16) {
#if defined(__AVX512BF16__)
        _mm256_mask_storeu_epi16((uint16_t *)y + (int64_t)r * ldy + 16 * j, m, (__m256i)_mm512_cvtneps_pbh(v));
#endif
    } else {
        _mm512_mask_storeu_ps((float *)y + (int64_t)r * ldy + 16 * j, m, v);
    }
}

/* The chunk's sums join the earlier chunks' in `partial` (sums of chunks, not one running sum: the
 * rounding error grows with KC, not k), or (last chunk) go with the bias to y. */
static inline __attribute__((always_inline)) void finish(__m512 acc[MR][NV], float *partial, int mr, const Chunk *c,
                                                        int dtype, void *y, int ldy) {
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < NV; j++) {
            const __m512 v = c->first ? acc[r][j] : _mm512_add_ps(_mm512_loadu_ps(partial + r * NR + 16 * j), acc[r][j]);
            if (c->last) emit(v, r, j, c, dtype, y, ldy);
            else _mm512_storeu_ps(partial + r * NR + 16 * j, v);
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

#if INT4_BY_VNNI
#define MRQ 2        /* rows of an int4 tile: 12 integer sums and 4 float ones in registers */
#define PIECES 3     /* bytes of x's fixed point (split_rows) */
#define PREFETCH_AHEAD 1024  /* bytes of a panel read ahead (tile_int4): batch-1 decode streams it from memory */
#define PREFETCH_FAR 4096    /* and further ahead into L2: batch-1 decode measured faster with both */

/* The group of G4 bfloat16 numbers at x, of which the first `have` are there (none past k: zeros), as two
 * halves of float32; returns their largest |x|. */
static inline float load_group(const uint16_t *x, int have, __m512 half[2]) {
    have = have < 0 ? 0 : have < G4 ? have : G4;
    const __m512i v = _mm512_maskz_loadu_epi16(have == G4 ? ~0u : (1u << have) - 1, x);
    half[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
    half[1] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(half[0]), _mm512_abs_ps(half[1])));
}

/* Rows 0 .. m of x (ldx apart), bfloat16, in fixed point for the int4 tiles: each group of G4 numbers (past k:
 * zeros, up to `depth`) as v = x / unit rounded to an integer, unit the power of two that puts the group's
 * largest |x| just under 2^22, and v as three signed bytes, v = hi 2^16 + mid 2^8 + lo: pieces[(r PIECES + i)
 * depth + kk] (i: lo, mid, hi). units[r groups + g] is the unit, sums[r groups + g] the group's sum of x (floats).
 * A bfloat16 number within 2^14 of its group's largest is exact; any other is off by at most half a unit, under
 * 2^-22 of that largest: a sum's error is then at most 2^-22 max|x| sum|w| a group, float32's order. */
static void split_rows(const uint16_t *x, int64_t ldx, int m, int k, int depth, int8_t *pieces, float *units,
                       float *sums) {
    const int groups = depth / G4;
    for (int r = 0; r < m; r++)
        for (int g = 0; g < groups; g++) {
            __m512 half[2];
            const float largest = load_group(x + r * ldx + g * G4, k - g * G4, half);
            int e = 0;
            if (largest > 0) frexpf(largest, &e);            /* largest < 2^e */
            units[r * groups + g] = ldexpf(1.0f, e - 22);
            sums[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(half[0], half[1]));
            const __m512 to_fixed = _mm512_set1_ps(ldexpf(1.0f, 22 - e));
            int8_t *row = pieces + (int64_t)r * PIECES * depth + g * G4;
            for (int h = 0; h < 2; h++) {
                __m512i rest = _mm512_cvtps_epi32(_mm512_mul_ps(half[h], to_fixed));
                for (int i = 0; i < PIECES; i++) {    /* the low byte as signed, then the rest shifted down */
                    const __m512i byte = _mm512_sub_epi32(
                        _mm512_and_si512(_mm512_add_epi32(rest, _mm512_set1_epi32(128)), _mm512_set1_epi32(255)),
                        _mm512_set1_epi32(128));
                    _mm_storeu_si128((__m128i *)(row + (int64_t)i * depth + 16 * h), _mm512_cvtepi32_epi8(byte));
                    rest = _mm512_srai_epi32(_mm512_sub_epi32(rest, byte), 8);
                }
            }
        }
}

#if INT8_ROWS
#define MRV 6        /* rows of a tile of int8 rows (quantize_rows): 12 integer sums and 12 float ones in registers */

/* Rows 0 .. m of x (ldx apart), bfloat16, quantized for the VNNI kernel: each group of G4 numbers (past k: zeros,
 * up to `depth`) as q = x / unit rounded to nearest, unit = the group's max |x| / 127 (0 for a group of zeros),
 * so |q| <= 127 and x - q unit is at most half a unit: max |x| / 254. q[r depth + kk]; units[r groups + g] the
 * unit, sums[r groups + g] the group's sum of q unit (the rounded x's). */
static void quantize_rows(const uint16_t *x, int64_t ldx, int m, int k, int depth, int8_t *q, float *units,
                          float *sums) {
    const int groups = depth / G4;
    for (int r = 0; r < m; r++)
        for (int g = 0; g < groups; g++) {
            __m512 half[2];
            const float largest = load_group(x + r * ldx + g * G4, k - g * G4, half);
            const __m512 to_q = _mm512_set1_ps(largest > 0 ? 127.0f / largest : 0.0f);
            __m512i total = _mm512_setzero_si512();
            for (int h = 0; h < 2; h++) {       /* |x| 127 / largest <= 127 (to within float32's rounding) */
                const __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(half[h], to_q));
                total = _mm512_add_epi32(total, n);
                _mm_storeu_si128((__m128i *)(q + (int64_t)r * depth + g * G4 + 16 * h), _mm512_cvtepi32_epi8(n));
            }
            units[r * groups + g] = largest / 127.0f;
            sums[r * groups + g] = (float)_mm512_reduce_add_epi32(total) * units[r * groups + g];
        }
}

/* Where VPDPBUSD's order takes its bytes from two pairs of k rows of an int8 panel as stored (int8_order), once each
 * is shuffled by this table (VPERMB): byte s of the shuffled pair is column j's k row s % 2 of the pair, j = 4L + w
 * for words w < 4 of 128-bit lane L, else 16 + 4L + w - 4; interleaving the two pairs' words (VPUNPCKLWD,
 * VPUNPCKHWD) then gives columns 0-15 and 16-31, four k rows of a column a 32-bit lane. */
static inline __m512i vnni_order(void) {
    int8_t at[64] __attribute__((aligned(64)));
    for (int s = 0; s < 64; s++) {
        const int lane = s / 16, w = s % 16 / 2, j = w < 4 ? 4 * lane + w : 16 + 4 * lane + w - 4;
        at[s] = (int8_t)int8_order(2 * j + s % 2);
    }
    return _mm512_load_si512(at);
}

/* mr (<= MRV) rows of x by kc k of an int8 panel (bfloat16 products), its k-chunk starting at a group, x as
 * quantize_rows gives it (`q`, `units`, `sums`: from the chunk's start). Each four k rows of the panel are
 * reordered for VPDPBUSD (vnni_order) with 128 added to every number (an unsigned byte, as VPDPBUSD's first
 * operand is), so a group's integer sums are sum (w + 128) q, exact in int32; once a group they are scaled by
 * its unit into float32, and once a chunk 128 times the sum of the rows' rounded x is taken off. The column's
 * scale is applied as the sums are written: the products are those of the dequantized weight by x rounded to
 * int8, up to the order of the sums. */
static inline __attribute__((always_inline)) void tile_vnni8(const int8_t *panel, const int8_t *next, __m512i order,
                                                            const int8_t *q, int depth, const float *units,
                                                            const float *sums, int ldg, int kc, int mr, float *partial,
                                                            const Chunk *c, void *y, int ldy) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[MR][NV];
    float shift[MRV] = {0};
    begin(acc);
    for (int g0 = 0; g0 < kc; g0 += G4) {
        __m512i dot[MRV][NV];
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < NV; j++) dot[r][j] = _mm512_setzero_si512();
        #pragma GCC unroll 8
        for (int kk = g0; kk < g0 + G4; kk += 4) {
            const int8_t *b = panel + (int64_t)kk * NR;
            _mm_prefetch((const char *)(b + 2 * PREFETCH_AHEAD), _MM_HINT_T0);
            _mm_prefetch((const char *)(b + 2 * PREFETCH_FAR), _MM_HINT_T1);
            if (next) {
                _mm_prefetch((const char *)(next + (int64_t)kk * NR), _MM_HINT_T1);
                _mm_prefetch((const char *)(next + (int64_t)kk * NR + 2 * NR), _MM_HINT_T1);
            }
            const __m512i lo = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(b));
            const __m512i hi = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(b + 2 * NR));
            const __m512i w[NV] = {_mm512_xor_si512(_mm512_unpacklo_epi16(lo, hi), flip),
                                   _mm512_xor_si512(_mm512_unpackhi_epi16(lo, hi), flip)};
            for (int r = 0; r < mr; r++) {
                int32_t four;
                memcpy(&four, q + (int64_t)r * depth + kk, 4);
                const __m512i a = _mm512_set1_epi32(four);
                for (int j = 0; j < NV; j++) dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], w[j], a);
            }
        }
        for (int r = 0; r < mr; r++) {
            const __m512 unit = _mm512_set1_ps(units[r * ldg + g0 / G4]);
            shift[r] += sums[r * ldg + g0 / G4];
            for (int j = 0; j < NV; j++) acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][j]), unit, acc[r][j]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < NV; j++) acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(shift[r]), _mm512_set1_ps(-128.0f), acc[r][j]);
    finish(acc, partial, mr, c, BF16, y, ldy);
}

/* tile_vnni8 with its row count a constant in each case. */
static void tile8(const int8_t *panel, const int8_t *next, __m512i order, const int8_t *q, int depth,
                  const float *units, const float *sums, int ldg, int kc, int mr, float *partial, const Chunk *c,
                  void *y, int ldy) {
#define ROWS(R) case R: tile_vnni8(panel, next, order, q, depth, units, sums, ldg, kc, R, partial, c, y, ldy); break;
    switch (mr) { ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) }
#undef ROWS
}
#endif

#if INT8_ROWS
#define ROWS4 MRV    /* rows of an int4 tile at most: MRQ of split_rows' pieces, MRV of quantize_rows' int8 */
#else
#define ROWS4 MRQ
#endif

/* mr (<= MRQ) rows of x by kc k of an int4 panel (bfloat16 products), its k-chunk starting at a group, x as
 * split_rows gives it (`pieces`, np = PIECES a row, `units`, `sums`: from the chunk's start); or (np = 1, mr <=
 * MRV) as quantize_rows gives it, one piece, x rounded to int8. Over a group of G4 k,
 * sum_k x (q scale + min) = scale sum_k x q + min sum_k x: VPDPBUSD sums q . v exactly in int32, a piece of v at
 * a time (q 0..15 unsigned bytes straight from the panel: a mask and a shift), and once a group, for each column,
 * the pieces' sums join as integers (|sum q v| < 32 x 15 x 2^22 < 2^31) and become sum(x q) scale + min sum(x)
 * in float32. The products are those of the dequantized weight q * scale + min in float32, up to the order of the
 * sums and x's rounding to its group's fixed point. */
static inline __attribute__((always_inline)) void tile_int4(const uint8_t *panel, const uint16_t *groups,
                                                           const int8_t *pieces, int np, int depth,
                                                           const float *units, const float *sums, int ldg, int kc,
                                                           int mr, float *partial, const Chunk *c, void *y, int ldy) {
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[MR][NV];
    begin(acc);
    for (int g0 = 0; g0 < kc; g0 += G4) {
        __m512i dot[ROWS4][PIECES][NV];
        for (int r = 0; r < mr; r++)
            for (int i = 0; i < np; i++)
                for (int j = 0; j < NV; j++) dot[r][i][j] = _mm512_setzero_si512();
        #pragma GCC unroll 8     /* a group whole: the sums stay in their registers, never copied */
        for (int kk = g0; kk < g0 + G4; kk += 4) {
            _mm_prefetch((const char *)(panel + (int64_t)kk / 4 * 64 + PREFETCH_AHEAD), _MM_HINT_T0);
            _mm_prefetch((const char *)(panel + (int64_t)kk / 4 * 64 + PREFETCH_FAR), _MM_HINT_T1);
            const __m512i bytes = _mm512_loadu_si512(panel + (int64_t)kk / 4 * 64);
            const __m512i q[NV] = {_mm512_and_si512(bytes, low), _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low)};
            for (int r = 0; r < mr; r++)
                for (int i = 0; i < np; i++) {
                    int32_t four;
                    memcpy(&four, pieces + ((int64_t)r * np + i) * depth + kk, 4);
                    const __m512i a = _mm512_set1_epi32(four);
                    for (int j = 0; j < NV; j++) dot[r][i][j] = _mm512_dpbusd_epi32(dot[r][i][j], q[j], a);
                }
        }
        const uint16_t *group = groups + (int64_t)g0 / G4 * 2 * NR;
        /* the scales and minimums are a second stream, a group's two lines per 512 bytes of the panel */
        _mm_prefetch((const char *)(group + 8 * 2 * NR), _MM_HINT_T0);
        _mm_prefetch((const char *)(group + 8 * 2 * NR + 32), _MM_HINT_T0);
        for (int j = 0; j < NV; j++) {
            const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(group + 16 * j)));
            const __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(group + NR + 16 * j)));
            for (int r = 0; r < mr; r++) {
                const __m512i whole = np == 1 ? dot[r][0][j] : _mm512_add_epi32(
                    _mm512_add_epi32(_mm512_slli_epi32(dot[r][2][j], 16), _mm512_slli_epi32(dot[r][1][j], 8)), dot[r][0][j]);
                const __m512 sum = _mm512_mul_ps(_mm512_cvtepi32_ps(whole), _mm512_set1_ps(units[r * ldg + g0 / G4]));
                acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * ldg + g0 / G4]), min,
                                            _mm512_fmadd_ps(sum, scale, acc[r][j]));
            }
        }
    }
    finish(acc, partial, mr, c, BF16, y, ldy);
}

/* tile_int4 with its row count and pieces a row (np: PIECES, or 1 where INT8_ROWS) constants in each case. */
static void tile4(const uint8_t *panel, const uint16_t *groups, const int8_t *pieces, int np, int depth,
                  const float *units, const float *sums, int ldg, int kc, int mr, float *partial, const Chunk *c,
                  void *y, int ldy) {
#define ROWS(N, R) case R: tile_int4(panel, groups, pieces, N, depth, units, sums, ldg, kc, R, partial, c, y, ldy); break;
    if (np == PIECES) {
        switch (mr) { ROWS(PIECES, 1) ROWS(PIECES, 2) }
        return;
    }
#if INT8_ROWS
    switch (mr) { ROWS(1, 1) ROWS(1, 2) ROWS(1, 3) ROWS(1, 4) ROWS(1, 5) ROWS(1, 6) }
#endif
#undef ROWS
}
#endif

#define MR_INT8 2            /* rows up to which an int8 panel is multiplied in registers (tile_int8) */

/* mr (<= MR_INT8) rows of x by kc k of an int8 panel, read as it is: each 16 numbers widened to float32 in
 * registers and multiplied there (at a row or two, widening to bfloat16 in L1 and VDPBF16PS over it would
 * convert and store as much, then read it back). bfloat16: the panel's pairs of k rows interleaved, so each
 * lane sums one column's even or odd k, x's pair broadcast, and the two are added at the end. `next`, if
 * any, is prefetched. */
static inline __attribute__((always_inline)) void tile_int8(int dtype, const int8_t *panel, const int8_t *next,
                                                           const void *x, int64_t ldx, int kc, int mr, float *partial,
                                                           const Chunk *c, void *y, int ldy) {
    __m512 acc[MR_INT8][4], sums[MR][NV];
    for (int r = 0; r < MR_INT8; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();
    if (dtype == BF16) {
        float rows[MR_INT8][2 * KC + 2] __attribute__((aligned(64)));
        for (int r = 0; r < mr; r++) {      /* x's chunk as floats, an odd k's pair completed by a zero */
            load_row(rows[r], (const uint16_t *)x + r * ldx, BF16, kc);
            rows[r][kc] = 0.0f;
        }
        for (int kk = 0; kk < kc; kk += 2) {
            const int8_t *b = panel + (int64_t)kk * NR;
            if (next) _mm_prefetch((const char *)(next + (int64_t)kk * NR), _MM_HINT_T1);
            __m512 w[4];
            for (int v = 0; v < 4; v++)
                w[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 16 * v))));
            for (int r = 0; r < mr; r++) {
                double pair;
                memcpy(&pair, rows[r] + kk, 8);
                const __m512 a = _mm512_castpd_ps(_mm512_set1_pd(pair));
                for (int v = 0; v < 4; v++) acc[r][v] = _mm512_fmadd_ps(a, w[v], acc[r][v]);
            }
        }
        /* acc[r][v]: the sums of numbers 16v..16v+15 of each pair as stored; first those in pair order (32
         * a half: int8_order), then each column's even and odd k added */
        const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < NV; j++) {
#if INT8_BY_BYTES
                const __m512i half = _mm512_add_epi32(_mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3,
                                                                       2, 1, 0), _mm512_set1_epi32(8 * j));
                const __m512 a = _mm512_permutex2var_ps(acc[r][0], half, acc[r][1]);
                const __m512 b = _mm512_permutex2var_ps(acc[r][2], half, acc[r][3]);
#else
                const __m512 a = acc[r][2 * j], b = acc[r][2 * j + 1];
#endif
                sums[r][j] = _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
            }
    } else {
        for (int kk = 0; kk < kc; kk++) {
            const int8_t *b = panel + (int64_t)kk * NR;
            if (next && kk % 2 == 0) _mm_prefetch((const char *)(next + (int64_t)kk * NR), _MM_HINT_T1);
            const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b)));
            const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 16))));
            for (int r = 0; r < mr; r++) {
                const __m512 a = _mm512_set1_ps(((const float *)x)[r * ldx + kk]);
                acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
            }
        }
        for (int r = 0; r < mr; r++) sums[r][0] = acc[r][0], sums[r][1] = acc[r][1];
    }
    finish(sums, partial, mr, c, dtype, y, ldy);
}

/* One tile, its row count a constant in each case, so that the sums stay in registers. */
static void tile(int dtype, int kind, const void *panel, const void *next, const void *x, int64_t ldx, int kc,
                 int mr, float *partial, const Chunk *c, void *y, int ldy) {
    (void)dtype, (void)kind;    /* a build without BF16 multiplies float32 only; the panel is in dtype */
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

#if AMX
static __thread Scratch rows_copy, panel_copy;     /* AMX: the rows, and an int8 panel widened */

/* AMX's tile configuration (palette 1): tiles 0-3 the sums (16 rows of 16 floats), 4-5 the rows (16 rows of
 * KT numbers), 6-7 the panel (16 pairs of k rows of 16 columns). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes[16];
    uint8_t rows[16];
} TileConfig;

/* Rows x[0 .. rows) (ldx apart, k numbers each) as AMX's tiles read them: groups of 16 rows (the last one
 * filled with zero rows), each k-step of a group a block of 16 x KT numbers of its own (tile loads of whole
 * cache lines, one after another: the rows themselves, some power of two apart, would share a few cache
 * sets), k padded with zeros to whole steps. */
static void copy_rows(const uint16_t *x, int64_t ldx, int rows, int k, uint16_t *to) {
    const int steps = (k + KT - 1) / KT, groups = (rows + 15) / 16;
    for (int g = 0; g < groups; g++)
        for (int s = 0; s < steps; s++) {
            uint16_t *block = to + ((int64_t)g * steps + s) * 16 * KT;
            const int width = k - s * KT < KT ? k - s * KT : KT;
            for (int r = 0; r < 16; r++) {
                const int row = g * 16 + r, have = row < rows ? width : 0;
                if (have) memcpy(block + r * KT, x + (int64_t)row * ldx + s * KT, 2 * (size_t)have);
                if (have < KT) memset(block + r * KT + have, 0, 2 * (size_t)(KT - have));
            }
        }
}

/* The sums of one group of 16 rows (two: and the next group) of the rows' copy `a` (copy_rows, `steps` k-steps
 * a group) by a panel of `steps` k-steps, `b`, into sums (NR a row). A quantized panel (`q` of `kind`, INT8
 * where INT8_BY_BYTES or INT4 with its `groups`; b unused) is widened a k-step at a time, in L1, as its tiles
 * are loaded. */
static inline __attribute__((always_inline)) void amx_tile(const uint16_t *b, const void *q, int kind,
                                                          const uint16_t *groups, const uint16_t *a, int steps,
                                                          float *sums, int two) {
    const uint16_t *a2 = a + (int64_t)steps * 16 * KT;
    uint16_t step[KT * NR] __attribute__((aligned(64)));
#if INT8_BY_BYTES
    const Int8Tables t = int8_tables();
#endif
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int s = 0; s < steps; s++) {
        const uint16_t *bs = b + (int64_t)s * KT * NR;
        if (q && kind == INT4) {
            widen_int4(q, groups, s * KT, KT, BF16, step);
            bs = step;
        }
#if INT8_BY_BYTES
        if (q && kind == INT8) {
            for (int i = 0; i < KT * NR; i += 64) widen64(&t, (const int8_t *)q + (int64_t)s * KT * NR + i, step + i);
            bs = step;
        }
#endif
        _tile_loadd(6, bs, 4 * NR);
        _tile_loadd(7, bs + 32, 4 * NR);
        _tile_loadd(4, a + (int64_t)s * 16 * KT, 2 * KT);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, a2 + (int64_t)s * 16 * KT, 2 * KT);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, sums, NR * 4);
    _tile_stored(1, sums + 16, NR * 4);
    if (two) {
        _tile_stored(2, sums + 16 * NR, NR * 4);
        _tile_stored(3, sums + 16 * NR + 16, NR * 4);
    }
}

#define MC_AMX_MAX 256
#define ROWS_COPY_BYTES (1 << 20)      /* AMX: the rows a pass over the panels shares, copied: they stay in L2 */

/* gemm_team by AMX's tiles (bfloat16): each thread copies a block of rows (copy_rows), then multiplies it by its
 * panels (an int8 one widened first), 32 rows (or 16) a tile, over the whole k. 0, or -1 on every thread of the team
 * where any thread's copies found no memory (nothing done). */
static int amx_team(const void *packed, const void *scales, int kind, const uint16_t *bias, const uint16_t *x,
                    int64_t ldx, int m, int k, int n, uint16_t *y, int gated) {
    const int panels = num_panels(gated ? 2 * n : n, gated), depth = panel_depth(BF16, k), steps = depth / KT;
    const int per_unit = gated ? 2 : 1, fit = ROWS_COPY_BYTES / (2 * depth) / 32 * 32;
    const int mc = fit < 32 ? 32 : fit > MC_AMX_MAX ? MC_AMX_MAX : fit, quantized = kind == INT8 || kind == INT4;
    const int64_t panel_bytes = kind == INT4 ? (int64_t)depth * NR / 2 : (int64_t)depth * NR * elem_size(kind);
    float sums[(MC_AMX_MAX + 16) * NR] __attribute__((aligned(64))), gate[(MC_AMX_MAX + 16) * NR];
    uint16_t *a = scratch(&rows_copy, 2 * ((size_t)((m < mc ? m : mc) + 15) / 16 * 16 * depth));
    uint16_t *widened = quantized ? scratch(&panel_copy, 2 * (size_t)depth * NR) : NULL;
    if (!team_all(a && (!quantized || widened))) return -1;
    TileConfig cfg = {.palette = 1};
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.bytes[t] = 64;
    _tile_loadconfig(&cfg);
    for (int m0 = 0; m0 < m; m0 += mc) {
        const int mb = m - m0 < mc ? m - m0 : mc, groups = (mb + 15) / 16;
        copy_rows(x + (int64_t)m0 * ldx, ldx, mb, k, a);
        #pragma omp for schedule(static) nowait
        for (int u = 0; u < panels / per_unit; u++)
            for (int p = u * per_unit; p < (u + 1) * per_unit; p++) {
                const void *panel = (const char *)packed + p * panel_bytes;
                const uint16_t *groups4 = kind == INT4 ? (const uint16_t *)scales + (int64_t)p * steps * 2 * NR : NULL;
                /* a quantized panel that few passes of tiles read: widened as they go; else first, for all */
                const void *q = groups <= 4 && (kind == INT4 || (kind == INT8 && INT8_BY_BYTES)) ? panel : NULL;
                if (quantized && !q) {
                    if (kind == INT4) widen_int4(panel, groups4, 0, depth, BF16, widened);
                    else widen_int8(panel, NULL, (int64_t)depth * NR, BF16, widened);
                    panel = widened;
                }
                for (int g = 0; g < groups; g += 2)
                    amx_tile(panel, q, kind, groups4, a + (int64_t)g * steps * 16 * KT, steps, sums + g * 16 * NR,
                             g + 1 < groups);
                const int out = gated ? (p % 2 ? SWIGLU : GATE) : PLAIN;
                const int64_t at = (gated && p % 2 ? n : 0) + (int64_t)u * NR;
                const Chunk c = {1, 1, n - u * NR < NR ? n - u * NR : NR, bias ? bias + at : NULL,
                                 kind == INT8 ? (const float *)scales + at : NULL, out, gate};
                for (int r = 0; r < mb; r++)
                    for (int j = 0; j < NV; j++)
                        emit(_mm512_loadu_ps(sums + r * NR + 16 * j), r, j, &c, BF16, y + (int64_t)m0 * n + u * NR, n);
            }
    }
    _tile_release();
    return 0;
}
#endif
#endif    /* AVX512_BW_VL's tiles */

#if !AVX512_BW_VL
/* AVX2 and FMA (x86-64-v3): each k-chunk of a panel a thread multiplies is first widened to float32 in L1
 * (widen_chunk: bfloat16 by a shift, int8 exactly, int4 to q * scale + min), then every tile of rows of the
 * pass reads it (tile_rows): a quantized or bfloat16 panel is widened once per pass over the panels, not once a
 * tile of rows. At a few rows (IN_PLACE_ROWS: decode), bfloat16 and int8 chunks are read in place instead and
 * widened in registers: a chunk stored to L1 and loaded back costs more than its few rows' products, and its
 * stores, behind loads that wait on memory, stall the stream of the panel. ARM64 builds (NEON) run the same tiles
 * in NEON's vectors (see there); emit_row and tile are the two's. */

#define WIDEN_AHEAD 2048    /* bytes of a panel asked for ahead of its widening (see widen_chunk) */
/* Up to this many rows a pass, tiles read bfloat16 and int8 chunks in place, widened in registers as multiplied;
 * beyond, widen_chunk's one widening per chunk costs less than each tile's */
#define IN_PLACE_ROWS 6

/* Row r of a tile's whole sums (NR floats) into y with the column's scale and the bias: or (a gated weight's)
 * its gate sums, or silu(gate) * up, rounded as the AVX-512 tiles' emit rounds. */
static void emit_row(const float *sums, int r, const Chunk *c, int dtype, void *y, int ldy) {
    for (int j = 0; j < c->cols; j++) {
        float v = sums[j];
        if (c->scale) v *= c->scale[j];
        if (c->bias) v += param(c->bias, dtype, j);
        if (c->out != PLAIN) {      /* as swiglu() rounds, the gate and up sums first */
            float *gate = c->gate + r * NR + j;
            v = as_dtype(v, dtype);
            if (c->out == GATE) {
                *gate = v;
                continue;
            }
            v = as_dtype(as_dtype(silu(*gate), dtype) * v, dtype);
        }
        store(y, dtype, (int64_t)r * ldy + j, v);
    }
}

/* a[r]: row r of x (dtype F32 or BF16, ldx apart, mr rows) as kc floats: x's own, or bfloat16 widened into
 * rows[r]. */
static inline void float_rows(const void *x, int64_t ldx, int dtype, int kc, int mr, float rows[MR][KC],
                              const float *a[MR]) {
    for (int r = 0; r < mr; r++) {
        if (dtype == BF16) load_row(rows[r], (const uint16_t *)x + r * ldx, BF16, kc);
        a[r] = dtype == BF16 ? rows[r] : (const float *)x + r * ldx;
    }
}

#if AVX2_FMA
/* Numbers i .. i + 7 of a panel as floats, of each kind. */
static inline __m256 widen8_bf16(const uint16_t *from) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)from)), 16));
}

static inline __m256 widen8_int8(const int8_t *from) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)from)));
}

/* k rows k0 .. k0 + kc of a panel of `kind` (BF16, INT8 or INT4 with its `groups`: gemm_pack_groups' for the
 * panel, from its first group) as float32, k row by k row (NR each), into `to`: bfloat16 and int8 numbers exactly
 * (an int8 column's scale is applied to its sums), int4 ones as q * scale + min in float32 (q * scale is exact, 4
 * bits by 11: the one rounding is the sum's). The panel is asked for WIDEN_AHEAD bytes ahead (a thread's panels lie
 * one after another): without it, the stores wait behind loads that wait on memory, one at a time. */
static void widen_chunk(const void *panel, const uint16_t *groups, int kind, int k0, int kc, float *to) {
    if (kind == BF16) {
        const uint16_t *from = (const uint16_t *)panel + (int64_t)k0 * NR;
        for (int i = 0; i < kc * NR; i += 8) {
            if (i % 32 == 0) _mm_prefetch((const char *)(from + i) + WIDEN_AHEAD, _MM_HINT_T0);
            _mm256_store_ps(to + i, widen8_bf16(from + i));
        }
    } else if (kind == INT8) {
        const int8_t *from = (const int8_t *)panel + (int64_t)k0 * NR;
        for (int i = 0; i < kc * NR; i += 8) {
            if (i % 64 == 0) _mm_prefetch((const char *)(from + i) + WIDEN_AHEAD, _MM_HINT_T0);
            _mm256_store_ps(to + i, widen8_int8(from + i));
        }
    } else {
        const __m256i nibble = _mm256_set1_epi32(15);
        __m256 s[NV8], m[NV8];
        for (int kk = k0; kk < k0 + kc; kk++) {
            if (kk == k0 || kk % G4 == 0) {
                const uint16_t *group = groups + (int64_t)(kk / G4) * 2 * NR;
                for (int j = 0; j < NV8; j++) {
                    s[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(group + 8 * j)));
                    m[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(group + NR + 8 * j)));
                }
            }
            /* byte j of the k row: column j in its low half, column j + 16 in its high half */
            const uint8_t *row = (const uint8_t *)panel + (int64_t)kk * NR / 2;
            if (kk % 4 == 0) _mm_prefetch((const char *)row + WIDEN_AHEAD, _MM_HINT_T0);
            const __m256i bytes[2] = {_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)row)),
                                      _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + 8)))};
            float *out = to + (int64_t)(kk - k0) * NR;
            for (int j = 0; j < NV8; j++) {
                const __m256i q = j < 2 ? _mm256_and_si256(bytes[j], nibble) : _mm256_srli_epi32(bytes[j - 2], 4);
                _mm256_store_ps(out + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s[j], m[j]));
            }
        }
    }
}

/* Numbers i .. i + 7 of a chunk of `kind` (F32, BF16 or INT8) as floats. */
static inline __attribute__((always_inline)) __m256 load8(const void *w, int kind, int64_t i) {
    if (kind == BF16) return widen8_bf16((const uint16_t *)w + i);
    if (kind == INT8) return widen8_int8((const int8_t *)w + i);
    return _mm256_loadu_ps((const float *)w + i);
}

/* mr rows of x (dtype F32 or BF16, ldx apart) by kc k rows of a chunk of `kind` (NR numbers each; BF16 and INT8
 * widened as they are loaded): the chunk's sums join the earlier chunks' in `partial` (sums of chunks: the
 * rounding error grows with KC, not k), or (last chunk) go to y (emit_row). Each k row's MR broadcasts of x stay in
 * registers while the chunk's four vectors go by. */
static inline __attribute__((always_inline)) void tile_rows(const void *w, int kind, const void *x, int64_t ldx,
                                                           int dtype, int kc, int mr, float *partial, const Chunk *c,
                                                           void *y, int ldy) {
    float rows[MR][KC] __attribute__((aligned(32)));      /* bfloat16 rows widened */
    const float *a[MR];
    float_rows(x, ldx, dtype, kc, mr, rows, a);
    __m256 acc[MR][NV8];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NV8; j++) acc[r][j] = _mm256_setzero_ps();
    for (int kk = 0; kk < kc; kk++) {
        __m256 xs[MR];
        for (int r = 0; r < mr; r++) xs[r] = _mm256_broadcast_ss(a[r] + kk);
        for (int j = 0; j < NV8; j++) {
            const __m256 b = load8(w, kind, (int64_t)kk * NR + 8 * j);
            for (int r = 0; r < mr; r++) acc[r][j] = _mm256_fmadd_ps(xs[r], b, acc[r][j]);
        }
    }
    for (int r = 0; r < mr; r++) {
        float *sums = partial + r * NR;
        for (int j = 0; j < NV8; j++)
            _mm256_storeu_ps(sums + 8 * j, c->first ? acc[r][j] : _mm256_add_ps(_mm256_loadu_ps(sums + 8 * j), acc[r][j]));
        if (c->last) emit_row(sums, r, c, dtype, y, ldy);
    }
}

#else
/* NEON (ARM64): AVX2's tiles in 128-bit vectors of four floats, with twice the registers (MR's 24 sums); bfloat16
 * widened by a shift (its bits are a float32's top half), int8 by vmovl to 16 bits and then 32 (exact), int4 by a
 * mask and a shift of each byte. The products are float32's, as AVX2's: ARMv8.6's BFDOT and BFMMLA read pairs of k
 * rows interleaved (PAIRED), which these panels do not hold. */

/* Numbers i .. i + 7 of a chunk of `kind` (F32, BF16 or INT8) as two vectors of floats. */
static inline __attribute__((always_inline)) void load8(const void *w, int kind, int64_t i, float32x4_t out[2]) {
    if (kind == BF16) {
        const uint16x8_t h = vld1q_u16((const uint16_t *)w + i);
        out[0] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16));
        out[1] = vreinterpretq_f32_u32(vshll_high_n_u16(h, 16));
    } else if (kind == INT8) {
        const int16x8_t q = vmovl_s8(vld1_s8((const int8_t *)w + i));
        out[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(q)));
        out[1] = vcvtq_f32_s32(vmovl_high_s16(q));
    } else {
        out[0] = vld1q_f32((const float *)w + i);
        out[1] = vld1q_f32((const float *)w + i + 4);
    }
}

/* k rows k0 .. k0 + kc of a panel as float32 into `to`: as AVX2's widen_chunk (see there). */
static void widen_chunk(const void *panel, const uint16_t *groups, int kind, int k0, int kc, float *to) {
    if (kind != INT4) {
        const int64_t first = (int64_t)k0 * NR, size = (int64_t)elem_size(kind);
        for (int i = 0; i < kc * NR; i += 8) {
            if (i * size % 64 == 0) __builtin_prefetch((const char *)panel + (first + i) * size + WIDEN_AHEAD);
            float32x4_t v[2];
            load8(panel, kind, first + i, v);
            vst1q_f32(to + i, v[0]);
            vst1q_f32(to + i + 4, v[1]);
        }
        return;
    }
    float32x4_t s[NV4], m[NV4];
    for (int kk = k0; kk < k0 + kc; kk++) {
        if (kk == k0 || kk % G4 == 0) {
            const uint16_t *group = groups + (int64_t)(kk / G4) * 2 * NR;
            for (int j = 0; j < NV4; j++) {
                s[j] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(group + 4 * j)));
                m[j] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(group + NR + 4 * j)));
            }
        }
        /* byte j of the k row: column j in its low half, column j + 16 in its high half */
        const uint8_t *row = (const uint8_t *)panel + (int64_t)kk * NR / 2;
        if (kk % 4 == 0) __builtin_prefetch(row + WIDEN_AHEAD);
        const uint8x16_t bytes = vld1q_u8(row), q[2] = {vandq_u8(bytes, vdupq_n_u8(15)), vshrq_n_u8(bytes, 4)};
        float *out = to + (int64_t)(kk - k0) * NR;
        for (int half = 0; half < 2; half++) {
            const uint16x8_t wide[2] = {vmovl_u8(vget_low_u8(q[half])), vmovl_high_u8(q[half])};
            for (int v = 0; v < 4; v++) {
                const int j = 4 * half + v;       /* columns 4j .. 4j + 3 */
                const uint32x4_t u = v % 2 ? vmovl_high_u16(wide[v / 2]) : vmovl_u16(vget_low_u16(wide[v / 2]));
                vst1q_f32(out + 4 * j, vfmaq_f32(m[j], vcvtq_f32_u32(u), s[j]));
            }
        }
    }
}

/* mr rows of x by kc k rows of a chunk of `kind`: as AVX2's tile_rows (see there), each k row's MR broadcasts of x
 * in registers while the chunk's eight vectors go by, two at a time. */
static inline __attribute__((always_inline)) void tile_rows(const void *w, int kind, const void *x, int64_t ldx,
                                                           int dtype, int kc, int mr, float *partial, const Chunk *c,
                                                           void *y, int ldy) {
    float rows[MR][KC] __attribute__((aligned(16)));      /* bfloat16 rows widened */
    const float *a[MR];
    float_rows(x, ldx, dtype, kc, mr, rows, a);
    float32x4_t acc[MR][NV4];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NV4; j++) acc[r][j] = vdupq_n_f32(0.0f);
    for (int kk = 0; kk < kc; kk++) {
        float32x4_t xs[MR];
        for (int r = 0; r < mr; r++) xs[r] = vdupq_n_f32(a[r][kk]);
        for (int j = 0; j < NV4; j += 2) {
            float32x4_t b[2];
            load8(w, kind, (int64_t)kk * NR + 4 * j, b);
            for (int r = 0; r < mr; r++) {
                acc[r][j] = vfmaq_f32(acc[r][j], xs[r], b[0]);
                acc[r][j + 1] = vfmaq_f32(acc[r][j + 1], xs[r], b[1]);
            }
        }
    }
    for (int r = 0; r < mr; r++) {
        float *sums = partial + r * NR;
        for (int j = 0; j < NV4; j++)
            vst1q_f32(sums + 4 * j, c->first ? acc[r][j] : vaddq_f32(vld1q_f32(sums + 4 * j), acc[r][j]));
        if (c->last) emit_row(sums, r, c, dtype, y, ldy);
    }
}
#endif

/* One tile, its row count and the kind of the chunk's numbers (F32, or BF16 and INT8 read in place) constants in
 * each case, so that the sums stay in registers (`next` unused: the hardware's prefetcher streams the panels). */
static void tile(int dtype, int kind, const void *panel, const void *next, const void *x, int64_t ldx, int kc,
                 int mr, float *partial, const Chunk *c, void *y, int ldy) {
    (void)next;
#define ROWS(R) case R: \
        if (kind == BF16) tile_rows(panel, BF16, x, ldx, dtype, kc, R, partial, c, y, ldy); \
        else if (kind == INT8) tile_rows(panel, INT8, x, ldx, dtype, kc, R, partial, c, y, ldy); \
        else tile_rows(panel, F32, x, ldx, dtype, kc, R, partial, c, y, ldy); \
        break;
    switch (mr) { ROWS(1) ROWS(2) ROWS(3) }
#undef ROWS
}
#endif

/* gemm's share of one thread of a team: call from every thread of a parallel region; y is whole once
 * they have all returned and met at a barrier (this ends without one). y has n columns; a gated
 * weight holds 2n (packed with gated set) and y = silu(gate) * up. The weight's numbers are of `kind`:
 * dtype's, INT8 with `scales` (float32, a column each) or INT4 with its groups' (gemm_pack_groups). kernel: GEMM_AVX512, or GEMM_AMX (bfloat16 only; where gemm_kernels
 * reports it, else AVX512 runs), or for quantized weights GEMM_VNNI or GEMM_WIDEN (where gemm_kernels reports them;
 * else, and for other weights, AVX512's). */
void gemm_team(const void *packed, const void *scales, int kind, const void *bias, int dtype, const void *x,
               int64_t ldx, int m, int k, int n, void *y, int gated, int kernel) {
#if AMX
    /* (where any thread's copies find no memory, AVX-512's kernel, which needs none, on every thread) */
    if (kernel == GEMM_AMX && dtype == BF16 && amx_granted &&
        amx_team(packed, scales, kind, bias, x, ldx, m, k, n, y, gated) == 0)
        return;
#else
    (void)kernel;
#endif
    const int panels = num_panels(gated ? 2 * n : n, gated), depth = panel_depth(dtype, k);
    const int kc_max = dtype == BF16 && PAIRED ? 2 * KC : KC, per_unit = gated ? 2 : 1;
    const size_t size = elem_size(dtype), wsize = elem_size(kind);
    /* bytes of a panel's k row (int4: a pair's, halved), and an int4 weight's groups a panel */
    const int64_t row_bytes = kind == INT4 ? NR / 2 : (int64_t)NR * wsize, groups4 = int4_groups(dtype, k);
    float partial[MC * NR] __attribute__((aligned(64))), gate[MC * NR] __attribute__((aligned(64)));
    float widened[KC * NR] __attribute__((aligned(64)));     /* a chunk widened: in L1 */
    /* an int4 weight's bfloat16 products: a block of rows in fixed point, np = PIECES bytes a number (split_rows),
     * or (the VNNI kernel, int8 or int4 weights) rounded to int8, np = 1 (quantize_rows); with their groups' units
     * and sums. Where any thread's find no memory, the chunks are widened as float32's are, on every thread: the
     * team's products, rounded alike, whichever thread computes them. */
#if INT4_BY_VNNI
    int8_t *pieces = NULL;
    float *units = NULL, *xsums = NULL;
    const size_t mc = m < MC ? m : MC;
    int np = kind == INT4 && dtype == BF16 && kernel != GEMM_WIDEN ? PIECES : 0;
#if INT8_ROWS
    const __m512i order = vnni_order();
    if (kernel == GEMM_VNNI && dtype == BF16 && (kind == INT8 || kind == INT4)) np = 1;
#endif
    if (np) {
        pieces = scratch(&fixed_rows, mc * (np * depth + 2 * sizeof(float) * groups4));
        if (!team_all(pieces != NULL)) pieces = NULL;
    }
    if (pieces) {
        units = (float *)(pieces + mc * np * depth);
        xsums = units + mc * groups4;
    }
#endif
    for (int m0 = 0; m0 < m; m0 += MC) {
        const int mb = m - m0 < MC ? m - m0 : MC, groups = (mb + MR - 1) / MR;
        const char *xr = (const char *)x + m0 * ldx * size;      /* the pass's rows, ld numbers apart */
        int64_t ld = ldx;
#if INT4_BY_VNNI
        if (pieces && np == PIECES) split_rows((const uint16_t *)xr, ld, mb, k, depth, pieces, units, xsums);
#if INT8_ROWS
        if (pieces && np == 1) quantize_rows((const uint16_t *)xr, ld, mb, k, depth, pieces, units, xsums);
#endif
#endif
#if AVX512_BW_VL
        int spread_out = mb > MR_INT8;      /* (at most MR_INT8 rows: int8's in-register tiles, or too few to clash) */
#if INT4_BY_VNNI
        spread_out = spread_out && !pieces; /* (the tiles read the rows' fixed point or int8 instead) */
#endif
        if (spread_out) spread_rows(&xr, &ld, mb, k, size);
#endif
        /* units of work: a panel, or a gated weight's pair, whose NR columns of y it writes */
        #pragma omp for schedule(static) nowait
        for (int u = 0; u < panels / per_unit; u++)
            for (int p = u * per_unit; p < (u + 1) * per_unit; p++) {
                const char *panel = (const char *)packed + (int64_t)p * depth * row_bytes;
                const int out = gated ? (p % 2 ? SWIGLU : GATE) : PLAIN;
                const int64_t at = (gated && p % 2 ? n : 0) + (int64_t)u * NR;
                for (int k0 = 0; k0 < k; k0 += kc_max) {
                    const int kc = k - k0 < kc_max ? k - k0 : kc_max;
                    const Chunk c = {k0 == 0, k0 + kc >= k, n - u * NR < NR ? n - u * NR : NR,
                                     bias ? (const char *)bias + at * size : NULL,
                                     kind == INT8 ? (const float *)scales + at : NULL, out, gate};
                    /* the thread's next chunk: this panel's next k-chunk, else the next panel's first */
                    const char *next = c.last ? (p + 1 < panels ? panel + (int64_t)depth * row_bytes : NULL)
                                              : panel + (int64_t)(k0 + kc) * row_bytes;
                    const void *chunk = panel + (int64_t)k0 * row_bytes;
#if INT4_BY_VNNI
                    if (pieces) {
                        const int most = np == PIECES ? MRQ : ROWS4;
                        for (int g = 0, r0 = 0, tiles = (mb + most - 1) / most; g < tiles; g++) {
                            const int mr = mb / tiles + (g < mb % tiles);
                            Chunk rows = c;
                            rows.gate = gate + r0 * NR;
                            const int8_t *q = pieces + (int64_t)r0 * np * depth + k0;
                            const float *unit = units + r0 * groups4 + k0 / G4, *sum = xsums + r0 * groups4 + k0 / G4;
                            uint16_t *to = (uint16_t *)y + ((int64_t)(m0 + r0) * n + u * NR);
#if INT8_ROWS
                            if (kind == INT8) {
                                /* the first tile brings the thread's next chunk into L2 as it goes: the others
                                 * read this one from cache, and memory would wait for them */
                                tile8(chunk, g == 0 && tiles > 1 ? (const int8_t *)next : NULL, order, q, depth, unit,
                                      sum, (int)groups4, kc, mr, partial + r0 * NR, &rows, to, n);
                                r0 += mr;
                                continue;
                            }
#endif
                            tile4((const uint8_t *)chunk, (const uint16_t *)scales + (p * groups4 + k0 / G4) * 2 * NR,
                                  q, np, depth, unit, sum, (int)groups4, kc, mr, partial + r0 * NR, &rows, to, n);
                            r0 += mr;
                        }
                        continue;
                    }
#endif
                    int held = kind;    /* the kind of the chunk's numbers (AVX2's tiles: as it is read, or F32) */
#if AVX512_BW_VL
                    if (kind == INT4) {
                        widen_int4((const uint8_t *)panel, (const uint16_t *)scales + p * groups4 * 2 * NR, k0,
                                   dtype == BF16 ? (kc + 3) / 4 * 4 : kc, dtype, widened);
                        chunk = widened, next = NULL;
                    }
                    if (kind == INT8 && mb <= MR_INT8 && kernel != GEMM_WIDEN) {
                        Chunk rows = c;
                        if (mb == 1) tile_int8(dtype, chunk, (const int8_t *)next, xr + k0 * size, ld, kc, 1,
                                               partial, &rows, (char *)y + ((int64_t)m0 * n + u * NR) * size, n);
                        else tile_int8(dtype, chunk, (const int8_t *)next, xr + k0 * size, ld, kc, 2,
                                       partial, &rows, (char *)y + ((int64_t)m0 * n + u * NR) * size, n);
                        continue;
                    }
                    if (kind == INT8) {     /* (the pairs of k rows of bfloat16: the last one padded) */
                        widen_int8(chunk, (const int8_t *)next, (int64_t)(dtype == BF16 ? (kc + 1) / 2 * 2 : kc) * NR,
                                   dtype, widened);
                        chunk = widened, next = NULL;
                    }
#else
                    if (kind == INT4 || (kind != F32 && mb > IN_PLACE_ROWS)) {
                        widen_chunk(panel, kind == INT4 ? (const uint16_t *)scales + p * groups4 * 2 * NR : NULL, kind,
                                    k0, kc, widened);
                        chunk = widened, next = NULL, held = F32;
                    }
#endif
                    for (int g = 0, r0 = 0; g < groups; g++) {
                        const int mr = mb / groups + (g < mb % groups);
                        Chunk rows = c;
                        rows.gate = gate + r0 * NR;
                        tile(dtype, held, chunk, g == 0 ? next : NULL, xr + (r0 * ld + k0) * size, ld, kc, mr,
                             partial + r0 * NR, &rows, (char *)y + ((int64_t)(m0 + r0) * n + u * NR) * size, n);
                        r0 += mr;
                    }
                }
            }
    }
}

/* y [m, n] (row stride n) = x [m, k] (row stride ldx) . W^T + bias, W packed by gemm_pack (gated: W
 * [2n, k] and y = silu(gate) * up, gate and up each with their half of the bias). */
void gemm(const void *packed, const void *scales, int kind, const void *bias, int dtype, const void *x, int64_t ldx,
          int m, int k, int n, void *y, int gated, int kernel, int threads) {
    #pragma omp parallel num_threads(threads)
    gemm_team(packed, scales, kind, bias, dtype, x, ldx, m, k, n, y, gated, kernel);
}
#else
int gemm_dtypes(void) { return 0; }
int gemm_kernels(void) { return 0; }
#endif
