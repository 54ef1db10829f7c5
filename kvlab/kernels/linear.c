/* kvlab's linear layer on x86 CPUs with AVX2 and FMA, fp32 or bf16, and fp32 activations
 * against weights in GGUF's block formats (blocks.h) read as stored.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]): x [M, K], w [N, K] (nn.Linear's layout, used as
 * is: no packed copy), y [M, N], all row-major and contiguous, all fp32 or all bf16. bf16 values
 * are widened exactly, summed in fp32, and each output rounded once (as PyTorch's bf16 matmul),
 * or kept in fp32 (``kvlab_linear_bf16_f32``: the LM head, whose logits are never rounded).
 * A quantised weight row is K / 32 blocks (k-quants: K / 256 super-blocks, kblocks.h); each 8
 * weights are dequantised in registers to exactly the values gguf.quants gives, then summed in
 * the fp32 chain below: the result is bitwise that of the fp32 kernel on the dequantised weight,
 * at a quarter to a seventh of the bytes read.
 *
 * Why: a decode step multiplies a few rows by every weight, so it is a read of the weights.
 * On the AVX2 EPYC kvlab is measured on, MKL's sgemm reads them at 3-8 GB/s for 1-16 rows;
 * this kernel streams each weight row once per call (4 or 8 weight rows at a time, held in L1
 * while every input row passes over them) and reaches 11-17 GB/s (docs/benchmarks.md).
 *
 * Each output is one fixed chain: 8 lanes of FMAs over k in order, then one fixed horizontal
 * sum, then the bias. It does not depend on M, on the row's place in the batch or on the thread
 * count, so every row is bitwise the same whatever runs beside it (deterministic mode).
 */
#include <stdlib.h>

#include "act8.h"
#include "blocks.h"
#include "kblocks.h"
#include "kvlab.h"

#define NB_MAX 8 /* output rows (weight rows) per tile: 8 for one input row, else 4 */
#define MB 3     /* input rows per tile: MB * 4 accumulators + 4 weights + 1 input in 16 registers */
#define MBLOCK 48 /* input rows per pass over the weights (a multiple of MB) */
#define PF_TILES 2 /* block-format weight tiles prefetched ahead (past the end: harmless) */

static int use512; /* kvlab_set_avx512: the block formats' AVX-512 loops, bitwise the AVX2 ones */
static int use_vnni; /* kvlab_set_vnni: KVLAB_VNNI_512, KVLAB_VNNI_AVX or 0 (AVX2), bitwise alike */


/* Input rows m0..m0+mb-1 against weight rows n0..n0+nn-1 (nn <= nb); mb, nb and bf16 are
 * constants after inlining, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const void *x, const void *w, const void *b,
                                                       void *y, long m0, const int mb, long n0,
                                                       const int nb, long nn, long N, long K,
                                                       const int bf16, const int ybf16) {
    const void *wr[NB_MAX], *xr[MB];
    for (int j = 0; j < nb; j++) wr[j] = row_at(w, n0 + (j < nn ? j : 0), K, bf16);
    for (int i = 0; i < mb; i++) xr[i] = row_at(x, m0 + i, K, bf16);
    __m256 acc[MB][NB_MAX];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm256_setzero_ps();
    long k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[NB_MAX];
        for (int j = 0; j < nb; j++) wv[j] = load8(wr[j], k, bf16);
        for (int i = 0; i < mb; i++) {
            __m256 xv = load8(xr[i], k, bf16);
            for (int j = 0; j < nb; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nn; j++) {
            float s = hsum(acc[i][j]);
            for (long kk = k; kk < K; kk++) s += load1(xr[i], kk, bf16) * load1(wr[j], kk, bf16);
            if (b) s += load1(b, n0 + j, bf16);
            store1(y, (m0 + i) * N + n0 + j, s, ybf16);
        }
}

/* A block format's unit of storage: a k-quant's super-block of 8 blocks of 32 weights
 * (kblocks.h), else one block of 32 (blocks.h). fmt is a constant wherever these inline. */
#define IS_K(fmt) ((fmt) == Q4_K || (fmt) == Q6_K)
#define UNIT_BYTES(fmt) (IS_K(fmt) ? KBLOCK_BYTES(fmt) : BLOCK_BYTES[fmt])
#define UNIT_BLOCKS(fmt) (IS_K(fmt) ? QK_K / QK : 1)

/* Block s of the unit at u as fp32, in four groups of 8 (qblock8 / kblock8). */
static inline __attribute__((always_inline)) void block8(const uint8_t *u, int s, const int fmt, __m256 out[4]) {
    if (IS_K(fmt)) kblock8(u, s, fmt, out);
    else qblock8(u, fmt, out);
}

/* The same for two rows' units at once (qblock16 / kblock16). */
static inline T512 void block16(const uint8_t *a, const uint8_t *b, int s, const int fmt, __m512 out[4]) {
    if (IS_K(fmt)) kblock16(a, b, s, fmt, out);
    else qblock16(a, b, fmt, out);
}

/* A block-format tile's outputs y[m0 + i, n0 + j]: each accumulator's fixed horizontal sum,
 * then the bias. */
static inline __attribute__((always_inline)) void qstore(__m256 acc[][NB_MAX], const int mb, long nn,
                                                         const float *b, float *y, long m0, long n0, long N) {
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nn; j++) {
            float s = hsum(acc[i][j]);
            if (b) s += b[n0 + j];
            y[(m0 + i) * N + n0 + j] = s;
        }
}

/* The same for the AVX-512 tiles' pairs: weight row j in half j % 2 of acc[i][j / 2]. */
static inline T512 void qstore512(__m512 acc[][NB_MAX / 2], const int mb, long nn, const float *b, float *y,
                                  long m0, long n0, long N) {
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nn; j++) {
            __m256 half = j % 2 ? _mm512_extractf32x8_ps(acc[i][j / 2], 1) : _mm512_castps512_ps256(acc[i][j / 2]);
            float s = hsum(half);
            if (b) s += b[n0 + j];
            y[(m0 + i) * N + n0 + j] = s;
        }
}

/* tile() for fp32 rows against a weight in block format fmt (K a multiple of its unit): the same
 * chain of FMAs, each block of 32 weights dequantised as it is loaded, a row's whole unit before
 * the next row's (k-quants, measured: 1.5-2.7x the rate of interleaving rows per 32 weights,
 * AVX2). Each row of the tile is prefetched PF_TILES tiles ahead, unit by unit, every 64 bytes of
 * it: a row is read a few bytes a step, too slowly for the hardware prefetcher alone (measured:
 * half the rate from DRAM without it). */
