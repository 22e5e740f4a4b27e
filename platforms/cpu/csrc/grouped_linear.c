/* Linear layers over grouped 8-bit and 4-bit weights (quantization/
 * grouped_weight.py's layout) on the CPU: platforms/cpu/grouped_linear.py.
 *
 * grouped_linear: y [M, N] = x [M, K] @ W.T + bias for decode-sized M. A
 * decode step is bound by how fast the weights stream from memory, and
 * these weights are a quarter (W8) or an eighth (W4) of float32's bytes.
 * Each output row's codes are read once per tile of MAX_TILE rows of x,
 * 16 at a time, and dequantized in registers: W8 widened to float32, then
 * w = code * scale + offset with one FMA (the group's scale and offset
 * broadcast; 16 inputs never straddle a group, since g is a multiple of
 * 16); W4 looked up in the group's table of its 16 values (one vpermps).
 * Then one FMA per row of x. So the dequantization is shared by the tile's
 * rows and an offset costs nothing extra. Sums are float32, the bias added before the one rounding to the
 * output dtype. Parallel over output rows on torch's OpenMP team.
 *
 * x is float32 (the wrapper converts bfloat16 once per call); out is
 * float32 (out_dtype 0) or bfloat16 (1); bias float32 or NULL; offsets
 * NULL means none (W8 only).
 *
 * W4 codes are in the kernel's own order (grouped_linear.py's prepack):
 * per row, per block of 32 inputs, byte j holds input j in its low nibble
 * and input 16 + j in its high one, so one 16-byte load widens to inputs
 * 0-15 (low nibbles) and 16-31 (high nibbles), both in element order.
 *
 * grouped_dequantize: W rows [n0, n1) into out [n1 - n0, K] (float32 or
 * bfloat16, rounded once), for the batched path's GEMM; W4 codes in the
 * canonical layout. Plain loops the compiler vectorises: no AVX-512 needed.
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernel_math.h"

#define ROW_BLOCK 16 /* output rows of one work item */
#define MAX_TILE 8   /* rows of x sharing one pass over a weight row */
#define X_CHUNK 4096 /* floats of x per pass over the rows: 16 KiB, in L1 */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_KERNEL 1

static inline __attribute__((always_inline)) void reduce_store(int tile, const __m512 *acc, const float *bias,
                                                               int64_t n, int64_t ldo, int out_dtype, void *out) {
    float b = bias ? bias[n] : 0.0f;
    for (int j = 0; j < MAX_TILE; j++) {
        if (j >= tile) break;
        float sum = _mm512_reduce_add_ps(acc[j]) + b;
        if (out_dtype)
            ((uint16_t *)out)[j * ldo + n] = f32_to_bf16(sum);
        else
            ((float *)out)[j * ldo + n] = sum;
    }
}

/* acc[j] += w * x[j][k .. k + 16) for the tile's rows. */
#define FMA_TILE(w, k)                                                                   \
    for (int j = 0; j < MAX_TILE; j++) {                                                 \
        if (j >= tile) break;                                                            \
        acc[j] = _mm512_fmadd_ps((w), _mm512_loadu_ps(x + j * ldx + (k)), acc[j]);      \
    }

/* Inputs [k0, k1) of one W8 row with `tile` rows of x, into acc; `tile`
 * is a constant where inlined. Groups split the range, so each 16 codes
 * share one broadcast scale and offset. */
static inline __attribute__((always_inline)) void chunk_w8(int tile, const int8_t *codes, const float *scales,
                                                           const float *offsets, int64_t group, int64_t k0,
                                                           int64_t k1, const float *x, int64_t ldx, __m512 *acc) {
    for (int64_t gi = k0 / group; gi * group < k1; gi++) {
        int64_t start = gi * group > k0 ? gi * group : k0, end = (gi + 1) * group < k1 ? (gi + 1) * group : k1;
        __m512 scale = _mm512_set1_ps(scales[gi]);
        __m512 offset = offsets ? _mm512_set1_ps(offsets[gi]) : _mm512_setzero_ps();
        for (int64_t k = start; k < end; k += 16) {
            __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + k)));
            __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(wide), scale, offset);
            FMA_TILE(w, k)
        }
    }
}

