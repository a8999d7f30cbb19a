/* MLoT Spark native CPU kernels: block-quantized matrix products (GGUF's Q8_0, Q4_0, Q4_1 layouts) and a whole
 * single-token decode step, threaded over a persistent pool.
 *
 * Why C: decoding one token of a small model is ~120 matrix-vector products and ~600 tiny ops. From Python each
 * op costs microseconds of dispatch; one call per token removes that, and a matrix-vector kernel that streams the
 * quantized rows with the CPU's dot-product instructions runs near memory bandwidth.
 *
 * Built on first use by engine/backends/native/__init__.py with the machine's C compiler (-O3, tuned for this CPU) and
 * loaded with ctypes; when no compiler is present the engine keeps its PyTorch path. No Python headers, no
 * PyTorch headers: the ABI is plain pointers, described in engine/backends/native/__init__.py.
 *
 * Longer than the project's ~400 lines on purpose: one translation unit, so the decoding step inlines the block
 * kernels and the pool's dispatch, and the Arm checker (tests/engine/backends/native/arm_check.c) includes the whole thing.
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
 * Routes to those integers: a decoding step (one activation row) takes the weight rows in pairs with 256-bit
 * products (AVX2; AVX-512 VNNI), one row from each half of a thread's range; a prefill puts 16 tokens in the
 * lanes of one 512-bit product on AVX-512 (tokens_in_lanes, every block type), on AVX2 8 weight rows in the
 * lanes of a 256-bit one against each token broadcast (rows_in_lanes_t: Q8_0, Q4_0, Q4_1); up to 4 tokens (a
 * verify) take pairs of weight rows over them (dot_rows2); elsewhere it passes
 * each weight row over 12 tokens (dot_rows_r). Where the CPU has AMX (Sapphire Rapids on), 2 tokens or more of
 * Q8_0, Q4_0 and Q4_1 take its tiles instead (amx_gemm_t: 16 weight rows by up to 16 tokens a block product), so a
 * verify of a few tokens costs little more than a decoding step.
 */

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "spark_kernels.h"

int32_t spark_max_head_dim(void) { return SPARK_MAX_HEAD_DIM; }
int32_t spark_max_threads(void) { return SPARK_MAX_THREADS; }
int64_t spark_sizeof_qmat(void) { return (int64_t)sizeof(spark_qmat); }
int64_t spark_sizeof_model(void) { return (int64_t)sizeof(spark_model); }
int64_t spark_sizeof_cache(void) { return (int64_t)sizeof(spark_cache); }
int64_t spark_sizeof_step(void) { return (int64_t)sizeof(spark_step); }
int64_t spark_sizeof_attn(void) { return (int64_t)sizeof(spark_attn); }

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
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

/* ---------------------------------------------------------------------------------------------------------------
 * Persistent thread pool: workers are created once (spark_set_threads) and wait for jobs; a job splits [0, items)
 * into one contiguous range per thread, the caller running the first. Workers wait for the next job spinning for
 * SPARK_LINGER_NS (a decoding step issues ~150 jobs back to back; a prefill's products are a millisecond or more of
 * PyTorch attention apart, and a worker that slept through that gap costs a wake-up per product), offering the core
 * to the OS all along past the first few thousand spins, then sleep on a condition variable, so an idle engine
 * costs no CPU and the GUI thread is never starved. A second caller while a job runs (forked backends decoding at once)
 * runs its job on its own thread instead of waiting.
 * ------------------------------------------------------------------------------------------------------------- */

typedef void (*spark_job)(void *ctx, int32_t begin, int32_t end);

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

static void parallel_for(spark_job job, void *ctx, int32_t items) {
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
 * Block formats.
 * ------------------------------------------------------------------------------------------------------------- */


/* Activation rows quantized per block of 32 with one fp32 scale per block: as int8 (parts = 1, llama.cpp's Q8:
 * q = rint(x * 127 / amax), d = amax / 127) or as int16 (parts = 2, q = rint(x * 32767 / amax), d = amax / 32767:
 * ~16 bits; "parts" is the ABI's older name, from two int8 parts, which held ~15 bits at twice the products). q8 / q16 (M, K) share memory; d (M, K/32) the
 * scales, s the blocks' sums of q, ds = d * s (Q4_1's min term). */
typedef struct {
    int8_t *q8;
    int16_t *q16;
    float *d, *ds;
    int32_t *s;
    int32_t parts;
    /* The same int16 rows with the tokens in vector lanes (a prefill on AVX-512, tokens_in_lanes below),
     * for ceil(M/L) groups of L = SPARK_LANES tokens, absent tokens zero: tq (G, K/32, 16, L) int16 pairs, lane t
     * of vector (g, b, i) = elements 2i, 2i+1 of token Lg + t's block b; td, tds, ts (G, K/32, L) its d, ds, s. */
    int32_t *tq;
    float *td, *tds;
    int32_t *ts;
    /* With int8 rows (parts = 1, spark_kquants.c's Q4_K and Q6_K): tq (G, K/32, 8, L) int32, lane t of vector
     * (g, b, i) = elements 4i..4i+3 of token Lg + t's block b, and th (G, K/32, L) the sums of each block's first
     * 16 quants (Q6_K's halves take their activation sums), in tq's second half. */
    int32_t *th;
    /* One row only (a decoding step; NULL otherwise): its int16 quants as two bytes each, xh = q >> 8 (signed) and
     * xl = q & 255 (unsigned), and per block xc = 32768 * sum(xh): split_row below, for the byte-product routes
     * (block_lanes_split; spark_kquants.c's kq_split_dot, which reads xh and xl, or an int8 row's quants as xv, in
     * the order of its lanes, and xs, per half block of 16 sum(q) in that order: kq_split_act). */
    int8_t *xh;
    uint8_t *xl;
    int32_t *xc;
    int32_t *xs;
    int8_t *xv; /* in xh's place */
    /* One row only, AVX2 (in xh's place): its int16 quants for a Q4_0 or Q4_1 decoding step, each block's
     * elements in the order of block_lanes_nib's vectors: 0, 2, .., 14, 1, 3, .., 15, 16, 18, .., 30, 17, .., 31. */
    int16_t *xp;
} spark_act;

static int32_t block_bytes(int32_t type) { return type == SPARK_Q8_0 ? 34 : type == SPARK_Q4_1 ? 20 : 18; }

static inline int kq_type(int32_t type);          /* spark_kquants.c: Q5_0, Q5_1, the K-quants, IQ4_*, TQ*_0 */
static inline int32_t kq_block_bytes(int32_t type);

int32_t spark_block_bytes(int32_t type) {
    if (kq_type(type)) return kq_block_bytes(type);
    return type == SPARK_Q8_0 || type == SPARK_Q4_0 || type == SPARK_Q4_1 ? block_bytes(type) : 0;
}

/* Tokens a prefill's lane route takes at a time (on AVX-512 in the lanes of one 512-bit product, on AVX2 each
 * broadcast against 8 weight rows in a 256-bit one), and the fewest worth a group. A group costs the same however
 * few tokens fill it; below that many the row routes are faster (tests/engine/backends/native/qgemm_timing.c: about half a
 * group on AVX-512, three quarters on AVX2). */
#if defined(SPARK_AVX512VNNI) && defined(__AVX512BW__)
#define SPARK_ZMM 1 /* the 512-bit token-lane route, every block type */
#define SPARK_LANES 16
#define SPARK_LANES_MIN 8
#define SPARK_LANES_MIN_A8 2 /* int8 rows of Q4_K and Q6_K: their row route costs more than a group from 2 tokens */
#else
#define SPARK_LANES 8
#define SPARK_LANES_MIN 6
#endif
#if defined(SPARK_ZMM) || defined(SPARK_AVX2)
#define SPARK_TOKEN_LANES 1 /* a prefill takes a lane route (AVX2: Q8_0, Q4_0, Q4_1, by rows_in_lanes_t) */
#endif

/* Rows rounded up to whole groups of SPARK_LANES tokens: the token-lane copy's (a prefill's or a verify's on
 * AVX-512, from the fewest any type takes in lanes; none for one row, nor where that route is not built). */
static int64_t lane_rows(int32_t m) {
#if defined(SPARK_ZMM)
    return m >= SPARK_LANES_MIN_A8 ? ((int64_t)m + SPARK_LANES - 1) / SPARK_LANES * SPARK_LANES : 0;
#else
    (void)m;
    return 0;
#endif
}

#if defined(SPARK_ZMM)
/* Token group g's 16 lanes of output column j into y (M, N) (+ bias): the tokens of the group below m (a last
 * group's other lanes are computed, never stored). */
static inline void lanes_store(__m512 v, const struct spark_qmat *w, float *y, int32_t m, int64_t g, int32_t j) {
    const int32_t count = m - g * SPARK_LANES < SPARK_LANES ? (int32_t)(m - g * SPARK_LANES) : SPARK_LANES;
    float lanes[SPARK_LANES];
    _mm512_storeu_ps(lanes, v);
    const float bias = w->bias ? w->bias[j] : 0.0f;
    for (int32_t t = 0; t < count; t++) y[(g * SPARK_LANES + t) * w->n + j] = lanes[t] + bias;
}
#endif

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

/* Ask for `bytes` from p in cache before they are read (streams the hardware prefetcher does not foresee). */
static inline void prefetch_bytes(const uint8_t *p, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at, 0, 3);
}

