/* MLoT Spark native CPU kernels, part three: a decoding step's attention over the slot table as it is stored.
 *
 * The table (engine/model/slots.py) holds keys unrotated, in fp16 (or fp32), and nothing else: no rotated fp32
 * copy beside it. This attention reads each attended key once, rotates it at its slot's position as it goes (a tile
 * of keys at a time, in L1), scores it against every query head of its group, and keeps a running softmax (the
 * flash-decoding scheme: per head a running max, sum and unnormalized output), so neither the rotated keys nor the
 * scores of the whole window are ever written out. The attended keys are split into chunks, one work item each,
 * whose partial results are merged at the end by their maxima: the pool's threads share a long window evenly
 * whatever the number of KV heads.
 *
 * Every row operation runs on the machine's float vectors (spark_vf below: 16 lanes on AVX-512, 8 on AVX2, 4 on
 * NEON, one elsewhere): fp16 rows widened by the conversion instructions, rotation, dot products and the weighted
 * sum of values; the exponentials of a tile run as vectors too.
 *
 * Numerics: a key is widened to fp32 and rotated as engine.model.attention.apply_rope does (x * cos + roll(x) * sin,
 * a multiply and an add, never fused), so the rotated key equals PyTorch's bit for bit on every instruction set;
 * scores and the weighted sums use fused multiply-adds where the machine has them and run in another order than
 * PyTorch's softmax: results agree within float rounding (tests/engine/backends/native).
 *
 * A step of several tokens (spark_decode_rows, a speculative verify) rotates each attended key once for all of them
 * (rotate_ranks) and, where every token's keys are the first ranks of the last one's (a chunk appended to the
 * table), runs their attentions as one job that reads each tile of keys and values once for every token it holds
 * (attend_prefix_chunk); each token's tiles, chunks and operations stay those of its own decoding step, so its
 * bits are too.
 *
 * spark_decode calls spark_attend for each layer; spark_decode_rows rotate_ranks and attend_many (spark_blocks.h).
 */

#define SPARK_ATTN_TILE 16      /* keys rotated and scored together, kept in L1 */
#define SPARK_ATTN_MIN_CHUNK 64 /* the fewest keys a work item takes when the pool splits a window */

#include "spark_blocks.h"

/* ---- float vectors: the few operations the attention needs, from the build's family ---- */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
#include "x86/vec.h"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include "arm/vec.h"
#else
#include "ref/vec.h"
#endif

/* exp_approx (spark_kernels.c) on a vector: the same operations in the same order, so the same bits per lane. */
static inline spark_vf vf_exp(spark_vf x) {
    x = vf_max(vf_min(x, vf_set1(88.0f)), vf_set1(-87.0f));
    const spark_vf magic = vf_set1(12582912.0f);
    const spark_vf n = (x * vf_set1(1.44269504f) + magic) - magic;
    const spark_vf r = (x - n * vf_set1(0.693145751953125f)) - n * vf_set1(1.428606765330187e-06f);
    spark_vf p = vf_set1(1.0f / 720);
    p = vf_set1(1.0f / 120) + r * p;
    p = vf_set1(1.0f / 24) + r * p;
    p = vf_set1(1.0f / 6) + r * p;
    p = vf_set1(0.5f) + r * p;
    p = vf_set1(1.0f) + r * p;
    p = vf_set1(1.0f) + r * p;
    return p * vf_pow2i(n);
}

/* Floats of `partial` an attention over `width` keys may use (callers allocate this many). */
int64_t spark_attend_floats(int32_t n_heads, int32_t head_dim, int32_t width) {
    const int64_t chunks = width > SPARK_ATTN_MIN_CHUNK ? (width + SPARK_ATTN_MIN_CHUNK - 1) / SPARK_ATTN_MIN_CHUNK : 1;
    return chunks * n_heads * (int64_t)(head_dim + 2);
}

/* out[i] = x[i] * cos[i] + x[i + off] * sin[i] for i in [0, n): one half of a rotation (off = +-D/2), a multiply
 * and an add per element as apply_rope's. x is fp16 when half. */
