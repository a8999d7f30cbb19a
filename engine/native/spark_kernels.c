/* MLoT Spark native CPU kernels: int8 matrix products and a whole single-token decode step.
 *
 * Why C: decoding one token of a small model is ~120 matrix-vector products and ~600 tiny ops. From Python each
 * op costs microseconds of dispatch, and the quantized library's matrix call has a ~13 us fixed cost; together
 * that was half of every token. One call per token removes both, and a matrix-vector kernel that streams the
 * int8 rows with the CPU's dot-product instructions runs near memory bandwidth.
 *
 * Built on first use by engine/native/__init__.py with the machine's C compiler (-O3, tuned for this CPU) and
 * loaded with ctypes; when no compiler is present the engine keeps its PyTorch path. No Python headers, no
 * PyTorch headers: the ABI is plain pointers, described in engine/native/__init__.py.
 *
 * Conventions (shapes as in engine/model.py): C hidden, H query heads, Hkv key/value heads, D head dim, I MLP
 * width, N/K a matrix's output/input size. Weights are int8 (N, K) row-major with one fp32 scale per output row;
 * activations are quantized per row (per token) to int8 with one fp32 scale, symmetric, at call time, and
 * products accumulate in int32: y[n] = x_scale * w_scale[n] * sum_k xq[k] * wq[n, k] + bias[n].
 */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Largest head dim spark_decode supports (the Python side checks before using it). */
#define SPARK_MAX_HEAD_DIM 512

int32_t spark_max_head_dim(void) { return SPARK_MAX_HEAD_DIM; }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SPARK_AVX512VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__)
#define SPARK_AVX2 1
#include <immintrin.h>
#elif defined(__ARM_FEATURE_DOTPROD)
#define SPARK_NEON_DOT 1
#include <arm_neon.h>
#endif

/* Which dot-product kernel this build uses (reported by the engine's backend explanation). */
const char *spark_isa(void) {
#if defined(SPARK_AVX512VNNI)
    return "avx512-vnni";
#elif defined(SPARK_AVX2)
    return "avx2";
#elif defined(SPARK_NEON_DOT)
    return "neon-dotprod";
#else
    return "portable";
#endif
}

/* One int8 matrix (N, K) with per-row scales; row_sums[n] = sum_k q[n, k] (the x86 VNNI kernel multiplies
 * unsigned activations, xq + 128, and subtracts 128 * row_sums to get the signed product back). */
typedef struct {
    const int8_t *q;         /* (N, K) */
    const float *scales;     /* (N,) */
    const int32_t *row_sums; /* (N,) */
    const float *bias;       /* (N,) or NULL */
    int32_t n, k;
} spark_qmat;

/* Quantize one activation row x (K) to int8 in [-127, 127]; returns its scale (0 for an all-zero row). The x86
 * VNNI kernel multiplies unsigned by signed bytes, so there the row is stored as xq + 128 (sign bit flipped) and
 * dot_row subtracts 128 * (sum of the weights) again. */
static float quantize_row(const float *x, int32_t k, int8_t *xq) {
    float amax = 0.0f;
    for (int32_t i = 0; i < k; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const float inv = amax == 0.0f ? 0.0f : 127.0f / amax;
    for (int32_t i = 0; i < k; i++) {
        int8_t v = (int8_t)lrintf(x[i] * inv);
#if defined(SPARK_AVX512VNNI)
        v = (int8_t)((uint8_t)v ^ 0x80u);
#endif
        xq[i] = v;
    }
    return amax / 127.0f;
}

/* sum_k x[k] * w[k] for one weight row and one quantized activation row (exact int32). */
static int32_t dot_row(const int8_t *w, const int8_t *x, int32_t k, int32_t row_sum) {
    int32_t i = 0, s = 0;
#if defined(SPARK_AVX512VNNI)
    __m512i a = _mm512_setzero_si512();
    for (; i + 64 <= k; i += 64) a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(x + i), _mm512_loadu_si512(w + i));
    if (i > 0) {
        int32_t head = row_sum; /* the sum of w over [0, i), which the unsigned offset added 128 times */
        for (int32_t j = i; j < k; j++) head -= w[j];
        s = _mm512_reduce_add_epi32(a) - 128 * head;
    }
    for (; i < k; i++) s += (int32_t)(int8_t)((uint8_t)x[i] ^ 0x80u) * w[i];
#elif defined(SPARK_AVX2)
    /* maddubs multiplies unsigned by signed bytes into saturating int16 pairs: |x| times w carrying x's sign keeps
     * every pair within 2 * 127 * 127 < 32767, so nothing saturates. */
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a = _mm256_setzero_si256();
    for (; i + 32 <= k; i += 32) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + i));
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + i));
        a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(wv, xv)), ones));
    }
    int32_t t[8];
    _mm256_storeu_si256((__m256i *)t, a);
    s = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
    (void)row_sum;
    for (; i < k; i++) s += (int32_t)x[i] * w[i];
