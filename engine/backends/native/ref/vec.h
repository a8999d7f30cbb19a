/* MLoT Spark native CPU kernels: the attention's float vectors (spark_vf) on any CPU (one lane, plain C: the compiler may still vectorize the loops around it): the few operations
 * spark_attention.c needs, each the same operation lane by lane on every family. */
#ifndef SPARK_REF_VEC_H
#define SPARK_REF_VEC_H

#define SPARK_VW 1
typedef float spark_vf;
static inline spark_vf vf_load(const float *p) { return *p; }
static inline spark_vf vf_load_h(const _Float16 *p) { return (float)*p; }
static inline void vf_store(float *p, spark_vf v) { *p = v; }
static inline spark_vf vf_set1(float x) { return x; }
static inline spark_vf vf_fma(spark_vf a, spark_vf b, spark_vf c) { return a * b + c; }
static inline float vf_sum(spark_vf v) { return v; }
static inline spark_vf vf_min(spark_vf a, spark_vf b) { return a < b ? a : b; }
static inline spark_vf vf_max(spark_vf a, spark_vf b) { return a > b ? a : b; }
static inline spark_vf vf_pow2i(spark_vf n) {
    const int32_t bits = ((int32_t)n + 127) << 23;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

#endif