static inline __attribute__((always_inline)) void rotate_half(const void *x, int32_t half, int32_t off, const float *cs, const float *sn, const int32_t n, float *out) {
    int32_t i = 0;
    if (half) {
        const _Float16 *p = x;
        for (; i + SPARK_VW <= n; i += SPARK_VW) vf_store(out + i, vf_load_h(p + i) * vf_load(cs + i) + vf_load_h(p + i + off) * vf_load(sn + i));
        for (; i < n; i++) out[i] = (float)p[i] * cs[i] + (float)p[i + off] * sn[i];
    } else {
        const float *p = x;
        for (; i + SPARK_VW <= n; i += SPARK_VW) vf_store(out + i, vf_load(p + i) * vf_load(cs + i) + vf_load(p + i + off) * vf_load(sn + i));
        for (; i < n; i++) out[i] = p[i] * cs[i] + p[i + off] * sn[i];
    }
}

/* Row `slot` of KV head `kh` widened to fp32. */
static inline __attribute__((always_inline)) void load_row(const void *base, int32_t half, int64_t capacity, int32_t kh, int64_t slot, const int32_t d, float *out) {
    const int64_t off = ((int64_t)kh * capacity + slot) * d;
    if (half) {
        const _Float16 *p = (const _Float16 *)base + off;
        int32_t i = 0;
        for (; i + SPARK_VW <= d; i += SPARK_VW) vf_store(out + i, vf_load_h(p + i));
        for (; i < d; i++) out[i] = (float)p[i];
    } else {
        memcpy(out, (const float *)base + off, sizeof(float) * (size_t)d);
    }
}

/* Row `slot` of KV head `kh`'s keys rotated at the position whose table rows are cs, sn: out (D). */
static inline __attribute__((always_inline)) void rotate_key(const void *k, int32_t half, int64_t capacity, int32_t kh, int64_t slot, const float *cs, const float *sn, const int32_t d, float *out) {
    const size_t elem = half ? 2 : 4;
    const int32_t hd = d / 2;
    const uint8_t *row = (const uint8_t *)k + (((int64_t)kh * capacity + slot) * d) * elem;
    rotate_half(row, half, hd, cs, sn, hd, out);
    rotate_half(row + hd * elem, half, -hd, cs + hd, sn + hd, d - hd, out + hd);
}

/* Every key of an addressing rotated once (spark_rotation, spark_blocks.h): a parallel_for job over ranks. */
void rotate_ranks(void *ctx, int32_t begin, int32_t end) {
    const spark_rotation *r = ctx;
    for (int32_t kh = 0; kh < r->n_kv_heads; kh++)
        for (int32_t i = begin; i < end; i++) {
            float *out = r->out + ((int64_t)kh * r->width + i) * r->d;
            const float *cs = r->cos + r->positions[i] * r->d, *sn = r->sin + r->positions[i] * r->d;
            if (r->d == 64) rotate_key(r->k, r->half, r->capacity, kh, r->slots[i], cs, sn, 64, out);
            else rotate_key(r->k, r->half, r->capacity, kh, r->slots[i], cs, sn, r->d, out);
        }
}

/* s[t] = q . kt[t] * scale for keys [t0, t1) of a tile: the query held in vectors across them. */
static inline __attribute__((always_inline)) void tile_scores(const float *q, const float *const *kt, int32_t t0, int32_t t1, const int32_t d, float scale, float *s) {
    enum { MAXV = SPARK_MAX_HEAD_DIM / SPARK_VW };
    spark_vf qv[MAXV];
    const int32_t nv = d / SPARK_VW;
    for (int32_t j = 0; j < nv; j++) qv[j] = vf_load(q + j * SPARK_VW);
    for (int32_t t = t0; t < t1; t++) {
        float dot = 0.0f; /* a head narrower than one vector (nv = 0) is all tail */
        if (nv > 0) {
            spark_vf acc = qv[0] * vf_load(kt[t]);
            for (int32_t j = 1; j < nv; j++) acc = vf_fma(qv[j], vf_load(kt[t] + j * SPARK_VW), acc);
            dot = vf_sum(acc);
        }
        for (int32_t i = nv * SPARK_VW; i < d; i++) dot += q[i] * kt[t][i];
        s[t] = dot * scale;
    }
}

#if SPARK_VW == 16
/* tile_scores for a whole tile of 16 keys (ranks below sp scored by qp, the rest by qn) with D a multiple of 16: the
 * same products per key, and each key's 16 lanes summed by _mm512_reduce_add_ps's tree (lane i + lane i + 8, then
 * i + i + 4, then i + i + 2, then the two), two to four keys' sums per vector add: the same bits as tile_scores. */
