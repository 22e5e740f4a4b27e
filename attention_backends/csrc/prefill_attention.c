/* Causal attention of fresh prefills (a request's keys are exactly its own
 * query rows of this step, nothing cached) on the CPU, every request of the
 * step in one call.
 *
 * Flash-style: a work item is one request's block of QB query rows and one
 * KV head, with the G query heads of that KV head (G * QB score rows); keys
 * are taken KC at a time with an online softmax in float32 (a prompt of up
 * to KC tokens is one chunk: no rescaling at all). Scores stay unscaled
 * until the softmax, which applies the scale in the same FMA that subtracts
 * the running max (AMX stores its score tiles straight into S). The causal limit skips
 * the key blocks past a tile's last row. bfloat16 on a CPU with AMX (and
 * allow_amx): scores are 16 x 16 tile products of the query rows and the
 * packed keys (exact bf16 products summed in float32, as torch's SDPA), and
 * P.V tile products of P, split in P_PARTS bf16 parts, with the values in
 * key pairs. Otherwise scores come from AVX512-BF16's dot product (bf16) or
 * float32 FMAs, and P.V is float32 FMAs from float32 probabilities. Without
 * AMX the bf16 kernel was only 1.1x faster than SDPA (16 prompts of 64-256
 * tokens, 12/4 heads of 64, one thread); with AMX 1.6x.
 *
 * Layout trick: a first parallel pass packs each KV head's keys 16 at a time
 * so that one vector holds one head dim (float32) or one pair of head dims
 * (bfloat16) of 16 keys; a query row's scores against 16 keys are then D
 * (or D/2) FMAs / dot products with the query's element broadcast, and no
 * horizontal sums (the decode kernel's sum16 shuffles); the bf16 layout is
 * also AMX's B tile. Values are converted to float32 (AMX: interleaved in
 * key pairs) once in the same pass.
 *
 * Needs AVX-512 (-march=native on a CPU that has it): elsewhere the entry
 * point returns -1 and prefill_attention_available() 0, and the caller keeps
 * torch's SDPA. Loaded through ctypes; see attention_backends/cpu_prefill_kernel.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_amx.h"
#include "cpu_kernel_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_AVX512 1
#if defined(__AVX512BF16__)
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

#define QB 16      /* query rows of a work item */
/* Keys per online-softmax chunk. 512, not 256: half the rescaling passes
 * over O and P.V's tile loads per key for long prompts (a 2,048-token
 * prompt's attention took 0.88-0.91x the time, 2 threads), no slower for
 * short ones; S and P stay within L2. */
#define KC 512
#define RQ 8       /* score rows per QK register tile */
#define RV 6       /* score rows per P.V register tile (6 x 4 accumulators) */
#define MAX_HEAD_SIZE 256
/* P's bf16 parts: P = p0 + p1 to ~17 bits (p0 + p1 + p2 to float32's 24).
 * Two parts put a bf16 output at most half an ulp plus ~1e-5 from the exact
 * result (three: plus float32 summation error only); three took 1.3x the
 * time of the whole kernel on the 100M model's prompts. */
#ifndef P_PARTS
#define P_PARTS 2
#endif

typedef struct {
    int bf16, kdot; /* kdot: keys packed as bf16 pairs for _mm512_dpbf16_ps (and AMX) */
    int amx;        /* scores by AMX tiles (bf16, CPU and kernel allow it) */
    const char *q, *k, *v;
    char *out;
    int64_t q_stride, k_stride, v_stride, out_stride; /* elements between rows */
    int num_heads, num_kv_heads, head_size, group;
    float scale;
    const float *sinks;           /* [num_heads] sink logits, or NULL */
    const int64_t *rows;          /* [num_reqs][2]: request r's rows [rows[2r], rows[2r + 1]) */
    const int64_t *kblock_starts; /* [num_reqs + 1]: request r's first 16-key block */
    const int64_t *vrow_starts;   /* [num_reqs + 1]: request r's first row in vpack (AMX: padded to 32) */
    int64_t total_blocks, total_rows;
    char *kpack;  /* [Hkv][total_blocks][D (or D/2 pairs)][16] */
    char *vpack;  /* float32 [Hkv][total_rows][D]; AMX: bf16 key pairs [Hkv][total_rows / 2][D][2] */
} plan_t;

