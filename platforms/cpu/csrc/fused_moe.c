/* Routed experts of a mixture-of-experts layer for decode-sized batches on
 * the CPU (the "fused_moe" op; platforms/cpu/fused_moe.py).
 *
 * A decode step multiplies a few tokens by the weights of the experts they
 * chose, so it is bound by how fast those weights stream from memory. The
 * kernel reads the routing (topk_ids, topk_weights) from the tensors
 * themselves, groups each expert's tokens, and streams every selected
 * expert's rows once, each row dotted with that expert's tokens four at a
 * time while it is in L1 (bfloat16: AVX512-BF16's pair dot product where
 * the CPU has it). It reads no host value in Python, so a CPU decode graph
 * can record it (the same pointers, new routing at every replay).
 *
 * Weights as the layer stores them (nn.Linear's [out, in] rows): w13
 * [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], optional biases
 * b13 [E, 2I] and b2 [E, H]. Three passes on torch's OpenMP team:
 *   1. per (expert, block of I): gate and up rows with the expert's tokens,
 *      the activation, into act [T * k, I];
 *   2. per (expert, block of H): the down rows, into y [T * k, H];
 *   3. per token: out = sum of weight * y over its experts in float32, in
 *      ascending expert order (the order of the reference's index_add_).
 * In bfloat16 every intermediate is rounded where torch's ops round
 * (gate_up, each activation op, y), so results match the reference to
 * within the GEMMs' summation order.
 *
 * dtype: 0 float32, 1 bfloat16 (x, out, weights and biases alike). Scratch
 * from the caller: act [T * k, I] in dtype (the activations are rounded to
 * it, as the reference's are, and are the down projection's input), and in
 * float32 y [T * k, H] and sums [T, H].
 * Built with -ffp-contract=off: weight * y then the add round as torch's
 * two ops do (the dots use explicit FMAs).
 * activation: 0 silu, 1 swigluoai. Expert ids outside [0, E) contribute
 * nothing.
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernel_math.h"

#define ROW_BLOCK 16 /* rows of one work item */

/* ---------------------------------------------------------------- dots */

/* One weight row dotted with up to TOKEN_TILE tokens' rows at once: the
 * row is loaded (and in bfloat16 widened) once per tile, and the tokens'
 * accumulators are independent chains. */
#define TOKEN_TILE 4

#if defined(__AVX512F__)
/* out[j] = the sum of acc[j]'s lanes, j < tile: four accumulators reduced
 * together (one horizontal sum each cost as much as a row's dot at decode
 * sizes). */
static inline void reduce_tile(const __m512 *acc, int tile, float *out) {
    __m256 half[TOKEN_TILE];
    for (int j = 0; j < TOKEN_TILE; j++)
        half[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[j]), _mm512_extractf32x8_ps(acc[j], 1));
    __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(half[0], half[1]), _mm256_hadd_ps(half[2], half[3]));
    __m128 sums = _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
    float all[4];
    _mm_storeu_ps(all, sums);
    for (int j = 0; j < tile; j++) out[j] = all[j];
}
#endif

/* out[j] = sum w[i] * x[j][i], float32. */
static void dots_f32(const float *w, const float *const *x, int tile, int64_t n, float *out) {
#if defined(__AVX512F__)
    __m512 acc[TOKEN_TILE];
    for (int j = 0; j < TOKEN_TILE; j++) acc[j] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 wv = _mm512_loadu_ps(w + i);
        for (int j = 0; j < TOKEN_TILE; j++)
            if (j < tile) acc[j] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x[j] + i), acc[j]);
    }
    if (i < n) {
        __mmask16 m = mask16(n - i);
        __m512 wv = _mm512_maskz_loadu_ps(m, w + i);
        for (int j = 0; j < TOKEN_TILE; j++)
            if (j < tile) acc[j] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x[j] + i), acc[j]);
    }
    reduce_tile(acc, tile, out);
#else
    for (int j = 0; j < tile; j++) {
        float sum = 0.0f;
        const float *xj = x[j];
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) sum += w[i] * xj[i];
        out[j] = sum;
    }
#endif
}

/* out[j] = sum w[i] * x[j][i], both bfloat16, summed in float32: with
 * AVX512-BF16's pair dot product where the CPU has it (32 elements an
 * instruction, nothing to widen), else widened to float32. */
