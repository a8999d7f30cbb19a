/* Checks the products of spark_kquants.h's formats (Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0) bit for bit against a plain C reference that decodes each
 * weight from ggml's layouts one element at a time (exact integer half-block sums, then the float terms in the
 * kernel's documented order). Compiled natively and for Arm (run under qemu) by tests/engine/backends/native/test_native_kquants.py;
 * it prints the ISA, the mismatch count and a hash of every output, which must be equal on every ISA. */
#include "spark_blocks.h"

#include <stdio.h>

static unsigned seed = 1;
static unsigned next(void) { return seed = seed * 1103515245u + 12345u; }

static void put_f16(uint8_t *p, float v) {
    const _Float16 h = (_Float16)v;
    memcpy(p, &h, 2);
}

/* Where the type's fp16 d lies in its block, and its dmin (or Q5_1's m; -1: none). */
static int32_t d_at(int32_t type) {
    switch (type) {
    case SPARK_Q6_K: return 208;
    case SPARK_Q2_K: return 80;
    case SPARK_Q3_K: return 108;
    case SPARK_TQ1_0: return 52;
    case SPARK_TQ2_0: return 64;
    default: return 0;
    }
}
static int32_t dmin_at(int32_t type) {
    return type == SPARK_Q4_K || type == SPARK_Q5_K || type == SPARK_Q5_1 ? 2 : type == SPARK_Q2_K ? 82 : -1;
}

/* Random blocks of `type` (one block: 32 weights or a super-block of 256) with moderate fp16 scales. */
static void random_block(int32_t type, uint8_t *blk) {
    const int32_t bytes = kq_block_bytes(type);
    for (int32_t i = 0; i < bytes; i++) blk[i] = (uint8_t)(next() >> 16);
    const float d = (float)((next() >> 16) % 1000 + 1) / 20000.0f, dmin = (float)((next() >> 16) % 1000) / 50000.0f;
    put_f16(blk + d_at(type), d);
    if (dmin_at(type) >= 0) put_f16(blk + dmin_at(type), type == SPARK_Q5_1 ? -dmin : dmin);
}

static const int32_t iq4_levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* Weight p (0..255) of a super-block of the newer types, as gguf.quants dequantizes it: its integer quant. */
static int32_t ref_super_quant(int32_t type, const uint8_t *blk, int32_t p) {
    const int32_t two = (p % 128) / 32 * 2; /* 2-bit fields: weight 128 h + 32 s + l at bits 2 s of byte 32 h + l */
    switch (type) {
    case SPARK_Q2_K: return (blk[16 + 32 * (p / 128) + p % 32] >> two) & 3;
    case SPARK_Q3_K: return ((blk[32 + 32 * (p / 128) + p % 32] >> two) & 3) - ((blk[p % 32] >> (p / 32)) & 1 ? 0 : 4);
    case SPARK_TQ2_0: return ((blk[32 * (p / 128) + p % 32] >> two) & 3) - 1;
    case SPARK_Q5_K: return ((blk[48 + 32 * (p / 64) + p % 32] >> (p % 64 < 32 ? 0 : 4)) & 15) | ((blk[16 + p % 32] >> (p / 32)) & 1) << 4;
    case SPARK_IQ4_XS: {
        const int32_t e = p % 32;
        return iq4_levels[(blk[8 + 16 * (p / 32) + e % 16] >> (e < 16 ? 0 : 4)) & 15];
    }
    default: { /* TQ1_0 */
        int32_t byte, pw;
        if (p < 160) byte = blk[p % 32], pw = p / 32;
        else if (p < 240) byte = blk[32 + (p - 160) % 16], pw = (p - 160) / 16;
        else byte = blk[48 + (p - 240) % 4], pw = (p - 240) / 4;
        int32_t mul = 1;
        for (int32_t i = 0; i < pw; i++) mul *= 3;
        return (((byte * mul) & 255) * 3 >> 8) - 1;
    }
    }
}

