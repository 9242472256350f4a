/* bfloat16 matmuls of a few rows on AMX: y[M, N] = x[M, K] . W^T, for a decode step's linear layers on the CPU.
 *
 * Built with cpu_decode.c into one object (kernels/cpu_native.py). At a decode step's row counts (tens of rows)
 * a matmul is a pass over its weights, and the step's time is how fast they are read: oneDNN read the default
 * model's at ~13 GB/s at 32 rows, this loop at ~25 GB/s, the host's read rate (docs/performance.md). Larger row
 * counts (prefill) stay with oneDNN, whose blocking wins there.
 *
 * The loop reads the weight oneDNN packed for its own matmuls (worker/layers/cpu_packed.py), so the weights are
 * held once. For a bfloat16 [N, K] weight packed for 32 rows, oneDNN's blocked layout is
 *   w [N' / 32][K / 2][32 columns][2]   (N' = N rounded up to 32, zero columns; cpu_native.amx_weight checks it)
 * so a K step (32 k) of a 32-column block is 2 KiB of contiguous memory, 16 rows of 128 bytes, and its two 16-column
 * halves are AMX B tiles with a row stride of 128 bytes (columns 0-15 in each row's first 64 bytes). Work items
 * (split among the threads) read whole blocks, step by step in memory order, prefetching each step into L2 twelve
 * steps ahead and into L1 three ahead on their first rows (later rows find the blocks in L2; past an item's end
 * the prefetch runs into the next item's blocks). Rows past M are read from a zero-padded copy of x's last rows.
 * The accumulators are rounded to bfloat16 as torch rounds (nearest even); the sums are float32 in another order
 * than oneDNN's, so the last bits differ as between any two BLAS.
 *
 * linear_bf16_amx's work item is one 32-column block, 32 rows at a time (four 16 x 16 float32 accumulator tiles:
 * 2 row tiles x the block's halves). linear_bf16_amx_silu is the MLP's gate_up projection ([gate; up], N = 2 I,
 * I a multiple of 32) with SiLU-and-mul in its store: its work item is a 32-column block of the gate and the
 * matching block of up, 16 rows at a time (accumulators: gate and up, two halves each), and it writes
 * silu(gate) * up [M, I] where the plain matmul writes [M, 2 I], each step rounded to bfloat16 as torch's separate
 * ops round (the products, SiLU in float32 from the rounded gate, the product with the rounded up); e^x is a
 * polynomial, not torch's Sleef, so a SiLU may differ from torch's in its last bit.
 *
 * Reading oneDNN's blocks, not a copy of the weights in a tile layout of the loop's own, holds the weights once;
 * it costs a few percent of a decode step, as the same bytes read in this order stream slower, for reasons not
 * found (docs/performance-history.md).
 *
 * Where the compiler does not target AMX (no amx_tile/amx_bf16 on the host), linear_bf16_amx returns -1 and the
 * caller keeps oneDNN. Linux hands a process AMX's large register state only on request (amx_enable).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cpu_vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define FAR 12  /* K steps ahead a weight step is prefetched into L2 */
#define NEAR 3  /* and into L1 */

int amx_enable(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

static void configure_tiles(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {  /* every tile 16 rows of 64 bytes: 16 x 16 float32, 16 x 32 bf16, 16 pairs x 16 */
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* float32 [rows][32] accumulators -> bf16 y rows, columns below `cols` (the rest are the padding's) */
static void store_rounded(const float *acc, int rows, int cols, uint16_t *y, int64_t ldy) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c += 16) {
            const u16x16 h = bf16_round_v(loadv(acc + r * 32 + c));
            memcpy(y + r * ldy + c, &h, (cols - c < 16 ? cols - c : 16) * sizeof(uint16_t));
        }
}

/* gate (columns 0-31) and up (32-63) accumulators, 64 floats a row -> silu(gate) * up, 32 bf16 columns a row, as
 * torch's ops round: the matmul's bf16 outputs, SiLU in float32 of the rounded gate (x / (1 + e^-x), taken as
 * x e^x / (1 + e^x) below zero so that e^x's argument is never positive), rounded, times the rounded up, rounded. */
static void store_silu_mul(const float *acc, int rows, uint16_t *y, int64_t ldy) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 32; c += 16) {
            const v16 g = bf16_widen_v(bf16_round_v(loadv(acc + r * 64 + c)));
            const v16 u = bf16_widen_v(bf16_round_v(loadv(acc + r * 64 + 32 + c)));
            const i16v negative = g < splat(0.0f);
            const v16 t = vexp(select_v(negative, g, -g));  /* e^-|g| */
            const v16 silu = select_v(negative, g * t, g) / (splat(1.0f) + t);
            const u16x16 h = bf16_round_v(bf16_widen_v(bf16_round_v(silu)) * u);
            memcpy(y + r * ldy + c, &h, 16 * sizeof(uint16_t));
        }
}

#define BLOCK_ROW 64   /* uint16 elements in a row of a 32-column block: 32 columns x 2 */
#define K_STEP 1024    /* uint16 elements in a K step (32 k, 16 rows) of a 32-column block */

/* prefetches the 2 KiB K step `ahead` steps past kb of each of the two blocks a work item reads (both halves' lines:
 * a plain item's two tiles are the halves of one block), into L2 from far ahead and into L1 from near; past the
 * item's last step that is the next item's first (the blocks lie in order; a prefetch never faults) */
