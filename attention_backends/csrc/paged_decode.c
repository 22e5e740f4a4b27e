/* Paged attention for decode rows (one query token per request) on the CPU.
 *
 * Reads each request's keys and values straight from the paged cache through
 * its block table: nothing is gathered into a padded copy, and a request
 * reads only its own keys. Scores, softmax and the weighted sum of values are
 * in float32 whatever the storage dtype (float32 or bfloat16), like
 * torch's SDPA CPU kernel (bf16 scores: exact bf16 products summed in
 * float32). Two implementations: AVX-512 (with AVX512-BF16's dot product
 * where the CPU has it) when the compiler targets it (-march=native), and a
 * portable C loop the compiler vectorises as it can. Loaded through ctypes (no Python or torch headers),
 * so building it takes a C compiler and well under a second; see
 * attention_backends/cpu_decode_kernel.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernel_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

#define MAX_HEAD_SIZE 512
#define MAX_QUERY_LEN 64 /* rows per request (a verify step: 1 + drafts) */

#if !HAVE_AVX512 /* the portable kernel */
/* Each query head's scores [n] -> softmax probabilities, in place. sinks
 * (NULL: none): head h's extra logit, in the softmax, its probability dropped. */
static void softmax_rows(float *scores, int num_heads, int64_t n, const float *sinks) {
    for (int h = 0; h < num_heads; h++) {
        float *sh = scores + h * n, m = sinks ? sinks[h] : -INFINITY, sum = 0.0f;
        for (int64_t i = 0; i < n; i++) m = sh[i] > m ? sh[i] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) {
            sh[i] = exp_clamped(sh[i] - m);
            sum += sh[i];
        }
        if (sinks) sum += exp_clamped(sinks[h] - m);
        float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) sh[i] *= inv;
    }
}

/* The portable kernel. One request: every query head attends over keys [start, len).
 * Tokens are the outer loop and heads the inner one, so that K and V are read
 * in cache order, all KV heads of a slot together (a pass per KV head re-read
 * each slot's cache lines from memory: 1.1x slower than gather + SDPA in the
 * engine, where the cache does not stay in L3 between layers). HS is the head
 * size: a constant for the common sizes, so the dot products unroll. */
