/* Arithmetic shared by pagedllm's CPU kernels (cpu_ops.c, paged_decode.c,
 * prefill_attention.c): bfloat16 conversions that round as torch does, and
 * a vectorisable exp. platforms/cpu_kernel_build.py puts this folder on the
 * include path and keys every build by this file too.
 */
#ifndef PAGEDLLM_CPU_KERNEL_MATH_H
#define PAGEDLLM_CPU_KERNEL_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* The value a bfloat16 op would have stored, as a float. */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* exp(x) within 2 ulp of expf (Cephes' expf polynomial), in a form the
 * compiler vectorises (libm's expf is a scalar call; floorf vectorises with
 * -fno-trapping-math). x is clamped to [-87.3, 88.7], where expf is finite
 * and normal: below, exp(-87.3) ~ 1.2e-38 stands for 0 (against a softmax
 * denominator of at least 1, it is). */
static inline float exp_clamped(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
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

#if defined(__AVX512F__)
#include <immintrin.h>

/* Lanes [0, n) of 16. */
static inline __mmask16 mask16(int64_t n) { return n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

/* exp_clamped on 16 lanes; the power of two by scalef. */
static inline __m512 exp16_clamped(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* 16 floats to bf16 by integer arithmetic, rounded to nearest even as
 * f32_to_bf16 (NaN stays NaN, quieted). */
static inline __m256i bf16x16_by_integers(__m512 x) {
    __m512i bits = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

/* 16 floats to bf16, rounded to nearest even as f32_to_bf16 (NaN stays NaN):
 * AVX512-BF16's conversion where the CPU has it. That conversion reads a
 * denormal float as zero (torch's does not), so lanes holding one, rare,
 * take the integer rounding. */
static inline __m256i bf16x16(__m512 x) {
#if defined(__AVX512BF16__)
    __m256i converted = (__m256i)_mm512_cvtneps_pbh(x);
    __mmask16 denormal = _mm512_fpclass_ps_mask(x, 0x20);
    if (__builtin_expect(denormal != 0, 0))
        converted = _mm256_mask_mov_epi16(converted, denormal, bf16x16_by_integers(x));
    return converted;
#else
    return bf16x16_by_integers(x);
#endif
}

/* 16 bf16 values as floats. */
static inline __m512 widen16_bf16(__m256i x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

/* 16 bf16 values from memory (masked lanes read as 0) as floats. */
static inline __m512 load16_bf16(const uint16_t *p, __mmask16 m) { return widen16_bf16(_mm256_maskz_loadu_epi16(m, p)); }
#endif /* __AVX512BW__ && __AVX512VL__ */
#endif /* __AVX512F__ */

#endif /* PAGEDLLM_CPU_KERNEL_MATH_H */
