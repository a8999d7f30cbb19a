/* MLoT Spark native CPU kernels, part two: the block formats that do not share Q8_0/Q4_0/Q4_1's shape of one fp16
 * scale and 32 plain quants per block: Q5_0 and Q5_1 (a fifth bit per weight), IQ4_NL (16 non-linear levels), the
 * K-quants Q2_K..Q6_K and IQ4_XS (super-blocks of 256 weights with integer sub-block scales) and the ternary TQ1_0,
 * TQ2_0 (BitNet b1.58's weights): every format of the files people download (engine/model/quant.py has the layouts).
 *
 * Included by spark_kernels.c after its block formats (one translation unit, so the row loops inline these and the
 * Arm checker, which includes spark_kernels.c, covers them too); it uses that file's spark_qmat, spark_act, QK,
 * f16_at and the ISA macros. The only hooks in spark_kernels.c are the type dispatch points: spark_block_bytes,
 * lane_tokens and gemm_rows, which hands these types to kq_gemm_rows below.
 *
 * Numerics, as spark_kernels.c's: activations quantized per block of 32 (int16 with one scale, or llama.cpp's int8);
 * each weight block of 32 (a super-block is 8 of them) is unpacked to signed 8-bit quants, its products with the
 * two halves of the activation block (16 weights each: the sub-blocks of Q6_K, Q3_K, Q2_K) are exact int32 sums,
 * and the block's float term is formed in one fixed way and added into partial sum b % 8, then the same fixed
 * tree. Every instruction set reaches the same integers by its own route, so every ISA, the prefill path and the
 * decoding step give the same bits. Per block of 32 (h0, h1 the halves' sums, x0, x1 the halves' activation sums,
 * d_x the activation scale, ds = d_x * (x0 + x1)):
 *   Q5_0, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0: term = (dw * d_x) * (h0 + h1)
 *       dw = d (IQ4_XS: d * (ls - 32)); w = dw * q, q = q5 - 16, a level, or a trit -1..1
 *   Q4_K, Q5_K, Q5_1: term = (dw * d_x) * (h0 + h1) + mw * ds
 *       Q4_K, Q5_K: dw = d * sc, mw = -(dmin * m) (sc, m: 6 bits); Q5_1: dw = d, mw = m; w = dw * q + mw
 *   Q6_K, Q3_K: term = (d * d_x) * ((float)(sc0 * h0) + (float)(sc1 * h1))   w = d * sc * q  (sc: per 16)
 *   Q2_K: term = (d * d_x) * (float)(sc0 * h0 + sc1 * h1) + (-dmin * d_x) * (float)(m0 * x0 + m1 * x1)
 *       w = d * sc * q2 - dmin * m  (sc, m: 4 bits per 16)
 * d * sc and dmin * m are exact in fp32 (an fp16 times an integer of at most 8 bits); |sc * h| <= 128 * 16 * 32 *
 * 32767 < 2^31 is an exact int32 (Q6_K's sum of two might not be, hence two conversions; Q2_K's, at most
 * 2 * 15 * 3 * 16 * 32767, is).
 * On x86 the int16-activation path (the default) takes 8 blocks at once (a K-quant super-block) for Q5_0, Q4_K and
 * Q6_K (kq_vec_type): the 8 blocks' sums fill the 8 lanes of a vector, lane j being partial sum j, so the same
 * float operations run lane by lane. The other formats go block by block on every ISA (kq_unpack_scalar unpacks
 * their quants; the products are vector code).
 * On AVX-512 VNNI, Q4_K and Q6_K matrices take int8 activations by default (engine.backends.native.activation_parts),
 * the rest int16: their quants stay bytes against the int8 rows (64 products an instruction).
 * Routes: AVX-512 with BW and VNNI (one 512-bit product per block; a prefill: spark_kernels.c's token-lane route,
 * kq_tokens_in_lanes below, for kq_vec_type, and kq_lanes_a8 for int8 rows of Q4_K and Q6_K; a decoding step's Q4_K
 * and Q6_K rows: kq_split_dot, byte products against the int8 row, or the int16 row split into its high and low
 * bytes, in lanes that each gather one half-block's weights), AVX2, Arm's NEON dot product, portable C; each checked
 * bit for bit by tests/engine/backends/native/kquant_check.c (the Arm ones under qemu) and the Python tests.
 */


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

