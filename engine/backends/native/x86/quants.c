/* MLoT Spark native CPU kernels, x86: the block products of every format with AVX2 or AVX-512 VNNI, and AMX's tiles
 * where the CPU has them (Sapphire Rapids on). Registered over the reference (ref/quants.c) for every type by
 * spark_register_x86 when the compiler targets AVX2 or better; the bits are the reference's (spark_kernels.c and
 * spark_kquants.h give the order of the float terms).
 *
 * Routes of Q8_0, Q4_0 and Q4_1 (spark_kernels.c's formats): a decoding step (one activation row) takes the weight
 * rows in pairs with 256-bit products (dot_pair16), one row from each half of a thread's range; a prefill puts 16
 * tokens in the lanes of one 512-bit product on AVX-512 (tokens_in_lanes, every block type), on AVX2 8 weight rows
 * in the lanes of a 256-bit one against each token broadcast (rows_in_lanes_t); up to 4 tokens (a verify) take
 * pairs of weight rows over them (dot_rows2); elsewhere it passes each weight row over 12 tokens (dot_rows_r). Where
 * the CPU has AMX, 2 tokens or more take its tiles instead (amx_gemm_t: 16 weight rows by up to 16 tokens a block
 * product), so a verify of a few tokens costs little more than a decoding step. The other formats' routes follow
 * (spark_kquants.h lists them).
 */
#include "../spark_blocks.h"

#if defined(__AVX2__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SPARK_AVX512VNNI 1
#else
#define SPARK_AVX2 1
#endif
#include <immintrin.h>
#include <pthread.h>

/* One unpacked weight block of 32: signed quants and the float factors of its term. */
typedef struct {
    __m256i w;      /* 32 x int8 */
    float dw, mw;   /* Q5_0, IQ4_NL, TQ*: d; Q4_K, Q5_K: d * sc and -(dmin * m); Q5_1: d and m; Q6_K, Q3_K: d;
                       Q2_K: d and -dmin; IQ4_XS: d * (ls - 32) */
    int32_t s0, s1; /* Q6_K, Q3_K, Q2_K: the two halves' scales */
    int32_t m0, m1; /* Q2_K: the two halves' mins */
} kq_block;
#include "../spark_kquants.h"

/* Tokens a prefill's lane route takes at a time (on AVX-512 in the lanes of one 512-bit product, on AVX2 each
 * broadcast against 8 weight rows in a 256-bit one), and the fewest worth a group. A group costs the same however
 * few tokens fill it; below that many the row routes are faster (tests/engine/backends/native/qgemm_timing.c: about half a
 * group on AVX-512, three quarters on AVX2). */
#if defined(SPARK_AVX512VNNI) && defined(__AVX512BW__)
#define SPARK_ZMM 1 /* the 512-bit token-lane route, every block type */
#define SPARK_LANES 16
#define SPARK_LANES_MIN 8
#define SPARK_LANES_MIN_A8 2 /* int8 rows of Q4_K and Q6_K: their row route costs more than a group from 2 tokens */
#else
#define SPARK_LANES 8
#define SPARK_LANES_MIN 6
#endif

#if defined(SPARK_ZMM)
/* Token group g's 16 lanes of output column j into y (M, N) (+ bias): the tokens of the group below m (a last
 * group's other lanes are computed, never stored). */
static inline void lanes_store(__m512 v, const struct spark_qmat *w, float *y, int32_t m, int64_t g, int32_t j) {
    const int32_t count = m - g * SPARK_LANES < SPARK_LANES ? (int32_t)(m - g * SPARK_LANES) : SPARK_LANES;
    float lanes[SPARK_LANES];
    _mm512_storeu_ps(lanes, v);
    const float bias = w->bias ? w->bias[j] : 0.0f;
    for (int32_t t = 0; t < count; t++) y[(g * SPARK_LANES + t) * w->n + j] = lanes[t] + bias;
}
#endif

/* One block of 32: q = rint(x * qmax / amax) into q8 (qmax 127, parts 1) or q16 (qmax 32767, parts 2); returns
 * d = amax / qmax (0 for an all-zero block) and sets q's sum. */
static float quantize_block(const float *x, int32_t parts, int8_t *q8, int16_t *q16, int32_t *sum) {
#if defined(SPARK_AVX512VNNI) && defined(__AVX512BW__)
    /* The same operations 16 lanes at a time: max keeps the running value where |x| is NaN, as `v > amax` does;
     * the conversion rounds as lrintf (the current mode) and its out-of-range result, like lrintf's, has zero low
     * bits, so the truncated quants and their sum are the scalar loop's. */
    const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x1), _mm512_max_ps(_mm512_abs_ps(x0), _mm512_setzero_ps())));
    const float qmax = parts == 2 ? 32767.0f : 127.0f;
    const __m512 inv = _mm512_set1_ps(amax == 0.0f ? 0.0f : qmax / amax);
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
    const int bits = parts == 2 ? 16 : 24; /* sign-extend the stored low 16 (8) bits for the sum */
    const __m512i t0 = _mm512_srai_epi32(_mm512_slli_epi32(i0, bits), bits), t1 = _mm512_srai_epi32(_mm512_slli_epi32(i1, bits), bits);
    if (parts == 2) {
        _mm256_storeu_si256((__m256i *)q16, _mm512_cvtepi32_epi16(i0));
        _mm256_storeu_si256((__m256i *)(q16 + 16), _mm512_cvtepi32_epi16(i1));
    } else {
        _mm_storeu_si128((__m128i *)q8, _mm512_cvtepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(q8 + 16), _mm512_cvtepi32_epi8(i1));
    }
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(t0, t1));
    return amax / qmax;
#else
    float amax = 0.0f;
    for (int32_t i = 0; i < QK; i++) {
        const float v = fabsf(x[i]);
        amax = v > amax ? v : amax;
    }
    const float qmax = parts == 2 ? 32767.0f : 127.0f;
    const float inv = amax == 0.0f ? 0.0f : qmax / amax;
    int32_t s = 0;
    if (parts == 2) {
        for (int32_t i = 0; i < QK; i++) {
            q16[i] = (int16_t)lrintf(x[i] * inv);
            s += q16[i];
        }
    } else {
        for (int32_t i = 0; i < QK; i++) {
            q8[i] = (int8_t)lrintf(x[i] * inv);
            s += q8[i];
        }
    }
    *sum = s;
    return amax / qmax;
#endif
}

static void quantize_row(const float *x, int32_t k, int32_t valid, spark_act *a, int64_t b0) {
    quantize_row_with(quantize_block, x, k, valid, a, b0);
}

/* Exact int32 products of one block: Q8_0 sum(wq * xq); Q4 sum(nib * xq), nibbles unsigned (0..15): byte i holds
 * element i in its low half and element i + 16 in its high half. `qs` points at the block's quants. Integer sums
 * are exact in any order, so each instruction set takes its own fastest route to the same number. */
typedef struct {
    __m256i u; /* unsigned bytes: |w| (Q8_0) or the nibbles */
    __m256i w; /* Q8_0's signed weights (their signs move onto x) */
} spark_wv;

static inline spark_wv load_w(int32_t type, const uint8_t *qs) {
    spark_wv v;
    if (type == SPARK_Q8_0) {
        v.w = _mm256_loadu_si256((const __m256i *)qs);
        v.u = _mm256_abs_epi8(v.w);
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
        const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F)), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
        v.u = _mm256_set_m128i(hi, lo);
        v.w = v.u;
    }
    return v;
}
/* 8 int32 lanes whose sum is the block's product with int8 activations: u8 times s8 without saturation. */
static inline __m256i block_lanes(int32_t type, spark_wv wv, const int8_t *xq) {
    __m256i x = _mm256_loadu_si256((const __m256i *)xq);
    if (type == SPARK_Q8_0) x = _mm256_sign_epi8(x, wv.w); /* |w| * (x * sign w) = w * x, w = -128 included */
#if defined(SPARK_AVX512VNNI)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv.u, x);
#else
    /* maddubs adds two u8 * s8 products into int16: |w| <= 128 and |x| <= 127 keep 2 * 128 * 127 < 32767. */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(wv.u, x), _mm256_set1_epi16(1));
#endif
}

typedef struct {
    __m256i lo, hi; /* the weights widened to int16: elements 0..15 and 16..31 */
} spark_w16;

static inline spark_w16 load_w16(int32_t type, const uint8_t *qs) {
    spark_w16 v;
    if (type == SPARK_Q8_0) {
        v.lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)qs));
        v.hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16)));
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0F);
        v.lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, mask));
        v.hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
    }
    return v;
}
/* 8 int32 lanes whose sum is the block's product with int16 activations: |w| <= 128, |x| <= 32767, so a pair's
 * sum and the block's total (< 2^27) stay within int32. */
static inline __m256i block_lanes16(spark_w16 w, const int16_t *x) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)x), x1 = _mm256_loadu_si256((const __m256i *)(x + 16));
#if defined(SPARK_AVX512VNNI)
    return _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), w.lo, x0), w.hi, x1);
#else
    return _mm256_add_epi32(_mm256_madd_epi16(w.lo, x0), _mm256_madd_epi16(w.hi, x1));
#endif
}
#if defined(SPARK_AVX512VNNI)
/* block_lanes16 for Q8_0 in two byte products, with no widening of the weights to int16:
 * x = 256 xh + xl, and w enters the xh product as the unsigned byte w + 128 (w ^ 0x80), so the lanes sum to
 * sum(w x) + 32768 sum(xh); the caller takes off a->xc per block. Exact integers: the same sums. */
static inline __m256i block_lanes_split(const uint8_t *qs, const spark_act *a, int64_t at) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)qs), wu = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
    const __m256i high = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wu, _mm256_loadu_si256((const __m256i *)(a->xh + at)));
    return _mm256_dpbusd_epi32(_mm256_slli_epi32(high, 8), _mm256_loadu_si256((const __m256i *)(a->xl + at)), w);
}
#endif
#if defined(SPARK_AVX2)
/* block_lanes16 of a Q4 block for a decoding step, against a->xp: the nibbles widened to int16 by shifts of the
 * block's 16 bytes (broadcast to both halves) within 32-bit words, not by two byte-to-word shuffles: a word's
 * nibble at bit 0 or 16 after a shift of 0 (low half) or 8 (high half) is the low nibble of an even or odd byte,
 * after 4 or 12 the high nibble. The pairs madd adds differ from block_lanes16's; the lanes' total is the same. */
static inline __m256i block_lanes_nib(const uint8_t *qs, const int16_t *xp) {
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs)), mask = _mm256_set1_epi32(0x000F000F);
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(raw, _mm256_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8)), mask);
    const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(raw, _mm256_setr_epi32(4, 4, 4, 4, 12, 12, 12, 12)), mask);
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xp)), _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xp + 16))));
}
#endif
/* The four blocks' sums from their lanes (integer adds: exact in any order). */
static inline __m128i hsum4(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}

/* Block `at` of a's product with the block of quants `qs`. */
static inline int32_t block_dot(int32_t type, const uint8_t *qs, const spark_act *a, int64_t at) {
    const __m256i z = _mm256_setzero_si256();
    const __m256i lanes = a->parts == 2 ? block_lanes16(load_w16(type, qs), a->q16 + at * QK) : block_lanes(type, load_w(type, qs), a->q8 + at * QK);
    return _mm_cvtsi128_si32(hsum4(lanes, z, z, z));
}

/* The weight side of blocks b .. b+3 (their d, and Q4_1's m), widened once for every activation row. */
static inline void block_scales4(int32_t type, const uint8_t *p, int32_t bb, __m128 *dw, __m128 *mw) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    /* The four fp16 scales gathered by one word permute of the blocks' first bytes (every scale sits at an even
     * offset: bb is even), not four scalar loads and inserts, which cost a decoding step more than the widening
     * of its weights. The loads stay inside the four blocks: 4 * bb >= 64 (Q4_0, Q4_1) and >= 128 (Q8_0). */
    const __m512i lo = _mm512_loadu_si512(p);
    __m512i dm; /* words 0..3: d of blocks 0..3; Q4_1: words 4..7, their m */
    if (type == SPARK_Q8_0) {
        dm = _mm512_permutex2var_epi16(lo, _mm512_zextsi128_si512(_mm_setr_epi16(0, 17, 34, 51, 0, 0, 0, 0)), _mm512_loadu_si512(p + 64));
    } else {
        const int16_t w = (int16_t)(bb / 2);
        dm = _mm512_permutexvar_epi16(_mm512_zextsi128_si512(_mm_setr_epi16(0, w, 2 * w, 3 * w, 1, w + 1, 2 * w + 1, 3 * w + 1)), lo);
    }
    const __m128i dm128 = _mm512_castsi512_si128(dm);
    *dw = _mm_cvtph_ps(dm128);
    if (type == SPARK_Q4_1) *mw = _mm_cvtph_ps(_mm_unpackhi_epi64(dm128, dm128));
#else
    int32_t w32[4]; /* each block's first 4 bytes: d, then m (Q4_1) or quants */
    for (int32_t j = 0; j < 4; j++) memcpy(&w32[j], p + j * bb, 4);
    const __m128i dm = _mm_setr_epi32(w32[0], w32[1], w32[2], w32[3]);
    *dw = _mm_cvtph_ps(_mm_shuffle_epi8(dm, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1)));
    if (type == SPARK_Q4_1) *mw = _mm_cvtph_ps(_mm_shuffle_epi8(dm, _mm_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1)));
#endif
}
/* block_term for blocks b .. b+3 at once: the same float operations in the same order, one lane per block. */
static inline __m128 block_terms4(int32_t type, __m128 dw, __m128 mw, __m128i i, const spark_act *a, int64_t b) {
    if (type == SPARK_Q4_0) i = _mm_sub_epi32(i, _mm_slli_epi32(_mm_loadu_si128((const __m128i *)(a->s + b)), 3));
    __m128 t = _mm_mul_ps(_mm_mul_ps(dw, _mm_loadu_ps(a->d + b)), _mm_cvtepi32_ps(i));
    if (type == SPARK_Q4_1) t = _mm_add_ps(t, _mm_mul_ps(mw, _mm_loadu_ps(a->ds + b)));
    return t;
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
    /* Per row, the partial sums of blocks of this group's parity (cur) and of the next group's (next): b % 8 for
     * b in groups of 4 is acc[0..3] for even groups, acc[4..7] for odd ones; the two swap roles every group. */
    __m128 cur[SPARK_ROWS], next[SPARK_ROWS];
    for (int32_t t = 0; t < r_count; t++) cur[t] = next[t] = _mm_setzero_ps();
    for (; b + 4 <= nb; b += 4) {
        const uint8_t *p = row + (int64_t)b * bb;
        __m128 dw, mw = _mm_setzero_ps();
        block_scales4(type, p, bb, &dw, &mw);
        __m128i isum[SPARK_ROWS];
        if (a->parts == 2) {
            const spark_w16 w0 = load_w16(type, p + off), w1 = load_w16(type, p + bb + off), w2 = load_w16(type, p + 2 * bb + off), w3 = load_w16(type, p + 3 * bb + off);
            for (int32_t t = 0; t < r_count; t++) {
                const int16_t *q = a->q16 + (b0[t] + b) * QK;
                isum[t] = hsum4(block_lanes16(w0, q), block_lanes16(w1, q + QK), block_lanes16(w2, q + 2 * QK), block_lanes16(w3, q + 3 * QK));
            }
        } else {
            const spark_wv w0 = load_w(type, p + off), w1 = load_w(type, p + bb + off), w2 = load_w(type, p + 2 * bb + off), w3 = load_w(type, p + 3 * bb + off);
            for (int32_t t = 0; t < r_count; t++) {
                const int8_t *q = a->q8 + (b0[t] + b) * QK;
                isum[t] = hsum4(block_lanes(type, w0, q), block_lanes(type, w1, q + QK), block_lanes(type, w2, q + 2 * QK), block_lanes(type, w3, q + 3 * QK));
            }
        }
        for (int32_t t = 0; t < r_count; t++) {
            const __m128 sum = _mm_add_ps(cur[t], block_terms4(type, dw, mw, isum[t], a, b0[t] + b));
            cur[t] = next[t];
            next[t] = sum;
        }
    }
    const int32_t odd = (b >> 2) & 1; /* groups done: after an odd count, cur holds the odd groups' sums */
    for (int32_t t = 0; t < r_count; t++) {
        _mm_storeu_ps(acc[t] + (odd ? 4 : 0), cur[t]);
        _mm_storeu_ps(acc[t] + (odd ? 0 : 4), next[t]);
    }
    for (int32_t t = 0; t < r_count; t++) {
        float *ac = acc[t];
        for (int32_t c = b; c < nb; c++) {
            const uint8_t *p = row + (int64_t)c * bb;
            ac[c & 7] += block_term(type, p, block_dot(type, p + off, a, b0[t] + c), a, b0[t] + c);
        }
        out[t] = ((ac[0] + ac[4]) + (ac[1] + ac[5])) + ((ac[2] + ac[6]) + (ac[3] + ac[7]));
    }
}

