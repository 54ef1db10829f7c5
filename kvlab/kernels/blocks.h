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
 * + m rounds once whether fused or not, so qload8 gives the dequantised values bit for bit.
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

/* 8 nibbles of a 16-byte nibble array from weight `at` (a multiple of 8) on, as int32 lanes */
static inline __m256i nibbles8(const uint8_t *qs, int at) {
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + (at & 15))));
    if (at >= 16) q = _mm256_srli_epi32(q, 4);
    return _mm256_and_si256(q, _mm256_set1_epi32(15));
}

/* Weights k..k+7 (k a multiple of 8) of a row stored in format fmt, as fp32. */
static inline __m256 qload8(const uint8_t *row, long k, const int fmt) {
    const uint8_t *b = row + (k / QK) * BLOCK_BYTES[fmt];
    const int at = (int)(k % QK);
    const __m256 d = _mm256_set1_ps(half_at(b));
    if (fmt == Q8_0) {
        __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + at)));
        return _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
    }
    if (fmt == Q4_0) {
        __m256i q = _mm256_sub_epi32(nibbles8(b + 2, at), _mm256_set1_epi32(8));
        return _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
    }
    if (fmt == Q4_1)
        return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(nibbles8(b + 4, at)), _mm256_set1_ps(half_at(b + 2)));
    /* Q5_0 */
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    __m256i hi = _mm256_srlv_epi32(_mm256_set1_epi32((int)(qh >> at)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    hi = _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(1)), 4);
    __m256i q = _mm256_sub_epi32(_mm256_or_si256(nibbles8(b + 6, at), hi), _mm256_set1_epi32(16));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
}

#endif