#elif defined(SPARK_NEON_DOT)
    int32x4_t a = vdupq_n_s32(0);
    for (; i + 16 <= k; i += 16) a = vdotq_s32(a, vld1q_s8(x + i), vld1q_s8(w + i));
    s = vaddvq_s32(a);
    (void)row_sum;
    for (; i < k; i++) s += (int32_t)x[i] * w[i];
#else
    (void)row_sum;
    for (; i < k; i++) s += (int32_t)x[i] * w[i];
#endif
    return s;
}

/* y (N) = W x for one activation row x (K), quantized on the fly into xq (K bytes). Decoding reads every weight
 * once, so this runs at memory bandwidth only if the weight stream stays sequential: one row at a time (17-27 GB/s
 * on one Zen 4 core; interleaving four rows ran at 9). Several rows (prefill) go to PyTorch's int8 GEMM instead. */
static void qgemv(const spark_qmat *w, const float *x, float *y, int8_t *xq) {
    const int32_t k = w->k;
    const float xs = quantize_row(x, k, xq);
    for (int32_t j = 0; j < w->n; j++) {
        const int32_t acc = dot_row(w->q + (size_t)j * k, xq, k, w->row_sums[j]);
        y[j] = xs * w->scales[j] * (float)acc + (w->bias ? w->bias[j] : 0.0f);
    }
}

/* Entry point for Python's int8 linear layers on one row: xq is scratch of K bytes. */
void spark_qgemv(const spark_qmat *w, const float *x, float *y, int8_t *xq) { qgemv(w, x, y, xq); }

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

/* The slot table (engine.model.KVCache) of one sequence row: canonical k, v (L, 1, Hkv, S, D) in fp16 or fp32,
 * and the fp32 read copies k_read, v_read of the same shape, in attention (rank) order. */
typedef struct {
    void *k, *v;
    float *k_read, *v_read;
    int64_t num_slots;
    int32_t half; /* 1: k, v are fp16; 0: fp32 */
} spark_cache;

/* One decoding step's addressing (engine.model.StepReads for T = 1, one row, only the written slot stale). */
typedef struct {
    const float *cos_new, *sin_new;     /* (D): rotation of the new key and of the queries scoring ranks >= split */
    const float *cos_plain, *sin_plain; /* (D): rotation of the queries scoring ranks < split (split > 0 only) */
    int64_t slot, rank;                 /* where the new k, v are stored, and the rank of its read copy */
    int32_t width, split;               /* attend to ranks [0, width); ranks [0, split) score against q_plain */
    float *qsum;                        /* (L, Hkv, D) or NULL: per layer, the mean pre-RoPE query of each KV-head
                                           group (engine.model: the query summary the cascade routes with) */
} spark_step;

static void rms_norm(const float *x, const float *w, int32_t c, float eps, float *out) {
    double ss = 0.0;
    for (int32_t i = 0; i < c; i++) ss += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(ss / c) + eps);
    for (int32_t i = 0; i < c; i++) out[i] = x[i] * r * w[i];
}

