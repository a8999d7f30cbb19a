/* MLoT Spark native CPU kernels: the row loops of the block products over one family's block primitives, for the
 * portable reference (ref/quants.c) and NEON (arm/quants.c), which define them after including this:
 *   block_dot8(type, qs, xq): a Q8_0, Q4_0 or Q4_1 block's exact product with an int8 activation block;
 *   kq_halves(o, a, at, &h0, &h1): an unpacked block's exact products with an activation block's two halves.
 * Each block's float term and its place in the sums are the reference's (spark_kernels.c, spark_kquants.h), so every
 * family's bits are the same.
 */
#ifndef SPARK_ROWS_H
#define SPARK_ROWS_H

/* One unpacked weight block of 32: signed quants and the float factors of its term. */
typedef struct {
    int8_t w[QK];
    float dw, mw;   /* Q5_0, IQ4_NL, TQ*: d; Q4_K, Q5_K: d * sc and -(dmin * m); Q5_1: d and m; Q6_K, Q3_K: d;
                       Q2_K: d and -dmin; IQ4_XS: d * (ls - 32) */
    int32_t s0, s1; /* Q6_K, Q3_K, Q2_K: the two halves' scales */
    int32_t m0, m1; /* Q2_K: the two halves' mins */
} kq_block;

#include "../spark_kquants.h"

/* The family's block primitives (defined by the including file, after this header). */
static inline int32_t block_dot8(int32_t type, const uint8_t *qs, const int8_t *xq);
static inline void kq_halves(const kq_block *o, const spark_act *a, int64_t at, int32_t *h0, int32_t *h1);

/* Exact int32 products of one block: Q8_0 sum(wq * xq); Q4 sum(nib * xq), nibbles unsigned (0..15): byte i holds
 * element i in its low half and element i + 16 in its high half. `qs` points at the block's quants. Integer sums
 * are exact in any order, so each instruction set takes its own fastest route to the same number. */

/* The products of an int16 activation block in plain C. */
static inline int32_t dot16_c(int32_t type, const uint8_t *qs, const int16_t *x) {
    int32_t s = 0;
    if (type == SPARK_Q8_0) {
        for (int32_t i = 0; i < QK; i++) s += (int32_t)((const int8_t *)qs)[i] * x[i];
    } else {
        for (int32_t i = 0; i < QK / 2; i++) s += (int32_t)(qs[i] & 0x0F) * x[i] + (int32_t)(qs[i] >> 4) * x[i + QK / 2];
    }
    return s;
}

/* Block `at` of a's product with the block of quants `qs`: int16 rows in plain C (which the compiler vectorizes),
 * int8 ones by the family's block_dot8. */
static inline int32_t block_dot(int32_t type, const uint8_t *qs, const spark_act *a, int64_t at) {
    if (a->parts == 2) return dot16_c(type, qs, a->q16 + at * QK);
    return block_dot8(type, qs, a->q8 + at * QK);
}

/* out[t] = sum_k w[row, k] x_t[k] for one row of blocks and R <= SPARK_ROWS (12) quantized activation rows, row t starting at
 * block b0[t]. The weight blocks are unpacked once for all R rows; each row's sum takes the same steps as for R = 1,
 * so a prefill and one-row decodes agree bit for bit. Inlined per R (spark_dot_rows below), so the R rows'
 * accumulators live in registers. */
#define SPARK_ROWS 12
static inline __attribute__((always_inline)) void dot_rows_r(int32_t type, const uint8_t *row, int32_t nb, const spark_act *a, const int64_t *b0, const int32_t r_count, float *out) {
    const int32_t bb = block_bytes(type), off = type == SPARK_Q4_1 ? 4 : 2;
    float acc[SPARK_ROWS][8] = {{0}};
    int32_t b = 0;
    for (int32_t t = 0; t < r_count; t++) {
        float *ac = acc[t];
        for (int32_t c = b; c < nb; c++) {
            const uint8_t *p = row + (int64_t)c * bb;
            ac[c & 7] += block_term(type, p, block_dot(type, p + off, a, b0[t] + c), a, b0[t] + c);
        }
        out[t] = ((ac[0] + ac[4]) + (ac[1] + ac[5])) + ((ac[2] + ac[6]) + (ac[3] + ac[7]));
    }
}