/* dot_rows_r over two weight rows at once for a few int16 activation rows (a verify's): two independent chains per
 * token for the core to overlap, as dot_pair16 has for one. Each output takes dot_rows_r's steps: the same bits. */
static inline __attribute__((always_inline)) void dot_rows2_r(const int32_t type, const uint8_t *ra, const uint8_t *rb, int32_t nb, const spark_act *a, const int64_t *b0, const int32_t r_count, float *out_a, float *out_b) {
    const int32_t bb = block_bytes(type), off = type == SPARK_Q4_1 ? 4 : 2;
    __m128 cur[2][4], next[2][4];
    for (int32_t t = 0; t < r_count; t++) cur[0][t] = next[0][t] = cur[1][t] = next[1][t] = _mm_setzero_ps();
    int32_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        const uint8_t *pa = ra + (int64_t)b * bb, *pb = rb + (int64_t)b * bb;
        __m128 dwa, mwa = _mm_setzero_ps(), dwb, mwb = _mm_setzero_ps();
        block_scales4(type, pa, bb, &dwa, &mwa);
        block_scales4(type, pb, bb, &dwb, &mwb);
        const spark_w16 a0 = load_w16(type, pa + off), a1 = load_w16(type, pa + bb + off), a2 = load_w16(type, pa + 2 * bb + off), a3 = load_w16(type, pa + 3 * bb + off);
        const spark_w16 c0 = load_w16(type, pb + off), c1 = load_w16(type, pb + bb + off), c2 = load_w16(type, pb + 2 * bb + off), c3 = load_w16(type, pb + 3 * bb + off);
        for (int32_t t = 0; t < r_count; t++) {
            const int16_t *q = a->q16 + (b0[t] + b) * QK;
            const __m128i ia = hsum4(block_lanes16(a0, q), block_lanes16(a1, q + QK), block_lanes16(a2, q + 2 * QK), block_lanes16(a3, q + 3 * QK));
            const __m128i ib = hsum4(block_lanes16(c0, q), block_lanes16(c1, q + QK), block_lanes16(c2, q + 2 * QK), block_lanes16(c3, q + 3 * QK));
            const __m128 sa = _mm_add_ps(cur[0][t], block_terms4(type, dwa, mwa, ia, a, b0[t] + b));
            const __m128 sb = _mm_add_ps(cur[1][t], block_terms4(type, dwb, mwb, ib, a, b0[t] + b));
            cur[0][t] = next[0][t], next[0][t] = sa, cur[1][t] = next[1][t], next[1][t] = sb;
        }
    }
    const int32_t odd = (b >> 2) & 1;
    for (int32_t r = 0; r < 2; r++) {
        const uint8_t *row = r ? rb : ra;
        float *out = r ? out_b : out_a;
        for (int32_t t = 0; t < r_count; t++) {
            float ac[8];
            _mm_storeu_ps(ac + (odd ? 4 : 0), cur[r][t]);
            _mm_storeu_ps(ac + (odd ? 0 : 4), next[r][t]);
            for (int32_t c = b; c < nb; c++) {
                const uint8_t *p = row + (int64_t)c * bb;
                ac[c & 7] += block_term(type, p, block_dot(type, p + off, a, b0[t] + c), a, b0[t] + c);
            }
            out[t] = ((ac[0] + ac[4]) + (ac[1] + ac[5])) + ((ac[2] + ac[6]) + (ac[3] + ac[7]));
        }
    }
}
#define SPARK_DOT_ROWS2_T(TYPE)                                                                                         \
    static void dot_rows2_##TYPE(const uint8_t *ra, const uint8_t *rb, int32_t nb, const spark_act *a, const int64_t *b0, int32_t r_count, float *oa, float *ob) { \
        switch (r_count) {                                                                                              \
        case 1: dot_rows2_r(TYPE, ra, rb, nb, a, b0, 1, oa, ob); break;                                                 \
        case 2: dot_rows2_r(TYPE, ra, rb, nb, a, b0, 2, oa, ob); break;                                                 \
        case 3: dot_rows2_r(TYPE, ra, rb, nb, a, b0, 3, oa, ob); break;                                                 \
        default: dot_rows2_r(TYPE, ra, rb, nb, a, b0, 4, oa, ob); break;                                                \
        }                                                                                                               \
    }
SPARK_DOT_ROWS2_T(SPARK_Q8_0)
SPARK_DOT_ROWS2_T(SPARK_Q4_0)
SPARK_DOT_ROWS2_T(SPARK_Q4_1)
#undef SPARK_DOT_ROWS2_T
/* Two weight rows against r_count <= 4 int16 activation rows; 0 where this build or format has no such route. */
static int32_t dot_rows2(int32_t type, const uint8_t *ra, const uint8_t *rb, int32_t nb, const spark_act *a, const int64_t *b0, int32_t r_count, float *oa, float *ob) {
    if (a->parts != 2 || r_count > 4) return 0;
    switch (type) {
    case SPARK_Q8_0: dot_rows2_SPARK_Q8_0(ra, rb, nb, a, b0, r_count, oa, ob); return 1;
    case SPARK_Q4_0: dot_rows2_SPARK_Q4_0(ra, rb, nb, a, b0, r_count, oa, ob); return 1;
    case SPARK_Q4_1: dot_rows2_SPARK_Q4_1(ra, rb, nb, a, b0, r_count, oa, ob); return 1;
    default: return 0;
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

/* dot_rows for one int16 activation row (a decoding step) and two weight rows at once: two independent chains
 * for the core to overlap, the activation blocks loaded once for both. Each row's sum takes dot_rows's steps. */
static inline __attribute__((always_inline)) void dot_pair16_t(const int32_t type, const uint8_t *ra, const uint8_t *rb, int32_t nb, const spark_act *a, float *out) {
    const int32_t bb = block_bytes(type), off = type == SPARK_Q4_1 ? 4 : 2;
    __m128 cur_a = _mm_setzero_ps(), next_a = _mm_setzero_ps(), cur_b = _mm_setzero_ps(), next_b = _mm_setzero_ps();
    int32_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        const uint8_t *pa = ra + (int64_t)b * bb, *pb = rb + (int64_t)b * bb;
        const int16_t *q = a->q16 + (int64_t)b * QK;
        __m256i la[4], lb[4];
        __m128i split = _mm_setzero_si128(); /* what block_lanes_split's sums carry over the products */
#if defined(SPARK_AVX512VNNI)
        if (type == SPARK_Q8_0) {
            for (int32_t j = 0; j < 4; j++) {
                la[j] = block_lanes_split(pa + j * bb + off, a, (int64_t)(b + j) * QK);
                lb[j] = block_lanes_split(pb + j * bb + off, a, (int64_t)(b + j) * QK);
            }
            split = _mm_loadu_si128((const __m128i *)(a->xc + b));
        } else
#endif
#if defined(SPARK_AVX2)
        if (type != SPARK_Q8_0) {
            for (int32_t j = 0; j < 4; j++) {
                la[j] = block_lanes_nib(pa + j * bb + off, a->xp + (int64_t)(b + j) * QK);
                lb[j] = block_lanes_nib(pb + j * bb + off, a->xp + (int64_t)(b + j) * QK);
            }
        } else
#endif
        {
            for (int32_t j = 0; j < 4; j++) {
                const spark_w16 wa = load_w16(type, pa + j * bb + off), wb = load_w16(type, pb + j * bb + off);
                la[j] = block_lanes16(wa, q + j * QK);
                lb[j] = block_lanes16(wb, q + j * QK);
            }
        }
        __m128 dwa, mwa = _mm_setzero_ps(), dwb, mwb = _mm_setzero_ps();
        block_scales4(type, pa, bb, &dwa, &mwa);
        block_scales4(type, pb, bb, &dwb, &mwb);
        const __m128i ia = _mm_sub_epi32(hsum4(la[0], la[1], la[2], la[3]), split), ib = _mm_sub_epi32(hsum4(lb[0], lb[1], lb[2], lb[3]), split);
        const __m128 sa = _mm_add_ps(cur_a, block_terms4(type, dwa, mwa, ia, a, b));
        const __m128 sb = _mm_add_ps(cur_b, block_terms4(type, dwb, mwb, ib, a, b));
        cur_a = next_a, next_a = sa, cur_b = next_b, next_b = sb;
    }
    const int32_t odd = (b >> 2) & 1;
    float acc[2][8];
    _mm_storeu_ps(acc[0] + (odd ? 4 : 0), cur_a);
    _mm_storeu_ps(acc[0] + (odd ? 0 : 4), next_a);
    _mm_storeu_ps(acc[1] + (odd ? 4 : 0), cur_b);
    _mm_storeu_ps(acc[1] + (odd ? 0 : 4), next_b);
    for (int32_t r = 0; r < 2; r++) {
        const uint8_t *row = r ? rb : ra;
        float *ac = acc[r];
        for (int32_t c = b; c < nb; c++) {
            const uint8_t *p = row + (int64_t)c * bb;
            ac[c & 7] += block_term(type, p, block_dot(type, p + off, a, c), a, c);
        }
        out[r] = ((ac[0] + ac[4]) + (ac[1] + ac[5])) + ((ac[2] + ac[6]) + (ac[3] + ac[7]));
    }
}
/* dot_pair16_t compiled per type, so its branches on the type fold away. */
static void dot_pair16(int32_t type, const uint8_t *ra, const uint8_t *rb, int32_t nb, const spark_act *a, float *out) {
    switch (type) {
    case SPARK_Q8_0: dot_pair16_t(SPARK_Q8_0, ra, rb, nb, a, out); break;
    case SPARK_Q4_0: dot_pair16_t(SPARK_Q4_0, ra, rb, nb, a, out); break;
    default: dot_pair16_t(SPARK_Q4_1, ra, rb, nb, a, out); break;
    }
}

/* 32 bytes, 0xFF where bit i of x is set (llama.cpp's bytes_from_bits_32). */
static inline __m256i kq_bytes_from_bits(uint32_t x) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)x), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

/* 16 bytes of nibbles -> 32 bytes: the low nibbles, then the high ones (the 32-blocks' element order). */
static inline __m256i kq_nibbles(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
}

/* Bit `j` of each of 32 bytes, as 0 or 1 per byte (a 16-bit shift moves each byte's own bit j to its bit 0). */
static inline __m256i kq_bit(const uint8_t *bytes, int32_t j) {
    return _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)bytes), _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
}

/* The 2-bit fields at bits 2s of 32 bytes. */
static inline __m256i kq_pairs(const uint8_t *bytes, int32_t s) {
    return _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)bytes), _mm_cvtsi32_si128(2 * s)), _mm256_set1_epi8(3));
}

/* TQ1_0's trits: byte * 3^n (mod 256), then the top of times 3 / 256, less 1, for 32 bytes and their powers. */
static inline __m256i kq_trits(__m256i bytes, __m256i pows) {
    const __m256i lo8 = _mm256_set1_epi16(0xFF), three = _mm256_set1_epi16(3);
    const __m256i even = _mm256_and_si256(_mm256_mullo_epi16(_mm256_and_si256(bytes, lo8), _mm256_and_si256(pows, lo8)), lo8);
    const __m256i odd = _mm256_and_si256(_mm256_mullo_epi16(_mm256_srli_epi16(bytes, 8), _mm256_srli_epi16(pows, 8)), lo8);
    const __m256i te = _mm256_srli_epi16(_mm256_mullo_epi16(even, three), 8), to = _mm256_srli_epi16(_mm256_mullo_epi16(odd, three), 8);
    return _mm256_sub_epi8(_mm256_or_si256(te, _mm256_slli_epi16(to, 8)), _mm256_set1_epi8(1));
}

/* kq_unpack_scalar's quants of block b, 32 at once (the types after Q5_0, Q4_K and Q6_K). */
static inline __m256i kq_quants_vec(int32_t type, const uint8_t *row, int32_t b) {
    const int32_t j = b & 7;
    const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kq_iq4_levels));
    if (type == SPARK_Q5_1) {
        const uint8_t *blk = row + (int64_t)b * 24;
        uint32_t qh;
        memcpy(&qh, blk + 4, 4);
        return _mm256_or_si256(kq_nibbles(blk + 8), _mm256_and_si256(kq_bytes_from_bits(qh), _mm256_set1_epi8(0x10)));
    }
    if (type == SPARK_IQ4_NL) return _mm256_shuffle_epi8(levels, kq_nibbles(row + (int64_t)b * 18 + 2));
    const uint8_t *blk = row + (int64_t)(b >> 3) * kq_block_bytes(type);
    switch (type) {
    case SPARK_Q2_K: return kq_pairs(blk + 16 + 32 * (j >> 2), j & 3);
    case SPARK_Q3_K: /* low - 4 where the high bit is clear */
        return _mm256_sub_epi8(kq_pairs(blk + 32 + 32 * (j >> 2), j & 3), _mm256_slli_epi16(_mm256_xor_si256(kq_bit(blk, j), _mm256_set1_epi8(1)), 2));
    case SPARK_Q5_K: {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + 48 + 32 * (j >> 1)));
        const __m256i low = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(0x0F));
        return _mm256_or_si256(low, _mm256_slli_epi16(kq_bit(blk + 16, j), 4));
    }
    case SPARK_IQ4_XS: return _mm256_shuffle_epi8(levels, kq_nibbles(blk + 8 + 16 * j));
    case SPARK_TQ2_0: return _mm256_sub_epi8(kq_pairs(blk + 32 * (j >> 2), j & 3), _mm256_set1_epi8(1));
    default: { /* TQ1_0: blocks 0..4 are trit j of qs[0..32); 5, 6 trits 2j - 10, 2j - 9 of qs[32..48); 7 trit 4 of
                * those, then the four of qh[0..4) */
        static const uint8_t pows[8][32] = {
            {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
            {3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3},
            {9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9},
            {27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27},
            {81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81},
            {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3},
            {9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27},
            {81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 1, 1, 1, 1, 3, 3, 3, 3, 9, 9, 9, 9, 27, 27, 27, 27},
        };
        __m256i bytes;
        if (j < 5) bytes = _mm256_loadu_si256((const __m256i *)blk);
        else if (j < 7) bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + 32)));
        else {
            uint32_t qh;
            memcpy(&qh, blk + 48, 4);
            bytes = _mm256_set_m128i(_mm_set1_epi32((int32_t)qh), _mm_loadu_si128((const __m128i *)(blk + 32)));
        }
        return kq_trits(bytes, _mm256_loadu_si256((const __m256i *)pows[j]));
    }
    }
}