static float f16(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

/* Weight e (0..31) of block b of a row: its signed quant, and its 16-weight half's factors. */
static int32_t ref_quant(int32_t type, const uint8_t *row, int32_t b, int32_t e) {
    if (type == SPARK_Q5_1) {
        const uint8_t *blk = row + (int64_t)b * 24;
        const uint32_t qh = (uint32_t)blk[4] | (uint32_t)blk[5] << 8 | (uint32_t)blk[6] << 16 | (uint32_t)blk[7] << 24;
        return (e < 16 ? blk[8 + e] & 0x0F : blk[8 + e - 16] >> 4) | (int32_t)((qh >> e) & 1) << 4;
    }
    if (type == SPARK_IQ4_NL) {
        const uint8_t *blk = row + (int64_t)b * 18;
        return iq4_levels[e < 16 ? blk[2 + e] & 0x0F : blk[2 + e - 16] >> 4];
    }
    if (type != SPARK_Q5_0 && type != SPARK_Q4_K && type != SPARK_Q6_K)
        return ref_super_quant(type, row + (int64_t)(b >> 3) * kq_block_bytes(type), (b & 7) * 32 + e);
    if (type == SPARK_Q5_0) {
        const uint8_t *blk = row + (int64_t)b * 22;
        const uint32_t qh = (uint32_t)blk[2] | (uint32_t)blk[3] << 8 | (uint32_t)blk[4] << 16 | (uint32_t)blk[5] << 24;
        const int32_t nib = e < 16 ? blk[6 + e] & 0x0F : blk[6 + e - 16] >> 4;
        return (nib | (int32_t)((qh >> e) & 1) << 4) - 16;
    }
    const int32_t p = (b & 7) * 32 + e; /* the weight's place in its super-block */
    if (type == SPARK_Q4_K) {
        const uint8_t *qs = row + (int64_t)(b >> 3) * 144 + 16;
        const uint8_t byte = qs[32 * (p / 64) + p % 32];
        return p % 64 < 32 ? byte & 0x0F : byte >> 4;
    }
    const uint8_t *blk = row + (int64_t)(b >> 3) * 210;
    const int32_t n = p / 128, r = p % 128, l = r % 32, t = r / 32;
    const uint8_t ql = blk[64 * n + l + 32 * (t & 1)];
    const int32_t low = t >= 2 ? ql >> 4 : ql & 0x0F, high = (blk[128 + 32 * n + l] >> (2 * t)) & 3;
    return (low | high << 4) - 32;
}

static float reference(int32_t type, const uint8_t *row, const float *x, int32_t k, int32_t parts) {
    float acc[8] = {0};
    for (int32_t b = 0; b < k / QK; b++) {
        const float *xb = x + b * QK;
        const float qmax = parts == 2 ? 32767.0f : 127.0f;
        float amax = 0.0f;
        for (int32_t i = 0; i < QK; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
        const float inv = amax == 0.0f ? 0.0f : qmax / amax, d = amax / qmax;
        int32_t h[2] = {0, 0}, s = 0, xs[2] = {0, 0};
        for (int32_t i = 0; i < QK; i++) {
            const int32_t q = (int32_t)lrintf(xb[i] * inv);
            s += q;
            xs[i / 16] += q;
            h[i / 16] += ref_quant(type, row, b, i) * q;
        }
        const int32_t j = b & 7; /* the block of 32 within its super-block */
        const uint8_t *sup = row + (int64_t)(b >> 3) * kq_block_bytes(type), *one = row + (int64_t)b * kq_block_bytes(type);
        float term;
        if (type == SPARK_Q5_1) {
            term = (f16(one) * d) * (float)(h[0] + h[1]) + f16(one + 2) * (d * (float)s);
        } else if (type == SPARK_IQ4_NL) {
            term = (f16(one) * d) * (float)(h[0] + h[1]);
        } else if (type == SPARK_TQ1_0 || type == SPARK_TQ2_0) {
            term = (f16(sup + d_at(type)) * d) * (float)(h[0] + h[1]);
        } else if (type == SPARK_IQ4_XS) {
            const int32_t ls = ((sup[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sup[2] | sup[3] << 8) >> (2 * j)) & 3) << 4;
            term = ((f16(sup) * (float)(ls - 32)) * d) * (float)(h[0] + h[1]);
        } else if (type == SPARK_Q5_K) {
            int32_t sc, m;
            k4_scale_min(j, sup + 4, &sc, &m);
            term = ((f16(sup) * (float)sc) * d) * (float)(h[0] + h[1]) + (-(f16(sup + 2) * (float)m)) * (d * (float)s);
        } else if (type == SPARK_Q3_K) {
            int32_t sc[2];
            for (int32_t u = 0; u < 2; u++) {
                const int32_t i = 2 * j + u; /* sub-block of 16: low 4 bits in byte i % 8, top 2 in byte 8 + i % 4 */
                sc[u] = (((sup[96 + i % 8] >> (4 * (i / 8))) & 15) | ((sup[104 + i % 4] >> (2 * (i / 4))) & 3) << 4) - 32;
            }
            term = (f16(sup + 108) * d) * ((float)(sc[0] * h[0]) + (float)(sc[1] * h[1]));
        } else if (type == SPARK_Q2_K) {
            const uint8_t s0 = sup[2 * j], s1 = sup[2 * j + 1];
            const int32_t mins = (s0 >> 4) * xs[0] + (s1 >> 4) * xs[1];
            term = (f16(sup + 80) * d) * (float)((s0 & 15) * h[0] + (s1 & 15) * h[1]) + (-f16(sup + 82) * d) * (float)mins;
        } else if (type == SPARK_Q5_0) {
            term = (f16(row + (int64_t)b * 22) * d) * (float)(h[0] + h[1]);
        } else if (type == SPARK_Q4_K) {
            const uint8_t *blk = row + (int64_t)(b >> 3) * 144;
            int32_t sc, m;
            k4_scale_min(b & 7, blk + 4, &sc, &m);
            term = ((f16(blk) * (float)sc) * d) * (float)(h[0] + h[1]) + (-(f16(blk + 2) * (float)m)) * (d * (float)s);
        } else {
            const uint8_t *blk = row + (int64_t)(b >> 3) * 210;
            const int8_t *sc = (const int8_t *)(blk + 192) + 2 * (b & 7);
            term = (f16(blk + 208) * d) * ((float)(sc[0] * h[0]) + (float)(sc[1] * h[1]));
        }
        acc[b & 7] += term;
    }
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

int main(void) {
    const int32_t types[] = {SPARK_Q5_0, SPARK_Q4_K, SPARK_Q6_K, SPARK_Q5_1, SPARK_Q2_K, SPARK_Q3_K,
                             SPARK_Q5_K, SPARK_IQ4_NL, SPARK_IQ4_XS, SPARK_TQ1_0, SPARK_TQ2_0};
    int bad = 0;
    uint64_t hash = 1469598103934665603ull; /* FNV-1a over every output's bits */
    printf("isa %s\n", spark_isa());
    spark_set_threads(2);
    for (int32_t ti = 0; ti < (int32_t)(sizeof types / sizeof types[0]); ti++) {
        for (int32_t wi = 0; wi < 3; wi++) {
            /* one super-block; SmolLM2's MLP width; its hidden size (blocks of 32 only: 18, a group of 8 short) */
            const int32_t k = (const int32_t[]){256, 1536, 576}[wi];
            if (k % kq_block_weights(types[ti])) continue;
            for (int32_t parts = 1; parts <= 2; parts++) {
                /* AVX-512: int16 rows 32 tokens in lanes, 4 by rows; int8 rows three groups in lanes, two together, then
                 * the last four tokens alone; n: each thread's rows end in a short set */
                const int32_t type = types[ti], n = 37, m = 36;
                const int64_t rb = kq_row_bytes(type, k);
                const int32_t per = kq_block_weights(type);
                uint8_t *w = malloc((size_t)(n * rb));
                float *bias = malloc(4 * n), *x = malloc(4 * (size_t)m * k), *y = malloc(4 * (size_t)m * n);
                void *scratch = malloc((size_t)spark_act_bytes(k, m));
                for (int32_t j = 0; j < n * (k / per); j++) random_block(type, w + (int64_t)j * kq_block_bytes(type));
                for (int32_t j = 0; j < n; j++) bias[j] = 0.5f * (float)j;
                for (int32_t i = 0; i < m * k; i++) x[i] = (float)((int)((next() >> 16) % 2001u) - 1000) / 100.0f;
                for (int32_t i = 0; i < k; i++) x[3 * k + i] = 0.0f; /* an all-zero row: just the bias */
                for (int32_t i = 0; i < 32; i++) x[4 * k + i] *= 1e4f; /* an outlier block */
                spark_qmat mat = {w, bias, n, k, type, parts};
                spark_qgemm(&mat, x, m, y, scratch);
                for (int32_t r = 0; r < m; r++) {
                    for (int32_t j = 0; j < n; j++) {
                        const float got = y[r * n + j];
                        if (reference(type, w + j * rb, x + (int64_t)r * k, k, parts) + bias[j] != got) bad++;
                        uint32_t bits;
                        memcpy(&bits, &got, 4);
                        hash = (hash ^ bits) * 1099511628211ull;
                    }
                    float one[37];
                    spark_qgemm(&mat, x + (int64_t)r * k, 1, one, scratch); /* one row (decode) = its prefill row */
                    if (memcmp(one, y + r * n, sizeof one) != 0) bad++;
                }
                free(w), free(bias), free(x), free(y), free(scratch);
            }
        }
    }
    spark_set_threads(1);
    printf("%d mismatches\n", bad);
    printf("hash %016llx\n", (unsigned long long)hash);
    return bad != 0;
}