static inline __attribute__((always_inline)) void qtile(const float *x, const uint8_t *w, const float *b,
                                                        float *y, long m0, const int mb, long n0,
                                                        const int nb, long nn, long N, long K, const int fmt) {
    const long ub = UNIT_BYTES(fmt), us = UNIT_BLOCKS(fmt), uk = us * QK, rb = K / uk * ub;
    const uint8_t *wr[NB_MAX];
    const float *xr[MB];
    for (int j = 0; j < nb; j++) wr[j] = w + (n0 + (j < nn ? j : 0)) * rb;
    for (int i = 0; i < mb; i++) xr[i] = x + (m0 + i) * K;
    __m256 acc[MB][NB_MAX];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm256_setzero_ps();
    for (long ku = 0; ku < K / uk; ku++) {
        for (int j = 0; j < nb; j++)
            for (long l = 0; l < ub; l += 64)
                _mm_prefetch((const char *)(wr[j] + PF_TILES * nb * rb + ku * ub + l), _MM_HINT_T0);
        for (int j = 0; j < nb; j++)
            for (int sb = 0; sb < us; sb++) {
                __m256 wv[4];
                block8(wr[j] + ku * ub, sb, fmt, wv);
                for (int i = 0; i < mb; i++)
                    for (int g = 0; g < 4; g++)
                        acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[i] + ku * uk + QK * sb + 8 * g), wv[g], acc[i][j]);
            }
    }
    qstore(acc, mb, nn, b, y, m0, n0, N);
}

/* qtile with AVX-512: weight rows in pairs, one zmm per pair and input row (qblock16), each half
 * the 8-lane chain of qtile, so the same bits at about half the instructions per weight. */
static inline T512 void qtile512(const float *x, const uint8_t *w, const float *b, float *y, long m0,
                                 const int mb, long n0, const int nb, long nn, long N, long K, const int fmt) {
    const long ub = UNIT_BYTES(fmt), us = UNIT_BLOCKS(fmt), uk = us * QK, rb = K / uk * ub;
    const uint8_t *wr[NB_MAX];
    const float *xr[MB];
    for (int j = 0; j < nb; j++) wr[j] = w + (n0 + (j < nn ? j : 0)) * rb;
    for (int i = 0; i < mb; i++) xr[i] = x + (m0 + i) * K;
    __m512 acc[MB][NB_MAX / 2];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb / 2; j++) acc[i][j] = _mm512_setzero_ps();
    for (long ku = 0; ku < K / uk; ku++) {
        for (int j = 0; j < nb; j++)
            for (long l = 0; l < ub; l += 64)
                _mm_prefetch((const char *)(wr[j] + PF_TILES * nb * rb + ku * ub + l), _MM_HINT_T0);
        for (int j = 0; j < nb / 2; j++)
            for (int sb = 0; sb < us; sb++) {
                __m512 wv[4];
                block16(wr[2 * j] + ku * ub, wr[2 * j + 1] + ku * ub, sb, fmt, wv);
                for (int i = 0; i < mb; i++)
                    for (int g = 0; g < 4; g++)
                        acc[i][j] = _mm512_fmadd_ps(
                            _mm512_broadcast_f32x8(_mm256_loadu_ps(xr[i] + ku * uk + QK * sb + 8 * g)), wv[g], acc[i][j]);
            }
    }
    qstore512(acc, mb, nn, b, y, m0, n0, N);
}

/* Past one tile of input rows, each weight tile is dequantised once to fp32 (dtile, dtile512),
 * then every tile of input rows multiplies by the stored values (btile, btile512): the same
 * values in the same chains, so the same bits as qtile, with the dequantising done once per
 * MBLOCK input rows instead of once per MB (measured, Q4_1 1536 x 576 at 16-512 rows on 2
 * threads: 1.4x the rate on the AVX-512 loop, 1.5x on AVX2; docs/benchmarks.md).
 * The buffer is the calling thread's own, nb * K floats, kept for its next call. */
static float *tile_buffer(long floats) {
    static __thread float *buf;
    static __thread long cap;
    if (floats > cap) {
        free(buf);
        buf = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        cap = buf ? floats : 0;
    }
    return buf;
}

/* The weight tiles PF_TILES ahead of rows wr[0..nb), as qtile prefetches them. */
static inline __attribute__((always_inline)) void prefetch_tiles(const uint8_t *const *wr, const int nb, long rb) {
    for (int j = 0; j < nb; j++)
        for (long l = 0; l < rb; l += 64) _mm_prefetch((const char *)(wr[j] + PF_TILES * nb * rb + l), _MM_HINT_T0);
}

/* Weight rows wr[0..nb) as fp32, row j at buf + j * K. */
static inline __attribute__((always_inline)) void dtile(const uint8_t *const *wr, const int nb, long K,
                                                        const int fmt, float *buf) {
    const long ub = UNIT_BYTES(fmt), us = UNIT_BLOCKS(fmt), uk = us * QK;
    prefetch_tiles(wr, nb, K / uk * ub);
    for (int j = 0; j < nb; j++)
        for (long ku = 0; ku < K / uk; ku++)
            for (int sb = 0; sb < us; sb++) {
                __m256 v[4];
                block8(wr[j] + ku * ub, sb, fmt, v);
                for (int g = 0; g < 4; g++) _mm256_store_ps(buf + j * K + ku * uk + QK * sb + 8 * g, v[g]);
            }
}

/* The same in qtile512's pairs: pair j's 8 weights k.. of both rows at buf + 2 * (j * K + k). */
static inline T512 void dtile512(const uint8_t *const *wr, const int nb, long K, const int fmt, float *buf) {
    const long ub = UNIT_BYTES(fmt), us = UNIT_BLOCKS(fmt), uk = us * QK;
    prefetch_tiles(wr, nb, K / uk * ub);
    for (int j = 0; j < nb / 2; j++)
        for (long ku = 0; ku < K / uk; ku++)
            for (int sb = 0; sb < us; sb++) {
                __m512 v[4];
                block16(wr[2 * j] + ku * ub, wr[2 * j + 1] + ku * ub, sb, fmt, v);
                for (int g = 0; g < 4; g++) _mm512_store_ps(buf + 2 * (j * K + ku * uk + QK * sb + 8 * g), v[g]);
            }
}

