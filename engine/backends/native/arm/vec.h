/* MLoT Spark native CPU kernels: the attention's float vectors (spark_vf) on Arm (NEON: 4 lanes): the few operations
 * spark_attention.c needs, each the same operation lane by lane on every family. */
#ifndef SPARK_ARM_VEC_H
#define SPARK_ARM_VEC_H

#include <arm_neon.h>
#define SPARK_VW 4
typedef float32x4_t spark_vf;
static inline spark_vf vf_load(const float *p) { return vld1q_f32(p); }
static inline spark_vf vf_load_h(const _Float16 *p) {
    float16x4_t h;
    memcpy(&h, p, sizeof h);
    return vcvt_f32_f16(h);
}
static inline void vf_store(float *p, spark_vf v) { vst1q_f32(p, v); }
static inline spark_vf vf_set1(float x) { return vdupq_n_f32(x); }
static inline spark_vf vf_fma(spark_vf a, spark_vf b, spark_vf c) { return vfmaq_f32(c, a, b); }
static inline float vf_sum(spark_vf v) { return vaddvq_f32(v); }
static inline spark_vf vf_min(spark_vf a, spark_vf b) { return vminq_f32(a, b); }
static inline spark_vf vf_max(spark_vf a, spark_vf b) { return vmaxq_f32(a, b); }
static inline spark_vf vf_pow2i(spark_vf n) {
    return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23));
}

#endif
