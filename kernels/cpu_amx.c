/* bfloat16 matmuls of a few rows on AMX: y[M, N] = x[M, K] . W^T, for a decode step's linear layers on the CPU.
 *
 * Built with cpu_decode.c into one object (kernels/cpu_native.py). At a decode step's row counts (tens of rows)
 * a matmul is a pass over its weights, and the step's time is how fast they are read: oneDNN read the default
 * model's at ~13 GB/s at 32 rows, this loop at ~25 GB/s, the host's read rate (docs/performance.md). Larger row
 * counts (prefill) stay with oneDNN, whose blocking wins there.
 *
 * The weights are packed once (pack_vnni in cpu_native.py) into AMX's B-tile layout, 1 KiB a tile:
 *   w [N / 16][K / 32][16 pairs of k][16 columns][2]   (N padded with zero columns to a multiple of 32)
 * so each tile is one load of contiguous memory and a pair of column blocks is two sequential streams. A work item
 * is a pair of 16-column blocks (split among the threads); for every 32 rows of x it runs the K loop with four
 * 16 x 16 float32 accumulator tiles (2 row tiles x 2 column blocks), two x tiles and two weight tiles, prefetching
 * the weight tiles four K steps ahead on the first 32 rows (later rows find them in L2). Rows past M are read
 * from a zero-padded copy of x's last rows. The accumulators are rounded to bfloat16 as torch rounds (nearest
 * even); the sums are float32 in another order than oneDNN's, so the last bits differ as between any two BLAS.
 *
 * linear_bf16_amx_silu is the MLP's gate_up projection with SiLU-and-mul in its store: its weight packed with the
 * gate's and the up projection's 16-column blocks taking turns (gate block j, then up block j: pair j), it writes
 * silu(gate) * up [M, N] where the plain matmul writes [M, 2N], each step rounded to bfloat16 as torch's separate
 * ops round (the products, SiLU in float32 from the rounded gate, the product with the rounded up); e^x is a
 * polynomial, not torch's Sleef, so a SiLU may differ from torch's in its last bit.
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
#define PREFETCH_TILES 4

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

/* gate (columns 0-15) and up (16-31) accumulators -> silu(gate) * up, 16 bf16 columns a row, as torch's ops round:
 * the matmul's bf16 outputs, SiLU in float32 of the rounded gate (x / (1 + e^-x), taken as x e^x / (1 + e^x) below
 * zero so that e^x's argument is never positive), rounded, times the rounded up, rounded. */
static void store_silu_mul(const float *acc, int rows, int cols, uint16_t *y, int64_t ldy) {
    for (int r = 0; r < rows; r++) {
        const v16 g = bf16_widen_v(bf16_round_v(loadv(acc + r * 32)));
        const v16 u = bf16_widen_v(bf16_round_v(loadv(acc + r * 32 + 16)));
        const i16v negative = g < splat(0.0f);
        const v16 t = vexp(select_v(negative, g, -g));  /* e^-|g| */
        const v16 silu = select_v(negative, g * t, g) / (splat(1.0f) + t);
        const u16x16 h = bf16_round_v(bf16_widen_v(bf16_round_v(silu)) * u);
        memcpy(y + r * ldy, &h, (cols < 16 ? cols : 16) * sizeof(uint16_t));
    }
}

/* x [M, K] bf16 rows ldx apart; w packed as above for n_padded (a multiple of 32) columns; y [M, N] bf16 rows ldy
 * apart (gated: N the up projection's columns, n_padded / 2 of them and more). K a multiple of 32. Returns 0; -1
 * where AMX is not compiled in; -2 for shapes it does not take; -3 where memory for the padded rows ran out. */
static int amx_matmul(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                      int64_t n_padded, uint16_t *y, int64_t ldy, int gated) {
    if (m < 1 || k < 32 || k % 32 || n < 1 || n_padded % 32 || n > (gated ? n_padded / 2 : n_padded) || ldx < k
        || ldy < n)
        return -2;
    const int64_t kb_count = k / 32, pairs = n_padded / 32, full = m / 32 * 32, tail = m - full;
    const int64_t out_cols = gated ? 16 : 32;  /* output columns a pair writes */
    uint16_t *padded = NULL;  /* the last partial 32 rows of x, zeros below */
    if (tail) {
        padded = calloc(32 * k, sizeof *padded);
        if (!padded)
            return -3;
        for (int64_t r = 0; r < tail; r++)
            memcpy(padded + r * k, x + (full + r) * ldx, k * sizeof *x);
    }
    #pragma omp parallel
    {
        configure_tiles();
        float acc[32 * 32];
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            const uint16_t *b0 = w + (2 * p) * kb_count * 512, *b1 = b0 + kb_count * 512;
            const int64_t cols = n - out_cols * p < out_cols ? n - out_cols * p : out_cols;
            for (int64_t m0 = 0; m0 < m && cols > 0; m0 += 32) {
                const uint16_t *a = m0 < full ? x + m0 * ldx : padded;
                const int64_t lda = m0 < full ? ldx : k;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kb = 0; kb < kb_count; kb++) {
                    if (m0 == 0 && kb + PREFETCH_TILES < kb_count) {
                        const char *f0 = (const char *)(b0 + (kb + PREFETCH_TILES) * 512);
                        const char *f1 = (const char *)(b1 + (kb + PREFETCH_TILES) * 512);
                        for (int line = 0; line < 1024; line += 64) {
                            _mm_prefetch(f0 + line, _MM_HINT_T0);
                            _mm_prefetch(f1 + line, _MM_HINT_T0);
                        }
                    }
                    _tile_loadd(4, a + kb * 32, lda * 2);
                    _tile_loadd(5, a + 16 * lda + kb * 32, lda * 2);
                    _tile_loadd(6, b0 + kb * 512, 64);
                    _tile_loadd(7, b1 + kb * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, acc, 128);
                _tile_stored(1, acc + 16, 128);
                _tile_stored(2, acc + 16 * 32, 128);
                _tile_stored(3, acc + 16 * 32 + 16, 128);
                const int rows = (int)(m - m0 < 32 ? m - m0 : 32);
                if (gated)
                    store_silu_mul(acc, rows, (int)cols, y + m0 * ldy + out_cols * p, ldy);
                else
                    store_rounded(acc, rows, (int)cols, y + m0 * ldy + out_cols * p, ldy);
            }
        }
        _tile_release();
    }
    free(padded);
    return 0;
}

int linear_bf16_amx(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                    int64_t n_padded, uint16_t *y, int64_t ldy) {
    return amx_matmul(x, ldx, m, k, w, n, n_padded, y, ldy, 0);
}

int linear_bf16_amx_silu(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                         int64_t n_padded, uint16_t *y, int64_t ldy) {
    return amx_matmul(x, ldx, m, k, w, n, n_padded, y, ldy, 1);
}

#else
int amx_enable(void) { return -1; }

int linear_bf16_amx(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                    int64_t n_padded, uint16_t *y, int64_t ldy) {
    (void)x; (void)ldx; (void)m; (void)k; (void)w; (void)n; (void)n_padded; (void)y; (void)ldy;
    return -1;
}

int linear_bf16_amx_silu(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                         int64_t n_padded, uint16_t *y, int64_t ldy) {
    return linear_bf16_amx(x, ldx, m, k, w, n, n_padded, y, ldy);
}
#endif
