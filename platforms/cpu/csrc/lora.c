/* The "lora" op on the CPU for decode-sized batches: platforms/cpu/lora.py.
 *
 * y[t] += (x[t] @ A[s].T) @ B[s].T for s = slots[t] in 1..num_slots, where
 * A is lora_a [num_slots + 1, R, K] and B lora_b [num_slots + 1, N, R]
 * (model_registry/layers/lora.py). A layer that stacks num_sub checkpoint
 * matrices gives sub-matrix i the rank block [i * max_rank, (i + 1) *
 * max_rank) and the output rows [out_offsets[i], out_offsets[i + 1]); B is
 * zero elsewhere, so the expand reads only those blocks.
 *
 * The rows are grouped by slot first (a counting sort over the slots, read
 * from memory: nothing comes from the host, so a CPU graph replays it with
 * whatever the slots hold then), so the rows of one adapter share every
 * read of its weights:
 *
 * - shrink: the grouped rows of x gathered as float32 once, then h (float32,
 *   the caller's scratch [T, R], in group order) = x @ A[s].T, one A row at
 *   a time against up to MAX_TILE rows of the group;
 * - expand: per block of 16 output rows and its rank block, the [16, r]
 *   block of B is widened to float32 and transposed once (into columns of
 *   16 outputs), then each row of the group adds sum_r h[r] * column[r]:
 *   16 outputs an FMA.
 *
 * Sums are float32; y (float32 or bfloat16, as x and the weights: dtype 0
 * or 1) is rounded once when the product is added. Rows whose slot is 0 or
 * out of range are left alone. Parallel over (group, A row) and (group,
 * output block) on torch's OpenMP team. AVX-512 only: lora_available()
 * says whether lora_apply runs here; elsewhere the caller's torch path does.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernel_math.h"

#define MAX_TILE 8      /* rows of a group sharing one pass over an A row */
#define MAX_RANK_PAD 512 /* the largest rank block the expand takes */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_KERNEL 1

/* 16 elements (masked lanes 0) of a float32 (bf16 == 0) or bfloat16 row, as floats. */
static inline __m512 load16(const void *p, int bf16, int64_t i, __mmask16 m) {
    return bf16 ? load16_bf16((const uint16_t *)p + i, m) : _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

/* h[j][r] = A_row . xf[j] for the tile's rows j (x's rows in group order, as
 * floats); `tile` is a constant where inlined, so acc stays in registers. */
static inline __attribute__((always_inline)) void shrink_tile(int tile, int bf16, const float *xf, int64_t K,
                                                              const void *a_row, float *h, int64_t R, int64_t r) {
    /* two accumulators a row (even and odd 16-input steps): a group of one
     * or two rows would otherwise wait on one FMA chain */
    __m512 even[MAX_TILE], odd[MAX_TILE];
    for (int j = 0; j < tile; j++) even[j] = odd[j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512 w0 = load16(a_row, bf16, k, 0xffff), w1 = load16(a_row, bf16, k + 16, 0xffff);
        for (int j = 0; j < tile; j++) {
            even[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xf + j * K + k), even[j]);
            odd[j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xf + j * K + k + 16), odd[j]);
        }
    }
    for (; k < K; k += 16) {
        __mmask16 m = mask16(K - k);
        __m512 w = load16(a_row, bf16, k, m);
        for (int j = 0; j < tile; j++) even[j] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, xf + j * K + k), even[j]);
    }
    for (int j = 0; j < tile; j++) h[j * R + r] = _mm512_reduce_add_ps(_mm512_add_ps(even[j], odd[j]));
}

static void shrink_row(int tile, int bf16, const float *xf, int64_t K, const void *a_row, float *h, int64_t R,
                       int64_t r) {
#define CASE(t) \
    case t: shrink_tile(t, bf16, xf, K, a_row, h, R, r); break;
    switch (tile) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) }
#undef CASE
}

/* xf[j] = x[order[j]] as floats. */
static void gather_rows(int bf16, const void *x, int64_t K, const int32_t *order, int64_t used, float *xf) {
#pragma omp parallel for schedule(static) if (used * K >= (1 << 16))
    for (int64_t j = 0; j < used; j++)
        for (int64_t k = 0; k < K; k += 16) {
            __mmask16 m = mask16(K - k);
            const void *row = bf16 ? (const void *)((const uint16_t *)x + order[j] * K)
                                   : (const void *)((const float *)x + order[j] * K);
            _mm512_mask_storeu_ps(xf + j * K + k, m, load16(row, bf16, k, m));
        }
}

