/* MLoT Spark native CPU kernels: the block formats that do not share Q8_0/Q4_0/Q4_1's shape of one fp16
 * scale and 32 plain quants per block: Q5_0 and Q5_1 (a fifth bit per weight), IQ4_NL (16 non-linear levels), the
 * K-quants Q2_K..Q6_K and IQ4_XS (super-blocks of 256 weights with integer sub-block scales) and the ternary TQ1_0,
 * TQ2_0 (BitNet b1.58's weights): every format of the files people download (engine/model/quant.py has the layouts).
 *
 * This header holds what every family's routes share: the layouts' unpacking one weight at a time and the float
 * terms; the routes are per family (x86/quants.c; ref/rows.h for the reference and NEON), looked up per type in
 * the table spark_kernels.c fills at load.
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
 * kq_tokens_in_lanes in x86/quants.c, for kq_vec_type, and kq_lanes_a8 for int8 rows of Q4_K and Q6_K; a decoding step's Q4_K
 * and Q6_K rows: kq_split_dot, byte products against the int8 row, or the int16 row split into its high and low
 * bytes, in lanes that each gather one half-block's weights), AVX2, Arm's NEON dot product, portable C; each checked
 * bit for bit by tests/engine/backends/native/kquant_check.c (the Arm ones under qemu) and the Python tests.
 */
/* The formats' unpacking and float terms every family's routes share. The including file defines kq_block first
 * (one block of 32: its signed quants in the family's own form, w, then the factors dw, mw, s0, s1, m0, m1), as
 * each family holds the quants its own way. */
#ifndef SPARK_KQUANTS_H
#define SPARK_KQUANTS_H

#include "spark_blocks.h"

/* Block b (of 32 weights) of a row of one of the types added after Q5_0, Q4_K and Q6_K: its factors and (w not
 * NULL) its signed quants, one at a time in ggml's layouts (engine/model/quant.py spells them out; x86 unpacks
 * them with kq_quants_vec). Element e of sub-block j is weight p = 32 j + e of its super-block. */
static inline void kq_unpack_scalar(int32_t type, const uint8_t *row, int32_t b, int8_t *w, kq_block *o) {
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

#endif
