/* MLoT Spark native CPU kernels: the attention's float vectors (spark_vf) on x86 (16 lanes on AVX-512, 8 on AVX2): the few operations
 * spark_attention.c needs, each the same operation lane by lane on every family. */
#ifndef SPARK_X86_VEC_H
#define SPARK_X86_VEC_H

#include <immintrin.h>

#if defined(__AVX512F__)
#define SPARK_VW 16
typedef __m512 spark_vf;
static inline spark_vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline spark_vf vf_load_h(const _Float16 *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)p)); }
static inline void vf_store(float *p, spark_vf v) { _mm512_storeu_ps(p, v); }
static inline spark_vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline spark_vf vf_fma(spark_vf a, spark_vf b, spark_vf c) { return _mm512_fmadd_ps(a, b, c); } /* a*b + c */
static inline float vf_sum(spark_vf v) { return _mm512_reduce_add_ps(v); }
static inline spark_vf vf_min(spark_vf a, spark_vf b) { return _mm512_min_ps(a, b); }
static inline spark_vf vf_max(spark_vf a, spark_vf b) { return _mm512_max_ps(a, b); }
/* 2^n for integral n in the normal range, built in the exponent bits */
static inline spark_vf vf_pow2i(spark_vf n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#else /* AVX2 with F16C and FMA */
#define SPARK_VW 8
typedef __m256 spark_vf;
static inline spark_vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline spark_vf vf_load_h(const _Float16 *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)p)); }
static inline void vf_store(float *p, spark_vf v) { _mm256_storeu_ps(p, v); }
static inline spark_vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline spark_vf vf_fma(spark_vf a, spark_vf b, spark_vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vf_sum(spark_vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline spark_vf vf_min(spark_vf a, spark_vf b) { return _mm256_min_ps(a, b); }
static inline spark_vf vf_max(spark_vf a, spark_vf b) { return _mm256_max_ps(a, b); }
static inline spark_vf vf_pow2i(spark_vf n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#endif

#endif