static inline float f16_at(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

/* One block of 32: q = rint(x * qmax / amax) into q8 (qmax 127, parts 1) or q16 (qmax 32767, parts 2); returns
 * d = amax / qmax (0 for an all-zero block) and sets q's sum. */
static float quantize_block(const float *x, int32_t parts, int8_t *q8, int16_t *q16, int32_t *sum) {
#if defined(SPARK_AVX512VNNI) && defined(__AVX512BW__)
    /* The same operations 16 lanes at a time: max keeps the running value where |x| is NaN, as `v > amax` does;
     * the conversion rounds as lrintf (the current mode) and its out-of-range result, like lrintf's, has zero low
     * bits, so the truncated quants and their sum are the scalar loop's. */
    const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x1), _mm512_max_ps(_mm512_abs_ps(x0), _mm512_setzero_ps())));
    const float qmax = parts == 2 ? 32767.0f : 127.0f;
    const __m512 inv = _mm512_set1_ps(amax == 0.0f ? 0.0f : qmax / amax);
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
    const int bits = parts == 2 ? 16 : 24; /* sign-extend the stored low 16 (8) bits for the sum */
    const __m512i t0 = _mm512_srai_epi32(_mm512_slli_epi32(i0, bits), bits), t1 = _mm512_srai_epi32(_mm512_slli_epi32(i1, bits), bits);
    if (parts == 2) {
        _mm256_storeu_si256((__m256i *)q16, _mm512_cvtepi32_epi16(i0));
        _mm256_storeu_si256((__m256i *)(q16 + 16), _mm512_cvtepi32_epi16(i1));
    } else {
        _mm_storeu_si128((__m128i *)q8, _mm512_cvtepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(q8 + 16), _mm512_cvtepi32_epi8(i1));
    }
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(t0, t1));
    return amax / qmax;
#else
    float amax = 0.0f;
    for (int32_t i = 0; i < QK; i++) {
        const float v = fabsf(x[i]);
        amax = v > amax ? v : amax;
    }
    const float qmax = parts == 2 ? 32767.0f : 127.0f;
    const float inv = amax == 0.0f ? 0.0f : qmax / amax;
    int32_t s = 0;
    if (parts == 2) {
        for (int32_t i = 0; i < QK; i++) {
            q16[i] = (int16_t)lrintf(x[i] * inv);
            s += q16[i];
        }
    } else {
        for (int32_t i = 0; i < QK; i++) {
            q8[i] = (int8_t)lrintf(x[i] * inv);
            s += q8[i];
        }
    }
    *sum = s;
    return amax / qmax;
#endif
}

/* Quantize one row x (K, of which the first `valid` values are given: the rest are zeros, a matrix whose input
 * size is no multiple of 32 being padded with zero columns) into block `b0` onwards of a. */
static void quantize_row(const float *x, int32_t k, int32_t valid, spark_act *a, int64_t b0) {
    for (int32_t b = 0; b < k / QK; b++) {
        float padded[QK];
        const float *xb = x + b * QK;
        if ((b + 1) * QK > valid) {
            for (int32_t i = 0; i < QK; i++) padded[i] = b * QK + i < valid ? xb[i] : 0.0f;
            xb = padded;
        }
        const int64_t at = b0 + b;
        a->d[at] = quantize_block(xb, a->parts, a->q8 + at * QK, a->q16 + at * QK, &a->s[at]);
        a->ds[at] = a->d[at] * (float)a->s[at];
    }
}

/* Exact int32 products of one block: Q8_0 sum(wq * xq); Q4 sum(nib * xq), nibbles unsigned (0..15): byte i holds
 * element i in its low half and element i + 16 in its high half. `qs` points at the block's quants. Integer sums
 * are exact in any order, so each instruction set takes its own fastest route to the same number. */
#if defined(SPARK_AVX512VNNI) || defined(SPARK_AVX2)
typedef struct {
    __m256i u; /* unsigned bytes: |w| (Q8_0) or the nibbles */
    __m256i w; /* Q8_0's signed weights (their signs move onto x) */
} spark_wv;

static inline spark_wv load_w(int32_t type, const uint8_t *qs) {
    spark_wv v;
    if (type == SPARK_Q8_0) {
        v.w = _mm256_loadu_si256((const __m256i *)qs);
        v.u = _mm256_abs_epi8(v.w);
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
        const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F)), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
        v.u = _mm256_set_m128i(hi, lo);
        v.w = v.u;
    }
    return v;
}
/* 8 int32 lanes whose sum is the block's product with int8 activations: u8 times s8 without saturation. */
static inline __m256i block_lanes(int32_t type, spark_wv wv, const int8_t *xq) {
    __m256i x = _mm256_loadu_si256((const __m256i *)xq);
    if (type == SPARK_Q8_0) x = _mm256_sign_epi8(x, wv.w); /* |w| * (x * sign w) = w * x, w = -128 included */
#if defined(SPARK_AVX512VNNI)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv.u, x);
#else
    /* maddubs adds two u8 * s8 products into int16: |w| <= 128 and |x| <= 127 keep 2 * 128 * 127 < 32767. */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(wv.u, x), _mm256_set1_epi16(1));
#endif
}

typedef struct {
    __m256i lo, hi; /* the weights widened to int16: elements 0..15 and 16..31 */
} spark_w16;

static inline spark_w16 load_w16(int32_t type, const uint8_t *qs) {
    spark_w16 v;
    if (type == SPARK_Q8_0) {
        v.lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)qs));
        v.hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16)));
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0F);
        v.lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, mask));
        v.hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
    }
    return v;
}
/* 8 int32 lanes whose sum is the block's product with int16 activations: |w| <= 128, |x| <= 32767, so a pair's
 * sum and the block's total (< 2^27) stay within int32. */
static inline __m256i block_lanes16(spark_w16 w, const int16_t *x) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)x), x1 = _mm256_loadu_si256((const __m256i *)(x + 16));
#if defined(SPARK_AVX512VNNI)
    return _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), w.lo, x0), w.hi, x1);
#else
    return _mm256_add_epi32(_mm256_madd_epi16(w.lo, x0), _mm256_madd_epi16(w.hi, x1));
#endif
}
#if defined(SPARK_AVX512VNNI)
/* block_lanes16 for Q8_0 in two byte products, with no widening of the weights to int16:
 * x = 256 xh + xl, and w enters the xh product as the unsigned byte w + 128 (w ^ 0x80), so the lanes sum to
 * sum(w x) + 32768 sum(xh); the caller takes off a->xc per block. Exact integers: the same sums. */
static inline __m256i block_lanes_split(const uint8_t *qs, const spark_act *a, int64_t at) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)qs), wu = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
    const __m256i high = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wu, _mm256_loadu_si256((const __m256i *)(a->xh + at)));
    return _mm256_dpbusd_epi32(_mm256_slli_epi32(high, 8), _mm256_loadu_si256((const __m256i *)(a->xl + at)), w);
}
#endif
#if defined(SPARK_AVX2)
/* block_lanes16 of a Q4 block for a decoding step, against a->xp: the nibbles widened to int16 by shifts of the
 * block's 16 bytes (broadcast to both halves) within 32-bit words, not by two byte-to-word shuffles: a word's
 * nibble at bit 0 or 16 after a shift of 0 (low half) or 8 (high half) is the low nibble of an even or odd byte,
 * after 4 or 12 the high nibble. The pairs madd adds differ from block_lanes16's; the lanes' total is the same. */
static inline __m256i block_lanes_nib(const uint8_t *qs, const int16_t *xp) {
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs)), mask = _mm256_set1_epi32(0x000F000F);
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(raw, _mm256_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8)), mask);
    const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(raw, _mm256_setr_epi32(4, 4, 4, 4, 12, 12, 12, 12)), mask);
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xp)), _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xp + 16))));
}
#endif
/* The four blocks' sums from their lanes (integer adds: exact in any order). */
static inline __m128i hsum4(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}
#endif

/* The same products in plain C (the portable build; Arm's int16 path, which the compiler vectorizes). */
static inline int32_t dot16_c(int32_t type, const uint8_t *qs, const int16_t *x) {
    int32_t s = 0;
    if (type == SPARK_Q8_0) {
        for (int32_t i = 0; i < QK; i++) s += (int32_t)((const int8_t *)qs)[i] * x[i];
    } else {
        for (int32_t i = 0; i < QK / 2; i++) s += (int32_t)(qs[i] & 0x0F) * x[i] + (int32_t)(qs[i] >> 4) * x[i + QK / 2];
    }
    return s;
}

/* Block `at` of a's product with the block of quants `qs`. */
static inline int32_t block_dot(int32_t type, const uint8_t *qs, const spark_act *a, int64_t at) {
#if defined(SPARK_AVX512VNNI) || defined(SPARK_AVX2)
    const __m256i z = _mm256_setzero_si256();
    const __m256i lanes = a->parts == 2 ? block_lanes16(load_w16(type, qs), a->q16 + at * QK) : block_lanes(type, load_w(type, qs), a->q8 + at * QK);
    return _mm_cvtsi128_si32(hsum4(lanes, z, z, z));
#else
    if (a->parts == 2) return dot16_c(type, qs, a->q16 + at * QK);
    const int8_t *xq = a->q8 + at * QK;
#if defined(SPARK_NEON_DOT)
    const int8x16_t x0 = vld1q_s8(xq), x1 = vld1q_s8(xq + 16);
    if (type == SPARK_Q8_0) return vaddvq_s32(vdotq_s32(vdotq_s32(vdupq_n_s32(0), vld1q_s8((const int8_t *)qs), x0), vld1q_s8((const int8_t *)qs + 16), x1));
    const uint8x16_t raw = vld1q_u8(qs);
    const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0F))), hi = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
    return vaddvq_s32(vdotq_s32(vdotq_s32(vdupq_n_s32(0), lo, x0), hi, x1));
#else
    int32_t s = 0;
    if (type == SPARK_Q8_0) {
        for (int32_t i = 0; i < QK; i++) s += (int32_t)((const int8_t *)qs)[i] * xq[i];
    } else {
        for (int32_t i = 0; i < QK / 2; i++) s += (int32_t)(qs[i] & 0x0F) * xq[i] + (int32_t)(qs[i] >> 4) * xq[i + QK / 2];
    }
    return s;
#endif
#endif
}

/* The float term block b adds (the fixed formulas at the top of this file), from its exact integer sum. */
static inline float block_term(int32_t type, const uint8_t *blk, int32_t i, const spark_act *a, int64_t b) {
    const float dw = f16_at(blk);
    if (type == SPARK_Q4_0) i -= 8 * a->s[b];
    float t = (dw * a->d[b]) * (float)i;
    if (type == SPARK_Q4_1) t += f16_at(blk + 2) * a->ds[b];
    return t;
}

