/* MLoT Spark native CPU kernels: block-quantized matrix products (GGUF's Q8_0, Q4_0, Q4_1 layouts) and a whole
 * single-token decode step, threaded over a persistent pool.
 *
 * Why C: decoding one token of a small model is ~120 matrix-vector products and ~600 tiny ops. From Python each
 * op costs microseconds of dispatch; one call per token removes that, and a matrix-vector kernel that streams the
 * quantized rows with the CPU's dot-product instructions runs near memory bandwidth.
 *
 * Built on first use by engine/backends/native/__init__.py with the machine's C compiler (-O3, tuned for this CPU) and
 * loaded with ctypes; when no compiler is present the engine keeps its PyTorch path. No Python headers, no
 * PyTorch headers: the ABI is plain structs of pointers (spark_kernels.h), mirrored in engine/backends/native/__init__.py.
 *
 * This file is the common part: the thread pool, the activations, the routes' table and the decoding step. The
 * block products are per instruction-set family (spark_blocks.h: ref/, x86/, arm/), the attention is
 * spark_attention.c, the other formats' numerics spark_kquants.h.
 *
 * Conventions (shapes as in engine/model/network.py): C hidden, H query heads, Hkv key/value heads, D head dim, I MLP
 * width, N/K a matrix's output/input size. Weights are GGUF blocks of 32 (engine/model/quant.py): each row of a matrix
 * is K/32 blocks, read in place from the file's bytes. Activations are quantized per block of 32 as llama.cpp's
 * dot products do (xq = rint(x * 127 / amax), d_x = amax / 127, fp32 scale) or, by default, as int16 with one scale
 * (xq = rint(x * 32767 / amax), d_x = amax / 32767: ~16-bit activations, finer than the two int8 parts used before,
 * which bench quant measured as faithful as fp32, at one product per block); each block's product is an exact int32 sum, and the blocks' float terms are added in one
 * fixed order (8 partial sums, lane b % 8, then a fixed tree) that every instruction set reproduces, so every ISA
 * and the prefill path give the same bits. Per block (w = the weight, x ~= d_x xq, s = sum(xq)):
 *   Q8_0: term = (d_w * d_x) * sum(wq * xq)                          w = d_w * wq
 *   Q4_0: term = (d_w * d_x) * (sum(nib * xq) - 8 * s)               w = d_w * (nib - 8)
 *   Q4_1: term = (d_w * d_x) * sum(nib * xq) + m_w * (d_x * s)       w = d_w * nib + m_w
 * Each family reaches those integers by its own routes (x86/quants.c lists x86's).
 */

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#include "spark_blocks.h"

int32_t spark_max_head_dim(void) { return SPARK_MAX_HEAD_DIM; }
int32_t spark_max_threads(void) { return SPARK_MAX_THREADS; }
int64_t spark_sizeof_qmat(void) { return (int64_t)sizeof(spark_qmat); }
int64_t spark_sizeof_model(void) { return (int64_t)sizeof(spark_model); }
int64_t spark_sizeof_cache(void) { return (int64_t)sizeof(spark_cache); }
int64_t spark_sizeof_step(void) { return (int64_t)sizeof(spark_step); }
int64_t spark_sizeof_attn(void) { return (int64_t)sizeof(spark_attn); }

/* ---------------------------------------------------------------------------------------------------------------
 * The routes of every block type (spark_blocks.h), chosen once when the library is loaded: the portable reference,
 * then the family this build targets over it.
 * ------------------------------------------------------------------------------------------------------------- */

static spark_type_traits traits[SPARK_TYPES];
static spark_isa_ops ops;

__attribute__((constructor)) static void choose_routes(void) {
    spark_register_ref(traits, &ops);
    spark_register_x86(traits, &ops);
    spark_register_arm(traits, &ops);
}

/* Which dot-product kernel this build uses (reported by the engine's backend explanation). */
const char *spark_isa(void) { return ops.isa; }

/* A type's routes; NULL for a format the kernels do not run (the Python side asks spark_block_bytes first). */
static const spark_type_traits *traits_of(int32_t type) {
    return type >= 0 && type < SPARK_TYPES && traits[type].block_bytes > 0 ? &traits[type] : NULL;
}

/* Bytes of one block of the type; 0 for a format the kernels do not run. */
int32_t spark_block_bytes(int32_t type) { return traits_of(type) ? traits_of(type)->block_bytes : 0; }

/* Whether products use the AMX route where it applies; `use` 0 switches it off (comparisons), 1 back on where the
 * machine has it. Returns the state in effect. */
int32_t spark_use_amx(int32_t use) { return ops.use_amx ? ops.use_amx(use) : 0; }

