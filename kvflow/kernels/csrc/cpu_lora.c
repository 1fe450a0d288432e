/*
 * Batched multi-LoRA for kvflow's CPU path (kvflow/lora/layers.py, LoRALinear):
 *
 *   y[t] += round((x[t] A[s]^T) B[s]^T)   for every row t whose slot s = slots[t] >= 0
 *
 * in one call for every adapter of the step, the slot of each row read from `slots` (int32
 * [rows], -1: no adapter). The CPU step graphs (kvflow/worker/cpu_graphs.py) record the call
 * with `slots` pointing at their static buffer, so a step with another mix of adapters (or of
 * none) replays the same program. A and B are the layer's fp32 slots (lora_a [max_loras, R, in],
 * lora_b [max_loras, out, R], scaling folded in, or that B stored transposed: b_transposed = 1
 * reads lora_b as [max_loras, R, out], what kvflow's CPU LoRA layers keep); x and y are fp32,
 * bf16 or fp16 rows. The math
 * is fp32: x widened, the rank-R intermediate kept in fp32, the delta rounded to y's dtype once
 * and added as torch's `y.add_(delta.to(y.dtype))` does (both widened, added, rounded).
 *
 * The rows are grouped by slot on the calling thread (a counting sort over the slots) and cut
 * into tiles of up to TILE rows of one slot: a tile reads each row of its A and B once for all
 * its rows (the segmented, "SGMV" form of Punica, Chen et al. 2023, arXiv:2310.18547, without
 * one matmul pair per adapter). The shrink is a dot product per rank row of A; the expand runs
 * over B^T's rows (b_transposed), each rank's output row scaled into vector accumulators of a
 * block of outputs (no horizontal sums: on 16-64 rows of one adapter the call takes 0.6-1.0x
 * torch's fp32 matmuls' time where with the dot-product expand it took 1.2-1.6x,
 * docs/benchmarks.md, session 50), or, for an [out, R] B, a dot product per output. Tiles are
 * split over OpenMP threads; a small call (a decode step's few rows) runs on the calling
 * thread. Returns 0, 1 when scratch could not be
 * allocated, 2 when a slot is >= max_loras (nothing is written then).
 */
#include "cpu_common.h"
#include "cpu_entry_points.h"

enum { TILE = 4 };

/* Work (multiply-adds) below which one thread runs the call (waking another costs more). */
static const int64_t PARALLEL_MACS = (int64_t)1 << 18;

/* d[i] = dot(w[0..n), v_i[0..n)) for i < count <= TILE (v_i: rows of length n at stride ldv;
 * a short tile repeats its last row, so the loop always runs TILE fixed accumulators).
 * Eight-lane partial sums, then one horizontal add for the four rows together. */
static inline void dot_tile(const float *w, const float *v, int64_t ldv, int64_t n, int count,
                            float *d) {
    const float *v0 = v, *v1 = v + (count > 1 ? 1 : 0) * ldv, *v2 = v + (count > 2 ? 2 : 0) * ldv,
                *v3 = v + (count > 3 ? 3 : 0) * ldv;
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        const v8f wk = load8(w + k);
        a0 += wk * load8(v0 + k);
        a1 += wk * load8(v1 + k);
        a2 += wk * load8(v2 + k);
        a3 += wk * load8(v3 + k);
    }
    v4f sums = sum8x4(a0, a1, a2, a3);
    for (; k < n; ++k) {
        const float wk = w[k];
        sums += (v4f){wk * v0[k], wk * v1[k], wk * v2[k], wk * v3[k]};
    }
    for (int i = 0; i < count; ++i) d[i] = sums[i];
}

