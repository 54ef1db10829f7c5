/* kvlab's linear layer on x86 CPUs with AVX2 and FMA, fp32 or bf16.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]): x [M, K], w [N, K] (nn.Linear's layout, used as
 * is: no packed copy), y [M, N], all row-major and contiguous, all fp32 or all bf16. bf16 values
 * are widened exactly, summed in fp32, and each output rounded once (as PyTorch's bf16 matmul),
 * or kept in fp32 (``kvlab_linear_bf16_f32``: the LM head, whose logits are never rounded).
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
#include "simd.h"

#define NB_MAX 8 /* output rows (weight rows) per tile: 8 for one input row, else 4 */
#define MB 3     /* input rows per tile: MB * 4 accumulators + 4 weights + 1 input in 16 registers */
#define MBLOCK 48 /* input rows per pass over the weights (a multiple of MB) */


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

/* y_p = x w_p^T (+ b_p) for each part p sharing the input x: every part's weight tiles in one
 * parallel loop, so the decoder layer's q/k/v (and gate/up) cost one OpenMP region, not three. */
static inline __attribute__((always_inline)) void linear(const void *x, const kvlab_part *parts,
                                                         int np, long M, long K, int threads,
                                                         const int bf16, const int ybf16) {
    const int nb = M == 1 ? 8 : 4; /* one row: more weight rows in flight per pass over x */
    long first[KVLAB_MAX_PARTS + 1] = {0}; /* each part's first tile in the joint numbering */
    for (int p = 0; p < np; p++) first[p + 1] = first[p] + (parts[p].N + nb - 1) / nb;
    const long tiles = first[np];
    /* MBLOCK input rows at a time (110 KB at K = 576) stay in L2 while every weight tile passes */
    for (long block = 0; block < M; block += MBLOCK) {
        const long end = M - block < MBLOCK ? M : block + MBLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (long t = 0; t < tiles; t++) {
            int p = 0;
            while (t >= first[p + 1]) p++;
            const void *w = parts[p].w, *b = parts[p].b;
            void *y = parts[p].y;
            const long N = parts[p].N, n0 = (t - first[p]) * nb, nn = N - n0 < nb ? N - n0 : nb;
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
}

void kvlab_linear_parts(const void *x, const kvlab_part *parts, int np, long M, long K, int threads,
                        int bf16) {
    if (bf16) linear(x, parts, np, M, K, threads, 1, 1);
    else linear(x, parts, np, M, K, threads, 0, 0);
}

void kvlab_linear_f32(const float *x, const float *w, const float *b, float *y, long M, long N,
                      long K, int threads) {
    const kvlab_part part = {w, b, y, N};
    linear(x, &part, 1, M, K, threads, 0, 0);
}

void kvlab_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, long M,
                       long N, long K, int threads) {
    const kvlab_part part = {w, b, y, N};
    linear(x, &part, 1, M, K, threads, 1, 1);
}

/* bf16 inputs, fp32 outputs: the same sums, not rounded. */
void kvlab_linear_bf16_f32(const uint16_t *x, const uint16_t *w, const uint16_t *b, float *y, long M,
                           long N, long K, int threads) {
    const kvlab_part part = {w, b, y, N};
    linear(x, &part, 1, M, K, threads, 1, 0);
}