/* ---------------------------------------------------------------------------------------------------------------
 * Persistent thread pool: workers are created once (spark_set_threads) and wait for jobs; a job splits [0, items)
 * into one contiguous range per thread, the caller running the first. Workers wait for the next job spinning for
 * SPARK_LINGER_NS (a decoding step issues ~150 jobs back to back; a prefill's products are a millisecond or more of
 * PyTorch attention apart, and a worker that slept through that gap costs a wake-up per product), offering the core
 * to the OS all along past the first few thousand spins, then sleep on a condition variable, so an idle engine
 * costs no CPU and the GUI thread is never starved. A second caller while a job runs (forked backends decoding at once)
 * runs its job on its own thread instead of waiting.
 * ------------------------------------------------------------------------------------------------------------- */

#define SPARK_LINGER_NS 5000000

static struct {
    pthread_mutex_t use;   /* held by the one caller dispatching jobs */
    pthread_mutex_t sleep; /* with wake: idle workers */
    pthread_cond_t wake;
    pthread_t workers[SPARK_MAX_THREADS];
    int32_t n_threads; /* the caller plus the workers */
    atomic_uint_fast64_t generation;
    uint_fast64_t start_generation; /* the generation the current workers were made at */
    atomic_int pending, sleepers, stop;
    spark_job job;
    void *ctx;
    int32_t items;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, {0}, 1, 0, 0, 0, 0, 0, NULL, NULL, 0};

/* One spin of a wait; past the first few thousand it also offers the core to the OS (sched_yield): on a busy or
 * oversubscribed machine the thread we wait for may need this very core. */
static inline void cpu_relax(int32_t spins) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
    if (spins > 2000 && (spins & 63) == 0) sched_yield();
}

static inline int64_t monotonic_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void run_share(int32_t index) {
    const int64_t items = pool.items, n = pool.n_threads;
    const int32_t begin = (int32_t)(items * index / n), end = (int32_t)(items * (index + 1) / n);
    if (begin < end) pool.job(pool.ctx, begin, end);
}

static void *worker_main(void *arg) {
    const int32_t index = (int32_t)(intptr_t)arg;
    /* The generation when this worker was made (under the dispatcher's lock, no job in flight): the jobs before it
     * are not ours, every later one is, even one dispatched before this thread first runs. */
    uint_fast64_t seen = pool.start_generation;
    for (;;) {
        uint_fast64_t g;
        const int64_t until = monotonic_ns() + SPARK_LINGER_NS;
        for (int32_t spins = 0; (g = atomic_load(&pool.generation)) == seen && !atomic_load(&pool.stop); spins++) {
            cpu_relax(spins);
            if ((spins & 63) == 63 && monotonic_ns() > until) break;
        }
        if (g == seen && !atomic_load(&pool.stop)) {
            pthread_mutex_lock(&pool.sleep);
            atomic_fetch_add(&pool.sleepers, 1); /* before re-checking: a dispatcher that misses us sees sleepers */
            while ((g = atomic_load(&pool.generation)) == seen && !atomic_load(&pool.stop)) pthread_cond_wait(&pool.wake, &pool.sleep);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.sleep);
        }
        if (atomic_load(&pool.stop)) return NULL;
        seen = g;
        run_share(index);
        atomic_fetch_sub(&pool.pending, 1);
    }
}

static void stop_workers(void) {
    atomic_store(&pool.stop, 1);
    pthread_mutex_lock(&pool.sleep);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.sleep);
    for (int32_t i = 1; i < pool.n_threads; i++) pthread_join(pool.workers[i], NULL);
    atomic_store(&pool.stop, 0);
    pool.n_threads = 1;
}