static inline __attribute__((always_inline)) void tile_scores16(const float *qp, const float *qn, const float *const *kt, int32_t sp, const int32_t d, float scale, float *s) {
    const int32_t nv = d / 16;
    __m512 v[16], a[8], b[4], c[2];
    for (int32_t t = 0; t < 16; t++) {
        const float *q = t < sp ? qp : qn;
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(kt[t]));
        for (int32_t j = 1; j < nv; j++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * 16), _mm512_loadu_ps(kt[t] + j * 16), acc);
        v[t] = acc;
    }
    for (int32_t i = 0; i < 8; i++) /* keys 2i, 2i + 1: their halves' sums (8 lanes each) */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int32_t i = 0; i < 4; i++) /* keys 4i..4i + 3, one per 128-bit lane: their quarters' sums */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int32_t i = 0; i < 2; i++) /* per 128-bit lane l: keys 8i + l, 8i + 4 + l, two sums each */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    /* element 4l + m holds key 4m + l */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_store_ps(s, _mm512_mul_ps(_mm512_permutexvar_ps(order, r), _mm512_set1_ps(scale)));
}
#endif

/* Chunk c of a starts: its heads' running max, sum and output cleared. */
static inline void chunk_start(const spark_attn *a, int32_t c, int32_t d) {
    const int32_t stride = d + 2;
    float *part = a->partial + (int64_t)c * a->n_heads * stride;
    for (int32_t h = 0; h < a->n_heads; h++) {
        part[h * stride] = -INFINITY;
        part[h * stride + 1] = 0.0f;
        memset(part + h * stride + 2, 0, sizeof(float) * (size_t)d);
    }
}

/* Keys [t0, t0 + n) of chunk c, KV head kh (rotated keys kr[t], values vt[t]), for that head's query heads of a:
 * scores, the chunk's running softmax, the weighted values. */
