/* Paged attention for decode rows (one query token per request) on the CPU.
 *
 * Reads each request's keys and values straight from the paged cache through
 * its block table: nothing is gathered into a padded copy, and a request
 * reads only its own keys. Scores, softmax and the weighted sum of values are
 * in float32 whatever the storage dtype (float32 or bfloat16), like
 * torch's SDPA CPU kernel. Loaded through ctypes (no Python or torch headers),
 * so building it takes a C compiler and well under a second; see
 * attention_backends/cpu_decode_kernel.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_SIZE 512

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* exp(x) for x <= 0, within 2 ulp of expf (Cephes' expf polynomial), in a
 * form the compiler vectorises: libm's expf is a scalar call, and the
 * softmax's exps were a third of the kernel's time. Below -87.3 it returns
 * exp(-87.3) ~ 1.2e-38 instead of a smaller number: against a softmax
 * denominator of at least 1 that is 0. */
static inline float exp_nonpositive(float x) {
    x = x < -87.3f ? -87.3f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* One request: every query head attends over keys [start, len).
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
                     int have_scores, /* scores already hold q.k (scores_bf16_dot) */                    \
                     float *scores, /* [num_heads][len - start] */                                        \
                     float *out /* [num_heads][head_size] */) {                                           \
        const int hs = HS;                                                                                 \
        const int64_t n = len - start;                                                                     \
        (void)head_size, (void)num_kv_heads;                                                               \
        for (int64_t b = start / block_size; !have_scores && b * block_size < len; b++) {                  \
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
        for (int h = 0; h < num_heads; h++) {                                                              \
            float *sh = scores + h * n, m = -INFINITY, sum = 0.0f;                                         \
            for (int64_t i = 0; i < n; i++) m = sh[i] > m ? sh[i] : m;                                     \
            _Pragma("omp simd reduction(+ : sum)") for (int64_t i = 0; i < n; i++) {                       \
                sh[i] = exp_nonpositive(sh[i] - m);                                                        \
                sum += sh[i];                                                                              \
            }                                                                                              \
            float inv = 1.0f / sum;                                                                        \
            _Pragma("omp simd") for (int64_t i = 0; i < n; i++) sh[i] *= inv;                             \
        }                                                                                                  \
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

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
/* q.k of every query head over keys [start, len) with AVX512-BF16's dot
 * product: bf16 pairs multiplied exactly and summed in float32, 32 values an
 * instruction, from the query as it is (the scale is applied to the sum).
 * Half the kernel's time at head size 64 went to these dot products. */
static void scores_bf16_dot(const uint16_t *q, float scale, const uint16_t *k_cache, int64_t stride_slot,
                            const int32_t *blocks, int block_size, int64_t start, int64_t len, int num_heads,
                            int head_size, const int *kv_head, float soft_cap, float *scores) {
    int64_t n = len - start;
    for (int64_t b = start / block_size; b * block_size < len; b++) {
        int64_t t0 = b * block_size > start ? b * block_size : start;
        int64_t t1 = (b + 1) * block_size < len ? (b + 1) * block_size : len;
        const uint16_t *k = k_cache + ((int64_t)blocks[b] * block_size + (t0 - b * block_size)) * stride_slot;
        for (int64_t t = t0; t < t1; t++, k += stride_slot) {
            for (int h = 0; h < num_heads; h++) {
                const uint16_t *qh = q + (int64_t)h * head_size, *kh = k + (int64_t)kv_head[h] * head_size;
                __m512 acc = _mm512_setzero_ps();
                for (int d = 0; d < head_size; d += 32)
                    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qh + d),
                                           (__m512bh)_mm512_loadu_si512(kh + d));
                float s = _mm512_reduce_add_ps(acc) * scale;
                if (soft_cap > 0.0f) s = soft_cap * tanhf(s / soft_cap);
                scores[h * n + (t - start)] = s;
            }
        }
    }
}
#else
#define HAVE_BF16_DOT 0
#endif

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
DEFINE_ATTEND(attend_f32, float, LOAD_F32, head_size)
DEFINE_ATTEND(attend_bf16, uint16_t, LOAD_BF16, head_size)
DEFINE_ATTEND(attend_f32_64, float, LOAD_F32, 64)
DEFINE_ATTEND(attend_bf16_64, uint16_t, LOAD_BF16, 64)
DEFINE_ATTEND(attend_f32_128, float, LOAD_F32, 128)
DEFINE_ATTEND(attend_bf16_128, uint16_t, LOAD_BF16, 128)