/* y row (dtype ydt) += round(delta): torch's y.add_(delta.to(y.dtype)). */
static void add_row(int ydt, void *y, const float *delta, float *wide, int64_t n) {
    if (ydt == DT_F32) {
        float *yf = y;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) yf[j] += delta[j];
        return;
    }
    load_row(ydt, y, wide, n);
    if (ydt == DT_BF16) {
        for (int64_t j = 0; j < n; ++j) {
            const uint32_t u = (uint32_t)f32_to_bf16(delta[j]) << 16;
            float rounded;
            memcpy(&rounded, &u, 4);
            wide[j] += rounded;
        }
    } else {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) wide[j] += (float)(_Float16)delta[j];
    }
    store_row(ydt, wide, y, n);
}

/* The expand's vector: 16 lanes where the build has AVX512, else 8 (AVX2, baseline). */
#if defined(__AVX512F__)
typedef float vnf __attribute__((vector_size(64)));
enum { VN = 16 };
#else
typedef float vnf __attribute__((vector_size(32)));
enum { VN = 8 };
#endif

static inline vnf loadvn(const float *p) {
    vnf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storevn(float *p, vnf v) { memcpy(p, &v, sizeof v); }

/* d[i][n] = sum over r ascending of h_i[r] * bt[r][n] for i < count <= TILE (h_i: rows of
 * length rank; bt: rank rows of out at stride ldb; d: rows of out). A short tile repeats its
 * last row, so every row's sums run in one fixed order whatever the tile (a row's bits do not
 * depend on the step's mix of adapters). Blocks of 2 vectors of outputs, then 1, then single
 * outputs. */
static void expand_one(const float *bt, int64_t ldb, const float *h, int64_t rank,
                       int64_t out, float *d);

static void expand_rows(const float *bt, int64_t ldb, const float *h, int64_t rank, int count,
                        int64_t out, float *d) {
    if (count == 1) {
        expand_one(bt, ldb, h, rank, out, d);
        return;
    }
    const float *h0 = h, *h1 = h + (count > 1 ? 1 : 0) * rank, *h2 = h + (count > 2 ? 2 : 0) * rank,
                *h3 = h + (count > 3 ? 3 : 0) * rank;
    float *d0 = d, *d1 = d + (count > 1 ? 1 : 0) * out, *d2 = d + (count > 2 ? 2 : 0) * out,
          *d3 = d + (count > 3 ? 3 : 0) * out;
    int64_t n = 0;
    for (; n + 2 * VN <= out; n += 2 * VN) {
        vnf a0 = {0}, b0 = {0}, a1 = {0}, b1 = {0}, a2 = {0}, b2 = {0}, a3 = {0}, b3 = {0};
        for (int64_t r = 0; r < rank; ++r) {
            const float *row = bt + r * ldb + n;
            const vnf lo = loadvn(row), hi = loadvn(row + VN);
            a0 += h0[r] * lo, b0 += h0[r] * hi;
            a1 += h1[r] * lo, b1 += h1[r] * hi;
            a2 += h2[r] * lo, b2 += h2[r] * hi;
            a3 += h3[r] * lo, b3 += h3[r] * hi;
        }
        /* d3 first: a short tile's repeated rows alias the real ones, which are stored last */
        storevn(d3 + n, a3), storevn(d3 + n + VN, b3);
        storevn(d2 + n, a2), storevn(d2 + n + VN, b2);
        storevn(d1 + n, a1), storevn(d1 + n + VN, b1);
        storevn(d0 + n, a0), storevn(d0 + n + VN, b0);
    }
    for (; n + VN <= out; n += VN) {
        vnf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t r = 0; r < rank; ++r) {
            const vnf b = loadvn(bt + r * ldb + n);
            a0 += h0[r] * b, a1 += h1[r] * b, a2 += h2[r] * b, a3 += h3[r] * b;
        }
        storevn(d3 + n, a3), storevn(d2 + n, a2), storevn(d1 + n, a1), storevn(d0 + n, a0);
    }
    for (; n < out; ++n)
        for (int i = 0; i < count; ++i) {
            float s = 0.0f;
            for (int64_t r = 0; r < rank; ++r) s += h[i * rank + r] * bt[r * ldb + n];
            d[i * out + n] = s;
        }
}