/* The 16 values a W4 group's codes stand for: table[c] = c * scale +
 * offset (one FMA on 0..15, the same rounding as dequantizing each code). */
static inline __m512 w4_table(float scale, float offset) {
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_fmadd_ps(codes, _mm512_set1_ps(scale), _mm512_set1_ps(offset));
}

/* 32 W4 codes (kernel order) at input k, dequantized by looking each code
 * up in its half's table: vpermps reads the low 4 bits of each 32-bit lane,
 * so the low nibble needs no mask and the high one one shift. */
#define W4_BLOCK(k, table_lo, table_hi)                                                           \
    do {                                                                                          \
        __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + (k) / 2))); \
        __m512 lo = _mm512_permutexvar_ps(bytes, table_lo);                                       \
        __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table_hi);                 \
        FMA_TILE(lo, k)                                                                           \
        FMA_TILE(hi, (k) + 16)                                                                    \
    } while (0)

/* Inputs [k0, k1) of one W4 row (k0, k1 multiples of 32), as chunk_w8. */
static inline __attribute__((always_inline)) void chunk_w4(int tile, const uint8_t *codes, const float *scales,
                                                           const float *offsets, int64_t group, int64_t k0,
                                                           int64_t k1, const float *x, int64_t ldx, __m512 *acc) {
    if (group == 16) { /* the two halves of a block are two groups */
        for (int64_t k = k0; k < k1; k += 32)
            W4_BLOCK(k, w4_table(scales[k / 16], offsets[k / 16]), w4_table(scales[k / 16 + 1], offsets[k / 16 + 1]));
        return;
    }
    for (int64_t gi = k0 / group; gi * group < k1; gi++) { /* group a multiple of 32 */
        int64_t start = gi * group > k0 ? gi * group : k0, end = (gi + 1) * group < k1 ? (gi + 1) * group : k1;
        __m512 table = w4_table(scales[gi], offsets[gi]);
        for (int64_t k = start; k < end; k += 32) W4_BLOCK(k, table, table);
    }
}

/* Output rows [n0, n1) (at most ROW_BLOCK) for rows [0, tile) of x: the
 * inputs in chunks of X_CHUNK / tile, so that the tile's chunk of x stays
 * in L1 while every row passes over it; the accumulators wait in memory
 * between chunks. (One row of x is a whole row of a model's weight: each
 * weight row is then read in one run, which the prefetcher follows best.) */
static inline __attribute__((always_inline)) void row_block(int tile, int bits, const void *codes,
                                                            const float *scales, const float *offsets,
                                                            int64_t group, int64_t K, int64_t N, int64_t n0,
                                                            int64_t n1, const float *x, const float *bias,
                                                            int out_dtype, void *out) {
    __m512 acc[ROW_BLOCK][MAX_TILE];
    int64_t groups = K / group;
    for (int64_t n = n0; n < n1; n++)
        for (int j = 0; j < MAX_TILE; j++) acc[n - n0][j] = _mm512_setzero_ps();
    const int64_t chunk = (X_CHUNK / tile) & ~(int64_t)31;
    for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        int64_t k1 = k0 + chunk < K ? k0 + chunk : K;
        for (int64_t n = n0; n < n1; n++) {
            const float *row_offsets = offsets ? offsets + n * groups : NULL;
            if (bits == 8)
                chunk_w8(tile, (const int8_t *)codes + n * K, scales + n * groups, row_offsets, group, k0, k1, x, K,
                         acc[n - n0]);
            else
                chunk_w4(tile, (const uint8_t *)codes + n * (K / 2), scales + n * groups, row_offsets, group, k0,
                         k1, x, K, acc[n - n0]);
        }
    }
    for (int64_t n = n0; n < n1; n++) reduce_store(tile, acc[n - n0], bias, n, N, out_dtype, out);
}