/* A forked child has none of the parent's workers: it starts over with one thread. */
static void pool_after_fork(void) {
    pool.n_threads = 1;
    pthread_mutex_init(&pool.use, NULL);
    pthread_mutex_init(&pool.sleep, NULL);
    pthread_cond_init(&pool.wake, NULL);
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.pending, 0);
}
static pthread_once_t fork_guard = PTHREAD_ONCE_INIT;
static void install_fork_guard(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

/* Use n threads (the caller included) for the jobs that follow; returns the count in effect. */
int32_t spark_set_threads(int32_t n) {
    n = n < 1 ? 1 : (n > SPARK_MAX_THREADS ? SPARK_MAX_THREADS : n);
    pthread_once(&fork_guard, install_fork_guard);
    pthread_mutex_lock(&pool.use);
    if (n != pool.n_threads) {
        stop_workers();
        pool.start_generation = atomic_load(&pool.generation);
        int32_t made = 1;
        for (; made < n; made++)
            if (pthread_create(&pool.workers[made], NULL, worker_main, (void *)(intptr_t)made) != 0) break;
        pool.n_threads = made;
    }
    const int32_t now = pool.n_threads;
    pthread_mutex_unlock(&pool.use);
    return now;
}

int32_t spark_threads(void) { return pool.n_threads; }

void parallel_for(spark_job job, void *ctx, int32_t items) {
    if (items <= 1 || pool.n_threads == 1 || pthread_mutex_trylock(&pool.use) != 0) {
        job(ctx, 0, items);
        return;
    }
    if (pool.n_threads == 1) {
        pthread_mutex_unlock(&pool.use);
        job(ctx, 0, items);
        return;
    }
    pool.job = job, pool.ctx = ctx, pool.items = items;
    atomic_store(&pool.pending, pool.n_threads - 1);
    atomic_fetch_add(&pool.generation, 1);
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.sleep);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.sleep);
    }
    run_share(0);
    for (int32_t spins = 0; atomic_load(&pool.pending) > 0; spins++) {
        cpu_relax(spins);
        if ((spins & 0xFFFFF) == 0xFFFFF) {
            /* A wake-up lost to a worker that was just falling asleep (seen once, under a full test suite): wake the
             * sleepers again rather than wait for ever. Costs nothing on the normal path. */
            pthread_mutex_lock(&pool.sleep);
            pthread_cond_broadcast(&pool.wake);
            pthread_mutex_unlock(&pool.sleep);
        }
    }
    pthread_mutex_unlock(&pool.use);
}

/* ---------------------------------------------------------------------------------------------------------------
 * Activations, and the product of a block matrix with them over the pool.
 * ------------------------------------------------------------------------------------------------------------- */

/* Rows rounded up to whole groups of token lanes: the token-lane copy's (a prefill's or a verify's where the
 * family copies the rows into lanes, from the fewest any type takes in lanes; none for one row). */
static int64_t lane_rows(int32_t m) {
    return ops.lane_copy_min > 0 && m >= ops.lane_copy_min ? ((int64_t)m + ops.lanes - 1) / ops.lanes * ops.lanes : 0;
}

/* Bytes of activation scratch for m rows of k (spark_qgemm's `scratch`): the rows, then their token-lane copy, or
 * for one row its split bytes. */
int64_t spark_act_bytes(int32_t k, int32_t m) {
    return ((int64_t)m + lane_rows(m)) * (2 * k + 12 * (k / QK)) + 128 + (m == 1 ? 2 * k + 12 * (k / QK) + 64 : 0);
}

static spark_act act_in(void *scratch, int32_t k, int32_t m, int32_t parts) {
    const int64_t nb = (int64_t)m * (k / QK), tb = lane_rows(m) * (k / QK);
    spark_act a;
    a.d = (float *)scratch;
    a.ds = a.d + nb;
    a.s = (int32_t *)(a.ds + nb);
    a.q8 = (int8_t *)(a.s + nb);
    a.q16 = (int16_t *)(a.s + nb);
    a.parts = parts;
    /* the token-lane copy from the next 64-byte boundary after the rows (its vectors are loaded whole) */
    a.tq = (int32_t *)(((uintptr_t)(a.q16 + nb * QK) + 63) & ~(uintptr_t)63);
    a.td = (float *)(a.tq + tb * QK / 2);
    a.tds = a.td + tb;
    a.ts = (int32_t *)(a.tds + tb);
    a.th = a.tq + tb * (QK / 4);
    a.xh = NULL, a.xl = NULL, a.xc = NULL, a.xs = NULL, a.xv = NULL, a.xp = NULL;
    if (m == 1) {
        a.xh = (int8_t *)(((uintptr_t)(a.ts + tb) + 63) & ~(uintptr_t)63);
        a.xl = (uint8_t *)(a.xh + k);
        a.xc = (int32_t *)(a.xl + k);
        a.xs = a.xc + k / QK;
        a.xv = a.xh;
        a.xp = (int16_t *)a.xh;
    }
    return a;
}

/* How many of a prefill's m activation rows over w take its type's token-lane route, the first ones; the rest take
 * the row routes: whole groups, and a last partial one of at least the route's fewest. */
static int32_t lane_tokens(const spark_qmat *w, int32_t m) {
    const spark_type_traits *t = &traits[w->type];
    const int32_t p = w->act_parts == 1 ? 0 : 1;
    if (t->lanes[p] == NULL) return 0;
    return m % ops.lanes >= t->lanes_min[p] ? m : m - m % ops.lanes;
}

/* Whether spark_qgemm takes w's m rows by AMX: two int16 rows or more, where the type has that route and it is on. */
static int amx_route(const spark_qmat *w, int32_t m) {
    return m >= 2 && w->act_parts == 2 && traits[w->type].amx != NULL && ops.amx_on != NULL && ops.amx_on();
}