static void dots_bf16(const uint16_t *w, const uint16_t *const *x, int tile, int64_t n, float *out) {
#if defined(__AVX512BF16__)
    __m512 acc[TOKEN_TILE];
    for (int j = 0; j < TOKEN_TILE; j++) acc[j] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512i wv = _mm512_loadu_si512(w + i);
        for (int j = 0; j < TOKEN_TILE; j++)
            if (j < tile) acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)wv, (__m512bh)_mm512_loadu_si512(x[j] + i));
    }
    if (i < n) {
        __mmask32 m = mask32(n - i);
        __m512i wv = _mm512_maskz_loadu_epi16(m, w + i);
        for (int j = 0; j < TOKEN_TILE; j++)
            if (j < tile) acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)wv, (__m512bh)_mm512_maskz_loadu_epi16(m, x[j] + i));
    }
    reduce_tile(acc, tile, out);
#elif defined(__AVX512BW__) && defined(__AVX512VL__)
    __m512 acc[TOKEN_TILE];
    for (int j = 0; j < TOKEN_TILE; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = mask16(n - i);
        __m512 wv = load16_bf16(w + i, m);
        for (int j = 0; j < TOKEN_TILE; j++)
            if (j < tile) acc[j] = _mm512_fmadd_ps(wv, load16_bf16(x[j] + i, m), acc[j]);
    }
    reduce_tile(acc, tile, out);
#else
    for (int j = 0; j < tile; j++) {
        float sum = 0.0f;
        const uint16_t *xj = x[j];
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) sum += bf16_to_f32(w[i]) * bf16_to_f32(xj[i]);
        out[j] = sum;
    }
#endif
}

/* Row `row` (element offset) of a weight in dtype dotted with the tile's rows. */
static inline void dots(int dtype, const void *w, int64_t offset, const void *const *x, int tile, int64_t n,
                        float *out) {
    if (dtype)
        dots_bf16((const uint16_t *)w + offset, (const uint16_t *const *)x, tile, n, out);
    else
        dots_f32((const float *)w + offset, (const float *const *)x, tile, n, out);
}

/* Element i of a dtype array, as a float, and a float stored as dtype. */
static inline const void *at(int dtype, const void *p, int64_t i) {
    return (const char *)p + i * (dtype ? 2 : 4);
}
static inline void store(int dtype, void *p, int64_t i, float v) {
    if (dtype)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

static inline float load_elem(int dtype, const void *p, int64_t i) {
    return dtype ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* What a torch op in dtype would have stored. */
static inline float rnd(int dtype, float v) { return dtype ? round_bf16(v) : v; }

static inline float sigmoid(float v) { return 1.0f / (1.0f + exp_clamped(-v)); }

/* apply_activation of layers/fused_moe.py on one (gate, up) pair, rounding
 * after each of torch's ops. */
static inline float activate(int dtype, int activation, float gate, float up, float alpha, float limit) {
    if (activation == 0) return rnd(dtype, rnd(dtype, gate * sigmoid(gate)) * up);
    gate = gate > limit ? limit : gate;
    up = up > limit ? limit : (up < -limit ? -limit : up);
    float glu = rnd(dtype, sigmoid(rnd(dtype, gate * alpha)));
    return rnd(dtype, rnd(dtype, rnd(dtype, up + 1.0f) * gate) * glu);
}

/* ---------------------------------------------------------------- kernel */

/* Slots (token * top_k + j) grouped by expert, each group in slot order:
 * expert e's are sorted[start[e] .. start[e + 1]). */
static void group_by_expert(const int64_t *topk_ids, int64_t slots, int64_t num_experts, int64_t *start,
                            int64_t *sorted) {
    for (int64_t e = 0; e <= num_experts; e++) start[e] = 0;
    for (int64_t s = 0; s < slots; s++) {
        int64_t e = topk_ids[s];
        if (e >= 0 && e < num_experts) start[e + 1]++;
    }
    for (int64_t e = 0; e < num_experts; e++) start[e + 1] += start[e];
    int64_t *fill = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_experts > 0 ? num_experts : 1));
    for (int64_t e = 0; e < num_experts; e++) fill[e] = start[e];
    for (int64_t s = 0; s < slots; s++) {
        int64_t e = topk_ids[s];
        if (e >= 0 && e < num_experts) sorted[fill[e]++] = s;
    }
    free(fill);
}