/* Block b (of 32 weights) of a row of the type. */
static inline void kq_unpack(int32_t type, const uint8_t *row, int32_t b, kq_block *o) {
    if (type != SPARK_Q5_0 && type != SPARK_Q4_K && type != SPARK_Q6_K) {
        kq_unpack_scalar(type, row, b, NULL, o);
        o->w = kq_quants_vec(type, row, b);
        return;
    }
    o->mw = 0.0f;
    o->s0 = o->s1 = o->m0 = o->m1 = 0;
    if (type == SPARK_Q5_0) {
        const uint8_t *blk = row + (int64_t)b * 22;
        uint32_t qh;
        memcpy(&qh, blk + 2, 4);
        o->dw = f16_at(blk);
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 6)), m4 = _mm_set1_epi8(0x0F);
        const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
        /* nib | 0xF0 where the fifth bit is clear: as int8 that is nib - 16, and nib + 16 - 16 where it is set. */
        o->w = _mm256_or_si256(nib, _mm256_andnot_si256(kq_bytes_from_bits(qh), _mm256_set1_epi8((char)0xF0)));
        return;
    }
    const int32_t j = b & 7; /* the block within its super-block */
    if (type == SPARK_Q4_K) {
        const uint8_t *blk = row + (int64_t)(b >> 3) * 144, *qs = blk + 16 + 32 * (j >> 1);
        int32_t sc, m;
        k4_scale_min(j, blk + 4, &sc, &m);
        o->dw = f16_at(blk) * (float)sc;
        o->mw = -(f16_at(blk + 2) * (float)m);
        const __m256i raw = _mm256_loadu_si256((const __m256i *)qs);
        o->w = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(0x0F));
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
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
    const __m256i l = _mm256_loadu_si256((const __m256i *)ql), hbits = _mm256_loadu_si256((const __m256i *)qh);
    const __m256i lo = _mm256_and_si256(t >= 2 ? _mm256_srli_epi16(l, 4) : l, m4);
    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * t)), m2), 4);
    o->w = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
}

/* The exact products of an unpacked block with activation block `at`: h0 over weights 0..15, h1 over 16..31. */
static inline void kq_halves(const kq_block *o, const spark_act *a, int64_t at, int32_t *h0, int32_t *h1) {
    __m128i q; /* four int32: two partial sums of the first 16 products, then two of the second 16 */
    if (a->parts == 2) {
        const int16_t *x = a->q16 + at * QK;
        const __m256i l0 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(o->w)), _mm256_loadu_si256((const __m256i *)x));
        const __m256i l1 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(o->w, 1)), _mm256_loadu_si256((const __m256i *)(x + 16)));
        const __m256i p = _mm256_hadd_epi32(l0, l1); /* per 128-bit lane: l0 pairs, l1 pairs */
        q = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    } else {
        /* |w| (unsigned) times x carrying w's sign: |w| <= 32 and |x| <= 127 keep maddubs's pair sums in int16.
         * madd's lanes 0..3 hold weights 0..15, lanes 4..7 weights 16..31. */
        const __m256i x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(a->q8 + at * QK)), o->w);
        const __m256i lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(o->w), x), _mm256_set1_epi16(1));
        q = _mm_hadd_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
    }
    const __m128i r = _mm_hadd_epi32(q, q); /* h0, h1, h0, h1 */
    *h0 = _mm_cvtsi128_si32(r);
    *h1 = _mm_extract_epi32(r, 1);
}

/* Block b's signed quants widened to int16 (w0: weights 0..15, w1: 16..31): Q5_0 widens kq_unpack's 32 int8 (its
 * fifth bits spread once per byte, cheaper on AVX2 than per int16 lane); the K-quants unpack 16 weights at a time. */
static inline void kq_unpack16(int32_t type, const uint8_t *row, int32_t b, __m256i *w0, __m256i *w1) {
    if (type != SPARK_Q4_K && type != SPARK_Q6_K) {
        __m256i q;
        if (type == SPARK_Q5_0) {
            kq_block o;
            kq_unpack(type, row, b, &o);
            q = o.w;
        } else {
            q = kq_quants_vec(type, row, b);
        }
        *w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
        *w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
        return;
    }
    const int32_t j = b & 7; /* the block within its super-block */
    const __m128i m4 = _mm_set1_epi8(0x0F);
    if (type == SPARK_Q4_K) {
        const uint8_t *qs = row + (int64_t)(b >> 3) * 144 + 16 + 32 * (j >> 1);
        const __m128i r0 = _mm_loadu_si128((const __m128i *)qs), r1 = _mm_loadu_si128((const __m128i *)(qs + 16));
        *w0 = _mm256_cvtepu8_epi16(_mm_and_si128(j & 1 ? _mm_srli_epi16(r0, 4) : r0, m4));
        *w1 = _mm256_cvtepu8_epi16(_mm_and_si128(j & 1 ? _mm_srli_epi16(r1, 4) : r1, m4));
        return;
    }
    /* Q6_K, as kq_unpack, 16 weights at a time. */
    const uint8_t *blk = row + (int64_t)(b >> 3) * 210;
    const int32_t h = j >> 2, t = j & 3;
    const uint8_t *ql = blk + 64 * h + 32 * (t & 1), *qh = blk + 128 + 32 * h;
    const __m128i shift = _mm_cvtsi32_si128(2 * t), m2 = _mm_set1_epi8(0x03), bias = _mm_set1_epi8(32);
    __m128i q[2];
    for (int32_t i = 0; i < 2; i++) {
        const __m128i l = _mm_loadu_si128((const __m128i *)(ql + 16 * i)), hb = _mm_loadu_si128((const __m128i *)(qh + 16 * i));
        const __m128i lo = _mm_and_si128(t >= 2 ? _mm_srli_epi16(l, 4) : l, m4);
        const __m128i hi = _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(hb, shift), m2), 4);
        q[i] = _mm_sub_epi8(_mm_or_si128(lo, hi), bias);
    }
    *w0 = _mm256_cvtepi8_epi16(q[0]);
    *w1 = _mm256_cvtepi8_epi16(q[1]);
}

#if defined(SPARK_ZMM)
/* Block b's 32 signed quants as one vector of int16 (AVX-512: a mask register spreads Q5_0's fifth bits). */
static inline __m512i kq_unpack512(int32_t type, const uint8_t *row, int32_t b) {
    if (type == SPARK_Q5_0) {
        const uint8_t *blk = row + (int64_t)b * 22;
        uint32_t qh;
        memcpy(&qh, blk + 2, 4);
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 6)), m4 = _mm_set1_epi8(0x0F);
        const __m512i nib = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4)));
        return _mm512_mask_sub_epi16(nib, (__mmask32)~qh, nib, _mm512_set1_epi16(16)); /* q5 - 16 */
    }
    if (type == SPARK_Q4_K) {
        const int32_t j = b & 7;
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(row + (int64_t)(b >> 3) * 144 + 16 + 32 * (j >> 1)));
        return _mm512_cvtepu8_epi16(_mm256_and_si256(j & 1 ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(0x0F)));
    }
    if (type != SPARK_Q6_K) return _mm512_cvtepi8_epi16(kq_quants_vec(type, row, b));
    kq_block o;
    kq_unpack(type, row, b, &o);
    return _mm512_cvtepi8_epi16(o.w);
}
#endif

/* Eight blocks' weight factors (lane j: block b + j): dw, mw and Q6_K's half scales. */
typedef struct {
    __m256 dw, mw;
    __m256i s0, s1, m0, m1; /* m0, m1: Q2_K's halves' mins */
} kq_factors;

/* Lane p of the split route's factors (kq_split_dot): block kq_lane_block[p] of the super-block. Pairs of lanes that
 * share a 64-bit word are blocks 4 apart, so each word holds one kind of quant (Q4_K: low or high nibbles, Q6_K: one
 * quarter's bits), and the terms' fixed tree over blocks (0 + 4, 1 + 5, ...) is a tree over neighbouring lanes. */
static const int32_t kq_lane_block[8] = {0, 4, 1, 5, 2, 6, 3, 7};

/* Q4_K's and Q5_K's scale unpacking (kq_group_factors) for blocks in natural order [0] or the split route's lanes [1]:
 * shuffles of the 16 bytes d, dmin, q[0..11] (low, top), the bits each keeps, and where a high nibble serves. */
static const int8_t kq_k4_unpack[2][4][16] = {
    {{4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15},
     {-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11},
     {63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0},
     {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15}},
    {{4, 12, 5, 13, 6, 14, 7, 15, 8, 12, 9, 13, 10, 14, 11, 15},
     {-1, 4, -1, 5, -1, 6, -1, 7, -1, 8, -1, 9, -1, 10, -1, 11},
     {63, 15, 63, 15, 63, 15, 63, 15, 63, 0, 63, 0, 63, 0, 63, 0},
     {0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 0, 15, 0, 15, 0, 15}},
};
/* Q6_K's 16 half-block scales split into the first halves' then the second halves', in either order. */
static const int8_t kq_k6_halves[2][16] = {{0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15},
                                           {0, 8, 2, 10, 4, 12, 6, 14, 1, 9, 3, 11, 5, 13, 7, 15}};

/* Q4_K's and Q5_K's factors (kq_group_factors') of `count` (1 or 2) super-blocks at once, whose first 16 bytes d,
 * dmin, q[0..11] are the 128-bit halves of raw: to 8 scales then 8 mins, one byte each (get_scale_min_k4 for all 8
 * sub-blocks in one register: the scalar form and its four inserts made a 1B Q4_K_M decoding step 6 % slower on
 * AVX-512; a decoding step unpacks two rows' at once). Sub-block j < 4: scale q[j] & 63, min q[j + 4] & 63; j >= 4:
 * scale q[j + 4] & 15 | (q[j - 4] >> 6) << 4, min q[j + 4] >> 4 | (q[j] >> 6) << 4. */
static inline void kq_k4_factors(__m256i raw, const int lanes, const int count, kq_factors *f) {
    const int8_t(*u)[16] = kq_k4_unpack[lanes];
    const __m256i low = _mm256_shuffle_epi8(raw, _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)u[0])));
    const __m256i top = _mm256_shuffle_epi8(raw, _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)u[1])));
    const __m256i keep = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)u[2]));
    const __m256i nib = _mm256_and_si256(_mm256_srli_epi16(low, 4), _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)u[3])));
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(top, 2), _mm256_set1_epi8(0x30));
    const __m256i packed = _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(low, keep), nib), high);
    const __m128i first = _mm256_castsi256_si128(raw);
    /* d, dmin of each (exact widenings) */
    const __m256 dm = _mm256_castps128_ps256(_mm_cvtph_ps(count == 2 ? _mm_unpacklo_epi32(first, _mm256_extracti128_si256(raw, 1)) : first));
    for (int32_t i = 0; i < count; i++) {
        const __m128i p = i ? _mm256_extracti128_si256(packed, 1) : _mm256_castsi256_si128(packed);
        const __m256 d = _mm256_permutevar8x32_ps(dm, _mm256_set1_epi32(2 * i)), dmin = _mm256_permutevar8x32_ps(dm, _mm256_set1_epi32(2 * i + 1));
        f[i].s0 = f[i].s1 = f[i].m0 = f[i].m1 = _mm256_setzero_si256();
        f[i].dw = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(p)));
        const __m256 mins = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(p, 8))));
        f[i].mw = _mm256_xor_ps(mins, _mm256_set1_ps(-0.0f)); /* -(dmin * m), exactly */
    }
}

/* Eight blocks' factors, lane j block b + j, or (`lanes`, Q4_K and Q6_K only) block b + kq_lane_block[j]. */
static inline kq_factors kq_group_factors(int32_t type, const uint8_t *row, int32_t b, const int lanes) {
    kq_factors f;
    f.mw = _mm256_setzero_ps();
    f.s0 = f.s1 = f.m0 = f.m1 = _mm256_setzero_si256();
    if (type == SPARK_Q2_K) { /* 16 bytes of scale (low nibble) and min (high), per half: block j's are 2j, 2j + 1 */
        const uint8_t *blk = row + (int64_t)(b >> 3) * 84;
        const __m128i sm = _mm_loadu_si128((const __m128i *)blk), m4 = _mm_set1_epi8(0x0F);
        const __m128i split = _mm_shuffle_epi8(sm, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
        const __m128i sc = _mm_and_si128(split, m4), mn = _mm_and_si128(_mm_srli_epi16(split, 4), m4);
        f.s0 = _mm256_cvtepu8_epi32(sc);
        f.s1 = _mm256_cvtepu8_epi32(_mm_srli_si128(sc, 8));
        f.m0 = _mm256_cvtepu8_epi32(mn);
        f.m1 = _mm256_cvtepu8_epi32(_mm_srli_si128(mn, 8));
        f.dw = _mm256_set1_ps(f16_at(blk + 80));
        f.mw = _mm256_set1_ps(-f16_at(blk + 82));
    } else if (type == SPARK_Q5_0 || type == SPARK_Q5_1 || type == SPARK_IQ4_NL) { /* 8 blocks of 32, each its own d */
        const int32_t bb = kq_block_bytes(type);
        const uint8_t *blk = row + (int64_t)b * bb;
        uint16_t h[8], m[8];
        for (int32_t j = 0; j < 8; j++) memcpy(&h[j], blk + j * bb, 2), memcpy(&m[j], blk + j * bb + 2, 2);
        /* built in registers: a vector load of just-stored scalars would stall on store forwarding */
        f.dw = _mm256_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], (short)h[4], (short)h[5], (short)h[6], (short)h[7]));
        if (type == SPARK_Q5_1) /* Q5_1's m follows its d */
            f.mw = _mm256_cvtph_ps(_mm_setr_epi16((short)m[0], (short)m[1], (short)m[2], (short)m[3], (short)m[4], (short)m[5], (short)m[6], (short)m[7]));
    } else if (type == SPARK_TQ1_0 || type == SPARK_TQ2_0) { /* one d per super-block */
        f.dw = _mm256_set1_ps(f16_at(row + (int64_t)(b >> 3) * kq_block_bytes(type) + (type == SPARK_TQ1_0 ? 52 : 64)));
    } else if (type == SPARK_IQ4_XS) {
        const uint8_t *blk = row + (int64_t)(b >> 3) * 136;
        const int32_t high = blk[2] | blk[3] << 8;
        int32_t ls[8];
        for (int32_t j = 0; j < 8; j++) ls[j] = (((blk[4 + (j >> 1)] >> (4 * (j & 1))) & 0x0F) | ((high >> (2 * j)) & 3) << 4) - 32;
        f.dw = _mm256_mul_ps(_mm256_set1_ps(f16_at(blk)), _mm256_cvtepi32_ps(_mm256_setr_epi32(ls[0], ls[1], ls[2], ls[3], ls[4], ls[5], ls[6], ls[7])));
    } else if (type == SPARK_Q3_K) {
        const uint8_t *blk = row + (int64_t)(b >> 3) * 110;
        int32_t sc[16];
        for (int32_t i = 0; i < 16; i++) sc[i] = k3_scale(blk + 96, i);
        f.s0 = _mm256_setr_epi32(sc[0], sc[2], sc[4], sc[6], sc[8], sc[10], sc[12], sc[14]);
        f.s1 = _mm256_setr_epi32(sc[1], sc[3], sc[5], sc[7], sc[9], sc[11], sc[13], sc[15]);
        f.dw = _mm256_set1_ps(f16_at(blk + 108));
    } else if (type == SPARK_Q4_K || type == SPARK_Q5_K) { /* Q5_K's d, dmin and scales are Q4_K's */
        const uint8_t *blk = row + (int64_t)(b >> 3) * kq_block_bytes(type);
        kq_k4_factors(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)blk)), lanes, 1, &f);
    } else if (type != SPARK_Q6_K) { /* the later types: each block's factors as kq_unpack_scalar finds them */
        float dw[8], mw[8];
        int32_t s0[8], s1[8];
        for (int32_t u = 0; u < 8; u++) {
            kq_block o;
            kq_unpack_scalar(type, row, b + u, NULL, &o);
            dw[u] = o.dw, mw[u] = o.mw, s0[u] = o.s0, s1[u] = o.s1;
        }
        f.dw = _mm256_loadu_ps(dw);
        f.mw = _mm256_loadu_ps(mw);
        f.s0 = _mm256_loadu_si256((const __m256i *)s0);
        f.s1 = _mm256_loadu_si256((const __m256i *)s1);
    } else {
        const uint8_t *blk = row + (int64_t)(b >> 3) * 210;
        const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192)); /* s0, s1 of block 0, then block 1, ... */
        const __m128i split = _mm_shuffle_epi8(sc, _mm_loadu_si128((const __m128i *)kq_k6_halves[lanes]));
        f.s0 = _mm256_cvtepi8_epi32(split);
        f.s1 = _mm256_cvtepi8_epi32(_mm_srli_si128(split, 8));
        f.dw = _mm256_set1_ps(f16_at(blk + 208));
    }
    return f;
}