/* expand_rows of one row (a decode step's row of its own adapter), 4 vectors of outputs a
 * block: each output's sum is the one expand_rows makes (r ascending, the same vector or
 * scalar path for each n), so a row's bits do not depend on its tile. */
static void expand_one(const float *bt, int64_t ldb, const float *h, int64_t rank,
                       int64_t out, float *d) {
    int64_t n = 0;
    for (; n + 4 * VN <= out; n += 4 * VN) {
        vnf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t r = 0; r < rank; ++r) {
            const float *row = bt + r * ldb + n;
            a0 += h[r] * loadvn(row), a1 += h[r] * loadvn(row + VN);
            a2 += h[r] * loadvn(row + 2 * VN), a3 += h[r] * loadvn(row + 3 * VN);
        }
        storevn(d + n, a0), storevn(d + n + VN, a1);
        storevn(d + n + 2 * VN, a2), storevn(d + n + 3 * VN, a3);
    }
    for (; n + VN <= out; n += VN) {
        vnf a0 = {0};
        for (int64_t r = 0; r < rank; ++r) a0 += h[r] * loadvn(bt + r * ldb + n);
        storevn(d + n, a0);
    }
    for (; n < out; ++n) {
        float s = 0.0f;
        for (int64_t r = 0; r < rank; ++r) s += h[r] * bt[r * ldb + n];
        d[n] = s;
    }
}

typedef struct {
    void *y;
    int64_t y_stride;
    int ydt;
    const void *x;
    int64_t x_stride;
    int xdt;
    const float *a, *b;
    int64_t in, out, rank;
    int b_transposed; /* lora_b stored [max_loras, R, out] */
} LoraArgs;

/* One tile: rows `rows[0..count)` of slot `slot`; scratch holds TILE * (in + rank + out) +
 * out floats. */
static void lora_tile(const LoraArgs *p, const int32_t *rows, int count, int64_t slot,
                      float *scratch) {
    const int64_t in = p->in, out = p->out, rank = p->rank;
    float *xs = scratch, *h = xs + TILE * in, *d = h + TILE * rank, *wide = d + TILE * out;
    const size_t xes = elem_size(p->xdt), yes = elem_size(p->ydt);
    for (int i = 0; i < count; ++i)
        load_row(p->xdt, (const char *)p->x + rows[i] * p->x_stride * xes, xs + i * in, in);
    const float *a = p->a + slot * rank * in, *b = p->b + slot * out * rank;
    float col[TILE];
    if (count == 1) { /* shrink of one row: TILE rank rows of A share each load of x. The
                       * same sums as below, operands swapped (x_k A_rk = A_rk x_k exactly, and
                       * sum8x4 reduces each lane alike), so a row's bits stay its tile's. */
        for (int64_t r = 0; r < rank; r += TILE)
            dot_tile(xs, a + r * in, in, in, rank - r < TILE ? (int)(rank - r) : TILE, h + r);
    } else {
        for (int64_t r = 0; r < rank; ++r) { /* shrink: h[i][r] = A[r] . x_i */
            dot_tile(a + r * in, xs, in, in, count, col);
            for (int i = 0; i < count; ++i) h[i * rank + r] = col[i];
        }
    }
    if (p->b_transposed) { /* expand: d[i] = sum_r h_i[r] B^T[r] */
        expand_rows(b, out, h, rank, count, out, d);
    } else {
        for (int64_t n = 0; n < out; ++n) { /* expand: d[i][n] = B[n] . h_i */
            dot_tile(b + n * rank, h, rank, rank, count, col);
            for (int i = 0; i < count; ++i) d[i * out + n] = col[i];
        }
    }
    for (int i = 0; i < count; ++i)
        add_row(p->ydt, (char *)p->y + rows[i] * p->y_stride * yes, d + i * out, wide, out);
}

/* Rows grouped by slot (order[], ascending slot, rows ascending within one) and the tiles over
 * them (tile_start[], tile_count + 1 entries). Returns the tile count, or -1 on a bad slot. */