void fused_moe(int dtype, const void *x, int64_t tokens, int64_t hidden, const float *topk_weights,
               const int64_t *topk_ids, int64_t top_k, const void *w13, const void *w2, const void *b13,
               const void *b2, int64_t num_experts, int64_t inter, int activation, float alpha, float limit,
               float *sums, void *act, float *y, void *out) {
    int64_t slots = tokens * top_k;
    int64_t *start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_experts + 1));
    int64_t *sorted = (int64_t *)malloc(sizeof(int64_t) * (size_t)(slots > 0 ? slots : 1));
    int64_t *active = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_experts > 0 ? num_experts : 1));
    group_by_expert(topk_ids, slots, num_experts, start, sorted);
    int64_t num_active = 0;
    for (int64_t e = 0; e < num_experts; e++)
        if (start[e + 1] > start[e]) active[num_active++] = e;

    /* 1. gate and up rows, activation. */
    int64_t inter_blocks = (inter + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for schedule(static) if (num_active * inter_blocks > 1)
    for (int64_t item = 0; item < num_active * inter_blocks; item++) {
        int64_t e = active[item / inter_blocks], i0 = (item % inter_blocks) * ROW_BLOCK;
        int64_t i1 = i0 + ROW_BLOCK < inter ? i0 + ROW_BLOCK : inter;
        for (int64_t g0 = start[e]; g0 < start[e + 1]; g0 += TOKEN_TILE) {
            int tile = start[e + 1] - g0 < TOKEN_TILE ? (int)(start[e + 1] - g0) : TOKEN_TILE;
            const void *rows[TOKEN_TILE];
            for (int j = 0; j < tile; j++) rows[j] = at(dtype, x, (sorted[g0 + j] / top_k) * hidden);
            for (int64_t i = i0; i < i1; i++) {
                int64_t gate_row = e * 2 * inter + i, up_row = gate_row + inter;
                float gate_bias = b13 ? load_elem(dtype, b13, gate_row) : 0.0f;
                float up_bias = b13 ? load_elem(dtype, b13, up_row) : 0.0f;
                float gate[TOKEN_TILE], up[TOKEN_TILE];
                dots(dtype, w13, gate_row * hidden, rows, tile, hidden, gate);
                dots(dtype, w13, up_row * hidden, rows, tile, hidden, up);
                for (int j = 0; j < tile; j++)
                    store(dtype, act, sorted[g0 + j] * inter + i,
                          activate(dtype, activation, rnd(dtype, gate[j] + gate_bias), rnd(dtype, up[j] + up_bias),
                                   alpha, limit));
            }
        }
    }

    /* 2. down rows. */
    int64_t hidden_blocks = (hidden + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for schedule(static) if (num_active * hidden_blocks > 1)
    for (int64_t item = 0; item < num_active * hidden_blocks; item++) {
        int64_t e = active[item / hidden_blocks], h0 = (item % hidden_blocks) * ROW_BLOCK;
        int64_t h1 = h0 + ROW_BLOCK < hidden ? h0 + ROW_BLOCK : hidden;
        for (int64_t g0 = start[e]; g0 < start[e + 1]; g0 += TOKEN_TILE) {
            int tile = start[e + 1] - g0 < TOKEN_TILE ? (int)(start[e + 1] - g0) : TOKEN_TILE;
            const void *rows[TOKEN_TILE];
            for (int j = 0; j < tile; j++) rows[j] = at(dtype, act, sorted[g0 + j] * inter);
            for (int64_t h = h0; h < h1; h++) {
                int64_t row = e * hidden + h;
                float bias = b2 ? load_elem(dtype, b2, row) : 0.0f, down[TOKEN_TILE];
                dots(dtype, w2, row * inter, rows, tile, inter, down);
                for (int j = 0; j < tile; j++) y[sorted[g0 + j] * hidden + h] = rnd(dtype, down[j] + bias);
            }
        }
    }

    /* 3. the weighted sum per token, experts in ascending order. */
#pragma omp parallel for schedule(static) if (tokens * hidden >= 65536)
    for (int64_t t = 0; t < tokens; t++) {
        int64_t order[64], count = 0; /* top_k <= 64: checked by the wrapper */
        for (int64_t j = 0; j < top_k; j++) {
            int64_t s = t * top_k + j, e = topk_ids[s];
            if (e < 0 || e >= num_experts) continue;
            int64_t at = count++;
            while (at > 0 && topk_ids[order[at - 1]] > e) {
                order[at] = order[at - 1];
                at--;
            }
            order[at] = s;
        }
        float *sum = sums + t * hidden;
        for (int64_t h = 0; h < hidden; h++) sum[h] = 0.0f;
        for (int64_t j = 0; j < count; j++) {
            const float *yj = y + order[j] * hidden;
            float weight = topk_weights[order[j]];
#pragma omp simd
            for (int64_t h = 0; h < hidden; h++) sum[h] += yj[h] * weight;
        }
        if (dtype)
            for (int64_t h = 0; h < hidden; h++) ((uint16_t *)out)[t * hidden + h] = f32_to_bf16(sum[h]);
        else
            memcpy((float *)out + t * hidden, sum, sizeof(float) * (size_t)hidden);
    }
    free(start);
    free(sorted);
    free(active);
}