/* Lane j = the sum of block j's lanes, from the pairwise sums p[i] = hadd(lanes 2i, lanes 2i + 1) (the first
 * step of a horizontal sum, taken as the blocks come; integer adds, exact in any order). */
static inline __m256i kq_hsum8_pairs(const __m256i *p) {
    const __m256i u0 = _mm256_hadd_epi32(p[0], p[1]), u1 = _mm256_hadd_epi32(p[2], p[3]);
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

/* Lane j = the sum of the first 16 int16 activation quants of block at + j (Q2_K's mins meet them). */
static inline __m256i kq_first_halves(const spark_act *a, int64_t at) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i p[4];
    for (int32_t u = 0; u < 8; u += 2) {
        const __m256i l0 = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a->q16 + (at + u) * QK)), ones);
        const __m256i l1 = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a->q16 + (at + u + 1) * QK)), ones);
        p[u / 2] = _mm256_hadd_epi32(l0, l1);
    }
    return kq_hsum8_pairs(p);
}

/* The 8 blocks' terms for one activation row from its block `at`, whose scales d and d * s the lanes meet (in the
 * factors' order): lanes as kq_term computes each. */
static inline __m256 kq_group_terms(int32_t type, const kq_factors *f, __m256i h0, __m256i h1, __m256 d, __m256 ds, const spark_act *a, int64_t at) {
    const __m256 scale = _mm256_mul_ps(f->dw, d);
    if (type == SPARK_Q2_K) { /* the mins against the halves' activation sums x0 and s - x0 */
        const __m256i x0 = kq_first_halves(a, at), x1 = _mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)(a->s + at)), x0);
        const __m256i mins = _mm256_add_epi32(_mm256_mullo_epi32(f->m0, x0), _mm256_mullo_epi32(f->m1, x1));
        const __m256 t = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_mullo_epi32(f->s0, h0), _mm256_mullo_epi32(f->s1, h1))));
        return _mm256_add_ps(t, _mm256_mul_ps(_mm256_mul_ps(f->mw, d), _mm256_cvtepi32_ps(mins)));
    }
    if (kq_half_scaled(type))
        return _mm256_mul_ps(scale, _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(f->s0, h0)), _mm256_cvtepi32_ps(_mm256_mullo_epi32(f->s1, h1))));
    __m256 t = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(h0)); /* h0: the whole block's sum here */
    if (kq_has_min(type)) t = _mm256_add_ps(t, _mm256_mul_ps(f->mw, ds));
    return t;
}

/* Block b's int16 products with activation block b0[t] + b of each row t: 8 int32 lanes into l0[t][i] (weights
 * 0..15) and l1[t][i] (16..31; Q5_0 and Q4_K: the whole block, l0 + l1). */
static inline __attribute__((always_inline)) void kq_block_lanes(const int32_t type, const uint8_t *row, int32_t b, const spark_act *a, const int64_t *b0, const int32_t r_count, __m256i (*l0)[2], __m256i (*l1)[2], int32_t i) {
#if defined(SPARK_ZMM)
    const __m512i w = kq_unpack512(type, row, b); /* 32 x int16 */
    for (int32_t t = 0; t < r_count; t++) {
        const __m512i l = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(a->q16 + (b0[t] + b) * QK));
        l0[t][i] = _mm512_castsi512_si256(l);
        l1[t][i] = _mm512_extracti64x4_epi64(l, 1);
        if (!kq_half_scaled(type)) l1[t][i] = _mm256_add_epi32(l0[t][i], l1[t][i]);
    }
#else
    __m256i w0, w1; /* the block's weights as int16: 0..15, 16..31 */
    kq_unpack16(type, row, b, &w0, &w1);
    for (int32_t t = 0; t < r_count; t++) {
        const int16_t *x = a->q16 + (b0[t] + b) * QK;
#if defined(SPARK_AVX512VNNI)
        const __m256i z = _mm256_setzero_si256();
        l0[t][i] = _mm256_dpwssd_epi32(z, w0, _mm256_loadu_si256((const __m256i *)x));
        l1[t][i] = _mm256_dpwssd_epi32(kq_half_scaled(type) ? z : l0[t][i], w1, _mm256_loadu_si256((const __m256i *)(x + 16)));
#else
        l0[t][i] = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x));
        l1[t][i] = _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 16)));
        if (!kq_half_scaled(type)) l1[t][i] = _mm256_add_epi32(l0[t][i], l1[t][i]);
#endif
    }
#endif
}

#if defined(SPARK_ZMM)
/* Super-block s of a Q4_K or Q6_K row as unsigned quants, one byte each: v[g] = blocks 2g and 2g + 1 (64 bytes),
 * Q4_K's q (0..15) and Q6_K's q + 32 (0..63). Q4_K: 32 bytes per pair of blocks, block 2g's in the low nibbles, 2g + 1's
 * in the high. Q6_K, per half of 128: ql's low nibbles are blocks 0, 1, its high ones 2, 3; qh's bit pairs above. */
static inline void kq_super_bytes(const int32_t type, const uint8_t *row, int32_t s, __m512i *v) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x03);
    if (type == SPARK_Q4_K) {
        const uint8_t *qs = row + (int64_t)s * 144 + 16;
        const __m512i shift = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
        for (int32_t g = 0; g < 4; g++) {
            const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * g)));
            v[g] = _mm512_and_si512(_mm512_srlv_epi64(raw, shift), m4);
        }
        return;
    }
    const uint8_t *blk = row + (int64_t)s * 210;
    for (int32_t n = 0; n < 2; n++) {
        const __m512i ql = _mm512_loadu_si512(blk + 64 * n);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n)));
        const __m512i lo_hi = _mm512_slli_epi64(_mm512_and_si512(_mm512_srlv_epi64(qh, _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2)), m2), 4);
        const __m512i hi_hi = _mm512_slli_epi64(_mm512_and_si512(_mm512_srlv_epi64(qh, _mm512_setr_epi64(4, 4, 4, 4, 6, 6, 6, 6)), m2), 4);
        v[2 * n] = _mm512_or_si512(_mm512_and_si512(ql, m4), lo_hi);
        v[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi64(ql, 4), m4), hi_hi);
    }
}

/* The weight factors of block b (kq_unpack's dw, mw, s0, s1) without its quants. */
static inline void kq_factors_of(const int32_t type, const uint8_t *row, int32_t b, kq_block *o) {
    o->mw = 0.0f;
    o->s0 = o->s1 = 0;
    if (type == SPARK_Q5_0) {
        o->dw = f16_at(row + (int64_t)b * 22);
    } else if (type == SPARK_Q4_K) {
        const uint8_t *blk = row + (int64_t)(b >> 3) * 144;
        int32_t sc, m;
        k4_scale_min(b & 7, blk + 4, &sc, &m);
        o->dw = f16_at(blk) * (float)sc;
        o->mw = -(f16_at(blk + 2) * (float)m);
    } else if (type != SPARK_Q6_K) {
        kq_unpack_scalar(type, row, b, NULL, o);
    } else {
        const uint8_t *blk = row + (int64_t)(b >> 3) * 210;
        const int8_t *sc = (const int8_t *)(blk + 192);
        o->dw = f16_at(blk + 208);
        o->s0 = sc[2 * (b & 7)];
        o->s1 = sc[2 * (b & 7) + 1];
    }
}

/* The token-lane prefill (tokens_in_lanes) for these types with int16 rows: out[r] (16 token lanes) =
 * weight row rows[r] (r < R) times token group g. Per block and row, 16 pair products of broadcast weights with the
 * 16 tokens' elements (pairs 0..7 sum to h0, 8..15 to h1); one lane per token, the terms as kq_term's, lane by lane.
 * Int8 rows of Q4_K and Q6_K take kq_lanes_a8 below. */
#define KQ_AHEAD 4 /* super-blocks of each weight row asked for ahead of the token-lane route's reads */
static inline __attribute__((always_inline)) void kq_tokens_in_lanes(const int32_t type, const uint8_t *const *rows, const int32_t R, int32_t nb, const spark_act *a, int64_t g, __m512 *out) {
    __m512 acc[2][8];
    for (int32_t r = 0; r < R; r++)
        for (int32_t u = 0; u < 8; u++) acc[r][u] = _mm512_setzero_ps();
    for (int32_t b8 = 0; b8 < nb; b8 += 8) {
        const int32_t count = nb - b8 < 8 ? nb - b8 : 8;
        int32_t wide[2][8][QK / 2] __attribute__((aligned(64))); /* int16 pairs: block u's weights 2i, 2i+1 */
        float dw[2][8], mw[2][8];
        int32_t s0[2][8], s1[2][8];
        for (int32_t r = 0; r < R; r++) {
            /* the bytes of 8 blocks of 32 (a super-block), KQ_AHEAD such steps ahead */
            const int64_t sb = kq_block_weights(type) == QK ? 8 * (int64_t)kq_block_bytes(type) : kq_block_bytes(type);
            prefetch_bytes(rows[r] + ((b8 >> 3) + KQ_AHEAD) * sb, sb);
            for (int32_t u = 0; u < count; u++) _mm512_store_si512(wide[r][u], kq_unpack512(type, rows[r], b8 + u));
            if (count == 8) { /* the 8 blocks' factors at once (kq_factors_of's values) */
                const kq_factors f = kq_group_factors(type, rows[r], b8, 0);
                _mm256_storeu_ps(dw[r], f.dw), _mm256_storeu_ps(mw[r], f.mw);
                _mm256_storeu_si256((__m256i *)s0[r], f.s0), _mm256_storeu_si256((__m256i *)s1[r], f.s1);
            } else {
                for (int32_t u = 0; u < count; u++) {
                    kq_block o;
                    kq_factors_of(type, rows[r], b8 + u, &o);
                    dw[r][u] = o.dw, mw[r][u] = o.mw, s0[r][u] = o.s0, s1[r][u] = o.s1;
                }
            }
        }
#pragma GCC unroll 8
        for (int32_t u = 0; u < 8; u++) {
            if (u >= count) break;
            const int64_t at = (g * nb + b8 + u) * SPARK_LANES;
            __m512i h[2][2];
            for (int32_t r = 0; r < R; r++) h[r][0] = h[r][1] = _mm512_setzero_si512();
            const int32_t *xq = a->tq + at * (QK / 2);
#pragma GCC unroll 16
            for (int32_t i = 0; i < QK / 2; i++) {
                const __m512i x = _mm512_load_si512(xq + i * SPARK_LANES);
                for (int32_t r = 0; r < R; r++) h[r][i >> 3] = _mm512_dpwssd_epi32(h[r][i >> 3], x, _mm512_set1_epi32(wide[r][u][i]));
            }
            const __m512 d = _mm512_loadu_ps(a->td + at);
            for (int32_t r = 0; r < R; r++) {
                const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(dw[r][u]), d);
                __m512 t;
                if (kq_half_scaled(type)) {
                    const __m512 lo = _mm512_cvtepi32_ps(_mm512_mullo_epi32(_mm512_set1_epi32(s0[r][u]), h[r][0]));
                    t = _mm512_mul_ps(scale, _mm512_add_ps(lo, _mm512_cvtepi32_ps(_mm512_mullo_epi32(_mm512_set1_epi32(s1[r][u]), h[r][1]))));
                } else {
                    t = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_add_epi32(h[r][0], h[r][1])));
                    if (kq_has_min(type)) t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_set1_ps(mw[r][u]), _mm512_loadu_ps(a->tds + at)));
                }
                acc[r][u] = _mm512_add_ps(acc[r][u], t);
            }
        }
    }
    for (int32_t r = 0; r < R; r++)
        out[r] = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][4]), _mm512_add_ps(acc[r][1], acc[r][5])),
                               _mm512_add_ps(_mm512_add_ps(acc[r][2], acc[r][6]), _mm512_add_ps(acc[r][3], acc[r][7])));
}

/* A prefill's Q4_K and Q6_K rows against int8 activation rows (their default on AVX-512 VNNI): KQ_A8_ROWS weight
 * rows at a time, each unpacked once (kq_a8_unpack) into its blocks' unsigned quants (kq_super_bytes; Q6_K's q + 32)
 * and factors, which every token group then passes, KQ_A8_GROUPS groups at a time. Each loaded activation vector
 * serves 4 rows and each broadcast weight word 2 groups: a route taking 2 rows and 1 group per step loaded 2 words
 * and 2 vectors for every 2 byte products, and unpacked each row again for every group (qgemm_timing: 1.2-1.35x slower
 * over Llama 3.2 1B's Q4_K matrices). Per block, row and group: 8 products of four bytes (0..3 to h0, 4..7 to h1;
 * Q4_K's into one sum), Q6_K's halves less 32 times their activation sums, the terms as kq_term's, lane by lane.
 * Partial sum u of a row and token (blocks u, u + 8, ...) is taken whole, in block order, before the next, so one
 * register per row and group holds it and the bits are every other route's. */
#define KQ_A8_ROWS 4
#define KQ_A8_GROUPS 2

typedef struct {
    uint8_t *q;       /* (KQ_A8_ROWS, nb, 32): each block's unsigned quants */
    float *dw, *mw;   /* (KQ_A8_ROWS, nb): kq_factors_of's */
    int32_t *s0, *s1; /* (KQ_A8_ROWS, nb): Q6_K's half scales */
} kq_a8_rows;