/* One unpacked weight block of 32: signed quants and the float factors of its term. */
typedef struct {
#if defined(SPARK_AVX512VNNI) || defined(SPARK_AVX2)
    __m256i w; /* 32 x int8 */
#else
    int8_t w[QK];
#endif
    float dw, mw;   /* Q5_0, IQ4_NL, TQ*: d; Q4_K, Q5_K: d * sc and -(dmin * m); Q5_1: d and m; Q6_K, Q3_K: d;
                       Q2_K: d and -dmin; IQ4_XS: d * (ls - 32) */
    int32_t s0, s1; /* Q6_K, Q3_K, Q2_K: the two halves' scales */
    int32_t m0, m1; /* Q2_K: the two halves' mins */
} kq_block;

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

/* Block b (of 32 weights) of a row of one of the types added after Q5_0, Q4_K and Q6_K: its factors and (w not
 * NULL) its signed quants, one at a time in ggml's layouts (engine/model/quant.py spells them out; x86 unpacks
 * them with kq_quants_vec). Element e of sub-block j is weight p = 32 j + e of its super-block. */
static void kq_unpack_scalar(int32_t type, const uint8_t *row, int32_t b, int8_t *w, kq_block *o) {
    const int32_t j = b & 7;
    o->mw = 0.0f;
    o->s0 = o->s1 = o->m0 = o->m1 = 0;
    if (type == SPARK_Q5_1 || type == SPARK_IQ4_NL) {
        const uint8_t *blk = row + (int64_t)b * kq_block_bytes(type), *qs = blk + (type == SPARK_Q5_1 ? 8 : 2);
        o->dw = f16_at(blk);
        if (type == SPARK_IQ4_NL) {
            if (w != NULL)
                for (int32_t e = 0; e < QK / 2; e++) w[e] = kq_iq4_levels[qs[e] & 0x0F], w[e + 16] = kq_iq4_levels[qs[e] >> 4];
            return;
        }
        uint32_t qh;
        memcpy(&qh, blk + 4, 4);
        o->mw = f16_at(blk + 2);
        for (int32_t e = 0; w != NULL && e < QK / 2; e++) {
            w[e] = (int8_t)((qs[e] & 0x0F) | ((qh >> e) & 1) << 4);
            w[e + 16] = (int8_t)((qs[e] >> 4) | ((qh >> (e + 16)) & 1) << 4);
        }
        return;
    }
    const uint8_t *blk = row + (int64_t)(b >> 3) * kq_block_bytes(type);
    switch (type) {
    case SPARK_Q2_K: { /* scales[16], qs[64] (2 bits: weight 128h + 32s + l at bits 2s of qs[32h + l]), d, dmin */
        const uint8_t *qs = blk + 16 + 32 * (j >> 2);
        o->dw = f16_at(blk + 80);
        o->mw = -f16_at(blk + 82);
        o->s0 = blk[2 * j] & 0x0F, o->m0 = blk[2 * j] >> 4;
        o->s1 = blk[2 * j + 1] & 0x0F, o->m1 = blk[2 * j + 1] >> 4;
        if (w != NULL)
            for (int32_t e = 0; e < QK; e++) w[e] = (int8_t)((qs[e] >> (2 * (j & 3))) & 3);
        return;
    }
    case SPARK_Q3_K: { /* hmask[32] (bit j of byte e: weight 32 j + e), qs[64] as Q2_K's, scales[12], d */
        const uint8_t *qs = blk + 32 + 32 * (j >> 2);
        o->dw = f16_at(blk + 108);
        o->s0 = k3_scale(blk + 96, 2 * j);
        o->s1 = k3_scale(blk + 96, 2 * j + 1);
        if (w != NULL)
            for (int32_t e = 0; e < QK; e++) w[e] = (int8_t)(((qs[e] >> (2 * (j & 3))) & 3) - (((blk[e] >> j) & 1) ? 0 : 4));
        return;
    }
    case SPARK_Q5_K: { /* d, dmin, Q4_K's 12 scale bytes, qh[32] (bit j of byte e), qs[128] as Q4_K's */
        const uint8_t *qs = blk + 48 + 32 * (j >> 1);
        int32_t sc, m;
        k4_scale_min(j, blk + 4, &sc, &m);
        o->dw = f16_at(blk) * (float)sc;
        o->mw = -(f16_at(blk + 2) * (float)m);
        if (w != NULL)
            for (int32_t e = 0; e < QK; e++) w[e] = (int8_t)(((qs[e] >> (4 * (j & 1))) & 0x0F) | ((blk[16 + e] >> j) & 1) << 4);
        return;
    }
    case SPARK_IQ4_XS: { /* d, scales_h (uint16: 2 bits per sub-block), scales_l[4] (a nibble each), qs[128] */
        const uint8_t *qs = blk + 8 + 16 * j;
        const int32_t high = ((blk[2] | blk[3] << 8) >> (2 * j)) & 3, ls = ((blk[4 + (j >> 1)] >> (4 * (j & 1))) & 0x0F) | high << 4;
        o->dw = f16_at(blk) * (float)(ls - 32);
        if (w != NULL)
            for (int32_t e = 0; e < QK / 2; e++) w[e] = kq_iq4_levels[qs[e] & 0x0F], w[e + 16] = kq_iq4_levels[qs[e] >> 4];
        return;
    }
    case SPARK_TQ2_0: { /* qs[64] (2 bits as Q2_K's, value + 1), d */
        const uint8_t *qs = blk + 32 * (j >> 2);
        o->dw = f16_at(blk + 64);
        if (w != NULL)
            for (int32_t e = 0; e < QK; e++) w[e] = (int8_t)(((qs[e] >> (2 * (j & 3))) & 3) - 1);
        return;
    }
    default: { /* TQ1_0: qs[48] then qh[4], five (qs) or four (qh) trits a byte as a base-3 fraction, d */
        o->dw = f16_at(blk + 52);
        static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
        for (int32_t e = 0; w != NULL && e < QK; e++) {
            const int32_t p = 32 * j + e;
            uint8_t byte, mul;
            if (p < 160) byte = blk[p & 31], mul = pow3[p >> 5];                     /* qs[0..32): weights 32 n + l */
            else if (p < 240) byte = blk[32 + ((p - 160) & 15)], mul = pow3[(p - 160) >> 4]; /* qs[32..48) */
            else byte = blk[48 + ((p - 240) & 3)], mul = pow3[(p - 240) >> 2];     /* qh */
            w[e] = (int8_t)((((uint8_t)(byte * mul)) * 3 >> 8) - 1);
        }
        return;
    }
    }
}

