/* MLoT Spark native CPU kernels: what the library's files share and what it exports.
 *
 * The structs below are the ABI: engine/backends/native/__init__.py mirrors each with ctypes, and bind() compares
 * its sizes with spark_sizeof_* before any call, so a field added on one side only is a load error, not a misread.
 * Plain C11 (gnu11) with _Float16; no Python or PyTorch headers.
 */
#ifndef SPARK_KERNELS_H
#define SPARK_KERNELS_H

#include <stdint.h>

#define SPARK_MAX_HEAD_DIM 512 /* largest head dim spark_decode supports (the Python side checks before using it) */
#define SPARK_MAX_THREADS 64
#define SPARK_MAX_STEP_ROWS 16 /* tokens of a step of several (spark_decode_rows) */
#define QK 32                  /* weights per block (and per activation block) */
#define QK_K 256               /* weights per super-block (the K-quants, IQ4_XS, TQ*_0) */

/* ggml type ids (gguf.GGMLQuantizationType) of the block formats the kernels run. */
enum { SPARK_Q4_0 = 2, SPARK_Q4_1 = 3, SPARK_Q8_0 = 8 }; /* spark_kernels.c's own */

enum { /* spark_kquants.h's */
    SPARK_Q5_0 = 6,
    SPARK_Q5_1 = 7,
    SPARK_Q2_K = 10,
    SPARK_Q3_K = 11,
    SPARK_Q4_K = 12,
    SPARK_Q5_K = 13,
    SPARK_Q6_K = 14,
    SPARK_IQ4_NL = 20,
    SPARK_IQ4_XS = 23,
    SPARK_TQ1_0 = 34,
    SPARK_TQ2_0 = 35,
};

/* One block-quantized matrix (N, K): N rows of K/32 GGUF blocks, row-major (the file's bytes, read in place). */
typedef struct spark_qmat {
    const uint8_t *blocks; /* (N, K/32) blocks of block_bytes(type) */
    const float *bias;     /* (N,) or NULL */
    int32_t n, k;
    int32_t type;      /* a ggml type id: SPARK_Q8_0, SPARK_Q4_0, SPARK_Q4_1, or one of spark_kquants.h's */
    int32_t act_parts; /* 1: activations as one int8 block (llama.cpp's Q8); 2: plus an int8 block of the residual */
    /* A fused matrix whose parts are stored in different formats (a Q4_K_M file's q, k as Q4_K beside v as Q6_K):
     * its further rows, whose outputs follow this part's, in `next` (same k and act_parts); NULL: no more. The
     * decoding step (qgemv) follows the chain; spark_qgemm computes one part (its caller calls each). */
    const struct spark_qmat *next;
} spark_qmat;

/* The decoder's weights, one entry per layer in each array. */
typedef struct {
    int32_t n_layers, hidden, n_heads, n_kv_heads, head_dim, intermediate;
    float eps;
    const float *const *attn_norm;  /* (L) of (C,) */
    const float *const *mlp_norm;   /* (L) of (C,) */
    const spark_qmat *qkv;          /* (L): (H*D + 2*Hkv*D, C) */
    const spark_qmat *o;            /* (L): (C, H*D) */
    const spark_qmat *gate_up;      /* (L): (2*I, C) */
    const spark_qmat *down;         /* (L): (C, I) */
    const float *final_norm;        /* (C,) */
    const spark_qmat *lm_head;      /* (V, C) */
} spark_model;

/* The slot table (engine.model.slots.KVCache) of one sequence row: k, v (L, 1, Hkv, C, D) in fp16 or fp32, keys
 * unrotated (spark_attention.c rotates them as it reads them). */
typedef struct {
    void *k, *v;
    int64_t capacity; /* C, the slots allocated so far */
    int32_t half;     /* 1: k, v are fp16; 0: fp32 */
} spark_cache;

/* One decoding step's addressing (engine.model.slots.DirectReads: T = 1, one row). */
typedef struct {
    const float *cos_new, *sin_new;     /* (D): rotation of the new query scoring ranks >= split */
    const float *cos_plain, *sin_plain; /* (D): rotation of the query scoring ranks < split (split > 0 only) */
    int64_t slot;                       /* where the new k, v are stored */
    int32_t width, split;               /* attend to ranks [0, width); ranks [0, split) score against q_plain */
    const int64_t *slots, *positions;   /* (width,) each rank's slot and the position its key is rotated at */
    const float *cos_table, *sin_table; /* (P, D) the rotary table the positions index */
    float *qsum;                        /* (L, Hkv, D) or NULL: per layer, the mean pre-RoPE query of each KV-head
                                           group (engine.model.slots: the query summary the cascade routes with) */
} spark_step;

/* One layer's attention for one decoding step. */
typedef struct {
    const void *k, *v;            /* this layer's (Hkv, C, D) of the row: fp16 when half, else fp32; keys unrotated */
    int64_t capacity;             /* C, the table's allocated slots */
    int32_t half;                 /* 1: fp16 table */
    const int64_t *slots;         /* (m,) the attended slots, in slot order */
    const int64_t *positions;     /* (m,) the position each key is rotated at */
    const float *cos, *sin;       /* (P, D) the rotary table (signed sin: engine.model.attention.RotaryTable) */
    int32_t width, split;         /* m; ranks [0, split) are scored by q_plain, the rest by q_new */
    const float *q_new, *q_plain; /* (H, D) rotated queries */
    int32_t n_heads, n_kv_heads, d;
    float scale;
    int32_t chunk;  /* keys per work item */
    float *partial; /* (chunks, H, D + 2): per chunk and head, the running max, the sum, then the output (D) */
    float *out;     /* (H, D) */
    /* Keys already rotated, for the tokens of a step of several (spark_decode_rows rotates each attended key once
     * for all of them): (Hkv, rotated_width, D) fp32, this token's rank i at rank rank_of[i]; NULL: rotate as read. */
    const float *rotated;
    const int32_t *rank_of;
    int64_t rotated_width;
} spark_attn;

/* Entry points (ctypes declares them in bind()). */
const char *spark_isa(void);
int32_t spark_max_head_dim(void);
int32_t spark_max_threads(void);
int32_t spark_set_threads(int32_t n);
int32_t spark_threads(void);
int32_t spark_use_amx(int32_t use);
int32_t spark_block_bytes(int32_t type);
int64_t spark_act_bytes(int32_t k, int32_t m);
void spark_qgemm(const spark_qmat *w, const float *x, int32_t m, float *y, void *scratch);
int32_t spark_dequant_rows(const spark_qmat *w, const int64_t *ids, int32_t n, float *out);
int64_t spark_attend_floats(int32_t n_heads, int32_t head_dim, int32_t width);
void spark_attend(spark_attn *a);
int64_t spark_decode_scratch_floats(const spark_model *m);
void spark_decode(const spark_model *m, const spark_cache *cache, const spark_step *step, float *x, float *logits,
                  float *scratch, float *partial);
int64_t spark_decode_rows_scratch_floats(const spark_model *m, int32_t t);
int32_t spark_decode_rows(const spark_model *m, const spark_cache *cache, const spark_step *steps, int32_t t_count,
                          float *x, float *logits, float *scratch, float *partial);

/* The ABI structs' sizes, which bind() checks against their ctypes mirrors. */
int64_t spark_sizeof_qmat(void);
int64_t spark_sizeof_model(void);
int64_t spark_sizeof_cache(void);
int64_t spark_sizeof_step(void);
int64_t spark_sizeof_attn(void);

#endif