/* y (M, N) = x W^T (+ bias) for M quantized activation rows; rows of W split across the pool. Each output is the
 * product of one weight row and one activation row, whichever route takes it, so a prefill of M rows and M
 * one-row decodes agree bit for bit. */
typedef struct {
    const spark_qmat *w;
    const spark_act *a;
    float *y;
    int32_t m;
    int32_t lanes; /* rows [0, lanes) by the type's token-lane route, the rest by its row routes */
    int amx;       /* every row by AMX */
} gemm_job;

static void gemm_rows(void *ctx, int32_t begin, int32_t end) {
    const gemm_job *g = ctx;
    const spark_type_traits *t = &traits[g->w->type];
    if (g->amx) {
        t->amx(g->w, g->a, g->y, g->m, begin, end);
        return;
    }
    int32_t lanes = g->lanes;
    if (lanes > 0 && !t->lanes[g->a->parts == 1 ? 0 : 1](g->w, g->a, g->y, lanes, begin, end)) lanes = 0; /* no memory for its copy: by rows */
    if (lanes == g->m) return;
    t->rows(g->w, g->a, g->y, lanes, g->m, begin, end);
}

/* Entry point for Python's block linear layers: x (M, K) -> y (M, N) for w's own N rows (a further part, w->next, is
 * another call); scratch holds spark_act_bytes(K, M). */
void spark_qgemm(const spark_qmat *w, const float *x, int32_t m, float *y, void *scratch) {
    const spark_type_traits *t = traits_of(w->type);
    if (t == NULL) return;
    spark_act a = act_in(scratch, w->k, m, w->act_parts);
    const int32_t nb = w->k / QK;
    for (int32_t r = 0; r < m; r++) ops.quantize_row(x + (int64_t)r * w->k, w->k, w->k, &a, (int64_t)r * nb);
    if (m == 1 && t->split) t->split(&a, w->type, nb);
    gemm_job g = {w, &a, y, m, 0, amx_route(w, m)};
    if (g.amx) {
        t->amx_in(&a, m, nb);
    } else {
        g.lanes = lane_tokens(w, m);
        if (g.lanes > 0 && t->lanes_in) t->lanes_in(&a, g.lanes, nb);
    }
    parallel_for(gemm_rows, &g, w->n);
}

/* One row through one matrix: y (N) = W x for x of `len` values (W's K rounded up to 32), quantized into a. */
static void qgemv(const spark_qmat *w, const float *x, int32_t len, float *y, spark_act *a) {
    a->parts = w->act_parts;
    ops.quantize_row(x, w->k, len, a, 0);
    for (; w != NULL; y += w->n, w = w->next) { /* each part of a fused matrix in its own format, outputs in order */
        const spark_type_traits *t = traits_of(w->type);
        if (t == NULL) continue;
        if (t->split) t->split(a, w->type, w->k / QK);
        gemm_job g = {w, a, y, 1, 0, 0};
        parallel_for(gemm_rows, &g, w->n);
    }
}

static void rms_norm(const float *x, const float *w, int32_t c, float eps, float *out) {
    double ss = 0.0;
    for (int32_t i = 0; i < c; i++) ss += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(ss / c) + eps);
    for (int32_t i = 0; i < c; i++) out[i] = x[i] * r * w[i];
}

/* RoPE with the signed sin table (engine.model.network.RotaryTable): out = x * cos + roll(x, D/2) * sin. */
static void rope(const float *x, const float *cos, const float *sin, int32_t d, float *out) {
    const int32_t half = d / 2;
    for (int32_t i = 0; i < half; i++) out[i] = x[i] * cos[i] + x[i + half] * sin[i];
    for (int32_t i = half; i < d; i++) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

/* Eight independent partial sums: lets the compiler vectorize a float reduction without reassociating it. */
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
    /* h, qkv, q_new, q_plain, attn out, gate_up, quantized activations (scores: per head, passed separately) */
    return c + (hd + 2 * kv) + hd + hd + hd + 2 * (int64_t)m->intermediate + spark_act_bytes((int32_t)(widest_in + QK - 1) / QK * QK, 1) / 4 + 8;
}

/* One token's k, v (Hkv, D) into `slot` of the layer at element offset `layer_off` of the table (fp16 or fp32). */
static void store_kv(const spark_cache *cache, int64_t layer_off, int32_t hkv, int32_t d, int64_t slot, const float *k,
                     const float *v) {
    for (int32_t kh = 0; kh < hkv; kh++) {
        const int64_t slot_off = layer_off + (kh * cache->capacity + slot) * d;
        for (int32_t i = 0; i < d; i++) {
            if (cache->half) {
                ((_Float16 *)cache->k)[slot_off + i] = (_Float16)k[kh * d + i];
                ((_Float16 *)cache->v)[slot_off + i] = (_Float16)v[kh * d + i];
            } else {
                ((float *)cache->k)[slot_off + i] = k[kh * d + i];
                ((float *)cache->v)[slot_off + i] = v[kh * d + i];
            }
        }
    }
}