/* qtile's sums for input rows m0..m0+mb-1 against dtile's rows. */
static inline __attribute__((always_inline)) void btile(const float *x, const float *buf, const float *b,
                                                        float *y, long m0, const int mb, long n0,
                                                        const int nb, long nn, long N, long K) {
    __m256 acc[MB][NB_MAX];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm256_setzero_ps();
    for (long k = 0; k < K; k += 8) { /* 3 x 4 accumulators, 3 inputs and 1 weight: 16 registers */
        __m256 xv[MB];
        for (int i = 0; i < mb; i++) xv[i] = _mm256_loadu_ps(x + (m0 + i) * K + k);
        for (int j = 0; j < nb; j++) {
            const __m256 wv = _mm256_load_ps(buf + j * K + k);
            for (int i = 0; i < mb; i++) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
        }
    }
    qstore(acc, mb, nn, b, y, m0, n0, N);
}

#define MB512 8 /* btile512's input rows: 8 x 2 accumulators, 2 weights and 1 input of 32 registers */

/* qtile512's sums for input rows m0..m0+mb-1 (mb <= MB512) against dtile512's pairs. */
static inline T512 void btile512(const float *x, const float *buf, const float *b, float *y, long m0,
                                 const int mb, long n0, const int nb, long nn, long N, long K) {
    __m512 acc[MB512][NB_MAX / 2];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb / 2; j++) acc[i][j] = _mm512_setzero_ps();
    for (long k = 0; k < K; k += 8) {
        __m512 wv[NB_MAX / 2];
        for (int j = 0; j < nb / 2; j++) wv[j] = _mm512_load_ps(buf + 2 * (j * K + k));
        for (int i = 0; i < mb; i++) {
            const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + (m0 + i) * K + k));
            for (int j = 0; j < nb / 2; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    qstore512(acc, mb, nn, b, y, m0, n0, N);
}

/* Input rows m0..end-1 (fewer than MB512) by btile512, mb a constant in each call. */
static inline T512 void btail512(const float *x, const float *buf, const float *b, float *y, long m0,
                                 long end, long n0, const int nb, long nn, long N, long K) {
    switch (end - m0) {
    case 7: btile512(x, buf, b, y, m0, 7, n0, nb, nn, N, K); break;
    case 6: btile512(x, buf, b, y, m0, 6, n0, nb, nn, N, K); break;
    case 5: btile512(x, buf, b, y, m0, 5, n0, nb, nn, N, K); break;
    case 4: btile512(x, buf, b, y, m0, 4, n0, nb, nn, N, K); break;
    case 3: btile512(x, buf, b, y, m0, 3, n0, nb, nn, N, K); break;
    case 2: btile512(x, buf, b, y, m0, 2, n0, nb, nn, N, K); break;
    case 1: btile512(x, buf, b, y, m0, 1, n0, nb, nn, N, K); break;
    }
}

/* The same for btile (MB = 3). */
static inline __attribute__((always_inline)) void btail(const float *x, const float *buf, const float *b,
                                                        float *y, long m0, long end, long n0, const int nb,
                                                        long nn, long N, long K) {
    if (end - m0 == 2) btile(x, buf, b, y, m0, 2, n0, nb, nn, N, K);
    else if (end - m0 == 1) btile(x, buf, b, y, m0, 1, n0, nb, nn, N, K);
}

/* One weight tile (weight rows n0.., input rows block..end) of a part in block format fmt, by
 * qtile or (wide) qtile512, or past one tile of input rows dequantised once (DTILE) and summed by
 * BTILE, BROWS rows at a time: the same bits every way. */
#define QTILES(NAME, TILE, DTILE, BTILE, BROWS, BTAIL, ATTR)                                          \
    static inline ATTR void NAME(const float *x, const kvlab_part *part, long n0, int nb, long block, \
                                 long end, long M, long K, const int fmt) {                           \
        const long N = part->N, nn = N - n0 < nb ? N - n0 : nb;                                      \
        const uint8_t *w = part->w;                                                                   \
        const float *b = part->b;                                                                     \
        float *y = part->y;                                                                           \
        if (M == 1) {                                                                                 \
            TILE(x, w, b, y, 0, 1, n0, 8, nn, N, K, fmt);                                             \
            return;                                                                                   \
        }                                                                                             \
        long m0 = block;                                                                              \
        float *buf = end - block > MB ? tile_buffer(4 * K) : NULL;                                    \
        if (buf) {                                                                                    \
            const long rb = K / (UNIT_BLOCKS(fmt) * QK) * UNIT_BYTES(fmt);                          \
            const uint8_t *wr[4];                                                                     \
            for (int j = 0; j < 4; j++) wr[j] = w + (n0 + (j < nn ? j : 0)) * rb;                    \
            DTILE(wr, 4, K, fmt, buf);                                                                \
            for (; m0 + BROWS <= end; m0 += BROWS) BTILE(x, buf, b, y, m0, BROWS, n0, 4, nn, N, K);   \
            BTAIL(x, buf, b, y, m0, end, n0, 4, nn, N, K);                                            \
            return;                                                                                   \
        }                                                                                             \
        for (; m0 + MB <= end; m0 += MB) TILE(x, w, b, y, m0, MB, n0, 4, nn, N, K, fmt);              \
        if (end - m0 == 2) TILE(x, w, b, y, m0, 2, n0, 4, nn, N, K, fmt);                             \
        else if (end - m0 == 1) TILE(x, w, b, y, m0, 1, n0, 4, nn, N, K, fmt);                        \
    }
QTILES(qtiles, qtile, dtile, btile, MB, btail, __attribute__((always_inline)))
QTILES(qtiles512_fmt, qtile512, dtile512, btile512, MB512, btail512, T512)

/* --activations int8 (act8.h). A tile is W weight rows (W = 8: AVX2's and AVX-VNNI's loops, 16:
 * AVX512-VNNI's), one output per lane. Its blocks are transposed into a panel, PANEL_BLOCKS at a
 * time: for every block and 4-weight chunk c, W lanes of the rows' 4 bytes at c (act8_weights'
 * bytes; Q8_0's also as |w|, the unsigned operand). Then each input row, per block: 8 dot
 * products of a chunk with the row's 4 quantised values at c broadcast (vpdpbusd, or vpmaddubsw
 * + vpmaddwd) give each lane its block's exact integer sum S; the output's chain is one fp32
 * multiply-add per block, acc = fma(S, d_w * d_x, acc) (Q4_1's m_w (d_x s) summed apart), the
 * same on every ISA and for every M: the integers are exact whatever computed them. A panel is
 * built once a pass of MBLOCK rows, so prefill's rows share its cost; one row (a decode step)
 * skips it (act8_row1_*, below). */
#define PANEL_BLOCKS 32 /* 16 KB of panel (32 KB for Q8_0) at W = 16: it stays in L1 */

