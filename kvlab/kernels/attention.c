/* kvlab's paged attention for x86 CPUs with AVX2 and FMA: each query row against its keys and
 * values read where they lie in the paged cache (no gathered copy).
 *
 * q [R, H, D] fp32; the cache's K [KV, S, D] and V [KV, S, DV] (S slots: blocks x block size),
 * fp32 or bf16; slots [NS, L] int64, one row of slots per sequence in position order; query row r
 * reads slots[seq[r], start[r] .. start[r] + len[r] - 1] (a decode: its whole row; a prompt
 * token: the keys up to its own position, or its window); out [R, H, DV] fp32. Head h reads KV
 * head h / (H / KV). D and DV are multiples of 32.
 *
 * Why: PyTorch's path gathers every cached K/V a step reads into a new tensor, per layer, then
 * runs SDPA over it; in a 16-request decode step that copy and the kernel took 38% of the
 * time. Here each (query row, KV head) is one task that reads its keys once for the scores and
 * its values once for the output, for all the query heads sharing that KV head (GQA: 8 keys at a
 * time, scored for every head of the group before the next 8), prefetching a block ahead.
 *
 * Softmax in three passes over the row's scores (max, exp and sum, weighted values), all in
 * fp32, in key order; the exponential is simd.h's exp256. A row's
 * result depends only on its query and its keys' values, never on the other rows, the batch or
 * where the keys lie: deterministic mode runs prompts and decodes through it alike.
 */
#include <math.h>
#include <stdlib.h>

#include "kvlab.h"
#include "simd.h"

#define GMAX 3 /* query heads per pass over the values: 3 x 4 accumulators */
/* Keys (and values) prefetched this many positions ahead: a sequence's blocks lie anywhere in
 * the pool, and the hardware prefetcher stops at each one's edge (a block of 16 fp32 keys of 64
 * values is one 4 KiB page), so each block would start with a miss. */
#define PF_KEYS 16

/* Prefetch row `index` of a [rows, width] cache, every 64 bytes of it. */
static inline void prefetch_row(const void *base, long index, long width, int bf16) {
    const char *r = (const char *)row_at(base, index, width, bf16);
    const long bytes = width * (bf16 ? 2 : 4);
    for (long o = 0; o < bytes; o += 64) _mm_prefetch(r + o, _MM_HINT_T0);
}

/* hsum of each of a[0..7], as one vector in a's order: the same additions in the same order as
 * hsum's (lanes 0+4, 1+5, 2+6, 3+7; then 0+2, 1+3; then 0+1), done for 8 keys at once, so each
 * lane holds exactly hsum(a[j]). */
static inline __m256 hsum8(const __m256 a[8]) {
    __m256 s[4], t[2];
    for (int j = 0; j < 4; j++) /* [lo + hi of a[2j] | of a[2j+1]] */
        s[j] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * j], a[2 * j + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * j], a[2 * j + 1], 0x31));
    for (int j = 0; j < 2; j++) /* [x0 + x2, x1 + x3] of 4 keys: (2j*2, 2j*2+2 | 2j*2+1, 2j*2+3) */
        t[j] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * j], s[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(s[2 * j], s[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(u, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)); /* a0,a2,a4,a6 | a1,... */
}

/* The G query heads' scores over n keys (stored at p, head g's at p + g * padded) and each
 * head's max. 8 keys at a time are read once for every head of the group (GQA: the KV head's
 * keys leave memory once, not once per query head); each score is one chain of FMAs over d,
 * 8 lanes, then hsum's additions: the chains, and so the bits, are those of one key and one
 * head at a time. */
static inline __attribute__((always_inline)) void scores(const float *q, long G, const void *kc, long base,
                                                         const int64_t *sl, long n, long padded, long D,
                                                         float scale, float *p, float *mx, const int bf16) {
    __m256 m[64];
    for (long g = 0; g < G; g++) m[g] = _mm256_set1_ps(-INFINITY);
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        const void *kr[8];
        for (int j = 0; j < 8; j++) kr[j] = row_at(kc, base + sl[i + j], D, bf16);
        if (i + PF_KEYS + 8 <= n)
            for (int j = 0; j < 8; j++) prefetch_row(kc, base + sl[i + PF_KEYS + j], D, bf16);
        for (long g = 0; g < G; g++) {
            const float *qg = q + g * D;
            __m256 acc[8];
            for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
            for (long d = 0; d < D; d += 8) {
                __m256 qv = _mm256_loadu_ps(qg + d);
                for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, load8(kr[j], d, bf16), acc[j]);
            }
            const __m256 sc = _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale));
            _mm256_storeu_ps(p + g * padded + i, sc);
            m[g] = _mm256_max_ps(sc, m[g]); /* a NaN score is passed over, as `s > max` does */
        }
    }
    for (long g = 0; g < G; g++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, m[g]);
        mx[g] = -INFINITY;
        for (int j = 0; j < 8; j++)
            if (lanes[j] > mx[g]) mx[g] = lanes[j];
    }
    for (; i < n; i++) {
        const void *k = row_at(kc, base + sl[i], D, bf16);
        for (long g = 0; g < G; g++) {
            const float *qg = q + g * D;
            __m256 acc = _mm256_setzero_ps();
            for (long d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), load8(k, d, bf16), acc);
            const float s = hsum(acc) * scale;
            p[g * padded + i] = s;
            if (s > mx[g]) mx[g] = s;
        }
    }
}