/* One token's attention in the layer at element offset `layer_off` of the table: its queries q (H*D) rotated like
 * its key (q_new) and, for ranks below the step's split, at plain positions (q_plain); the attention over the ranks
 * the step addresses into out (H*D), `partial` its scratch, keys rotated as read or taken from `rotated` (rank_of:
 * spark_attn). Returns the description spark_attend (or attend_many) runs. */
static spark_attn token_attention(const spark_cache *cache, int64_t layer_off, const spark_step *st, const float *q,
                                  int32_t h, int32_t hkv, int32_t d, float *q_new, float *q_plain, float *partial,
                                  float *out, const float *rotated, const int32_t *rank_of, int64_t rotated_width) {
    for (int32_t qh = 0; qh < h; qh++) {
        rope(q + qh * d, st->cos_new, st->sin_new, d, q_new + qh * d);
        if (st->split > 0) rope(q + qh * d, st->cos_plain, st->sin_plain, d, q_plain + qh * d);
    }
    const size_t elem = cache->half ? 2 : 4;
    spark_attn aj = {(const uint8_t *)cache->k + layer_off * elem, (const uint8_t *)cache->v + layer_off * elem,
                     cache->capacity, cache->half, st->slots, st->positions, st->cos_table, st->sin_table, st->width,
                     st->split, q_new, q_plain, h, hkv, d, 1.0f / sqrtf((float)d), 0, partial, out,
                     rank_of != NULL ? rotated : NULL, rank_of, rotated_width};
    return aj;
}

/* One token through every layer: x (C) is the token's embedding on entry and is updated in place (the residual
 * stream); writes its k, v into the cache; logits (V) = lm_head(final_norm(x)). partial: spark_attend_floats floats. */
void spark_decode(const spark_model *m, const spark_cache *cache, const spark_step *step, float *x, float *logits,
                  float *scratch, float *partial) {
    const int32_t c = m->hidden, h = m->n_heads, hkv = m->n_kv_heads, d = m->head_dim, inter = m->intermediate;
    const int32_t g = h / hkv, hd = h * d, kvd = hkv * d;
    const int64_t s = cache->capacity;
    float *hbuf = scratch;                  /* (C) normed input */
    float *qkv = hbuf + c;                  /* (H*D + 2*Hkv*D) */
    float *q_new = qkv + hd + 2 * kvd;      /* (H*D) queries rotated like the new key */
    float *q_plain = q_new + hd;            /* (H*D) queries at plain positions (split > 0) */
    float *att = q_plain + hd;              /* (H*D) attention output */
    float *gu = att + hd;                   /* (2*I) gate, up */
    const int32_t widest = c > inter ? (c > hd ? c : hd) : (inter > hd ? inter : hd);
    spark_act xq = act_in(gu + 2 * (int64_t)inter, (widest + QK - 1) / QK * QK, 1, 1); /* each matrix's quantized input */

    for (int32_t l = 0; l < m->n_layers; l++) {
        /* Attention block. */
        rms_norm(x, m->attn_norm[l], c, m->eps, hbuf);
        qgemv(&m->qkv[l], hbuf, c, qkv, &xq);
        const float *q = qkv, *k = qkv + hd, *v = qkv + hd + kvd;
        if (step->qsum) query_summary(q, hkv, g, d, step->qsum + (int64_t)l * kvd);
        const int64_t layer_off = (int64_t)l * hkv * s * d;
        store_kv(cache, layer_off, hkv, d, step->slot, k, v);
        spark_attn aj = token_attention(cache, layer_off, step, q, h, hkv, d, q_new, q_plain, partial, att, NULL, NULL, 0);
        spark_attend(&aj);
        qgemv(&m->o[l], att, hd, hbuf, &xq);
        for (int32_t i = 0; i < c; i++) x[i] += hbuf[i];

        /* MLP block. */
        rms_norm(x, m->mlp_norm[l], c, m->eps, hbuf);
        qgemv(&m->gate_up[l], hbuf, c, gu, &xq);
        for (int32_t i = 0; i < inter; i++) {
            const float gate = gu[i];
            gu[i] = gate / (1.0f + exp_approx(-gate)) * gu[inter + i];
        }
        qgemv(&m->down[l], gu, inter, hbuf, &xq);
        for (int32_t i = 0; i < c; i++) x[i] += hbuf[i];
    }
    rms_norm(x, m->final_norm, c, m->eps, hbuf);
    qgemv(m->lm_head, hbuf, c, logits, &xq);
}