#define DEFINE_ATTEND(NAME, T, LOAD, HS)                                                                   \
    static void NAME(const float *q, /* [num_heads][head_size], already scaled */                         \
                     const T *k_cache, const T *v_cache, int64_t stride_slot, const int32_t *blocks,       \
                     int block_size, int64_t start, int64_t len, int num_heads, int num_kv_heads,          \
                     int head_size, float soft_cap, const int *kv_head, /* of each query head */        \
                     const float *sinks, /* [num_heads] or NULL */                                       \
                     float *scores, /* [num_heads][len - start] */                                        \
                     float *out /* [num_heads][head_size] */) {                                           \
        const int hs = HS;                                                                                 \
        const int64_t n = len - start;                                                                     \
        (void)head_size, (void)num_kv_heads;                                                               \
        for (int64_t b = start / block_size; b * block_size < len; b++) {                  \
            int64_t t0 = b * block_size > start ? b * block_size : start;                                  \
            int64_t t1 = (b + 1) * block_size < len ? (b + 1) * block_size : len;                          \
            const T *k = k_cache + ((int64_t)blocks[b] * block_size + (t0 - b * block_size)) * stride_slot; \
            for (int64_t t = t0; t < t1; t++, k += stride_slot) {                                          \
                for (int h = 0; h < num_heads; h++) {                                                      \
                    const float *qh = q + (int64_t)h * hs;                                                 \
                    const T *kh = k + (int64_t)kv_head[h] * hs;                                            \
                    float acc = 0.0f;                                                                      \
                    _Pragma("omp simd reduction(+ : acc)") for (int d = 0; d < hs; d++) acc +=             \
                        qh[d] * LOAD(kh[d]);                                                               \
                    if (soft_cap > 0.0f) acc = soft_cap * tanhf(acc / soft_cap);                           \
                    scores[h * n + (t - start)] = acc;                                                     \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        softmax_rows(scores, num_heads, n, sinks);                                                         \
        memset(out, 0, sizeof(float) * (size_t)num_heads * (size_t)hs);                                    \
        for (int64_t b = start / block_size; b * block_size < len; b++) {                                  \
            int64_t t0 = b * block_size > start ? b * block_size : start;                                  \
            int64_t t1 = (b + 1) * block_size < len ? (b + 1) * block_size : len;                          \
            const T *v = v_cache + ((int64_t)blocks[b] * block_size + (t0 - b * block_size)) * stride_slot; \
            for (int64_t t = t0; t < t1; t++, v += stride_slot) {                                          \
                for (int h = 0; h < num_heads; h++) {                                                      \
                    float p = scores[h * n + (t - start)];                                                 \
                    float *o = out + (int64_t)h * hs;                                                      \
                    const T *vh = v + (int64_t)kv_head[h] * hs;                                            \
                    _Pragma("omp simd") for (int d = 0; d < hs; d++) o[d] += p * LOAD(vh[d]);              \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
    }
#endif

#if HAVE_AVX512
#include <immintrin.h>
/* The AVX-512 kernel: keys and values are read CHUNK tokens at a time, the
 * next chunks prefetched (prefetch_rows).
 *
 * Scores: a query head's dot products with 16 keys go into 16 vector
 * accumulators, reduced together into one vector of 16 scores (sum16): the
 * per-token horizontal sum (_mm512_reduce_add_ps, ~8 dependent shuffles and
 * adds per token and head) was most of the old kernel's score time. The 16
 * key rows stay in L1 while every query head of their KV head group uses them.
 * Weighted sum: the query heads of a KV head group (up to 4 at a time) and 64
 * head dims stay in registers over the chunk's 16 tokens, so each value row
 * is loaded and converted to float32 once per group instead of once per head,
 * and the float32 accumulators are not reloaded and stored per token. */
#define CHUNK 16

/* Lane i of the result is the sum of a[i]'s 16 lanes: a transpose-and-add
 * tree, 45 shuffles and adds for 16 sums. */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 a[CHUNK]) {
    __m512 b[8], c[4], d[2];
    for (int k = 0; k < 8; k++) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] */
        b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    for (int k = 0; k < 4; k++) { /* per 128-bit lane: the lane's sum of a[4k .. 4k+3] */
        __m512d x = _mm512_castps_pd(b[2 * k]), y = _mm512_castps_pd(b[2 * k + 1]);
        c[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int k = 0; k < 2; k++) /* 128-bit lanes: sums of lanes 0+1 and 2+3 of a[8k .. 8k+3], then a[8k+4 ..] */
        d[k] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xdd));
}

/* Cache rows of tokens [t0, t0 + nt) of a request, in bytes from `cache`;
 * the rows past nt repeat the first, so that a short chunk's loads stay in
 * the request's memory (their lanes are never stored). */
static inline void chunk_rows(const char *cache, int64_t slot_bytes, const int32_t *blocks, int block_size,
                              int64_t t0, int nt, const char *rows[CHUNK]) {
    int64_t b = t0 / block_size, off = t0 - b * block_size;
    for (int i = 0; i < nt; i++) {
        rows[i] = cache + ((int64_t)blocks[b] * block_size + off) * slot_bytes;
        if (++off == block_size) off = 0, b++;
    }
    for (int i = nt; i < CHUNK; i++) rows[i] = rows[0];
}

/* prefetcht1 as volatile asm: GCC 12 deleted the loops of _mm_prefetch below
 * as loops without side effects. */
static inline void prefetch_l2(const char *p) { __asm__ volatile("prefetcht1 %0" : : "m"(*p)); }

/* Asks for tokens [t0, t0 + nt)'s rows (row_bytes each) in L2 ahead of use.
 * In the engine the cache is cold (the other layers' weights and caches ran
 * through since this layer's last step) and a request's blocks are scattered
 * 8 KB pieces (block 16, 4 KV heads of 64 bf16): without it the 100M model's
 * layer call took 1.06-1.08x as long as with two chunks ahead (one, four and
 * eight were no better; neither was prefetching the next request's first
 * chunks). */
static inline void prefetch_rows(const char *cache, int64_t slot_bytes, const int32_t *blocks, int block_size,
                                 int64_t t0, int nt, int64_t row_bytes) {
    int64_t b = t0 / block_size, off = t0 - b * block_size;
    for (int i = 0; i < nt; i++) {
        const char *row = cache + ((int64_t)blocks[b] * block_size + off) * slot_bytes;
        for (int64_t o = 0; o < row_bytes; o += 64) prefetch_l2(row + o);
        if (++off == block_size) off = 0, b++;
    }
}

#ifndef PREFETCH_CHUNKS
#define PREFETCH_CHUNKS 2 /* how far ahead, in chunks */
#endif
/* Prefetches chunk t0's rows if t0 < len. */
static inline void prefetch_chunk(const char *cache, int64_t slot_bytes, const int32_t *blocks, int block_size,
                                  int64_t t0, int64_t len, int64_t row_bytes) {
    if (t0 < len)
        prefetch_rows(cache, slot_bytes, blocks, block_size, t0, len - t0 < CHUNK ? (int)(len - t0) : CHUNK, row_bytes);
}

/* softmax_rows in AVX-512: the compiler left the max and the exps scalar,
 * and they took as long as the scores and the weighted sum together. */
static void softmax_rows16(float *scores, int num_heads, int64_t n, const float *sinks) {
    for (int h = 0; h < num_heads; h++) {
        float *sh = scores + h * n;
        __m512 m = _mm512_set1_ps(sinks ? sinks[h] : -INFINITY), sum = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) m = _mm512_mask_max_ps(m, mask16(n - i), m, _mm512_maskz_loadu_ps(mask16(n - i), sh + i));
        const float max_score = _mm512_reduce_max_ps(m);
        __m512 mx = _mm512_set1_ps(max_score);
        for (int64_t i = 0; i < n; i += 16) {
            __mmask16 k = mask16(n - i);
            __m512 e = exp16_clamped(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sh + i), mx));
            sum = _mm512_mask_add_ps(sum, k, sum, e);
            _mm512_mask_storeu_ps(sh + i, k, e);
        }
        float total = _mm512_reduce_add_ps(sum) + (sinks ? exp_clamped(sinks[h] - max_score) : 0.0f);
        __m512 inv = _mm512_set1_ps(1.0f / total);
        for (int64_t i = 0; i < n; i += 16)
            _mm512_mask_storeu_ps(sh + i, mask16(n - i), _mm512_mul_ps(_mm512_maskz_loadu_ps(mask16(n - i), sh + i), inv));
    }
}

