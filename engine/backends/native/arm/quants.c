/* MLoT Spark native CPU kernels, Arm: the block products with the NEON dot-product instructions (every Apple Silicon
 * core, Armv8.2 with dotprod), over the reference's row loops (ref/rows.h), registered for every type by
 * spark_register_arm; the bits are the reference's. Checked under qemu by tests/engine/backends/native.
 */
#include "../spark_blocks.h"

#if defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>

#include "../ref/rows.h"

/* A Q8_0, Q4_0 or Q4_1 block's exact product with an int8 activation block xq. */
static inline int32_t block_dot8(int32_t type, const uint8_t *qs, const int8_t *xq) {
    const int8x16_t x0 = vld1q_s8(xq), x1 = vld1q_s8(xq + 16);
    if (type == SPARK_Q8_0) return vaddvq_s32(vdotq_s32(vdotq_s32(vdupq_n_s32(0), vld1q_s8((const int8_t *)qs), x0), vld1q_s8((const int8_t *)qs + 16), x1));
    const uint8x16_t raw = vld1q_u8(qs);
    const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0F))), hi = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
    return vaddvq_s32(vdotq_s32(vdotq_s32(vdupq_n_s32(0), lo, x0), hi, x1));
}

/* The exact products of an unpacked block with activation block `at`: h0 over weights 0..15, h1 over 16..31. */
static inline void kq_halves(const kq_block *o, const spark_act *a, int64_t at, int32_t *h0, int32_t *h1) {
    const int8x16_t w0 = vld1q_s8(o->w), w1 = vld1q_s8(o->w + 16);
    if (a->parts == 2) {
        const int16_t *x = a->q16 + at * QK;
        const int16x8_t a0 = vmovl_s8(vget_low_s8(w0)), a1 = vmovl_high_s8(w0);
        const int16x8_t b0 = vmovl_s8(vget_low_s8(w1)), b1 = vmovl_high_s8(w1);
        const int16x8_t x0 = vld1q_s16(x), x1 = vld1q_s16(x + 8), x2 = vld1q_s16(x + 16), x3 = vld1q_s16(x + 24);
        int32x4_t s0 = vmlal_high_s16(vmull_s16(vget_low_s16(a0), vget_low_s16(x0)), a0, x0);
        s0 = vmlal_high_s16(vmlal_s16(s0, vget_low_s16(a1), vget_low_s16(x1)), a1, x1);
        int32x4_t s1 = vmlal_high_s16(vmull_s16(vget_low_s16(b0), vget_low_s16(x2)), b0, x2);
        s1 = vmlal_high_s16(vmlal_s16(s1, vget_low_s16(b1), vget_low_s16(x3)), b1, x3);
        *h0 = vaddvq_s32(s0), *h1 = vaddvq_s32(s1);
    } else {
        const int8_t *x = a->q8 + at * QK;
        *h0 = vaddvq_s32(vdotq_s32(vdupq_n_s32(0), w0, vld1q_s8(x)));
        *h1 = vaddvq_s32(vdotq_s32(vdupq_n_s32(0), w1, vld1q_s8(x + 16)));
    }
}

void spark_register_arm(spark_type_traits *traits, spark_isa_ops *ops) {
    ops->isa = "neon-dotprod";
    rows_register(traits);
}
#else
/* Not an Arm build with the dot product: the reference runs. */
void spark_register_arm(spark_type_traits *traits, spark_isa_ops *ops) { (void)traits, (void)ops; }
#endif