#if defined(SPARK_AVX512VNNI) || defined(SPARK_AVX2)
/* The weight side of blocks b .. b+3 (their d, and Q4_1's m), widened once for every activation row. */
static inline void block_scales4(int32_t type, const uint8_t *p, int32_t bb, __m128 *dw, __m128 *mw) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    /* The four fp16 scales gathered by one word permute of the blocks' first bytes (every scale sits at an even
     * offset: bb is even), not four scalar loads and inserts, which cost a decoding step more than the widening
     * of its weights. The loads stay inside the four blocks: 4 * bb >= 64 (Q4_0, Q4_1) and >= 128 (Q8_0). */
    const __m512i lo = _mm512_loadu_si512(p);
    __m512i dm; /* words 0..3: d of blocks 0..3; Q4_1: words 4..7, their m */
    if (type == SPARK_Q8_0) {
        dm = _mm512_permutex2var_epi16(lo, _mm512_zextsi128_si512(_mm_setr_epi16(0, 17, 34, 51, 0, 0, 0, 0)), _mm512_loadu_si512(p + 64));
    } else {
        const int16_t w = (int16_t)(bb / 2);
        dm = _mm512_permutexvar_epi16(_mm512_zextsi128_si512(_mm_setr_epi16(0, w, 2 * w, 3 * w, 1, w + 1, 2 * w + 1, 3 * w + 1)), lo);
    }
    const __m128i dm128 = _mm512_castsi512_si128(dm);
    *dw = _mm_cvtph_ps(dm128);
    if (type == SPARK_Q4_1) *mw = _mm_cvtph_ps(_mm_unpackhi_epi64(dm128, dm128));
#else
    int32_t w32[4]; /* each block's first 4 bytes: d, then m (Q4_1) or quants */
    for (int32_t j = 0; j < 4; j++) memcpy(&w32[j], p + j * bb, 4);
    const __m128i dm = _mm_setr_epi32(w32[0], w32[1], w32[2], w32[3]);
    *dw = _mm_cvtph_ps(_mm_shuffle_epi8(dm, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1)));
    if (type == SPARK_Q4_1) *mw = _mm_cvtph_ps(_mm_shuffle_epi8(dm, _mm_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1)));
#endif
}
/* block_term for blocks b .. b+3 at once: the same float operations in the same order, one lane per block. */
static inline __m128 block_terms4(int32_t type, __m128 dw, __m128 mw, __m128i i, const spark_act *a, int64_t b) {
    if (type == SPARK_Q4_0) i = _mm_sub_epi32(i, _mm_slli_epi32(_mm_loadu_si128((const __m128i *)(a->s + b)), 3));
    __m128 t = _mm_mul_ps(_mm_mul_ps(dw, _mm_loadu_ps(a->d + b)), _mm_cvtepi32_ps(i));
    if (type == SPARK_Q4_1) t = _mm_add_ps(t, _mm_mul_ps(mw, _mm_loadu_ps(a->ds + b)));
    return t;
}
#endif

/* out[t] = sum_k w[row, k] x_t[k] for one row of blocks and R <= SPARK_ROWS (12) quantized activation rows, row t starting at
 * block b0[t]. The weight blocks are unpacked once for all R rows; each row's sum takes the same steps as for R = 1,
 * so a prefill and one-row decodes agree bit for bit. Inlined per R (spark_dot_rows below), so the R rows'
 * accumulators live in registers. */
#define SPARK_ROWS 12
static inline __attribute__((always_inline)) void dot_rows_r(int32_t type, const uint8_t *row, int32_t nb, const spark_act *a, const int64_t *b0, const int32_t r_count, float *out) {
    const int32_t bb = block_bytes(type), off = type == SPARK_Q4_1 ? 4 : 2;
    float acc[SPARK_ROWS][8] = {{0}};
    int32_t b = 0;
#if defined(SPARK_AVX512VNNI) || defined(SPARK_AVX2)
    /* Per row, the partial sums of blocks of this group's parity (cur) and of the next group's (next): b % 8 for
     * b in groups of 4 is acc[0..3] for even groups, acc[4..7] for odd ones; the two swap roles every group. */
    __m128 cur[SPARK_ROWS], next[SPARK_ROWS];
    for (int32_t t = 0; t < r_count; t++) cur[t] = next[t] = _mm_setzero_ps();
    for (; b + 4 <= nb; b += 4) {
        const uint8_t *p = row + (int64_t)b * bb;
        __m128 dw, mw = _mm_setzero_ps();
        block_scales4(type, p, bb, &dw, &mw);
        __m128i isum[SPARK_ROWS];
        if (a->parts == 2) {
            const spark_w16 w0 = load_w16(type, p + off), w1 = load_w16(type, p + bb + off), w2 = load_w16(type, p + 2 * bb + off), w3 = load_w16(type, p + 3 * bb + off);
            for (int32_t t = 0; t < r_count; t++) {
                const int16_t *q = a->q16 + (b0[t] + b) * QK;
                isum[t] = hsum4(block_lanes16(w0, q), block_lanes16(w1, q + QK), block_lanes16(w2, q + 2 * QK), block_lanes16(w3, q + 3 * QK));
            }
        } else {
            const spark_wv w0 = load_w(type, p + off), w1 = load_w(type, p + bb + off), w2 = load_w(type, p + 2 * bb + off), w3 = load_w(type, p + 3 * bb + off);
            for (int32_t t = 0; t < r_count; t++) {
                const int8_t *q = a->q8 + (b0[t] + b) * QK;
                isum[t] = hsum4(block_lanes(type, w0, q), block_lanes(type, w1, q + QK), block_lanes(type, w2, q + 2 * QK), block_lanes(type, w3, q + 3 * QK));
            }
        }
        for (int32_t t = 0; t < r_count; t++) {
            const __m128 sum = _mm_add_ps(cur[t], block_terms4(type, dw, mw, isum[t], a, b0[t] + b));
            cur[t] = next[t];
            next[t] = sum;
        }
    }
    const int32_t odd = (b >> 2) & 1; /* groups done: after an odd count, cur holds the odd groups' sums */
    for (int32_t t = 0; t < r_count; t++) {
        _mm_storeu_ps(acc[t] + (odd ? 4 : 0), cur[t]);
        _mm_storeu_ps(acc[t] + (odd ? 0 : 4), next[t]);
    }
#endif
    for (int32_t t = 0; t < r_count; t++) {
        float *ac = acc[t];
        for (int32_t c = b; c < nb; c++) {
            const uint8_t *p = row + (int64_t)c * bb;
            ac[c & 7] += block_term(type, p, block_dot(type, p + off, a, b0[t] + c), a, b0[t] + c);
        }
        out[t] = ((ac[0] + ac[4]) + (ac[1] + ac[5])) + ((ac[2] + ac[6]) + (ac[3] + ac[7]));
    }
}

#if defined(SPARK_AVX512VNNI) || defined(SPARK_AVX2)
/* dot_rows_r over two weight rows at once for a few int16 activation rows (a verify's): two independent chains per
 * token for the core to overlap, as dot_pair16 has for one. Each output takes dot_rows_r's steps: the same bits. */
static inline __attribute__((always_inline)) void dot_rows2_r(const int32_t type, const uint8_t *ra, const uint8_t *rb, int32_t nb, const spark_act *a, const int64_t *b0, const int32_t r_count, float *out_a, float *out_b) {
    const int32_t bb = block_bytes(type), off = type == SPARK_Q4_1 ? 4 : 2;
    __m128 cur[2][4], next[2][4];
    for (int32_t t = 0; t < r_count; t++) cur[0][t] = next[0][t] = cur[1][t] = next[1][t] = _mm_setzero_ps();
    int32_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        const uint8_t *pa = ra + (int64_t)b * bb, *pb = rb + (int64_t)b * bb;
        __m128 dwa, mwa = _mm_setzero_ps(), dwb, mwb = _mm_setzero_ps();
        block_scales4(type, pa, bb, &dwa, &mwa);
        block_scales4(type, pb, bb, &dwb, &mwb);
        const spark_w16 a0 = load_w16(type, pa + off), a1 = load_w16(type, pa + bb + off), a2 = load_w16(type, pa + 2 * bb + off), a3 = load_w16(type, pa + 3 * bb + off);
        const spark_w16 c0 = load_w16(type, pb + off), c1 = load_w16(type, pb + bb + off), c2 = load_w16(type, pb + 2 * bb + off), c3 = load_w16(type, pb + 3 * bb + off);
        for (int32_t t = 0; t < r_count; t++) {
            const int16_t *q = a->q16 + (b0[t] + b) * QK;
            const __m128i ia = hsum4(block_lanes16(a0, q), block_lanes16(a1, q + QK), block_lanes16(a2, q + 2 * QK), block_lanes16(a3, q + 3 * QK));
            const __m128i ib = hsum4(block_lanes16(c0, q), block_lanes16(c1, q + QK), block_lanes16(c2, q + 2 * QK), block_lanes16(c3, q + 3 * QK));
            const __m128 sa = _mm_add_ps(cur[0][t], block_terms4(type, dwa, mwa, ia, a, b0[t] + b));
            const __m128 sb = _mm_add_ps(cur[1][t], block_terms4(type, dwb, mwb, ib, a, b0[t] + b));
            cur[0][t] = next[0][t], next[0][t] = sa, cur[1][t] = next[1][t], next[1][t] = sb;
        }
    }
    const int32_t odd = (b >> 2) & 1;
    for (int32_t r = 0; r < 2; r++) {
        const uint8_t *row = r ? rb : ra;
        float *out = r ? out_b : out_a;
        for (int32_t t = 0; t < r_count; t++) {
            float ac[8];
            _mm_storeu_ps(ac + (odd ? 4 : 0), cur[r][t]);
            _mm_storeu_ps(ac + (odd ? 0 : 4), next[r][t]);
            for (int32_t c = b; c < nb; c++) {
                const uint8_t *p = row + (int64_t)c * bb;
                ac[c & 7] += block_term(type, p, block_dot(type, p + off, a, b0[t] + c), a, b0[t] + c);
            }
            out[t] = ((ac[0] + ac[4]) + (ac[1] + ac[5])) + ((ac[2] + ac[6]) + (ac[3] + ac[7]));
        }
    }
}
#define SPARK_DOT_ROWS2_T(TYPE)                                                                                         \
    static void dot_rows2_##TYPE(const uint8_t *ra, const uint8_t *rb, int32_t nb, const spark_act *a, const int64_t *b0, int32_t r_count, float *oa, float *ob) { \
        switch (r_count) {                                                                                              \
        case 1: dot_rows2_r(TYPE, ra, rb, nb, a, b0, 1, oa, ob); break;                                                 \
        case 2: dot_rows2_r(TYPE, ra, rb, nb, a, b0, 2, oa, ob); break;                                                 \
        case 3: dot_rows2_r(TYPE, ra, rb, nb, a, b0, 3, oa, ob); break;                                                 \
        default: dot_rows2_r(TYPE, ra, rb, nb, a, b0, 4, oa, ob); break;                                                \
        }                                                                                                               \
    }
