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
#include "blocks.h"
#include "kblocks.h"
#include "pool.h"

#define NB_MAX 8 /* output rows (weight rows) per tile: 8 for one input row, else 4 */
#define MB 3     /* input rows per tile: MB * 4 accumulators + 4 weights + 1 input in 16 registers */
#define MBLOCK 48 /* input rows per pass over the weights (a multiple of MB) */
#define PF_TILES 2 /* block-format weight tiles prefetched ahead (past the end: harmless) */

static int use512; /* kvlab_set_avx512: the block formats' AVX-512 loops, bitwise the AVX2 ones */


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

/* tile() for fp32 rows against a weight in block format fmt (K a multiple of 32): the same chain
 * of FMAs, each block of 32 weights dequantised as it is loaded. Each row of the tile is
 * prefetched PF_TILES tiles ahead, block by block: a row is read a few bytes a step, too slowly
 * for the hardware prefetcher alone (measured: half the rate from DRAM without it). */
static inline __attribute__((always_inline)) void qtile(const float *x, const uint8_t *w, const float *b,
                                                        float *y, long m0, const int mb, long n0,
                                                        const int nb, long nn, long N, long K, const int fmt) {
    const long bb = BLOCK_BYTES[fmt], rb = K / QK * bb;
    const uint8_t *wr[NB_MAX];
    const float *xr[MB];
    for (int j = 0; j < nb; j++) wr[j] = w + (n0 + (j < nn ? j : 0)) * rb;
    for (int i = 0; i < mb; i++) xr[i] = x + (m0 + i) * K;
    __m256 acc[MB][NB_MAX];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm256_setzero_ps();
    for (long kb = 0; kb < K / QK; kb++) {
        for (int j = 0; j < nb; j++) _mm_prefetch((const char *)(wr[j] + PF_TILES * nb * rb + kb * bb), _MM_HINT_T0);
        for (int j = 0; j < nb; j++) {
            __m256 wv[4];
            qblock8(wr[j] + kb * bb, fmt, wv);
            for (int i = 0; i < mb; i++)
                for (int g = 0; g < 4; g++)
                    acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[i] + kb * QK + 8 * g), wv[g], acc[i][j]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nn; j++) {
            float s = hsum(acc[i][j]);
            if (b) s += b[n0 + j];
            y[(m0 + i) * N + n0 + j] = s;
        }
}

/* qtile with AVX-512: weight rows in pairs, one zmm per pair and input row (qblock16), each half
 * the 8-lane chain of qtile, so the same bits at about half the instructions per weight. */
static inline T512 void qtile512(const float *x, const uint8_t *w, const float *b, float *y, long m0,
                                 const int mb, long n0, const int nb, long nn, long N, long K, const int fmt) {
    const long bb = BLOCK_BYTES[fmt], rb = K / QK * bb;
    const uint8_t *wr[NB_MAX];
    const float *xr[MB];
    for (int j = 0; j < nb; j++) wr[j] = w + (n0 + (j < nn ? j : 0)) * rb;
    for (int i = 0; i < mb; i++) xr[i] = x + (m0 + i) * K;
    __m512 acc[MB][NB_MAX / 2];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb / 2; j++) acc[i][j] = _mm512_setzero_ps();
    for (long kb = 0; kb < K / QK; kb++) {
        for (int j = 0; j < nb; j++) _mm_prefetch((const char *)(wr[j] + PF_TILES * nb * rb + kb * bb), _MM_HINT_T0);
        for (int j = 0; j < nb / 2; j++) {
            __m512 wv[4];
            qblock16(wr[2 * j] + kb * bb, wr[2 * j + 1] + kb * bb, fmt, wv);
            for (int i = 0; i < mb; i++)
                for (int g = 0; g < 4; g++)
                    acc[i][j] = _mm512_fmadd_ps(_mm512_broadcast_f32x8(_mm256_loadu_ps(xr[i] + kb * QK + 8 * g)),
                                                wv[g], acc[i][j]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nn; j++) {
            __m256 half = j % 2 ? _mm512_extractf32x8_ps(acc[i][j / 2], 1) : _mm512_castps512_ps256(acc[i][j / 2]);
            float s = hsum(half);
            if (b) s += b[n0 + j];
            y[(m0 + i) * N + n0 + j] = s;
        }
}

/* One weight tile (weight rows n0.., input rows block..end) of a part in block format fmt, by
 * qtile or (wide) qtile512: the same tiles either way. */
#define QTILES(NAME, TILE, ATTR)                                                                      \
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
        for (; m0 + MB <= end; m0 += MB) TILE(x, w, b, y, m0, MB, n0, 4, nn, N, K, fmt);              \
        if (end - m0 == 2) TILE(x, w, b, y, m0, 2, n0, 4, nn, N, K, fmt);                             \
        else if (end - m0 == 1) TILE(x, w, b, y, m0, 1, n0, 4, nn, N, K, fmt);                        \
    }