/* dot_rows_r compiled per type and row count, so its branches on the type fold away as dot_pair16's do. */
#define SPARK_DOT_ROWS_T(TYPE)                                                                                          \
    static void dot_rows_##TYPE(const uint8_t *row, int32_t nb, const spark_act *a, const int64_t *b0, int32_t r_count, float *out) { \
        switch (r_count) {                                                                                              \
        case 1: dot_rows_r(TYPE, row, nb, a, b0, 1, out); break;                                                        \
        case 2: dot_rows_r(TYPE, row, nb, a, b0, 2, out); break;                                                        \
        case 3: dot_rows_r(TYPE, row, nb, a, b0, 3, out); break;                                                        \
        case 4: dot_rows_r(TYPE, row, nb, a, b0, 4, out); break;                                                        \
        case 5: dot_rows_r(TYPE, row, nb, a, b0, 5, out); break;                                                        \
        case 6: dot_rows_r(TYPE, row, nb, a, b0, 6, out); break;                                                        \
        case 7: dot_rows_r(TYPE, row, nb, a, b0, 7, out); break;                                                        \
        case 8: dot_rows_r(TYPE, row, nb, a, b0, 8, out); break;                                                        \
        case 9: dot_rows_r(TYPE, row, nb, a, b0, 9, out); break;                                                        \
        case 10: dot_rows_r(TYPE, row, nb, a, b0, 10, out); break;                                                      \
        case 11: dot_rows_r(TYPE, row, nb, a, b0, 11, out); break;                                                      \
        default: dot_rows_r(TYPE, row, nb, a, b0, SPARK_ROWS, out); break;                                              \
        }                                                                                                               \
    }
SPARK_DOT_ROWS_T(SPARK_Q8_0)
SPARK_DOT_ROWS_T(SPARK_Q4_0)
SPARK_DOT_ROWS_T(SPARK_Q4_1)
#undef SPARK_DOT_ROWS_T

static void dot_rows(int32_t type, const uint8_t *row, int32_t nb, const spark_act *a, const int64_t *b0, int32_t r_count, float *out) {
    switch (type) {
    case SPARK_Q8_0: dot_rows_SPARK_Q8_0(row, nb, a, b0, r_count, out); break;
    case SPARK_Q4_0: dot_rows_SPARK_Q4_0(row, nb, a, b0, r_count, out); break;
    default: dot_rows_SPARK_Q4_1(row, nb, a, b0, r_count, out); break;
    }
}