SPARK_DOT_ROWS2_T(SPARK_Q8_0)
SPARK_DOT_ROWS2_T(SPARK_Q4_0)
SPARK_DOT_ROWS2_T(SPARK_Q4_1)
#undef SPARK_DOT_ROWS2_T
/* Two weight rows against r_count <= 4 int16 activation rows; 0 where this build or format has no such route. */
static int32_t dot_rows2(int32_t type, const uint8_t *ra, const uint8_t *rb, int32_t nb, const spark_act *a, const int64_t *b0, int32_t r_count, float *oa, float *ob) {
    if (a->parts != 2 || r_count > 4) return 0;
    switch (type) {
    case SPARK_Q8_0: dot_rows2_SPARK_Q8_0(ra, rb, nb, a, b0, r_count, oa, ob); return 1;
    case SPARK_Q4_0: dot_rows2_SPARK_Q4_0(ra, rb, nb, a, b0, r_count, oa, ob); return 1;
    case SPARK_Q4_1: dot_rows2_SPARK_Q4_1(ra, rb, nb, a, b0, r_count, oa, ob); return 1;
    default: return 0;
    }
}
#endif

/* dot_rows_r compiled per type and row count, so its branches on the type fold away as dot_pair16's do. */
#define SPARK_DOT_ROWS_T(TYPE)                                                                                          \
    static void dot_rows_##TYPE(const uint8_t *row, int32_t nb, const spark_act *a, const int64_t *b0, int32_t r_count, float *out) { \
        switch (r_count) {                                                                                              \
        case 1: dot_rows_r(TYPE, row, nb, a, b0, 1, out); break;                                                        \
        case 2: dot_rows_r(TYPE, row, nb, a, b0, 2, out); break;                                                        \
        case 3: dot_rows_r(TYPE, row, nb, a, b0, 3, out); break;                                                        \
        case 4: dot_rows_r(TYPE, row, nb, a, b0, 4, out); break;                                                        \
        case 5: dot_rows_r(TYPE, row, nb, a, b0, 5, out); break;                                                        \
        case 6: dot_rows_r(TYPE, row, nb, a, b0, 6, out); break;                                                        \
        case 7: dot_rows_r(TYPE, row, nb, a, b0, 7, out); break;                                                        \
        case 8: dot_rows_r(TYPE, row, nb, a, b0, 8, out); break;                                                        \
        case 9: dot_rows_r(TYPE, row, nb, a, b0, 9, out); break;                                                        \
        case 10: dot_rows_r(TYPE, row, nb, a, b0, 10, out); break;                                                      \
        case 11: dot_rows_r(TYPE, row, nb, a, b0, 11, out); break;                                                      \
        default: dot_rows_r(TYPE, row, nb, a, b0, SPARK_ROWS, out); break;                                              \
        }                                                                                                               \
    }
SPARK_DOT_ROWS_T(SPARK_Q8_0)
SPARK_DOT_ROWS_T(SPARK_Q4_0)
SPARK_DOT_ROWS_T(SPARK_Q4_1)
#undef SPARK_DOT_ROWS_T

static void dot_rows(int32_t type, const uint8_t *row, int32_t nb, const spark_act *a, const int64_t *b0, int32_t r_count, float *out) {
    switch (type) {
    case SPARK_Q8_0: dot_rows_SPARK_Q8_0(row, nb, a, b0, r_count, out); break;
    case SPARK_Q4_0: dot_rows_SPARK_Q4_0(row, nb, a, b0, r_count, out); break;
    default: dot_rows_SPARK_Q4_1(row, nb, a, b0, r_count, out); break;
    }
}

#if defined(SPARK_AVX512VNNI) || defined(SPARK_AVX2)
/* dot_rows for one int16 activation row (a decoding step) and two weight rows at once: two independent chains
 * for the core to overlap, the activation blocks loaded once for both. Each row's sum takes dot_rows's steps. */
static inline __attribute__((always_inline)) void dot_pair16_t(const int32_t type, const uint8_t *ra, const uint8_t *rb, int32_t nb, const spark_act *a, float *out) {
    const int32_t bb = block_bytes(type), off = type == SPARK_Q4_1 ? 4 : 2;
    __m128 cur_a = _mm_setzero_ps(), next_a = _mm_setzero_ps(), cur_b = _mm_setzero_ps(), next_b = _mm_setzero_ps();
    int32_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        const uint8_t *pa = ra + (int64_t)b * bb, *pb = rb + (int64_t)b * bb;
        const int16_t *q = a->q16 + (int64_t)b * QK;
        __m256i la[4], lb[4];
        __m128i split = _mm_setzero_si128(); /* what block_lanes_split's sums carry over the products */
#if defined(SPARK_AVX512VNNI)
        if (type == SPARK_Q8_0) {
            for (int32_t j = 0; j < 4; j++) {
                la[j] = block_lanes_split(pa + j * bb + off, a, (int64_t)(b + j) * QK);
                lb[j] = block_lanes_split(pb + j * bb + off, a, (int64_t)(b + j) * QK);
            }
            split = _mm_loadu_si128((const __m128i *)(a->xc + b));
        } else
#endif
#if defined(SPARK_AVX2)
        if (type != SPARK_Q8_0) {
            for (int32_t j = 0; j < 4; j++) {
                la[j] = block_lanes_nib(pa + j * bb + off, a->xp + (int64_t)(b + j) * QK);
                lb[j] = block_lanes_nib(pb + j * bb + off, a->xp + (int64_t)(b + j) * QK);
            }
        } else
#endif
        {
            for (int32_t j = 0; j < 4; j++) {
                const spark_w16 wa = load_w16(type, pa + j * bb + off), wb = load_w16(type, pb + j * bb + off);
                la[j] = block_lanes16(wa, q + j * QK);
                lb[j] = block_lanes16(wb, q + j * QK);
            }
        }
        __m128 dwa, mwa = _mm_setzero_ps(), dwb, mwb = _mm_setzero_ps();
        block_scales4(type, pa, bb, &dwa, &mwa);
        block_scales4(type, pb, bb, &dwb, &mwb);
        const __m128i ia = _mm_sub_epi32(hsum4(la[0], la[1], la[2], la[3]), split), ib = _mm_sub_epi32(hsum4(lb[0], lb[1], lb[2], lb[3]), split);
        const __m128 sa = _mm_add_ps(cur_a, block_terms4(type, dwa, mwa, ia, a, b));
        const __m128 sb = _mm_add_ps(cur_b, block_terms4(type, dwb, mwb, ib, a, b));
        cur_a = next_a, next_a = sa, cur_b = next_b, next_b = sb;
    }
    const int32_t odd = (b >> 2) & 1;
    float acc[2][8];
    _mm_storeu_ps(acc[0] + (odd ? 4 : 0), cur_a);
    _mm_storeu_ps(acc[0] + (odd ? 0 : 4), next_a);
    _mm_storeu_ps(acc[1] + (odd ? 4 : 0), cur_b);
    _mm_storeu_ps(acc[1] + (odd ? 0 : 4), next_b);
    for (int32_t r = 0; r < 2; r++) {
        const uint8_t *row = r ? rb : ra;
        float *ac = acc[r];
        for (int32_t c = b; c < nb; c++) {
            const uint8_t *p = row + (int64_t)c * bb;
            ac[c & 7] += block_term(type, p, block_dot(type, p + off, a, c), a, c);
        }
        out[r] = ((ac[0] + ac[4]) + (ac[1] + ac[5])) + ((ac[2] + ac[6]) + (ac[3] + ac[7]));
    }
}
/* dot_pair16_t compiled per type, so its branches on the type fold away. */
static void dot_pair16(int32_t type, const uint8_t *ra, const uint8_t *rb, int32_t nb, const spark_act *a, float *out) {
    switch (type) {
    case SPARK_Q8_0: dot_pair16_t(SPARK_Q8_0, ra, rb, nb, a, out); break;
    case SPARK_Q4_0: dot_pair16_t(SPARK_Q4_0, ra, rb, nb, a, out); break;
    default: dot_pair16_t(SPARK_Q4_1, ra, rb, nb, a, out); break;
    }
}
#endif

#include "spark_kquants.c" /* Q5_0, Q5_1, the K-quants, IQ4_NL/XS, TQ1_0/TQ2_0: kq_gemm_rows */

#if defined(SPARK_ZMM)
/* Prefill on AVX-512 with the tokens in the lanes: one 512-bit product adds a pair of weights (broadcast) times the
 * same pair of 16 tokens' activations, so 16 products give 16 tokens' exact block sums, one per lane, with no
 * horizontal sum (a block per vector, the 256-bit route's layout, needs one per block and token); the float terms
 * then run 16 tokens at once, each lane taking block_term's operations in block order. */