QTILES(qtiles, qtile, __attribute__((always_inline)))
QTILES(qtiles512_fmt, qtile512, T512)

/* --- k-quants (kblocks.h): super-blocks of 256 weights, K a multiple of 256 ------------------- */

/* qtile for a weight in k-quant format fmt: the same chain of FMAs (k in order, 8 lanes, one
 * chain per output), each super-block dequantised 32 weights at a time as it is loaded, a row's
 * whole super-block before the next row's (measured: 1.5-2.7x the rate of interleaving rows per
 * 32 weights, AVX2). A super-block spans 3-4 cache lines: one prefetch per 64 bytes covers each
 * row's every line. */
static inline __attribute__((always_inline)) void ktile(const float *x, const uint8_t *w, const float *b,
                                                        float *y, long m0, const int mb, long n0,
                                                        const int nb, long nn, long N, long K, const int fmt) {
    const long bb = KBLOCK_BYTES(fmt), rb = K / QK_K * bb;
    const uint8_t *wr[NB_MAX];
    const float *xr[MB];
    for (int j = 0; j < nb; j++) wr[j] = w + (n0 + (j < nn ? j : 0)) * rb;
    for (int i = 0; i < mb; i++) xr[i] = x + (m0 + i) * K;
    __m256 acc[MB][NB_MAX];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm256_setzero_ps();
    for (long ks = 0; ks < K / QK_K; ks++) {
        for (int j = 0; j < nb; j++)
            for (long l = 0; l < bb; l += 64)
                _mm_prefetch((const char *)(wr[j] + PF_TILES * nb * rb + ks * bb + l), _MM_HINT_T0);
        for (int j = 0; j < nb; j++)
            for (int s = 0; s < QK_K / QK; s++) {
                __m256 wv[4];
                kblock8(wr[j] + ks * bb, s, fmt, wv);
                for (int i = 0; i < mb; i++)
                    for (int g = 0; g < 4; g++)
                        acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[i] + ks * QK_K + QK * s + 8 * g), wv[g], acc[i][j]);
            }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nn; j++) {
            float s = hsum(acc[i][j]);
            if (b) s += b[n0 + j];
            y[(m0 + i) * N + n0 + j] = s;
        }
}

/* ktile with AVX-512, as qtile512 is qtile's: weight rows in pairs (kblock16), each half of a
 * zmm the 8-lane chain of ktile, so the same bits. */
static inline T512 void ktile512(const float *x, const uint8_t *w, const float *b, float *y, long m0,
                                 const int mb, long n0, const int nb, long nn, long N, long K, const int fmt) {
    const long bb = KBLOCK_BYTES(fmt), rb = K / QK_K * bb;
    const uint8_t *wr[NB_MAX];
    const float *xr[MB];
    for (int j = 0; j < nb; j++) wr[j] = w + (n0 + (j < nn ? j : 0)) * rb;
    for (int i = 0; i < mb; i++) xr[i] = x + (m0 + i) * K;
    __m512 acc[MB][NB_MAX / 2];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb / 2; j++) acc[i][j] = _mm512_setzero_ps();
    for (long ks = 0; ks < K / QK_K; ks++) {
        for (int j = 0; j < nb; j++)
            for (long l = 0; l < bb; l += 64)
                _mm_prefetch((const char *)(wr[j] + PF_TILES * nb * rb + ks * bb + l), _MM_HINT_T0);
        for (int j = 0; j < nb / 2; j++)
            for (int s = 0; s < QK_K / QK; s++) {
                __m512 wv[4];
                kblock16(wr[2 * j] + ks * bb, wr[2 * j + 1] + ks * bb, s, fmt, wv);
                for (int i = 0; i < mb; i++)
                    for (int g = 0; g < 4; g++)
                        acc[i][j] = _mm512_fmadd_ps(
                            _mm512_broadcast_f32x8(_mm256_loadu_ps(xr[i] + ks * QK_K + QK * s + 8 * g)), wv[g], acc[i][j]);
            }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nn; j++) {
            __m256 half = j % 2 ? _mm512_extractf32x8_ps(acc[i][j / 2], 1) : _mm512_castps512_ps256(acc[i][j / 2]);
            float s = hsum(half);
            if (b) s += b[n0 + j];
            y[(m0 + i) * N + n0 + j] = s;
        }
}

