/* Checks spark_kquants.c's products (Q5_0, Q4_K, Q6_K) bit for bit against a plain C reference that decodes each
 * weight from ggml's layouts one element at a time (exact integer half-block sums, then the float terms in the
 * kernel's documented order). Compiled natively and for Arm (run under qemu) by tests/engine/backends/native/test_native_kquants.py;
 * it prints the ISA, the mismatch count and a hash of every output, which must be equal on every ISA. */
#include "spark_kernels.c"

#include <stdio.h>

static unsigned seed = 1;
static unsigned next(void) { return seed = seed * 1103515245u + 12345u; }

static void put_f16(uint8_t *p, float v) {
    const _Float16 h = (_Float16)v;
    memcpy(p, &h, 2);
}

/* Random blocks of `type` (one block: 32 weights for Q5_0, 256 for a K-quant) with moderate fp16 scales. */
static void random_block(int32_t type, uint8_t *blk) {
    const int32_t bytes = kq_block_bytes(type);
    for (int32_t i = 0; i < bytes; i++) blk[i] = (uint8_t)(next() >> 16);
    const float d = (float)((next() >> 16) % 1000 + 1) / 20000.0f, dmin = (float)((next() >> 16) % 1000) / 50000.0f;
    if (type == SPARK_Q6_K) put_f16(blk + 208, d);
    else put_f16(blk, d);
    if (type == SPARK_Q4_K) put_f16(blk + 2, dmin);
}

static float f16(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

/* Weight e (0..31) of block b of a row: its signed quant, and its 16-weight half's factors. */
static int32_t ref_quant(int32_t type, const uint8_t *row, int32_t b, int32_t e) {
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
        int32_t h[2] = {0, 0}, s = 0;
        for (int32_t i = 0; i < QK; i++) {
            const int32_t q = (int32_t)lrintf(xb[i] * inv);
            s += q;
            h[i / 16] += ref_quant(type, row, b, i) * q;
        }
        float term;
        if (type == SPARK_Q5_0) {
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
    const int32_t types[] = {SPARK_Q5_0, SPARK_Q4_K, SPARK_Q6_K};
    int bad = 0;
    uint64_t hash = 1469598103934665603ull; /* FNV-1a over every output's bits */
    printf("isa %s\n", spark_isa());
    spark_set_threads(2);
    for (int32_t ti = 0; ti < 3; ti++) {
        for (int32_t wi = 0; wi < 3; wi++) {
            /* one super-block; SmolLM2's MLP width; its hidden size (Q5_0 only: 18 blocks, a group of 8 short) */
            const int32_t k = (const int32_t[]){256, 1536, 576}[wi];
            if (k % QK_K && types[ti] != SPARK_Q5_0) continue;
            for (int32_t parts = 1; parts <= 2; parts++) {
                const int32_t type = types[ti], n = 37, m = 20; /* AVX-512: 16 tokens in lanes, 4 by rows */
                const int64_t rb = kq_row_bytes(type, k);
                const int32_t per = type == SPARK_Q5_0 ? QK : QK_K;
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