typedef struct {
    uint8_t w[PANEL_BLOCKS * 8 * 4 * 16];   /* [block][chunk][W] 4-byte chunks, as act8_weights gives them */
    uint8_t abs[PANEL_BLOCKS * 8 * 4 * 16]; /* Q8_0: the same as |w| (w's signs go onto x) */
    float dw[PANEL_BLOCKS * 16], mw[PANEL_BLOCKS * 16]; /* [block][W]: scales; Q4_1's minimums */
} act8_panel;

/* 8 rows' 32 bytes (r[j]: row j's chunks 0-7) -> out[c]: chunk c of rows 0-7, one row a lane. */
static inline __attribute__((always_inline)) void transpose8(const __m256i r[8], __m256i out[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int h = 0; h < 8; h += 4) {
        u[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);
        u[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);
        u[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
        u[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
    }
    for (int c = 0; c < 4; c++) {
        out[c] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x20);
        out[c + 4] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x31);
    }
}

/* The panel of blocks kb0..kb0+nk-1 of weight rows n0..n0+W-1 (rows past nn repeat row n0:
 * computed, never stored). */
static inline __attribute__((always_inline)) void act8_build(act8_panel *pn, const uint8_t *w, long n0, long nn,
                                                             long rb, long kb0, int nk, const int W, const int fmt) {
    const long bb = BLOCK_BYTES[fmt];
    for (int k = 0; k < nk; k++)
        for (int g = 0; g < W; g += 8) {
            __m256i r[8], t[8];
            for (int j = 0; j < 8; j++) {
                const uint8_t *blk = w + (n0 + (g + j < nn ? g + j : 0)) * rb + (kb0 + k) * bb;
                _mm_prefetch((const char *)(blk + PF_TILES * W * rb), _MM_HINT_T0); /* the tiles ahead */
                r[j] = act8_weights(blk, fmt);
                pn->dw[k * W + g + j] = half_at(blk);
                pn->mw[k * W + g + j] = fmt == Q4_1 ? half_at(blk + 2) : 0.0f;
            }
            transpose8(r, t);
            for (int c = 0; c < 8; c++) {
                const long at = (k * 8 + c) * 4 * W + 4 * g;
                _mm256_storeu_si256((__m256i *)(pn->w + at), t[c]);
                if (fmt == Q8_0) _mm256_storeu_si256((__m256i *)(pn->abs + at), _mm256_abs_epi8(t[c]));
            }
        }
}

/* R rows (m0..) over the panel's nk blocks (blocks kb0.. of the rows), their sums carried in acc
 * and ext ([R][8]), in 8 lanes: DOT4 is AVX2's vpmaddubsw + vpmaddwd or AVX-VNNI's vpdpbusd. */
#define ACT8_ROWS8(NAME, DOT4, ATTR)                                                                        \
    static inline ATTR void NAME(const act8_panel *pn, const act8_rows *xa, long kb0, int nk, float *accp, \
                                 float *extp, long m0, const int R, const int fmt) {                       \
        const int offset = fmt == Q4_0 ? 8 : fmt == Q5_0 ? 16 : 0;                                          \
        const long nblk = xa->K / QK;                                                                       \
        __m256 acc[4], ext[4];                                                                              \
        for (int i = 0; i < R; i++) acc[i] = _mm256_loadu_ps(accp + 8 * i), ext[i] = _mm256_loadu_ps(extp + 8 * i); \
        for (int k = 0; k < nk; k++) {                                                                      \
            const __m256 dw = _mm256_loadu_ps(pn->dw + k * 8), mw = _mm256_loadu_ps(pn->mw + k * 8);        \
            const uint8_t *wc = pn->w + k * 8 * 32, *ac = pn->abs + k * 8 * 32;                             \
            for (int i = 0; i < R; i++) {                                                                   \
                const long at = (m0 + i) * nblk + kb0 + k;                                                  \
                const int32_t *xq = (const int32_t *)(xa->q + at * QK);                                     \
                __m256i s = _mm256_setzero_si256();                                                         \
                for (int c = 0; c < 8; c++) {                                                               \
                    __m256i x = _mm256_set1_epi32(xq[c]);                                                   \
                    const __m256i wv = _mm256_loadu_si256((const __m256i *)(wc + c * 32));                  \
                    if (fmt == Q8_0) x = _mm256_sign_epi8(x, wv);                                           \
                    s = DOT4(s, fmt == Q8_0 ? _mm256_loadu_si256((const __m256i *)(ac + c * 32)) : wv, x);  \
                }                                                                                           \
                const float dx = xa->d[at];                                                                 \
                const int32_t sx = xa->s[at];                                                               \
                s = _mm256_sub_epi32(s, _mm256_set1_epi32(offset * sx));                                    \
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_set1_ps(dx)), acc[i]); \
                if (fmt == Q4_1) ext[i] = _mm256_add_ps(ext[i], _mm256_mul_ps(mw, _mm256_set1_ps(dx * (float)sx))); \
            }                                                                                               \
        }                                                                                                   \
        for (int i = 0; i < R; i++) _mm256_storeu_ps(accp + 8 * i, acc[i]), _mm256_storeu_ps(extp + 8 * i, ext[i]); \
    }