static int64_t kq_a8_bytes(int32_t nb) { return (int64_t)KQ_A8_ROWS * nb * (QK + 16); }

static inline void kq_a8_unpack(const int32_t type, const uint8_t *row, int32_t nb, const kq_a8_rows *w, int32_t r) {
    for (int32_t s = 0; s < nb / 8; s++) {
        const int64_t at = (int64_t)r * nb + 8 * s;
        __m512i v[4];
        kq_super_bytes(type, row, s, v);
        for (int32_t i = 0; i < 4; i++) _mm512_store_si512(w->q + at * QK + 64 * i, v[i]);
        const kq_factors f = kq_group_factors(type, row, 8 * s, 0);
        _mm256_storeu_ps(w->dw + at, f.dw), _mm256_storeu_ps(w->mw + at, f.mw);
        _mm256_storeu_si256((__m256i *)(w->s0 + at), f.s0), _mm256_storeu_si256((__m256i *)(w->s1 + at), f.s1);
    }
}

/* out[r * G + c] (16 token lanes) = unpacked row r times token group g[c]. */
static inline __attribute__((always_inline)) void kq_lanes_a8(const int32_t type, const kq_a8_rows *w, const int32_t G, int32_t nb, const spark_act *a, const int64_t *g, __m512 *out) {
    enum { R = KQ_A8_ROWS };
    const int six = type == SPARK_Q6_K;
    __m512 part[8][R][KQ_A8_GROUPS];
    for (int32_t u = 0; u < 8; u++) {
        __m512 acc[R][KQ_A8_GROUPS];
        for (int32_t r = 0; r < R; r++)
            for (int32_t c = 0; c < G; c++) acc[r][c] = _mm512_setzero_ps();
        for (int32_t b = u; b < nb; b += 8) {
            int64_t at[KQ_A8_GROUPS];
            const int32_t *xq[KQ_A8_GROUPS];
            for (int32_t c = 0; c < G; c++) at[c] = (g[c] * nb + b) * SPARK_LANES, xq[c] = a->tq + at[c] * (QK / 4);
            const int32_t *wq[R];
            for (int32_t r = 0; r < R; r++) wq[r] = (const int32_t *)(w->q + ((int64_t)r * nb + b) * QK);
            __m512i h[R][KQ_A8_GROUPS][2];
            for (int32_t r = 0; r < R; r++)
                for (int32_t c = 0; c < G; c++) h[r][c][0] = h[r][c][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int32_t i = 0; i < QK / 4; i++) {
                __m512i x[KQ_A8_GROUPS];
                for (int32_t c = 0; c < G; c++) {
                    x[c] = _mm512_load_si512(xq[c] + i * SPARK_LANES);
                    __asm__("" : "+v"(x[c])); /* in a register: GCC would fold a load of it into each row's product */
                }
                for (int32_t r = 0; r < R; r++) {
                    const __m512i wv = _mm512_set1_epi32(wq[r][i]);
                    for (int32_t c = 0; c < G; c++) h[r][c][six & (i >> 2)] = _mm512_dpbusd_epi32(h[r][c][six & (i >> 2)], wv, x[c]);
                }
            }
            for (int32_t c = 0; c < G; c++) {
                const __m512 d = _mm512_loadu_ps(a->td + at[c]);
                __m512i x0 = _mm512_setzero_si512(), x1 = x0; /* Q6_K: 32 times each half's activation sum */
                __m512 ds = _mm512_setzero_ps();
                if (six) {
                    const __m512i first = _mm512_loadu_si512(a->th + at[c]);
                    x1 = _mm512_slli_epi32(_mm512_sub_epi32(_mm512_loadu_si512(a->ts + at[c]), first), 5);
                    x0 = _mm512_slli_epi32(first, 5);
                } else {
                    ds = _mm512_loadu_ps(a->tds + at[c]);
                }
                for (int32_t r = 0; r < R; r++) {
                    const int64_t f = (int64_t)r * nb + b;
                    const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(w->dw[f]), d);
                    __m512 t;
                    if (six) {
                        const __m512i h0 = _mm512_sub_epi32(h[r][c][0], x0), h1 = _mm512_sub_epi32(h[r][c][1], x1);
                        const __m512 lo = _mm512_cvtepi32_ps(_mm512_mullo_epi32(_mm512_set1_epi32(w->s0[f]), h0));
                        t = _mm512_mul_ps(scale, _mm512_add_ps(lo, _mm512_cvtepi32_ps(_mm512_mullo_epi32(_mm512_set1_epi32(w->s1[f]), h1))));
                    } else {
                        t = _mm512_add_ps(_mm512_mul_ps(scale, _mm512_cvtepi32_ps(h[r][c][0])), _mm512_mul_ps(_mm512_set1_ps(w->mw[f]), ds));
                    }
                    acc[r][c] = _mm512_add_ps(acc[r][c], t);
                }
            }
        }
        for (int32_t r = 0; r < R; r++)
            for (int32_t c = 0; c < G; c++) part[u][r][c] = acc[r][c];
    }
    for (int32_t r = 0; r < R; r++)
        for (int32_t c = 0; c < G; c++)
            out[r * G + c] = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(part[0][r][c], part[4][r][c]), _mm512_add_ps(part[1][r][c], part[5][r][c])),
                                           _mm512_add_ps(_mm512_add_ps(part[2][r][c], part[6][r][c]), _mm512_add_ps(part[3][r][c], part[7][r][c])));
}

/* Weight rows [begin, end) of a Q4_K or Q6_K matrix times token groups of int8 rows (m tokens): y (M, N) (+ bias).
 * A last short set of rows repeats its last row and a last odd group runs alone: computed, never stored. */
static inline __attribute__((always_inline)) void kq_lanes_gemm_a8_t(const int32_t type, const spark_qmat *w, const spark_act *a, float *y, int32_t m, int32_t begin, int32_t end, const kq_a8_rows *u) {
    const int32_t nb = w->k / QK;
    const int64_t row_bytes = kq_row_bytes(type, w->k), groups = ((int64_t)m + SPARK_LANES - 1) / SPARK_LANES;
    for (int32_t j = begin; j < end; j += KQ_A8_ROWS) {
        const int32_t rc = end - j < KQ_A8_ROWS ? end - j : KQ_A8_ROWS;
        for (int32_t r = 0; r < KQ_A8_ROWS; r++) kq_a8_unpack(type, w->blocks + (int64_t)(j + (r < rc ? r : rc - 1)) * row_bytes, nb, u, r);
        if (j + KQ_A8_ROWS < end) { /* the next rows, on their way to L2 while every group passes these */
            const int32_t next = end - j - KQ_A8_ROWS < KQ_A8_ROWS ? end - j - KQ_A8_ROWS : KQ_A8_ROWS;
            const uint8_t *p = w->blocks + (int64_t)(j + KQ_A8_ROWS) * row_bytes;
            for (int64_t at = 0; at < next * row_bytes; at += 64) __builtin_prefetch(p + at, 0, 2);
        }
        for (int64_t g0 = 0; g0 < groups; g0 += KQ_A8_GROUPS) {
            const int32_t gc = groups - g0 < KQ_A8_GROUPS ? (int32_t)(groups - g0) : KQ_A8_GROUPS;
            const int64_t g[KQ_A8_GROUPS] = {g0, g0 + 1};
            __m512 out[KQ_A8_ROWS * KQ_A8_GROUPS];
            if (gc == KQ_A8_GROUPS) kq_lanes_a8(type, u, KQ_A8_GROUPS, nb, a, g, out);
            else kq_lanes_a8(type, u, 1, nb, a, g, out);
            for (int32_t c = 0; c < gc; c++)
                for (int32_t r = 0; r < rc; r++) lanes_store(out[r * gc + c], w, y, m, g[c], j + r);
        }
    }
}

/* Returns 0, having computed nothing, where the memory for the unpacked rows was not to be had. */
static int32_t kq_lanes_gemm_a8(const spark_qmat *w, const spark_act *a, float *y, int32_t m, int32_t begin, int32_t end) {
    const int32_t nb = w->k / QK;
    uint8_t *mem = aligned_alloc(64, (size_t)((kq_a8_bytes(nb) + 63) / 64 * 64));
    if (mem == NULL) return 0;
    const int64_t cells = (int64_t)KQ_A8_ROWS * nb;
    kq_a8_rows u;
    u.q = mem;
    u.dw = (float *)(mem + cells * QK);
    u.mw = u.dw + cells;
    u.s0 = (int32_t *)(u.mw + cells);
    u.s1 = u.s0 + cells;
    if (w->type == SPARK_Q4_K) kq_lanes_gemm_a8_t(SPARK_Q4_K, w, a, y, m, begin, end, &u);
    else kq_lanes_gemm_a8_t(SPARK_Q6_K, w, a, y, m, begin, end, &u);
    free(mem);
    return 1;
}
#endif

/* out[t] = one weight row times activation rows t < r_count (row t from block b0[t]); each block is unpacked once for
 * all rows, and each row's sum takes the same steps whatever r_count is. */
#define KQ_ROWS 4
static inline __attribute__((always_inline)) void kq_dot_rows_r(int32_t type, const uint8_t *row, int32_t nb, const spark_act *a, const int64_t *b0, const int32_t r_count, float *out) {
    float acc[KQ_ROWS][8] = {{0}};
    int32_t b = 0;
    if (a->parts == 2 && kq_vec_type(type)) {
        __m256 vacc[KQ_ROWS];
        for (int32_t t = 0; t < r_count; t++) vacc[t] = _mm256_setzero_ps();
        for (; b + 8 <= nb; b += 8) {
            /* Per row, the blocks' lanes summed pairwise as they come (few live registers: AVX2 has 16): p1 the
             * whole block's (or Q6_K's second half's), p0 Q6_K's first half's. */
            __m256i p0[KQ_ROWS][4], p1[KQ_ROWS][4];
            for (int32_t j = 0; j < 8; j += 2) {
                __m256i l0[KQ_ROWS][2], l1[KQ_ROWS][2];
                for (int32_t i = 0; i < 2; i++) kq_block_lanes(type, row, b + j + i, a, b0, r_count, l0, l1, i);
                for (int32_t t = 0; t < r_count; t++) {
                    p1[t][j / 2] = _mm256_hadd_epi32(l1[t][0], l1[t][1]);
                    if (kq_half_scaled(type)) p0[t][j / 2] = _mm256_hadd_epi32(l0[t][0], l0[t][1]);
                }
            }
            const kq_factors f = kq_group_factors(type, row, b, 0);
            for (int32_t t = 0; t < r_count; t++) {
                const __m256i h1 = kq_hsum8_pairs(p1[t]);
                const __m256i h0 = kq_half_scaled(type) ? kq_hsum8_pairs(p0[t]) : h1; /* else the block's sum */
                const int64_t at = b0[t] + b;
                vacc[t] = _mm256_add_ps(vacc[t], kq_group_terms(type, &f, h0, h1, _mm256_loadu_ps(a->d + at), _mm256_loadu_ps(a->ds + at), a, at));
            }
        }
        for (int32_t t = 0; t < r_count; t++) _mm256_storeu_ps(acc[t], vacc[t]);
    }
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

#if defined(SPARK_ZMM)
/* The split route's lanes. A super-block's 256 products are four 512-bit byte products (registers g = 0..3), and lane
 * l (0..15) of each holds weights of one half-block: elements 4g..4g+3 of half l >> 3 of block kq_lane_block[l & 7].
 * So the four products add up in place to the 16 half-blocks' sums, without horizontal sums: the weights' bytes move
 * to their lanes (one permute per register), and the activation row's bytes were put in the same order once per step
 * (kq_split_act). */

/* One step's activation row in the split route's order: per super-block s, byte 4 l + i of register g (at
 * 256 s + 64 g + 4 l + i) is element 32 kq_lane_block[l & 7] + 16 (l >> 3) + 4 g + i of the super-block; int8
 * quants (parts 1) as xv, int16 ones as xh and xl (their high and low bytes); xs the half-blocks' sums of q in lane
 * order (Q6_K's quants are read unsigned, q + 32, and take 32 of them off). */
static void kq_split_act(const spark_act *a, int32_t nb) {
    for (int32_t s = 0; s < nb / 8; s++)
        for (int32_t l = 0; l < 16; l++) {
            const int64_t from = 256 * (int64_t)s + 32 * kq_lane_block[l & 7] + 16 * (l >> 3);
            int32_t sum = 0;
            for (int32_t g = 0; g < 4; g++)
                for (int32_t i = 0; i < 4; i++) {
                    const int64_t to = 256 * (int64_t)s + 64 * g + 4 * l + i;
                    const int32_t q = a->parts == 1 ? a->q8[from + 4 * g + i] : a->q16[from + 4 * g + i];
                    sum += q;
                    if (a->parts == 1) a->xv[to] = (int8_t)q;
                    else a->xh[to] = (int8_t)(q >> 8), a->xl[to] = (uint8_t)(q & 0xFF);
                }
            a->xs[16 * s + l] = sum;
        }
}

/* The 8 x 8 bit matrix (one 64-bit word of a GF(2^8) affine product) whose output bit `out` is input bit `in`. */
#define KQ_BIT(out, in) ((long long)((uint64_t)(1u << (in)) << (8 * (7 - (out)))))
#define KQ_NIBBLE(shift) (KQ_BIT(0, shift) | KQ_BIT(1, (shift) + 1) | KQ_BIT(2, (shift) + 2) | KQ_BIT(3, (shift) + 3))
#define KQ_TOP2(t) (KQ_BIT(4, 2 * (t)) | KQ_BIT(5, 2 * (t) + 1)) /* Q6_K's bits 2t, 2t + 1 of qh as bits 4, 5 */

/* Register g of a super-block's unsigned quants in the split route's lanes (Q4_K q, 0..15; Q6_K q + 32, 0..63), from
 * its quant bytes: Q4_K's qs in r[0..2) (blocks 2m, 2m + 1 in the low and high nibbles of qs[32m..32m + 32));
 * Q6_K's ql in r[0..2), qh in r[2] (block 4h + t: the nibbles of ql[64h + 32 (t & 1) + e], high from t = 2, and bits
 * 2t of qh[32h + e]). Each 64-bit word is one kind of quant (kq_lane_block), so one affine product (GFNI) or a
 * shift picks its bits. */
static inline __m512i kq_split_quants(const int32_t type, const __m512i *r, int32_t g) {
    const __m512i gv = _mm512_set1_epi32(g);
#if !defined(__GFNI__)
    const __m512i m4 = _mm512_set1_epi8(0x0F);
#endif
    if (type == SPARK_Q4_K) { /* lane l: dword 8 (b >> 1) + 4 (l >> 3) + g of qs, b = kq_lane_block[l & 7] */
        const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 16, 0, 16, 8, 24, 8, 24, 4, 20, 4, 20, 12, 28, 12, 28), gv);
        const __m512i v = _mm512_permutex2var_epi32(r[0], idx, r[1]);
#if defined(__GFNI__)
        return _mm512_gf2p8affine_epi64_epi8(v, _mm512_set_epi64(KQ_NIBBLE(4), KQ_NIBBLE(0), KQ_NIBBLE(4), KQ_NIBBLE(0), KQ_NIBBLE(4), KQ_NIBBLE(0), KQ_NIBBLE(4), KQ_NIBBLE(0)), 0);
#else
        return _mm512_and_si512(_mm512_srlv_epi64(v, _mm512_setr_epi64(0, 4, 0, 4, 0, 4, 0, 4)), m4);
#endif
    }
    /* Q6_K, lane l: block j = 4h + t = kq_lane_block[l & 7]; dword 16h + 8 (t & 1) + 4 (l >> 3) + g of ql, 8h +
     * 4 (l >> 3) + g of qh */
    const __m512i il = _mm512_add_epi32(_mm512_setr_epi32(0, 16, 8, 24, 0, 16, 8, 24, 4, 20, 12, 28, 4, 20, 12, 28), gv);
    const __m512i ih = _mm512_add_epi32(_mm512_setr_epi32(0, 8, 0, 8, 0, 8, 0, 8, 4, 12, 4, 12, 4, 12, 4, 12), gv);
    const __m512i low = _mm512_permutex2var_epi32(r[0], il, r[1]), high = _mm512_permutexvar_epi32(ih, r[2]);
