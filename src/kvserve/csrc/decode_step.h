#ifndef KVSERVE_DECODE_STEP_H
#define KVSERVE_DECODE_STEP_H

/* The structs csrc/decode_step.c takes: their one definition. The Python side's ctypes structures are built from
 * this file (kvserve.kernels.c_structs), and checked by field name, type and offset against the library
 * (struct_layout, kvserve.kernels.check_layout); they are filled by field name (kvserve.kernels.fill), every field
 * or none. So that the Python side reads it, each typedef here is a struct of fields of the types int, int64_t,
 * float, pointers, the structs and function pointer types before it, or a function pointer type. */
#include <stdint.h>

/* A linear layer: its weight packed for csrc/gemm.c, or (packed NULL) the weight [out][in] as torch
 * keeps it, for the matrix-vector products; its bias (or NULL); the packed numbers' kind (the model's
 * dtype, INT8 with a float32 scale per output column, or INT4 with its groups' scales and minimums); and
 * the rows from which csrc/gemm.c multiplies it by AMX's tiles (measured at start-up), not AVX-512's; below them,
 * a quantized weight's rows from which it runs its WIDEN kernel, and below those its VNNI kernel. */
typedef struct {
    const void *w, *b, *packed, *scales;
    int kind, amx_from, widen_from, vnni_from;
} Proj;

/* A decoder layer. Its cache: pages [2][KVH][NB][BS][row] whose rows are of kv_kind (csrc/paged_decode.c's
 * kinds: the model's dtype, or a quantized one with its K and V scales, k_meta and v_meta, else NULL), its keys
 * stored rotated by the Hadamard matrix of kv/quant.py's rotate_keys_ where rotate_keys (its queries turn alike),
 * and its keys' summaries (kv/summaries.py, of summary_kind; NULL where the cache keeps none). */
typedef struct {
    Proj qkv, o, gate_up, down;
    const void *input_norm, *post_norm, *q_norm, *k_norm;    /* q_norm, k_norm: Qwen3's, else NULL */
    void *kv;
    const void *k_meta, *v_meta;
    int kv_kind, rotate_keys;
    void *summary;
    int summary_kind;
    int64_t window;                                           /* its sliding window, or 0: full attention */
    int group;                                                /* its layer group: the block table it reads */
    int local_rope;                                           /* RoPE by the sliding layers' table (Gemma 3) */
    /* Gemma's norms of the attention's output (post_norm) and the MLP's input and output: NULL elsewhere */
    const void *pre_ff_norm, *post_ff_norm;
} Layer;

/* Under tensor parallelism: `count` numbers of dtype at rows summed over the ranks, in place; 0, or nonzero where
 * the collective failed. */
typedef int (*AllReduce)(void *rows, int64_t count, int dtype);

/* A model, or under tensor parallelism one rank's shard of it (kvserve.distributed): its heads, its share of the
 * intermediate size and its vocab rows from vocab_start, all_reduce summing the ranks' partial sums (the
 * embedding's lookups, o's and down's products), and the logits those of its vocab rows; NULL without. */
typedef struct {
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, rotary_dim, intermediate, vocab, dtype;
    int num_blocks, block_size;
    float eps, scale;
    int gelu, gemma_norms;         /* GeGLU, not SwiGLU; (1 + weight) norms in float32 (Gemma) */
    float embed_scale;             /* the embeddings are multiplied by it (Gemma), else 1 */
    float attn_cap, logit_cap;     /* soft caps of the attention scores and the logits (Gemma 2), or 0 */
    const void *embed, *norm;      /* embed NULL: the rows of lm_head's packed weight (tied embeddings) */
    Proj lm_head;
    const Layer *layers;
    int64_t vocab_start;
    AllReduce all_reduce;
} Model;

#endif
