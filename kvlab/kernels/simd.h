/* AVX2 helpers shared by kvlab's kernels: fp32 sums and bf16 <-> fp32. */
#ifndef KVLAB_SIMD_H
#define KVLAB_SIMD_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* The lanes' sum, in one fixed order: (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), then 0+1. */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 values from element i of a row: fp32 as is, bf16 widened (its 16 bits on top: exact). */
static inline __m256 load8(const void *base, long i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)base + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float load1(const void *base, long i, int bf16) {
    if (!bf16) return ((const float *)base)[i];
    uint32_t u = (uint32_t)((const uint16_t *)base)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Row `index` of a [rows, width] matrix of fp32 or bf16. */
static inline const void *row_at(const void *base, long index, long width, int bf16) {
    return bf16 ? (const void *)((const uint16_t *)base + index * width)
                : (const void *)((const float *)base + index * width);
}

/* Store f at element i: fp32 as is, bf16 rounded to nearest even as PyTorch rounds (NaN kept). */
static inline void store1(void *base, long i, float f, int bf16) {
    if (!bf16) {
        ((float *)base)[i] = f;
        return;
    }
    uint32_t u;
    memcpy(&u, &f, 4);
    ((uint16_t *)base)[i] = f != f ? (uint16_t)0x7FC0 : (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* exp(x) of 8 lanes: Cephes' polynomial (relative error ~1e-7), x clamped to +-88.38. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)),
                      _mm256_set1_ps(88.3762626647949f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#endif