/* 16 storage elements as float32 (bfloat16 -> float32 is exact: a shift). */
static inline __attribute__((always_inline)) __m512 load16(const char *p, int bf16, __mmask16 m) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
    return _mm512_maskz_loadu_ps(m, p);
}

/* q . k for the 16 rows, float32 products: qf is the scaled float32 query head. */
static inline __attribute__((always_inline)) __m512 qk_fma(const float *qf, const char *const rows[CHUNK],
                                                           int64_t off, int hs, int bf16) {
    __m512 acc[CHUNK];
    int elt = bf16 ? 2 : 4;
    for (int i = 0; i < CHUNK; i++) acc[i] = _mm512_setzero_ps();
    for (int d = 0; d < hs; d += 16) {
        __mmask16 m = mask16(hs - d);
        __m512 qv = _mm512_maskz_loadu_ps(m, qf + d);
#pragma GCC unroll 16
        for (int i = 0; i < CHUNK; i++)
            acc[i] = _mm512_fmadd_ps(qv, load16(rows[i] + off + (int64_t)d * elt, bf16, m), acc[i]);
    }
    return sum16(acc);
}

#if defined(__AVX512BF16__)
/* q . k for the 16 rows with AVX512-BF16's dot product: bf16 pairs multiplied
 * exactly and summed in float32, 32 values an instruction, from the query as
 * it is (the caller scales the sums). Masked loads: past the head size, a
 * key's neighbour in memory may be NaN, and 0 * NaN is NaN. */
static inline __attribute__((always_inline)) __m512 qk_dpbf16(const uint16_t *q, const char *const rows[CHUNK],
                                                              int64_t off, int hs) {
    __m512 acc[CHUNK];
    for (int i = 0; i < CHUNK; i++) acc[i] = _mm512_setzero_ps();
    for (int d = 0; d < hs; d += 32) {
        __mmask32 m = hs - d >= 32 ? 0xffffffffu : (1u << (hs - d)) - 1;
        __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(m, q + d);
#pragma GCC unroll 16
        for (int i = 0; i < CHUNK; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], qv, (__m512bh)_mm512_maskz_loadu_epi16(m, rows[i] + off + 2 * (int64_t)d));
    }
    return sum16(acc);
}
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

