/* Fused elementwise ops of the decoder layers on the CPU: RMSNorm (with the
 * residual add), SwiGLU's SiLU * mul, and rotary embedding in place.
 *
 * In torch each is 4-8 ops, each a pass over memory and, in bfloat16, a
 * round trip through float32 per element: on the ~100M Llama in bfloat16 they
 * were 25 % of a 2,500-token prefill step. Here each is one pass, in float32,
 * rounding where torch's op sequence rounds (so bfloat16 results match torch's
 * to the bit but for the order of the RMSNorm sum). Built with
 * -ffp-contract=off: a fused multiply-add would round differently from torch.
 * Loaded through ctypes; see platforms/cpu/fused_ops.py.
 *
 * dtype: 0 float32, 1 bfloat16 (every tensor argument of a call, except the
 * float32 cos / sin tables). Strides are in elements.
 */
#include <stdint.h>

#include "cpu_kernel_math.h"

/* Rows run on torch's OpenMP team (the library links the libgomp torch has
 * loaded) when there are enough of them to pay for waking it. */
#define PARALLEL_MIN_ELEMENTS 65536

/* One row of RMSNorm: out = RMSNorm(s) * weight, s = x, or with a residual
 * s = x + residual, rounded to T as torch's add would and stored in summed
 * (which may be the residual itself). The norm follows torch's float32
 * computation: y = s * rsqrt(mean(s^2) + eps), rounded to T (ROUND), then
 * multiplied by the weight in T. */
#define DEFINE_RMS_NORM_ROW(NAME, T, LOAD, STORE, ROUND)                                                    \
    static void NAME(const T *x, const T *residual, T *summed, const T *weight, T *out, int64_t hidden,     \
                     float eps) {                                                                         \
        float sum = 0.0f;                                                                                 \
        if (residual != NULL) {                                                                           \
            _Pragma("omp simd") for (int64_t i = 0; i < hidden; i++) summed[i] =                          \
                STORE(LOAD(x[i]) + LOAD(residual[i]));                                                   \
            x = summed;                                                                                   \
        }                                                                                                 \
        _Pragma("omp simd reduction(+ : sum)") for (int64_t i = 0; i < hidden; i++) sum +=                \
            LOAD(x[i]) * LOAD(x[i]);                                                                      \
        float inv = 1.0f / sqrtf(sum / (float)hidden + eps);                                              \
        _Pragma("omp simd") for (int64_t i = 0; i < hidden; i++) out[i] =                                 \
            STORE(LOAD(weight[i]) * ROUND(LOAD(x[i]) * inv));                                             \
    }

#define IDENTITY(x) (x)
DEFINE_RMS_NORM_ROW(rms_norm_row_f32, float, IDENTITY, IDENTITY, IDENTITY)

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* The bfloat16 row in AVX-512, to the bit what the portable loop below
 * returned as GCC 12 vectorised it for AVX-512 (tests/test_cpu_fused_ops.py
 * states the order in torch): the squares summed in 32 lanes, one per
 * position in each 32 elements, the last hidden % 32 added one by one to
 * position 0's lane, then the lanes in order from position 0. The portable
 * loop spent most of its time rounding by integer arithmetic and passed
 * over the row three times; here the residual add and the sum are one pass,
 * in the even/odd layout (cpu_kernel_math.h), where position 2j's lane is
 * even's j and position 2j + 1's is odd's j. */
static float sum_of_squares_bf16(const uint16_t *x, const uint16_t *residual, uint16_t *summed, int64_t hidden) {
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    int64_t body = hidden & ~(int64_t)31;
    for (int64_t i = 0; i < body; i += 32) {
        __m512i s = _mm512_loadu_si512(x + i);
        if (residual != NULL) {
            __m512i r = _mm512_loadu_si512(residual + i);
            s = bf16x32_even_odd(_mm512_add_ps(even_bf16(s), even_bf16(r)), _mm512_add_ps(odd_bf16(s), odd_bf16(r)));
            _mm512_storeu_si512(summed + i, s);
        }
        even = _mm512_add_ps(even, _mm512_mul_ps(even_bf16(s), even_bf16(s)));
        odd = _mm512_add_ps(odd, _mm512_mul_ps(odd_bf16(s), odd_bf16(s)));
    }
    if (residual != NULL) {
        for (int64_t j = body; j < hidden; j++) summed[j] = f32_to_bf16(bf16_to_f32(x[j]) + bf16_to_f32(residual[j]));
        x = summed;
    }
    float lanes[2][16];
    _mm512_storeu_ps(lanes[0], even);
    _mm512_storeu_ps(lanes[1], odd);
    for (int64_t j = body; j < hidden; j++) lanes[0][0] += bf16_to_f32(x[j]) * bf16_to_f32(x[j]);
    float sum = 0.0f;
    for (int position = 0; position < 32; position++) sum += lanes[position & 1][position >> 1];
    return sum;
}

