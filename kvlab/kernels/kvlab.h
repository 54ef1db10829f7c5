/* kvlab's native kernels, declared once: every function Python calls (KVLAB_API), every
 * function one .c file calls in another, and the structs they share. Every .c file includes it;
 * none declares another's function again.
 *
 * The library is built with -fvisibility=hidden, so it exports exactly the KVLAB_API functions,
 * and kvlab/kernels/binding.py reads this file to set their ctypes argument and result types
 * and to build the structs' ctypes.Structure classes: nothing here is written again in Python.
 * Its parser is strict and small, so keep to what it reads: `KVLAB_API type name(args);`,
 * plain prototypes, `typedef struct { fields; } name;`, function-pointer typedefs, #include,
 * #define and the include guard; named arguments; the scalar types void, int, long, float,
 * double, size_t, (u)int8/16/32/64_t, and pointers to those or to the structs here (a pointer
 * to data is an address in Python: a tensor's data_ptr()). Anything else fails loudly there,
 * naming its line.
 *
 * x86 with AVX2 and FMA; fp32 or bf16 (as uint16_t bits) activations. Each function's comment
 * at its definition says more.
 */
#ifndef KVLAB_H
#define KVLAB_H

#include <stdint.h>

#define KVLAB_API __attribute__((visibility("default")))

/* ---- structs ---- */

/* One weight of a linear sharing its input x with others: y [M, N] = x w^T (+ b; NULL: none), fmt 0 dense, else a block format (blocks.h). */
typedef struct {
    const void *w, *b;
    void *y;
    long N;
    int fmt;
} kvlab_part;
#define KVLAB_MAX_PARTS 3 /* parts per kvlab_linear_parts call at most */
/* kvlab_part.fmt's flag on a 32-weight block format (Q8_0, Q4_0, Q4_1, Q5_0): the fp32 input rows
   are quantised to int8 blocks and multiplied by integer dot products (act8.h) */
#define KVLAB_ACT8 64

/* One layer of a kvlab_decoder_layers stack: w its 16 weight pointers (layer.c's order), fmt its seven matrices' formats, H / KV heads, I the MLP's width, eps the norms'. */
typedef struct {
    const void *const *w;
    const int *fmt;
    long H, KV, I;
    float eps;
} kvlab_layer;

/* ---- called from Python ---- */

/* linear.c: fp32 y [M, N] = x [M, K] w [N, K]^T (+ b) on `threads` threads. */
KVLAB_API void kvlab_linear_f32(const float *x, const float *w, const float *b, float *y, long M, long N,
                                long K, int threads);
/* linear.c: the same in bf16, summed in fp32 and each output rounded once. */
KVLAB_API void kvlab_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y,
                                 long M, long N, long K, int threads);
/* linear.c: bf16 inputs, fp32 outputs (the LM head's logits): the same sums, not rounded. */
KVLAB_API void kvlab_linear_bf16_f32(const uint16_t *x, const uint16_t *w, const uint16_t *b, float *y,
                                     long M, long N, long K, int threads);
/* linear.c: fp32 rows x [M, K] against a weight [N, K] stored in GGUF block format fmt (| KVLAB_ACT8: int8 activations). */
KVLAB_API void kvlab_linear_q(const float *x, const uint8_t *w, const float *b, float *y, long M, long N,
                              long K, int fmt, int threads);
/* linear.c: the fp32 values [rows, K] of a weight in block format fmt, exactly gguf.quants'. */
KVLAB_API void kvlab_dequantize(const uint8_t *w, float *out, long rows, long K, int fmt, int threads);
/* linear.c: x [M, K] fp32 quantised as --activations int8 does: q [M, K], per 32 values a scale d and the sum s of q. */
KVLAB_API void kvlab_quantize_act8(const float *x, int8_t *q, float *d, int32_t *s, long M, long K, int threads);
/* kvlab_set_vnni's encodings of vpdpbusd (0: AVX2's vpmaddubsw + vpmaddwd) */
#define KVLAB_VNNI_512 1 /* AVX512-VNNI with BW and VL */
#define KVLAB_VNNI_AVX 2 /* AVX-VNNI */
/* linear.c: the int8 activations' dot products in encoding want if the CPU has it (0: AVX2's); returns whether it runs. */
KVLAB_API int kvlab_set_vnni(int want);
/* linear.c: take the block formats' AVX-512 loops if wanted and the CPU has them; returns whether they run. */
KVLAB_API int kvlab_set_avx512(int want);
/* attention.c: softmax(q K^T * scale) V per query row over the paged cache; returns 1 when out of memory. */
KVLAB_API int kvlab_paged_attention(const float *q, const void *kc, const void *vc, int bf16, long S,
                                    const int64_t *slots, long L, const int64_t *seq, const int64_t *start,
                                    const int64_t *len, float *out, long R, long H, long KV, long D, long DV,
                                    float scale, int threads);
/* rowwise.c: y = RMSNorm(h) * w with h = x + a (a NULL: h = x; h_out NULL: h not written), rows [M, D]. */
KVLAB_API void kvlab_rms_norm(const void *x, const void *a, void *h_out, const void *w, void *y, long M,
                              long D, float eps, int bf16, int threads);
/* rowwise.c: rotate-half RoPE in place on T tokens x H heads of D values (token stride `stride`). */
KVLAB_API void kvlab_rope(void *x, long T, long H, long D, long stride, const void *cos, const void *sin,
                          int bf16, int threads);
/* rowwise.c: each token's k [T, KV, D] and v [T, KV, DV] to slot slots[t] of the caches [KV, S, D / DV]. */
KVLAB_API void kvlab_store_kv(const void *k, const void *v, long k_stride, long v_stride, void *kc, void *vc,
                              const int64_t *slots, long T, long KV, long D, long DV, long S, int src_bf16,
                              int dst_bf16);
/* rowwise.c: gate = silu(gate) * up in place over n values. */
KVLAB_API void kvlab_silu_mul(void *gate, const void *up, long n, int bf16, int threads);
/* layer.c: n decoder layers on x [M, hidden] -> out, each on the one before's output; returns 1 when out of memory. */
KVLAB_API int kvlab_decoder_layers(const kvlab_layer *layers, const int64_t *caches, const int64_t *rows, int n,
                                   long M, long hidden, const void *x, void *out, const void *cos,
                                   const void *sin, int bf16, int threads);

/* ---- shared between the .c files only ---- */

/* linear.c: y_p = x w_p^T (+ b_p) for np <= KVLAB_MAX_PARTS parts sharing x, in one parallel loop. */
void kvlab_linear_parts(const void *x, const kvlab_part *parts, int np, long M, long K, int threads,
                        int bf16);

/* pool.c: items [begin, end) of a loop; ctx: the loop's arguments. */
typedef void (*kvlab_task)(void *ctx, long begin, long end);
/* pool.c: fn over items [0, n) on up to `threads` threads, the caller one of them (grain <= 0: a few chunks a thread). */
void kvlab_parallel(long n, long grain, int threads, kvlab_task fn, void *ctx);

#endif
