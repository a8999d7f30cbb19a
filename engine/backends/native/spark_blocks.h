/* MLoT Spark native CPU kernels: what the library's own files share (the ABI is spark_kernels.h).
 *
 * The library is one file of common code (spark_kernels.c: the thread pool, activations, the decoding step), the
 * attention (spark_attention.c), and the block products per instruction-set family, as ggml lays out its CPU
 * backend: ref/ (portable C, every format: the reference), x86/ (AVX2, AVX-512 VNNI, AMX) and arm/ (the NEON dot
 * product). Each family file registers its routes per block type in a table (spark_type_traits) once, when the
 * library is loaded: the reference first, then the family this build targets over it where it has a faster route.
 * spark_qgemm and the decoding step look a type's routes up there; no other code branches on an instruction set.
 *
 * Every route of every family computes the same bits (exact integer block sums, the float terms in one fixed order:
 * spark_kernels.c and spark_kquants.h say which); tests/engine/backends/native/kquant_check.c and arm_check.c check it.
 */
#ifndef SPARK_BLOCKS_H
#define SPARK_BLOCKS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "spark_kernels.h"

#if !defined(__FLT16_MAX__)
#error "the native kernels need a compiler with _Float16 (GCC >= 12, Clang >= 15)"
/* Quantize one row x (K, of which the first `valid` values are given: the rest are zeros, a matrix whose input
 * size is no multiple of 32 being padded with zero columns) into block `b0` onwards of a, each block of 32 by the
 * family's quantize_block (inlined: a decoding step quantizes ~100 rows). */
static inline __attribute__((always_inline)) void quantize_row_with(spark_quantize_block_fn quantize_block, const float *x, int32_t k, int32_t valid, spark_act *a, int64_t b0) {
    for (int32_t b = 0; b < k / QK; b++) {
        float padded[QK];
        const float *xb = x + b * QK;
        if ((b + 1) * QK > valid) {
            for (int32_t i = 0; i < QK; i++) padded[i] = b * QK + i < valid ? xb[i] : 0.0f;
            xb = padded;
        }
        const int64_t at = b0 + b;
        a->d[at] = quantize_block(xb, a->parts, a->q8 + at * QK, a->q16 + at * QK, &a->s[at]);
        a->ds[at] = a->d[at] * (float)a->s[at];
    }
}

#endif

/* Shared between the library's files, not exported from it. */
#define SPARK_INTERNAL __attribute__((visibility("hidden")))

/* Activation rows quantized per block of 32 with one fp32 scale per block: as int8 (parts = 1, llama.cpp's Q8:
 * q = rint(x * 127 / amax), d = amax / 127) or as int16 (parts = 2, q = rint(x * 32767 / amax), d = amax / 32767:
 * ~16 bits; "parts" is the ABI's older name, from two int8 parts, which held ~15 bits at twice the products). q8 / q16 (M, K) share memory; d (M, K/32) the
 * scales, s the blocks' sums of q, ds = d * s (Q4_1's min term). */
typedef struct {
    int8_t *q8;
    int16_t *q16;
    float *d, *ds;
    int32_t *s;
    int32_t parts;
    /* The same int16 rows with the tokens in vector lanes (a prefill on AVX-512, tokens_in_lanes below),
     * for ceil(M/L) groups of L = SPARK_LANES tokens, absent tokens zero: tq (G, K/32, 16, L) int16 pairs, lane t
     * of vector (g, b, i) = elements 2i, 2i+1 of token Lg + t's block b; td, tds, ts (G, K/32, L) its d, ds, s. */
    int32_t *tq;
    float *td, *tds;
    int32_t *ts;
    /* With int8 rows (parts = 1, Q4_K and Q6_K): tq (G, K/32, 8, L) int32, lane t of vector
     * (g, b, i) = elements 4i..4i+3 of token Lg + t's block b, and th (G, K/32, L) the sums of each block's first
     * 16 quants (Q6_K's halves take their activation sums), in tq's second half. */
    int32_t *th;
    /* One row only (a decoding step; NULL otherwise): its int16 quants as two bytes each, xh = q >> 8 (signed) and
     * xl = q & 255 (unsigned), and per block xc = 32768 * sum(xh): split_row below, for the byte-product routes
     * (block_lanes_split; x86's kq_split_dot, which reads xh and xl, or an int8 row's quants as xv, in
     * the order of its lanes, and xs, per half block of 16 sum(q) in that order: kq_split_act). */
    int8_t *xh;
    uint8_t *xl;
    int32_t *xc;
    int32_t *xs;
    int8_t *xv; /* in xh's place */
    /* One row only, AVX2 (in xh's place): its int16 quants for a Q4_0 or Q4_1 decoding step, each block's
     * elements in the order of block_lanes_nib's vectors: 0, 2, .., 14, 1, 3, .., 15, 16, 18, .., 30, 17, .., 31. */
    int16_t *xp;
} spark_act;

