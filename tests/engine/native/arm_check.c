/* Checks spark_kernels.c's int8 products bit for bit against exact integer arithmetic, compiled for Arm and run
 * under qemu by tests/engine/test_native.py (Apple Silicon's NEON dot-product kernel, off a Mac). */
#include "spark_kernels.c"

#include <stdio.h>

int main(void) {
    const int32_t widths[] = {16, 50, 64, 200, 576};
    unsigned seed = 1;
    int bad = 0;
    printf("isa %s\n", spark_isa());
    for (int wi = 0; wi < 5; wi++) {
        const int32_t k = widths[wi], n = 37, m = 3;
        int8_t *q = malloc((size_t)n * k), *xq = malloc((size_t)m * k);
        float *scales = malloc(4 * n), *bias = malloc(4 * n), *x = malloc(4 * (size_t)m * k), *y = malloc(4 * (size_t)m * n);
        int32_t *sums = malloc(4 * n);
        for (int32_t j = 0; j < n; j++) {
            sums[j] = 0, scales[j] = 0.01f * (float)(j + 1), bias[j] = 0.5f * (float)j;
            for (int32_t i = 0; i < k; i++) {
                seed = seed * 1103515245u + 12345u;
                q[j * k + i] = (int8_t)((int)((seed >> 16) % 255u) - 127);
                sums[j] += q[j * k + i];
            }
        }
        for (int32_t i = 0; i < m * k; i++) {
            seed = seed * 1103515245u + 12345u;
            x[i] = (float)((int)((seed >> 16) % 2001u) - 1000) / 100.0f;
        }
        spark_qmat w = {q, scales, sums, bias, n, k};
        for (int32_t r = 0; r < m; r++) spark_qgemv(&w, x + r * k, y + r * n, xq + r * k);
        for (int32_t r = 0; r < m; r++) {
            float amax = 0.0f;
            for (int32_t i = 0; i < k; i++) amax = fabsf(x[r * k + i]) > amax ? fabsf(x[r * k + i]) : amax;
            for (int32_t j = 0; j < n; j++) {
                long acc = 0;
                for (int32_t i = 0; i < k; i++) acc += lrintf(x[r * k + i] * (127.0f / amax)) * q[j * k + i];
                const float want = (amax / 127.0f) * scales[j] * (float)acc + bias[j];
                if (want != y[r * n + j]) bad++;
            }
        }
        free(q), free(xq), free(scales), free(bias), free(x), free(y), free(sums);
    }
    printf("%d mismatches\n", bad);
    return bad != 0;
}