#if defined(__GFNI__)
    const __m512i lo_m = _mm512_set_epi64(KQ_NIBBLE(4), KQ_NIBBLE(4), KQ_NIBBLE(0), KQ_NIBBLE(0), KQ_NIBBLE(4), KQ_NIBBLE(4), KQ_NIBBLE(0), KQ_NIBBLE(0));
    const __m512i hi_m = _mm512_set_epi64(KQ_TOP2(3), KQ_TOP2(2), KQ_TOP2(1), KQ_TOP2(0), KQ_TOP2(3), KQ_TOP2(2), KQ_TOP2(1), KQ_TOP2(0));
    return _mm512_or_si512(_mm512_gf2p8affine_epi64_epi8(low, lo_m, 0), _mm512_gf2p8affine_epi64_epi8(high, hi_m, 0));
#else
    /* the nibble by a right shift, bits 2t, 2t + 1 to bits 4, 5 by a left rotation of 4 - 2t (mod 64) */
    const __m512i lo = _mm512_and_si512(_mm512_srlv_epi64(low, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)), m4);
    const __m512i hi = _mm512_and_si512(_mm512_rolv_epi64(high, _mm512_setr_epi64(4, 2, 0, 62, 4, 2, 0, 62)), _mm512_set1_epi8(0x30));
    return _mm512_or_si512(lo, hi);
#endif
}

/* Lane l = the exact sum of w x over half-block l of super-block s (the split route's lanes) of a Q4_K or Q6_K row
 * (unsigned quants) and the step's activation row: int8 rows (a8) in one VNNI byte product per register; int16 rows
 * through their split x = 256 xh + xl, two byte products in place of the int16 widening of w. Exact: the high
 * products' lanes are at most 16 * 63 * 128 (times 256 under 2^25), the low ones' 16 * 63 * 255. */
static inline __m512i kq_split_sums(const int32_t type, const uint8_t *row, int32_t s, const spark_act *a, const int a8) {
    __m512i r[3];
    const uint8_t *q = type == SPARK_Q4_K ? row + (int64_t)s * 144 + 16 : row + (int64_t)s * 210;
    r[0] = _mm512_loadu_si512(q), r[1] = _mm512_loadu_si512(q + 64);
    if (type == SPARK_Q6_K) r[2] = _mm512_loadu_si512(q + 128);
    const int64_t e = 256 * (int64_t)s;
    __m512i hi = _mm512_setzero_si512(), lo = _mm512_setzero_si512();
    for (int32_t g = 0; g < 4; g++) {
        const __m512i w = kq_split_quants(type, r, g);
        if (a8) {
            hi = _mm512_dpbusd_epi32(hi, w, _mm512_loadu_si512(a->xv + e + 64 * g));
        } else {
            hi = _mm512_dpbusd_epi32(hi, w, _mm512_loadu_si512(a->xh + e + 64 * g));
            lo = _mm512_dpbusd_epi32(lo, _mm512_loadu_si512(a->xl + e + 64 * g), w);
        }
    }
    return a8 ? hi : _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo);
}

/* Weight rows rows[0..count) (count <= 2), Q4_K or Q6_K, times a decoding step's activation row (block 0 on), int8
 * (a8) or int16 through its split: per super-block, the 16 half-blocks' exact sums (kq_split_sums; Q4_K adds each
 * block's two, Q6_K takes its 32s off), then kq_group_terms' float steps lane by lane with the factors and activation
 * scales in the lanes' block order, and the fixed tree over blocks: the same bits as kq_dot_rows_r. Two rows at once
 * keep two weight streams in flight. */
static inline __attribute__((always_inline)) void kq_split_dot(const int32_t type, const uint8_t *const *rows, const int32_t count, int32_t nb, const spark_act *a, float *out, const int a8) {
    const __m256i order = _mm256_loadu_si256((const __m256i *)kq_lane_block);
    __m256 vacc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int32_t b = 0; b + 8 <= nb; b += 8) {
        const __m256 d = _mm256_permutexvar_ps(order, _mm256_loadu_ps(a->d + b));
        const __m256 ds = _mm256_permutexvar_ps(order, _mm256_loadu_ps(a->ds + b));
        kq_factors f[2];
        if (type == SPARK_Q4_K && count == 2) {
            const int64_t at = (int64_t)(b >> 3) * 144;
            kq_k4_factors(_mm256_loadu2_m128i((const __m128i *)(rows[1] + at), (const __m128i *)(rows[0] + at)), 1, 2, f);
        } else {
            for (int32_t r = 0; r < count; r++) f[r] = kq_group_factors(type, rows[r], b, 1);
        }
        for (int32_t r = 0; r < count; r++) {
            __m512i q = kq_split_sums(type, rows[r], b >> 3, a, a8);
            __m256i h0, h1;
            if (type == SPARK_Q4_K) {
                h0 = h1 = _mm256_add_epi32(_mm512_castsi512_si256(q), _mm512_extracti64x4_epi64(q, 1));
            } else {
                q = _mm512_sub_epi32(q, _mm512_slli_epi32(_mm512_loadu_si512(a->xs + 2 * (int64_t)b), 5));
                h0 = _mm512_castsi512_si256(q);
                h1 = _mm512_extracti64x4_epi64(q, 1);
            }
            vacc[r] = _mm256_add_ps(vacc[r], kq_group_terms(type, &f[r], h0, h1, d, ds, a, b));
        }
    }
    for (int32_t r = 0; r < count; r++) { /* lanes 2i, 2i + 1 hold blocks i, i + 4 */
        float ac[8];
        _mm256_storeu_ps(ac, vacc[r]);
        out[r] = ((ac[0] + ac[1]) + (ac[2] + ac[3])) + ((ac[4] + ac[5]) + (ac[6] + ac[7]));
    }
}

/* kq_split_dot inlined per type and row count (its branches fold away in each copy). */
static void kq_split_dots(const int32_t type, const uint8_t *const *rows, const int32_t count, int32_t nb, const spark_act *a, float *out) {
    const int a8 = a->parts == 1;
    if (type == SPARK_Q4_K) {
        if (a8) count == 2 ? kq_split_dot(SPARK_Q4_K, rows, 2, nb, a, out, 1) : kq_split_dot(SPARK_Q4_K, rows, 1, nb, a, out, 1);
        else count == 2 ? kq_split_dot(SPARK_Q4_K, rows, 2, nb, a, out, 0) : kq_split_dot(SPARK_Q4_K, rows, 1, nb, a, out, 0);
    } else {
        if (a8) count == 2 ? kq_split_dot(SPARK_Q6_K, rows, 2, nb, a, out, 1) : kq_split_dot(SPARK_Q6_K, rows, 1, nb, a, out, 1);
        else count == 2 ? kq_split_dot(SPARK_Q6_K, rows, 2, nb, a, out, 0) : kq_split_dot(SPARK_Q6_K, rows, 1, nb, a, out, 0);
    }
}
#endif

/* Weight rows [begin, end) of w times activation rows [first, m): y (M, N), the K-quants' row routes. */
static void kq_gemm_rows(const spark_qmat *w, const spark_act *a, float *y, int32_t first, int32_t m, int32_t begin, int32_t end) {
    const int32_t nb = w->k / QK, n = w->n;
    const int64_t rb = kq_row_bytes(w->type, w->k);
#if defined(SPARK_ZMM)
    if (m - first == 1 && a->xh != NULL && kq_split_type(w->type) && nb % 8 == 0) { /* split_row's */
        /* row i of the range's first half with row i of its second: two long sequential streams (gemm_rows' Q8_0) */
        const int32_t half = (end - begin) / 2;
        for (int32_t i = 0; i < half; i++) {
            const int32_t ja = begin + i, jb = begin + half + i;
            const uint8_t *rows[2] = {w->blocks + ja * rb, w->blocks + jb * rb};
            float out[2];
            kq_split_dots(w->type, rows, 2, nb, a, out);
            y[(int64_t)first * n + ja] = out[0] + (w->bias ? w->bias[ja] : 0.0f);
            y[(int64_t)first * n + jb] = out[1] + (w->bias ? w->bias[jb] : 0.0f);
        }
        for (int32_t j = begin + 2 * half; j < end; j++) { /* an odd range's last row */
            const uint8_t *rows[1] = {w->blocks + j * rb};
            float out[1];
            kq_split_dots(w->type, rows, 1, nb, a, out);
            y[(int64_t)first * n + j] = out[0] + (w->bias ? w->bias[j] : 0.0f);
        }
        return;
    }
#endif
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

#if defined(SPARK_ZMM)
/* Prefill on AVX-512 with the tokens in the lanes: one 512-bit product adds a pair of weights (broadcast) times the
 * same pair of 16 tokens' activations, so 16 products give 16 tokens' exact block sums, one per lane, with no
 * horizontal sum (a block per vector, the 256-bit route's layout, needs one per block and token); the float terms
 * then run 16 tokens at once, each lane taking block_term's operations in block order. */

/* Token-lane copy of a's m rows of nb blocks (spark_act's tq, td, tds, ts), absent tokens of the last group zero. */
static void lanes_in(const spark_act *a, int32_t m, int32_t nb) {
    const int64_t groups = ((int64_t)m + SPARK_LANES - 1) / SPARK_LANES;
    for (int64_t g = 0; g < groups; g++)
        for (int32_t t = 0; t < SPARK_LANES; t++) {
            const int64_t tok = g * SPARK_LANES + t;
            for (int32_t b = 0; b < nb; b++) {
                const int64_t at = (g * nb + b) * SPARK_LANES + t; /* lane t of block b's scalars */
                int32_t *q = a->tq + (g * nb + b) * (QK / 2) * SPARK_LANES + t;
                if (a->parts == 1) { /* int8: four elements a lane, and the first half's sum */
                    int32_t *q8 = a->tq + (g * nb + b) * (QK / 4) * SPARK_LANES + t, half = 0;
                    const int8_t *x = tok < m ? a->q8 + (tok * nb + b) * QK : NULL;
                    for (int32_t i = 0; i < QK / 4; i++) {
                        if (x != NULL) memcpy(&q8[i * SPARK_LANES], x + 4 * i, 4);
                        else q8[i * SPARK_LANES] = 0;
                    }
                    for (int32_t i = 0; x != NULL && i < QK / 2; i++) half += x[i];
                    a->th[at] = half;
                } else if (tok < m) {
                    const int16_t *x = a->q16 + (tok * nb + b) * QK;
                    for (int32_t i = 0; i < QK / 2; i++) memcpy(&q[i * SPARK_LANES], x + 2 * i, 4);
                } else {
                    for (int32_t i = 0; i < QK / 2; i++) q[i * SPARK_LANES] = 0;
                }
                if (tok < m) {
                    a->td[at] = a->d[tok * nb + b], a->tds[at] = a->ds[tok * nb + b], a->ts[at] = a->s[tok * nb + b];
                } else {
                    a->td[at] = a->tds[at] = 0.0f, a->ts[at] = 0;
                }
            }
        }
}

/* out[r] (16 token lanes) = weight row rows[r] (r < R) times the 16 tokens of group g: per 8 blocks, each row's
 * quants widened to int16 once (wide), then per block 16 products per row into two chains (pairs i even, odd). */
static inline __attribute__((always_inline)) void tokens_in_lanes(const int32_t type, const uint8_t *const *rows, const int32_t R, int32_t nb, const spark_act *a, int64_t g, __m512 *out) {
    const int32_t bb = block_bytes(type), off = type == SPARK_Q4_1 ? 4 : 2;
    __m512 acc[2][8];
    for (int32_t r = 0; r < R; r++)
        for (int32_t u = 0; u < 8; u++) acc[r][u] = _mm512_setzero_ps();
    for (int32_t b8 = 0; b8 < nb; b8 += 8) {
        const int32_t count = nb - b8 < 8 ? nb - b8 : 8;
        int32_t wide[2][8][QK / 2] __attribute__((aligned(64))); /* int16 pairs: block u's weights 2i, 2i+1 */
        for (int32_t r = 0; r < R; r++)
            for (int32_t u = 0; u < count; u++) {
                const spark_w16 w = load_w16(type, rows[r] + (int64_t)(b8 + u) * bb + off);
                _mm512_store_si512(wide[r][u], _mm512_inserti64x4(_mm512_castsi256_si512(w.lo), w.hi, 1));
            }
#pragma GCC unroll 8
        for (int32_t u = 0; u < 8; u++) {
            if (u >= count) break;
            const int64_t at = (g * nb + b8 + u) * SPARK_LANES;
            const int32_t *xq = a->tq + at * (QK / 2);
            __m512i s[2][2];
            for (int32_t r = 0; r < R; r++) s[r][0] = s[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 16
            for (int32_t i = 0; i < QK / 2; i++) {
                const __m512i x = _mm512_load_si512(xq + i * SPARK_LANES);
                for (int32_t r = 0; r < R; r++) s[r][i & 1] = _mm512_dpwssd_epi32(s[r][i & 1], x, _mm512_set1_epi32(wide[r][u][i]));
            }
            const __m512 d = _mm512_loadu_ps(a->td + at);
            for (int32_t r = 0; r < R; r++) {
                const uint8_t *blk = rows[r] + (int64_t)(b8 + u) * bb;
                __m512i isum = _mm512_add_epi32(s[r][0], s[r][1]);
                if (type == SPARK_Q4_0) isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(_mm512_loadu_si512(a->ts + at), 3));
                __m512 t = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(f16_at(blk)), d), _mm512_cvtepi32_ps(isum));
                if (type == SPARK_Q4_1) t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_set1_ps(f16_at(blk + 2)), _mm512_loadu_ps(a->tds + at)));
                acc[r][u] = _mm512_add_ps(acc[r][u], t);
            }
        }
    }
    for (int32_t r = 0; r < R; r++)
        out[r] = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][4]), _mm512_add_ps(acc[r][1], acc[r][5])),
                               _mm512_add_ps(_mm512_add_ps(acc[r][2], acc[r][6]), _mm512_add_ps(acc[r][3], acc[r][7])));
}
#endif