/* Scores of every query head for keys [start, len) into scores[h][t - start]. */
static inline __attribute__((always_inline)) void qk_pass(int bf16, const void *q, const float *qf, float scale,
                                                          const char *k_cache, int64_t slot_bytes,
                                                          const int32_t *blocks, int block_size, int64_t start,
                                                          int64_t len, int num_heads, int group, int hs,
                                                          float *scores) {
    const int64_t n = len - start, elt = bf16 ? 2 : 4, row_bytes = (int64_t)(num_heads / group) * hs * elt;
    const char *rows[CHUNK];
    for (int64_t t = start; t < start + PREFETCH_CHUNKS * CHUNK; t += CHUNK)
        prefetch_chunk(k_cache, slot_bytes, blocks, block_size, t, len, row_bytes);
    for (int64_t t0 = start; t0 < len; t0 += CHUNK) {
        int nt = len - t0 < CHUNK ? (int)(len - t0) : CHUNK;
        prefetch_chunk(k_cache, slot_bytes, blocks, block_size, t0 + PREFETCH_CHUNKS * CHUNK, len, row_bytes);
        chunk_rows(k_cache, slot_bytes, blocks, block_size, t0, nt, rows);
        for (int h = 0; h < num_heads; h++) {
            int64_t off = (int64_t)(h / group) * hs * elt;
            __m512 s;
#if HAVE_BF16_DOT
            if (bf16)
                s = _mm512_mul_ps(qk_dpbf16((const uint16_t *)q + (int64_t)h * hs, rows, off, hs), _mm512_set1_ps(scale));
            else
#endif
                s = qk_fma(qf + (int64_t)h * hs, rows, off, hs, bf16);
            (void)q, (void)scale;
            _mm512_mask_storeu_ps(scores + h * n + (t0 - start), mask16(nt), s);
        }
    }
}

/* out[h][d0 .. d0+64) += sum over the chunk's nt tokens of p[h][i] * v_i, for
 * HT query heads of one KV head group; off: the KV head's dim d0 in a row. */
static inline __attribute__((always_inline)) void pv_tile(const int HT, int bf16, float *out, int hs,
                                                          const float *p, int64_t n, const char *const rows[CHUNK],
                                                          int64_t off, int nt, int dims) {
    const int elt = bf16 ? 2 : 4;
    __mmask16 m[4];
    __m512 acc[4][4];
    for (int c = 0; c < 4; c++) m[c] = mask16(dims - 16 * c);
    for (int h = 0; h < HT; h++)
        for (int c = 0; c < 4; c++) acc[h][c] = _mm512_maskz_loadu_ps(m[c], out + (int64_t)h * hs + 16 * c);
    for (int i = 0; i < nt; i++) {
        __m512 v[4];
        for (int c = 0; c < 4; c++) v[c] = load16(rows[i] + off + (int64_t)16 * c * elt, bf16, m[c]);
        for (int h = 0; h < HT; h++) {
            __m512 pb = _mm512_set1_ps(p[h * n + i]);
            for (int c = 0; c < 4; c++) acc[h][c] = _mm512_fmadd_ps(pb, v[c], acc[h][c]);
        }
    }
    for (int h = 0; h < HT; h++)
        for (int c = 0; c < 4; c++) _mm512_mask_storeu_ps(out + (int64_t)h * hs + 16 * c, m[c], acc[h][c]);
}

