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
 *
 * int8 weights (weight-only quantization: W = q * scale[n]) are packed the
 * same way, one byte an element, half the bytes to stream. Each K block's
 * two int8 tiles are widened to bfloat16 (exact: |q| <= 128) in L1 right
 * before their tile products, and each column's float32 sum is scaled once.
 * Loaded through ctypes; see platforms/cpu/amx_linear.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_amx.h"

#define RUN 32 /* output columns per work item: two B tiles */

/* Elements of the packed weight of N x K. */
int64_t amx_linear_packed_elements(int64_t n, int64_t k) { return (n + RUN - 1) / RUN * RUN * k; }

/* W [N, K] (elements of `elem` bytes, rows `ldw` elements apart) into the layout above. */
static void pack(const char *w, int64_t ldw, int64_t n, int64_t k, char *packed, int elem) {
    int64_t runs = (n + RUN - 1) / RUN, kblocks = k / 32;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < runs; j++)
        for (int64_t kb = 0; kb < kblocks; kb++) {
            char *tiles = packed + (j * kblocks + kb) * 2 * 512 * elem;
            for (int half = 0; half < 2; half++)
                for (int r = 0; r < 16; r++)
                    for (int c = 0; c < 16; c++) {
                        int64_t col = j * RUN + half * 16 + c, kk = kb * 32 + 2 * r;
                        char *dst = tiles + (half * 512 + r * 32 + c * 2) * elem;
                        if (col < n)
                            memcpy(dst, w + (col * ldw + kk) * elem, 2 * (size_t)elem);
                        else
                            memset(dst, 0, 2 * (size_t)elem);
                    }
        }
}

void amx_linear_pack(const uint16_t *w, int64_t ldw, int64_t n, int64_t k, uint16_t *packed) {
    pack((const char *)w, ldw, n, k, (char *)packed, 2);
}

void amx_linear_pack_int8(const int8_t *q, int64_t ldq, int64_t n, int64_t k, int8_t *packed) {
    pack((const char *)q, ldq, n, k, (char *)packed, 1);
}

/* 1 where the kernel runs: built for AMX, and Linux lets this process use the tiles. */
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

/* Two int8 B tiles (1024 bytes) as bfloat16 tiles in out: exact, |q| <= 128. */
static inline void widen_tiles(const int8_t *q, uint16_t *out) {
    for (int i = 0; i < 1024; i += 32) {
        __m256i bytes = _mm256_loadu_si256((const __m256i *)(q + i));
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
        _mm512_store_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* One run's sums for `rows` (1-32) x rows from x, into y, times scale
 * (NULL: 1), plus bias (NULL: 0). */
static void run_rows(const uint16_t *x, int64_t ldx, const void *packed, int elem, const float *scale,
                     const float *bias, uint16_t *y, int64_t ldy, int rows, int64_t cols, int64_t kblocks) {
    uint16_t widened[2][1024] __attribute__((aligned(64))); /* int8 tiles as bf16, alternating */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < kblocks; kb++) {
        const uint16_t *b = (const uint16_t *)packed + kb * 1024;
        if (elem == 1) {
            widen_tiles((const int8_t *)packed + kb * 1024, widened[kb & 1]);
            b = widened[kb & 1];
        }
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
    __m512 scale0 = scale ? _mm512_maskz_loadu_ps(m0, scale) : _mm512_set1_ps(1.0f);
    __m512 scale1 = scale ? _mm512_maskz_loadu_ps(m1, scale + 16) : _mm512_set1_ps(1.0f);
    for (int r = 0; r < rows; r++) {
        __m256bh lo = _mm512_cvtneps_pbh(_mm512_fmadd_ps(_mm512_load_ps(&sums[r][0]), scale0, bias0));
        __m256bh hi = _mm512_cvtneps_pbh(_mm512_fmadd_ps(_mm512_load_ps(&sums[r][16]), scale1, bias1));
        _mm256_mask_storeu_epi16(y + r * ldy, m0, (__m256i)lo);
        if (m1) _mm256_mask_storeu_epi16(y + r * ldy + 16, m1, (__m256i)hi);
    }
}

/* The runs over torch's OpenMP team; elem 2: bfloat16 tiles, 1: int8 tiles
 * (widened to bfloat16 in L1 a K block at a time, between the tile products). */
static void linear_runs(const uint16_t *x, int64_t ldx, const char *packed, int elem, const float *scale,
                        const float *bias, uint16_t *y, int64_t ldy, int64_t m, int64_t n, int64_t k) {
    int64_t runs = (n + RUN - 1) / RUN, kblocks = k / 32;
#pragma omp parallel if (runs > 1)
    {
        int configured = 0;
#pragma omp for schedule(static)
        for (int64_t j = 0; j < runs; j++) {
            int64_t cols = n - j * RUN < RUN ? n - j * RUN : RUN;
            for (int64_t r0 = 0; r0 < m; r0 += 32) {
                int rows = m - r0 < 32 ? (int)(m - r0) : 32;
                if (configured != rows) configure(rows), configured = rows;
                run_rows(x + r0 * ldx, ldx, packed + j * kblocks * 1024 * elem, elem, scale ? scale + j * RUN : NULL,
                         bias ? bias + j * RUN : NULL, y + r0 * ldy + j * RUN, ldy, rows, cols, kblocks);
            }
        }
        if (configured) _tile_release();
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
    linear_runs(x, ldx, (const char *)packed, 2, NULL, bias, y, ldy, m, n, k);
    return 0;
#else
    (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)m, (void)n, (void)k;
    return -1;
#endif
}

/* The same with int8 weights packed by amx_linear_pack_int8: y = (x . q^T)
 * * scale + bias, scale float32 [N]. */
int amx_linear_int8(const uint16_t *x, int64_t ldx, const int8_t *packed, const float *scale, const float *bias,
                    uint16_t *y, int64_t ldy, int64_t m, int64_t n, int64_t k) {
#if HAVE_AMX
    if (k % 32 || k <= 0 || !amx_permitted()) return -1;
    linear_runs(x, ldx, (const char *)packed, 1, scale, bias, y, ldy, m, n, k);
    return 0;
#else
    (void)x, (void)ldx, (void)packed, (void)scale, (void)bias, (void)y, (void)ldy, (void)m, (void)n, (void)k;
    return -1;
#endif
}