#if defined(SPARK_AVX512VNNI) || defined(SPARK_AVX2)
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
#endif

/* The types whose halves of 16 weights have their own scales, and those with a min term (w = scale * q + mw). */
static inline int kq_half_scaled(int32_t type) { return type == SPARK_Q6_K || type == SPARK_Q3_K || type == SPARK_Q2_K; }
static inline int kq_has_min(int32_t type) { return type == SPARK_Q4_K || type == SPARK_Q5_K || type == SPARK_Q5_1; }

/* Block b (of 32 weights) of a row of the type. */
static inline void kq_unpack(int32_t type, const uint8_t *row, int32_t b, kq_block *o) {
    if (type != SPARK_Q5_0 && type != SPARK_Q4_K && type != SPARK_Q6_K) {
#if defined(SPARK_AVX512VNNI) || defined(SPARK_AVX2)
        kq_unpack_scalar(type, row, b, NULL, o);
        o->w = kq_quants_vec(type, row, b);
#else
        kq_unpack_scalar(type, row, b, o->w, o);
#endif
        return;
    }
    o->mw = 0.0f;
    o->s0 = o->s1 = o->m0 = o->m1 = 0;
    if (type == SPARK_Q5_0) {
        const uint8_t *blk = row + (int64_t)b * 22;
        uint32_t qh;
        memcpy(&qh, blk + 2, 4);
        o->dw = f16_at(blk);
#if defined(SPARK_AVX512VNNI) || defined(SPARK_AVX2)
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 6)), m4 = _mm_set1_epi8(0x0F);
        const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
        /* nib | 0xF0 where the fifth bit is clear: as int8 that is nib - 16, and nib + 16 - 16 where it is set. */
        o->w = _mm256_or_si256(nib, _mm256_andnot_si256(kq_bytes_from_bits(qh), _mm256_set1_epi8((char)0xF0)));