static inline __attribute__((always_inline)) void tile_heads(const spark_attn *a, int32_t c, int32_t kh, int32_t t0, int32_t n, const float *const *kt, float (*vt)[SPARK_MAX_HEAD_DIM], const int32_t d) {
    enum { MAXV = SPARK_MAX_HEAD_DIM / SPARK_VW };
    const int32_t g = a->n_heads / a->n_kv_heads, stride = d + 2, nv = d / SPARK_VW;
    float *part = a->partial + (int64_t)c * a->n_heads * stride;
    /* ranks below the split are scored by q_plain: keys [0, sp) of this tile */
    const int32_t sp = a->split <= t0 ? 0 : (a->split - t0 < n ? a->split - t0 : n);
    _Alignas(64) float s[SPARK_ATTN_TILE], p[SPARK_ATTN_TILE];
    const float *kr[SPARK_ATTN_TILE];
    for (int32_t t = 0; t < SPARK_ATTN_TILE; t++) kr[t] = kt[t < n ? t : 0]; /* past n: scored, never used */
    for (int32_t u = 0; u < g; u++) {
        const int32_t h = kh * g + u;
        float *st = part + h * stride, *acc = st + 2;
#if SPARK_VW == 16
        if (d % 16 == 0) {
            tile_scores16(a->q_plain + (int64_t)h * d, a->q_new + (int64_t)h * d, kr, sp, d, a->scale, s);
        } else
#endif
        {
            tile_scores(a->q_plain + (int64_t)h * d, kr, 0, sp, d, a->scale, s);
            tile_scores(a->q_new + (int64_t)h * d, kr, sp, n, d, a->scale, s);
        }
        float mx = st[0];
        for (int32_t t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
        for (int32_t t = n; t < SPARK_ATTN_TILE; t++) s[t] = mx; /* the tile's unused lanes: e^0, never summed */
        if (mx > st[0]) { /* a new maximum: rescale what the chunk summed so far */
            const float corr = exp_approx(st[0] - mx);
            st[1] *= corr;
            for (int32_t i = 0; i < d; i++) acc[i] *= corr;
            st[0] = mx;
        }
        const spark_vf vmx = vf_set1(mx);
        for (int32_t t = 0; t < SPARK_ATTN_TILE; t += SPARK_VW) vf_store(p + t, vf_exp(vf_load(s + t) - vmx));
        float total = 0.0f;
        for (int32_t t = 0; t < n; t++) total += p[t];
        st[1] += total;
        spark_vf av[MAXV];
        for (int32_t j = 0; j < nv; j++) av[j] = vf_load(acc + j * SPARK_VW);
        for (int32_t t = 0; t < n; t++) {
            const spark_vf pv = vf_set1(p[t]);
            for (int32_t j = 0; j < nv; j++) av[j] = vf_fma(pv, vf_load(vt[t] + j * SPARK_VW), av[j]);
            for (int32_t i = nv * SPARK_VW; i < d; i++) acc[i] += p[t] * vt[t][i];
        }
        for (int32_t j = 0; j < nv; j++) vf_store(acc + j * SPARK_VW, av[j]);
    }
}

/* Keys [r0, r1) of one chunk, for every KV head and its query heads: the chunk's partial softmax. */
static inline __attribute__((always_inline)) void attend_chunk(const spark_attn *a, int32_t c, int32_t r0, int32_t r1, const int32_t d) {
    chunk_start(a, c, d);
    _Alignas(64) float kt[SPARK_ATTN_TILE][SPARK_MAX_HEAD_DIM], vt[SPARK_ATTN_TILE][SPARK_MAX_HEAD_DIM];
    for (int32_t t0 = r0; t0 < r1; t0 += SPARK_ATTN_TILE) {
        const int32_t n = r1 - t0 < SPARK_ATTN_TILE ? r1 - t0 : SPARK_ATTN_TILE;
        for (int32_t kh = 0; kh < a->n_kv_heads; kh++) {
            const float *kr[SPARK_ATTN_TILE]; /* the tile's rotated keys */
            for (int32_t t = 0; t < n; t++) {
                const int64_t slot = a->slots[t0 + t];
                if (a->rotated != NULL) {
                    kr[t] = a->rotated + ((int64_t)kh * a->rotated_width + a->rank_of[t0 + t]) * d;
                } else {
                    rotate_key(a->k, a->half, a->capacity, kh, slot, a->cos + a->positions[t0 + t] * d, a->sin + a->positions[t0 + t] * d, d, kt[t]);
                    kr[t] = kt[t];
                }
                load_row(a->v, a->half, a->capacity, kh, slot, d, vt[t]);
            }
            tile_heads(a, c, kh, t0, n, kr, vt, d);
        }
    }
}
static void attend_chunks(void *ctx, int32_t begin, int32_t end) {
    const spark_attn *a = ctx;
    for (int32_t c = begin; c < end; c++) {
        const int32_t r0 = c * a->chunk, r1 = r0 + a->chunk < a->width ? r0 + a->chunk : a->width;
        if (a->d == 64) {
            attend_chunk(a, c, r0, r1, 64); /* SmolLM2's, Llama's and Qwen's head dim */
        } else {
            attend_chunk(a, c, r0, r1, a->d);
        }
    }
}

/* How many keys a work item of a's attention takes (a->chunk), and how many items: one chunk on one thread; else
 * about four per thread, never under SPARK_ATTN_MIN_CHUNK keys (the bound spark_attend_floats allocates for). */
static int32_t attend_split(spark_attn *a) {
    const int32_t threads = spark_threads();
    int32_t chunk = a->width;
    if (threads > 1 && a->width > SPARK_ATTN_MIN_CHUNK) {
        chunk = (a->width + 4 * threads - 1) / (4 * threads);
        chunk = (chunk + SPARK_ATTN_TILE - 1) / SPARK_ATTN_TILE * SPARK_ATTN_TILE;
        chunk = chunk < SPARK_ATTN_MIN_CHUNK ? SPARK_ATTN_MIN_CHUNK : chunk;
    }
    a->chunk = chunk > 0 ? chunk : 1;
    return (a->width + a->chunk - 1) / a->chunk;
}

/* a->out from its chunks' partial results, merged by their maxima. */
static void attend_merge(const spark_attn *a) {
    const int32_t d = a->d, stride = d + 2, chunks = (a->width + a->chunk - 1) / a->chunk;
    for (int32_t h = 0; h < a->n_heads; h++) {
        float mx = -INFINITY;
        for (int32_t c = 0; c < chunks; c++) {
            const float m = a->partial[((int64_t)c * a->n_heads + h) * stride];
            mx = m > mx ? m : mx;
        }
        float total = 0.0f, sum[SPARK_MAX_HEAD_DIM];
        for (int32_t i = 0; i < d; i++) sum[i] = 0.0f;
        for (int32_t c = 0; c < chunks; c++) {
            const float *st = a->partial + ((int64_t)c * a->n_heads + h) * stride;
            const float w = chunks == 1 ? 1.0f : exp_approx(st[0] - mx);
            total += st[1] * w;
            for (int32_t i = 0; i < d; i++) sum[i] += st[2 + i] * w;
        }
        for (int32_t i = 0; i < d; i++) a->out[(int64_t)h * d + i] = sum[i] / total;
    }
}

/* out (H, D) = softmax(q k^T * scale) v over the attended keys, the chunks split over the pool's threads. Exported
 * too (engine.backends.native.AttnDesc), so it is checked on its own against PyTorch. */
void spark_attend(spark_attn *a) {
    parallel_for(attend_chunks, a, attend_split(a));
    attend_merge(a);
}

/* The attentions of a step's T tokens (each its own addressing, queries and partial results) as one job: every
 * token's chunks, as spark_attend splits them, shared over the pool at once, then every token's merge. */
typedef struct {
    spark_attn *a;
    int32_t count;
    int32_t first[SPARK_MAX_STEP_ROWS + 1]; /* token t's chunks are items [first[t], first[t + 1]) */
} spark_attend_many;

static void attend_many_chunks(void *ctx, int32_t begin, int32_t end) {
    const spark_attend_many *j = ctx;
    int32_t t = 0;
    for (int32_t item = begin; item < end; item++) {
        while (item >= j->first[t + 1]) t++;
        attend_chunks(&j->a[t], item - j->first[t], item - j->first[t] + 1);
    }
}

static void attend_many_merge(void *ctx, int32_t begin, int32_t end) {
    const spark_attend_many *j = ctx;
    for (int32_t t = begin; t < end; t++) attend_merge(&j->a[t]);
}

/* Chunk c of every token whose addressing is a prefix of the last token's (a[count - 1], whose rotated keys they
 * all read at their own ranks): each tile of keys and values read once, for every token whose chunk c holds it, so
 * a tile stays in L1 while all of them use it; each token's tiles in its own order: its bits as spark_attend's. */
static inline __attribute__((always_inline)) void attend_prefix_chunk(const spark_attend_many *j, int32_t c, const int32_t d) {
    const spark_attn *u = &j->a[j->count - 1];
    int32_t lo = INT32_MAX, hi = 0, from[SPARK_MAX_STEP_ROWS], to[SPARK_MAX_STEP_ROWS];
    for (int32_t t = 0; t < j->count; t++) {
        const spark_attn *a = &j->a[t];
        from[t] = c * a->chunk, to[t] = from[t] + a->chunk < a->width ? from[t] + a->chunk : a->width;
        if (from[t] >= to[t]) continue; /* no chunk c */
        chunk_start(a, c, d);
        lo = from[t] < lo ? from[t] : lo, hi = to[t] > hi ? to[t] : hi;
    }
    _Alignas(64) float vt[SPARK_ATTN_TILE][SPARK_MAX_HEAD_DIM];
    for (int32_t t0 = lo; t0 < hi; t0 += SPARK_ATTN_TILE) { /* chunk edges are whole tiles: every token's tiles */
        const int32_t n = hi - t0 < SPARK_ATTN_TILE ? hi - t0 : SPARK_ATTN_TILE;
        for (int32_t kh = 0; kh < u->n_kv_heads; kh++) {
            const float *kr[SPARK_ATTN_TILE];
            for (int32_t i = 0; i < n; i++) {
                kr[i] = u->rotated + ((int64_t)kh * u->rotated_width + t0 + i) * d;
                load_row(u->v, u->half, u->capacity, kh, u->slots[t0 + i], d, vt[i]);
            }
            for (int32_t t = 0; t < j->count; t++)
                if (t0 >= from[t] && t0 < to[t]) tile_heads(&j->a[t], c, kh, t0, to[t] - t0 < n ? to[t] - t0 : n, kr, vt, d);
        }
    }
}

static void attend_prefix_chunks(void *ctx, int32_t begin, int32_t end) {
    const spark_attend_many *j = ctx;
    for (int32_t c = begin; c < end; c++) {
        if (j->a[0].d == 64) attend_prefix_chunk(j, c, 64);
        else attend_prefix_chunk(j, c, j->a[0].d);
    }
}

/* The attentions of `count` tokens; `prefix`: each token's addressing is the first ranks of the last one's, whose
 * keys a[t].rotated holds (rank_of the identity). */
void attend_many(spark_attn *a, int32_t count, int prefix) {
    spark_attend_many j;
    j.a = a, j.count = count, j.first[0] = 0;
    int32_t chunks = 0;
    for (int32_t t = 0; t < count; t++) {
        const int32_t n = attend_split(&a[t]);
        j.first[t + 1] = j.first[t] + n;
        chunks = n > chunks ? n : chunks;
    }
    if (prefix) parallel_for(attend_prefix_chunks, &j, chunks);
    else parallel_for(attend_many_chunks, &j, j.first[count]);
    parallel_for(attend_many_merge, &j, count);
}
