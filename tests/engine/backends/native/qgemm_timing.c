/* Kernel timing harness (not a test): spark_qgemm over SmolLM2-135M's matrix shapes, 30 layers each with its own
 * random weights (so a decoding step's rows stream from memory as in the model), m activation rows, fastest of
 * `reps` passes over all 120 matrices (plus, with `head` = 1, the 49152 x 576 LM head). Timings only: the bits are
 * checked by the tests. Pin it to a core and compare builds in the same session:
 *   N=engine/backends/native; cc -O3 -std=gnu11 -pthread -ffp-contract=off -fno-math-errno -march=native -I $N \
 *      tests/engine/backends/native/qgemm_timing.c $N/spark_kernels.c $N/spark_attention.c $N/ref/quants.c \
 *      $N/x86/quants.c $N/arm/quants.c -o /tmp/qgemm_timing -lm
 *   taskset -c 1 /tmp/qgemm_timing TYPE M REPS [HEAD]   (TYPE: ggml id, 8 Q8_0, 3 Q4_1, 2 Q4_0, 6 Q5_0, 12 Q4_K, 14 Q6_K)
 * With HOT=1 in the environment every layer shares layer 0's weights (they stay in cache: compute alone); with
 * THREADS=N the products run on N threads (the kernels' pool); with NOAMX=1 they leave AMX's tiles unused; with
 * MODEL=1b the shapes are Llama 3.2 1B's (16 layers of 2048 wide, MLP 8192; head 128256 x 2048); with PARTS=1 the
 * activations are int8 blocks (the Q4_K and Q6_K default on AVX-512 VNNI) instead of int16. */
#include "spark_blocks.h"

#include <stdio.h>
#include <time.h>

static unsigned seed = 1;
static unsigned next(void) { return seed = seed * 1103515245u + 12345u; }
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Weights per block of the type: 32, or a K-quant's super-block of 256. */
static int32_t block_weights(int32_t type) { return kq_type(type) ? kq_block_weights(type) : QK; }

/* Random blocks with a moderate fp16 scale (and min or dmin) where the type keeps them: the row bytes of the type. */
static uint8_t *random_rows(int32_t type, int32_t n, int32_t k) {
    const int32_t bb = spark_block_bytes(type), per = block_weights(type);
    const int32_t d_at = type == SPARK_Q6_K    ? 208
                         : type == SPARK_Q2_K  ? 80
                         : type == SPARK_Q3_K  ? 108
                         : type == SPARK_TQ1_0 ? 52
                         : type == SPARK_TQ2_0 ? 64
                                               : 0;
    const int second = type == SPARK_Q4_1 || type == SPARK_Q5_1 || type == SPARK_Q4_K || type == SPARK_Q5_K || type == SPARK_Q2_K;
    const int64_t blocks = (int64_t)n * (k / per);
    uint8_t *p = aligned_alloc(64, (size_t)((blocks * bb + 63) / 64 * 64));
    for (int64_t b = 0; b < blocks; b++) {
        uint8_t *blk = p + b * bb;
        for (int32_t i = 0; i < bb; i++) blk[i] = (uint8_t)(next() >> 16);
        const _Float16 d = (_Float16)((float)((next() >> 16) % 1000 + 1) / 20000.0f);
        memcpy(blk + d_at, &d, 2);
        if (second) memcpy(blk + d_at + 2, &d, 2);
    }
    return p;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s TYPE M REPS [HEAD]\n", argv[0]);
        return 2;
    }
    const int32_t type = atoi(argv[1]), m = atoi(argv[2]), reps = atoi(argv[3]), head = argc > 4 ? atoi(argv[4]) : 0;
    if (spark_block_bytes(type) == 0 || m < 1 || reps < 1) {
        fprintf(stderr, "TYPE must be a block type the kernels run, M and REPS at least 1\n");
        return 2;
    }
    const int big = getenv("MODEL") != NULL && strcmp(getenv("MODEL"), "1b") == 0;
    const int32_t parts = getenv("PARTS") != NULL ? atoi(getenv("PARTS")) : 2;
    /* qkv, o, gate_up, down; the LM head */
    const int32_t small[5][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}, {49152, 576}};
    const int32_t large[5][2] = {{3072, 2048}, {2048, 2048}, {16384, 2048}, {2048, 8192}, {128256, 2048}};
    const int32_t(*shapes)[2] = big ? large : small, layers = big ? 16 : 30, widest = big ? 8192 : 1536;
    spark_qmat w[30 * 4 + 1];
    int32_t count = 0;
    for (int32_t l = 0; l < layers; l++)
        for (int32_t s = 0; s < 4; s++) {
            const int32_t n = shapes[s][0], k = shapes[s][1];
            const uint8_t *p = getenv("HOT") && l > 0 ? w[s].blocks : random_rows(type, n, k);
            w[count++] = (spark_qmat){p, NULL, n, k, type, parts, NULL};
        }
    if (head) {
        w[count] = (spark_qmat){random_rows(type, shapes[4][0], shapes[4][1]), NULL, shapes[4][0], shapes[4][1], type, parts, NULL};
        count++;
    }
    float *x = malloc(sizeof(float) * (size_t)m * widest), *y = malloc(sizeof(float) * (size_t)m * shapes[4][0]);
    for (int64_t i = 0; i < (int64_t)m * widest; i++) x[i] = (float)((int)((next() >> 16) % 2001u) - 1000) / 300.0f;
    void *scratch = malloc((size_t)spark_act_bytes(widest, m));
    if (getenv("THREADS")) spark_set_threads(atoi(getenv("THREADS")));
    if (getenv("NOAMX")) spark_use_amx(0);
    double best = 1e9, sink = 0.0;
    for (int32_t r = 0; r < reps; r++) {
        const double t0 = now();
        for (int32_t i = 0; i < count; i++) spark_qgemm(&w[i], x, m, y, scratch);
        const double t = now() - t0;
        best = t < best ? t : best;
        sink += y[0];
    }
    int64_t bytes = 0; /* the weights a pass reads */
    for (int32_t i = 0; i < count; i++) bytes += (int64_t)w[i].n * (w[i].k / block_weights(type)) * spark_block_bytes(type);
    printf("type %d, %d rows%s%s: fastest pass %.3f ms (%.1f rows/s of products, %.1f GB/s of weights) [%g]\n", type, m,
           head ? ", LM head" : "", getenv("HOT") ? ", weights in cache" : "", best * 1e3, m / best, (double)bytes / best / 1e9, sink);
    return 0;
}