/* The thread pool (spark_kernels.c): job(ctx, begin, end) over [0, items) split into one range per thread. */
typedef void (*spark_job)(void *ctx, int32_t begin, int32_t end);
SPARK_INTERNAL void parallel_for(spark_job job, void *ctx, int32_t items);

/* ---------------------------------------------------------------------------------------------------------------
 * The routes of one block type, chosen once at load (spark_register_*). A route computes weight rows [begin, end)
 * of w against activation rows of a (y (M, N) = x W^T + bias), as one job of the pool.
 * ------------------------------------------------------------------------------------------------------------- */

/* Activation rows [first, m), one or a few at a time. */
typedef void (*spark_rows_fn)(const spark_qmat *w, const spark_act *a, float *y, int32_t first, int32_t m, int32_t begin, int32_t end);
/* Activation rows [0, m) together (tokens in vector lanes, AMX tiles); 0: nothing computed (no memory for a copy). */
typedef int32_t (*spark_group_fn)(const spark_qmat *w, const spark_act *a, float *y, int32_t m, int32_t begin, int32_t end);
/* The activation rows put in a route's order (in the scratch a points into), once per product, before its jobs run. */
typedef void (*spark_prep_fn)(const spark_act *a, int32_t m, int32_t nb);
/* The same for one row (a decoding step) of a matrix of the type: its byte-product routes' order. */
typedef void (*spark_split_fn)(const spark_act *a, int32_t type, int32_t nb);

typedef struct {
    int32_t block_bytes;           /* bytes of one block (0: not a format the kernels run) */
    int32_t block_weights;         /* its weights: 32, or a super-block's 256 */
    spark_rows_fn rows;            /* every activation row: set for every format */
    spark_split_fn split;          /* one activation row (a decoding step) for rows' byte-product route, or NULL */
    spark_group_fn lanes[2];       /* a prefill's token-lane route for int8 [0] and int16 [1] rows, or NULL */
    int32_t lanes_min[2];          /* the fewest tokens of a last, partial group worth that route */
    spark_prep_fn lanes_in;        /* its copy of the rows (NULL: it reads them as they are) */
    spark_group_fn amx;            /* two int16 rows or more in AMX tiles, or NULL */
    spark_prep_fn amx_in;
} spark_type_traits;

/* One block of 32: q = rint(x * qmax / amax) into q8 (qmax 127, parts 1) or q16 (qmax 32767, parts 2); returns
 * d = amax / qmax (0 for an all-zero block) and sets q's sum. */
typedef float (*spark_quantize_block_fn)(const float *x, int32_t parts, int8_t *q8, int16_t *q16, int32_t *sum);
typedef void (*spark_quantize_row_fn)(const float *x, int32_t k, int32_t valid, spark_act *a, int64_t b0);

/* What the build's family sets for every type. */
typedef struct {
    const char *isa;                /* spark_isa(): the dot-product kernel's name */
    int32_t lanes;                  /* tokens a token-lane group holds */
    int32_t lane_copy_min;          /* the fewest rows spark_qgemm copies into token lanes (0: no route copies) */
    spark_quantize_row_fn quantize_row; /* activations into blocks (quantize_row_with below) */
    int32_t (*use_amx)(int32_t use); /* spark_use_amx, where AMX is built (else NULL) */
    int (*amx_on)(void);             /* whether products take AMX's tiles now */
} spark_isa_ops;

