/* Checks spark_kernels.c's block products bit for bit against a plain C reference (exact integer block sums, the
 * float terms in the kernel's documented order), and its decoding attention within float rounding of a double one, compiled for Arm and run under qemu by tests/engine/backends/native/test_native.py
 * (Apple Silicon's NEON dot-product kernel, off a Mac); the same file compiled natively checks the checker. */
#include "spark_kernels.c"

#include <stdio.h>

static unsigned seed = 1;
static unsigned next(void) { return seed = seed * 1103515245u + 12345u; }

/* A random block of `type`: an fp16 scale (and min) of moderate size, random quants. */
static void random_block(int32_t type, uint8_t *blk) {
    const _Float16 d = (_Float16)((float)((next() >> 16) % 1000 + 1) / 20000.0f);
    const _Float16 m = (_Float16)(-(float)((next() >> 16) % 1000) / 1000.0f);
    memcpy(blk, &d, 2);
    if (type == SPARK_Q4_1) memcpy(blk + 2, &m, 2);
    for (int32_t i = type == SPARK_Q4_1 ? 4 : 2; i < block_bytes(type); i++) blk[i] = (uint8_t)(next() >> 16);
}

/* The reference: quantize x per block as the kernel documents, then sum the terms in its order. */
static float reference(int32_t type, const uint8_t *row, const float *x, int32_t k, int32_t parts) {
    float acc[8] = {0};
    for (int32_t b = 0; b < k / QK; b++) {
        const uint8_t *blk = row + (int64_t)b * block_bytes(type);
        float xb[QK], dw, mw = 0.0f, term, ds;
        memcpy(xb, x + b * QK, sizeof xb);
        _Float16 h;
        memcpy(&h, blk, 2);
        dw = (float)h;
        if (type == SPARK_Q4_1) {
            memcpy(&h, blk + 2, 2);
            mw = (float)h;
        }
        /* One scale per block: int8 (parts 1, qmax 127) or int16 (parts 2, qmax 32767). */
        const float qmax = parts == 2 ? 32767.0f : 127.0f;
        float amax = 0.0f;
        for (int32_t i = 0; i < QK; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
        const float inv = amax == 0.0f ? 0.0f : qmax / amax, d = amax / qmax;
        int32_t q[QK], isum = 0, s = 0;
        for (int32_t i = 0; i < QK; i++) {
            q[i] = (int32_t)lrintf(xb[i] * inv);
            s += q[i];
        }
        for (int32_t i = 0; i < QK; i++) {
            int32_t w;
            if (type == SPARK_Q8_0) w = (int8_t)blk[2 + i];
            else {
                const uint8_t byte = blk[(type == SPARK_Q4_1 ? 4 : 2) + i % 16];
                w = i < 16 ? (byte & 0x0F) : (byte >> 4);
            }
            isum += w * q[i];
        }
        if (type == SPARK_Q4_0) isum -= 8 * s;
        term = (dw * d) * (float)isum;
        ds = d * (float)s;
        if (type == SPARK_Q4_1) term += mw * ds;
        acc[b & 7] += term;
    }
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* The decoding attention (spark_attention.c) against a plain double-precision one over the same fp16 table: keys
 * rotated at their positions, ranks below the split scored by the other query; returns the mismatches (error above
 * float rounding). Widths on both sides of the tile (16) and chunk (64) edges, head dims 64 and 40 (vector tails). */
static int attention_mismatches(void) {
    int bad = 0;
    const int32_t widths[] = {1, 15, 17, 64, 65, 300}, dims[] = {64, 40}, h = 6, hkv = 2, cap = 320, npos = 400;
    for (int32_t di = 0; di < 2; di++) {
        const int32_t d = dims[di], hd = d / 2;
        _Float16 *k = malloc(2 * (size_t)hkv * cap * d), *v = malloc(2 * (size_t)hkv * cap * d);
        float *cs = malloc(4 * (size_t)npos * d), *sn = malloc(4 * (size_t)npos * d), *qn = malloc(4 * (size_t)h * d),
              *qp = malloc(4 * (size_t)h * d), *out = malloc(4 * (size_t)h * d);
        for (int32_t i = 0; i < hkv * cap * d; i++) {
            k[i] = (_Float16)((float)((int)((next() >> 16) % 2001u) - 1000) / 400.0f);
            v[i] = (_Float16)((float)((int)((next() >> 16) % 2001u) - 1000) / 800.0f);
        }
        for (int32_t p = 0; p < npos; p++)
            for (int32_t i = 0; i < hd; i++) {
                const double ang = p * pow(10000.0, -2.0 * i / d);
                cs[p * d + i] = cs[p * d + i + hd] = (float)cos(ang);
                sn[p * d + i] = -(float)sin(ang), sn[p * d + i + hd] = (float)sin(ang);
            }
        for (int32_t i = 0; i < h * d; i++) {
            qn[i] = (float)((int)((next() >> 16) % 2001u) - 1000) / 500.0f;
            qp[i] = (float)((int)((next() >> 16) % 2001u) - 1000) / 500.0f;
        }
        for (int32_t wi = 0; wi < 6; wi++) {
            const int32_t width = widths[wi], split = width / 3;
            int64_t slots[300], positions[300];
            for (int32_t r = 0; r < width; r++) slots[r] = r + r / 7, positions[r] = (int64_t)((next() >> 16) % npos);
            float *partial = malloc(4 * (size_t)spark_attend_floats(h, d, width));
            spark_attn a = {k, v, cap, 1, slots, positions, cs, sn, width, split, qn, qp, h, hkv, d, 1.0f / sqrtf((float)d), 0, partial, out};
            spark_attend(&a);
            for (int32_t hh = 0; hh < h; hh++) {
                const int32_t kh = hh / (h / hkv);
                double sc[300], mx = -1e300, total = 0.0;
                for (int32_t r = 0; r < width; r++) {
                    const _Float16 *kr = k + ((int64_t)kh * cap + slots[r]) * d;
                    const float *c = cs + positions[r] * d, *s = sn + positions[r] * d, *q = (r < split ? qp : qn) + hh * d;
                    double dot = 0.0;
                    for (int32_t i = 0; i < d; i++) dot += (double)q[i] * ((double)kr[i] * c[i] + (double)kr[(i + hd) % d] * s[i]);
                    sc[r] = dot / sqrt((double)d);
                    mx = sc[r] > mx ? sc[r] : mx;
                }
                for (int32_t r = 0; r < width; r++) total += exp(sc[r] - mx);
                for (int32_t i = 0; i < d; i++) {
                    double want = 0.0;
                    for (int32_t r = 0; r < width; r++) want += exp(sc[r] - mx) / total * (double)v[((int64_t)kh * cap + slots[r]) * d + i];
                    if (fabs(want - out[hh * d + i]) > 2e-5 + 1e-4 * fabs(want)) bad++;
                }
            }
            free(partial);
        }
        free(k), free(v), free(cs), free(sn), free(qn), free(qp), free(out);
    }
    return bad;
}

int main(void) {
    const int32_t widths[] = {32, 128, 160, 576}, types[] = {SPARK_Q8_0, SPARK_Q4_0, SPARK_Q4_1};
    int bad = 0;
    printf("isa %s\n", spark_isa());
    spark_set_threads(2);
    for (int32_t ti = 0; ti < 3; ti++) {
        for (int32_t wi = 0; wi < 4; wi++) {
            for (int32_t parts = 1; parts <= 2; parts++) {
                const int32_t type = types[ti], k = widths[wi], n = 37, m = 20; /* AVX-512: 16 tokens in lanes, 4 by rows */
                uint8_t *w = malloc((size_t)n * (k / QK) * block_bytes(type));
                float *bias = malloc(4 * n), *x = malloc(4 * (size_t)m * k), *y = malloc(4 * (size_t)m * n);
                void *scratch = malloc((size_t)spark_act_bytes(k, m));
                for (int32_t j = 0; j < n * (k / QK); j++) random_block(type, w + (int64_t)j * block_bytes(type));
                for (int32_t j = 0; j < n; j++) bias[j] = 0.5f * (float)j;
                for (int32_t i = 0; i < m * k; i++) x[i] = (float)((int)((next() >> 16) % 2001u) - 1000) / 100.0f;
                for (int32_t i = 0; i < k; i++) x[3 * k + i] = 0.0f; /* an all-zero row: just the bias */
                spark_qmat mat = {w, bias, n, k, type, parts};
                spark_qgemm(&mat, x, m, y, scratch);
                for (int32_t r = 0; r < m; r++) {
                    for (int32_t j = 0; j < n; j++) {
                        const float want = reference(type, w + (int64_t)j * (k / QK) * block_bytes(type), x + (int64_t)r * k, k, parts) + bias[j];
                        if (want != y[r * n + j]) bad++;
                    }
                    float one[37];
                    spark_qgemm(&mat, x + (int64_t)r * k, 1, one, scratch); /* one row (decode) = its prefill row */
                    if (memcmp(one, y + r * n, sizeof one) != 0) bad++;
                }
                free(w), free(bias), free(x), free(y), free(scratch);
            }
        }
    }
    bad += attention_mismatches(); /* on two threads: chunks merged by their maxima */
    spark_set_threads(1);
    bad += attention_mismatches();
    printf("%d mismatches\n", bad);
    return bad != 0;
}
