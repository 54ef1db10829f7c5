/* kvlab's whole decoder layer (the Llama / Qwen2 form: RMSNorm, q/k/v with optional biases,
 * rotate-half RoPE, attention over the paged cache, o, residual, RMSNorm, SiLU-gated MLP,
 * residual) for M rows in one call, fp32 or bf16.
 *
 * Why: at batch 1 the bundled model's linears read their weights at the memory's speed, and
 * what was left of a step was PyTorch's dispatch of the ~40 small ops around them per layer
 * (each a few microseconds on this class of CPU). This runs the same kernels in the same order
 * as the layer's PyTorch modules do when the native kernels serve them (linear, rms_norm, rope,
 * store_kv, paged_attention, silu_mul, the residual adds), so its results are bitwise those of
 * that path: a step may take either path without a row's values changing (deterministic mode).
 *
 * w: 16 pointers, see enum below (a NULL bias: none); fmt: the seven weight matrices' formats
 * (q, k, v, o, gate, up, down: 0 dense, else a GGUF block format, blocks.h; fp32 rows only). The attention layout is that of
 * kvlab_paged_attention; write_slots [M]: where each row's new K/V go. Returns 0, or 1 when
 * memory for the scratch buffers or the scores ran out (nothing written but the cache). out may
 * be x: x is last read before out is first written.
 *
 * kvlab_decoder_layers runs a stack of such layers in one call, each on the one before's output.
 * Why: at batch 1 the Python between 30 layer calls (a call's arguments gathered and checked)
 * cost the bundled model a quarter of its decode step.
 */
#include <math.h>
#include <stdlib.h>

#include "kvlab.h"
#include "simd.h"

enum { NORM1, WQ, BQ, WK, BK, WV, BV, WO, BO, NORM2, WG, BG, WU, BU, WD, BD };

static void lin(const void *x, const void *w, const void *b, int fmt, void *y, long M, long N, long K,
                int threads, int bf16) {
    const kvlab_part part = {w, b, y, N, fmt};
    kvlab_linear_parts(x, &part, 1, M, K, threads, bf16);
}

/* The calling thread's scratch, kept from call to call (at most the largest step's: bounded by
 * the engine's tokens per step). A 2048-token prefill chunk's buffers are ~50 MB, which malloc
 * would map and fault in afresh for each of the layers. */
static char *scratch(long bytes) {
    static __thread char *buf;
    static __thread long cap;
    if (bytes > cap) {
        free(buf);
        buf = malloc(bytes);
        cap = buf ? bytes : 0;
    }
    return buf;
}