#define SPARK_TYPES 40 /* ggml type ids below this index the table */

/* Each family's registration, called once in this order (a family the compiler does not target sets nothing). */
SPARK_INTERNAL void spark_register_ref(spark_type_traits *traits, spark_isa_ops *ops);
SPARK_INTERNAL void spark_register_x86(spark_type_traits *traits, spark_isa_ops *ops);
SPARK_INTERNAL void spark_register_arm(spark_type_traits *traits, spark_isa_ops *ops);

/* Q4_K's and Q6_K's block b as float32 (ref/quants.c), for spark_dequant_rows. */
SPARK_INTERNAL void spark_kq_dequant_block(int32_t type, const uint8_t *row, int32_t b, float *o);

/* The attention's pieces a step of several tokens uses (spark_attention.c). */
/* Every key of an addressing (slots, positions: width ranks) rotated once, for all the tokens of a step that
 * attend to them: out (Hkv, width, D). A parallel_for job over ranks. */
typedef struct {
    const void *k;
    int32_t half, n_kv_heads, d;
    int64_t capacity, width;
    const int64_t *slots, *positions;
    const float *cos, *sin;
    float *out;
} spark_rotation;
SPARK_INTERNAL void rotate_ranks(void *ctx, int32_t begin, int32_t end);
SPARK_INTERNAL void attend_many(spark_attn *a, int32_t count, int prefix);

/* ---------------------------------------------------------------------------------------------------------------
 * The block formats' facts (engine/model/quant.py has the layouts), inlined where the routes specialize per type.
 * ------------------------------------------------------------------------------------------------------------- */

/* Q8_0, Q4_0, Q4_1: one fp16 scale (Q4_1: and a min), 32 quants. */
static inline int32_t block_bytes(int32_t type) { return type == SPARK_Q8_0 ? 34 : type == SPARK_Q4_1 ? 20 : 18; }

/* The other formats (spark_kquants.h). */
static inline int kq_type(int32_t type) {
    switch (type) {
    case SPARK_Q5_0: case SPARK_Q5_1: case SPARK_Q2_K: case SPARK_Q3_K: case SPARK_Q4_K: case SPARK_Q5_K:
    case SPARK_Q6_K: case SPARK_IQ4_NL: case SPARK_IQ4_XS: case SPARK_TQ1_0: case SPARK_TQ2_0: return 1;
    default: return 0;
    }
}

/* The types with the x86 vector route below (8 blocks per step): all; elsewhere every type goes block by block.
 * A prefill on AVX-512 takes the token-lane route (kq_tokens_in_lanes) for all but Q2_K, whose min term needs each
 * half's activation sum. */
static inline int kq_vec_type(int32_t type) { return kq_type(type); }
static inline int kq_lane_type(int32_t type) { return kq_type(type) && type != SPARK_Q2_K; }

/* Bytes of one block of the type: 32 weights for Q5_0, Q5_1 and IQ4_NL, a super-block of 256 for the others. */
static inline int32_t kq_block_bytes(int32_t type) {
    switch (type) {
    case SPARK_Q5_0: return 22;
    case SPARK_Q5_1: return 24;
    case SPARK_Q2_K: return 84;
    case SPARK_Q3_K: return 110;
    case SPARK_Q4_K: return 144;
    case SPARK_Q5_K: return 176;
    case SPARK_IQ4_NL: return 18;
    case SPARK_IQ4_XS: return 136;
    case SPARK_TQ1_0: return 54;
    case SPARK_TQ2_0: return 66;
    default: return 210; /* Q6_K */
    }
}

static inline int32_t kq_block_weights(int32_t type) { return type == SPARK_Q5_0 || type == SPARK_Q5_1 || type == SPARK_IQ4_NL ? QK : QK_K; }

