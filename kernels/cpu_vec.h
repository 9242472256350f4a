/* What the CPU's C kernels share (cpu_decode.c, cpu_amx.c): GCC's vector types, 16 lanes, and bfloat16 rounding. */
#ifndef SHARDSERVE_CPU_VEC_H
#define SHARDSERVE_CPU_VEC_H
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

#endif
