/* Checks the kernels' block products of Q8_0, Q4_0 and Q4_1 bit for bit against a plain C reference (exact integer block sums, the
 * float terms in the kernel's documented order), its decoding attention within float rounding of a double one, and
 * its step of several tokens bit for bit against one-token steps, compiled for Arm and run under qemu by tests/engine/backends/native/test_native.py
 * (Apple Silicon's NEON dot-product kernel, off a Mac); the same file compiled natively checks the checker. */
#include "spark_blocks.h"

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

/* A random two-layer model: T tokens in one spark_decode_rows call against T spark_decode calls, which must agree
 * bit for bit (logits, stored k, v, query summaries); widths by rows and (AVX-512) in the token lanes. */
static float random_float(float scale) { return (float)((int)((next() >> 16) % 2001u) - 1000) / 1000.0f * scale; }
static spark_qmat random_qmat(int32_t type, int32_t n, int32_t k) {
    uint8_t *w = malloc((size_t)n * (k / QK) * block_bytes(type));
    for (int32_t j = 0; j < n * (k / QK); j++) random_block(type, w + (int64_t)j * block_bytes(type));
    spark_qmat mat = {w, NULL, n, k, type, 2, NULL};
    return mat;
}
static int rows_mismatches(void) {
    enum { L = 2, C = 64, H = 2, HKV = 1, D = 32, I = 96, V = 50, CAP = 64, P0 = 20, NPOS = 64 };
    const float *attn_norm[L], *mlp_norm[L];
    spark_qmat qkv[L], o[L], gate_up[L], down[L];
    float *norms = malloc(4 * (size_t)(2 * L + 1) * C);
    for (int32_t i = 0; i < (2 * L + 1) * C; i++) norms[i] = 1.0f + random_float(0.2f);
    for (int32_t l = 0; l < L; l++) {
        attn_norm[l] = norms + 2 * l * C, mlp_norm[l] = norms + (2 * l + 1) * C;
        qkv[l] = random_qmat(SPARK_Q4_1, H * D + 2 * HKV * D, C), o[l] = random_qmat(SPARK_Q8_0, C, H * D);
        gate_up[l] = random_qmat(SPARK_Q4_0, 2 * I, C), down[l] = random_qmat(SPARK_Q4_1, C, I);
    }
    spark_qmat head = random_qmat(SPARK_Q8_0, V, C);
    const spark_model m = {L, C, H, HKV, D, I, 1e-5f, (const float *const *)attn_norm, (const float *const *)mlp_norm, qkv, o, gate_up, down, norms + 2 * L * C, &head};
    float *cs = malloc(4 * (size_t)NPOS * D), *sn = malloc(4 * (size_t)NPOS * D);
    for (int32_t p = 0; p < NPOS; p++)
        for (int32_t i = 0; i < D / 2; i++) {
            const double ang = p * pow(10000.0, -2.0 * i / D);
            cs[p * D + i] = cs[p * D + i + D / 2] = (float)cos(ang);
            sn[p * D + i] = -(float)sin(ang), sn[p * D + i + D / 2] = (float)sin(ang);
        }
    int64_t slots[CAP];
    for (int32_t r = 0; r < CAP; r++) slots[r] = r;
    const size_t table = 2 * (size_t)L * HKV * CAP * D;
    _Float16 *k0 = malloc(table), *v0 = malloc(table), *k1 = malloc(table), *v1 = malloc(table);
    for (size_t i = 0; i < table / 2; i++) k0[i] = (_Float16)random_float(2.0f), v0[i] = (_Float16)random_float(1.0f);
    int bad = 0;
    const int32_t counts[] = {2, 5, 12, 16};
    for (int32_t ci = 0; ci < 4; ci++) {
        const int32_t t = counts[ci];
        memcpy(k1, k0, table), memcpy(v1, v0, table);
        spark_cache one = {k0, v0, CAP, 1}, many = {k1, v1, CAP, 1};
        float *x = malloc(4 * (size_t)t * C), *x1 = malloc(4 * (size_t)t * C), *want = malloc(4 * (size_t)t * V), *got = malloc(4 * (size_t)t * V);
        float *qs_one = malloc(4 * (size_t)t * L * HKV * D), *qs_many = malloc(4 * (size_t)t * L * HKV * D);
        for (int32_t i = 0; i < t * C; i++) x[i] = x1[i] = random_float(1.0f);
        spark_step steps[16];
        for (int32_t r = 0; r < t; r++) {
            const int32_t pos = P0 + r;
            spark_step st = {cs + pos * D, sn + pos * D, cs + pos * D, sn + pos * D, pos, pos + 1, 0, slots, slots, cs, sn, qs_many + (int64_t)r * L * HKV * D};
            steps[r] = st;
        }
        float *scratch = malloc(4 * (size_t)spark_decode_rows_scratch_floats(&m, t)), *partial = malloc(4 * (size_t)spark_attend_floats(H, D, CAP));
        float *scratch1 = malloc(4 * (size_t)spark_decode_scratch_floats(&m));
        for (int32_t r = 0; r < t; r++) {
            spark_step st = steps[r];
            st.qsum = qs_one + (int64_t)r * L * HKV * D;
            spark_decode(&m, &one, &st, x + (int64_t)r * C, want + (int64_t)r * V, scratch1, partial);
        }
        if (spark_decode_rows(&m, &many, steps, t, x1, got, scratch, partial) != 1) bad++;
        bad += memcmp(want, got, 4 * (size_t)t * V) != 0;
        bad += memcmp(qs_one, qs_many, 4 * (size_t)t * L * HKV * D) != 0;
        bad += memcmp(k0, k1, table) != 0 || memcmp(v0, v1, table) != 0;
        free(x), free(x1), free(want), free(got), free(qs_one), free(qs_many), free(scratch), free(partial), free(scratch1);
    }
    if (spark_decode_rows(&m, &(spark_cache){k1, v1, CAP, 1}, NULL, 17, NULL, NULL, NULL, NULL) != 0) bad++; /* too many */
    for (int32_t l = 0; l < L; l++) free((void *)qkv[l].blocks), free((void *)o[l].blocks), free((void *)gate_up[l].blocks), free((void *)down[l].blocks);
    free((void *)head.blocks), free(norms), free(cs), free(sn), free(k0), free(v0), free(k1), free(v1);
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
    bad += rows_mismatches();
    spark_set_threads(1);
    bad += attention_mismatches();
    bad += rows_mismatches();
    printf("%d mismatches\n", bad);
    return bad != 0;
}
