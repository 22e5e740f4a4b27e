/* Routed experts of a mixture-of-experts layer for decode-sized batches on
 * the CPU (the "fused_moe" op; platforms/cpu/fused_moe.py).
 *
 * A decode step multiplies a few tokens by the weights of the experts they
 * chose, so it is bound by how fast those weights stream from memory. The
 * kernel reads the routing (topk_ids, topk_weights) from the tensors
 * themselves, groups each expert's tokens, and streams every selected
 * expert's rows once, each row dotted with all of that expert's tokens
 * while it is in L1. It reads no host value in Python, so a CPU decode graph
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
 * from the caller, float32: x_f32 [T, H], act [T * k, I], y [T * k, H].
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

/* sum w[i] * x[i], w float32. */
static float dot_f32(const float *w, const float *x, int64_t n) {
#if defined(__AVX512F__)
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), acc1);
    }
    for (; i < n; i += 16) {
        __mmask16 m = mask16(n - i);
        acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + i), _mm512_maskz_loadu_ps(m, x + i), acc0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#else
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += w[i] * x[i];
    return sum;
#endif
}

/* sum w[i] * x[i], w bfloat16, x float32. */
static float dot_bf16(const uint16_t *w, const float *x, int64_t n) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm512_fmadd_ps(load16_bf16(w + i, 0xffff), _mm512_loadu_ps(x + i), acc0);
        acc1 = _mm512_fmadd_ps(load16_bf16(w + i + 16, 0xffff), _mm512_loadu_ps(x + i + 16), acc1);
    }
    for (; i < n; i += 16) {
        __mmask16 m = mask16(n - i);
        acc0 = _mm512_fmadd_ps(load16_bf16(w + i, m), _mm512_maskz_loadu_ps(m, x + i), acc0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#else
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += bf16_to_f32(w[i]) * x[i];
    return sum;
#endif
}

/* Row `row` of a [rows, n] weight (element offset) dotted with x. */
static inline float dot_row(int dtype, const void *w, int64_t offset, const float *x, int64_t n) {
    return dtype ? dot_bf16((const uint16_t *)w + offset, x, n) : dot_f32((const float *)w + offset, x, n);
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
               float *x_f32, float *act, float *y, void *out) {
    int64_t slots = tokens * top_k;
    int64_t *start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_experts + 1));
    int64_t *sorted = (int64_t *)malloc(sizeof(int64_t) * (size_t)(slots > 0 ? slots : 1));
    int64_t *active = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_experts > 0 ? num_experts : 1));
    group_by_expert(topk_ids, slots, num_experts, start, sorted);
    int64_t num_active = 0;
    for (int64_t e = 0; e < num_experts; e++)
        if (start[e + 1] > start[e]) active[num_active++] = e;

    const float *xs = (const float *)x;
    if (dtype) {
        for (int64_t i = 0; i < tokens * hidden; i++) x_f32[i] = bf16_to_f32(((const uint16_t *)x)[i]);
        xs = x_f32;
    }

    /* 1. gate and up rows, activation. */
    int64_t inter_blocks = (inter + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for schedule(static) if (num_active * inter_blocks > 1)
    for (int64_t item = 0; item < num_active * inter_blocks; item++) {
        int64_t e = active[item / inter_blocks], i0 = (item % inter_blocks) * ROW_BLOCK;
        int64_t i1 = i0 + ROW_BLOCK < inter ? i0 + ROW_BLOCK : inter;
        for (int64_t i = i0; i < i1; i++) {
            int64_t gate_row = e * 2 * inter + i, up_row = gate_row + inter;
            float gate_bias = b13 ? load_elem(dtype, b13, gate_row) : 0.0f;
            float up_bias = b13 ? load_elem(dtype, b13, up_row) : 0.0f;
            for (int64_t g = start[e]; g < start[e + 1]; g++) {
                int64_t s = sorted[g];
                const float *xt = xs + (s / top_k) * hidden;
                float gate = rnd(dtype, dot_row(dtype, w13, gate_row * hidden, xt, hidden) + gate_bias);
                float up = rnd(dtype, dot_row(dtype, w13, up_row * hidden, xt, hidden) + up_bias);
                act[s * inter + i] = activate(dtype, activation, gate, up, alpha, limit);
            }
        }
    }

    /* 2. down rows. */
    int64_t hidden_blocks = (hidden + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for schedule(static) if (num_active * hidden_blocks > 1)
    for (int64_t item = 0; item < num_active * hidden_blocks; item++) {
        int64_t e = active[item / hidden_blocks], h0 = (item % hidden_blocks) * ROW_BLOCK;
        int64_t h1 = h0 + ROW_BLOCK < hidden ? h0 + ROW_BLOCK : hidden;
        for (int64_t h = h0; h < h1; h++) {
            int64_t row = e * hidden + h;
            float bias = b2 ? load_elem(dtype, b2, row) : 0.0f;
            for (int64_t g = start[e]; g < start[e + 1]; g++) {
                int64_t s = sorted[g];
                y[s * hidden + h] = rnd(dtype, dot_row(dtype, w2, row * inter, act + s * inter, inter) + bias);
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
        float *sum = x_f32 + t * hidden; /* x_f32 is free again: its row t is the float32 sum */
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
