/* kvlab's row-wise ops between the matmuls of a decoder layer, fp32 or bf16: RMSNorm (with the
 * residual add before it), RoPE in place, the write of new keys and values to the cache, and
 * the MLP's silu(gate) * up.
 *
 * Why: at batch 1 the bundled model's 30 layers spend more time in these small ops than in
 * attention. PyTorch runs each as 5-10 ops of a few microseconds of dispatch apiece (an RMSNorm
 * is pow, mean, add, rsqrt, mul, mul); here each is one call.
 *
 * Every value is computed as PyTorch's eager ops compute it, op by op, each result rounded to
 * the tensors' dtype (compiled with -ffp-contract=off: no product is fused into an add), except
 * the sum of squares of RMSNorm, which is one fixed chain (8 lanes over the row, then hsum)
 * where PyTorch's reduction order depends on its vectorisation, and silu's exponential. A row's result depends on that
 * row only, never on the batch (deterministic mode).
 */
#include <math.h>

#include "kvlab.h"
#include "simd.h"

/* A value of a row as fp32 (bf16 widened exactly). */
/* kvlab_parallel's grain for n items of `width` values each: even chunks from 64K values on,
 * below that one chunk (serial: handing it to another thread costs more than the pass). */
#define GRAIN(n, width) ((n) * (width) >= 1L << 16 ? 0 : (n))

static inline float get(const void *base, long i, int bf16) { return load1(base, i, bf16); }

/* f rounded to the dtype, as a tensor of that dtype would hold it. */
static inline float round_to(float f, int bf16) {
    if (!bf16) return f;
    uint16_t h;
    store1(&h, 0, f, 1);
    return load1(&h, 0, 1);
}

/* y = w * (h / sqrt(mean(h^2) + eps)) per row, h = x + a (a may be NULL; h is written to h_out
 * when given). x, a, h_out, y [M, D] contiguous; w [D]. */
typedef struct {
    const void *x, *a, *w;
    void *h_out, *y;
    long D;
    float eps;
    int bf16;
} rms_norm_job;

