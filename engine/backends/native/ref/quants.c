/* MLoT Spark native CPU kernels, the portable reference: every format's block products in plain C (the compiler
 * vectorizes what it can), registered for every type first (spark_register_ref); a family the build targets
 * replaces them where it has faster routes to the same bits. Arm's NEON file shares its row loops (rows.h).
 */
#include "../spark_blocks.h"

#include "rows.h"

/* A Q8_0, Q4_0 or Q4_1 block's exact product with an int8 activation block xq. */
static inline int32_t block_dot8(int32_t type, const uint8_t *qs, const int8_t *xq) {
    int32_t s = 0;
    if (type == SPARK_Q8_0) {
        for (int32_t i = 0; i < QK; i++) s += (int32_t)((const int8_t *)qs)[i] * xq[i];
    } else {
        for (int32_t i = 0; i < QK / 2; i++) s += (int32_t)(qs[i] & 0x0F) * xq[i] + (int32_t)(qs[i] >> 4) * xq[i + QK / 2];
    }
    return s;
}

/* The exact products of an unpacked block with activation block `at`: h0 over weights 0..15, h1 over 16..31. */
static inline void kq_halves(const kq_block *o, const spark_act *a, int64_t at, int32_t *h0, int32_t *h1) {
    int32_t s0 = 0, s1 = 0;
    if (a->parts == 2) {
        const int16_t *x = a->q16 + at * QK;
        for (int32_t i = 0; i < QK / 2; i++) s0 += (int32_t)o->w[i] * x[i];
        for (int32_t i = QK / 2; i < QK; i++) s1 += (int32_t)o->w[i] * x[i];
    } else {
        const int8_t *x = a->q8 + at * QK;
        for (int32_t i = 0; i < QK / 2; i++) s0 += (int32_t)o->w[i] * x[i];
        for (int32_t i = QK / 2; i < QK; i++) s1 += (int32_t)o->w[i] * x[i];
    }
    *h0 = s0, *h1 = s1;
}

/* One block of 32: q = rint(x * qmax / amax) into q8 (qmax 127, parts 1) or q16 (qmax 32767, parts 2); returns
 * d = amax / qmax (0 for an all-zero block) and sets q's sum. */
static float quantize_block(const float *x, int32_t parts, int8_t *q8, int16_t *q16, int32_t *sum) {
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
}

static void quantize_row(const float *x, int32_t k, int32_t valid, spark_act *a, int64_t b0) {
    quantize_row_with(quantize_block, x, k, valid, a, b0);
}

/* Block b (of 32 weights) of a Q4_K or Q6_K row as float32, with engine.model.quant's float operations (_q4_k:
 * (d * sc) * q - dmin * m, here dw * q + mw; _q6_k: (d * sc) * q, sc per 16 weights), from kq_unpack's quants and
 * factors. */
void spark_kq_dequant_block(int32_t type, const uint8_t *row, int32_t b, float *o) {
    kq_block u;
    kq_unpack(type, row, b, &u);
    int8_t q[QK];
    memcpy(q, u.w, QK);
    for (int32_t i = 0; i < QK; i++)
        o[i] = type == SPARK_Q4_K ? u.dw * (float)q[i] + u.mw : (u.dw * (float)(i < QK / 2 ? u.s0 : u.s1)) * (float)q[i];
}

void spark_register_ref(spark_type_traits *traits, spark_isa_ops *ops) {
    ops->isa = "portable";
    ops->lanes = 8;
    ops->quantize_row = quantize_row;
    static const int32_t q[] = {SPARK_Q8_0, SPARK_Q4_0, SPARK_Q4_1};
    for (int32_t i = 0; i < 3; i++) traits[q[i]].block_bytes = block_bytes(q[i]), traits[q[i]].block_weights = QK;
    for (int32_t type = 0; type < SPARK_TYPES; type++)
        if (kq_type(type)) traits[type].block_bytes = kq_block_bytes(type), traits[type].block_weights = kq_block_weights(type);
    rows_register(traits);
}