/* Head dims of a packed key block: AMX reads 32 dims (16 pairs) per tile,
 * so its blocks are padded with zero pairs to a multiple of 32. */
static inline int packed_dims(const plan_t *p) { return p->amx ? (p->head_size + 31) / 32 * 32 : p->head_size; }
static inline int64_t kblock_bytes(const plan_t *p) { return (int64_t)packed_dims(p) * 16 * (p->kdot ? 2 : 4); }

/* Packs KV head j's keys of request r's block b and converts its values. */
/* permutex2var indices: lanes 2i, 2i + 1 = x[i], y[i] for i < 16 (lo) or 16 <= i < 32 (hi). */
static inline __m512i interleave_lo(void) {
    return _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3,
                            34, 2, 33, 1, 32, 0);
}
static inline __m512i interleave_hi(void) {
    return _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54, 22, 53, 21, 52, 20,
                            51, 19, 50, 18, 49, 17, 48, 16);
}

static void pack_block(const plan_t *p, int64_t r, int j, int64_t b) {
    const int D = p->head_size, elt = p->bf16 ? 2 : 4;
    const int64_t row0 = p->rows[2 * r] + 16 * b, nt = p->rows[2 * r + 1] - row0 < 16 ? p->rows[2 * r + 1] - row0 : 16;
    char *dst = p->kpack + ((int64_t)j * p->total_blocks + p->kblock_starts[r] + b) * kblock_bytes(p);
    if (nt < 16 || packed_dims(p) != D) memset(dst, 0, (size_t)kblock_bytes(p)); /* padding: finite, masked out or times 0 */
    for (int64_t t = 0; t < nt; t++) {
        const char *krow = p->k + ((row0 + t) * p->k_stride + (int64_t)j * D) * elt;
        if (p->kdot) { /* a scatter per 16 pairs: the scalar transpose was 5 % of the kernel */
            const __m512i stride = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                      _mm512_set1_epi32(16));
            for (int i = 0; i < D / 2; i += 16) { /* masked: D = 80 has 40 pairs, not 48 */
                __mmask16 mk = mask16(D / 2 - i);
                _mm512_mask_i32scatter_epi32((uint32_t *)dst + i * 16 + t, mk, stride,
                                             _mm512_maskz_loadu_epi32(mk, krow + 4 * i), 4);
            }
        } else if (p->bf16) {
            for (int d = 0; d < D; d++) ((float *)dst)[d * 16 + t] = bf16_to_f32(((const uint16_t *)krow)[d]);
        } else {
            for (int d = 0; d < D; d++) ((float *)dst)[d * 16 + t] = ((const float *)krow)[d];
        }
        const char *vrow = p->v + ((row0 + t) * p->v_stride + (int64_t)j * D) * elt;
        int64_t vr = p->vrow_starts[r] + 16 * b + t;
        if (p->amx) { /* keys t and t + 1 interleaved (vrow_starts and blocks are even) */
            if (t % 2) continue;
            const uint16_t *a = (const uint16_t *)vrow, *c = (const uint16_t *)(vrow + p->v_stride * elt);
            uint16_t *vdst = (uint16_t *)p->vpack + (int64_t)j * p->total_rows * D + vr * D;
            for (int d = 0; d < D; d += 32) {
                __mmask32 mk = D - d >= 32 ? 0xffffffffu : (1u << (D - d)) - 1, mc = t + 1 < nt ? mk : 0;
                __m512i x = _mm512_maskz_loadu_epi16(mk, a + d), y = _mm512_maskz_loadu_epi16(mc, c + d);
                _mm512_storeu_si512(vdst + 2 * d, _mm512_permutex2var_epi16(x, interleave_lo(), y));
                if (D - d > 16) _mm512_storeu_si512(vdst + 2 * d + 32, _mm512_permutex2var_epi16(x, interleave_hi(), y));
            }
            continue;
        }
        float *vdst = (float *)p->vpack + ((int64_t)j * p->total_rows + vr) * D;
        for (int d = 0; d < D; d++) vdst[d] = p->bf16 ? bf16_to_f32(((const uint16_t *)vrow)[d]) : ((const float *)vrow)[d];
    }
    int64_t len = p->rows[2 * r + 1] - p->rows[2 * r];
    if (p->amx && 16 * b + 16 >= len) /* last block: zero values up to the 32-key padding (0 * NaN is NaN) */
        for (int64_t vr = p->vrow_starts[r] + len; vr < p->vrow_starts[r + 1]; vr++) {
            uint16_t *vdst = (uint16_t *)p->vpack + (int64_t)j * p->total_rows * D + (vr / 2) * 2 * D + vr % 2;
            for (int d = 0; d < D; d++) vdst[2 * d] = 0;
        }
}