#if defined(SPARK_AVX2)
/* out[i] lane r = in[r] lane i: an 8 x 8 transpose of int32 (pairs of rows interleaved, then quads, then halves). */
static inline void transpose8x32(const __m256i *in, __m256i *out) {
    __m256i t[8], u[8];
    for (int32_t r = 0; r < 8; r += 2) {
        t[r] = _mm256_unpacklo_epi32(in[r], in[r + 1]);     /* rows r, r+1 at lanes 0, 1 | 4, 5 */
        t[r + 1] = _mm256_unpackhi_epi32(in[r], in[r + 1]); /* at lanes 2, 3 | 6, 7 */
    }
    for (int32_t r = 0; r < 8; r += 4)
        for (int32_t h = 0; h < 2; h++) {
            u[r + h] = _mm256_unpacklo_epi64(t[r + h], t[r + h + 2]);     /* rows r..r+3 at lane 0 | 4 (h = 1: 2 | 6) */
            u[r + h + 2] = _mm256_unpackhi_epi64(t[r + h], t[r + h + 2]); /* at lane 1 | 5 (h = 1: 3 | 7) */
        }
    const int32_t at[4] = {0, 2, 1, 3}; /* the u holding lane i | i + 4 */
    for (int32_t i = 0; i < 4; i++) {
        out[i] = _mm256_permute2x128_si256(u[at[i]], u[4 + at[i]], 0x20);
        out[i + 4] = _mm256_permute2x128_si256(u[at[i]], u[4 + at[i]], 0x31);
    }
}

/* Prefill on AVX2 with 8 weight rows in the lanes and the tokens broadcast (Q8_0, Q4_0, Q4_1). With the tokens in
 * the lanes instead (as on AVX-512), each weight pair is broadcast from a register, two shuffles a product on the
 * one shuffle port, which bounded that route; here the 8 rows' blocks are widened and transposed once into wt,
 * (nb, 16, 8) int16 pairs (pair i of row r at [b][i][r]), with dw (nb, 8) their scales and mw (nb, 8) Q4_1's
 * minimums, and each token's pair comes straight from memory as a broadcast load, so a product is a madd and an
 * add. Per row and token: the same integer block sums and the same float operations in the same order as every
 * other route (block terms into 8 partial sums by block mod 8, added in the same tree), so the same bits. wt holds
 * nb * (128 int32 + 16 floats). */
static inline __attribute__((always_inline)) void rows_in_lanes_t(const int32_t type, const spark_qmat *w, const spark_act *a, float *y, int32_t m, int32_t begin, int32_t end, int32_t *wt) {
    const int32_t nb = w->k / QK, n = w->n, bb = block_bytes(type), off = type == SPARK_Q4_1 ? 4 : 2;
    const int64_t row_bytes = (int64_t)nb * bb;
    float *dw = (float *)(wt + (int64_t)nb * (QK / 2) * 8), *mw = dw + (int64_t)nb * 8;
    const int32_t *x32 = (const int32_t *)a->q16; /* token t's pair p at x32[t * nb * 16 + p] */
    for (int32_t j = begin; j < end; j += 8) {
        const int32_t rows = end - j < 8 ? end - j : 8;
        for (int32_t b = 0; b < nb; b++) {
            __m256i lo[8], hi[8]; /* row r's pairs 0-7 and 8-15, transposed below into pair i's 8 rows */
            for (int32_t r = 0; r < 8; r++) {
                float d = 0.0f, mn = 0.0f; /* rows past the range: zero weights, their lanes never stored */
                lo[r] = hi[r] = _mm256_setzero_si256();
                if (r < rows) {
                    const uint8_t *blk = w->blocks + (j + r) * row_bytes + (int64_t)b * bb;
                    const spark_w16 q = load_w16(type, blk + off);
                    lo[r] = q.lo, hi[r] = q.hi;
                    d = f16_at(blk);
                    if (type == SPARK_Q4_1) mn = f16_at(blk + 2);
                }
                dw[(int64_t)b * 8 + r] = d, mw[(int64_t)b * 8 + r] = mn;
            }
            transpose8x32(lo, (__m256i *)(wt + (int64_t)b * (QK / 2) * 8));
            transpose8x32(hi, (__m256i *)(wt + ((int64_t)b * (QK / 2) + 8) * 8));
        }
        for (int32_t t0 = 0; t0 < m; t0 += 8) {
            const int32_t count = m - t0 < 8 ? m - t0 : 8;
            const int32_t *xt[8];
            int64_t at[8]; /* token t's first block in a->d, ds, s */
            for (int32_t t = 0; t < 8; t++) { /* tokens past m repeat token t0: computed, never stored */
                const int64_t tok = t0 + (t < count ? t : 0);
                xt[t] = x32 + tok * nb * (QK / 2);
                at[t] = tok * nb;
            }
            __m256 acc[8][8];
            for (int32_t t = 0; t < 8; t++)
                for (int32_t u = 0; u < 8; u++) acc[t][u] = _mm256_setzero_ps();
            for (int32_t b = 0; b < nb; b++) {
                const int32_t *wb = wt + (int64_t)b * (QK / 2) * 8;
                __m256i s[8];
                for (int32_t t = 0; t < 8; t++) s[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
                for (int32_t i = 0; i < QK / 2; i++) {
                    const __m256i wv = _mm256_load_si256((const __m256i *)(wb + i * 8));
                    for (int32_t t = 0; t < 8; t++) s[t] = _mm256_add_epi32(s[t], _mm256_madd_epi16(wv, _mm256_set1_epi32(xt[t][b * (QK / 2) + i])));
                }
                const __m256 d = _mm256_loadu_ps(dw + (int64_t)b * 8);
                for (int32_t t = 0; t < 8; t++) {
                    __m256i isum = s[t];
                    if (type == SPARK_Q4_0) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(a->s[at[t] + b] << 3));
                    __m256 term = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(a->d[at[t] + b])), _mm256_cvtepi32_ps(isum));
                    if (type == SPARK_Q4_1) term = _mm256_add_ps(term, _mm256_mul_ps(_mm256_loadu_ps(mw + (int64_t)b * 8), _mm256_set1_ps(a->ds[at[t] + b])));
                    acc[t][b & 7] = _mm256_add_ps(acc[t][b & 7], term);
                }
            }
            for (int32_t t = 0; t < count; t++) {
                const __m256 out = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][4]), _mm256_add_ps(acc[t][1], acc[t][5])),
                                                 _mm256_add_ps(_mm256_add_ps(acc[t][2], acc[t][6]), _mm256_add_ps(acc[t][3], acc[t][7])));
                float lanes[8];
                _mm256_storeu_ps(lanes, out);
                float *row = y + (int64_t)(t0 + t) * n + j;
                for (int32_t r = 0; r < rows; r++) row[r] = lanes[r] + (w->bias ? w->bias[j + r] : 0.0f);
            }
        }
    }
}
#endif

#if defined(SPARK_ZMM)
/* Weight rows [begin, end) times every token group: y (M, N) (+ bias), rows two at a time, in tiles of rows whose
 * bytes stay in cache while every token group passes them (a matrix larger than the cache is read from memory
 * once, not once per group). */
#define LANE_TILE_BYTES 65536
static inline __attribute__((always_inline)) void lanes_gemm_t(const int32_t type, const spark_qmat *w, const spark_act *a, float *y, int32_t m, int32_t begin, int32_t end) {
    const int32_t nb = w->k / QK;
    const int64_t row_bytes = kq_type(type) ? kq_row_bytes(type, w->k) : (int64_t)nb * block_bytes(type);
    const int32_t tile = row_bytes >= LANE_TILE_BYTES / 2 ? 2 : (int32_t)(LANE_TILE_BYTES / row_bytes) & ~1;
    for (int32_t first = begin; first < end; first += tile) {
        const int32_t last = end - first < tile ? end : first + tile;
        for (int64_t g = 0; g * SPARK_LANES < m; g++) {
            for (int32_t j = first; j < last; j += 2) {
                const int32_t R = last - j >= 2 ? 2 : 1;
                const uint8_t *rows[2] = {w->blocks + j * row_bytes, w->blocks + (j + 1) * row_bytes};
                __m512 out[2];
                if (kq_type(type)) {
                    if (R == 2) kq_tokens_in_lanes(type, rows, 2, nb, a, g, out);
                    else kq_tokens_in_lanes(type, rows, 1, nb, a, g, out);
                } else if (R == 2) {
                    tokens_in_lanes(type, rows, 2, nb, a, g, out);
                } else {
                    tokens_in_lanes(type, rows, 1, nb, a, g, out);
                }
                for (int32_t r = 0; r < R; r++) lanes_store(out[r], w, y, m, g, j + r);
            }
        }
    }
}
#endif

/* Returns 0, having computed nothing, where the memory for rows_in_lanes_t's copy was not to be had. */
static int32_t lanes_gemm(const spark_qmat *w, const spark_act *a, float *y, int32_t m, int32_t begin, int32_t end) {
#if defined(SPARK_AVX2)
    const int64_t nb = w->k / QK;
    int32_t *wt = aligned_alloc(32, (size_t)(nb * ((QK / 2) * 8 + 16) * 4)); /* a multiple of 32 bytes */
    if (wt == NULL) return 0;
    switch (w->type) {
    case SPARK_Q8_0: rows_in_lanes_t(SPARK_Q8_0, w, a, y, m, begin, end, wt); break;
    case SPARK_Q4_0: rows_in_lanes_t(SPARK_Q4_0, w, a, y, m, begin, end, wt); break;
    default: rows_in_lanes_t(SPARK_Q4_1, w, a, y, m, begin, end, wt); break;
    }
    free(wt);
    return 1;
#else
    if (a->parts == 1) return kq_lanes_gemm_a8(w, a, y, m, begin, end); /* lane_tokens: int8 rows are Q4_K's, Q6_K's */
    switch (w->type) {
    case SPARK_Q8_0: lanes_gemm_t(SPARK_Q8_0, w, a, y, m, begin, end); break;
    case SPARK_Q4_0: lanes_gemm_t(SPARK_Q4_0, w, a, y, m, begin, end); break;
    case SPARK_Q4_1: lanes_gemm_t(SPARK_Q4_1, w, a, y, m, begin, end); break;
    case SPARK_Q5_0: lanes_gemm_t(SPARK_Q5_0, w, a, y, m, begin, end); break;
    case SPARK_Q5_1: lanes_gemm_t(SPARK_Q5_1, w, a, y, m, begin, end); break;
    case SPARK_Q3_K: lanes_gemm_t(SPARK_Q3_K, w, a, y, m, begin, end); break;
    case SPARK_Q4_K: lanes_gemm_t(SPARK_Q4_K, w, a, y, m, begin, end); break;
    case SPARK_Q5_K: lanes_gemm_t(SPARK_Q5_K, w, a, y, m, begin, end); break;
    case SPARK_IQ4_NL: lanes_gemm_t(SPARK_IQ4_NL, w, a, y, m, begin, end); break;
    case SPARK_IQ4_XS: lanes_gemm_t(SPARK_IQ4_XS, w, a, y, m, begin, end); break;
    case SPARK_TQ1_0: lanes_gemm_t(SPARK_TQ1_0, w, a, y, m, begin, end); break;
    case SPARK_TQ2_0: lanes_gemm_t(SPARK_TQ2_0, w, a, y, m, begin, end); break;
    default: lanes_gemm_t(SPARK_Q6_K, w, a, y, m, begin, end); break; /* kq_lane_type: no Q2_K here (lane_tokens) */
    }
    return 1;
#endif
}

#if defined(SPARK_ZMM) && defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__linux__)
#define SPARK_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
/* A verify or prefill of Q8_0, Q4_0 or Q4_1 rows with int16 activations on AMX (Sapphire Rapids and later): the
 * tile unit's byte products give each block's exact int32 sums for 16 weight rows and up to 16 tokens at once, and
 * the float terms then run as tokens_in_lanes' (same operations, same order: the same bits as every other route).
 * An int16 activation x = 256 hi + lo (hi signed, lo unsigned bytes) takes two products per block, one per byte;
 * the weights' 16 rows are gathered into the tile's layout (4 bytes of a row per 32-bit column). A tile's result
 * goes through memory, so each block's terms are added while the next block's products run. Linux asks the kernel
 * for the tile state once (arch_prctl); where it refuses, or the CPU lacks AMX, the lane route runs instead. */
typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

static int amx_available, amx_state; /* what the CPU and OS allow; whether products use it (set by amx_probe) */
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static void amx_probe(void) {
    uint32_t a, b, c, d, lo, hi;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    const int cpu = (d >> 24 & 1) && (d >> 25 & 1); /* AMX-TILE, AMX-INT8 */
    int os = 0;
    if (cpu) {
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        os = (lo & 0x60000) == 0x60000 && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    }
    amx_available = amx_state = cpu && os;
}
static int amx_on(void) {
    pthread_once(&amx_once, amx_probe);
    return amx_state == 1;
}

/* Whether products use the AMX route where it applies (spark_use_amx); `use` 0 switches it off (comparisons), 1
 * back on where the machine has it. Returns the state in effect. */
static int32_t use_amx(int32_t use) {
    pthread_once(&amx_once, amx_probe);
    amx_state = use && amx_available;
    return amx_state;
}
#endif

#if defined(SPARK_AMX)
/* Groups of up to this many tokens take one product a block: their high bytes (offset to unsigned), low bytes and
 * a row of ones as the rows of one tile (2 T + 1 <= 16), whose one result then holds both sums and the weights'. */
#define AMX_ONE_TILE 7

/* a's m int16 rows as the tiles' operands, in the token-lane copy's memory (the same bytes): per group g of 16
 * tokens and block b, 1024 bytes: hi (16 tokens x 32, signed) then lo (unsigned); a last group's tiles have only
 * its tokens' rows (amx_gemm_t configures them so), the rest of its bytes unused. A group of T <= AMX_ONE_TILE
 * tokens: T rows of hi + 128 (unsigned), T of lo, then one of ones. */
static void amx_in(const spark_act *a, int32_t m, int32_t nb) {
    uint8_t *xa = (uint8_t *)a->tq;
    for (int64_t g = 0; g * 16 < m; g++) {
        const int32_t T = m - g * 16 < 16 ? (int32_t)(m - g * 16) : 16, one = T <= AMX_ONE_TILE;
        for (int32_t b = 0; b < nb; b++) {
            uint8_t *hi = xa + (g * nb + b) * 1024, *lo = hi + (one ? 32 * T : 512);
            for (int32_t t = 0; t < T; t++) {
                const __m512i v = _mm512_loadu_si512(a->q16 + ((g * 16 + t) * nb + b) * QK);
                __m256i h = _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8));
                if (one) h = _mm256_xor_si256(h, _mm256_set1_epi8((char)0x80)); /* + 128 */
                _mm256_storeu_si256((__m256i *)(hi + t * 32), h);
                _mm256_storeu_si256((__m256i *)(lo + t * 32), _mm512_cvtepi16_epi8(_mm512_and_si512(v, _mm512_set1_epi16(0xFF))));
            }
            if (one) _mm256_storeu_si256((__m256i *)(lo + T * 32), _mm256_set1_epi8(1));
        }
    }
}

/* Block `blk` of 16 weight rows (byte offsets idx) in the tile layout bt (8 rows of 16 x 4 bytes: element 4i + j of
 * row r at bt[i][4r + j]), and the rows' first four bytes (the fp16 scale, and Q4_1's min) in *dm. */
static inline __attribute__((always_inline)) void amx_weights(const int32_t type, const uint8_t *blk, __m512i idx, uint8_t (*bt)[64], __m512i *dm) {
    *dm = _mm512_i32gather_epi32(idx, blk, 1);
    if (type == SPARK_Q8_0) {
        for (int32_t i = 0; i < 8; i++) _mm512_store_si512(bt[i], _mm512_i32gather_epi32(idx, blk + 2 + 4 * i, 1));
        return;
    }
    const int32_t off = type == SPARK_Q4_1 ? 4 : 2;
    const __m512i mask = _mm512_set1_epi8(0x0F);
    for (int32_t i = 0; i < 4; i++) { /* byte e holds element e (low nibble) and e + 16 (high) */
        const __m512i q = _mm512_i32gather_epi32(idx, blk + off + 4 * i, 1);
        _mm512_store_si512(bt[i], _mm512_and_si512(q, mask));
        _mm512_store_si512(bt[i + 4], _mm512_and_si512(_mm512_srli_epi32(q, 4), mask));
    }
}