typedef void (*attend_fn)(const float *, const void *, const void *, int64_t, const int32_t *, int, int64_t,
                          int64_t, int, int, int, float, const int *, int, float *, float *);

static attend_fn pick_attend(int dtype, int head_size) {
    if (head_size == 64) return dtype ? (attend_fn)attend_bf16_64 : (attend_fn)attend_f32_64;
    if (head_size == 128) return dtype ? (attend_fn)attend_bf16_128 : (attend_fn)attend_f32_128;
    return dtype ? (attend_fn)attend_bf16 : (attend_fn)attend_f32;
}

/* Decode attention for requests [req_begin, req_end) of the arrays below.
 *
 * dtype: 0 float32, 1 bfloat16 (query, cache and output alike).
 * q: row r, head h at q + r * q_stride_row + h * head_size (elements).
 * k_cache / v_cache: slot s, KV head j at cache + s * cache_stride_slot + j * head_size.
 * block_table: request r's blocks at block_table + r * block_table_stride.
 * seq_lens: request r attends to positions [max(0, len - sliding_window), len).
 * out: [rows][num_heads][head_size], contiguous.
 * sliding_window <= 0 and soft_cap <= 0 mean none.
 * Returns 0, or -1 when a scratch buffer cannot be allocated or a size is out of range.
 */
int paged_decode(int dtype, const void *q, int64_t q_stride_row, const void *k_cache, const void *v_cache,
                 int64_t cache_stride_slot, const int32_t *block_table, int64_t block_table_stride,
                 const int32_t *seq_lens, void *out, int64_t req_begin, int64_t req_end, int num_heads,
                 int num_kv_heads, int head_size, int block_size, float scale, int64_t sliding_window,
                 float soft_cap) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || head_size > MAX_HEAD_SIZE) return -1;
    int64_t max_len = 1;
    for (int64_t r = req_begin; r < req_end; r++)
        if (seq_lens[r] > max_len) max_len = seq_lens[r];
    int failed = 0;
    /* Requests are shared out one at a time (their lengths differ) over the
     * OpenMP team. The library links the libgomp.so.1 torch has loaded, so
     * this is torch's own thread team (torch.set_num_threads): a second
     * runtime's threads, or Python threads, competed with torch's spinning
     * idle threads for the cores and gained nothing at 2 threads. */
#pragma omp parallel reduction(| : failed) if (req_end - req_begin > 1)
    {
    size_t row = (size_t)num_heads * (size_t)head_size;
    float *scores = malloc(sizeof(float) * (size_t)num_heads * (size_t)max_len);
    float *acc = malloc(sizeof(float) * row);
    float *qf = malloc(sizeof(float) * row);
    int *kv_head = malloc(sizeof(int) * (size_t)num_heads);
    failed = !scores || !acc || !qf || !kv_head;
    /* An integer division per head and token was a third of the kernel's time. */
    for (int h = 0; !failed && h < num_heads; h++) kv_head[h] = h / (num_heads / num_kv_heads);
    attend_fn attend = pick_attend(dtype, head_size);
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = req_begin; r < req_end; r++) {
        if (failed) continue;
        int64_t len = seq_lens[r];
        int64_t start = sliding_window > 0 && len > sliding_window ? len - sliding_window : 0;
        for (size_t i = 0; i < row; i++) {
            int64_t src_i = r * q_stride_row + (int64_t)i;
            float x = dtype ? bf16_to_f32(((const uint16_t *)q)[src_i]) : ((const float *)q)[src_i];
            qf[i] = x * scale;
        }
        const int32_t *blocks = block_table + r * block_table_stride;
        int have_scores = 0;
#if HAVE_BF16_DOT
        if (dtype && head_size % 32 == 0) {
            scores_bf16_dot((const uint16_t *)q + r * q_stride_row, scale, k_cache, cache_stride_slot, blocks,
                            block_size, start, len, num_heads, head_size, kv_head, soft_cap, scores);
            have_scores = 1;
        }
#endif
        attend(qf, k_cache, v_cache, cache_stride_slot, blocks, block_size, start, len, num_heads, num_kv_heads,
               head_size, soft_cap, kv_head, have_scores, scores, acc);
        for (size_t i = 0; i < row; i++) {
            size_t dst_i = (size_t)r * row + i;
            if (dtype)
                ((uint16_t *)out)[dst_i] = f32_to_bf16(acc[i]);
            else
                ((float *)out)[dst_i] = acc[i];
        }
    }
    free(scores), free(acc), free(qf), free(kv_head);
    }
    return failed ? -1 : 0;
}
