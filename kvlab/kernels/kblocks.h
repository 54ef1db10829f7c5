/* GGUF's k-quants, read in place: super-blocks of 256 weights, 8 sub-blocks of 32.
 *
 * Q4_K (144 bytes): d, dmin (fp16), 12 bytes of 6-bit scales sc[8] and mins m[8], 128 bytes of
 *   nibbles. Weight 64c + i (i < 32) of sub-block 2c is the low nibble of byte 32c + i, of
 *   sub-block 2c + 1 the high one.                          w = (d * sc[j]) * q - dmin * m[j]
 * Q6_K (210 bytes): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales, d
 *   (fp16) last. Weight i = 128h + r: ql[64h + r % 64] >> 4 (r / 64), qh[32h + r % 32] >>
 *   2 (r / 32).                                             w = (d * sc[i / 16]) * (q - 32)
 * Layouts and values as gguf.quants dequantises them (llama.cpp's dequantize_row_q4_K/q6_K).
 *
 * Exactness, as for blocks.h: d * sc (11 bits x 6, or Q6_K's 7 and a sign), that times q (4 or
 * 5 bits and a sign: at most 23 bits) and dmin * m are exact in fp32, so numpy's d * q - dm
 * rounds once, as one fmsub does here, and Q6_K's products never round. kblock8 gives the
 * dequantised values bit for bit.
 */
#ifndef KVLAB_KBLOCKS_H
#define KVLAB_KBLOCKS_H

#include "blocks.h"

/* After blocks.h's 32-weight formats; kvlab.models.weights.FORMATS numbers them the same way. */
enum { Q4_K = 5, Q6_K = 6 };
_Static_assert((int)Q4_K == (int)NFORMATS, "the k-quants follow blocks.h's formats");
#define QK_K 256
#define KBLOCK_BYTES(fmt) ((fmt) == Q4_K ? 144 : 210)

/* Q4_K's scale and min of sub-block j (llama.cpp's get_scale_min_k4), each times its fp16 factor:
 * d * sc and dmin * m, exact. */
static inline __attribute__((always_inline)) void q4k_scale(const uint8_t *b, int j, float *dd, float *dm) {
    const uint8_t *s = b + 4;
    int sc, m;
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
    *dd = half_at(b) * (float)sc;
    *dm = half_at(b + 2) * (float)m;
}

/* Where the bytes of weights 32s + 8g..+7 (sub-block s < 8, group g < 4) of a super-block lie:
 * Q4_K's nibbles; Q6_K's low and high bits, and the shifts that bring them down. */
static inline int q4k_at(int s, int g) { return 16 + 32 * (s >> 1) + 8 * g; }
static inline int q6k_lo_at(int s, int g) { return 64 * (s >> 2) + 32 * (s & 1) + 8 * g; }
static inline int q6k_hi_at(int s, int g) { return 128 + 32 * (s >> 2) + 8 * g; }
static inline int q6k_lo_shift(int s) { return 4 * ((s >> 1) & 1); }
static inline int q6k_hi_shift(int s) { return 2 * (s & 3); }

/* Q6_K's scale of weights 16i..16i+15 times d: exact. */
static inline float q6k_scale(const uint8_t *b, int i) {
    return half_at(b + 208) * (float)(int8_t)b[192 + i];
}

static inline __m256i bytes8(const uint8_t *b, int at) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + at)));
}

/* Sub-block s (weights 32s..32s+31) of super-block b in format fmt as fp32, in four groups of 8
 * (out[g]: weights 32s + 8g..+7), as qblock8 gives a 32-weight block. */
static inline __attribute__((always_inline)) void kblock8(const uint8_t *b, const int s, const int fmt, __m256 out[4]) {
    if (fmt == Q4_K) {
        float dd, dm;
        q4k_scale(b, s, &dd, &dm);
        const __m256 d = _mm256_set1_ps(dd), m = _mm256_set1_ps(dm);
        for (int g = 0; g < 4; g++) {
            const __m256i q = bytes8(b, q4k_at(s, g));
            const __m256i nib = s & 1 ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, _mm256_set1_epi32(15));
            out[g] = _mm256_fmsub_ps(d, _mm256_cvtepi32_ps(nib), m);
        }
        return;
    }
    for (int g = 0; g < 4; g++) {
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(bytes8(b, q6k_lo_at(s, g)), q6k_lo_shift(s)),
                                            _mm256_set1_epi32(15));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(bytes8(b, q6k_hi_at(s, g)), q6k_hi_shift(s)),
                                            _mm256_set1_epi32(3));
        const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
        out[g] = _mm256_mul_ps(_mm256_set1_ps(q6k_scale(b, 2 * s + g / 2)), _mm256_cvtepi32_ps(q));
    }
}

/* AVX-512: sub-block s of super-blocks a and b of two weight rows at once, row a's 8 weights in the
 * low half of each zmm, row b's in the high half (as qblock16): each half kblock8's values. */
static inline T512 __m512 pair512(float lo, float hi) {
    return _mm512_insertf32x8(_mm512_set1_ps(lo), _mm256_set1_ps(hi), 1);
}

static inline T512 __m512i bytes16(const uint8_t *a, const uint8_t *b, int at) {
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(a + at)),
                                                   _mm_loadl_epi64((const __m128i *)(b + at))));
}

static inline T512 void kblock16(const uint8_t *a, const uint8_t *b, const int s, const int fmt, __m512 out[4]) {
    if (fmt == Q4_K) {
        float da, ma, db, mb;
        q4k_scale(a, s, &da, &ma);
        q4k_scale(b, s, &db, &mb);
        const __m512 d = pair512(da, db), m = pair512(ma, mb);
        for (int g = 0; g < 4; g++) {
            const __m512i q = bytes16(a, b, q4k_at(s, g));
            const __m512i nib = s & 1 ? _mm512_srli_epi32(q, 4) : _mm512_and_si512(q, _mm512_set1_epi32(15));
            out[g] = _mm512_fmsub_ps(d, _mm512_cvtepi32_ps(nib), m);
        }
        return;
    }
    for (int g = 0; g < 4; g++) {
        const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(bytes16(a, b, q6k_lo_at(s, g)), q6k_lo_shift(s)),
                                            _mm512_set1_epi32(15));
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(bytes16(a, b, q6k_hi_at(s, g)), q6k_hi_shift(s)),
                                            _mm512_set1_epi32(3));
        const __m512i q = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32));
        const __m512 d = pair512(q6k_scale(a, 2 * s + g / 2), q6k_scale(b, 2 * s + g / 2));
        out[g] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q));
    }
}

#endif