static inline __attribute__((always_inline)) void pv_pass(int bf16, const char *v_cache, int64_t slot_bytes,
                                                          const int32_t *blocks, int block_size, int64_t start,
                                                          int64_t len, int num_heads, int group, int hs,
                                                          const float *scores, float *out) {
    const int64_t n = len - start, elt = bf16 ? 2 : 4, row_bytes = (int64_t)(num_heads / group) * hs * elt;
    const char *rows[CHUNK];
    memset(out, 0, sizeof(float) * (size_t)num_heads * (size_t)hs);
    for (int64_t t0 = start; t0 < len; t0 += CHUNK) {
        int nt = len - t0 < CHUNK ? (int)(len - t0) : CHUNK;
        prefetch_chunk(v_cache, slot_bytes, blocks, block_size, t0 + PREFETCH_CHUNKS * CHUNK, len, row_bytes);
        chunk_rows(v_cache, slot_bytes, blocks, block_size, t0, nt, rows);
        for (int h0 = 0, ht; h0 < num_heads; h0 += ht) {
            ht = group - h0 % group < 4 ? group - h0 % group : 4; /* heads left in h0's group, at most 4 */
            const float *p = scores + h0 * n + (t0 - start);
            for (int d0 = 0; d0 < hs; d0 += 64) {
                float *o = out + (int64_t)h0 * hs + d0;
                int64_t off = ((int64_t)(h0 / group) * hs + d0) * elt;
                int dims = hs - d0 < 64 ? hs - d0 : 64;
                switch (ht) {
                case 1: pv_tile(1, bf16, o, hs, p, n, rows, off, nt, dims); break;
                case 2: pv_tile(2, bf16, o, hs, p, n, rows, off, nt, dims); break;
                case 3: pv_tile(3, bf16, o, hs, p, n, rows, off, nt, dims); break;
                default: pv_tile(4, bf16, o, hs, p, n, rows, off, nt, dims); break;
                }
            }
        }
    }
}

/* Folded rows (see paged_decode): head h is query row (h % group) / (group /
 * rows) of its request, which sees keys [max(start, its len - window), its
 * len), its len being len - (rows - 1 - row). The scores of the keys it does
 * not see become `value`: -inf before the softmax, 0 after it (exp clamps). */
static void mask_folded_rows(float *scores, int num_heads, int group, int rows, int64_t start, int64_t len,
                             int64_t window, float value) {
    const int64_t n = len - start;
    const int per_row = group / rows;
    for (int h = 0; h < num_heads; h++) {
        int row = (h % group) / per_row;
        int64_t row_len = len - (rows - 1 - row);
        int64_t row_start = window > 0 && row_len > window ? row_len - window : 0;
        float *sh = scores + (int64_t)h * n;
        for (int64_t t = start; t < row_start && t < len; t++) sh[t - start] = value;
        for (int64_t t = row_len > start ? row_len : start; t < len; t++) sh[t - start] = value;
    }
}

/* One request, every query head over keys [start, len): scores, soft cap,
 * softmax, weighted sum of values; `rows` > 1: folded rows (see
 * paged_decode), each masked to its own keys. HS and BF16 are constants at
 * the call sites below, so the common head sizes' loops unroll. */
static inline __attribute__((always_inline)) void attend_vec(int bf16, const void *q, const float *qf, float scale,
                                                             const void *k_cache, const void *v_cache,
                                                             int64_t stride_slot, const int32_t *blocks,
                                                             int block_size, int64_t start, int64_t len,
                                                             int num_heads, int group, int hs, float soft_cap,
                                                             int rows, int64_t window, const float *sinks,
                                                             float *scores, float *out) {
    const int64_t n = len - start, slot_bytes = stride_slot * (bf16 ? 2 : 4);
    const int64_t row_bytes = (int64_t)(num_heads / group) * hs * (bf16 ? 2 : 4);
    qk_pass(bf16, q, qf, scale, k_cache, slot_bytes, blocks, block_size, start, len, num_heads, group, hs, scores);
    /* the values' first chunks arrive during the softmax */
    for (int64_t t = start; t < start + PREFETCH_CHUNKS * CHUNK; t += CHUNK)
        prefetch_chunk(v_cache, slot_bytes, blocks, block_size, t, len, row_bytes);
    if (soft_cap > 0.0f)
        for (int64_t i = 0; i < (int64_t)num_heads * n; i++) scores[i] = soft_cap * tanhf(scores[i] / soft_cap);
    if (rows > 1) mask_folded_rows(scores, num_heads, group, rows, start, len, window, -INFINITY);
    softmax_rows16(scores, num_heads, n, sinks);
    if (rows > 1) mask_folded_rows(scores, num_heads, group, rows, start, len, window, 0.0f);
    pv_pass(bf16, v_cache, slot_bytes, blocks, block_size, start, len, num_heads, group, hs, scores, out);
}

typedef void (*attend_vec_fn)(const void *, const float *, float, const void *, const void *, int64_t,
                              const int32_t *, int, int64_t, int64_t, int, int, int, float, int, int64_t,
                              const float *, float *, float *);