static void rms_norm_row_bf16(const uint16_t *x, const uint16_t *residual, uint16_t *summed, const uint16_t *weight,
                              uint16_t *out, int64_t hidden, float eps) {
    float sum = sum_of_squares_bf16(x, residual, summed, hidden);
    if (residual != NULL) x = summed;
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(sum / (float)hidden + eps));
    for (int64_t i = 0; i < hidden; i += 32) {
        __mmask32 m = mask32(hidden - i);
        __m512i xs = _mm512_maskz_loadu_epi16(m, x + i), ws = _mm512_maskz_loadu_epi16(m, weight + i);
        __m512i y = bf16x32_even_odd(_mm512_mul_ps(even_bf16(xs), inv), _mm512_mul_ps(odd_bf16(xs), inv));
        __m512i o = bf16x32_even_odd(_mm512_mul_ps(even_bf16(ws), even_bf16(y)), _mm512_mul_ps(odd_bf16(ws), odd_bf16(y)));
        _mm512_mask_storeu_epi16(out + i, m, o);
    }
}
#else
DEFINE_RMS_NORM_ROW(rms_norm_row_bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16)
#endif

/* RMSNorm of `rows` rows of `hidden` (see above); x and residual rows at
 * their strides, summed and out contiguous. */
void rms_norm(int dtype, const void *x, int64_t x_stride, const void *residual, int64_t residual_stride,
              void *summed, const void *weight, void *out, int64_t rows, int64_t hidden, float eps) {
#pragma omp parallel for schedule(static) if (rows * hidden >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        if (dtype) {
            const uint16_t *res = residual ? (const uint16_t *)residual + r * residual_stride : NULL;
            rms_norm_row_bf16((const uint16_t *)x + r * x_stride, res, (uint16_t *)summed + r * hidden,
                              (const uint16_t *)weight, (uint16_t *)out + r * hidden, hidden, eps);
        } else {
            const float *res = residual ? (const float *)residual + r * residual_stride : NULL;
            rms_norm_row_f32((const float *)x + r * x_stride, res, (float *)summed + r * hidden,
                             (const float *)weight, (float *)out + r * hidden, hidden, eps);
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* The bfloat16 row with AVX512-BF16's rounding conversion (vcvtneps2bf16,
 * round to nearest even like f32_to_bf16) and the same exp polynomial.
 * silu(g) rounded to bfloat16 depends on g's 16 bits only, so the vector
 * body looks it up in a table of all 65,536 (256 KiB, filled when the
 * library loads, by this same arithmetic): one gather instead of the exp
 * polynomial, the division and a rounding, which took ~30 vector operations
 * per 16 elements. The tail keeps the scalar formula it always had. */
static float silu_bf16_table[65536];

static __m512 silu16_rounded(__m512 g) {
    __m512 one_plus_exp = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16_clamped(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    return widen16_bf16(bf16x16(_mm512_div_ps(g, one_plus_exp)));
}

__attribute__((constructor)) static void fill_silu_bf16_table(void) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int32_t bits = 0; bits < 65536; bits += 16) {
        __m512i g = _mm512_slli_epi32(_mm512_add_epi32(_mm512_set1_epi32(bits), lanes), 16);
        _mm512_storeu_ps(silu_bf16_table + bits, silu16_rounded(_mm512_castsi512_ps(g)));
    }
}

static void silu_and_mul_row_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int64_t width) {
    int64_t i = 0;
    for (; i + 16 <= width; i += 16) {
        __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(g + i)));
        __m512 silu = _mm512_i32gather_ps(bits, silu_bf16_table, 4);
        _mm256_storeu_si256((__m256i *)(o + i), bf16x16(_mm512_mul_ps(silu, load16_bf16(u + i, 0xffff))));
    }
    for (; i < width; i++) {
        float gi = bf16_to_f32(g[i]);
        o[i] = f32_to_bf16(round_bf16(gi / (1.0f + exp_clamped(-gi))) * bf16_to_f32(u[i]));
    }
}
#else
static void silu_and_mul_row_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int64_t width) {
#pragma omp simd
    for (int64_t i = 0; i < width; i++) {
        float gi = bf16_to_f32(g[i]);
        o[i] = f32_to_bf16(round_bf16(gi / (1.0f + exp_clamped(-gi))) * bf16_to_f32(u[i]));
    }
}
#endif