/* The tile size as a constant in each case, so the loops over it unroll. */
static void row_block_any(int tile, int bits, const void *codes, const float *scales, const float *offsets,
                          int64_t group, int64_t K, int64_t N, int64_t n0, int64_t n1, const float *x,
                          const float *bias, int out_dtype, void *out) {
#define CASE(t) \
    case t: row_block(t, bits, codes, scales, offsets, group, K, N, n0, n1, x, bias, out_dtype, out); break;
    switch (tile) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) }
#undef CASE
}

/* ---- int8 activations (grouped_linear_q8a; PAGEDLLM_CPU_GROUPED_INT8_ACTIVATIONS=1) ----
 * As llama.cpp's Q8_0 activations: each row of x quantized once per call in
 * blocks of 32, scale s = max|x| / 127 (float32), q = round-half-even(x / s)
 * (0 where s == 0). Each weight group's dot product is then an integer one
 * (vpdpbusd, 4 byte products a 32-bit lane), scaled in float32 per lane of 4
 * inputs: y += float(idot) * (s_w * s_a) + offset * s_a * sum(q). A 64-input
 * chunk's 16 lanes each lie in one group and one activation block when g is
 * 16, 32 or a multiple of 64 (K a multiple of 64); else the exact path runs.
 * W8 codes are signed: q + 128 as unsigned bytes, the accumulator starting at
 * -128 * sum(w) (one more vpdpbusd on ones, shared by the tile's rows). */
#if defined(__AVX512VNNI__)
#define HAVE_Q8A 1
#define Q8_BLOCK 32

typedef struct {
    const uint8_t *q;     /* [M, K] q + 128 (W8) or q as int8 bits (W4) */
    const float *scale;   /* [M, K / 4] the activation scale of each lane of 4 inputs */
    const float *sum;     /* [M, K / 4] s_a * (sum of the lane's 4 q) */
} Q8Rows;

/* Quantizes rows of x into the buffers behind `rows` (bias 128 for W8). */
static void quantize_rows(const float *x, int64_t M, int64_t K, int bias, uint8_t *q, float *scale, float *sum) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < K; b += Q8_BLOCK) {
            const float *xb = x + m * K + b;
            float amax = 0.0f;
            for (int i = 0; i < Q8_BLOCK; i++) amax = fmaxf(amax, fabsf(xb[i]));
            float s = amax / 127.0f;
            for (int i = 0; i < Q8_BLOCK; i += 4) {
                int lane_sum = 0;
                for (int t = 0; t < 4; t++) {
                    int v = s > 0.0f ? (int)nearbyintf(xb[i + t] / s) : 0;
                    lane_sum += v;
                    q[m * K + b + i + t] = (uint8_t)(v + bias);
                }
                scale[(m * K + b + i) / 4] = s;
                sum[(m * K + b + i) / 4] = s * (float)lane_sum;
            }
        }
}

/* The 16 lanes' weight scales (or offsets) of the chunk at input k. */
static inline __m512 lane_params(const float *p, int64_t group, int64_t k, __m512i idx) {
    if (group >= 64) return _mm512_set1_ps(p[k / group]);
    __mmask16 need = (__mmask16)((1u << (64 / group)) - 1);
    return _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(need, p + k / group));
}

/* 64 codes at input k as 64 unsigned bytes in input order. */
static inline __m512i chunk_bytes(int bits, const void *codes, int64_t k) {
    if (bits == 8) return _mm512_loadu_si512((const uint8_t *)codes + k);
    __m256i b = _mm256_loadu_si256((const __m256i *)((const uint8_t *)codes + k / 2));
    __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
    both = _mm512_and_si512(both, _mm512_set1_epi8(0x0F)); /* [lo A, lo B, hi A, hi B] */
    return _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
}