static inline int64_t kq_row_bytes(int32_t type, int32_t k) { return (int64_t)(k / kq_block_weights(type)) * kq_block_bytes(type); }

/* The types whose halves of 16 weights have their own scales, and those with a min term (w = scale * q + mw). */
static inline int kq_half_scaled(int32_t type) { return type == SPARK_Q6_K || type == SPARK_Q3_K || type == SPARK_Q2_K; }
static inline int kq_has_min(int32_t type) { return type == SPARK_Q4_K || type == SPARK_Q5_K || type == SPARK_Q5_1; }

/* The types with a decoding step's split route (x86/quants.c, AVX-512): every Q4_K_M and Q6_K file's bulk. */
static inline int kq_split_type(int32_t type) { return type == SPARK_Q4_K || type == SPARK_Q6_K; }

/* The types whose rows spark_dequant_rows gives (the tied embedding of most K-quant files: its head is Q6_K). */
static inline int kq_dequant_type(int32_t type) { return type == SPARK_Q4_K || type == SPARK_Q6_K; }

/* Q4_K's scale and min of sub-block j (ggml's get_scale_min_k4). */
static inline void k4_scale_min(int32_t j, const uint8_t *q, int32_t *sc, int32_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* IQ4_NL's and IQ4_XS's 16 levels (ggml's kvalues_iq4nl). */
static const int8_t kq_iq4_levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* Q3_K's 6-bit scale of sub-block i (of 16 weights), -32..31: the low 4 bits from the nibbles of bytes 0..7, the
 * top 2 from the pairs of bytes 8..11. */
static inline int32_t k3_scale(const uint8_t *sc, int32_t i) {
    return (((sc[i & 7] >> (4 * (i >> 3))) & 0x0F) | (((sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3) << 4)) - 32;
}

/* Ask for `bytes` from p in cache before they are read (streams the hardware prefetcher does not foresee). */
static inline void prefetch_bytes(const uint8_t *p, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at, 0, 3);
}

static inline float f16_at(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

/* The float term block b adds (the fixed formulas at the top of spark_kernels.c), from its exact integer sum. */
static inline float block_term(int32_t type, const uint8_t *blk, int32_t i, const spark_act *a, int64_t b) {
    const float dw = f16_at(blk);
    if (type == SPARK_Q4_0) i -= 8 * a->s[b];
    float t = (dw * a->d[b]) * (float)i;
    if (type == SPARK_Q4_1) t += f16_at(blk + 2) * a->ds[b];
    return t;
}

/* e^x to ~1e-7 relative, branch-free so loops over it vectorize (libm's expf does not: ~8% of a decoded
 * token, in softmax and SiLU). x = n ln2 + r, |r| <= ln2 / 2; e^r by its Taylor series to r^6 (error < 2e-7);
 * 2^n built in the exponent bits. Clamped to the normal float range. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float round_magic = 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    const float n = (x * 1.44269504f + round_magic) - round_magic;
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f; /* Cody-Waite: ln2 in two parts */
    const float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* Quantize one row x (K, of which the first `valid` values are given: the rest are zeros, a matrix whose input
 * size is no multiple of 32 being padded with zero columns) into block `b0` onwards of a, each block of 32 by the
 * family's quantize_block (inlined: a decoding step quantizes ~100 rows). */
static inline __attribute__((always_inline)) void quantize_row_with(spark_quantize_block_fn quantize_block, const float *x, int32_t k, int32_t valid, spark_act *a, int64_t b0) {
    for (int32_t b = 0; b < k / QK; b++) {
        float padded[QK];
        const float *xb = x + b * QK;
        if ((b + 1) * QK > valid) {
            for (int32_t i = 0; i < QK; i++) padded[i] = b * QK + i < valid ? xb[i] : 0.0f;
            xb = padded;
        }
        const int64_t at = b0 + b;
        a->d[at] = quantize_block(xb, a->parts, a->q8 + at * QK, a->q16 + at * QK, &a->s[at]);
        a->ds[at] = a->d[at] * (float)a->s[at];
    }
}

#endif
