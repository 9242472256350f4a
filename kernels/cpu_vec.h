/* What the CPU's C kernels share (cpu_decode.c, cpu_amx.c): GCC's vector types, 16 lanes, bfloat16 rounding and
 * widening, loads and stores, e^x. */
#ifndef CPU_VEC_H_INCLUDED
#define CPU_VEC_H_INCLUDED
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

/* float -> bfloat16 bits, 16 at a time, rounded to nearest even as torch rounds (a NaN becomes the quiet NaN 0x7fc0) */
static inline u16x16 bf16_round_v(v16 f) {
    u32x16 u;
    memcpy(&u, &f, sizeof u);
    const u32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const u32x16 nan = (u32x16)((u & 0x7fffffffu) > 0x7f800000u);
    return __builtin_convertvector((nan & 0x7fc0u) | (rounded & ~nan), u16x16);
}

static inline v16 bf16_widen_v(u16x16 h) {
    const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    v16 f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline v16 load_bf16(const uint16_t *p) {
    u16x16 h;
    memcpy(&h, p, sizeof h);
    return bf16_widen_v(h);
}
static inline v16 loadv(const float *p) { v16 f; memcpy(&f, p, sizeof f); return f; }
static inline void storev(float *p, v16 x) { memcpy(p, &x, sizeof x); }
static inline v16 splat(float x) { return (v16){x,x,x,x,x,x,x,x,x,x,x,x,x,x,x,x}; }
static inline v16 select_v(i16v m, v16 a, v16 b) {
    i16v ia, ib; memcpy(&ia, &a, 64); memcpy(&ib, &b, 64);
    ia = (ia & m) | (ib & ~m); v16 r; memcpy(&r, &ia, 64); return r;
}
static inline v16 vmax(v16 a, v16 b) { return select_v(a > b, a, b); }
static inline float hmax(v16 a) { float m = a[0]; for (int i = 1; i < 16; i++) m = a[i] > m ? a[i] : m; return m; }
static inline float hsum(v16 a) { float s = 0; for (int i = 0; i < 16; i++) s += a[i]; return s; }

/* e^x for x <= 0 (Cephes' float polynomial, ~2 ulp); x below -87 (and -inf) gives 0 */
static inline v16 vexp(v16 x) {
    const v16 lo = splat(-87.0f);
    const i16v under = x < lo;
    x = vmax(x, lo);
    const v16 n = x * splat(1.44269504088896341f) + splat(12582912.0f) - splat(12582912.0f); /* rounded */
    const v16 f = x - n * splat(0.693359375f) + n * splat(2.12194440e-4f);
    v16 p = splat(1.9875691500e-4f);
    p = p * f + splat(1.3981999507e-3f);
    p = p * f + splat(8.3334519073e-3f);
    p = p * f + splat(4.1665795894e-2f);
    p = p * f + splat(1.6666665459e-1f);
    p = p * f + splat(5.0000001201e-1f);
    p = p * f * f + f + splat(1.0f);
    const i16v e = (__builtin_convertvector(n, i16v) + 127) << 23;
    v16 scale; memcpy(&scale, &e, sizeof scale);
    return select_v(under, splat(0.0f), p * scale);
}

#endif