QTILES(ktiles, ktile, __attribute__((always_inline)))
QTILES(ktiles512, ktile512, T512)

/* kvlab_dequantize's arguments, for the pool's chunks of blocks (pool.h). */
typedef struct {
    const uint8_t *w;
    float *out;
    int fmt;
} dequantize_job;

/* kvlab_dequantize for the k-quants: super-blocks [i0, i1). */
static void kdequantize(void *arg, long i0, long i1) {
    const dequantize_job *job = arg;
    const long bb = KBLOCK_BYTES(job->fmt);
    for (long i = i0; i < i1; i++)
        for (int s = 0; s < QK_K / QK; s++) {
            __m256 v[4];
            if (job->fmt == Q4_K) kblock8(job->w + i * bb, s, Q4_K, v);
            else kblock8(job->w + i * bb, s, Q6_K, v);
            for (int g = 0; g < 4; g++) _mm256_storeu_ps(job->out + i * QK_K + QK * s + 8 * g, v[g]);
        }
}

/* --- end of k-quants ---------------------------------------------------------------------------- */

/* Not inlined into linear(): its AVX-512 code runs only where kvlab_set_avx512 found the CPU's. */
static __attribute__((target("avx2,fma,f16c,avx512f,avx512dq"), noinline)) void
qtiles512(const float *x, const kvlab_part *part, long n0, int nb, long block, long end, long M, long K) {
    switch (part->fmt) {
    case Q8_0: qtiles512_fmt(x, part, n0, nb, block, end, M, K, Q8_0); break;
    case Q4_0: qtiles512_fmt(x, part, n0, nb, block, end, M, K, Q4_0); break;
    case Q4_1: qtiles512_fmt(x, part, n0, nb, block, end, M, K, Q4_1); break;
    case Q4_K: ktiles512(x, part, n0, nb, block, end, M, K, Q4_K); break;
    case Q6_K: ktiles512(x, part, n0, nb, block, end, M, K, Q6_K); break;
    default: qtiles512_fmt(x, part, n0, nb, block, end, M, K, Q5_0); break;
    }
}

/* One call's arguments, for the pool's chunks of its weight tiles (pool.h). */
typedef struct {
    const void *x;
    const kvlab_part *parts;
    long first[KVLAB_MAX_PARTS + 1]; /* each part's first tile in the joint numbering */
    long M, K, block, end;           /* input rows block..end-1 of M pass over the tiles */
    int nb;                          /* weight rows per tile */
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
            case Q4_K: ktiles(x, &parts[p], q0, nb, block, end, M, K, Q4_K); break;
            case Q6_K: ktiles(x, &parts[p], q0, nb, block, end, M, K, Q6_K); break;
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
    /* one row: more weight rows in flight per pass over x */
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

static void dequantize_blocks(void *arg, long i0, long i1) {
    const dequantize_job *job = arg;
    const long bb = BLOCK_BYTES[job->fmt];
    for (long i = i0; i < i1; i++) {
        __m256 v[4];
        switch (job->fmt) {
        case Q8_0: qblock8(job->w + i * bb, Q8_0, v); break;
        case Q4_0: qblock8(job->w + i * bb, Q4_0, v); break;
        case Q4_1: qblock8(job->w + i * bb, Q4_1, v); break;
        default: qblock8(job->w + i * bb, Q5_0, v); break;
        }
        for (int g = 0; g < 4; g++) _mm256_storeu_ps(job->out + i * QK + 8 * g, v[g]);
    }
}

/* The fp32 values of rows [rows, K / 32 blocks] (k-quants: K / 256) in block format fmt: exactly
 * gguf.quants'. */
void kvlab_dequantize(const uint8_t *w, float *out, long rows, long K, int fmt, int threads) {
    dequantize_job job = {w, out, fmt};
    if (fmt == Q4_K || fmt == Q6_K) kvlab_parallel(rows * (K / QK_K), 256, threads, kdequantize, &job);
    else kvlab_parallel(rows * (K / QK), 2048, threads, dequantize_blocks, &job);
}

/* Take the AVX-512 loops if asked and this CPU (and its OS) has AVX-512 F and DQ; returns
 * whether they run. kvlab.kernels calls it once at load, from kvlab.dispatch's switch. */
int kvlab_set_avx512(int want) {
    __builtin_cpu_init();
    use512 = want && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    return use512;
}