/* Tiles: C0, C1 (hi, lo sums) for even blocks, C2, C3 for odd ones; A4, A5 the tokens' hi and lo; B6 the weights.
 * Q8_0's weights are signed, the nibbles unsigned. A small group (AMX_ONE_TILE): C0 or C2 and A4 only. */
#define AMX_PRODUCTS(type, c_hi, c_lo, xb, bt)                                                                          \
    do {                                                                                                               \
        _tile_zero(c_hi);                                                                                              \
        _tile_zero(c_lo);                                                                                              \
        _tile_loadd(4, xb, 32);                                                                                        \
        _tile_loadd(5, (xb) + 512, 32);                                                                                \
        _tile_loadd(6, bt, 64);                                                                                        \
        if (type == SPARK_Q8_0) {                                                                                      \
            _tile_dpbssd(c_hi, 4, 6);                                                                                  \
            _tile_dpbusd(c_lo, 5, 6);                                                                                  \
        } else {                                                                                                       \
            _tile_dpbsud(c_hi, 4, 6);                                                                                  \
            _tile_dpbuud(c_lo, 5, 6);                                                                                  \
        }                                                                                                              \
    } while (0)

/* The same with one tile of 2 T + 1 rows (A4: AMX_ONE_TILE's layout): unsigned activations by either sign of weight. */
#define AMX_PRODUCTS_ONE(type, c, xb, bt)                                                                              \
    do {                                                                                                               \
        _tile_zero(c);                                                                                                 \
        _tile_loadd(4, xb, 32);                                                                                        \
        _tile_loadd(6, bt, 64);                                                                                        \
        if (type == SPARK_Q8_0) _tile_dpbusd(c, 4, 6);                                                                 \
        else _tile_dpbuud(c, 4, 6);                                                                                    \
    } while (0)

/* Block b's terms for tokens [16 g, 16 g + T) into acc[t][b % 8] (16 weight-row lanes): block_term's operations. */
static inline __attribute__((always_inline)) void amx_terms(const int32_t type, const spark_act *a, int64_t g, int32_t nb, int32_t b, int32_t T, const int32_t (*c)[16], __m512i dm, __m512 (*acc)[8], const int one) {
    const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
    const __m512 mw = type == SPARK_Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))) : _mm512_setzero_ps();
    for (int32_t t = 0; t < T; t++) {
        const int64_t at = (g * 16 + t) * nb + b;
        /* x = 256 hi + lo; one tile: hi + 128 in place of hi, so less 2^15 times the weights' sum (its last row) */
        __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c[t]), 8), _mm512_load_si512(c[(one ? T : 16) + t]));
        if (one) isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(_mm512_load_si512(c[2 * T]), 15));
        if (type == SPARK_Q4_0) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(a->s[at] * 8));
        __m512 term = _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a->d[at])), _mm512_cvtepi32_ps(isum));
        if (type == SPARK_Q4_1) term = _mm512_add_ps(term, _mm512_mul_ps(mw, _mm512_set1_ps(a->ds[at])));
        acc[t][b & 7] = _mm512_add_ps(acc[t][b & 7], term);
    }
}

/* Weight rows [begin, end) times every group of 16 tokens: y (M, N) (+ bias). */
static inline __attribute__((always_inline)) void amx_gemm_t(const int32_t type, const spark_qmat *w, const spark_act *a, float *y, int32_t m, int32_t begin, int32_t end) {
    const int32_t nb = w->k / QK, n = w->n, bb = block_bytes(type);
    const int64_t row_bytes = (int64_t)nb * bb;
    const uint8_t *xa = (const uint8_t *)a->tq;
    _Alignas(64) int32_t c[2][32][16]; /* a block's hi sums (rows 0..15), then its lo sums; one tile: rows 0..2T */
    _Alignas(64) uint8_t bt[2][8][64];
    _Alignas(64) __m512 acc[16][8];
    __m512i dm[2];
    for (int64_t g = 0; g * 16 < m; g++) {
        const int32_t T = m - g * 16 < 16 ? (int32_t)(m - g * 16) : 16, one = T <= AMX_ONE_TILE, rows = one ? 2 * T + 1 : T;
        amx_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int32_t i = 0; i < 4; i++) cfg.rows[i] = (uint8_t)rows, cfg.colsb[i] = 64;
        cfg.rows[4] = cfg.rows[5] = (uint8_t)rows, cfg.colsb[4] = cfg.colsb[5] = 32;
        cfg.rows[6] = 8, cfg.colsb[6] = 64;
        _tile_loadconfig(&cfg);
        const uint8_t *xg = xa + g * nb * 1024;
        for (int32_t j = begin; j < end; j += 16) {
            const int32_t R = end - j < 16 ? end - j : 16;
            /* rows past the range repeat its last one (their lanes are not stored) */
            const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            const __m512i idx = _mm512_mullo_epi32(_mm512_min_epi32(lane, _mm512_set1_epi32(R - 1)), _mm512_set1_epi32((int32_t)row_bytes));
            const uint8_t *base = w->blocks + (int64_t)j * row_bytes;
            for (int32_t t = 0; t < T; t++)
                for (int32_t u = 0; u < 8; u++) acc[t][u] = _mm512_setzero_ps();
            amx_weights(type, base, idx, bt[0], &dm[0]);
            /* the next 16 rows' bytes (one contiguous run) asked for in equal parts over this group's blocks: the
             * 16 rows the gathers read at once are more streams than the hardware prefetcher follows */
            const int64_t ahead = j + 16 < end ? ((16 * row_bytes + nb - 1) / nb + 63) & ~(int64_t)63 : 0;
            for (int32_t b = 0; b < nb; b++) {
                if (ahead > 0) prefetch_bytes(base + 16 * row_bytes + b * ahead, ahead);
                const uint8_t *xb = xg + (int64_t)b * 1024;
                if (one && (b & 1)) {
                    AMX_PRODUCTS_ONE(type, 2, xb, bt[1]);
                    _tile_stored(2, c[1][0], 64);
                } else if (one) {
                    AMX_PRODUCTS_ONE(type, 0, xb, bt[0]);
                    _tile_stored(0, c[0][0], 64);
                } else if (b & 1) {
                    AMX_PRODUCTS(type, 2, 3, xb, bt[1]);
                    _tile_stored(2, c[1][0], 64);
                    _tile_stored(3, c[1][16], 64);
                } else {
                    AMX_PRODUCTS(type, 0, 1, xb, bt[0]);
                    _tile_stored(0, c[0][0], 64);
                    _tile_stored(1, c[0][16], 64);
                }
                if (b > 0) amx_terms(type, a, g, nb, b - 1, T, c[(b - 1) & 1], dm[(b - 1) & 1], acc, one);
                if (b + 1 < nb) amx_weights(type, base + (int64_t)(b + 1) * bb, idx, bt[(b + 1) & 1], &dm[(b + 1) & 1]);
            }
            amx_terms(type, a, g, nb, nb - 1, T, c[(nb - 1) & 1], dm[(nb - 1) & 1], acc, one);
            const __mmask16 keep = (__mmask16)((1u << R) - 1);
            for (int32_t t = 0; t < T; t++) {
                __m512 o = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][4]), _mm512_add_ps(acc[t][1], acc[t][5])),
                                         _mm512_add_ps(_mm512_add_ps(acc[t][2], acc[t][6]), _mm512_add_ps(acc[t][3], acc[t][7])));
                if (w->bias) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(keep, w->bias + j));
                _mm512_mask_storeu_ps(y + (g * 16 + t) * n + j, keep, o);
            }
        }
    }
    _tile_release(); /* the thread's tile state is saved on every switch while it holds it */
}

static int32_t amx_gemm(const spark_qmat *w, const spark_act *a, float *y, int32_t m, int32_t begin, int32_t end) {
    switch (w->type) {
    case SPARK_Q8_0: amx_gemm_t(SPARK_Q8_0, w, a, y, m, begin, end); break;
    case SPARK_Q4_0: amx_gemm_t(SPARK_Q4_0, w, a, y, m, begin, end); break;
    default: amx_gemm_t(SPARK_Q4_1, w, a, y, m, begin, end); break;
    }
    return 1;
}
#endif

/* Rows [first, m) of Q8_0, Q4_0 and Q4_1 by the row routes. A decoding step: weight rows in pairs, row i of the
 * range's first half with row i of its second, so the rows stream from memory as two long sequential runs, which
 * the hardware prefetcher follows (adjacent rows in pairs make a short two-stream pattern it does not: it needed a
 * software prefetch and was slower still; tests/engine/backends/native/qgemm_timing.c). More rows: tokens in groups
 * of SPARK_ROWS, and within a group every row of this thread's range: the group's activations stay in L1 while the
 * weight rows stream past once per group; a few (a verify) take the weight rows in pairs too. */
static void q_rows(const spark_qmat *w, const spark_act *a, float *y, int32_t first, int32_t m, int32_t begin, int32_t end) {
    const int32_t nb = w->k / QK, n = w->n;
    const int64_t row_bytes = (int64_t)nb * block_bytes(w->type);
    if (first == 0 && m == 1 && a->parts == 2) {
        const int32_t half = (end - begin) / 2;
        for (int32_t i = 0; i < half; i++) {
            const int32_t ra = begin + i, rb = begin + half + i;
            float out[2];
            dot_pair16(w->type, w->blocks + ra * row_bytes, w->blocks + rb * row_bytes, nb, a, out);
            y[ra] = out[0] + (w->bias ? w->bias[ra] : 0.0f);
            y[rb] = out[1] + (w->bias ? w->bias[rb] : 0.0f);
        }
        begin += 2 * half; /* an odd range's last row: the loop below */
    }
    for (int32_t r = first; r < m; r += SPARK_ROWS) {
        const int32_t rc = m - r < SPARK_ROWS ? m - r : SPARK_ROWS;
        int64_t b0[SPARK_ROWS];
        for (int32_t t = 0; t < rc; t++) b0[t] = (int64_t)(r + t) * nb;
        int32_t j = begin;
        const int32_t half = (end - begin) / 2;
        float oa[4], ob[4];
        if (half > 0 && dot_rows2(w->type, w->blocks + begin * row_bytes, w->blocks + (begin + half) * row_bytes, nb, a, b0, rc, oa, ob)) {
            for (int32_t i = 0; i < half; i++) {
                const int32_t ja = begin + i, jb = begin + half + i;
                if (i > 0) dot_rows2(w->type, w->blocks + ja * row_bytes, w->blocks + jb * row_bytes, nb, a, b0, rc, oa, ob);
                for (int32_t t = 0; t < rc; t++) {
                    y[(int64_t)(r + t) * n + ja] = oa[t] + (w->bias ? w->bias[ja] : 0.0f);
                    y[(int64_t)(r + t) * n + jb] = ob[t] + (w->bias ? w->bias[jb] : 0.0f);
                }
            }
            j = begin + 2 * half; /* an odd range's last row: the loop below */
        }
        for (; j < end; j++) {
            float out[SPARK_ROWS];
            dot_rows(w->type, w->blocks + j * row_bytes, nb, a, b0, rc, out);
            const float bias = w->bias ? w->bias[j] : 0.0f;
            for (int32_t t = 0; t < rc; t++) y[(int64_t)(r + t) * n + j] = out[t] + bias;
        }
    }
}

/* One row's quants for a decoding step's byte-product routes: a Q4_K or Q6_K one's kq_split_dot (AVX-512, int8 or
 * int16 rows, kq_split_act), a Q8_0 one's block_lanes_split (int16 rows as a->xh, xl, xc), or as a->xp for a Q4
 * one's block_lanes_nib (AVX2). */
static void split_row(const spark_act *a, int32_t type, int32_t nb) {
#if defined(SPARK_AVX512VNNI)
#if defined(SPARK_ZMM)
    if (kq_split_type(type) && a->xh != NULL && nb % 8 == 0) {
        kq_split_act(a, nb);
        return;
    }
#endif
    if (type != SPARK_Q8_0 || a->parts != 2 || a->xh == NULL) return;
    for (int32_t b = 0; b < nb; b++) {
        int32_t high = 0;
        for (int32_t i = 0; i < QK; i++) {
            const int16_t q = a->q16[b * QK + i];
            a->xh[b * QK + i] = (int8_t)(q >> 8);
            a->xl[b * QK + i] = (uint8_t)(q & 0xFF);
            high += q >> 8;
        }
        a->xc[b] = high * 32768;
    }
#elif defined(SPARK_AVX2)
    if (type == SPARK_Q8_0 || a->parts != 2 || a->xp == NULL) return;
    for (int32_t b = 0; b < nb; b++) {
        const int16_t *q = a->q16 + b * QK;
        int16_t *p = a->xp + b * QK;
        for (int32_t h = 0; h < 2; h++) /* elements 0..15, then 16..31 */
            for (int32_t i = 0; i < 8; i++) p[16 * h + i] = q[16 * h + 2 * i], p[16 * h + 8 + i] = q[16 * h + 2 * i + 1];
    }
#else
    (void)a, (void)type, (void)nb;
#endif
}

/* The x86 routes of every type over the reference's (spark_blocks.h). */
void spark_register_x86(spark_type_traits *traits, spark_isa_ops *ops) {
#if defined(SPARK_AVX512VNNI)
    ops->isa = "avx512-vnni";
#else
    ops->isa = "avx2";
#endif
    ops->lanes = SPARK_LANES;
    ops->quantize_row = quantize_row;
#if defined(SPARK_ZMM)
    ops->lane_copy_min = SPARK_LANES_MIN_A8;
#endif
#if defined(SPARK_AMX)
    ops->use_amx = use_amx;
    ops->amx_on = amx_on;
#endif
    static const int32_t q[] = {SPARK_Q8_0, SPARK_Q4_0, SPARK_Q4_1};
    for (int32_t i = 0; i < 3; i++) {
        spark_type_traits *t = &traits[q[i]];
        t->rows = q_rows, t->split = split_row;
        t->lanes[1] = lanes_gemm, t->lanes_min[1] = SPARK_LANES_MIN;
#if defined(SPARK_ZMM)
        t->lanes_in = lanes_in;
#endif
#if defined(SPARK_AMX)
        t->amx = amx_gemm, t->amx_in = amx_in;
#endif
    }
    for (int32_t type = 0; type < SPARK_TYPES; type++) {
        if (!kq_type(type)) continue;
        spark_type_traits *t = &traits[type];
        t->rows = kq_gemm_rows, t->split = split_row;
#if defined(SPARK_ZMM)
        if (kq_lane_type(type)) t->lanes[1] = lanes_gemm, t->lanes_min[1] = SPARK_LANES_MIN;
        if (kq_split_type(type)) t->lanes[0] = kq_lanes_gemm_a8, t->lanes_min[0] = SPARK_LANES_MIN_A8;
        t->lanes_in = lanes_in;
#endif
    }
}
#else
/* Not an x86 build with AVX2: the reference runs. */
void spark_register_x86(spark_type_traits *traits, spark_isa_ops *ops) { (void)traits, (void)ops; }
#endif