/* Token-lane copy of a's m rows of nb blocks (spark_act's tq, td, tds, ts), absent tokens of the last group zero. */
static void lanes_in(spark_act *a, int32_t m, int32_t nb) {
    const int64_t groups = lane_rows(m) / SPARK_LANES;
    for (int64_t g = 0; g < groups; g++)
        for (int32_t t = 0; t < SPARK_LANES; t++) {
            const int64_t tok = g * SPARK_LANES + t;
            for (int32_t b = 0; b < nb; b++) {
                const int64_t at = (g * nb + b) * SPARK_LANES + t; /* lane t of block b's scalars */
                int32_t *q = a->tq + (g * nb + b) * (QK / 2) * SPARK_LANES + t;
                if (a->parts == 1) { /* int8: four elements a lane, and the first half's sum */
                    int32_t *q8 = a->tq + (g * nb + b) * (QK / 4) * SPARK_LANES + t, half = 0;
                    const int8_t *x = tok < m ? a->q8 + (tok * nb + b) * QK : NULL;
                    for (int32_t i = 0; i < QK / 4; i++) {
                        if (x != NULL) memcpy(&q8[i * SPARK_LANES], x + 4 * i, 4);
                        else q8[i * SPARK_LANES] = 0;
                    }
                    for (int32_t i = 0; x != NULL && i < QK / 2; i++) half += x[i];
                    a->th[at] = half;
                } else if (tok < m) {
                    const int16_t *x = a->q16 + (tok * nb + b) * QK;
                    for (int32_t i = 0; i < QK / 2; i++) memcpy(&q[i * SPARK_LANES], x + 2 * i, 4);
                } else {
                    for (int32_t i = 0; i < QK / 2; i++) q[i * SPARK_LANES] = 0;
                }
                if (tok < m) {
                    a->td[at] = a->d[tok * nb + b], a->tds[at] = a->ds[tok * nb + b], a->ts[at] = a->s[tok * nb + b];
                } else {
                    a->td[at] = a->tds[at] = 0.0f, a->ts[at] = 0;
                }
            }
        }
}

/* out[r] (16 token lanes) = weight row rows[r] (r < R) times the 16 tokens of group g: per 8 blocks, each row's
 * quants widened to int16 once (wide), then per block 16 products per row into two chains (pairs i even, odd). */
static inline __attribute__((always_inline)) void tokens_in_lanes(const int32_t type, const uint8_t *const *rows, const int32_t R, int32_t nb, const spark_act *a, int64_t g, __m512 *out) {
    const int32_t bb = block_bytes(type), off = type == SPARK_Q4_1 ? 4 : 2;
    __m512 acc[2][8];
    for (int32_t r = 0; r < R; r++)
        for (int32_t u = 0; u < 8; u++) acc[r][u] = _mm512_setzero_ps();
    for (int32_t b8 = 0; b8 < nb; b8 += 8) {
        const int32_t count = nb - b8 < 8 ? nb - b8 : 8;
        int32_t wide[2][8][QK / 2] __attribute__((aligned(64))); /* int16 pairs: block u's weights 2i, 2i+1 */
        for (int32_t r = 0; r < R; r++)
            for (int32_t u = 0; u < count; u++) {
                const spark_w16 w = load_w16(type, rows[r] + (int64_t)(b8 + u) * bb + off);
                _mm512_store_si512(wide[r][u], _mm512_inserti64x4(_mm512_castsi256_si512(w.lo), w.hi, 1));
            }
#pragma GCC unroll 8
        for (int32_t u = 0; u < 8; u++) {
            if (u >= count) break;
            const int64_t at = (g * nb + b8 + u) * SPARK_LANES;
            const int32_t *xq = a->tq + at * (QK / 2);
            __m512i s[2][2];
            for (int32_t r = 0; r < R; r++) s[r][0] = s[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 16
            for (int32_t i = 0; i < QK / 2; i++) {
                const __m512i x = _mm512_load_si512(xq + i * SPARK_LANES);
                for (int32_t r = 0; r < R; r++) s[r][i & 1] = _mm512_dpwssd_epi32(s[r][i & 1], x, _mm512_set1_epi32(wide[r][u][i]));
            }
            const __m512 d = _mm512_loadu_ps(a->td + at);
            for (int32_t r = 0; r < R; r++) {
                const uint8_t *blk = rows[r] + (int64_t)(b8 + u) * bb;
                __m512i isum = _mm512_add_epi32(s[r][0], s[r][1]);
                if (type == SPARK_Q4_0) isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(_mm512_loadu_si512(a->ts + at), 3));
                __m512 t = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(f16_at(blk)), d), _mm512_cvtepi32_ps(isum));
                if (type == SPARK_Q4_1) t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_set1_ps(f16_at(blk + 2)), _mm512_loadu_ps(a->tds + at)));
                acc[r][u] = _mm512_add_ps(acc[r][u], t);
            }
        }
    }
    for (int32_t r = 0; r < R; r++)
        out[r] = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][4]), _mm512_add_ps(acc[r][1], acc[r][5])),
                               _mm512_add_ps(_mm512_add_ps(acc[r][2], acc[r][6]), _mm512_add_ps(acc[r][3], acc[r][7])));
}
#endif

#if defined(SPARK_AVX2)
/* out[i] lane r = in[r] lane i: an 8 x 8 transpose of int32 (pairs of rows interleaved, then quads, then halves). */
static inline void transpose8x32(const __m256i *in, __m256i *out) {
    __m256i t[8], u[8];
    for (int32_t r = 0; r < 8; r += 2) {
        t[r] = _mm256_unpacklo_epi32(in[r], in[r + 1]);     /* rows r, r+1 at lanes 0, 1 | 4, 5 */
        t[r + 1] = _mm256_unpackhi_epi32(in[r], in[r + 1]); /* at lanes 2, 3 | 6, 7 */
    }
    for (int32_t r = 0; r < 8; r += 4)
        for (int32_t h = 0; h < 2; h++) {
            u[r + h] = _mm256_unpacklo_epi64(t[r + h], t[r + h + 2]);     /* rows r..r+3 at lane 0 | 4 (h = 1: 2 | 6) */
            u[r + h + 2] = _mm256_unpackhi_epi64(t[r + h], t[r + h + 2]); /* at lane 1 | 5 (h = 1: 3 | 7) */
        }
    const int32_t at[4] = {0, 2, 1, 3}; /* the u holding lane i | i + 4 */
    for (int32_t i = 0; i < 4; i++) {
        out[i] = _mm256_permute2x128_si256(u[at[i]], u[4 + at[i]], 0x20);
        out[i + 4] = _mm256_permute2x128_si256(u[at[i]], u[4 + at[i]], 0x31);
    }
}

/* Prefill on AVX2 with 8 weight rows in the lanes and the tokens broadcast (Q8_0, Q4_0, Q4_1). With the tokens in
 * the lanes instead (as on AVX-512), each weight pair is broadcast from a register, two shuffles a product on the
 * one shuffle port, which bounded that route; here the 8 rows' blocks are widened and transposed once into wt,
 * (nb, 16, 8) int16 pairs (pair i of row r at [b][i][r]), with dw (nb, 8) their scales and mw (nb, 8) Q4_1's
 * minimums, and each token's pair comes straight from memory as a broadcast load, so a product is a madd and an
 * add. Per row and token: the same integer block sums and the same float operations in the same order as every
 * other route (block terms into 8 partial sums by block mod 8, added in the same tree), so the same bits. wt holds
 * nb * (128 int32 + 16 floats). */
static inline __attribute__((always_inline)) void rows_in_lanes_t(const int32_t type, const spark_qmat *w, const spark_act *a, float *y, int32_t m, int32_t begin, int32_t end, int32_t *wt) {
    const int32_t nb = w->k / QK, n = w->n, bb = block_bytes(type), off = type == SPARK_Q4_1 ? 4 : 2;
    const int64_t row_bytes = (int64_t)nb * bb;
    float *dw = (float *)(wt + (int64_t)nb * (QK / 2) * 8), *mw = dw + (int64_t)nb * 8;
    const int32_t *x32 = (const int32_t *)a->q16; /* token t's pair p at x32[t * nb * 16 + p] */
    for (int32_t j = begin; j < end; j += 8) {
        const int32_t rows = end - j < 8 ? end - j : 8;
        for (int32_t b = 0; b < nb; b++) {
            __m256i lo[8], hi[8]; /* row r's pairs 0-7 and 8-15, transposed below into pair i's 8 rows */
            for (int32_t r = 0; r < 8; r++) {
                float d = 0.0f, mn = 0.0f; /* rows past the range: zero weights, their lanes never stored */
                lo[r] = hi[r] = _mm256_setzero_si256();
                if (r < rows) {
                    const uint8_t *blk = w->blocks + (j + r) * row_bytes + (int64_t)b * bb;
                    const spark_w16 q = load_w16(type, blk + off);
                    lo[r] = q.lo, hi[r] = q.hi;
                    d = f16_at(blk);
                    if (type == SPARK_Q4_1) mn = f16_at(blk + 2);
                }
                dw[(int64_t)b * 8 + r] = d, mw[(int64_t)b * 8 + r] = mn;
            }
            transpose8x32(lo, (__m256i *)(wt + (int64_t)b * (QK / 2) * 8));
            transpose8x32(hi, (__m256i *)(wt + ((int64_t)b * (QK / 2) + 8) * 8));
        }
        for (int32_t t0 = 0; t0 < m; t0 += 8) {
            const int32_t count = m - t0 < 8 ? m - t0 : 8;
            const int32_t *xt[8];
            int64_t at[8]; /* token t's first block in a->d, ds, s */
            for (int32_t t = 0; t < 8; t++) { /* tokens past m repeat token t0: computed, never stored */
                const int64_t tok = t0 + (t < count ? t : 0);
                xt[t] = x32 + tok * nb * (QK / 2);
                at[t] = tok * nb;
            }
            __m256 acc[8][8];
            for (int32_t t = 0; t < 8; t++)
                for (int32_t u = 0; u < 8; u++) acc[t][u] = _mm256_setzero_ps();
            for (int32_t b = 0; b < nb; b++) {
                const int32_t *wb = wt + (int64_t)b * (QK / 2) * 8;
                __m256i s[8];
                for (int32_t t = 0; t < 8; t++) s[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
                for (int32_t i = 0; i < QK / 2; i++) {
                    const __m256i wv = _mm256_load_si256((const __m256i *)(wb + i * 8));
                    for (int32_t t = 0; t < 8; t++) s[t] = _mm256_add_epi32(s[t], _mm256_madd_epi16(wv, _mm256_set1_epi32(xt[t][b * (QK / 2) + i])));
                }
                const __m256 d = _mm256_loadu_ps(dw + (int64_t)b * 8);
                for (int32_t t = 0; t < 8; t++) {
                    __m256i isum = s[t];
                    if (type == SPARK_Q4_0) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(a->s[at[t] + b] << 3));
                    __m256 term = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(a->d[at[t] + b])), _mm256_cvtepi32_ps(isum));
                    if (type == SPARK_Q4_1) term = _mm256_add_ps(term, _mm256_mul_ps(_mm256_loadu_ps(mw + (int64_t)b * 8), _mm256_set1_ps(a->ds[at[t] + b])));
                    acc[t][b & 7] = _mm256_add_ps(acc[t][b & 7], term);
                }
            }
            for (int32_t t = 0; t < count; t++) {
                const __m256 out = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][4]), _mm256_add_ps(acc[t][1], acc[t][5])),
                                                 _mm256_add_ps(_mm256_add_ps(acc[t][2], acc[t][6]), _mm256_add_ps(acc[t][3], acc[t][7])));
                float lanes[8];
                _mm256_storeu_ps(lanes, out);
                float *row = y + (int64_t)(t0 + t) * n + j;
                for (int32_t r = 0; r < rows; r++) row[r] = lanes[r] + (w->bias ? w->bias[j + r] : 0.0f);
            }
        }
    }
}
#endif

