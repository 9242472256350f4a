/* The CPU path's C kernels: decode attention over the paged KV cache (one query per sequence, the cache read in
 * place), the KV store into that cache, RoPE and RMSNorm (the last two bit for bit as torch's ops compute them).
 *
 * Built at first use by kernels/cpu_native.py (the host's C compiler, -O3 -march=native, OpenMP's pragmas on) and
 * called through ctypes, which releases the GIL for the call. The object is linked against the OpenMP runtime torch
 * has loaded, so the parallel loops run on torch's intra-op threads.
 *
 * Decode attention. Layouts (those of the torch backend's CPU cache, kernels/torch_paged_decode.py):
 *   q       [B, H, D] float32, already multiplied by the softmax scale
 *   k_t     [num_blocks, KVH, D, BS]  K transposed within each block: a key's dims are BS apart
 *   v       [num_blocks, BS, KVH, D]
 *   tables  [B, table_stride] int32 block ids; lens [B] int32 context lengths (>= 1)
 *   out     [B, H, D] float32
 * Cache entries are bfloat16 (uint16 bits) or float32; head_dim and block_size multiples of 16. Returns 0; -1 for a
 * shape it does not take, -2 for a length < 1 or a block id outside [0, num_blocks), both before computing anything;
 * -3 where memory for the scores ran out. One work item is a sequence (its KV heads one after the other: a
 * sequence's cache, ~250 KB at 330 tokens, stays in L2 while its heads are read, and the neighbouring heads' lines
 * come in with each other; by (sequence, head) items a layer took 10-22% longer). Each KV head's G = H / KVH query
 * heads are taken four at a time, in three passes over the sequence, all in float32:
 *   1. scores: 16 keys at a time from K^T's rows (16 consecutive keys of one dim: one vector, times each head's
 *      entry for that dim; even and odd dims in separate sums, so that eight multiply-adds are in flight), the
 *      positions past the context set to -inf, each head's running maximum kept as a vector;
 *   2. softmax numerators in place, e^x by a polynomial 16 at a time, and each head's sum;
 *   3. out = sum of p * v over the keys, 4 heads x 64 dims of accumulators held in registers.
 * The next block's lines are prefetched while one block is read (the blocks of a sequence lie anywhere in the
 * cache). Written with GCC's vector extensions, which the compiler lowers to the host's widest vectors (AVX-512
 * where it has them). The kernel reads memory at about the rate the host gives it (docs/performance.md): reading
 * heads block by block, pair products (vdpbf16ps) and other prefetch distances were timed and gave nothing.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cpu_vec.h"

#define DEFINE_DECODE(NAME, T, LOAD)                                                                             \
int NAME(const float *q, const T *k_t, const T *v, const int32_t *tables, int64_t table_stride,                \
         const int32_t *lens, float *out, int batch, int heads, int kv_heads, int head_dim, int block_size,     \
         int64_t num_blocks) {                                                                                 \
    const int group = heads / kv_heads;                                                                       \
    if (group * kv_heads != heads || head_dim % 16 || block_size % 16) return -1;                             \
    for (int b = 0; b < batch; b++) { /* every block read lies in the cache, or nothing is computed */         \
        if (lens[b] < 1) return -2;                                                                           \
        for (int blk = 0; blk < (lens[b] + block_size - 1) / block_size; blk++) {                             \
            const int32_t id = tables[(int64_t)b * table_stride + blk];                                       \
            if (id < 0 || id >= num_blocks) return -2;                                                        \
        }                                                                                                     \
    }                                                                                                         \
    const int dv = head_dim / 16, bv = block_size / 16;                                                       \
    const int64_t vstride = (int64_t)kv_heads * head_dim;                                                     \
    int failed = 0;                                                                                           \
    _Pragma("omp parallel for schedule(dynamic, 1) reduction(|: failed)")                                     \
    for (int b = 0; b < batch; b++)                                                                           \
    for (int h = 0; h < kv_heads; h++) {                                                                      \
        const int len = lens[b];                                                                              \
        const int blocks = (len + block_size - 1) / block_size, padded = blocks * block_size;                 \
        const int32_t *table = tables + (int64_t)b * table_stride;                                            \
        const float *qg = q + ((int64_t)b * heads + (int64_t)h * group) * head_dim;                           \
        float *scores = malloc(sizeof(float) * group * padded); /* [group, padded] */                         \
        if (!scores) { failed = 1; continue; }                                                                \
        for (int g0 = 0; g0 < group; g0 += 4) {                                                               \
            const int gn = group - g0 < 4 ? group - g0 : 4;                                                   \
            v16 top[4] = {splat(-INFINITY), splat(-INFINITY), splat(-INFINITY), splat(-INFINITY)};            \
            /* scores: q . k for 16 keys at a time, two partial sums a head (even and odd dims) */            \
            for (int blk = 0; blk < blocks; blk++) {                                                          \
                const T *kb = k_t + ((int64_t)table[blk] * kv_heads + h) * head_dim * block_size;             \
                if (blk + 1 < blocks) {                                                                       \
                    const char *nk =                                                                          \
                        (const char *)(k_t + ((int64_t)table[blk + 1] * kv_heads + h) * head_dim * block_size);   \
                    for (int o = 0; o < (int)(head_dim * block_size * sizeof(T)); o += 64) __builtin_prefetch(nk + o); \
                }                                                                                             \
                for (int c = 0; c < bv; c++) {                                                                \
                    v16 s[4][2] = {{splat(0), splat(0)}, {splat(0), splat(0)}, {splat(0), splat(0)},          \
                                   {splat(0), splat(0)}};                                                     \
                    for (int d = 0; d < head_dim; d += 2) {                                                   \
                        const v16 k0 = LOAD(kb + (int64_t)d * block_size + c * 16);                           \
                        const v16 k1 = LOAD(kb + (int64_t)(d + 1) * block_size + c * 16);                     \
                        _Pragma("GCC unroll 4")                                                               \
                        for (int g = 0; g < 4; g++) {                                                         \
                            if (g < gn) {                                                                     \
                                s[g][0] += splat(qg[(g0 + g) * head_dim + d]) * k0;                           \
                                s[g][1] += splat(qg[(g0 + g) * head_dim + d + 1]) * k1;                       \
                            }                                                                                 \
                        }                                                                                     \
                    }                                                                                         \
                    const int pos = blk * block_size + c * 16;                                                \
                    const i16v past = (i16v){0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15} + pos >= len;             \
                    _Pragma("GCC unroll 4")                                                                   \
                    for (int g = 0; g < 4; g++) {                                                             \
                        if (g < gn) {                                                                         \
                            const v16 x = select_v(past, splat(-INFINITY), s[g][0] + s[g][1]);                \
                            top[g] = vmax(top[g], x);                                                         \
                            storev(scores + (g0 + g) * padded + pos, x);                                      \
                        }                                                                                     \
                    }                                                                                         \
                }                                                                                             \
            }                                                                                                 \
            /* softmax numerators in place, each head's sum */                                                \
            float inv[4];                                                                                     \
            for (int g = 0; g < gn; g++) {                                                                    \
                const v16 m = splat(hmax(top[g]));                                                            \
                float *sg = scores + (g0 + g) * padded;                                                       \
                v16 sum = splat(0);                                                                           \
                for (int i = 0; i < padded; i += 16) {                                                        \
                    const v16 e = vexp(loadv(sg + i) - m);                                                    \
                    storev(sg + i, e);                                                                        \
                    sum += e;                                                                                 \
                }                                                                                             \
                inv[g] = 1.0f / hsum(sum);                                                                    \
            }                                                                                                 \
            /* out = sum of p * v over the keys, four 16-dim pieces of each head at a time */                 \
            for (int c0 = 0; c0 < dv; c0 += 4) {                                                              \
                const int cn = dv - c0 < 4 ? dv - c0 : 4;                                                     \
                v16 acc[4][4];                                                                                \
                for (int g = 0; g < 4; g++) for (int c = 0; c < 4; c++) acc[g][c] = splat(0);                 \
                for (int blk = 0; blk < blocks; blk++) {                                                      \
                    const T *vb = v + ((int64_t)table[blk] * block_size * kv_heads + h) * head_dim + c0 * 16; \
                    const int n = len - blk * block_size < block_size ? len - blk * block_size : block_size;  \
                    if (blk + 1 < blocks) {                                                                   \
                        const T *nv = v + ((int64_t)table[blk + 1] * block_size * kv_heads + h) * head_dim + c0 * 16; \
                        for (int j = 0; j < block_size; j++)                                                  \
                            for (int o = 0; o < (int)(cn * 16 * sizeof(T)); o += 64)                          \
                                __builtin_prefetch((const char *)(nv + j * vstride) + o);                     \
                    }                                                                                         \
                    for (int j = 0; j < n; j++) {                                                             \
                        const int pos = blk * block_size + j;                                                 \
                        v16 x[4];                                                                             \
                        _Pragma("GCC unroll 4")                                                               \
                        for (int c = 0; c < 4; c++) if (c < cn) x[c] = LOAD(vb + j * vstride + c * 16);       \
                        _Pragma("GCC unroll 4")                                                               \
                        for (int g = 0; g < 4; g++) {                                                         \
                            if (g < gn) {                                                                     \
                                const v16 p = splat(scores[(g0 + g) * padded + pos]);                         \
                                _Pragma("GCC unroll 4")                                                       \
                                for (int c = 0; c < 4; c++) if (c < cn) acc[g][c] += p * x[c];                \
                            }                                                                                 \
                        }                                                                                     \
                    }                                                                                         \
                }                                                                                             \
                for (int g = 0; g < gn; g++) {                                                                \
                    float *o = out + ((int64_t)b * heads + (int64_t)h * group + g0 + g) * head_dim + c0 * 16; \
                    for (int c = 0; c < cn; c++) storev(o + c * 16, acc[g][c] * splat(inv[g]));               \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        free(scores);                                                                                         \
    }                                                                                                         \
    return failed ? -3 : 0;                                                                                   \
}
DEFINE_DECODE(paged_decode_bf16, uint16_t, load_bf16)
DEFINE_DECODE(paged_decode_f32, float, loadv)

/* The new tokens' K and V written at their cache slots (slot >= 0; the caller leaves out rows without one): K into
 * K^T (a key's dims block_size apart), V as a row. k and v are [T, KVH, D] with any token stride (the QKV
 * projection's output, split), heads and dims contiguous; entries of elem_size bytes (2 or 4), as the caches'. */
#define DEFINE_STORE(NAME, T)                                                                                    \
static void NAME(const T *k, const T *v, int64_t k_stride, int64_t v_stride, T *k_t, T *v_cache,                \
                 const int64_t *slots, int tokens, int kv_heads, int head_dim, int block_size) {                \
    _Pragma("omp parallel for if (tokens >= 64)")                                                             \
    for (int t = 0; t < tokens; t++) {                                                                        \
        const int64_t slot = slots[t], block = slot / block_size, offset = slot % block_size;                 \
        for (int h = 0; h < kv_heads; h++) {                                                                  \
            const T *src = k + t * k_stride + (int64_t)h * head_dim;                                          \
            T *dst = k_t + ((block * kv_heads + h) * head_dim) * block_size + offset;                         \
            for (int d = 0; d < head_dim; d++) dst[(int64_t)d * block_size] = src[d];                         \
            memcpy(v_cache + (slot * kv_heads + h) * head_dim, v + t * v_stride + (int64_t)h * head_dim,      \
                   sizeof(T) * head_dim);                                                                     \
        }                                                                                                     \
    }                                                                                                         \
}
DEFINE_STORE(store_kv_2, uint16_t)
DEFINE_STORE(store_kv_4, uint32_t)

int store_kv(const void *k, const void *v, int64_t k_stride, int64_t v_stride, void *k_t, void *v_cache,
             const int64_t *slots, int tokens, int kv_heads, int head_dim, int block_size, int elem_size,
             int64_t num_slots) {
    for (int t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -2; /* nothing written */
    if (elem_size == 2)
        store_kv_2(k, v, k_stride, v_stride, k_t, v_cache, slots, tokens, kv_heads, head_dim, block_size);
    else if (elem_size == 4)
        store_kv_4(k, v, k_stride, v_stride, k_t, v_cache, slots, tokens, kv_heads, head_dim, block_size);
    else
        return -1;
    return 0;
}


/* ---- RoPE and RMSNorm on the CPU, bit for bit as torch's ops compute them ---- */

static inline float bf16_scalar(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float -> bfloat16 bits, rounded to nearest even as torch rounds (a NaN stays a quiet NaN) */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off") /* each product and sum rounded on its own, as torch's separate ops do */

/* RoPE in place on x [T, heads, D] (a token's heads D apart, tokens x_stride elements apart: the q and k heads of
 * the QKV projection's output): with c, s = cos, sin [position, i] (float32 [max_position, D/2]), each head's halves
 * x1, x2 become x1 c - x2 s and x2 c + x1 s, in float32, then x's dtype (elem_size 4: float32, 2: bfloat16).
 * Returns -2, writing nothing, for a position outside [0, max_position). */
int rope_inplace(void *x, int64_t x_stride, int tokens, int heads, int head_dim, const int64_t *positions,
                 const float *cos_c, const float *sin_c, int64_t max_position, int elem_size) {
    const int half = head_dim / 2;
    if (elem_size != 2 && elem_size != 4) return -1;
    for (int t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_position) return -2;
    #pragma omp parallel for if (tokens >= 64)
    for (int t = 0; t < tokens; t++) {
        const float *c = cos_c + positions[t] * half, *s = sin_c + positions[t] * half;
        for (int h = 0; h < heads; h++) {
            const int64_t at = t * x_stride + (int64_t)h * head_dim;
            if (elem_size == 4) {
                float *r = (float *)x + at;
                for (int i = 0; i < half; i++) {
                    const float x1 = r[i], x2 = r[i + half];
                    const float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
                    r[i] = a - b;
                    r[i + half] = e + f;
                }
            } else {
                uint16_t *r = (uint16_t *)x + at;
                for (int i = 0; i < half; i++) {
                    const float x1 = bf16_scalar(r[i]), x2 = bf16_scalar(r[i + half]);
                    const float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
                    r[i] = bf16_round(a - b);
                    r[i + half] = bf16_round(e + f);
                }
            }
        }
    }
    return 0;
}

/* A float sum of n values in the order torch's CPU reduction adds them (aten/src/ATen/native/cpu/SumKernel.cpp:
 * 8-wide vectors, four of them interleaved, a four-level cascade; then the leftover vectors, the leftover values
 * and the 8 lanes), so that a norm's mean of squares has torch's bits. Held to torch.sum by the tests. */
static float torch_order_sum(const float *x, int n) {
    enum { VEC = 8, ILP = 4, LEVELS = 4 };
    const int vectors = n / VEC, size = vectors / ILP;
    const int ceil_log2 = size > 1 ? 32 - __builtin_clz((unsigned)(size - 1)) : 0;
    const int level_power = ceil_log2 / LEVELS > 4 ? ceil_log2 / LEVELS : 4;
    const int level_step = 1 << level_power, level_mask = level_step - 1;
    float acc[LEVELS][ILP][VEC];
    memset(acc, 0, sizeof acc);
    int i = 0;
    while (i + level_step <= size) {
        for (int j = 0; j < level_step; j++, i++)
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < VEC; l++) acc[0][k][l] += x[(i * ILP + k) * VEC + l];
        for (int j = 1; j < LEVELS; j++) {
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < VEC; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (level_mask << (j * level_power))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < VEC; l++) acc[0][k][l] += x[(i * ILP + k) * VEC + l];
    for (int j = 1; j < LEVELS; j++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < VEC; l++) acc[0][k][l] += acc[j][k][l];
    for (int v = size * ILP; v < vectors; v++)
        for (int l = 0; l < VEC; l++) acc[0][0][l] += x[v * VEC + l];
    for (int k = 1; k < ILP; k++)
        for (int l = 0; l < VEC; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int k = vectors * VEC; k < n; k++) total += x[k];
    for (int l = 0; l < VEC; l++) total += acc[0][0][l];
    return total;
}

/* RMSNorm of rows [rows, n] (x's rows x_stride elements apart; elem_size 4: float32, 2: bfloat16; n a multiple of
 * 16, at most 16,384), as the layer's torch ops compute it (HF's formula): with a residual, s = x + residual (in
 * x's dtype) is written to `summed` and normalised; y = s * (1 / sqrt(sum(s^2) / n + eps)) in float32, rounded to
 * x's dtype, then out = weight * y in x's dtype. Bit for bit the torch ops' result (the sum in torch's order, no
 * fused multiply-adds). */
int rms_norm_rows(const void *x, int64_t x_stride, const void *residual, int64_t r_stride, void *out, void *summed,
                  const void *weight, int rows, int n, float eps, int elem_size) {
    if ((elem_size != 2 && elem_size != 4) || n % 16 || n > 16384) return -1;
    const int half = elem_size == 2;
    #pragma omp parallel for if ((int64_t)rows * n >= 65536)
    for (int row = 0; row < rows; row++) {
        float vals[n], squares[n];
        for (int i = 0; i < n; i += 16) {
            v16 v;
            if (half) {
                u16x16 h;
                memcpy(&h, (const uint16_t *)x + row * x_stride + i, sizeof h);
                v = bf16_widen_v(h);
                if (residual) {
                    memcpy(&h, (const uint16_t *)residual + row * r_stride + i, sizeof h);
                    const u16x16 sum = bf16_round_v(v + bf16_widen_v(h));
                    memcpy((uint16_t *)summed + (int64_t)row * n + i, &sum, sizeof sum);
                    v = bf16_widen_v(sum);
                }
            } else {
                v = loadv((const float *)x + row * x_stride + i);
                if (residual) {
                    v = v + loadv((const float *)residual + row * r_stride + i);
                    storev((float *)summed + (int64_t)row * n + i, v);
                }
            }
            storev(vals + i, v);
            storev(squares + i, v * v);
        }
        const v16 scale = splat(1.0f / sqrtf(torch_order_sum(squares, n) / (float)n + eps));
        for (int i = 0; i < n; i += 16) {
            const v16 y = loadv(vals + i) * scale;
            if (half) {
                u16x16 w;
                memcpy(&w, (const uint16_t *)weight + i, sizeof w);
                const u16x16 o = bf16_round_v(bf16_widen_v(w) * bf16_widen_v(bf16_round_v(y)));
                memcpy((uint16_t *)out + (int64_t)row * n + i, &o, sizeof o);
            } else {
                storev((float *)out + (int64_t)row * n + i, loadv((const float *)weight + i) * y);
            }
        }
    }
    return 0;
}

#pragma GCC pop_options