/* kvlab_paged_attention's arguments, for the pool's tasks: one per (row, KV head). */
typedef struct {
    const float *q;
    const void *kc, *vc;
    const int64_t *slots, *seq, *start, *len;
    float *out;
    long S, L, H, KV, D, DV;
    float scale;
    int bf16, failed;
} attention_job;

static void attend(void *arg, long t0, long t1) {
    const attention_job *job = arg;
    const float *q = job->q;
    const void *kc = job->kc, *vc = job->vc;
    float *out = job->out;
    const long S = job->S, L = job->L, H = job->H, KV = job->KV, D = job->D, DV = job->DV, G = H / KV;
    const float scale = job->scale;
    const int bf16 = job->bf16;
    for (long task = t0; task < t1; task++) {
        const long b = task / KV, kvh = task % KV, n = job->len[b];
        const long padded = (n + 7) / 8 * 8;
        const int64_t *sl = job->slots + job->seq[b] * L + job->start[b];
        float *p = malloc(sizeof(float) * G * padded);
        if (!p) {
            __atomic_store_n(&((attention_job *)arg)->failed, 1, __ATOMIC_RELAXED);
            continue;
        }
        /* scores, and each head's max */
        float mx[64];
        const float *qg = q + (b * H + kvh * G) * D;
        if (bf16)
            scores(qg, G, kc, kvh * S, sl, n, padded, D, scale, p, mx, 1);
        else
            scores(qg, G, kc, kvh * S, sl, n, padded, D, scale, p, mx, 0);
        /* exp(score - max), padding lanes zeroed, and the sums */
        float sum[64];
        for (long g = 0; g < G; g++) {
            float *pg = p + g * padded;
            for (long i = n; i < padded; i++) pg[i] = mx[g];
            __m256 m = _mm256_set1_ps(mx[g]), tot = _mm256_setzero_ps();
            for (long i = 0; i < padded; i += 8) {
                __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(pg + i), m));
                _mm256_storeu_ps(pg + i, e);
            }
            for (long i = n; i < padded; i++) pg[i] = 0.0f;
            for (long i = 0; i < padded; i += 8) tot = _mm256_add_ps(tot, _mm256_loadu_ps(pg + i));
            sum[g] = hsum(tot);
        }
        /* weighted values: GMAX heads x 32 columns at a time */
        for (long g0 = 0; g0 < G; g0 += GMAX) {
            const long gn = G - g0 < GMAX ? G - g0 : GMAX;
            for (long d0 = 0; d0 < DV; d0 += 32) {
                __m256 acc[GMAX][4];
                for (int g = 0; g < GMAX; g++)
                    for (int j = 0; j < 4; j++) acc[g][j] = _mm256_setzero_ps();
                for (long i = 0; i < n; i++) {
                    const void *v = row_at(vc, kvh * S + sl[i], DV, bf16);
                    if (d0 == 0 && i + PF_KEYS < n) prefetch_row(vc, kvh * S + sl[i + PF_KEYS], DV, bf16);
                    __m256 vv[4];
                    for (int j = 0; j < 4; j++) vv[j] = load8(v, d0 + 8 * j, bf16);
                    for (int g = 0; g < gn; g++) {
                        __m256 w = _mm256_set1_ps(p[(g0 + g) * padded + i]);
                        for (int j = 0; j < 4; j++) acc[g][j] = _mm256_fmadd_ps(w, vv[j], acc[g][j]);
                    }
                }
                for (int g = 0; g < gn; g++) {
                    float *o = out + (b * H + kvh * G + g0 + g) * DV + d0;
                    __m256 inv = _mm256_set1_ps(1.0f / sum[g0 + g]);
                    for (int j = 0; j < 4; j++) _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(acc[g][j], inv));
                }
            }
        }
        free(p);
    }
}

int kvlab_paged_attention(const float *q, const void *kc, const void *vc, int bf16, long S,
                          const int64_t *slots, long L, const int64_t *seq, const int64_t *start,
                          const int64_t *len, float *out, long R, long H, long KV, long D, long DV,
                          float scale, int threads) {
    attention_job job = {q, kc, vc, slots, seq, start, len, out, S, L, H, KV, D, DV, scale, bf16, 0};
    kvlab_parallel(R * KV, 1, threads, attend, &job); /* one task each: their lengths differ */
    return job.failed;
}