/* A work item's rows: score row s is query head j * G + s / nq, query row i0 + s % nq. */
typedef struct {
    int64_t r, i0; /* request, first query row (request-relative) */
    int nq, j;
} item_t;

/* Score row s's accumulator row: AMX tiles take 16 rows of one head. */
static inline int64_t o_row(const plan_t *p, const item_t *it, int s) {
    return p->amx ? (int64_t)(s / it->nq) * 16 + s % it->nq : s;
}

static inline const char *q_row(const plan_t *p, const item_t *it, int s) {
    int g = s / it->nq, i = s % it->nq;
    int64_t row = p->rows[2 * it->r] + it->i0 + i;
    return p->q + (row * p->q_stride + (int64_t)(it->j * p->group + g) * p->head_size) * (p->bf16 ? 2 : 4);
}

/* Scores of RQ rows against one packed block of 16 keys. */
static inline __attribute__((always_inline)) void qk_tile(const plan_t *p, const char *const qr[RQ], const char *kb,
                                                          __m512 acc[RQ]) {
    const int D = p->head_size;
    for (int s = 0; s < RQ; s++) acc[s] = _mm512_setzero_ps();
#if HAVE_BF16_DOT
    if (p->kdot) {
        for (int i = 0; i < D / 2; i++) {
            __m512bh kv = (__m512bh)_mm512_loadu_si512(kb + (int64_t)i * 64);
#pragma GCC unroll 8
            for (int s = 0; s < RQ; s++)
                acc[s] = _mm512_dpbf16_ps(acc[s], (__m512bh)_mm512_set1_epi32(((const int32_t *)qr[s])[i]), kv);
        }
        return;
    }
#endif
    for (int d = 0; d < D; d++) {
        __m512 kv = _mm512_loadu_ps(kb + (int64_t)d * 64);
#pragma GCC unroll 8
        for (int s = 0; s < RQ; s++) {
            float qv = p->bf16 ? bf16_to_f32(((const uint16_t *)qr[s])[d]) : ((const float *)qr[s])[d];
            acc[s] = _mm512_fmadd_ps(_mm512_set1_ps(qv), kv, acc[s]);
        }
    }
}

/* Scaled scores of the item's rows for keys [k0, k1) into S[s][t - k0];
 * each row tile stops at its last row's causal limit. */
static void qk_chunk(const plan_t *p, const item_t *it, int64_t k0, int64_t k1, float *S) {
    const int rows = p->group * it->nq;
    const char *kbase = p->kpack + ((int64_t)it->j * p->total_blocks + p->kblock_starts[it->r]) * kblock_bytes(p);
    for (int s0 = 0; s0 < rows; s0 += RQ) {
        const char *qr[RQ];
        int64_t limit = 0; /* keys the tile's rows attend, past k0 */
        for (int s = 0; s < RQ; s++) {
            int ss = s0 + s < rows ? s0 + s : rows - 1;
            qr[s] = q_row(p, it, ss);
            int64_t last = it->i0 + ss % it->nq + 1;
            limit = last > limit ? last : limit;
        }
        limit = limit < k1 ? limit : k1;
        for (int64_t t0 = k0; t0 < limit; t0 += 16) {
            __m512 acc[RQ];
            qk_tile(p, qr, kbase + (t0 / 16) * kblock_bytes(p), acc);
            for (int s = 0; s < RQ && s0 + s < rows; s++)
                _mm512_storeu_ps(S + (int64_t)(s0 + s) * KC + (t0 - k0), acc[s]);
        }
    }
}

#if HAVE_AMX