static inline __attribute__((always_inline)) __m256i dot4_avx2(__m256i s, __m256i w, __m256i x) {
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
static inline T_AVXVNNI __m256i dot4_avxvnni(__m256i s, __m256i w, __m256i x) {
    return _mm256_dpbusd_avx_epi32(s, w, x);
}
ACT8_ROWS8(act8_rows8, dot4_avx2, __attribute__((always_inline)))
ACT8_ROWS8(act8_rows8_avxvnni, dot4_avxvnni, T_AVXVNNI)

/* ACT8_ROWS8 in 16 lanes (AVX512-VNNI): the same per-lane operations, so the same bits. */
static inline T_VNNI void act8_rows16(const act8_panel *pn, const act8_rows *xa, long kb0, int nk, float *accp,
                                      float *extp, long m0, const int R, const int fmt) {
    const int offset = fmt == Q4_0 ? 8 : fmt == Q5_0 ? 16 : 0;
    const long nblk = xa->K / QK;
    __m512 acc[8], ext[8];
    for (int i = 0; i < R; i++) acc[i] = _mm512_loadu_ps(accp + 16 * i), ext[i] = _mm512_loadu_ps(extp + 16 * i);
    for (int k = 0; k < nk; k++) {
        const __m512 dw = _mm512_loadu_ps(pn->dw + k * 16), mw = _mm512_loadu_ps(pn->mw + k * 16);
        const uint8_t *wc = pn->w + k * 8 * 64, *ac = pn->abs + k * 8 * 64;
        for (int i = 0; i < R; i++) {
            const long at = (m0 + i) * nblk + kb0 + k;
            const int32_t *xq = (const int32_t *)(xa->q + at * QK);
            __m512i s = _mm512_setzero_si512();
            for (int c = 0; c < 8; c++) {
                __m512i x = _mm512_set1_epi32(xq[c]);
                const __m512i wv = _mm512_loadu_si512(wc + c * 64);
                if (fmt == Q8_0) { /* x's sign by w's: vpsignb has no 512-bit form (w = 0: |w| = 0) */
                    x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(wv), _mm512_setzero_si512(), x);
                    s = _mm512_dpbusd_epi32(s, _mm512_loadu_si512(ac + c * 64), x);
                } else {
                    s = _mm512_dpbusd_epi32(s, wv, x);
                }
            }
            const float dx = xa->d[at];
            const int32_t sx = xa->s[at];
            s = _mm512_sub_epi32(s, _mm512_set1_epi32(offset * sx));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(dx)), acc[i]);
            if (fmt == Q4_1) ext[i] = _mm512_add_ps(ext[i], _mm512_mul_ps(mw, _mm512_set1_ps(dx * (float)sx)));
        }
    }
    for (int i = 0; i < R; i++) _mm512_storeu_ps(accp + 16 * i, acc[i]), _mm512_storeu_ps(extp + 16 * i, ext[i]);
}

/* The 8 int32 lanes of each of p[0..7] summed: one vector of the 8 totals, in p's order. */
static inline __attribute__((always_inline)) __m256i hsum8_epi32(const __m256i p[8]) {
    const __m256i a0 = _mm256_hadd_epi32(p[0], p[1]), a1 = _mm256_hadd_epi32(p[2], p[3]);
    const __m256i a2 = _mm256_hadd_epi32(p[4], p[5]), a3 = _mm256_hadd_epi32(p[6], p[7]);
    const __m256i b0 = _mm256_hadd_epi32(a0, a1), b1 = _mm256_hadd_epi32(a2, a3); /* [p0-3 lo | p0-3 hi] */
    return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}

/* Each weight row's first 4 bytes of a block, 8 rows a vector (idx: the rows' byte offsets
 * from row 0), as fp32: the scale d of the low 16 bits, and Q4_1's minimum m of the high 16. */
static inline __attribute__((always_inline)) void act8_heads(const uint8_t *at, __m256i idx, __m256 *d, __m256 *m) {
    const __m256i head = _mm256_i32gather_epi32((const int *)at, idx, 1);
    const __m256i halves = _mm256_shuffle_epi8(head, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                                                      0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const __m256i ordered = _mm256_permute4x64_epi64(halves, 0xD8); /* [lo halves 0-7 | hi halves 0-7] */
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(ordered));
    *m = _mm256_cvtph_ps(_mm256_extracti128_si256(ordered, 1));
}

/* One input row (a decode step's) against weight rows n0.. of an int8 part, every block, with
 * no panel: each weight row's block is dotted with the row's 32 quantised values in one 256-bit
 * dot (8 partial sums, added up 8 weight rows at a time by hsum8_epi32). The integer S of each
 * lane is the one the panel's loop gets (an exact sum: its order does not matter) and enters
 * the same fp32 chain, so the bits are those of every M; what one row saves is the panel's
 * transposition, which only several rows share. DOT(w, x): 8 int32 sums of 4 products each.
 * Lanes g * 8 .. g * 8 + 7 are weight rows n0 + g * 8 .. (rows past nn repeat row n0). */
#define ACT8_ROW1_SUMS(DOT, W)                                                                               \
    const long at = m * nblk + k;                                                                            \
    const __m256i xq = _mm256_loadu_si256((const __m256i *)(xa->q + at * QK));                             \
    __m256i sums[W / 8];                                                                                     \
    __m256 dw[W / 8], mw[W / 8];                                                                             \
    for (int g = 0; g < W / 8; g++) {                                                                        \
        __m256i p[8];                                                                                        \
        for (int j = 0; j < 8; j++) {                                                                        \
            const uint8_t *blk = wr[g * 8 + j] + k * bb;                                                     \
            _mm_prefetch((const char *)(blk + PF_TILES * W * rb), _MM_HINT_T0); /* the tiles ahead */       \
            const __m256i w = act8_weights(blk, fmt);                                                        \
            p[j] = fmt == Q8_0 ? DOT(_mm256_abs_epi8(w), _mm256_sign_epi8(xq, w)) : DOT(w, xq);             \
        }                                                                                                    \
        sums[g] = hsum8_epi32(p);                                                                            \
        act8_heads(wr[0] + k * bb, idx[g], &dw[g], &mw[g]);                                                  \
    }                                                                                                        \
    const float dx = xa->d[at];                                                                              \
    const int32_t sx = xa->s[at];

/* The weight rows' pointers and their offsets from row n0, for ACT8_ROW1_SUMS. */
#define ACT8_ROW1_SETUP(W)                                                                                   \
    const int offset = fmt == Q4_0 ? 8 : fmt == Q5_0 ? 16 : 0;                                              \
    const long nblk = xa->K / QK, bb = BLOCK_BYTES[fmt], rb = nblk * bb;                                    \
    const uint8_t *wr[W];                                                                                    \
    int32_t offs[W];                                                                                         \
    for (int j = 0; j < W; j++) offs[j] = (int32_t)((j < nn ? j : 0) * rb), wr[j] = part->w + n0 * rb + offs[j]; \
    __m256i idx[W / 8];                                                                                      \
    for (int g = 0; g < W / 8; g++) idx[g] = _mm256_loadu_si256((const __m256i *)(offs + 8 * g));

#define ACT8_ROW1_8(NAME, DOT, ATTR)                                                                         \
    static inline ATTR void NAME(const act8_rows *xa, const kvlab_part *part, long n0, long nn, long m,    \
                                 float *accp, float *extp, const int fmt) {                                 \
        ACT8_ROW1_SETUP(8)                                                                                   \
        __m256 acc = _mm256_setzero_ps(), ext = _mm256_setzero_ps();                                         \
        for (long k = 0; k < nblk; k++) {                                                                    \
            ACT8_ROW1_SUMS(DOT, 8)                                                                           \
            const __m256i s = _mm256_sub_epi32(sums[0], _mm256_set1_epi32(offset * sx));                    \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw[0], _mm256_set1_ps(dx)), acc);     \
            if (fmt == Q4_1) ext = _mm256_add_ps(ext, _mm256_mul_ps(mw[0], _mm256_set1_ps(dx * (float)sx))); \
        }                                                                                                    \
        _mm256_storeu_ps(accp, acc), _mm256_storeu_ps(extp, ext);                                            \
    }

