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
 * Numerics: a key is widened to fp32 and rotated as engine.model.attention.apply_rope does (x * cos + roll(x) * sin,
 * no contraction), so the rotated key equals PyTorch's bit for bit; scores, exponentials and sums run in fp32 in
 * another order than PyTorch's softmax: results agree within float rounding (tests/engine/backends/native).
 *
 * Included by spark_kernels.c after its helpers (one translation unit: it uses parallel_for, exp_approx, dotf and
 * SPARK_MAX_HEAD_DIM); spark_decode calls spark_attend for each layer.
 */

#define SPARK_ATTN_TILE 16      /* keys rotated and scored together, kept in L1 */
#define SPARK_ATTN_MIN_CHUNK 64 /* the fewest keys a work item takes when the pool splits a window */

/* One layer's attention for one decoding step. */
typedef struct {
    const void *k, *v;            /* this layer's (Hkv, C, D) of the row: fp16 when half, else fp32; keys unrotated */
    int64_t capacity;             /* C, the table's allocated slots */
    int32_t half;                 /* 1: fp16 table */
    const int64_t *slots;         /* (m,) the attended slots, in slot order */
    const int64_t *positions;     /* (m,) the position each key is rotated at */
    const float *cos, *sin;       /* (P, D) the rotary table (signed sin: engine.model.attention.RotaryTable) */
    int32_t width, split;         /* m; ranks [0, split) are scored by q_plain, the rest by q_new */
    const float *q_new, *q_plain; /* (H, D) rotated queries */
    int32_t n_heads, n_kv_heads, d;
    float scale;
    int32_t chunk;  /* keys per work item */
    float *partial; /* (chunks, H, D + 2): per chunk and head, the running max, the sum, then the output (D) */
    float *out;     /* (H, D) */
} spark_attn;

/* Floats of `partial` an attention over `width` keys may use (callers allocate this many). */
int64_t spark_attend_floats(int32_t n_heads, int32_t head_dim, int32_t width) {
    const int64_t chunks = width > SPARK_ATTN_MIN_CHUNK ? (width + SPARK_ATTN_MIN_CHUNK - 1) / SPARK_ATTN_MIN_CHUNK : 1;
    return chunks * n_heads * (int64_t)(head_dim + 2);
}

/* Row `slot` of KV head `kh` widened to fp32. */
static inline __attribute__((always_inline)) void load_row(const void *base, int32_t half, int64_t capacity, int32_t kh, int64_t slot, const int32_t d, float *out) {
    const int64_t off = ((int64_t)kh * capacity + slot) * d;
    if (half) {
        const _Float16 *p = (const _Float16 *)base + off;
        for (int32_t i = 0; i < d; i++) out[i] = (float)p[i];
    } else {
        memcpy(out, (const float *)base + off, sizeof(float) * (size_t)d);
    }
}

/* Keys [r0, r1) of one chunk, for every KV head and its query heads: the chunk's partial softmax. */
static inline __attribute__((always_inline)) void attend_chunk(const spark_attn *a, int32_t c, int32_t r0, int32_t r1, const int32_t d) {
    const int32_t g = a->n_heads / a->n_kv_heads, stride = d + 2, hd = d / 2;
    float *part = a->partial + (int64_t)c * a->n_heads * stride;
    for (int32_t h = 0; h < a->n_heads; h++) {
        part[h * stride] = -INFINITY;
        part[h * stride + 1] = 0.0f;
        memset(part + h * stride + 2, 0, sizeof(float) * (size_t)d);
    }
    float kt[SPARK_ATTN_TILE][SPARK_MAX_HEAD_DIM], vt[SPARK_ATTN_TILE][SPARK_MAX_HEAD_DIM], raw[SPARK_MAX_HEAD_DIM];
    float s[SPARK_ATTN_TILE];
    for (int32_t t0 = r0; t0 < r1; t0 += SPARK_ATTN_TILE) {
        const int32_t n = r1 - t0 < SPARK_ATTN_TILE ? r1 - t0 : SPARK_ATTN_TILE;
        for (int32_t kh = 0; kh < a->n_kv_heads; kh++) {
            for (int32_t t = 0; t < n; t++) {
                const int64_t slot = a->slots[t0 + t];
                const float *cs = a->cos + a->positions[t0 + t] * d, *sn = a->sin + a->positions[t0 + t] * d;
                load_row(a->k, a->half, a->capacity, kh, slot, d, raw);
                for (int32_t i = 0; i < hd; i++) kt[t][i] = raw[i] * cs[i] + raw[i + hd] * sn[i];
                for (int32_t i = hd; i < d; i++) kt[t][i] = raw[i] * cs[i] + raw[i - hd] * sn[i];
                load_row(a->v, a->half, a->capacity, kh, slot, d, vt[t]);
            }
            for (int32_t u = 0; u < g; u++) {
                const int32_t h = kh * g + u;
                float *st = part + h * stride, *acc = st + 2;
                float mx = st[0];
                for (int32_t t = 0; t < n; t++) {
                    const float *q = (t0 + t < a->split ? a->q_plain : a->q_new) + (int64_t)h * d;
                    s[t] = dotf(q, kt[t], d) * a->scale;
                    mx = s[t] > mx ? s[t] : mx;
                }
                if (mx > st[0]) { /* a new maximum: rescale what the chunk summed so far */
                    const float corr = exp_approx(st[0] - mx);
                    st[1] *= corr;
                    for (int32_t i = 0; i < d; i++) acc[i] *= corr;
                    st[0] = mx;
                }
                for (int32_t t = 0; t < n; t++) {
                    const float p = exp_approx(s[t] - mx);
                    st[1] += p;
                    for (int32_t i = 0; i < d; i++) acc[i] += p * vt[t][i];
                }
            }
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

/* out (H, D) = softmax(q k^T * scale) v over the attended keys, the chunks split over the pool's threads. Exported
 * too (engine.backends.native.AttnDesc), so it is checked on its own against PyTorch. */
void spark_attend(spark_attn *a) {
    const int32_t threads = pool.n_threads, d = a->d, stride = d + 2;
    /* One chunk on one thread; else about four per thread, never under SPARK_ATTN_MIN_CHUNK keys (the bound
     * spark_attend_floats allocates for). */
    int32_t chunk = a->width;
    if (threads > 1 && a->width > SPARK_ATTN_MIN_CHUNK) {
        chunk = (a->width + 4 * threads - 1) / (4 * threads);
        chunk = (chunk + SPARK_ATTN_TILE - 1) / SPARK_ATTN_TILE * SPARK_ATTN_TILE;
        chunk = chunk < SPARK_ATTN_MIN_CHUNK ? SPARK_ATTN_MIN_CHUNK : chunk;
    }
    a->chunk = chunk > 0 ? chunk : 1;
    const int32_t chunks = (a->width + a->chunk - 1) / a->chunk;
    parallel_for(attend_chunks, a, chunks);
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