static int kvlab_decoder_layer(const void *const *w, const int *fmt, long M, long hidden, long H, long KV, long D, long I,
                        float eps, const void *x, void *out, const void *cos, const void *sin,
                        void *kc, void *vc, long S, int cache_bf16, const int64_t *write_slots,
                        const int64_t *slots, long L, const int64_t *seqs, const int64_t *starts,
                        const int64_t *lengths, int bf16, int threads) {
    const long es = bf16 ? 2 : 4, QD = H * D, KD = KV * D;
    /* h (then the second norm's output), q, k, v, the attention's fp32 output, a (then the MLP's
     * output), x + a, gate, up; bf16 adds fp32 q and the rounded attention output */
    const long sizes[] = {M * hidden * es, M * QD * es, M * KD * es, M * KD * es, M * QD * 4,
                          M * hidden * es, M * hidden * es, M * I * es, M * I * es,
                          bf16 ? M * QD * 4 : 0, bf16 ? M * QD * es : 0};
    enum { H_, Q_, K_, V_, O32_, A_, X2_, G_, U_, Q32_, O_, NBUF };
    char *buf[NBUF];
    long total = 0;
    for (int i = 0; i < NBUF; i++) total += (sizes[i] + 63) / 64 * 64;
    char *arena = scratch(total);
    if (!arena) return 1;
    for (long i = 0, at = 0; i < NBUF; at += (sizes[i] + 63) / 64 * 64, i++) buf[i] = arena + at;

    kvlab_rms_norm(x, NULL, NULL, w[NORM1], buf[H_], M, hidden, eps, bf16, threads);
    const kvlab_part qkv[] = {{w[WQ], w[BQ], buf[Q_], QD, fmt[0]}, {w[WK], w[BK], buf[K_], KD, fmt[1]},
                              {w[WV], w[BV], buf[V_], KD, fmt[2]}};
    kvlab_linear_parts(buf[H_], qkv, 3, M, hidden, threads, bf16);
    kvlab_rope(buf[Q_], M, H, D, QD, cos, sin, bf16, threads);
    kvlab_rope(buf[K_], M, KV, D, KD, cos, sin, bf16, threads);
    kvlab_store_kv(buf[K_], buf[V_], KD, KD, kc, vc, write_slots, M, KV, D, D, S, bf16, cache_bf16);

    float *q32 = (float *)buf[Q_], *o32 = (float *)buf[O32_];
    void *o = o32;
    if (bf16) { /* the attention takes fp32 queries and its output is rounded back */
        q32 = (float *)buf[Q32_];
        o = buf[O_];
        for (long i = 0; i < M * QD; i++) q32[i] = load1(buf[Q_], i, 1);
    }
    /* the scale as kvlab.kernels.paged_attention passes it: 1 / sqrt(D) in double, then float */
    if (kvlab_paged_attention(q32, kc, vc, cache_bf16, S, slots, L, seqs, starts, lengths, o32, M, H,
                              KV, D, D, (float)(1.0 / sqrt((double)D)), threads))
        return 1;
    if (bf16)
        for (long i = 0; i < M * QD; i++) store1(o, i, o32[i], 1);
    lin(o, w[WO], w[BO], fmt[3], buf[A_], M, hidden, QD, threads, bf16);
    kvlab_rms_norm(buf[A_], x, buf[X2_], w[NORM2], buf[H_], M, hidden, eps, bf16, threads);
    const kvlab_part gate_up[] = {{w[WG], w[BG], buf[G_], I, fmt[4]}, {w[WU], w[BU], buf[U_], I, fmt[5]}};
    kvlab_linear_parts(buf[H_], gate_up, 2, M, hidden, threads, bf16);
    kvlab_silu_mul(buf[G_], buf[U_], M * I, bf16, threads);
    lin(buf[G_], w[WD], w[BD], fmt[6], buf[A_], M, hidden, I, threads, bf16);
    for (long i = 0; i < M * hidden; i++)
        store1(out, i, load1(buf[X2_], i, bf16) + load1(buf[A_], i, bf16), bf16);
    return 0;
}

/* layers[n] (kvlab_layer, kvlab.h): what kvlab_decoder_layer takes for each layer but the step's
 * rows (x, M, RoPE), fixed while the model's weights are (w, fmt, shapes, eps); caches[n][6]:
 * each layer's k cache, v cache, D, S, cache_bf16 and row group; rows[g][6]: each group's
 * write_slots, slots, L, seqs, starts, lengths (int64, pointers as addresses).
 * x [M, hidden] -> out; 1 as kvlab_decoder_layer. */
int kvlab_decoder_layers(const kvlab_layer *layers, const int64_t *caches, const int64_t *rows, int n,
                         long M, long hidden, const void *x, void *out, const void *cos, const void *sin,
                         int bf16, int threads) {
    for (int i = 0; i < n; i++) {
        const kvlab_layer *l = &layers[i];
        const int64_t *c = caches + 6 * i, *r = rows + 6 * c[5];
        if (kvlab_decoder_layer(l->w, l->fmt, M, hidden, l->H, l->KV, c[2], l->I, l->eps, i ? out : x, out,
                                cos, sin, (void *)c[0], (void *)c[1], c[3], (int)c[4], (const int64_t *)r[0],
                                (const int64_t *)r[1], r[2], (const int64_t *)r[3], (const int64_t *)r[4],
                                (const int64_t *)r[5], bf16, threads))
            return 1;
    }
    return 0;
}