#if defined(SPARK_ZMM)
/* Weight rows [begin, end) times every token group: y (M, N) (+ bias), rows two at a time, in tiles of rows whose
 * bytes stay in cache while every token group passes them (a matrix larger than the cache is read from memory
 * once, not once per group). */
#define LANE_TILE_BYTES 65536
static inline __attribute__((always_inline)) void lanes_gemm_t(const int32_t type, const spark_qmat *w, const spark_act *a, float *y, int32_t m, int32_t begin, int32_t end) {
    const int32_t nb = w->k / QK;
    const int64_t row_bytes = kq_type(type) ? kq_row_bytes(type, w->k) : (int64_t)nb * block_bytes(type);
    const int32_t tile = row_bytes >= LANE_TILE_BYTES / 2 ? 2 : (int32_t)(LANE_TILE_BYTES / row_bytes) & ~1;
    for (int32_t first = begin; first < end; first += tile) {
        const int32_t last = end - first < tile ? end : first + tile;
        for (int64_t g = 0; g * SPARK_LANES < m; g++) {
            for (int32_t j = first; j < last; j += 2) {
                const int32_t R = last - j >= 2 ? 2 : 1;
                const uint8_t *rows[2] = {w->blocks + j * row_bytes, w->blocks + (j + 1) * row_bytes};
                __m512 out[2];
                if (kq_type(type)) {
                    if (R == 2) kq_tokens_in_lanes(type, rows, 2, nb, a, g, out);
                    else kq_tokens_in_lanes(type, rows, 1, nb, a, g, out);
                } else if (R == 2) {
                    tokens_in_lanes(type, rows, 2, nb, a, g, out);
                } else {
                    tokens_in_lanes(type, rows, 1, nb, a, g, out);
                }
                for (int32_t r = 0; r < R; r++) lanes_store(out[r], w, y, m, g, j + r);
            }
        }
    }
}
#endif

#if defined(SPARK_TOKEN_LANES)
/* Returns 0, having computed nothing, where the memory for rows_in_lanes_t's copy was not to be had. */
static int32_t lanes_gemm(const spark_qmat *w, const spark_act *a, float *y, int32_t m, int32_t begin, int32_t end) {
#if defined(SPARK_AVX2)
    const int64_t nb = w->k / QK;
    int32_t *wt = aligned_alloc(32, (size_t)(nb * ((QK / 2) * 8 + 16) * 4)); /* a multiple of 32 bytes */
    if (wt == NULL) return 0;
    switch (w->type) {
    case SPARK_Q8_0: rows_in_lanes_t(SPARK_Q8_0, w, a, y, m, begin, end, wt); break;
    case SPARK_Q4_0: rows_in_lanes_t(SPARK_Q4_0, w, a, y, m, begin, end, wt); break;
    default: rows_in_lanes_t(SPARK_Q4_1, w, a, y, m, begin, end, wt); break;
    }
    free(wt);
    return 1;
#else
    if (a->parts == 1) return kq_lanes_gemm_a8(w, a, y, m, begin, end); /* lane_tokens: int8 rows are Q4_K's, Q6_K's */
    switch (w->type) {
    case SPARK_Q8_0: lanes_gemm_t(SPARK_Q8_0, w, a, y, m, begin, end); break;
    case SPARK_Q4_0: lanes_gemm_t(SPARK_Q4_0, w, a, y, m, begin, end); break;
    case SPARK_Q4_1: lanes_gemm_t(SPARK_Q4_1, w, a, y, m, begin, end); break;
    case SPARK_Q5_0: lanes_gemm_t(SPARK_Q5_0, w, a, y, m, begin, end); break;
    case SPARK_Q5_1: lanes_gemm_t(SPARK_Q5_1, w, a, y, m, begin, end); break;
    case SPARK_Q3_K: lanes_gemm_t(SPARK_Q3_K, w, a, y, m, begin, end); break;
    case SPARK_Q4_K: lanes_gemm_t(SPARK_Q4_K, w, a, y, m, begin, end); break;
    case SPARK_Q5_K: lanes_gemm_t(SPARK_Q5_K, w, a, y, m, begin, end); break;
    case SPARK_IQ4_NL: lanes_gemm_t(SPARK_IQ4_NL, w, a, y, m, begin, end); break;
    case SPARK_IQ4_XS: lanes_gemm_t(SPARK_IQ4_XS, w, a, y, m, begin, end); break;
    case SPARK_TQ1_0: lanes_gemm_t(SPARK_TQ1_0, w, a, y, m, begin, end); break;
    case SPARK_TQ2_0: lanes_gemm_t(SPARK_TQ2_0, w, a, y, m, begin, end); break;
    default: lanes_gemm_t(SPARK_Q6_K, w, a, y, m, begin, end); break; /* kq_lane_type: no Q2_K here (lane_tokens) */
    }
    return 1;
#endif
}
#endif

#if defined(SPARK_ZMM) && defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__linux__)
#define SPARK_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
/* A verify or prefill of Q8_0, Q4_0 or Q4_1 rows with int16 activations on AMX (Sapphire Rapids and later): the
 * tile unit's byte products give each block's exact int32 sums for 16 weight rows and up to 16 tokens at once, and
 * the float terms then run as tokens_in_lanes' (same operations, same order: the same bits as every other route).
 * An int16 activation x = 256 hi + lo (hi signed, lo unsigned bytes) takes two products per block, one per byte;
 * the weights' 16 rows are gathered into the tile's layout (4 bytes of a row per 32-bit column). A tile's result
 * goes through memory, so each block's terms are added while the next block's products run. Linux asks the kernel
 * for the tile state once (arch_prctl); where it refuses, or the CPU lacks AMX, the lane route runs instead. */
typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

static int amx_available, amx_state; /* what the CPU and OS allow; whether products use it (set by amx_probe) */
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static void amx_probe(void) {
    uint32_t a, b, c, d, lo, hi;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    const int cpu = (d >> 24 & 1) && (d >> 25 & 1); /* AMX-TILE, AMX-INT8 */
    int os = 0;
    if (cpu) {
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        os = (lo & 0x60000) == 0x60000 && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    }
    amx_available = amx_state = cpu && os;
}
static int amx_on(void) {
    pthread_once(&amx_once, amx_probe);
    return amx_state == 1;
}
#else
static int amx_on(void) { return 0; }
#endif

/* Whether products use the AMX route where it applies; `use` 0 switches it off (comparisons), 1 back on where the
 * machine has it. Returns the state in effect. */
int32_t spark_use_amx(int32_t use) {
#if defined(SPARK_AMX)
    pthread_once(&amx_once, amx_probe);
    amx_state = use && amx_available;
    return amx_state;
#else
    (void)use;
    return 0;
#endif
}

/* Whether spark_qgemm takes w's m rows by AMX. */
static int amx_route(const spark_qmat *w, int32_t m) {
    return m >= 2 && w->act_parts == 2 && (w->type == SPARK_Q8_0 || w->type == SPARK_Q4_0 || w->type == SPARK_Q4_1) && amx_on();
}

#if defined(SPARK_AMX)
/* Groups of up to this many tokens take one product a block: their high bytes (offset to unsigned), low bytes and
 * a row of ones as the rows of one tile (2 T + 1 <= 16), whose one result then holds both sums and the weights'. */
#define AMX_ONE_TILE 7

/* a's m int16 rows as the tiles' operands, in the token-lane copy's memory (the same bytes): per group g of 16
 * tokens and block b, 1024 bytes: hi (16 tokens x 32, signed) then lo (unsigned); a last group's tiles have only
 * its tokens' rows (amx_gemm_t configures them so), the rest of its bytes unused. A group of T <= AMX_ONE_TILE
 * tokens: T rows of hi + 128 (unsigned), T of lo, then one of ones. */
static void amx_in(const spark_act *a, int32_t m, int32_t nb) {
    uint8_t *xa = (uint8_t *)a->tq;
    for (int64_t g = 0; g * 16 < m; g++) {
        const int32_t T = m - g * 16 < 16 ? (int32_t)(m - g * 16) : 16, one = T <= AMX_ONE_TILE;
        for (int32_t b = 0; b < nb; b++) {
            uint8_t *hi = xa + (g * nb + b) * 1024, *lo = hi + (one ? 32 * T : 512);
            for (int32_t t = 0; t < T; t++) {
                const __m512i v = _mm512_loadu_si512(a->q16 + ((g * 16 + t) * nb + b) * QK);
                __m256i h = _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8));
                if (one) h = _mm256_xor_si256(h, _mm256_set1_epi8((char)0x80)); /* + 128 */
                _mm256_storeu_si256((__m256i *)(hi + t * 32), h);
                _mm256_storeu_si256((__m256i *)(lo + t * 32), _mm512_cvtepi16_epi8(_mm512_and_si512(v, _mm512_set1_epi16(0xFF))));
            }
            if (one) _mm256_storeu_si256((__m256i *)(lo + T * 32), _mm256_set1_epi8(1));
        }
    }
}

