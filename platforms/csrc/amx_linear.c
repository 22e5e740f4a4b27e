/* bfloat16 linear layers on AMX tiles, for the few-row GEMMs of decode.
 *
 * y[M, N] = x[M, K] . W[N, K]^T (+ bias), bfloat16 in and out, float32
 * accumulation (AMX multiplies bf16 pairs exactly and sums in float32), one
 * rounding to bfloat16 at the end (to nearest even, like oneDNN and torch).
 *
 * At decode a linear layer reads its whole weight to multiply a few rows:
 * the step is bound by how fast the weights stream from memory. The weight is
 * packed once, at load, into the tiles' own layout (amx_linear_pack), so a
 * thread streams one contiguous run of 1 KB tiles per 32 output columns, and
 * a step's ~50 calls cost little beyond that stream. Columns are shared out
 * in runs of 32 over torch's OpenMP team (the library links the libgomp torch
 * has loaded); rows go 32 at a time, each run's weight tiles staying in L2
 * while further row chunks reuse them.
 *
 * Packed layout: for column run j (columns 32j .. 32j + 31, zero past N) and
 * K block kb (32 of K): two 16 x 64-byte B tiles, the first for columns
 * 32j .. 32j + 15, each row r of a tile holding (W[n][32kb + 2r],
 * W[n][32kb + 2r + 1]) for its 16 columns n. K must be a multiple of 32.
 * Loaded through ctypes; see platforms/cpu_amx_linear.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_amx.h"

#define RUN 32 /* output columns per work item: two B tiles */

/* Bytes of the packed weight of N x K. */
int64_t amx_linear_packed_bytes(int64_t n, int64_t k) { return (n + RUN - 1) / RUN * RUN * k * 2; }

/* W [N, K] bf16, rows `ldw` elements apart, into the layout above. */
void amx_linear_pack(const uint16_t *w, int64_t ldw, int64_t n, int64_t k, uint16_t *packed) {
    int64_t runs = (n + RUN - 1) / RUN, kblocks = k / 32;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < runs; j++)
        for (int64_t kb = 0; kb < kblocks; kb++) {
            uint16_t *tiles = packed + (j * kblocks + kb) * 2 * 512;
            for (int half = 0; half < 2; half++)
                for (int r = 0; r < 16; r++)
                    for (int c = 0; c < 16; c++) {
                        int64_t col = j * RUN + half * 16 + c, kk = kb * 32 + 2 * r;
                        uint16_t *dst = tiles + half * 512 + r * 32 + c * 2;
                        dst[0] = col < n ? w[col * ldw + kk] : 0;
                        dst[1] = col < n ? w[col * ldw + kk + 1] : 0;
                    }
        }
}

int amx_linear_available(void) {
#if HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

#if HAVE_AMX
/* Tiles: 0-3 the float32 sums (rows 0-15 / 16-31 x columns 0-15 / 16-31 of
 * the run), 4-5 the x rows' A tiles, 6-7 the run's two B tiles. */
static void configure(int rows) {
    tile_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    int lo = rows < 16 ? rows : 16, hi = rows - lo;
    int tile_rows[8] = {lo, lo, hi, hi, lo, hi, 16, 16};
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = (uint8_t)(tile_rows[t] ? tile_rows[t] : 1);
    _tile_loadconfig(&cfg);
}

/* One run's sums for `rows` (1-32) x rows from x, into y with bias. */
static void run_rows(const uint16_t *x, int64_t ldx, const uint16_t *b, const float *bias, uint16_t *y,
                     int64_t ldy, int rows, int64_t cols, int64_t kblocks) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < kblocks; kb++, b += 1024) {
        _tile_loadd(4, x + kb * 32, ldx * 2);
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (rows > 16) {
            _tile_loadd(5, x + 16 * ldx + kb * 32, ldx * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    float sums[32][32] __attribute__((aligned(64)));
    _tile_stored(0, &sums[0][0], 128);
    _tile_stored(1, &sums[0][16], 128);
    if (rows > 16) {
        _tile_stored(2, &sums[16][0], 128);
        _tile_stored(3, &sums[16][16], 128);
    }
    __mmask16 m0 = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    __mmask16 m1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    __m512 bias0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    __m512 bias1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        __m256bh lo = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(&sums[r][0]), bias0));
        __m256bh hi = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(&sums[r][16]), bias1));
        _mm256_mask_storeu_epi16(y + r * ldy, m0, (__m256i)lo);
        if (m1) _mm256_mask_storeu_epi16(y + r * ldy + 16, m1, (__m256i)hi);
    }
}
#endif

/* y [M, N] (rows ldy apart) = x [M, K] (rows ldx apart) . W^T + bias, W
 * packed by amx_linear_pack; bias: float32 [N] or NULL. Returns 0, or -1
 * where AMX is unavailable or K is not a multiple of 32. */
int amx_linear(const uint16_t *x, int64_t ldx, const uint16_t *packed, const float *bias, uint16_t *y, int64_t ldy,
               int64_t m, int64_t n, int64_t k) {
#if HAVE_AMX
    if (k % 32 || k <= 0 || !amx_permitted()) return -1;
    int64_t runs = (n + RUN - 1) / RUN, kblocks = k / 32;
#pragma omp parallel if (runs > 1)
    {
        int configured = 0;
#pragma omp for schedule(static)
        for (int64_t j = 0; j < runs; j++) {
            const uint16_t *b = packed + j * kblocks * 1024;
            int64_t cols = n - j * RUN < RUN ? n - j * RUN : RUN;
            for (int64_t r0 = 0; r0 < m; r0 += 32) {
                int rows = m - r0 < 32 ? (int)(m - r0) : 32;
                if (configured != rows) configure(rows), configured = rows;
                run_rows(x + r0 * ldx, ldx, b, bias ? bias + j * RUN : NULL, y + r0 * ldy + j * RUN, ldy, rows,
                         cols, kblocks);
            }
        }
        if (configured) _tile_release();
    }
    return 0;
#else
    (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)m, (void)n, (void)k;
    return -1;
#endif
}
