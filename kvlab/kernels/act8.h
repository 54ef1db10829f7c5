/* 8-bit activations (--activations int8) against GGUF's 32-weight blocks (blocks.h).
 *
 * Each input row is quantised in blocks of 32 values, as llama.cpp quantises activations to Q8_0
 * for its dot products and OpenVINO's CPU plugin does on the fly: d = max|x| / 127, q =
 * round-to-nearest-even(x * (1 / d)) in [-127, 127] (all zero where the block is), and s = sum q.
 * A block's dot product with a weight block is then an integer sum, exact whatever its order:
 *
 *   Q8_0  d_w d_x sum q_w q        Q4_0  d_w d_x (sum n q - 8 s)
 *   Q4_1  d_w d_x sum n q + m_w d_x s                Q5_0  d_w d_x (sum n q - 16 s)
 *
 * (n the unsigned 4- or 5-bit values; Q8_0's signed weights go through |q_w| and q's sign moved
 * onto it). Each output is one fixed fp32 chain: per block, acc = fma(S, d_w d_x, acc) with S
 * that block's integer sum, Q4_1's m term in a chain of its own, added at the end. It does not
 * depend on M, the row's place in the batch or the ISA (AVX2's vpmaddubsw + vpmaddwd, or VNNI's
 * vpdpbusd in AVX512-VNNI's or AVX-VNNI's encoding: the same integers), so the mode is
 * batch-invariant and every path gives the same bits. linear.c holds the loops.
 *
 * Why: prefill and batched decode are compute-bound, and an int8 multiply-add does 4x an fp32
 * FMA's work per instruction (vpdpbusd: 64 a 256-bit instruction). The cost is the activations'
 * rounding: at most half a step of 1/127 of the block's largest value.
 */
#ifndef KVLAB_ACT8_H
#define KVLAB_ACT8_H

#include "blocks.h"

/* A call's input rows, quantised: q [M, K] int8, d and s [M, K / 32] (scale, sum of q). */
typedef struct {
    const int8_t *q;
    const float *d;
    const int32_t *s;
    long K;
} act8_rows;

/* Block b (32 values at x) quantised into q, its scale and sum returned through d and s. */
static inline __attribute__((always_inline)) void act8_block(const float *x, int8_t *q, float *d, int32_t *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int g = 0; g < 4; g++) {
        v[g] = _mm256_loadu_ps(x + 8 * g);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[g]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float scale = _mm_cvtss_f32(m) / 127.0f;
    const __m256 inv = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
    __m256i i32[4];
    for (int g = 0; g < 4; g++) i32[g] = _mm256_cvtps_epi32(_mm256_mul_ps(v[g], inv)); /* nearest even */
    /* 32 int32 -> 32 int8 in order: the packs interleave 128-bit lanes, the permute undoes it */
    const __m256i p16a = _mm256_packs_epi32(i32[0], i32[1]), p16b = _mm256_packs_epi32(i32[2], i32[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p8);
    const __m256i sums = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    *d = scale;
    *s = _mm_cvtsi128_si32(t);
}

/* A weight block's 32 values as bytes, in weight order: Q8_0's signed, the others' unsigned
 * (Q4_0 / Q4_1 nibbles 0..15, Q5_0 0..31; their offsets go with the sums). */
static inline __attribute__((always_inline)) __m256i act8_weights(const uint8_t *b, const int fmt) {
    if (fmt == Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(b + (fmt == Q4_0 ? 2 : fmt == Q4_1 ? 4 : 6)));
    const __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(15));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(15));
    __m256i n = _mm256_set_m128i(hi, lo); /* weights 0-15: low nibbles, 16-31: high */
    if (fmt == Q5_0) { /* bit i of the 32-bit word: weight i's fifth bit */
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                                   _mm256_setr_epi64x(0, 0x0101010101010101LL,
                                                                      0x0202020202020202LL, 0x0303030303030303LL));
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        const __m256i high = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        n = _mm256_or_si256(n, _mm256_and_si256(high, _mm256_set1_epi8(16)));
    }
    return n;
}

/* The int8 loops' targets (linear.c): AVX512-VNNI (512-bit vpdpbusd; BW for the byte masks)
 * and AVX-VNNI (vpdpbusd in VEX encoding, CPUs with it and without AVX-512). */
#define T_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"), always_inline))
#define T_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni"), always_inline))

#endif