static inline __attribute__((always_inline)) void q8a_row(int tile, int bits, const void *codes, const float *scales,
                                                          const float *offsets, int64_t group, int64_t K,
                                                          Q8Rows rows, __m512i idx, __m512 *acc) {
    const __m512i ones = _mm512_set1_epi8(1);
    for (int j = 0; j < MAX_TILE; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 64) {
        __m512i w = chunk_bytes(bits, codes, k), start = _mm512_setzero_si512();
        if (bits == 8) start = _mm512_sub_epi32(start, _mm512_slli_epi32(_mm512_dpbusd_epi32(start, ones, w), 7));
        __m512 ws = lane_params(scales, group, k, idx);
        __m512 wo = offsets ? lane_params(offsets, group, k, idx) : _mm512_setzero_ps();
        for (int j = 0; j < MAX_TILE; j++) {
            if (j >= tile) break;
            __m512i qj = _mm512_loadu_si512(rows.q + j * K + k);
            __m512i d = bits == 8 ? _mm512_dpbusd_epi32(start, qj, w) : _mm512_dpbusd_epi32(start, w, qj);
            __m512 sa = _mm512_loadu_ps(rows.scale + (j * K + k) / 4);
            acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d), ws), sa, acc[j]);
            if (offsets) acc[j] = _mm512_fmadd_ps(wo, _mm512_loadu_ps(rows.sum + (j * K + k) / 4), acc[j]);
        }
    }
}

static inline __attribute__((always_inline)) void q8a_block(int tile, int bits, const void *codes, const float *scales, const float *offsets,
                      int64_t group, int64_t K, int64_t N, int64_t n0, int64_t n1, Q8Rows rows, const float *bias,
                      int out_dtype, void *out) {
    int64_t groups = K / group, row_bytes = bits == 8 ? K : K / 2;
    int32_t lane_group[16];
    for (int l = 0; l < 16; l++) lane_group[l] = group >= 64 ? 0 : (int32_t)(4 * l / group);
    __m512i idx = _mm512_loadu_si512(lane_group);
    __m512 acc[MAX_TILE];
    for (int64_t n = n0; n < n1; n++) {
        q8a_row(tile, bits, (const uint8_t *)codes + n * row_bytes, scales + n * groups,
                offsets ? offsets + n * groups : NULL, group, K, rows, idx, acc);
        reduce_store(tile, acc, bias, n, N, out_dtype, out);
    }
}

/* The tile size as a constant in each case, so the loops over it unroll. */
static void q8a_block_any(int tile, int bits, const void *codes, const float *scales, const float *offsets,
                          int64_t group, int64_t K, int64_t N, int64_t n0, int64_t n1, Q8Rows rows,
                          const float *bias, int out_dtype, void *out) {
#define CASE(t) \
    case t: q8a_block(t, bits, codes, scales, offsets, group, K, N, n0, n1, rows, bias, out_dtype, out); break;
    switch (tile) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) }
#undef CASE
}
#else
#define HAVE_Q8A 0
#endif
#else
#define HAVE_KERNEL 0
#endif

/* 1 when grouped_linear runs here (built with AVX-512 F/BW/VL). */
int grouped_linear_available(void) { return HAVE_KERNEL; }

/* See the top. Returns 0, or 1 when unavailable or the shape is off the
 * kernel's grid (the caller's torch path runs). */
int grouped_linear(int bits, const float *x, int64_t M, int64_t K, const void *codes, const float *scales,
                   const float *offsets, int64_t group, const float *bias, int64_t N, int out_dtype, void *out) {
#if HAVE_KERNEL
    if (group % 16 || K % group || K % 32 || (bits == 4 && !offsets) || (bits != 4 && bits != 8)) return 1;
    int64_t blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for schedule(static) if (blocks > 1 && N * K >= (1 << 16))
    for (int64_t block = 0; block < blocks; block++) {
        int64_t n1 = (block + 1) * ROW_BLOCK < N ? (block + 1) * ROW_BLOCK : N;
        for (int64_t m0 = 0; m0 < M; m0 += MAX_TILE) {
            int tile = M - m0 < MAX_TILE ? (int)(M - m0) : MAX_TILE;
            void *tile_out = out_dtype ? (void *)((uint16_t *)out + m0 * N) : (void *)((float *)out + m0 * N);
            row_block_any(tile, bits, codes, scales, offsets, group, K, N, block * ROW_BLOCK, n1, x + m0 * K, bias,
                          out_dtype, tile_out);
        }
    }
    return 0;
#else
    (void)bits, (void)x, (void)M, (void)K, (void)codes, (void)scales, (void)offsets, (void)group, (void)bias;
    (void)N, (void)out_dtype, (void)out;
    return 1;
#endif
}