/* Block `blk` of 16 weight rows (byte offsets idx) in the tile layout bt (8 rows of 16 x 4 bytes: element 4i + j of
 * row r at bt[i][4r + j]), and the rows' first four bytes (the fp16 scale, and Q4_1's min) in *dm. */
static inline __attribute__((always_inline)) void amx_weights(const int32_t type, const uint8_t *blk, __m512i idx, uint8_t (*bt)[64], __m512i *dm) {
    *dm = _mm512_i32gather_epi32(idx, blk, 1);
    if (type == SPARK_Q8_0) {
        for (int32_t i = 0; i < 8; i++) _mm512_store_si512(bt[i], _mm512_i32gather_epi32(idx, blk + 2 + 4 * i, 1));
        return;
    }
    const int32_t off = type == SPARK_Q4_1 ? 4 : 2;
    const __m512i mask = _mm512_set1_epi8(0x0F);
    for (int32_t i = 0; i < 4; i++) { /* byte e holds element e (low nibble) and e + 16 (high) */
        const __m512i q = _mm512_i32gather_epi32(idx, blk + off + 4 * i, 1);
        _mm512_store_si512(bt[i], _mm512_and_si512(q, mask));
        _mm512_store_si512(bt[i + 4], _mm512_and_si512(_mm512_srli_epi32(q, 4), mask));
    }
}

/* Tiles: C0, C1 (hi, lo sums) for even blocks, C2, C3 for odd ones; A4, A5 the tokens' hi and lo; B6 the weights.
 * Q8_0's weights are signed, the nibbles unsigned. A small group (AMX_ONE_TILE): C0 or C2 and A4 only. */
#define AMX_PRODUCTS(type, c_hi, c_lo, xb, bt)                                                                          \
    do {                                                                                                               \
        _tile_zero(c_hi);                                                                                              \
        _tile_zero(c_lo);                                                                                              \
        _tile_loadd(4, xb, 32);                                                                                        \
        _tile_loadd(5, (xb) + 512, 32);                                                                                \
        _tile_loadd(6, bt, 64);                                                                                        \
        if (type == SPARK_Q8_0) {                                                                                      \
            _tile_dpbssd(c_hi, 4, 6);                                                                                  \
            _tile_dpbusd(c_lo, 5, 6);                                                                                  \
        } else {                                                                                                       \
            _tile_dpbsud(c_hi, 4, 6);                                                                                  \
            _tile_dpbuud(c_lo, 5, 6);                                                                                  \
        }                                                                                                              \
    } while (0)

/* The same with one tile of 2 T + 1 rows (A4: AMX_ONE_TILE's layout): unsigned activations by either sign of weight. */
#define AMX_PRODUCTS_ONE(type, c, xb, bt)                                                                              \
    do {                                                                                                               \
        _tile_zero(c);                                                                                                 \
        _tile_loadd(4, xb, 32);                                                                                        \
        _tile_loadd(6, bt, 64);                                                                                        \
        if (type == SPARK_Q8_0) _tile_dpbusd(c, 4, 6);                                                                 \
        else _tile_dpbuud(c, 4, 6);                                                                                    \
    } while (0)

/* Block b's terms for tokens [16 g, 16 g + T) into acc[t][b % 8] (16 weight-row lanes): block_term's operations. */
static inline __attribute__((always_inline)) void amx_terms(const int32_t type, const spark_act *a, int64_t g, int32_t nb, int32_t b, int32_t T, const int32_t (*c)[16], __m512i dm, __m512 (*acc)[8], const int one) {
    const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
    const __m512 mw = type == SPARK_Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))) : _mm512_setzero_ps();
    for (int32_t t = 0; t < T; t++) {
        const int64_t at = (g * 16 + t) * nb + b;
        /* x = 256 hi + lo; one tile: hi + 128 in place of hi, so less 2^15 times the weights' sum (its last row) */
        __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c[t]), 8), _mm512_load_si512(c[(one ? T : 16) + t]));
        if (one) isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(_mm512_load_si512(c[2 * T]), 15));
        if (type == SPARK_Q4_0) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(a->s[at] * 8));
        __m512 term = _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a->d[at])), _mm512_cvtepi32_ps(isum));
        if (type == SPARK_Q4_1) term = _mm512_add_ps(term, _mm512_mul_ps(mw, _mm512_set1_ps(a->ds[at])));
        acc[t][b & 7] = _mm512_add_ps(acc[t][b & 7], term);
    }
}

/* Weight rows [begin, end) times every group of 16 tokens: y (M, N) (+ bias). */
static inline __attribute__((always_inline)) void amx_gemm_t(const int32_t type, const spark_qmat *w, const spark_act *a, float *y, int32_t m, int32_t begin, int32_t end) {
    const int32_t nb = w->k / QK, n = w->n, bb = block_bytes(type);
    const int64_t row_bytes = (int64_t)nb * bb;
    const uint8_t *xa = (const uint8_t *)a->tq;
    _Alignas(64) int32_t c[2][32][16]; /* a block's hi sums (rows 0..15), then its lo sums; one tile: rows 0..2T */
    _Alignas(64) uint8_t bt[2][8][64];
    _Alignas(64) __m512 acc[16][8];
    __m512i dm[2];
    for (int64_t g = 0; g * 16 < m; g++) {
        const int32_t T = m - g * 16 < 16 ? (int32_t)(m - g * 16) : 16, one = T <= AMX_ONE_TILE, rows = one ? 2 * T + 1 : T;
        amx_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int32_t i = 0; i < 4; i++) cfg.rows[i] = (uint8_t)rows, cfg.colsb[i] = 64;
        cfg.rows[4] = cfg.rows[5] = (uint8_t)rows, cfg.colsb[4] = cfg.colsb[5] = 32;
        cfg.rows[6] = 8, cfg.colsb[6] = 64;
        _tile_loadconfig(&cfg);
        const uint8_t *xg = xa + g * nb * 1024;
        for (int32_t j = begin; j < end; j += 16) {
            const int32_t R = end - j < 16 ? end - j : 16;
            /* rows past the range repeat its last one (their lanes are not stored) */
            const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            const __m512i idx = _mm512_mullo_epi32(_mm512_min_epi32(lane, _mm512_set1_epi32(R - 1)), _mm512_set1_epi32((int32_t)row_bytes));
            const uint8_t *base = w->blocks + (int64_t)j * row_bytes;
            for (int32_t t = 0; t < T; t++)
                for (int32_t u = 0; u < 8; u++) acc[t][u] = _mm512_setzero_ps();
            amx_weights(type, base, idx, bt[0], &dm[0]);
            /* the next 16 rows' bytes (one contiguous run) asked for in equal parts over this group's blocks: the
             * 16 rows the gathers read at once are more streams than the hardware prefetcher follows */
            const int64_t ahead = j + 16 < end ? ((16 * row_bytes + nb - 1) / nb + 63) & ~(int64_t)63 : 0;
            for (int32_t b = 0; b < nb; b++) {
                if (ahead > 0) prefetch_bytes(base + 16 * row_bytes + b * ahead, ahead);
                const uint8_t *xb = xg + (int64_t)b * 1024;
                if (one && (b & 1)) {
                    AMX_PRODUCTS_ONE(type, 2, xb, bt[1]);
                    _tile_stored(2, c[1][0], 64);
                } else if (one) {
                    AMX_PRODUCTS_ONE(type, 0, xb, bt[0]);
                    _tile_stored(0, c[0][0], 64);
                } else if (b & 1) {
                    AMX_PRODUCTS(type, 2, 3, xb, bt[1]);
                    _tile_stored(2, c[1][0], 64);
                    _tile_stored(3, c[1][16], 64);
                } else {
                    AMX_PRODUCTS(type, 0, 1, xb, bt[0]);
                    _tile_stored(0, c[0][0], 64);
                    _tile_stored(1, c[0][16], 64);
                }
                if (b > 0) amx_terms(type, a, g, nb, b - 1, T, c[(b - 1) & 1], dm[(b - 1) & 1], acc, one);
                if (b + 1 < nb) amx_weights(type, base + (int64_t)(b + 1) * bb, idx, bt[(b + 1) & 1], &dm[(b + 1) & 1]);
            }
            amx_terms(type, a, g, nb, nb - 1, T, c[(nb - 1) & 1], dm[(nb - 1) & 1], acc, one);
            const __mmask16 keep = (__mmask16)((1u << R) - 1);
            for (int32_t t = 0; t < T; t++) {
                __m512 o = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][4]), _mm512_add_ps(acc[t][1], acc[t][5])),
                                         _mm512_add_ps(_mm512_add_ps(acc[t][2], acc[t][6]), _mm512_add_ps(acc[t][3], acc[t][7])));
                if (w->bias) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(keep, w->bias + j));
                _mm512_mask_storeu_ps(y + (g * 16 + t) * n + j, keep, o);
            }
        }
    }
    _tile_release(); /* the thread's tile state is saved on every switch while it holds it */
}

static void amx_gemm(const spark_qmat *w, const spark_act *a, float *y, int32_t m, int32_t begin, int32_t end) {
    switch (w->type) {
    case SPARK_Q8_0: amx_gemm_t(SPARK_Q8_0, w, a, y, m, begin, end); break;
    case SPARK_Q4_0: amx_gemm_t(SPARK_Q4_0, w, a, y, m, begin, end); break;
    default: amx_gemm_t(SPARK_Q4_1, w, a, y, m, begin, end); break;
    }
}
#endif

/* How many of a prefill's m activation rows over w take the lane route (on AVX-512 its copy built by spark_qgemm),
 * the first ones; the rest take the row routes: whole groups, and a last partial one of at least SPARK_LANES_MIN.
 * Int16 rows for every routed type; int8 rows for Q4_K and Q6_K (their default, engine.backends.native). */