static inline void prefetch_steps(const uint16_t *b0, const uint16_t *b1, int64_t kb) {
    const char *far0 = (const char *)(b0 + (kb + FAR) * K_STEP), *far1 = (const char *)(b1 + (kb + FAR) * K_STEP);
    const char *near0 = (const char *)(b0 + (kb + NEAR) * K_STEP), *near1 = (const char *)(b1 + (kb + NEAR) * K_STEP);
    for (int line = 0; line < 2048; line += 64) {
        _mm_prefetch(far0 + line, _MM_HINT_T2);
        _mm_prefetch(near0 + line, _MM_HINT_T0);
        if (b1 != b0) {
            _mm_prefetch(far1 + line, _MM_HINT_T2);
            _mm_prefetch(near1 + line, _MM_HINT_T0);
        }
    }
}

/* x [M, K] bf16 rows ldx apart; w [N' / 32][K / 2][32][2] as above; y [M, N] bf16 rows ldy apart; gated: N is the
 * gate's (and up's) columns, a multiple of 32, and the weight's 2 N. K a multiple of 32. Returns 0; -1 where AMX
 * is not compiled in; -2 for shapes it does not take; -3 where memory for the padded rows ran out.
 *
 * A plain work item is a 32-column block, 32 rows at a time: four accumulators (2 row tiles x the block's two
 * halves), two x tiles, two weight tiles. A gated one is a 32-column block of the gate and the up projection's
 * matching block, 16 rows at a time: four accumulators (gate and up, two halves each), one x tile, the weight tiles
 * loaded two at a time; both read their blocks' 2 KiB steps whole, in memory order. */
static int amx_matmul(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                      uint16_t *y, int64_t ldy, int gated) {
    if (m < 1 || k < 32 || k % 32 || n < 1 || (gated && n % 32) || ldx < k || ldy < n)
        return -2;
    const int64_t chunk = gated ? 16 : 32;  /* rows a pass over K takes */
    const int64_t kb_count = k / 32, full = m / chunk * chunk, tail = m - full, items = (n + 31) / 32;
    uint16_t *padded = NULL;  /* the last partial chunk of x's rows, zeros below */
    if (tail) {
        padded = calloc(chunk * k, sizeof *padded);
        if (!padded)
            return -3;
        for (int64_t r = 0; r < tail; r++)
            memcpy(padded + r * k, x + (full + r) * ldx, k * sizeof *x);
    }
    #pragma omp parallel
    {
        configure_tiles();
        float acc[32 * 32];  /* plain: [32 rows][32 columns]; gated: [16 rows][gate 32, up 32] */
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < items; p++) {
            const uint16_t *b0 = w + p * 32 * k, *b1 = gated ? w + (n / 32 + p) * 32 * k : b0;
            const int64_t cols = n - 32 * p < 32 ? n - 32 * p : 32;
            for (int64_t m0 = 0; m0 < m; m0 += chunk) {
                const uint16_t *a = m0 < full ? x + m0 * ldx : padded;
                const int64_t lda = m0 < full ? ldx : k;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kb = 0; kb < kb_count; kb++) {
                    if (m0 == 0)  /* later chunks find the item's blocks in L2 */
                        prefetch_steps(b0, b1, kb);
                    const uint16_t *w0 = b0 + kb * K_STEP, *w1 = b1 + kb * K_STEP;
                    if (gated) {
                        _tile_loadd(4, a + kb * 32, lda * 2);
                        _tile_loadd(6, w0, BLOCK_ROW * 2);
                        _tile_loadd(7, w0 + 32, BLOCK_ROW * 2);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_loadd(6, w1, BLOCK_ROW * 2);
                        _tile_loadd(7, w1 + 32, BLOCK_ROW * 2);
                        _tile_dpbf16ps(2, 4, 6);
                        _tile_dpbf16ps(3, 4, 7);
                    } else {
                        _tile_loadd(4, a + kb * 32, lda * 2);
                        _tile_loadd(5, a + 16 * lda + kb * 32, lda * 2);
                        _tile_loadd(6, w0, BLOCK_ROW * 2);
                        _tile_loadd(7, w0 + 32, BLOCK_ROW * 2);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                if (gated) {
                    _tile_stored(0, acc, 256);
                    _tile_stored(1, acc + 16, 256);
                    _tile_stored(2, acc + 32, 256);
                    _tile_stored(3, acc + 48, 256);
                } else {
                    _tile_stored(0, acc, 128);
                    _tile_stored(1, acc + 16, 128);
                    _tile_stored(2, acc + 16 * 32, 128);
                    _tile_stored(3, acc + 16 * 32 + 16, 128);
                }
                const int rows = (int)(m - m0 < chunk ? m - m0 : chunk);
                if (gated)
                    store_silu_mul(acc, rows, y + m0 * ldy + 32 * p, ldy);
                else
                    store_rounded(acc, rows, (int)cols, y + m0 * ldy + 32 * p, ldy);
            }
        }
        _tile_release();
    }
    free(padded);
    return 0;
}

int linear_bf16_amx(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                    uint16_t *y, int64_t ldy) {
    return amx_matmul(x, ldx, m, k, w, n, y, ldy, 0);
}

int linear_bf16_amx_silu(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                         uint16_t *y, int64_t ldy) {
    return amx_matmul(x, ldx, m, k, w, n, y, ldy, 1);
}

#else
int amx_enable(void) { return -1; }

int linear_bf16_amx(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                    uint16_t *y, int64_t ldy) {
    (void)x; (void)ldx; (void)m; (void)k; (void)w; (void)n; (void)y; (void)ldy;
    return -1;
}

int linear_bf16_amx_silu(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                         uint16_t *y, int64_t ldy) {
    return linear_bf16_amx(x, ldx, m, k, w, n, y, ldy);
}
#endif