/* All tiles 16 rows x 64 bytes. Scores: 0 (16 x 16 float32), 1 (16 query
 * rows x 32 bf16 dims), 2 (16 dim pairs x 16 keys, the packed key block).
 * P.V: 0-3 (16 rows x 16 dims of O, float32), 4 (16 key pairs x 16 dims
 * of V), 5, 6, 7 (16 rows x 32 keys of each of P's bf16 parts). */
static void amx_configure(void) {
    tile_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

/* qk_chunk by AMX: 16 query rows of one head x 16 keys per tile product,
 * from the item's zero-padded query rows qbuf [G][16][Dp]. The diagonal
 * tile computes its masked half too (softmax_chunk masks it). */
static void qk_chunk_amx(const plan_t *p, const item_t *it, int64_t k0, int64_t k1, const uint16_t *qbuf, float *S) {
    const int Dp = packed_dims(p);
    const int64_t kb_bytes = kblock_bytes(p), kend = it->i0 + it->nq < k1 ? it->i0 + it->nq : k1;
    const char *kbase = p->kpack + ((int64_t)it->j * p->total_blocks + p->kblock_starts[it->r]) * kb_bytes;
    for (int g = 0; g < p->group; g++) {
        const uint16_t *qa = qbuf + (int64_t)g * 16 * Dp;
        for (int64_t t0 = k0; t0 < kend; t0 += 16) {
            const char *kb = kbase + (t0 / 16) * kb_bytes;
            _tile_zero(0);
            for (int c = 0; c < Dp / 32; c++) {
                _tile_loadd(1, qa + c * 32, Dp * 2);
                _tile_loadd(2, kb + (int64_t)c * 16 * 64, 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            /* Rows past the item's land on the next head's rows, which it stores after. */
            _tile_stored(0, S + (int64_t)g * it->nq * KC + (t0 - k0), KC * 4);
        }
    }
}

/* pv_chunk by AMX, from softmax_chunk's P as bf16 parts, each multiplied by
 * the exact bf16 values: P keeps float32's precision instead of being
 * rounded to bf16's 8 bits as a single bf16 product would (torch's SDPA
 * rounds it). */
static void pv_chunk_amx(const plan_t *p, const item_t *it, int64_t k0, int64_t k1, const uint16_t *pb, float *O) {
    const int D = p->head_size, slices = D / 16;
    const int64_t kend = it->i0 + it->nq < k1 ? it->i0 + it->nq : k1, n32 = (kend - k0 + 31) / 32 * 32;
    const char *vbase = p->vpack + ((int64_t)it->j * p->total_rows + p->vrow_starts[it->r] + k0) * D * 2;
    for (int g = 0; g < p->group; g++) {
        const uint16_t *pg = pb + (int64_t)g * P_PARTS * 16 * KC;
        float *og = O + (int64_t)g * 16 * D;
        /* Up to 4 16-dim slices of O stay in tiles 0-3 over the chunk, so
         * P's tiles are loaded once per 4 slices, not once per slice. */
        for (int c0 = 0; c0 < slices; c0 += 4) {
            const int nc = slices - c0 < 4 ? slices - c0 : 4;
            float *oc = og + c0 * 16;
            const char *vc = vbase + (int64_t)c0 * 64;
            _tile_loadd(0, oc, D * 4);
            if (nc > 1) _tile_loadd(1, oc + 16, D * 4);
            if (nc > 2) _tile_loadd(2, oc + 32, D * 4);
            if (nc > 3) _tile_loadd(3, oc + 48, D * 4);
            for (int64_t kk = 0; kk < n32; kk += 32) {
                const char *v = vc + kk * D * 2;
                _tile_loadd(5, pg + kk, KC * 2);
                _tile_loadd(6, pg + 16 * KC + kk, KC * 2);
#if P_PARTS == 3
                _tile_loadd(7, pg + 32 * KC + kk, KC * 2);
#define PV_SLICE(T)                                                                                            \
    do {                                                                                                       \
        _tile_loadd(4, v + (T) * 64, D * 4);                                                                   \
        _tile_dpbf16ps(T, 7, 4);                                                                               \
        _tile_dpbf16ps(T, 6, 4);                                                                               \
        _tile_dpbf16ps(T, 5, 4);                                                                               \
    } while (0)
#else
#define PV_SLICE(T)                                                                                            \
    do {                                                                                                       \
        _tile_loadd(4, v + (T) * 64, D * 4);                                                                   \
        _tile_dpbf16ps(T, 6, 4);                                                                               \
        _tile_dpbf16ps(T, 5, 4);                                                                               \
    } while (0)
#endif
                PV_SLICE(0);
                if (nc > 1) PV_SLICE(1);
                if (nc > 2) PV_SLICE(2);
                if (nc > 3) PV_SLICE(3);
#undef PV_SLICE
            }
            _tile_stored(0, oc, D * 4);
            if (nc > 1) _tile_stored(1, oc + 16, D * 4);
            if (nc > 2) _tile_stored(2, oc + 32, D * 4);
            if (nc > 3) _tile_stored(3, oc + 48, D * 4);
        }
    }
}

/* The item's query rows, head-major, zero-padded to 16 rows and Dp dims. */
static void gather_queries(const plan_t *p, const item_t *it, uint16_t *qbuf) {
    const int Dp = packed_dims(p), D = p->head_size;
    memset(qbuf, 0, sizeof(uint16_t) * (size_t)p->group * 16 * (size_t)Dp);
    for (int s = 0; s < p->group * it->nq; s++)
        memcpy(qbuf + ((int64_t)(s / it->nq) * 16 + s % it->nq) * Dp, q_row(p, it, s), sizeof(uint16_t) * (size_t)D);
}
#else
static int amx_permitted(void) { return 0; }
#endif

/* Online softmax step of every row over keys [k0, k1): masks keys past the
 * row, turns S into probabilities relative to the new running max, rescales
 * O. With pb (AMX), the probabilities go to pb [G][P_PARTS][16][KC] as
 * bf16 parts instead, zero up to a multiple of 32 keys: a second pass
 * over S to convert them cost as much as the exps. */
static void softmax_chunk(const plan_t *p, const item_t *it, int64_t k0, int64_t k1, float *S, float *O, float *m,
                          float *l, uint16_t *pb) {
    const int rows = p->group * it->nq, D = p->head_size;
    for (int s = 0; s < rows; s++) {
        int64_t end = it->i0 + s % it->nq + 1; /* causal: keys < end */
        end = end < k1 ? end : k1;
        float *sr = S + (int64_t)s * KC;
        int64_t n = end - k0, width = pb ? (k1 - k0 + 31) / 32 * 32 : (k1 - k0 + 15) / 16 * 16;
        uint16_t *part = pb ? pb + ((int64_t)(s / it->nq) * P_PARTS * 16 + s % it->nq) * KC : NULL;
        if (n <= 0) { /* whole chunk masked for this row (not reached: chunks start at a query block) */
            for (int c = 0; pb && c < P_PARTS; c++) memset(part + c * 16 * KC, 0, sizeof(uint16_t) * (size_t)width);
            if (!pb)
                memset(sr, 0, sizeof(float) * (size_t)width);
            continue;
        }
        __m512 mx = _mm512_set1_ps(-INFINITY), scale = _mm512_set1_ps(p->scale);
        for (int64_t i = 0; i < n; i += 16)
            mx = _mm512_mask_max_ps(mx, mask16(n - i), mx, _mm512_mul_ps(_mm512_loadu_ps(sr + i), scale));
        float m_new = _mm512_reduce_max_ps(mx);
        m_new = m_new > m[s] ? m_new : m[s];
        float corr = m[s] == -INFINITY ? 0.0f : expf(m[s] - m_new);
        __m512 mb = _mm512_set1_ps(m_new), sum = _mm512_setzero_ps();
        for (int64_t i = 0; i < width; i += 16) {
            __mmask16 k = mask16(n - i);
            __m512 e = _mm512_maskz_mov_ps(k, exp16_clamped(_mm512_fmsub_ps(_mm512_loadu_ps(sr + i), scale, mb)));
            sum = _mm512_add_ps(sum, e);
#if HAVE_AMX
            if (pb) {
                __m512 rest = e;
                for (int c = 0; c < P_PARTS; c++) {
                    __m256i h = (__m256i)_mm512_cvtneps_pbh(rest);
                    _mm256_storeu_si256((__m256i *)(part + c * 16 * KC + i), h);
                    rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
                }
                continue;
            }
#endif
            _mm512_storeu_ps(sr + i, e);
        }
        l[s] = l[s] * corr + _mm512_reduce_add_ps(sum);
        if (corr != 1.0f && m[s] != -INFINITY) /* the first chunk's O is still 0 */
            for (int d = 0; d < D; d++) O[o_row(p, it, s) * D + d] *= corr;
        m[s] = m_new;
    }
}

/* O[s][d0 .. d0+64) += sum over keys [k0, limit) of P[s][t] * v_t for HT rows. */
static inline __attribute__((always_inline)) void pv_tile(const int HT, const plan_t *p, const float *P, float *O,
                                                          const float *vb, int64_t nk, int d0) {
    const int D = p->head_size;
    __mmask16 m[4];
    __m512 acc[RV][4];
    for (int c = 0; c < 4; c++) m[c] = mask16(D - d0 - 16 * c);
    for (int h = 0; h < HT; h++)
        for (int c = 0; c < 4; c++) acc[h][c] = _mm512_maskz_loadu_ps(m[c], O + (int64_t)h * D + d0 + 16 * c);
    for (int64_t t = 0; t < nk; t++) {
        __m512 v[4];
        for (int c = 0; c < 4; c++) v[c] = _mm512_maskz_loadu_ps(m[c], vb + t * D + d0 + 16 * c);
        for (int h = 0; h < HT; h++) {
            __m512 pb = _mm512_set1_ps(P[(int64_t)h * KC + t]);
            for (int c = 0; c < 4; c++) acc[h][c] = _mm512_fmadd_ps(pb, v[c], acc[h][c]);
        }
    }
    for (int h = 0; h < HT; h++)
        for (int c = 0; c < 4; c++) _mm512_mask_storeu_ps(O + (int64_t)h * D + d0 + 16 * c, m[c], acc[h][c]);
}

static void pv_chunk(const plan_t *p, const item_t *it, int64_t k0, int64_t k1, const float *S, float *O) {
    const int rows = p->group * it->nq, D = p->head_size;
    const float *vb = (const float *)p->vpack + ((int64_t)it->j * p->total_rows + p->vrow_starts[it->r] + k0) * D;
    for (int s0 = 0; s0 < rows; s0 += RV) {
        int ht = rows - s0 < RV ? rows - s0 : RV;
        int64_t limit = 0;
        for (int s = s0; s < s0 + ht; s++) {
            int64_t last = it->i0 + s % it->nq + 1;
            limit = last > limit ? last : limit;
        }
        limit = limit < k1 ? limit : k1;
        if (limit <= k0) continue;
        for (int d0 = 0; d0 < D; d0 += 64) {
            const float *P = S + (int64_t)s0 * KC;
            float *o = O + (int64_t)s0 * D;
            switch (ht) {
            case 1: pv_tile(1, p, P, o, vb, limit - k0, d0); break;
            case 2: pv_tile(2, p, P, o, vb, limit - k0, d0); break;
            case 3: pv_tile(3, p, P, o, vb, limit - k0, d0); break;
            case 4: pv_tile(4, p, P, o, vb, limit - k0, d0); break;
            case 5: pv_tile(5, p, P, o, vb, limit - k0, d0); break;
            default: pv_tile(6, p, P, o, vb, limit - k0, d0); break;
            }
        }
    }
}

static void attend_item(const plan_t *p, const item_t *it, float *S, float *O, float *m, float *l, uint16_t *qbuf,
                        uint16_t *pbuf /* [G][P_PARTS][16][KC] */) {
    const int rows = p->group * it->nq, D = p->head_size, elt = p->bf16 ? 2 : 4;
    const int64_t kend = it->i0 + it->nq;
    for (int s = 0; s < rows; s++) m[s] = -INFINITY, l[s] = 0.0f;
    memset(O, 0, sizeof(float) * (size_t)p->group * QB * (size_t)D);
#if HAVE_AMX
    if (p->amx) gather_queries(p, it, qbuf);
    if (p->amx && it->nq < QB) { /* the tiles' rows past the item's, as far as P.V reads: P = 0 */
        int64_t cols = (kend < KC ? (kend + 31) / 32 * 32 : KC);
        for (int r = 0; r < p->group * P_PARTS; r++)
            for (int i = it->nq; i < 16; i++) memset(pbuf + ((int64_t)r * 16 + i) * KC, 0, sizeof(uint16_t) * (size_t)cols);
    }
#else
    (void)qbuf, (void)pbuf;
#endif
    for (int64_t k0 = 0; k0 < kend; k0 += KC) {
        int64_t k1 = kend - k0 < KC ? kend : k0 + KC;
#if HAVE_AMX
        if (p->amx)
            qk_chunk_amx(p, it, k0, k1, qbuf, S);
        else
#endif
            qk_chunk(p, it, k0, k1, S);
        softmax_chunk(p, it, k0, k1, S, O, m, l, p->amx ? pbuf : NULL);
#if HAVE_AMX
        if (p->amx)
            pv_chunk_amx(p, it, k0, k1, pbuf, O);
        else
#endif
            pv_chunk(p, it, k0, k1, S, O);
    }
    for (int s = 0; s < rows; s++) {
        int g = s / it->nq, i = s % it->nq;
        int64_t row = p->rows[2 * it->r] + it->i0 + i;
        char *dst = p->out + (row * p->out_stride + (int64_t)(it->j * p->group + g) * D) * elt;
        /* A sink adds its exp to the denominator only: its probability is dropped. */
        float sink = p->sinks ? expf(p->sinks[it->j * p->group + g] - m[s]) : 0.0f;
        const __m512 inv = _mm512_set1_ps(1.0f / (l[s] + sink));
        const float *o = O + o_row(p, it, s) * D;
        for (int d = 0; d < D; d += 16) { /* head sizes are multiples of 16 */
            __m512 x = _mm512_mul_ps(_mm512_loadu_ps(o + d), inv);
            if (p->bf16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)dst + d), bf16x16(x));
            else
                _mm512_storeu_ps((float *)dst + d, x);
        }
    }
}

int prefill_attention_available(void) { return 1; }

/* Causal attention of num_reqs fresh prefills.
 *
 * dtype: 0 float32, 1 bfloat16 (q, k, v and out alike).
 * Request r owns rows [rows[2r], rows[2r + 1]) of q, k, v and out (requests
 * need not be adjacent: decode rows may lie between them).
 * q: row t, head h at q + t * q_stride + h * head_size (elements); k and v
 * likewise with their strides and num_kv_heads heads; out likewise.
 * allow_amx: 0 keeps bfloat16 scores on AVX512-BF16 even where AMX is there.
 * sinks (NULL: none): float32 [num_heads], query head h's sink logit: one
 * more logit in each row's softmax whose probability is dropped.
 * Returns 0, or -1 for an unsupported shape or a failed allocation.
 */
int prefill_attention(int dtype, const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                      int64_t v_stride, void *out, int64_t out_stride, const int64_t *rows, int64_t num_reqs,
                      int num_heads, int num_kv_heads, int head_size, float scale, int allow_amx,
                      const float *sinks) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || head_size <= 0 || head_size % 16 ||
        head_size > MAX_HEAD_SIZE || num_reqs <= 0 || (dtype != 0 && dtype != 1))
        return -1;
    int amx = dtype == 1 && HAVE_AMX && allow_amx && amx_permitted();
    plan_t p = {dtype, dtype == 1 && HAVE_BF16_DOT, amx, q, k, v, out, q_stride, k_stride, v_stride, out_stride,
                num_heads, num_kv_heads, head_size, num_heads / num_kv_heads, scale, sinks, rows, NULL, NULL, 0, 0,
                NULL, NULL};
    int64_t *kblock_starts = malloc(sizeof(int64_t) * 2 * (size_t)(num_reqs + 1));
    if (!kblock_starts) return -1;
    int64_t *vrow_starts = kblock_starts + num_reqs + 1;
    int64_t num_items = 0;
    kblock_starts[0] = vrow_starts[0] = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
        int64_t len = rows[2 * r + 1] - rows[2 * r];
        if (len <= 0) {
            free(kblock_starts);
            return -1;
        }
        kblock_starts[r + 1] = kblock_starts[r] + (len + 15) / 16;
        vrow_starts[r + 1] = vrow_starts[r] + (p.amx ? (len + 31) / 32 * 32 : len);
        num_items += (len + QB - 1) / QB * num_kv_heads;
    }
    p.kblock_starts = kblock_starts, p.vrow_starts = vrow_starts;
    p.total_blocks = kblock_starts[num_reqs];
    p.total_rows = vrow_starts[num_reqs];
    p.kpack = malloc((size_t)(num_kv_heads * p.total_blocks * kblock_bytes(&p)));
    p.vpack = malloc((size_t)(num_kv_heads * p.total_rows * head_size * (p.amx ? 2 : 4)));
    item_t *items = malloc(sizeof(item_t) * (size_t)(num_items > 0 ? num_items : 1));
    if (!p.kpack || !p.vpack || !items) {
        free(kblock_starts), free(p.kpack), free(p.vpack), free(items);
        return -1;
    }
    int failed = 0;
    /* Work items longest first (a query block's work grows with its last row),
     * so the dynamic schedule ends with short items. */
    int64_t n = 0, max_qb = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
        int64_t len = rows[2 * r + 1] - rows[2 * r];
        max_qb = (len + QB - 1) / QB > max_qb ? (len + QB - 1) / QB : max_qb;
    }
    for (int64_t b = max_qb - 1; b >= 0; b--)
        for (int64_t r = 0; r < num_reqs; r++) {
            int64_t len = rows[2 * r + 1] - rows[2 * r];
            if (b * QB >= len) continue;
            for (int j = 0; j < num_kv_heads; j++)
                items[n++] = (item_t){r, b * QB, (int)(len - b * QB < QB ? len - b * QB : QB), j};
        }
    /* One team for both passes: the packing's implicit barrier keeps every
     * key block ready before any item reads it. Torch's own OpenMP team
     * (libgomp.so.1, loaded by torch), as in paged_decode.c. */