/* Block b (of 32 weights) of a row of the type. */
static inline void kq_unpack(int32_t type, const uint8_t *row, int32_t b, kq_block *o) {
    if (type != SPARK_Q5_0 && type != SPARK_Q4_K && type != SPARK_Q6_K) {
        kq_unpack_scalar(type, row, b, o->w, o);
        return;
    }
    o->mw = 0.0f;
    o->s0 = o->s1 = o->m0 = o->m1 = 0;
    if (type == SPARK_Q5_0) {
        const uint8_t *blk = row + (int64_t)b * 22;
        uint32_t qh;
        memcpy(&qh, blk + 2, 4);
        o->dw = f16_at(blk);
        for (int32_t i = 0; i < QK / 2; i++) {
            o->w[i] = (int8_t)(((blk[6 + i] & 0x0F) | (((qh >> i) & 1) << 4)) - 16);
            o->w[i + QK / 2] = (int8_t)(((blk[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16);
        }
        return;
    }
    const int32_t j = b & 7; /* the block within its super-block */
    if (type == SPARK_Q4_K) {
        const uint8_t *blk = row + (int64_t)(b >> 3) * 144, *qs = blk + 16 + 32 * (j >> 1);
        int32_t sc, m;
        k4_scale_min(j, blk + 4, &sc, &m);
        o->dw = f16_at(blk) * (float)sc;
        o->mw = -(f16_at(blk + 2) * (float)m);
        for (int32_t i = 0; i < QK; i++) o->w[i] = (int8_t)(j & 1 ? qs[i] >> 4 : qs[i] & 0x0F);
        return;
    }
    /* Q6_K: block j is quarter t of half h; its low 4 bits are nibbles of ql (the high ones from t = 2), its top
     * two bits are bits 2t of qh; its halves' scales are sc[2j], sc[2j + 1]. */
    const uint8_t *blk = row + (int64_t)(b >> 3) * 210;
    const int32_t h = j >> 2, t = j & 3;
    const uint8_t *ql = blk + 64 * h + 32 * (t & 1), *qh = blk + 128 + 32 * h;
    const int8_t *sc = (const int8_t *)(blk + 192);
    o->dw = f16_at(blk + 208);
    o->s0 = sc[2 * j];
    o->s1 = sc[2 * j + 1];
    for (int32_t i = 0; i < QK; i++) {
        const int32_t low = t >= 2 ? ql[i] >> 4 : ql[i] & 0x0F;
        o->w[i] = (int8_t)((low | (((qh[i] >> (2 * t)) & 3) << 4)) - 32);
    }
}

/* out[t] = one weight row times activation rows t < r_count (row t from block b0[t]); each block is unpacked once for
 * all rows, and each row's sum takes the same steps whatever r_count is. */
#define KQ_ROWS 4
static inline __attribute__((always_inline)) void kq_dot_rows_r(int32_t type, const uint8_t *row, int32_t nb, const spark_act *a, const int64_t *b0, const int32_t r_count, float *out) {
    float acc[KQ_ROWS][8] = {{0}};
    int32_t b = 0;
    for (; b < nb; b++) {
        kq_block o;
        kq_unpack(type, row, b, &o);
        for (int32_t t = 0; t < r_count; t++) {
            int32_t h0, h1;
            kq_halves(&o, a, b0[t] + b, &h0, &h1);
            acc[t][b & 7] += kq_term(type, &o, h0, h1, a, b0[t] + b);
        }
    }
    for (int32_t t = 0; t < r_count; t++) {
        const float *ac = acc[t];
        out[t] = ((ac[0] + ac[4]) + (ac[1] + ac[5])) + ((ac[2] + ac[6]) + (ac[3] + ac[7]));
    }
}

/* kq_dot_rows_r inlined per row count, then per type (below): the type's branches fold away in each copy. */
static inline __attribute__((always_inline)) void kq_dot_rows_t(const int32_t type, const uint8_t *row, int32_t nb, const spark_act *a, const int64_t *b0, int32_t r_count, float *out) {
    switch (r_count) {
    case 1: kq_dot_rows_r(type, row, nb, a, b0, 1, out); break;
    case 2: kq_dot_rows_r(type, row, nb, a, b0, 2, out); break;
    case 3: kq_dot_rows_r(type, row, nb, a, b0, 3, out); break;
    default: kq_dot_rows_r(type, row, nb, a, b0, KQ_ROWS, out); break;
    }
}

static void kq_dot_rows(int32_t type, const uint8_t *row, int32_t nb, const spark_act *a, const int64_t *b0, int32_t r_count, float *out) {
    switch (type) {
    case SPARK_Q5_0: kq_dot_rows_t(SPARK_Q5_0, row, nb, a, b0, r_count, out); break;
    case SPARK_Q5_1: kq_dot_rows_t(SPARK_Q5_1, row, nb, a, b0, r_count, out); break;
    case SPARK_Q2_K: kq_dot_rows_t(SPARK_Q2_K, row, nb, a, b0, r_count, out); break;
    case SPARK_Q3_K: kq_dot_rows_t(SPARK_Q3_K, row, nb, a, b0, r_count, out); break;
    case SPARK_Q4_K: kq_dot_rows_t(SPARK_Q4_K, row, nb, a, b0, r_count, out); break;
    case SPARK_Q5_K: kq_dot_rows_t(SPARK_Q5_K, row, nb, a, b0, r_count, out); break;
    case SPARK_IQ4_NL: kq_dot_rows_t(SPARK_IQ4_NL, row, nb, a, b0, r_count, out); break;
    case SPARK_IQ4_XS: kq_dot_rows_t(SPARK_IQ4_XS, row, nb, a, b0, r_count, out); break;
    case SPARK_TQ1_0: kq_dot_rows_t(SPARK_TQ1_0, row, nb, a, b0, r_count, out); break;
    case SPARK_TQ2_0: kq_dot_rows_t(SPARK_TQ2_0, row, nb, a, b0, r_count, out); break;
    default: kq_dot_rows_t(SPARK_Q6_K, row, nb, a, b0, r_count, out); break;
    }
}

/* Weight rows [begin, end) of w times activation rows [first, m): y (M, N), the K-quants' row routes. */
static void kq_gemm_rows(const spark_qmat *w, const spark_act *a, float *y, int32_t first, int32_t m, int32_t begin, int32_t end) {
    const int32_t nb = w->k / QK, n = w->n;
    const int64_t rb = kq_row_bytes(w->type, w->k);
    for (int32_t r = first; r < m; r += KQ_ROWS) {
        const int32_t rc = m - r < KQ_ROWS ? m - r : KQ_ROWS;
        int64_t b0[KQ_ROWS];
        for (int32_t t = 0; t < rc; t++) b0[t] = (int64_t)(r + t) * nb;
        for (int32_t j = begin; j < end; j++) {
            float out[KQ_ROWS];
            kq_dot_rows(w->type, w->blocks + j * rb, nb, a, b0, rc, out);
            const float bias = w->bias ? w->bias[j] : 0.0f;
            for (int32_t t = 0; t < rc; t++) y[(int64_t)(r + t) * n + j] = out[t] + bias;
        }
    }
}

/* Rows [first, m) of Q8_0, Q4_0 and Q4_1: tokens in groups of SPARK_ROWS, and within a group every row of this
 * thread's range, so the group's activations stay in L1 while the weight rows stream past once per group. */
static void q_rows(const spark_qmat *w, const spark_act *a, float *y, int32_t first, int32_t m, int32_t begin, int32_t end) {
    const int32_t nb = w->k / QK, n = w->n;
    const int64_t row_bytes = (int64_t)nb * block_bytes(w->type);
    for (int32_t r = first; r < m; r += SPARK_ROWS) {
        const int32_t rc = m - r < SPARK_ROWS ? m - r : SPARK_ROWS;
        int64_t b0[SPARK_ROWS];
        for (int32_t t = 0; t < rc; t++) b0[t] = (int64_t)(r + t) * nb;
        for (int32_t j = begin; j < end; j++) {
            float out[SPARK_ROWS];
            dot_rows(w->type, w->blocks + j * row_bytes, nb, a, b0, rc, out);
            const float bias = w->bias ? w->bias[j] : 0.0f;
            for (int32_t t = 0; t < rc; t++) y[(int64_t)(r + t) * n + j] = out[t] + bias;
        }
    }
}

/* The row routes of every type: those above. */
static void rows_register(spark_type_traits *traits) {
    static const int32_t q[] = {SPARK_Q8_0, SPARK_Q4_0, SPARK_Q4_1};
    for (int32_t i = 0; i < 3; i++) traits[q[i]].rows = q_rows;
    for (int32_t type = 0; type < SPARK_TYPES; type++)
        if (kq_type(type)) traits[type].rows = kq_gemm_rows;
}

#endif