/* ---------------------------------------------------------------------------------------------------------------
 * A step of T consecutive tokens of one row (a speculative verify, a short chunk), 1 < T <= SPARK_MAX_STEP_ROWS:
 * every matrix reads its weights once for the T rows (spark_qgemm's routes, whose rows equal one-row products bit
 * for bit), each token attends over its own addressing (spark_step: its slots, positions, rotations: the table and
 * the chunk's earlier tokens), so each row equals what T spark_decode calls give.
 * ------------------------------------------------------------------------------------------------------------- */

static int32_t round_qk(int32_t k) { return (k + QK - 1) / QK * QK; }

/* A matrix's total outputs over its chained parts, and the widest chained matrix (whose parts go through a copy). */
static int32_t chain_n(const spark_qmat *w) {
    int32_t n = 0;
    for (; w != NULL; w = w->next) n += w->n;
    return n;
}
static int32_t chained_widest(const spark_model *m) {
    int32_t widest = m->lm_head->next ? chain_n(m->lm_head) : 0;
    for (int32_t l = 0; l < m->n_layers; l++) {
        const spark_qmat *ws[4] = {&m->qkv[l], &m->o[l], &m->gate_up[l], &m->down[l]};
        for (int32_t i = 0; i < 4; i++)
            if (ws[i]->next && chain_n(ws[i]) > widest) widest = chain_n(ws[i]);
    }
    return widest;
}

/* Scratch floats spark_decode_rows needs for t rows of a model. */
int64_t spark_decode_rows_scratch_floats(const spark_model *m, int32_t t) {
    const int64_t cp = round_qk(m->hidden), hd = (int64_t)m->n_heads * m->head_dim, hdp = round_qk((int32_t)hd);
    const int64_t kv = (int64_t)m->n_kv_heads * m->head_dim, ip = round_qk(m->intermediate);
    const int64_t widest = cp > ip ? (cp > hdp ? cp : hdp) : (ip > hdp ? ip : hdp);
    /* h, qkv, attn out, gate_up, the MLP's product, projections, the parts' copy; q_new, q_plain; quantized activations */
    return t * (cp + hd + 2 * kv + hdp + 2 * (int64_t)m->intermediate + ip + m->hidden + chained_widest(m)) + 2 * hd +
           spark_act_bytes((int32_t)widest, t) / 4 + 16;
}

/* y (t, N) = x (t, K) W^T over every part of a chained matrix (x rows of w->k, padding zero): spark_qgemm per part,
 * a fused matrix's parts through `tmp` into their columns. */
static void qgemm_chain(const spark_qmat *w, const float *x, int32_t t, float *y, float *tmp, void *act) {
    if (w->next == NULL) {
        spark_qgemm(w, x, t, y, act);
        return;
    }
    const int32_t n = chain_n(w);
    for (int32_t col = 0; w != NULL; col += w->n, w = w->next) {
        spark_qgemm(w, x, t, tmp, act);
        for (int32_t r = 0; r < t; r++) memcpy(y + (int64_t)r * n + col, tmp + (int64_t)r * w->n, sizeof(float) * (size_t)w->n);
    }
}

/* The keys a step's tokens share: token r's rank i is rank rank_of[r][i] of the last token's addressing (the table
 * and the step's tokens, a superset of every earlier token's), each key at one position for all. A token whose
 * addressing is not such a subset (NULL) rotates its keys as it reads them. width 0: nothing shared (none is, or
 * the rotated keys would take more than SPARK_SHARED_KEYS_BYTES). */
#define SPARK_SHARED_KEYS_BYTES (32 << 20)
typedef struct {
    int64_t width;
    const int32_t *rank_of[SPARK_MAX_STEP_ROWS];
    int32_t *maps;
    int prefix; /* every token's addressing is the first ranks of the last one's (a chunk appended to the table) */
} shared_keys;

static shared_keys share_keys(const spark_step *steps, int32_t t_n, int64_t key_bytes) {
    shared_keys sh;
    memset(&sh, 0, sizeof sh);
    const spark_step *u = &steps[t_n - 1];
    if (t_n < 2 || u->width * key_bytes > SPARK_SHARED_KEYS_BYTES) return sh;
    int64_t total = 0;
    for (int32_t r = 0; r < t_n; r++) total += steps[r].width;
    sh.maps = malloc(sizeof(int32_t) * (size_t)(total > 0 ? total : 1));
    if (sh.maps == NULL) return sh;
    int32_t *map = sh.maps;
    int any = 0, prefix = 1;
    for (int32_t r = 0; r < t_n; r++) {
        const spark_step *st = &steps[r];
        int64_t j = 0, i = 0;
        for (; i < st->width; i++) { /* both in slot order */
            while (j < u->width && u->slots[j] < st->slots[i]) j++;
            if (j == u->width || u->slots[j] != st->slots[i] || u->positions[j] != st->positions[i]) break;
            prefix = prefix && j == i;
            map[i] = (int32_t)j++;
        }
        if (i == st->width) sh.rank_of[r] = map, map += st->width, any = 1;
        else prefix = 0;
    }
    sh.prefix = prefix;
    sh.width = any ? u->width : 0;
    return sh;
}