#define DEFINE_ATTEND_VEC(NAME, BF16, HS)                                                                  \
    static void NAME(const void *q, const float *qf, float scale, const void *k_cache, const void *v_cache, \
                     int64_t stride_slot, const int32_t *blocks, int block_size, int64_t start, int64_t len, \
                     int num_heads, int group, int head_size, float soft_cap, int rows, int64_t window,     \
                     const float *sinks, float *scores, float *out) {                                      \
        (void)head_size;                                                                                   \
        attend_vec(BF16, q, qf, scale, k_cache, v_cache, stride_slot, blocks, block_size, start, len,       \
                   num_heads, group, HS, soft_cap, rows, window, sinks, scores, out);                      \
    }
DEFINE_ATTEND_VEC(attend_vec_f32, 0, head_size)
DEFINE_ATTEND_VEC(attend_vec_bf16, 1, head_size)
DEFINE_ATTEND_VEC(attend_vec_f32_64, 0, 64)
DEFINE_ATTEND_VEC(attend_vec_bf16_64, 1, 64)
DEFINE_ATTEND_VEC(attend_vec_f32_128, 0, 128)
DEFINE_ATTEND_VEC(attend_vec_bf16_128, 1, 128)

static attend_vec_fn pick_attend_vec(int dtype, int head_size) {
    if (head_size == 64) return dtype ? attend_vec_bf16_64 : attend_vec_f32_64;
    if (head_size == 128) return dtype ? attend_vec_bf16_128 : attend_vec_f32_128;
    return dtype ? attend_vec_bf16 : attend_vec_f32;
}
#endif

#if !HAVE_AVX512
#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
DEFINE_ATTEND(attend_f32, float, LOAD_F32, head_size)
DEFINE_ATTEND(attend_bf16, uint16_t, LOAD_BF16, head_size)
DEFINE_ATTEND(attend_f32_64, float, LOAD_F32, 64)
DEFINE_ATTEND(attend_bf16_64, uint16_t, LOAD_BF16, 64)
DEFINE_ATTEND(attend_f32_128, float, LOAD_F32, 128)
DEFINE_ATTEND(attend_bf16_128, uint16_t, LOAD_BF16, 128)

typedef void (*attend_fn)(const float *, const void *, const void *, int64_t, const int32_t *, int, int64_t,
                          int64_t, int, int, int, float, const int *, const float *, float *, float *);

static attend_fn pick_attend(int dtype, int head_size) {
    if (head_size == 64) return dtype ? (attend_fn)attend_bf16_64 : (attend_fn)attend_f32_64;
    if (head_size == 128) return dtype ? (attend_fn)attend_bf16_128 : (attend_fn)attend_f32_128;
    return dtype ? (attend_fn)attend_bf16 : (attend_fn)attend_f32;
}
#endif

/* Decode attention for requests [req_begin, req_end) of the arrays below.
 *
 * dtype: 0 float32, 1 bfloat16 (query, cache and output alike).
 * q: row r, head h at q + r * q_stride_row + h * head_size (elements).
 * k_cache / v_cache: slot s, KV head j at cache + s * cache_stride_slot + j * head_size.
 * block_table: request r's blocks at block_table + r * block_table_stride.
 * seq_lens: request r attends to positions [max(0, len - sliding_window), len).
 * out: [rows][num_heads][head_size], contiguous.
 * k_new / v_new (NULL: none): request r's new key and value, its KV heads
 * contiguous at k_new + r * k_new_stride (elements), written to cache slot
 * new_slots[r] before any row attends (a negative slot: nothing is
 * written), which saves torch two index_copy_ passes per layer.
 * query_len: rows per request (a verify step scores 1 + k tokens of each
 * request): row r is query row r % query_len of request r / query_len,
 * which reads that request's block table row and attends up to
 * seq_lens[r / query_len] - (query_len - 1 - r % query_len), i.e. causally
 * over the request's rows before it, whose keys and values are all written first.
 * sliding_window <= 0 and soft_cap <= 0 mean none.
 * sinks (NULL: none): float32 [num_heads], query head h's sink logit: it
 * joins each row's softmax (after the soft cap) and its probability is dropped.
 * Returns 0, or -1 when a scratch buffer cannot be allocated or a size is out of range.
 */
#if HAVE_AVX512
/* Request b's query_len rows folded into one pass over its keys and values
 * (they share them): query head h of row i becomes head (h / group *
 * query_len + i) * group + h % group, so each KV head's group is all its
 * heads of all rows (group * query_len), and mask_folded_rows keeps each row
 * causal. qraw / qf / acc hold num_heads * query_len heads. */