/* out[r] = silu(gate) * up, gate_up[r] = [gate | up], each `width` wide.
 * silu is rounded to dtype before the product, as torch's two ops round. */
void silu_and_mul(int dtype, const void *gate_up, int64_t in_stride, void *out, int64_t out_stride, int64_t rows,
                  int64_t width) {
#pragma omp parallel for schedule(static) if (rows * width >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        int64_t in_row = r * in_stride, out_row = r * out_stride;
        if (dtype) {
            const uint16_t *g = (const uint16_t *)gate_up + in_row;
            silu_and_mul_row_bf16(g, g + width, (uint16_t *)out + out_row, width);
        } else {
            const float *g = (const float *)gate_up + in_row, *u = g + width;
            float *o = (float *)out + out_row;
#pragma omp simd
            for (int64_t i = 0; i < width; i++) o[i] = g[i] / (1.0f + exp_clamped(-g[i])) * u[i];
        }
    }
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* One head's bfloat16 rotation, 16 pairs a time (the last masked), every
 * product and sum rounded as the portable loop below. */
static void rotate_head_bf16(uint16_t *x1, uint16_t *x2, const float *c, const float *s, int64_t half) {
    for (int64_t i = 0; i < half; i += 16) {
        __mmask16 m = mask16(half - i);
        __m512 a = load16_bf16(x1 + i, m), b = load16_bf16(x2 + i, m);
        __m512 ci = _mm512_maskz_loadu_ps(m, c + i), si = _mm512_maskz_loadu_ps(m, s + i);
        __m512 ac = _mm512_mul_ps(a, ci), bs = _mm512_mul_ps(b, si), bc = _mm512_mul_ps(b, ci), as = _mm512_mul_ps(a, si);
        round2_bf16(&ac, &bs);
        round2_bf16(&bc, &as);
        __m512i both = bf16x32(_mm512_sub_ps(ac, bs), _mm512_add_ps(bc, as));
        _mm256_mask_storeu_epi16(x1 + i, m, _mm512_castsi512_si256(both));
        _mm256_mask_storeu_epi16(x2 + i, m, _mm512_extracti64x4_epi64(both, 1));
    }
}
#else
static void rotate_head_bf16(uint16_t *x1, uint16_t *x2, const float *c, const float *s, int64_t half) {
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        float a = bf16_to_f32(x1[i]), b = bf16_to_f32(x2[i]);
        x1[i] = f32_to_bf16(round_bf16(a * c[i]) - round_bf16(b * s[i]));
        x2[i] = f32_to_bf16(round_bf16(b * c[i]) + round_bf16(a * s[i]));
    }
}
#endif

/* Rotate-half (GPT-NeoX) rotary embedding of x[t, h, :] in place, for
 * `heads` heads of `head_size` per token; cos / sin: [t, >= head_size / 2],
 * float32 or bfloat16 (table_dtype; both halves of a head use the first
 * half). In bfloat16 cos and sin are rounded to bfloat16 first and every
 * product and sum is rounded, as torch's x * cos, out1 -= x2 * sin,
 * out2 += x1 * sin do. */
void rotary_embedding(int dtype, void *x, int64_t token_stride, int64_t head_stride, int64_t tokens, int64_t heads,
                      int64_t head_size, int table_dtype, const void *cos, const void *sin, int64_t table_stride) {
    int64_t half = head_size / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * head_size >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        float c[half], s[half];
        for (int64_t i = 0; i < half; i++) {
            int64_t j = t * table_stride + i;
            c[i] = table_dtype ? bf16_to_f32(((const uint16_t *)cos)[j]) : ((const float *)cos)[j];
            s[i] = table_dtype ? bf16_to_f32(((const uint16_t *)sin)[j]) : ((const float *)sin)[j];
            if (dtype) c[i] = round_bf16(c[i]), s[i] = round_bf16(s[i]);
        }
        for (int64_t h = 0; h < heads; h++) {
            int64_t base = t * token_stride + h * head_stride;
            if (dtype) {
                uint16_t *x1 = (uint16_t *)x + base;
                rotate_head_bf16(x1, x1 + half, c, s, half);
            } else {
                float *x1 = (float *)x + base, *x2 = x1 + half;
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    float a = x1[i], b = x2[i];
                    x1[i] = a * c[i] - b * s[i];
                    x2[i] = b * c[i] + a * s[i];
                }
            }
        }
    }
}