static inline __attribute__((always_inline)) __m256i dot_avx2(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}
static inline T_AVXVNNI __m256i dot_avxvnni(__m256i w, __m256i x) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
}
ACT8_ROW1_8(act8_row1_avx2, dot_avx2, __attribute__((always_inline)))
ACT8_ROW1_8(act8_row1_avxvnni, dot_avxvnni, T_AVXVNNI)

static inline T_VNNI __m256i dot_vnni(__m256i w, __m256i x) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
}

static inline T_VNNI __m512 join8(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}

/* ACT8_ROW1_8 in 16 lanes (AVX512-VNNI): the same sums and per-lane operations, so the same bits. */
static inline T_VNNI void act8_row1_vnni(const act8_rows *xa, const kvlab_part *part, long n0, long nn, long m,
                                         float *accp, float *extp, const int fmt) {
    ACT8_ROW1_SETUP(16)
    __m512 acc = _mm512_setzero_ps(), ext = _mm512_setzero_ps();
    for (long k = 0; k < nblk; k++) {
        ACT8_ROW1_SUMS(dot_vnni, 16)
        const __m512i s = _mm512_sub_epi32(_mm512_inserti64x4(_mm512_castsi256_si512(sums[0]), sums[1], 1),
                                           _mm512_set1_epi32(offset * sx));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(join8(dw[0], dw[1]), _mm512_set1_ps(dx)), acc);
        if (fmt == Q4_1) ext = _mm512_add_ps(ext, _mm512_mul_ps(join8(mw[0], mw[1]), _mm512_set1_ps(dx * (float)sx)));
    }
    _mm512_storeu_ps(accp, acc), _mm512_storeu_ps(extp, ext);
}

/* One tile of an int8-activation part: weight rows n0..n0+nb-1 (nb <= W) against input rows
 * block..end-1 (at most MBLOCK), RMAX at a time and the rest in one call of their count (a
 * constant in each call, so the accumulators stay in registers); then the outputs. */
#define ACT8_TILES(NAME, ROWS, ROW1, W, RMAX, ATTR)                                                         \
    static inline ATTR void NAME(const act8_rows *xa, const kvlab_part *part, long n0, int nb, long block, \
                                 long end, const int fmt) {                                                 \
        const long N = part->N, nn = N - n0 < nb ? N - n0 : nb, nblk = xa->K / QK;                          \
        act8_panel pn;                                                                                      \
        float acc[MBLOCK * W], ext[MBLOCK * W];                                                             \
        memset(acc, 0, sizeof(float) * (end - block) * W);                                                  \
        memset(ext, 0, sizeof(float) * (end - block) * W);                                                  \
        if (end - block == 1) ROW1(xa, part, n0, nn, block, acc, ext, fmt);                                 \
        else for (long kb0 = 0; kb0 < nblk; kb0 += PANEL_BLOCKS) {                                          \
            const int nk = nblk - kb0 < PANEL_BLOCKS ? (int)(nblk - kb0) : PANEL_BLOCKS;                    \
            act8_build(&pn, part->w, n0, nn, nblk * BLOCK_BYTES[fmt], kb0, nk, W, fmt);                     \
            long m0 = block;                                                                                \
            for (; m0 + RMAX <= end; m0 += RMAX)                                                            \
                ROWS(&pn, xa, kb0, nk, acc + (m0 - block) * W, ext + (m0 - block) * W, m0, RMAX, fmt);      \
            float *a = acc + (m0 - block) * W, *e = ext + (m0 - block) * W;                                 \
            switch (end - m0) {                                                                             \
            case 1: if (1 < RMAX) ROWS(&pn, xa, kb0, nk, a, e, m0, 1, fmt); break;                          \
            case 2: if (2 < RMAX) ROWS(&pn, xa, kb0, nk, a, e, m0, 2, fmt); break;                          \
            case 3: if (3 < RMAX) ROWS(&pn, xa, kb0, nk, a, e, m0, 3, fmt); break;                          \
            case 4: if (4 < RMAX) ROWS(&pn, xa, kb0, nk, a, e, m0, 4, fmt); break;                          \
            case 5: if (5 < RMAX) ROWS(&pn, xa, kb0, nk, a, e, m0, 5, fmt); break;                          \
            case 6: if (6 < RMAX) ROWS(&pn, xa, kb0, nk, a, e, m0, 6, fmt); break;                          \
            case 7: if (7 < RMAX) ROWS(&pn, xa, kb0, nk, a, e, m0, 7, fmt); break;                          \
            }                                                                                               \
        }                                                                                                   \
        for (long m = block; m < end; m++)                                                                  \
            for (long j = 0; j < nn; j++) {                                                                 \
                const long at = (m - block) * W + j;                                                        \
                float o = fmt == Q4_1 ? acc[at] + ext[at] : acc[at];                                        \
                if (part->b) o += ((const float *)part->b)[n0 + j];                                         \
                ((float *)part->y)[m * N + n0 + j] = o;                                                     \
            }                                                                                               \
    }
ACT8_TILES(act8_tiles_avx2_fmt, act8_rows8, act8_row1_avx2, 8, 4, __attribute__((always_inline)))
ACT8_TILES(act8_tiles_avxvnni_fmt, act8_rows8_avxvnni, act8_row1_avxvnni, 8, 4, T_AVXVNNI)
ACT8_TILES(act8_tiles_vnni_fmt, act8_rows16, act8_row1_vnni, 16, 8, T_VNNI)

/* The format as a constant inside each; each ISA's loop in a function of its own target, which
 * runs only where kvlab_set_vnni found the CPU's. */
#define ACT8_BY_FORMAT(NAME, FMT_TILES, TARGET)                                                             \
    static __attribute__((target(TARGET), noinline)) void NAME(const act8_rows *xa, const kvlab_part *part, \
                                                               long n0, int nb, long block, long end) {     \
        switch (part->fmt & ~KVLAB_ACT8) {                                                                   \
        case Q8_0: FMT_TILES(xa, part, n0, nb, block, end, Q8_0); break;                                     \
        case Q4_0: FMT_TILES(xa, part, n0, nb, block, end, Q4_0); break;                                     \
        case Q4_1: FMT_TILES(xa, part, n0, nb, block, end, Q4_1); break;                                     \
        default: FMT_TILES(xa, part, n0, nb, block, end, Q5_0); break;                                       \
        }                                                                                                    \
    }
