/* Arithmetic shared by pagedllm's CPU kernels (cpu_ops.c, paged_decode.c,
 * prefill_attention.c): bfloat16 conversions that round as torch does, and
 * a vectorisable exp. platforms/cpu/kernel_build.py puts this folder on the
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
/* 16 floats rounded to bf16 by integer arithmetic, as f32_to_bf16 (NaN
 * stays NaN, quieted): each lane's bf16 in its upper 16 bits. */
static inline __m512i bf16_bits_by_integers(__m512 x) {
    __m512i bits = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x400000));
}

/* 16 floats to bf16 by integer arithmetic (see bf16_bits_by_integers). */
static inline __m256i bf16x16_by_integers(__m512 x) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits_by_integers(x), 16));
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

/* Lanes [0, n) of 32. */
static inline __mmask32 mask32(int64_t n) {
    return n >= 32 ? (__mmask32)0xffffffffu : n <= 0 ? 0 : (__mmask32)((1u << n) - 1);
}

/* 32 bf16 values in the even/odd layout: 32 consecutive bf16 in one
 * register widen to two float registers with one operation each, the
 * even-indexed elements in `even` and the odd ones in `odd` (lane j holds
 * elements 2j and 2j + 1), instead of two each in element order.
 * Elementwise arithmetic does not care, as long as every operand is in it. */
static inline __m512 even_bf16(__m512i packed) { return _mm512_castsi512_ps(_mm512_slli_epi32(packed, 16)); }
static inline __m512 odd_bf16(__m512i packed) {
    return _mm512_castsi512_ps(_mm512_and_si512(packed, _mm512_set1_epi32((int)0xffff0000u)));
}

/* 32 floats in the even/odd layout to 32 bf16 in element order, rounded as
 * f32_to_bf16: vcvtne2ps2bf16 converts 32 in the time vcvtneps2bf16 takes
 * for 16, and one word permutation interleaves them. Lanes holding a
 * denormal, which it reads as zero, take the integer rounding. */
static inline __m512i bf16x32_even_odd(__m512 even, __m512 odd) {
#if defined(__AVX512BF16__)
    static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                            8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    if (__builtin_expect(_kortestz_mask16_u8(_mm512_fpclass_ps_mask(even, 0x20), _mm512_fpclass_ps_mask(odd, 0x20)), 1)) {
        __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(odd, even); /* evens in words 0-15, odds in 16-31 */
        return _mm512_permutexvar_epi16(_mm512_loadu_si512(interleave), packed);
    }
#endif
    return _mm512_mask_blend_epi16(0xaaaaaaaau, _mm512_srli_epi32(bf16_bits_by_integers(even), 16),
                                   bf16_bits_by_integers(odd));
}

/* a and b rounded to bf16 (as f32_to_bf16) and back to floats, lanes in
 * place: one vcvtne2ps2bf16 for both, and a word permutation that puts a's
 * in the upper and b's in the lower half of each 32-bit lane. */
static inline void round2_bf16(__m512 *a, __m512 *b) {
#if defined(__AVX512BF16__)
    static const uint16_t spread[32] = {16, 0, 17, 1, 18, 2, 19, 3, 20, 4, 21, 5, 22, 6, 23, 7,
                                        24, 8, 25, 9, 26, 10, 27, 11, 28, 12, 29, 13, 30, 14, 31, 15};
    if (__builtin_expect(_kortestz_mask16_u8(_mm512_fpclass_ps_mask(*a, 0x20), _mm512_fpclass_ps_mask(*b, 0x20)), 1)) {
        __m512i both = _mm512_permutexvar_epi16(_mm512_loadu_si512(spread), (__m512i)_mm512_cvtne2ps_pbh(*b, *a));
        *a = odd_bf16(both);
        *b = even_bf16(both);
        return;
    }
#endif
    __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    *a = _mm512_castsi512_ps(_mm512_and_si512(bf16_bits_by_integers(*a), high));
    *b = _mm512_castsi512_ps(_mm512_and_si512(bf16_bits_by_integers(*b), high));
}

/* 32 floats, elements 0-15 in lo and 16-31 in hi, to 32 bf16 in order. */
static inline __m512i bf16x32(__m512 lo, __m512 hi) {
#if defined(__AVX512BF16__)
    if (__builtin_expect(_kortestz_mask16_u8(_mm512_fpclass_ps_mask(lo, 0x20), _mm512_fpclass_ps_mask(hi, 0x20)), 1))
        return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
#endif
    return _mm512_inserti64x4(_mm512_castsi256_si512(bf16x16_by_integers(lo)), bf16x16_by_integers(hi), 1);
}
#endif /* __AVX512BW__ && __AVX512VL__ */
#endif /* __AVX512F__ */

#endif /* PAGEDLLM_CPU_KERNEL_MATH_H */