#pragma omp parallel if (num_items > 1) reduction(| : failed)
    {
        int rows = p.group * QB;
        float *S = malloc(sizeof(float) * (size_t)rows * KC), *O = malloc(sizeof(float) * (size_t)rows * head_size);
        float *m = malloc(sizeof(float) * (size_t)rows), *l = malloc(sizeof(float) * (size_t)rows);
        uint16_t *qbuf = malloc(sizeof(uint16_t) * (size_t)p.group * 16 * (size_t)packed_dims(&p));
        uint16_t *pbuf = malloc(sizeof(uint16_t) * (size_t)p.group * P_PARTS * 16 * KC);
        failed = !S || !O || !m || !l || !qbuf || !pbuf; /* then this thread's items are skipped and the call fails */
        /* Flush denormals to zero while this thread is in the kernel: a
         * probability near exp(-87) times a value is a denormal product, and
         * each cost ~100 cycles; real prompts have such scores (the step took
         * 2.5x the time of random inputs). The caller's mode is restored. */
        unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040u); /* FTZ | DAZ */
#if HAVE_AMX
        if (p.amx) amx_configure();
#endif
#pragma omp for schedule(static)
        for (int64_t i = 0; i < num_kv_heads * p.total_blocks; i++) {
            int j = (int)(i / p.total_blocks);
            int64_t blk = i % p.total_blocks, r = 0;
            while (kblock_starts[r + 1] <= blk) r++; /* few requests: a scan is enough */
            pack_block(&p, r, j, blk - kblock_starts[r]);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; i++)
            if (!failed) attend_item(&p, &items[i], S, O, m, l, qbuf, pbuf);
#if HAVE_AMX
        if (p.amx) _tile_release();
#endif
        _mm_setcsr(csr);
        free(S), free(O), free(m), free(l), free(qbuf), free(pbuf);
    }
    free(kblock_starts), free(p.kpack), free(p.vpack), free(items);
    return failed ? -1 : 0;
}
#else
int prefill_attention_available(void) { return 0; }

int prefill_attention(int dtype, const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                      int64_t v_stride, void *out, int64_t out_stride, const int64_t *rows, int64_t num_reqs,
                      int num_heads, int num_kv_heads, int head_size, float scale, int allow_amx,
                      const float *sinks) {
    (void)sinks, (void)allow_amx, (void)dtype, (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)out;
    (void)out_stride, (void)rows, (void)num_reqs, (void)num_heads, (void)num_kv_heads, (void)head_size, (void)scale;
    return -1;
}
#endif