static int32_t lane_tokens(const spark_qmat *w, int32_t m) {
#if defined(SPARK_TOKEN_LANES)
    int routed = w->type == SPARK_Q8_0 || w->type == SPARK_Q4_0 || w->type == SPARK_Q4_1;
#if defined(SPARK_ZMM)
    routed = w->act_parts == 1 ? kq_split_type(w->type) : routed || kq_lane_type(w->type); /* int8: Q4_K, Q6_K */
    const int32_t least = w->act_parts == 1 ? SPARK_LANES_MIN_A8 : SPARK_LANES_MIN;
#else
    routed = routed && w->act_parts == 2;
    const int32_t least = SPARK_LANES_MIN;
#endif
    if (!routed) return 0;
    return m % SPARK_LANES >= least ? m : m - m % SPARK_LANES;
#else
    (void)w, (void)m;
    return 0;
#endif
}

/* y (M, N) = x W^T (+ bias) for M quantized activation rows; rows of W split across the pool. Each output is
 * dot_row of one weight row and one activation row, so a prefill of M rows and M one-row decodes agree bit for
 * bit; the weight row stays in cache while the M activation rows pass it. */
typedef struct {
    const spark_qmat *w;
    const spark_act *a;
    float *y;
    int32_t m;
} gemm_job;

static void gemm_rows(void *ctx, int32_t begin, int32_t end) {
    const gemm_job *g = ctx;
    const spark_qmat *w = g->w;
#if defined(SPARK_AMX)
    if (amx_route(w, g->m)) {
        amx_gemm(w, g->a, g->y, g->m, begin, end);
        return;
    }
#endif
    int32_t lanes = lane_tokens(w, g->m); /* tokens [0, lanes) in the lanes, the rest by rows */
#if defined(SPARK_TOKEN_LANES)
    if (lanes > 0 && !lanes_gemm(w, g->a, g->y, lanes, begin, end)) lanes = 0; /* no memory for its copy: by rows */
    if (lanes == g->m) return;
#endif
    if (kq_type(w->type)) {
        kq_gemm_rows(w, g->a, g->y, lanes, g->m, begin, end);
        return;
    }
    const int32_t nb = w->k / QK, n = w->n;
    const int64_t row_bytes = (int64_t)nb * block_bytes(w->type);
#if defined(SPARK_AVX512VNNI) || defined(SPARK_AVX2)
    /* A decoding step over the types dot_pair16 knows: weight rows in pairs, row i of the range's first half with
     * row i of its second, so the rows stream from memory as two long sequential runs, which the hardware
     * prefetcher follows (adjacent rows in pairs make a short two-stream pattern it does not: it needed a software
     * prefetch and was slower still; tests/engine/backends/native/qgemm_timing.c). */
    if (g->m == 1 && g->a->parts == 2 && (w->type == SPARK_Q4_0 || w->type == SPARK_Q4_1 || w->type == SPARK_Q8_0)) {
        const int32_t half = (end - begin) / 2;
        for (int32_t i = 0; i < half; i++) {
            const int32_t ra = begin + i, rb = begin + half + i;
            float out[2];
            dot_pair16(w->type, w->blocks + ra * row_bytes, w->blocks + rb * row_bytes, nb, g->a, out);
            g->y[ra] = out[0] + (w->bias ? w->bias[ra] : 0.0f);
            g->y[rb] = out[1] + (w->bias ? w->bias[rb] : 0.0f);
        }
        begin += 2 * half; /* an odd range's last row: the loop below */
    }
#endif
    /* Tokens in groups of SPARK_ROWS, and within a group every row of this thread's range: the group's activations
     * stay in L1 while the weight rows stream past once per group. */
    for (int32_t r = lanes; r < g->m; r += SPARK_ROWS) {
        const int32_t rc = g->m - r < SPARK_ROWS ? g->m - r : SPARK_ROWS;
        int64_t b0[SPARK_ROWS];
        for (int32_t t = 0; t < rc; t++) b0[t] = (int64_t)(r + t) * nb;
        int32_t j = begin;
#if defined(SPARK_AVX512VNNI) || defined(SPARK_AVX2)
        /* A few rows (a verify): weight rows in pairs, each half of the range a sequential run (see above). */
        const int32_t half = (end - begin) / 2;
        float oa[4], ob[4];
        if (half > 0 && dot_rows2(w->type, w->blocks + begin * row_bytes, w->blocks + (begin + half) * row_bytes, nb, g->a, b0, rc, oa, ob)) {
            for (int32_t i = 0; i < half; i++) {
                const int32_t ja = begin + i, jb = begin + half + i;
                if (i > 0) dot_rows2(w->type, w->blocks + ja * row_bytes, w->blocks + jb * row_bytes, nb, g->a, b0, rc, oa, ob);
                for (int32_t t = 0; t < rc; t++) {
                    g->y[(int64_t)(r + t) * n + ja] = oa[t] + (w->bias ? w->bias[ja] : 0.0f);
                    g->y[(int64_t)(r + t) * n + jb] = ob[t] + (w->bias ? w->bias[jb] : 0.0f);
                }
            }
            j = begin + 2 * half; /* an odd range's last row: the loop below */
        }
#endif
        for (; j < end; j++) {
            float out[SPARK_ROWS];
            dot_rows(w->type, w->blocks + j * row_bytes, nb, g->a, b0, rc, out);
            const float bias = w->bias ? w->bias[j] : 0.0f;
            for (int32_t t = 0; t < rc; t++) g->y[(int64_t)(r + t) * n + j] = out[t] + bias;
        }
    }
}

/* One row's quants for a decoding step's byte-product routes: a Q4_K or Q6_K one's kq_split_dot (AVX-512, int8 or
 * int16 rows, kq_split_act), a Q8_0 one's block_lanes_split (int16 rows as a->xh, xl, xc), or as a->xp for a Q4
 * one's block_lanes_nib (AVX2). */
static void split_row(const spark_act *a, int32_t type, int32_t nb) {
#if defined(SPARK_AVX512VNNI)
#if defined(SPARK_ZMM)
    if (kq_split_type(type) && a->xh != NULL && nb % 8 == 0) {
        kq_split_act(a, nb);
        return;
    }
#endif
    if (type != SPARK_Q8_0 || a->parts != 2 || a->xh == NULL) return;
    for (int32_t b = 0; b < nb; b++) {
        int32_t high = 0;
        for (int32_t i = 0; i < QK; i++) {
            const int16_t q = a->q16[b * QK + i];
            a->xh[b * QK + i] = (int8_t)(q >> 8);
            a->xl[b * QK + i] = (uint8_t)(q & 0xFF);
            high += q >> 8;
        }
        a->xc[b] = high * 32768;
    }
#elif defined(SPARK_AVX2)
    if (type == SPARK_Q8_0 || a->parts != 2 || a->xp == NULL) return;
    for (int32_t b = 0; b < nb; b++) {
        const int16_t *q = a->q16 + b * QK;
        int16_t *p = a->xp + b * QK;
        for (int32_t h = 0; h < 2; h++) /* elements 0..15, then 16..31 */
            for (int32_t i = 0; i < 8; i++) p[16 * h + i] = q[16 * h + 2 * i], p[16 * h + 8 + i] = q[16 * h + 2 * i + 1];
    }
#else
    (void)a, (void)type, (void)nb;
#endif
}

/* Entry point for Python's block linear layers: x (M, K) -> y (M, N) for w's own N rows (a further part, w->next, is
 * another call); scratch holds spark_act_bytes(K, M). */
void spark_qgemm(const spark_qmat *w, const float *x, int32_t m, float *y, void *scratch) {
    spark_act a = act_in(scratch, w->k, m, w->act_parts);
    const int32_t nb = w->k / QK;
    for (int32_t r = 0; r < m; r++) quantize_row(x + (int64_t)r * w->k, w->k, w->k, &a, (int64_t)r * nb);
    if (m == 1) split_row(&a, w->type, nb);
#if defined(SPARK_AMX)
    if (amx_route(w, m)) amx_in(&a, m, nb);
    else
#endif
#if defined(SPARK_ZMM)
    {
        const int32_t lanes = lane_tokens(w, m);
        if (lanes > 0) lanes_in(&a, lanes, nb);
    }
#endif
    gemm_job g = {w, &a, y, m};
    parallel_for(gemm_rows, &g, w->n);
}

/* One row through one matrix: y (N) = W x for x of `len` values (W's K rounded up to 32), quantized into a. */
static void qgemv(const spark_qmat *w, const float *x, int32_t len, float *y, spark_act *a) {
    a->parts = w->act_parts;
    quantize_row(x, w->k, len, a, 0);
    for (; w != NULL; y += w->n, w = w->next) { /* each part of a fused matrix in its own format, outputs in order */
        split_row(a, w->type, w->k / QK);
        gemm_job g = {w, a, y, 1};
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

#if !defined(__FLT16_MAX__)
#error "spark_kernels.c needs a compiler with _Float16 (GCC >= 12, Clang >= 15)"
#endif

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
    /* h, qkv, q_new, q_plain, attn out, gate_up, quantized activations (scores: per head, passed separately) */
    return c + (hd + 2 * kv) + hd + hd + hd + 2 * (int64_t)m->intermediate + spark_act_bytes((int32_t)(widest_in + QK - 1) / QK * QK, 1) / 4 + 8;
}

#include "spark_attention.c" /* a decoding step's attention over the table as stored: spark_attend */

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
 * (Q8_0: q * d; Q4_0: d * (nib - 8); Q4_1: d * nib + m; Q4_K, Q6_K: kq_dequant_block), for the embedding a tied LM
 * head shares. Returns 1; 0 for a type these do not cover (the caller dequantizes in Python); -1, with nothing
 * written, for an id outside [0, N). */
int32_t spark_dequant_rows(const spark_qmat *w, const int64_t *ids, int32_t n, float *out) {
    if (w->type != SPARK_Q8_0 && w->type != SPARK_Q4_0 && w->type != SPARK_Q4_1 && !kq_dequant_type(w->type)) return 0;
    for (int32_t r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= w->n) return -1;
    if (kq_dequant_type(w->type)) {
        const int64_t rb = kq_row_bytes(w->type, w->k);
        for (int32_t r = 0; r < n; r++)
            for (int32_t b = 0; b < w->k / QK; b++) kq_dequant_block(w->type, w->blocks + ids[r] * rb, b, out + (int64_t)r * w->k + (int64_t)b * QK);
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