/* Rows [n0, n1) of W as float32 (out_dtype 0) or bfloat16 (1), canonical codes. */
void grouped_dequantize(int bits, const void *codes, const float *scales, const float *offsets, int64_t group,
                        int64_t K, int64_t n0, int64_t n1, int out_dtype, void *out) {
    int64_t groups = K / group;
#pragma omp parallel for schedule(static) if ((n1 - n0) * K >= (1 << 16))
    for (int64_t n = n0; n < n1; n++) {
        float row[K];
        if (bits == 8) {
            const int8_t *c = (const int8_t *)codes + n * K;
#pragma omp simd
            for (int64_t k = 0; k < K; k++) row[k] = (float)c[k];
        } else {
            const uint8_t *c = (const uint8_t *)codes + n * (K / 2);
#pragma omp simd
            for (int64_t k = 0; k < K / 2; k++) {
                row[2 * k] = (float)(c[k] & 0xF);
                row[2 * k + 1] = (float)(c[k] >> 4);
            }
        }
        for (int64_t gi = 0; gi < groups; gi++) {
            float scale = scales[n * groups + gi], offset = offsets ? offsets[n * groups + gi] : 0.0f;
#pragma omp simd
            for (int64_t k = gi * group; k < (gi + 1) * group; k++) row[k] = row[k] * scale + offset;
        }
        if (out_dtype) {
            uint16_t *o = (uint16_t *)out + (n - n0) * K;
            int64_t k = 0;
#if HAVE_KERNEL
            for (; k + 16 <= K; k += 16) _mm256_storeu_si256((__m256i *)(o + k), bf16x16(_mm512_loadu_ps(row + k)));
#endif
            for (; k < K; k++) o[k] = f32_to_bf16(row[k]);
        } else {
            float *o = (float *)out + (n - n0) * K;
#pragma omp simd
            for (int64_t k = 0; k < K; k++) o[k] = row[k];
        }
    }
}

/* 1 when grouped_linear_q8a runs here (AVX-512 and AVX512-VNNI). */
int grouped_linear_q8a_available(void) { return HAVE_KERNEL && HAVE_Q8A; }

/* grouped_linear with int8 activations (see "int8 activations" above).
 * Returns 0, or 1 when unavailable or off its grid (g not 16, 32 or a
 * multiple of 64; K not a multiple of 64; M over MAX_TILE). */
int grouped_linear_q8a(int bits, const float *x, int64_t M, int64_t K, const void *codes, const float *scales,
                       const float *offsets, int64_t group, const float *bias, int64_t N, int out_dtype,
                       void *out) {
#if HAVE_KERNEL && HAVE_Q8A
    if (K % 64 || K % group || !(group == 16 || group == 32 || group % 64 == 0) || M > MAX_TILE || M < 1 ||
        (bits == 4 && !offsets) || (bits != 4 && bits != 8))
        return 1;
    uint8_t *q = malloc((size_t)(M * K));
    float *lanes = malloc(sizeof(float) * (size_t)(M * K / 2));
    if (!q || !lanes) {
        free(q), free(lanes);
        return 1;
    }
    quantize_rows(x, M, K, bits == 8 ? 128 : 0, q, lanes, lanes + M * K / 4);
    Q8Rows rows = {q, lanes, lanes + M * K / 4};
    int64_t blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
    int tile = (int)M;
#pragma omp parallel for schedule(static) if (blocks > 1 && N * K >= (1 << 16))
    for (int64_t block = 0; block < blocks; block++) {
        int64_t n1 = (block + 1) * ROW_BLOCK < N ? (block + 1) * ROW_BLOCK : N;
        q8a_block_any(tile, bits, codes, scales, offsets, group, K, N, block * ROW_BLOCK, n1, rows, bias,
                      out_dtype, out);
    }
    free(q), free(lanes);
    return 0;
#else
    (void)bits, (void)x, (void)M, (void)K, (void)codes, (void)scales, (void)offsets, (void)group, (void)bias;
    (void)N, (void)out_dtype, (void)out;
    return 1;
#endif
}