ACT8_BY_FORMAT(act8_tiles_avx2, act8_tiles_avx2_fmt, "avx2,fma,f16c")
ACT8_BY_FORMAT(act8_tiles_avxvnni, act8_tiles_avxvnni_fmt, "avx2,fma,f16c,avxvnni")
ACT8_BY_FORMAT(act8_tiles_vnni, act8_tiles_vnni_fmt, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")

/* kvlab_quantize_act8's arguments, for the pool's chunks of rows. */
typedef struct {
    const float *x;
    int8_t *q;
    float *d;
    int32_t *s;
    long K;
} quantize_job;

static void quantize_rows(void *arg, long r0, long r1) {
    const quantize_job *job = arg;
    const long nblk = job->K / QK;
    for (long r = r0; r < r1; r++)
        for (long kb = 0; kb < nblk; kb++) {
            const long at = r * nblk + kb;
            act8_block(job->x + at * QK, job->q + at * QK, job->d + at, job->s + at);
        }
}

void kvlab_quantize_act8(const float *x, int8_t *q, float *d, int32_t *s, long M, long K, int threads) {
    quantize_job job = {x, q, d, s, K};
    kvlab_parallel(M, 0, threads, quantize_rows, &job);
}

/* The calling thread's buffer for a call's quantised rows (K / 32 blocks of 32 + 8 bytes a row),
 * kept for its next call. */
static uint8_t *act8_buffer(long bytes) {
    static __thread uint8_t *buf;
    static __thread long cap;
    if (bytes > cap) {
        free(buf);
        buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        cap = buf ? bytes : 0;
    }
    return buf;
}

/* kvlab_dequantize's arguments, for the pool's chunks of blocks (pool.c). */
typedef struct {
    const uint8_t *w;
    float *out;
    int fmt;
} dequantize_job;


/* Not inlined into linear(): its AVX-512 code runs only where kvlab_set_avx512 found the CPU's. */
static __attribute__((target("avx2,fma,f16c,avx512f,avx512dq"), noinline)) void
qtiles512(const float *x, const kvlab_part *part, long n0, int nb, long block, long end, long M, long K) {
    switch (part->fmt) {
    case Q8_0: qtiles512_fmt(x, part, n0, nb, block, end, M, K, Q8_0); break;
    case Q4_0: qtiles512_fmt(x, part, n0, nb, block, end, M, K, Q4_0); break;
    case Q4_1: qtiles512_fmt(x, part, n0, nb, block, end, M, K, Q4_1); break;
    case Q4_K: qtiles512_fmt(x, part, n0, nb, block, end, M, K, Q4_K); break;
    case Q6_K: qtiles512_fmt(x, part, n0, nb, block, end, M, K, Q6_K); break;
    default: qtiles512_fmt(x, part, n0, nb, block, end, M, K, Q5_0); break;
    }
}

/* One call's arguments, for the pool's chunks of its weight tiles (pool.c). */
typedef struct {
    const void *x;
    const kvlab_part *parts;
    long first[KVLAB_MAX_PARTS + 1]; /* each part's first tile in the joint numbering */
    long M, K, block, end;           /* input rows block..end-1 of M pass over the tiles */
    int nb;                          /* weight rows per tile */
    act8_rows xa;                    /* x quantised, where a part takes int8 activations */
} linear_job;

/* Weight tiles [t0, t1) of the parts against input rows block..end-1. */
static inline __attribute__((always_inline)) void linear_tiles(const linear_job *job, long t0, long t1,
                                                               const int bf16, const int ybf16) {
    const void *x = job->x;
    const kvlab_part *parts = job->parts;
    const long M = job->M, K = job->K, block = job->block, end = job->end;
    const int nb = job->nb;
    for (long t = t0; t < t1; t++) {
        int p = 0;
        while (t >= job->first[p + 1]) p++;
        if (parts[p].fmt & KVLAB_ACT8) {
            const long q0 = (t - job->first[p]) * nb;
            if (use_vnni == KVLAB_VNNI_512) act8_tiles_vnni(&job->xa, &parts[p], q0, nb, block, end);
            else if (use_vnni == KVLAB_VNNI_AVX) act8_tiles_avxvnni(&job->xa, &parts[p], q0, nb, block, end);
            else act8_tiles_avx2(&job->xa, &parts[p], q0, nb, block, end);
            continue;
        }
        if (!bf16 && parts[p].fmt != DENSE) { /* the format, a constant inside each call */
            const long q0 = (t - job->first[p]) * nb;
            if (use512) {
                qtiles512(x, &parts[p], q0, nb, block, end, M, K);
                continue;
            }
            switch (parts[p].fmt) {
            case Q8_0: qtiles(x, &parts[p], q0, nb, block, end, M, K, Q8_0); break;
            case Q4_0: qtiles(x, &parts[p], q0, nb, block, end, M, K, Q4_0); break;
            case Q4_1: qtiles(x, &parts[p], q0, nb, block, end, M, K, Q4_1); break;
            case Q4_K: qtiles(x, &parts[p], q0, nb, block, end, M, K, Q4_K); break;
            case Q6_K: qtiles(x, &parts[p], q0, nb, block, end, M, K, Q6_K); break;
            default: qtiles(x, &parts[p], q0, nb, block, end, M, K, Q5_0); break;
            }
            continue;
        }
        const void *w = parts[p].w, *b = parts[p].b;
        void *y = parts[p].y;
        const long N = parts[p].N, n0 = (t - job->first[p]) * nb, nn = N - n0 < nb ? N - n0 : nb;
        long m0 = block;
        if (M == 1) {
            tile(x, w, b, y, 0, 1, n0, 8, nn, N, K, bf16, ybf16);
            continue;
        }
        for (; m0 + MB <= end; m0 += MB) tile(x, w, b, y, m0, MB, n0, 4, nn, N, K, bf16, ybf16);
        if (end - m0 == 2) tile(x, w, b, y, m0, 2, n0, 4, nn, N, K, bf16, ybf16);
        else if (end - m0 == 1) tile(x, w, b, y, m0, 1, n0, 4, nn, N, K, bf16, ybf16);
    }
}

/* The three dtype pairs as pool tasks: fp32, bf16, and bf16 in with fp32 out (the LM head). */
static void tiles_f32(void *job, long t0, long t1) { linear_tiles(job, t0, t1, 0, 0); }
static void tiles_bf16(void *job, long t0, long t1) { linear_tiles(job, t0, t1, 1, 1); }
static void tiles_bf16_f32(void *job, long t0, long t1) { linear_tiles(job, t0, t1, 1, 0); }

/* y_p = x w_p^T (+ b_p) for each part p sharing the input x: every part's weight tiles in one
 * parallel loop, so the decoder layer's q/k/v (and gate/up) cost one loop, not three. */
static void linear(const void *x, const kvlab_part *parts, int np, long M, long K, int threads, int bf16,
                   int ybf16) {
    linear_job job = {.x = x, .parts = parts, .M = M, .K = K, .nb = M == 1 ? 8 : 4};
    int act8 = 0, all8 = 1;
    for (int p = 0; p < np; p++) act8 |= parts[p].fmt & KVLAB_ACT8, all8 &= !!(parts[p].fmt & KVLAB_ACT8);
    kvlab_part exact[KVLAB_MAX_PARTS];
    const long blocks = M * (K / QK);
    uint8_t *buf = act8 ? act8_buffer(blocks * (QK + 8)) : NULL;
    if (act8 && !buf) { /* out of memory for the quantised rows: these parts take fp32 rows */
        for (int p = 0; p < np; p++) exact[p] = parts[p], exact[p].fmt &= ~KVLAB_ACT8;
        job.parts = exact;
        all8 = 0;
    } else if (act8) { /* the parts share x: quantised once, before any tile reads it */
        int8_t *q = (int8_t *)buf;
        float *d = (float *)(buf + blocks * QK);
        int32_t *s = (int32_t *)(d + blocks);
        kvlab_quantize_act8(x, q, d, s, M, K, threads);
        job.xa = (act8_rows){q, d, s, K};
    }
    /* one row: more weight rows in flight per pass over x; int8 rows alone: a tile of one
     * register's lanes (act8_tiles_*; mixed with other parts, fewer, in as many lanes) */
    if (all8) job.nb = use_vnni == KVLAB_VNNI_512 ? 16 : 8;
    for (int p = 0; p < np; p++) job.first[p + 1] = job.first[p] + (parts[p].N + job.nb - 1) / job.nb;
    const kvlab_task task = !bf16 ? tiles_f32 : ybf16 ? tiles_bf16 : tiles_bf16_f32;
    /* MBLOCK input rows at a time (110 KB at K = 576) stay in L2 while every weight tile passes */
    for (job.block = 0; job.block < M; job.block += MBLOCK) {
        job.end = M - job.block < MBLOCK ? M : job.block + MBLOCK;
        kvlab_parallel(job.first[np], 0, threads, task, &job);
    }
}

void kvlab_linear_parts(const void *x, const kvlab_part *parts, int np, long M, long K, int threads,
                        int bf16) {
    linear(x, parts, np, M, K, threads, bf16, bf16);
}

void kvlab_linear_f32(const float *x, const float *w, const float *b, float *y, long M, long N,
                      long K, int threads) {
    const kvlab_part part = {w, b, y, N, DENSE};
    linear(x, &part, 1, M, K, threads, 0, 0);
}

void kvlab_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, long M,
                       long N, long K, int threads) {
    const kvlab_part part = {w, b, y, N, DENSE};
    linear(x, &part, 1, M, K, threads, 1, 1);
}