#else
        for (int32_t i = 0; i < QK / 2; i++) {
            o->w[i] = (int8_t)(((blk[6 + i] & 0x0F) | (((qh >> i) & 1) << 4)) - 16);
            o->w[i + QK / 2] = (int8_t)(((blk[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16);
        }
#endif
        return;
    }
    const int32_t j = b & 7; /* the block within its super-block */
    if (type == SPARK_Q4_K) {
        const uint8_t *blk = row + (int64_t)(b >> 3) * 144, *qs = blk + 16 + 32 * (j >> 1);
        int32_t sc, m;
        k4_scale_min(j, blk + 4, &sc, &m);
        o->dw = f16_at(blk) * (float)sc;
        o->mw = -(f16_at(blk + 2) * (float)m);
#if defined(SPARK_AVX512VNNI) || defined(SPARK_AVX2)
        const __m256i raw = _mm256_loadu_si256((const __m256i *)qs);
        o->w = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(0x0F));
#else
        for (int32_t i = 0; i < QK; i++) o->w[i] = (int8_t)(j & 1 ? qs[i] >> 4 : qs[i] & 0x0F);
#endif
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
#if defined(SPARK_AVX512VNNI) || defined(SPARK_AVX2)
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
    const __m256i l = _mm256_loadu_si256((const __m256i *)ql), hbits = _mm256_loadu_si256((const __m256i *)qh);
    const __m256i lo = _mm256_and_si256(t >= 2 ? _mm256_srli_epi16(l, 4) : l, m4);
    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * t)), m2), 4);
    o->w = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
#else
    for (int32_t i = 0; i < QK; i++) {
        const int32_t low = t >= 2 ? ql[i] >> 4 : ql[i] & 0x0F;
        o->w[i] = (int8_t)((low | (((qh[i] >> (2 * t)) & 3) << 4)) - 32);
    }
#endif
}

/* The exact products of an unpacked block with activation block `at`: h0 over weights 0..15, h1 over 16..31. */
static inline void kq_halves(const kq_block *o, const spark_act *a, int64_t at, int32_t *h0, int32_t *h1) {
#if defined(SPARK_AVX512VNNI) || defined(SPARK_AVX2)
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
#elif defined(SPARK_NEON_DOT)
    const int8x16_t w0 = vld1q_s8(o->w), w1 = vld1q_s8(o->w + 16);
    if (a->parts == 2) {
        const int16_t *x = a->q16 + at * QK;
        const int16x8_t a0 = vmovl_s8(vget_low_s8(w0)), a1 = vmovl_high_s8(w0);
        const int16x8_t b0 = vmovl_s8(vget_low_s8(w1)), b1 = vmovl_high_s8(w1);
        const int16x8_t x0 = vld1q_s16(x), x1 = vld1q_s16(x + 8), x2 = vld1q_s16(x + 16), x3 = vld1q_s16(x + 24);
        int32x4_t s0 = vmlal_high_s16(vmull_s16(vget_low_s16(a0), vget_low_s16(x0)), a0, x0);
        s0 = vmlal_high_s16(vmlal_s16(s0, vget_low_s16(a1), vget_low_s16(x1)), a1, x1);
        int32x4_t s1 = vmlal_high_s16(vmull_s16(vget_low_s16(b0), vget_low_s16(x2)), b0, x2);
        s1 = vmlal_high_s16(vmlal_s16(s1, vget_low_s16(b1), vget_low_s16(x3)), b1, x3);
        *h0 = vaddvq_s32(s0), *h1 = vaddvq_s32(s1);
    } else {
        const int8_t *x = a->q8 + at * QK;
        *h0 = vaddvq_s32(vdotq_s32(vdupq_n_s32(0), w0, vld1q_s8(x)));
        *h1 = vaddvq_s32(vdotq_s32(vdupq_n_s32(0), w1, vld1q_s8(x + 16)));
    }
#else
    int32_t s0 = 0, s1 = 0;
    if (a->parts == 2) {
        const int16_t *x = a->q16 + at * QK;
        for (int32_t i = 0; i < QK / 2; i++) s0 += (int32_t)o->w[i] * x[i];
        for (int32_t i = QK / 2; i < QK; i++) s1 += (int32_t)o->w[i] * x[i];
    } else {
        const int8_t *x = a->q8 + at * QK;
        for (int32_t i = 0; i < QK / 2; i++) s0 += (int32_t)o->w[i] * x[i];
        for (int32_t i = QK / 2; i < QK; i++) s1 += (int32_t)o->w[i] * x[i];
    }
    *h0 = s0, *h1 = s1;
#endif
}