/* T tokens through every layer: x (T, C) their embeddings on entry, the residual streams on return; writes each
 * token's k, v at steps[t].slot; logits (T, V); steps[t].qsum (when set) gets token t's query summaries. partial:
 * spark_attend_floats for the widest step. Returns 0, doing nothing, for T outside [1, SPARK_MAX_STEP_ROWS]. */
int32_t spark_decode_rows(const spark_model *m, const spark_cache *cache, const spark_step *steps, int32_t t_count,
                          float *x, float *logits, float *scratch, float *partial) {
    if (t_count < 1 || t_count > SPARK_MAX_STEP_ROWS) return 0;
    const int32_t c = m->hidden, h = m->n_heads, hkv = m->n_kv_heads, d = m->head_dim, inter = m->intermediate;
    const int32_t g = h / hkv, hd = h * d, kvd = hkv * d, nqkv = hd + 2 * kvd;
    const int32_t cp = round_qk(c), hdp = round_qk(hd), ip = round_qk(inter), t_n = t_count;
    const int64_t s = cache->capacity;
    float *hbuf = scratch;                          /* (T, Cp) normed inputs, padding zero */
    float *qkv = hbuf + (int64_t)t_n * cp;          /* (T, H*D + 2*Hkv*D) */
    float *att = qkv + (int64_t)t_n * nqkv;         /* (T, HDp) attention outputs, padding zero */
    float *gu = att + (int64_t)t_n * hdp;           /* (T, 2*I) gate, up */
    float *act = gu + (int64_t)t_n * 2 * inter;     /* (T, Ip) silu(gate) * up, padding zero */
    float *proj = act + (int64_t)t_n * ip;          /* (T, C) the o and down projections */
    float *tmp = proj + (int64_t)t_n * c;           /* (T, widest chained N) */
    float *q_new = tmp + (int64_t)t_n * chained_widest(m); /* (H*D) one token's rotated queries */
    float *q_plain = q_new + hd;                    /* (H*D) */
    void *xq = q_plain + hd;                        /* quantized activations */
    memset(hbuf, 0, sizeof(float) * (size_t)t_n * cp);
    memset(att, 0, sizeof(float) * (size_t)t_n * hdp);
    memset(act, 0, sizeof(float) * (size_t)t_n * ip);
    const shared_keys shared = share_keys(steps, t_n, (int64_t)hkv * d * (int64_t)sizeof(float));
    float *rotated = shared.width > 0 ? malloc(sizeof(float) * (size_t)(hkv * shared.width * d)) : NULL;
    /* Every token's queries and partial results at once, so their attentions run as one job (attend_many); without
     * the memory, one token after another in the caller's scratch. */
    int32_t widest = 0;
    for (int32_t r = 0; r < t_n; r++) widest = steps[r].width > widest ? steps[r].width : widest;
    const int64_t per_token = 2 * (int64_t)hd + spark_attend_floats(h, d, widest);
    float *many = t_n > 1 ? malloc(sizeof(float) * (size_t)(t_n * per_token)) : NULL;

    for (int32_t l = 0; l < m->n_layers; l++) {
        /* Attention block: every token's k, v stored first (a token attends to the chunk's earlier ones). */
        for (int32_t r = 0; r < t_n; r++) rms_norm(x + (int64_t)r * c, m->attn_norm[l], c, m->eps, hbuf + (int64_t)r * cp);
        qgemm_chain(&m->qkv[l], hbuf, t_n, qkv, tmp, xq);
        const int64_t layer_off = (int64_t)l * hkv * s * d;
        for (int32_t r = 0; r < t_n; r++) {
            const float *k = qkv + (int64_t)r * nqkv + hd, *v = k + kvd;
            store_kv(cache, layer_off, hkv, d, steps[r].slot, k, v);
        }
        if (rotated != NULL) { /* the last token's keys, a superset of every other's: each rotated once */
            const spark_step *u = &steps[t_n - 1];
            const size_t elem = cache->half ? 2 : 4;
            spark_rotation job = {(const uint8_t *)cache->k + layer_off * elem, cache->half, hkv, d, s, shared.width,
                                  u->slots, u->positions, u->cos_table, u->sin_table, rotated};
            parallel_for(rotate_ranks, &job, (int32_t)shared.width);
        }
        spark_attn aj[SPARK_MAX_STEP_ROWS];
        for (int32_t r = 0; r < t_n; r++) {
            const spark_step *st = &steps[r];
            const float *q = qkv + (int64_t)r * nqkv;
            if (st->qsum) query_summary(q, hkv, g, d, st->qsum + (int64_t)l * kvd);
            float *mine = many != NULL ? many + r * per_token : NULL;
            aj[r] = token_attention(cache, layer_off, st, q, h, hkv, d, mine ? mine : q_new, mine ? mine + hd : q_plain,
                                    mine ? mine + 2 * hd : partial, att + (int64_t)r * hdp, rotated, shared.rank_of[r],
                                    shared.width);
            if (many == NULL) spark_attend(&aj[r]);
        }
        if (many != NULL) attend_many(aj, t_n, rotated != NULL && shared.prefix);
        qgemm_chain(&m->o[l], att, t_n, proj, tmp, xq);
        for (int32_t r = 0; r < t_n; r++)
            for (int32_t i = 0; i < c; i++) x[(int64_t)r * c + i] += proj[(int64_t)r * c + i];

        /* MLP block. */
        for (int32_t r = 0; r < t_n; r++) rms_norm(x + (int64_t)r * c, m->mlp_norm[l], c, m->eps, hbuf + (int64_t)r * cp);
        qgemm_chain(&m->gate_up[l], hbuf, t_n, gu, tmp, xq);
        for (int32_t r = 0; r < t_n; r++) {
            const float *gr = gu + (int64_t)r * 2 * inter;
            float *ar = act + (int64_t)r * ip;
            for (int32_t i = 0; i < inter; i++) {
                const float gate = gr[i];
                ar[i] = gate / (1.0f + exp_approx(-gate)) * gr[inter + i];
            }
        }
        qgemm_chain(&m->down[l], act, t_n, proj, tmp, xq);
        for (int32_t r = 0; r < t_n; r++)
            for (int32_t i = 0; i < c; i++) x[(int64_t)r * c + i] += proj[(int64_t)r * c + i];
    }
    for (int32_t r = 0; r < t_n; r++) rms_norm(x + (int64_t)r * c, m->final_norm, c, m->eps, hbuf + (int64_t)r * cp);
    qgemm_chain(m->lm_head, hbuf, t_n, logits, tmp, xq);
    free(many);
    free(rotated);
    free(shared.maps);
    return 1;
}

