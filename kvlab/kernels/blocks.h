/* GGUF's block formats, read in place: 32 weights per block, an fp16 scale first.
 *
 * Q8_0: d, 32 int8 q                 w = d * q
 * Q4_0: d, 16 bytes of nibbles       w = d * (q - 8)
 * Q4_1: d, m, 16 bytes of nibbles    w = d * q + m
 * Q5_0: d, 32 high bits, 16 bytes    w = d * (q - 16)
 * (weight i < 16: the low nibble of byte i; i >= 16: the high nibble of byte i - 16; Q5_0's fifth
 * bit of weight i is bit i of the little-endian 32-bit word.) Layouts and values as gguf.quants
 * dequantises them (llama.cpp's ggml-quants.c).
 *
 * Every d * q here is exact in fp32 (an 11-bit scale times a 4- to 8-bit integer), and Q4_1's
 * + m rounds once whether fused or not, so qblock8 gives the dequantised values bit for bit.
 */
#ifndef KVLAB_BLOCKS_H
#define KVLAB_BLOCKS_H

#include "simd.h"

/* kvlab.models.weights.FORMATS numbers them the same way; 0 is a dense fp32 or bf16 weight */
enum { DENSE = 0, Q8_0 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 4, NFORMATS };
#define QK 32
static const int BLOCK_BYTES[NFORMATS] = {0, 34, 18, 20, 22};

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The 32 weights of block b in format fmt as fp32, in four groups of 8 (out[g]: weights 8g..8g+7).
 * One scale load per block, one 16-byte load of its nibbles. */
static inline __attribute__((always_inline)) void qblock8(const uint8_t *b, const int fmt, __m256 out[4]) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    if (fmt == Q8_0) {
        for (int g = 0; g < 4; g++)
            out[g] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                          _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * g)))));
        return;
    }
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(b + (fmt == Q4_0 ? 2 : fmt == Q4_1 ? 4 : 6)));
    const __m256i lo = _mm256_cvtepu8_epi32(bytes), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
    const __m256i mask = _mm256_set1_epi32(15);
    __m256i q[4] = {_mm256_and_si256(lo, mask), _mm256_and_si256(hi, mask), _mm256_srli_epi32(lo, 4),
                    _mm256_srli_epi32(hi, 4)};
    if (fmt == Q4_1) {
        const __m256 m = _mm256_set1_ps(half_at(b + 2));
        for (int g = 0; g < 4; g++) out[g] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[g]), m);
        return;
    }
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    for (int g = 0; g < 4; g++) {
        if (fmt == Q5_0) {
            __m256i h = _mm256_srlv_epi32(_mm256_set1_epi32((int)(qh >> 8 * g)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            q[g] = _mm256_sub_epi32(_mm256_or_si256(q[g], _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(1)), 4)),
                                    _mm256_set1_epi32(16));
        } else {
            q[g] = _mm256_sub_epi32(q[g], _mm256_set1_epi32(8));
        }
        out[g] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q[g]));
    }
}

/* AVX-512: the blocks a and b of two weight rows at once, row a's 8 weights in the low half of
 * each zmm, row b's in the high half: the same values in the same lanes' order as qblock8, so an
 * 8-lane chain per half is bitwise qblock8's. */
#define T512 __attribute__((target("avx2,fma,f16c,avx512f,avx512dq"), always_inline))

/* The fp16 pairs at a and b (d, and Q4_1's m after it) widened at once: lanes 0-7 a's, 8-15 b's. */
static inline T512 void scales16(const uint8_t *a, const uint8_t *b, __m512 *d, __m512 *m) {
    uint32_t sa, sb;
    memcpy(&sa, a, 4);
    memcpy(&sb, b, 4);
    const __m512 s = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_setr_epi32((int)sa, (int)sb, 0, 0)));
    *d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), s);
    if (m) *m = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3), s);
}

static inline T512 void qblock16(const uint8_t *a, const uint8_t *b, const int fmt, __m512 out[4]) {
    __m512 d, m;
    scales16(a, b, &d, fmt == Q4_1 ? &m : NULL);
    if (fmt == Q8_0) {
        for (int g = 0; g < 4; g++) {
            __m128i q = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(a + 2 + 8 * g)),
                                           _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * g)));
            out[g] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
        }
        return;
    }
    const int at = fmt == Q4_0 ? 2 : fmt == Q4_1 ? 4 : 6;
    const __m128i qa = _mm_loadu_si128((const __m128i *)(a + at)), qb = _mm_loadu_si128((const __m128i *)(b + at));
    const __m512i lo = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(qa, qb));
    const __m512i hi = _mm512_cvtepu8_epi32(_mm_unpackhi_epi64(qa, qb));
    const __m512i mask = _mm512_set1_epi32(15);
    __m512i q[4] = {_mm512_and_si512(lo, mask), _mm512_and_si512(hi, mask), _mm512_srli_epi32(lo, 4),
                    _mm512_srli_epi32(hi, 4)};
    if (fmt == Q4_1) {
        for (int g = 0; g < 4; g++) out[g] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q[g]), m);
        return;
    }
    uint32_t ha, hb;
    memcpy(&ha, a + 2, 4);
    memcpy(&hb, b + 2, 4);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    for (int g = 0; g < 4; g++) {
        if (fmt == Q5_0) {
            __m512i h = _mm512_inserti32x8(_mm512_set1_epi32((int)(ha >> 8 * g)),
                                           _mm256_set1_epi32((int)(hb >> 8 * g)), 1);
            h = _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(h, lanes), _mm512_set1_epi32(1)), 4);
            q[g] = _mm512_sub_epi32(_mm512_or_si512(q[g], h), _mm512_set1_epi32(16));
        } else {
            q[g] = _mm512_sub_epi32(q[g], _mm512_set1_epi32(8));
        }
        out[g] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q[g]));
    }
}

#endif