/* The block's float term (the formulas at the top of this file). */
static inline float kq_term(int32_t type, const kq_block *o, int32_t h0, int32_t h1, const spark_act *a, int64_t at) {
    if (type == SPARK_Q6_K || type == SPARK_Q3_K) return (o->dw * a->d[at]) * ((float)(o->s0 * h0) + (float)(o->s1 * h1));
    if (type == SPARK_Q2_K) {
        int32_t x0 = 0; /* the activation block's first half's sum (the second: its whole sum less this) */
        if (a->parts == 2)
            for (int32_t i = 0; i < QK / 2; i++) x0 += a->q16[at * QK + i];
        else
            for (int32_t i = 0; i < QK / 2; i++) x0 += a->q8[at * QK + i];
        const int32_t mins = o->m0 * x0 + o->m1 * (a->s[at] - x0);
        return (o->dw * a->d[at]) * (float)(o->s0 * h0 + o->s1 * h1) + (o->mw * a->d[at]) * (float)mins;
    }
    float t = (o->dw * a->d[at]) * (float)(h0 + h1);
    if (type == SPARK_Q4_K || type == SPARK_Q5_K || type == SPARK_Q5_1) t += o->mw * a->ds[at];
    return t;
}

#if defined(SPARK_AVX512VNNI) || defined(SPARK_AVX2)
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
#endif

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

/* spark_kernels.c's token-lane prefill (tokens_in_lanes) for these types with int16 rows: out[r] (16 token lanes) =
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
#if defined(SPARK_AVX512VNNI) || defined(SPARK_AVX2)
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
#endif
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

/* The types with a decoding step's split route below (AVX-512): every Q4_K_M and Q6_K file's bulk. */
static inline int kq_split_type(int32_t type) { return type == SPARK_Q4_K || type == SPARK_Q6_K; }

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

/* The types whose rows spark_dequant_rows gives (the tied embedding of most K-quant files: its head is Q6_K). */
static inline int kq_dequant_type(int32_t type) { return type == SPARK_Q4_K || type == SPARK_Q6_K; }

/* Block b (of 32 weights) of a Q4_K or Q6_K row as float32, with engine.model.quant's float operations (_q4_k:
 * (d * sc) * q - dmin * m, here dw * q + mw; _q6_k: (d * sc) * q, sc per 16 weights), from kq_unpack's quants and
 * factors. */
static void kq_dequant_block(int32_t type, const uint8_t *row, int32_t b, float *o) {
    kq_block u;
    kq_unpack(type, row, b, &u);
    int8_t q[QK];
#if defined(SPARK_AVX512VNNI) || defined(SPARK_AVX2)
    _mm256_storeu_si256((__m256i *)q, u.w);
#else
    memcpy(q, u.w, QK);
#endif
    for (int32_t i = 0; i < QK; i++)
        o[i] = type == SPARK_Q4_K ? u.dw * (float)q[i] + u.mw : (u.dw * (float)(i < QK / 2 ? u.s0 : u.s1)) * (float)q[i];
}

/* Weight rows [begin, end) of w times activation rows [first, m): y (M, N), as spark_kernels.c's gemm_rows. */
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