/* Rows `ids` (n) of a block matrix (N, K) as float32, out (n, K): the float operations of engine.model.quant.dequantize
 * (Q8_0: q * d; Q4_0: d * (nib - 8); Q4_1: d * nib + m; Q4_K, Q6_K: spark_kq_dequant_block), for the embedding a tied LM
 * head shares. Returns 1; 0 for a type these do not cover (the caller dequantizes in Python); -1, with nothing
 * written, for an id outside [0, N). */
int32_t spark_dequant_rows(const spark_qmat *w, const int64_t *ids, int32_t n, float *out) {
    if (w->type != SPARK_Q8_0 && w->type != SPARK_Q4_0 && w->type != SPARK_Q4_1 && !kq_dequant_type(w->type)) return 0;
    for (int32_t r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= w->n) return -1;
    if (kq_dequant_type(w->type)) {
        const int64_t rb = kq_row_bytes(w->type, w->k);
        for (int32_t r = 0; r < n; r++)
            for (int32_t b = 0; b < w->k / QK; b++) spark_kq_dequant_block(w->type, w->blocks + ids[r] * rb, b, out + (int64_t)r * w->k + (int64_t)b * QK);
        return 1;
    }
    const int32_t nb = w->k / QK, bb = block_bytes(w->type);
    for (int32_t r = 0; r < n; r++) {
        const uint8_t *row = w->blocks + ids[r] * (int64_t)nb * bb;
        float *o = out + (int64_t)r * w->k;
        for (int32_t b = 0; b < nb; b++, o += QK) {
            const uint8_t *blk = row + (int64_t)b * bb;
            const float d = f16_at(blk);
            if (w->type == SPARK_Q8_0) {
                for (int32_t i = 0; i < QK; i++) o[i] = (float)((const int8_t *)(blk + 2))[i] * d;
            } else if (w->type == SPARK_Q4_0) {
                for (int32_t i = 0; i < QK / 2; i++) {
                    o[i] = d * ((float)(blk[2 + i] & 0x0F) - 8.0f);
                    o[i + QK / 2] = d * ((float)(blk[2 + i] >> 4) - 8.0f);
                }
            } else {
                const float m = f16_at(blk + 2);
                for (int32_t i = 0; i < QK / 2; i++) {
                    o[i] = d * (float)(blk[4 + i] & 0x0F) + m;
                    o[i + QK / 2] = d * (float)(blk[4 + i] >> 4) + m;
                }
            }
        }
    }
    return 1;
}