static void attend_folded_request(attend_vec_fn attend, int dtype, const void *q, int64_t q_stride_row,
                                  const void *k_cache, const void *v_cache, int64_t cache_stride_slot,
                                  const int32_t *blocks, int64_t b, int64_t len, int64_t query_len, int num_heads,
                                  int num_kv_heads, int head_size, int block_size, float scale,
                                  int64_t sliding_window, float soft_cap, const float *sinks, float *folded_sinks,
                                  void *qraw, float *qf, float *scores, float *acc, void *out) {
    const int group = num_heads / num_kv_heads, folded_group = group * (int)query_len;
    const size_t elem = dtype ? 2 : 4, head_bytes = (size_t)head_size * elem;
    for (int64_t i = 0; i < query_len; i++)
        for (int h = 0; h < num_heads; h++) {
            int64_t folded = (h / group * query_len + i) * group + h % group;
            memcpy((char *)qraw + folded * head_bytes,
                   (const char *)q + ((b * query_len + i) * q_stride_row + (int64_t)h * head_size) * elem, head_bytes);
        }
    const int64_t num_values = (int64_t)num_heads * query_len * head_size;
    for (int64_t i = 0; i < num_values; i++)
        qf[i] = (dtype ? bf16_to_f32(((const uint16_t *)qraw)[i]) : ((const float *)qraw)[i]) * scale;
    if (sinks) /* each folded head's sink is its query head's */
        for (int64_t i = 0; i < query_len; i++)
            for (int h = 0; h < num_heads; h++) folded_sinks[(h / group * query_len + i) * group + h % group] = sinks[h];
    int64_t first_len = len - (query_len - 1);
    int64_t start = sliding_window > 0 && first_len > sliding_window ? first_len - sliding_window : 0;
    attend(qraw, qf, scale, k_cache, v_cache, cache_stride_slot, blocks, block_size, start, len,
           num_heads * (int)query_len, folded_group, head_size, soft_cap, (int)query_len, sliding_window,
           sinks ? folded_sinks : NULL, scores, acc);
    for (int64_t i = 0; i < query_len; i++)
        for (int h = 0; h < num_heads; h++) {
            const float *src = acc + ((h / group * query_len + i) * group + h % group) * head_size;
            size_t dst = ((size_t)(b * query_len + i) * (size_t)num_heads + (size_t)h) * (size_t)head_size;
            for (int d = 0; d < head_size; d++) {
                if (dtype)
                    ((uint16_t *)out)[dst + d] = f32_to_bf16(src[d]);
                else
                    ((float *)out)[dst + d] = src[d];
            }
        }
}
#endif

/* Writes rows [begin, end)'s new keys and values to their slots. */
static void write_new_kv(int dtype, void *k_cache, void *v_cache, int64_t cache_stride_slot, const void *k_new,
                         int64_t k_new_stride, const void *v_new, int64_t v_new_stride, const int64_t *new_slots,
                         int64_t r, int num_kv_heads, int head_size) {
    if (new_slots[r] < 0) return; /* slot -1: a row that writes nothing (a graph's padding) */
    size_t elem = dtype ? 2 : 4, kv_row = (size_t)num_kv_heads * (size_t)head_size * elem;
    memcpy((char *)k_cache + new_slots[r] * cache_stride_slot * (int64_t)elem,
           (const char *)k_new + r * k_new_stride * (int64_t)elem, kv_row);
    memcpy((char *)v_cache + new_slots[r] * cache_stride_slot * (int64_t)elem,
           (const char *)v_new + r * v_new_stride * (int64_t)elem, kv_row);
}

int paged_decode(int dtype, const void *q, int64_t q_stride_row, void *k_cache, void *v_cache,
                 int64_t cache_stride_slot, const int32_t *block_table, int64_t block_table_stride,
                 const int32_t *seq_lens, void *out, const void *k_new, int64_t k_new_stride, const void *v_new,
                 int64_t v_new_stride, const int64_t *new_slots, int64_t req_begin, int64_t req_end, int num_heads,
                 int num_kv_heads, int head_size, int block_size, float scale, int64_t sliding_window,
                 float soft_cap, int64_t query_len, const float *sinks) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || head_size > MAX_HEAD_SIZE || query_len < 1 ||
        query_len > MAX_QUERY_LEN || req_begin % query_len || req_end % query_len)
        return -1;
    int64_t max_len = 1;
    for (int64_t r = req_begin; r < req_end; r++)
        if (seq_lens[r / query_len] > max_len) max_len = seq_lens[r / query_len];
    int failed = 0;
    /* Requests are shared out one at a time (their lengths differ) over the
     * OpenMP team. The library links the libgomp.so.1 torch has loaded, so
     * this is torch's own thread team (torch.set_num_threads): a second
     * runtime's threads, or Python threads, competed with torch's spinning
     * idle threads for the cores and gained nothing at 2 threads. */