static int64_t plan_tiles(const int32_t *slots, int64_t rows, int64_t max_loras, int32_t *order,
                          int64_t *tile_start, int64_t *counts) {
    memset(counts, 0, (size_t)(max_loras + 1) * sizeof(int64_t));
    for (int64_t t = 0; t < rows; ++t) {
        if (slots[t] >= max_loras) return -1;
        if (slots[t] >= 0) counts[slots[t] + 1]++;
    }
    for (int64_t s = 0; s < max_loras; ++s) counts[s + 1] += counts[s];
    for (int64_t t = 0; t < rows; ++t)
        if (slots[t] >= 0) order[counts[slots[t]]++] = (int32_t)t;
    /* counts[s] is now the end of slot s's rows */
    int64_t tiles = 0, start = 0;
    for (int64_t s = 0; s < max_loras; ++s) {
        for (int64_t i = start; i < counts[s]; i += TILE) tile_start[tiles++] = i;
        start = counts[s];
    }
    tile_start[tiles] = start;
    return tiles;
}

/* Tile `tile` of the plan: up to TILE rows of one slot. */
static void run_tile(const LoraArgs *p, const int32_t *order, const int64_t *tile_start,
                     int64_t tiles, int64_t tile, const int32_t *slots, float *work) {
    const int64_t first = tile_start[tile];
    int64_t end = first + TILE;
    const int64_t slot = slots[order[first]];
    for (int64_t i = first + 1; i < end; ++i) /* a tile ends at TILE rows or its slot's last */
        if (i >= tile_start[tiles] || slots[order[i]] != slot) end = i;
    lora_tile(p, order + first, (int)(end - first), slot, work);
}

int kvflow_lora(void *y, int64_t y_stride, int ydt, const void *x, int64_t x_stride, int xdt,
                const float *lora_a, const float *lora_b, int b_transposed,
                const int32_t *slots, int64_t rows, int64_t in, int64_t out, int64_t rank,
                int64_t max_loras, int num_threads) {
    if (rows <= 0 || rank <= 0) return 0;
    int32_t *order = malloc((size_t)rows * sizeof(int32_t));
    int64_t *tile_start = malloc((size_t)(rows + 1) * sizeof(int64_t));
    int64_t *counts = malloc((size_t)(max_loras + 1) * sizeof(int64_t));
    int status = 0;
    if (!order || !tile_start || !counts) {
        status = 1;
        goto done;
    }
    const int64_t tiles = plan_tiles(slots, rows, max_loras, order, tile_start, counts);
    if (tiles <= 0) { /* a bad slot, or no row with an adapter */
        status = tiles < 0 ? 2 : 0;
        goto done;
    }
    const LoraArgs p = {y,      y_stride, ydt, x,   x_stride, xdt,
                        lora_a, lora_b,   in,  out, rank,     b_transposed};
    const int64_t adapted = tile_start[tiles]; /* rows with a slot */
    const int threads = adapted * rank * (in + out) < PARALLEL_MACS || tiles < 2 ? 1
                                                                              : num_threads;
    const size_t scratch = ((size_t)TILE * (in + rank + out) + out) * sizeof(float);
    if (threads == 1) { /* no parallel region: a 1-thread one costs a fraction of a
                         * microsecond more (benchmarks/cpu_omp_regions.c) */
        float *work = malloc(scratch);
        if (!work) {
            status = 1;
            goto done;
        }
        for (int64_t tile = 0; tile < tiles; ++tile)
            run_tile(&p, order, tile_start, tiles, tile, slots, work);
        free(work);
        goto done;
    }
#pragma omp parallel num_threads(threads) reduction(| : status)
    {
        float *work = malloc(scratch);
        if (!work) {
            status |= 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t tile = 0; tile < tiles; ++tile)
                run_tile(&p, order, tile_start, tiles, tile, slots, work);
            free(work);
        }
    }
done:
    free(order);
    free(tile_start);
    free(counts);
    return status;
}