static void rms_norm_rows(void *arg, long m0, long m1) {
    const rms_norm_job *job = arg;
    const void *x = job->x, *a = job->a, *w = job->w;
    void *h_out = job->h_out, *y = job->y;
    const long D = job->D;
    const int bf16 = job->bf16;
    for (long m = m0; m < m1; m++) {
        const long off = m * D;
        const void *h = row_at(x, m, D, bf16);
        if (a) {
            for (long i = 0; i < D; i++)
                store1(h_out, off + i, get(x, off + i, bf16) + get(a, off + i, bf16), bf16);
            h = row_at(h_out, m, D, bf16);
        }
        __m256 acc = _mm256_setzero_ps();
        long i = 0;
        for (; i + 8 <= D; i += 8) {
            __m256 v = load8(h, i, bf16);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float s = hsum(acc);
        for (; i < D; i++) s += get(h, i, bf16) * get(h, i, bf16);
        const float r = 1.0f / sqrtf(s / (float)D + job->eps);
        for (i = 0; i < D; i++)
            store1(y, off + i, get(w, i, bf16) * round_to(get(h, i, bf16) * r, bf16), bf16);
    }
}

void kvlab_rms_norm(const void *x, const void *a, void *h_out, const void *w, void *y, long M,
                    long D, float eps, int bf16, int threads) {
    rms_norm_job job = {x, a, w, h_out, y, D, eps, bf16};
    kvlab_parallel(M, GRAIN(M, D), threads, rms_norm_rows, &job);
}

/* Rotate-half RoPE in place on T tokens x H heads of D values: element (t, h, i) lies at
 * x[t * stride + h * D + i]; cos, sin [T, D] contiguous. out = x * cos + rotate_half(x) * sin,
 * rotate_half(x) = (-x[D/2:], x[:D/2]). */
typedef struct {
    void *x;
    const void *cos, *sin;
    long H, D, stride;
    int bf16;
} rope_job;

static void rope_rows(void *arg, long t0, long t1) {
    const rope_job *job = arg;
    void *x = job->x;
    const void *cos = job->cos, *sin = job->sin;
    const long H = job->H, D = job->D, stride = job->stride, half = D / 2;
    const int bf16 = job->bf16;
    for (long t = t0; t < t1; t++) {
        for (long h = 0; h < H; h++) {
            const long base = t * stride + h * D;
            for (long i = 0; i < half; i++) {
                const float x1 = get(x, base + i, bf16), x2 = get(x, base + half + i, bf16);
                const float c1 = get(cos, t * D + i, bf16), s1 = get(sin, t * D + i, bf16);
                const float c2 = get(cos, t * D + half + i, bf16), s2 = get(sin, t * D + half + i, bf16);
                const float lo = round_to(x1 * c1, bf16) + round_to(-x2 * s1, bf16);
                const float hi = round_to(x2 * c2, bf16) + round_to(x1 * s2, bf16);
                store1(x, base + i, lo, bf16);
                store1(x, base + half + i, hi, bf16);
            }
        }
    }
}

void kvlab_rope(void *x, long T, long H, long D, long stride, const void *cos, const void *sin,
                int bf16, int threads) {
    rope_job job = {x, cos, sin, H, D, stride, bf16};
    kvlab_parallel(T, GRAIN(T, H * D), threads, rope_rows, &job);
}

/* Token t's heads of k [T, KV, D] (row t at k + t * k_stride) and v [T, KV, DV] go to slot
 * slots[t] of the cache's K [KV, S, D] and V [KV, S, DV]. src_bf16 / dst_bf16: the dtypes
 * (fp32 to bf16 rounds to nearest even, as PyTorch's cast). */
void kvlab_store_kv(const void *k, const void *v, long k_stride, long v_stride, void *kc, void *vc,
                    const int64_t *slots, long T, long KV, long D, long DV, long S, int src_bf16,
                    int dst_bf16) {
    for (long t = 0; t < T; t++)
        for (long h = 0; h < KV; h++) {
            const long ks = t * k_stride + h * D, vs = t * v_stride + h * DV;
            const long kd = (h * S + slots[t]) * D, vd = (h * S + slots[t]) * DV;
            if (src_bf16 == dst_bf16) {
                const long size = src_bf16 ? 2 : 4;
                memcpy((char *)kc + kd * size, (const char *)k + ks * size, D * size);
                memcpy((char *)vc + vd * size, (const char *)v + vs * size, DV * size);
                continue;
            }
            for (long i = 0; i < D; i++) store1(kc, kd + i, get(k, ks + i, src_bf16), dst_bf16);
            for (long i = 0; i < DV; i++) store1(vc, vd + i, get(v, vs + i, src_bf16), dst_bf16);
        }
}

/* gate = silu(gate) * up in place over n values: silu(x) = x / (1 + exp(-x)) (PyTorch's form;
 * exp is simd.h's exp256), rounded to the dtype, then the product rounded. Every value goes
 * through the same 8-lane code (the last few padded), so its result never depends on where it
 * lies in the batch. */
typedef struct {
    void *gate;
    const void *up;
    long n;
    int bf16;
} silu_job;

/* Groups [i0, i1) of 8 values. */
static void silu_groups(void *arg, long i0, long i1) {
    const silu_job *job = arg;
    void *gate = job->gate;
    const void *up = job->up;
    const long n = job->n;
    const int bf16 = job->bf16;
    for (long i = i0 * 8; i < n && i < i1 * 8; i += 8) {
        const long w = n - i < 8 ? n - i : 8;
        if (!bf16 && w == 8) { /* the same ops on registers, without the scalar staging below */
            const __m256 x = _mm256_loadu_ps((const float *)gate + i);
            const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), x));
            const __m256 sx = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps((float *)gate + i, _mm256_mul_ps(sx, _mm256_loadu_ps((const float *)up + i)));
            continue;
        }
        float g[8] = {0}, u[8] = {0}, s[8];
        for (long j = 0; j < w; j++) g[j] = get(gate, i + j, bf16), u[j] = get(up, i + j, bf16);
        const __m256 x = _mm256_loadu_ps(g);
        const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), x));
        _mm256_storeu_ps(s, _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
        for (long j = 0; j < w; j++) store1(gate, i + j, round_to(s[j], bf16) * u[j], bf16);
    }
}

void kvlab_silu_mul(void *gate, const void *up, long n, int bf16, int threads) {
    silu_job job = {gate, up, n, bf16};
    kvlab_parallel((n + 7) / 8, GRAIN((n + 7) / 8, 8), threads, silu_groups, &job);
}
