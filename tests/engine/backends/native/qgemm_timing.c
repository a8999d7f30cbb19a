/* Kernel timing harness (not a test): spark_qgemm over SmolLM2-135M's matrix shapes, 30 layers each with its own
 * random weights (so a decoding step's rows stream from memory as in the model), m activation rows, fastest of
 * `reps` passes over all 120 matrices (plus, with `head` = 1, the 49152 x 576 LM head). Timings only: the bits are
 * checked by the tests. Pin it to a core and compare builds in the same session:
 *   cc -O3 -std=gnu11 -pthread -ffp-contract=off -fno-math-errno -march=native -I engine/backends/native \
 *      tests/engine/backends/native/qgemm_timing.c -o /tmp/qgemm_timing -lm
 *   taskset -c 1 /tmp/qgemm_timing TYPE M REPS [HEAD]   (TYPE: ggml id, 8 Q8_0, 3 Q4_1, 2 Q4_0, 6 Q5_0)
 * With HOT=1 in the environment every layer shares layer 0's weights (they stay in cache: compute alone); with
 * THREADS=N the products run on N threads (the kernels' pool); with NOAMX=1 they leave AMX's tiles unused. */
#include "spark_kernels.c"

#include <stdio.h>
#include <time.h>

static unsigned seed = 1;
static unsigned next(void) { return seed = seed * 1103515245u + 12345u; }
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Random blocks with a moderate fp16 scale (and min) in front: the row bytes of the type. */
static uint8_t *random_rows(int32_t type, int32_t n, int32_t k) {
    const int32_t bb = spark_block_bytes(type), per = kq_type(type) && type != SPARK_Q5_0 ? QK_K : QK;
    const int64_t blocks = (int64_t)n * (k / per);
    uint8_t *p = aligned_alloc(64, (size_t)((blocks * bb + 63) / 64 * 64));
    for (int64_t b = 0; b < blocks; b++) {
        uint8_t *blk = p + b * bb;
        for (int32_t i = 0; i < bb; i++) blk[i] = (uint8_t)(next() >> 16);
        const _Float16 d = (_Float16)((float)((next() >> 16) % 1000 + 1) / 20000.0f);
        memcpy(blk, &d, 2);
        if (type == SPARK_Q4_1) memcpy(blk + 2, &d, 2);
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
    const int32_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}}; /* qkv, o, gate_up, down */
    enum { L = 30 };
    spark_qmat w[L * 4 + 1];
    int32_t count = 0;
    for (int32_t l = 0; l < L; l++)
        for (int32_t s = 0; s < 4; s++) {
            const int32_t n = shapes[s][0], k = shapes[s][1];
            const uint8_t *p = getenv("HOT") && l > 0 ? w[s].blocks : random_rows(type, n, k);
            w[count++] = (spark_qmat){p, NULL, n, k, type, 2};
        }
    if (head) {
        w[count] = (spark_qmat){random_rows(type, 49152, 576), NULL, 49152, 576, type, 2};
        count++;
    }
    float *x = malloc(sizeof(float) * (size_t)m * 1536), *y = malloc(sizeof(float) * (size_t)m * 49152);
    for (int64_t i = 0; i < (int64_t)m * 1536; i++) x[i] = (float)((int)((next() >> 16) % 2001u) - 1000) / 300.0f;
    void *scratch = malloc((size_t)spark_act_bytes(1536, m));
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
    printf("type %d, %d rows%s%s: fastest pass %.3f ms (%.1f rows/s of products) [%g]\n", type, m, head ? ", LM head" : "",
           getenv("HOT") ? ", weights in cache" : "", best * 1e3, m / best, sink);
    return 0;
}