/* RoPE with the signed sin table (engine.model.RotaryTable): out = x * cos + roll(x, D/2) * sin. */
static void rope(const float *x, const float *cos, const float *sin, int32_t d, float *out) {
    const int32_t half = d / 2;
    for (int32_t i = 0; i < half; i++) out[i] = x[i] * cos[i] + x[i + half] * sin[i];
    for (int32_t i = half; i < d; i++) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

static float round_kv(float x, int32_t half) {
#if defined(__FLT16_MAX__)
    return half ? (float)(_Float16)x : x;
#else
#error "spark_kernels.c needs a compiler with _Float16 (GCC >= 12, Clang >= 15)"
#endif
}

/* Eight independent partial sums: lets the compiler vectorize a float reduction without reassociating it. */
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

static float dotf(const float *a, const float *b, int32_t n) {
    float acc[8] = {0};
    int32_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int32_t j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* out (Hkv, D) = the mean of q (H, D) over the G query heads of each KV head (heads of a group adjacent). */
static void query_summary(const float *q, int32_t hkv, int32_t g, int32_t d, float *out) {
    for (int32_t kh = 0; kh < hkv; kh++)
        for (int32_t i = 0; i < d; i++) {
            float acc = 0.0f;
            for (int32_t j = 0; j < g; j++) acc += q[(kh * g + j) * d + i];
            out[kh * d + i] = acc / (float)g;
        }
}

/* Scratch floats spark_decode needs for a model (callers allocate this many). */
int64_t spark_decode_scratch_floats(const spark_model *m) {
    const int64_t c = m->hidden, hd = (int64_t)m->n_heads * m->head_dim, kv = (int64_t)m->n_kv_heads * m->head_dim;
    const int64_t widest_in = c > m->intermediate ? (c > hd ? c : hd) : (m->intermediate > hd ? m->intermediate : hd);
    /* h, qkv, q_new, q_plain, attn out, gate_up, scores (per head: up to num_slots, passed separately), quant */
    return c + (hd + 2 * kv) + hd + hd + hd + 2 * (int64_t)m->intermediate + widest_in / 4 + 8;
}

/* One token through every layer: x (C) is the token's embedding on entry and is updated in place (the residual
 * stream); writes its k, v into the cache; logits (V) = lm_head(final_norm(x)). scores: width floats. */
void spark_decode(const spark_model *m, const spark_cache *cache, const spark_step *step, float *x, float *logits,
                  float *scratch, float *scores) {
    const int32_t c = m->hidden, h = m->n_heads, hkv = m->n_kv_heads, d = m->head_dim, inter = m->intermediate;
    const int32_t g = h / hkv, hd = h * d, kvd = hkv * d;
    const int64_t s = cache->num_slots;
    const float scale = 1.0f / sqrtf((float)d);
    float *hbuf = scratch;                  /* (C) normed input */
    float *qkv = hbuf + c;                  /* (H*D + 2*Hkv*D) */
    float *q_new = qkv + hd + 2 * kvd;      /* (H*D) queries rotated like the new key */
    float *q_plain = q_new + hd;            /* (H*D) queries at plain positions (split > 0) */
    float *att = q_plain + hd;              /* (H*D) attention output */
    float *gu = att + hd;                   /* (2*I) gate, up */
    int8_t *xq = (int8_t *)(gu + 2 * (int64_t)inter); /* widest input, as bytes */

    for (int32_t l = 0; l < m->n_layers; l++) {
        /* Attention block. */
        rms_norm(x, m->attn_norm[l], c, m->eps, hbuf);
        qgemv(&m->qkv[l], hbuf, qkv, xq);
        const float *q = qkv, *k = qkv + hd, *v = qkv + hd + kvd;
        if (step->qsum) query_summary(q, hkv, g, d, step->qsum + (int64_t)l * kvd);
        const int64_t layer_off = (int64_t)l * hkv * s * d;
        for (int32_t kh = 0; kh < hkv; kh++) {
            const int64_t slot_off = layer_off + (kh * s + step->slot) * d;
            const int64_t rank_off = layer_off + (kh * s + step->rank) * d;
            float kr[SPARK_MAX_HEAD_DIM];
            for (int32_t i = 0; i < d; i++) {
                /* The read copies hold what the table stores, widened: round through the table's dtype first. */
                float kv_k = round_kv(k[kh * d + i], cache->half), kv_v = round_kv(v[kh * d + i], cache->half);
                if (cache->half) {
                    ((_Float16 *)cache->k)[slot_off + i] = (_Float16)kv_k;
                    ((_Float16 *)cache->v)[slot_off + i] = (_Float16)kv_v;
                } else {
                    ((float *)cache->k)[slot_off + i] = kv_k;
                    ((float *)cache->v)[slot_off + i] = kv_v;
                }
                kr[i] = kv_k;
                cache->v_read[rank_off + i] = kv_v;
            }
            rope(kr, step->cos_new, step->sin_new, d, cache->k_read + rank_off);
        }
        for (int32_t qh = 0; qh < h; qh++) {
            rope(q + qh * d, step->cos_new, step->sin_new, d, q_new + qh * d);
            if (step->split > 0) rope(q + qh * d, step->cos_plain, step->sin_plain, d, q_plain + qh * d);
        }
        for (int32_t qh = 0; qh < h; qh++) {
            const int64_t head_off = layer_off + (int64_t)(qh / g) * s * d;
            const float *kh_read = cache->k_read + head_off, *vh_read = cache->v_read + head_off;
            float mx = -INFINITY;
            for (int32_t r = 0; r < step->width; r++) {
                const float *qv = (r < step->split ? q_plain : q_new) + qh * d;
                float sc = dotf(qv, kh_read + (int64_t)r * d, d) * scale;
                scores[r] = sc;
                mx = sc > mx ? sc : mx;
            }
            for (int32_t r = 0; r < step->width; r++) scores[r] = exp_approx(scores[r] - mx);
            float part[8] = {0};
            int32_t r = 0;
            for (; r + 8 <= step->width; r += 8)
                for (int32_t j = 0; j < 8; j++) part[j] += scores[r + j];
            float total = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
            for (; r < step->width; r++) total += scores[r];
            float *out = att + qh * d;
            memset(out, 0, sizeof(float) * (size_t)d);
            for (int32_t r = 0; r < step->width; r++) {
                const float p = scores[r] / total;
                const float *vr = vh_read + (int64_t)r * d;
                for (int32_t i = 0; i < d; i++) out[i] += p * vr[i];
            }
        }
        qgemv(&m->o[l], att, hbuf, xq);
        for (int32_t i = 0; i < c; i++) x[i] += hbuf[i];

        /* MLP block. */
        rms_norm(x, m->mlp_norm[l], c, m->eps, hbuf);
        qgemv(&m->gate_up[l], hbuf, gu, xq);
        for (int32_t i = 0; i < inter; i++) {
            const float gate = gu[i];
            gu[i] = gate / (1.0f + exp_approx(-gate)) * gu[inter + i];
        }
        qgemv(&m->down[l], gu, hbuf, xq);
        for (int32_t i = 0; i < c; i++) x[i] += hbuf[i];
    }
    rms_norm(x, m->final_norm, c, m->eps, hbuf);
    qgemv(m->lm_head, hbuf, logits, xq);
}