/* bf16 inputs, fp32 outputs: the same sums, not rounded. */
void kvlab_linear_bf16_f32(const uint16_t *x, const uint16_t *w, const uint16_t *b, float *y, long M,
                           long N, long K, int threads) {
    const kvlab_part part = {w, b, y, N, DENSE};
    linear(x, &part, 1, M, K, threads, 1, 0);
}

/* fp32 rows against a weight [N, K / 32 blocks] (k-quants: K / 256) in block format fmt. */
void kvlab_linear_q(const float *x, const uint8_t *w, const float *b, float *y, long M, long N, long K,
                    int fmt, int threads) {
    const kvlab_part part = {w, b, y, N, fmt};
    linear(x, &part, 1, M, K, threads, 0, 0);
}

/* Units [i0, i1) in format fmt (a constant once inlined). */
static inline __attribute__((always_inline)) void dequantize_fmt(const dequantize_job *job, long i0, long i1,
                                                                 const int fmt) {
    const long ub = UNIT_BYTES(fmt), us = UNIT_BLOCKS(fmt);
    for (long i = i0; i < i1; i++)
        for (int sb = 0; sb < us; sb++) {
            __m256 v[4];
            block8(job->w + i * ub, sb, fmt, v);
            for (int g = 0; g < 4; g++) _mm256_storeu_ps(job->out + (i * us + sb) * QK + 8 * g, v[g]);
        }
}

static void dequantize_units(void *arg, long i0, long i1) {
    const dequantize_job *job = arg;
    switch (job->fmt) {
    case Q8_0: dequantize_fmt(job, i0, i1, Q8_0); break;
    case Q4_0: dequantize_fmt(job, i0, i1, Q4_0); break;
    case Q4_1: dequantize_fmt(job, i0, i1, Q4_1); break;
    case Q4_K: dequantize_fmt(job, i0, i1, Q4_K); break;
    case Q6_K: dequantize_fmt(job, i0, i1, Q6_K); break;
    default: dequantize_fmt(job, i0, i1, Q5_0); break;
    }
}

/* The fp32 values of rows [rows, K / 32 blocks] (k-quants: K / 256) in block format fmt: exactly
 * gguf.quants'. */
void kvlab_dequantize(const uint8_t *w, float *out, long rows, long K, int fmt, int threads) {
    dequantize_job job = {w, out, fmt};
    kvlab_parallel(rows * (K / (QK * UNIT_BLOCKS(fmt))), 2048 / UNIT_BLOCKS(fmt), threads, dequantize_units, &job);
}

/* Take the int8 activations' dot products in VNNI encoding `want` (KVLAB_VNNI_512: AVX512-VNNI
 * with BW and VL; KVLAB_VNNI_AVX: AVX-VNNI; 0: AVX2's) if this CPU has it; returns whether it runs. */
int kvlab_set_vnni(int want) {
    __builtin_cpu_init();
    const int has = want == KVLAB_VNNI_512 ? __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")
                                                 && __builtin_cpu_supports("avx512bw")
                  : want == KVLAB_VNNI_AVX ? __builtin_cpu_supports("avxvnni")
                                           : 0;
    use_vnni = has ? want : 0;
    return has;
}

/* Take the AVX-512 loops if asked and this CPU (and its OS) has AVX-512 F and DQ; returns
 * whether they run. kvlab.kernels calls it once at load, from kvlab.dispatch's switch. */
int kvlab_set_avx512(int want) {
    __builtin_cpu_init();
    use512 = want && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    return use512;
}