/* The 16x16 float block in rows[0..15] transposed in place. */
static void transpose16(__m512 *rows) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(rows[i], rows[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(rows[i], rows[i + 1]);
    }
#define LO_PD(a, b) _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)))
#define HI_PD(a, b) _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)))
    for (int i = 0; i < 16; i += 4) {
        rows[i] = LO_PD(t[i], t[i + 2]);
        rows[i + 1] = HI_PD(t[i], t[i + 2]);
        rows[i + 2] = LO_PD(t[i + 1], t[i + 3]);
        rows[i + 3] = HI_PD(t[i + 1], t[i + 3]);
    }
#undef LO_PD
#undef HI_PD
    /* then the 128-bit lanes: 4x4 blocks of 4x4 */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(rows[i], rows[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(rows[i], rows[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(rows[i + 8], rows[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(rows[i + 8], rows[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        rows[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        rows[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
        rows[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
        rows[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* Output rows [n0, n0 + count) (count <= 16) of one slot's group: B's block
 * with rank columns [c0, c0 + rank) transposed into cols, then each row adds
 * its product into y. */
static void expand_block(int bf16, const void *b, int64_t R, int64_t n0, int count, int64_t c0, int64_t rank,
                         const int32_t *rows, int64_t num_rows, const float *h, int64_t N, void *y) {
    /* rows[j]: y's row of the group's j-th row, whose h is h[j] */
    __m512 cols[MAX_RANK_PAD];
    for (int64_t r0 = 0; r0 < rank; r0 += 16) {
        __m512 block[16];
        __mmask16 m = mask16(rank - r0);
        for (int l = 0; l < 16; l++)
            block[l] = l < count ? load16(b, bf16, (n0 + l) * R + c0 + r0, m) : _mm512_setzero_ps();
        transpose16(block);
        for (int i = 0; i < 16 && r0 + i < rank; i++) cols[r0 + i] = block[i];
    }
    __mmask16 out_mask = mask16(count);
    for (int64_t j = 0; j < num_rows; j++) {
        const float *hr = h + j * R + c0;
        /* four independent FMA chains over the rank */
        __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
        int64_t r = 0;
        for (; r + 4 <= rank; r += 4) {
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(hr[r]), cols[r], acc0);
            acc1 = _mm512_fmadd_ps(_mm512_set1_ps(hr[r + 1]), cols[r + 1], acc1);
            acc2 = _mm512_fmadd_ps(_mm512_set1_ps(hr[r + 2]), cols[r + 2], acc2);
            acc3 = _mm512_fmadd_ps(_mm512_set1_ps(hr[r + 3]), cols[r + 3], acc3);
        }
        for (; r < rank; r++) acc0 = _mm512_fmadd_ps(_mm512_set1_ps(hr[r]), cols[r], acc0);
        __m512 acc = _mm512_add_ps(_mm512_add_ps(acc0, acc1), _mm512_add_ps(acc2, acc3));
        if (bf16) {
            uint16_t *yr = (uint16_t *)y + rows[j] * N + n0;
            __m512 sum = _mm512_add_ps(load16_bf16(yr, out_mask), acc);
            _mm256_mask_storeu_epi16(yr, out_mask, bf16x16(sum));
        } else {
            float *yr = (float *)y + rows[j] * N + n0;
            _mm512_mask_storeu_ps(yr, out_mask, _mm512_add_ps(_mm512_maskz_loadu_ps(out_mask, yr), acc));
        }
    }
}
#else
#define HAVE_KERNEL 0
#endif

/* 1 when lora_apply runs here (built with AVX-512 F/BW/VL). */
int lora_available(void) { return HAVE_KERNEL; }

#if HAVE_KERNEL
/* Rows of each slot, slot by slot: order[starts[s] .. starts[s + 1]). */
static void group_rows(const int32_t *slots, int64_t T, int64_t num_slots, int64_t *starts, int32_t *order) {
    memset(starts, 0, sizeof(int64_t) * (size_t)(num_slots + 2));
    for (int64_t t = 0; t < T; t++)
        if (slots[t] > 0 && slots[t] <= num_slots) starts[slots[t] + 1]++;
    for (int64_t s = 1; s <= num_slots + 1; s++) starts[s] += starts[s - 1];
    int64_t *fill = starts + num_slots + 2; /* a copy of the starts, as write positions */
    memcpy(fill, starts, sizeof(int64_t) * (size_t)(num_slots + 1));
    for (int64_t t = 0; t < T; t++)
        if (slots[t] > 0 && slots[t] <= num_slots) order[fill[slots[t]]++] = (int32_t)t;
}

/* A layer's slot buffers and shape (see the top). */
typedef struct {
    int bf16;
    const void *a, *b;
    int64_t K, R, N, num_sub, max_rank;
    const int64_t *out_offsets;
} Slots;

/* The grouped rows: slot s has rows order[starts[s] .. starts[s + 1]). */
typedef struct {
    const int64_t *starts;
    const int32_t *order;
    int64_t num_slots, used;
} Groups;

/* h[j] = xf[j] @ A[s].T for every grouped row j; one work item per (slot, A row). */
static void shrink_all(const Slots *w, const Groups *g, const float *xf, float *h) {
    int64_t R = w->R, K = w->K, items = g->num_slots * R;
    size_t elem = w->bf16 ? 2 : 4;
#pragma omp parallel for schedule(dynamic, 4) if (g->used * R * K >= (1 << 16))
    for (int64_t item = 0; item < items; item++) {
        int64_t s = item / R + 1, r = item % R;
        int64_t first = g->starts[s], last = g->starts[s + 1];
        const char *a_row = (const char *)w->a + ((s * R + r) * K) * elem;
        for (int64_t j = first; j < last; j += MAX_TILE) {
            int tile = last - j < MAX_TILE ? (int)(last - j) : MAX_TILE;
            shrink_row(tile, w->bf16, xf + j * K, K, a_row, h + j * R, R, r);
        }
    }
}

/* y[order[j]] += h[j] @ B[s].T; one work item per (slot, block of 16
 * output rows), split where the block straddles two sub-matrices. */
static void expand_all(const Slots *w, const Groups *g, const float *h, void *y) {
    int64_t R = w->R, N = w->N, blocks = (N + 15) / 16, items = g->num_slots * blocks;
    size_t elem = w->bf16 ? 2 : 4;
#pragma omp parallel for schedule(dynamic, 4) if (g->used * N * w->max_rank >= (1 << 16))
    for (int64_t item = 0; item < items; item++) {
        int64_t s = item / blocks + 1, n0 = (item % blocks) * 16, n1 = n0 + 16 < N ? n0 + 16 : N;
        int64_t first = g->starts[s], last = g->starts[s + 1];
        if (first == last) continue;
        const char *b_slot = (const char *)w->b + (s * N * R) * elem;
        for (int64_t i = 0; i < w->num_sub; i++) {
            int64_t lo = w->out_offsets[i] > n0 ? w->out_offsets[i] : n0;
            int64_t hi = w->out_offsets[i + 1] < n1 ? w->out_offsets[i + 1] : n1;
            if (lo < hi)
                expand_block(w->bf16, b_slot, R, lo, (int)(hi - lo), i * w->max_rank, w->max_rank,
                             g->order + first, last - first, h + first * R, N, y);
        }
    }
}
#endif

/* See the top. h: float32 scratch [T, R]; out_offsets: int64 [num_sub + 1].
 * Returns 0, 1 when unavailable or the rank block is over MAX_RANK_PAD, 2
 * when out of memory (the caller's torch path runs). */
int lora_apply(int dtype, const void *x, int64_t T, int64_t K, const int32_t *slots, int64_t num_slots,
               const void *a, const void *b, int64_t R, int64_t num_sub, int64_t max_rank,
               const int64_t *out_offsets, int64_t N, float *h, void *y) {
#if HAVE_KERNEL
    if (max_rank > MAX_RANK_PAD || R != num_sub * max_rank) return 1;
    Slots w = {dtype == 1, a, b, K, R, N, num_sub, max_rank, out_offsets};
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(2 * num_slots + 3));
    int32_t *order = malloc(sizeof(int32_t) * (size_t)(T > 0 ? T : 1));
    float *xf = NULL;
    int status = 2;
    if (starts && order) {
        group_rows(slots, T, num_slots, starts, order);
        Groups g = {starts, order, num_slots, starts[num_slots + 1]};
        xf = malloc(sizeof(float) * (size_t)(g.used * K > 0 ? g.used * K : 1));
        if (xf) {
            gather_rows(w.bf16, x, K, order, g.used, xf);
            shrink_all(&w, &g, xf, h);
            expand_all(&w, &g, h, y);
            status = 0;
        }
    }
    free(xf), free(starts), free(order);
    return status;
#else
    (void)dtype, (void)x, (void)T, (void)K, (void)slots, (void)num_slots, (void)a, (void)b, (void)R;
    (void)num_sub, (void)max_rank, (void)out_offsets, (void)N, (void)h, (void)y;
    return 1;
#endif
}