#pragma omp parallel reduction(| : failed) if (req_end - req_begin > 1)
    {
    size_t row = (size_t)num_heads * (size_t)head_size, rows = row * (size_t)query_len;
    float *scores = malloc(sizeof(float) * (size_t)num_heads * (size_t)query_len * (size_t)max_len);
    float *acc = malloc(sizeof(float) * rows);
    float *qf = malloc(sizeof(float) * rows);
    void *qraw = malloc(sizeof(float) * rows);
    int *kv_head = malloc(sizeof(int) * (size_t)num_heads);
    float *folded_sinks = malloc(sizeof(float) * (size_t)num_heads * (size_t)query_len);
    failed = !scores || !acc || !qf || !qraw || !kv_head || !folded_sinks;
    /* An integer division per head and token was a third of the kernel's time. */
    for (int h = 0; !failed && h < num_heads; h++) kv_head[h] = h / (num_heads / num_kv_heads);
#if HAVE_AVX512
    attend_vec_fn attend = pick_attend_vec(dtype, head_size);
#else
    attend_fn attend = pick_attend(dtype, head_size);
#endif
    /* Every new row first (the barrier ending this loop orders them before
     * any read): with query_len > 1 a row attends over its request's earlier rows. */
    if (k_new) {
#pragma omp for schedule(static)
        for (int64_t r = req_begin; r < req_end; r++)
            write_new_kv(dtype, k_cache, v_cache, cache_stride_slot, k_new, k_new_stride, v_new, v_new_stride,
                         new_slots, r, num_kv_heads, head_size);
    }
#if HAVE_AVX512
    if (query_len > 1) {
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = req_begin / query_len; b < req_end / query_len; b++) {
            if (failed) continue;
            attend_folded_request(attend, dtype, q, q_stride_row, k_cache, v_cache, cache_stride_slot,
                                  block_table + b * block_table_stride, b, seq_lens[b], query_len, num_heads,
                                  num_kv_heads, head_size, block_size, scale, sliding_window, soft_cap, sinks,
                                  folded_sinks, qraw, qf, scores, acc, out);
        }
    } else
#endif
    {
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = req_begin; r < req_end; r++) {
        if (failed) continue;
        int64_t req = r / query_len;
        int64_t len = seq_lens[req] - (query_len - 1 - r % query_len);
        int64_t start = sliding_window > 0 && len > sliding_window ? len - sliding_window : 0;
        for (size_t i = 0; i < row; i++) {
            int64_t src_i = r * q_stride_row + (int64_t)i;
            float x = dtype ? bf16_to_f32(((const uint16_t *)q)[src_i]) : ((const float *)q)[src_i];
            qf[i] = x * scale;
        }
        const int32_t *blocks = block_table + req * block_table_stride;
#if HAVE_AVX512
        attend((const char *)q + r * q_stride_row * (dtype ? 2 : 4), qf, scale, k_cache, v_cache, cache_stride_slot,
               blocks, block_size, start, len, num_heads, num_heads / num_kv_heads, head_size, soft_cap, 1, 0,
               sinks, scores, acc);
#else
        attend(qf, k_cache, v_cache, cache_stride_slot, blocks, block_size, start, len, num_heads, num_kv_heads,
               head_size, soft_cap, kv_head, sinks, scores, acc);
#endif
        for (size_t i = 0; i < row; i++) {
            size_t dst_i = (size_t)r * row + i;
            if (dtype)
                ((uint16_t *)out)[dst_i] = f32_to_bf16(acc[i]);
            else
                ((float *)out)[dst_i] = acc[i];
        }
    }
    }
    free(scores), free(acc), free(qf), free(qraw), free(kv_head), free(folded_sinks);
    }
    return failed ? -1 : 0;
}
