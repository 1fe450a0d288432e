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
 * into blocks of up to BLOCK rows of one slot (fewer, so that every OpenMP thread gets one):
 * a block reads its A and B from cache for all its rows (the segmented, "SGMV" form of Punica,
 * Chen et al. 2023, arXiv:2310.18547, without one matmul pair per adapter). The shrink runs
 * groups of 8 rank rows of A over the block's rows, 2 rows at a time (each A load serves 2
 * rows, each x load 8 rank rows; a row alone, 4 rank rows at a time). The expand runs over
 * B^T's rows (b_transposed), each rank's output row scaled into vector accumulators of a
 * block of outputs (no horizontal sums) for tiles of TILE rows, a chunk of outputs at a time
 * (B^T's part packed, about 32 KiB, while every tile of the block reads it), or, for an
 * [out, R] B, a dot product per output. Session 51 (Ice Lake Xeon): 1.2-2x faster than the
 * tile-by-tile kernel at 16-128 rows of rank 64 (docs/benchmarks.md). A small call (a decode
 * step's few rows) runs on the calling thread. Returns 0, 1 when scratch could not be
 * allocated, 2 when a slot is >= max_loras (nothing is written then).
 */
#include "cpu_common.h"
#include "cpu_entry_points.h"

/* TILE: rows the expand's register block takes (and the shrink's tile); BLOCK: rows of one
 * slot that share each chunk of B (and one thread); EXPAND_BYTES: B's part of a chunk. */
enum { TILE = 4, BLOCK = 64, EXPAND_BYTES = 32 * 1024 };

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

/* The shrink's register block: RB rank rows of A by 2 rows of x (or one: a row alone); 8
 * rank rows with AVX512's 32 vector registers (16 accumulators), 4 otherwise (8). */
#if defined(__AVX512F__)
enum { RB = 8 };
#else
enum { RB = 4 };
#endif

/* out[i][j] = w_j . v_i (j < rb rank rows of A, i < nv rows of x, each of n floats; out[i]
 * holds rank rows 4 q .. 4 q + 3 at out[i * rb / 4 + q]): one load of each of the rb + nv
 * vectors per 8 floats of k, rb * nv multiply-adds, 8-lane partial sums over k ascending,
 * each reduced by sum8x4, then the k tail (n % 8) added in order (8 lanes: a row alone, a
 * decode step's, took up to 1.8x the time with 16, and a row's sums are those of the
 * dot-product shrink before session 51, bit for bit). So each (row, rank row)
 * sum is the same whatever rows and rank rows share its block: a row's bits do not depend on
 * its block, nor on the step's mix of adapters. rb: 4 or RB, nv: 1 or 2, constants at each
 * call (the accumulators are named, so they stay in registers). */
static inline __attribute__((always_inline)) void shrink_block(const float *const w[RB],
                                                               const float *v0,
                                                               const float *v1, int rb,
                                                               int nv, int64_t n, v4f *out) {
    const float *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3];
    const float *w4 = w[rb > 4 ? 4 : 0], *w5 = w[rb > 4 ? 5 : 0], *w6 = w[rb > 4 ? 6 : 0],
                *w7 = w[rb > 4 ? 7 : 0];
    v8f c00 = {0}, c10 = {0}, c20 = {0}, c30 = {0}, c40 = {0}, c50 = {0}, c60 = {0}, c70 = {0};
    v8f c01 = {0}, c11 = {0}, c21 = {0}, c31 = {0}, c41 = {0}, c51 = {0}, c61 = {0}, c71 = {0};
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        const v8f a0 = load8(w0 + k), a1 = load8(w1 + k), a2 = load8(w2 + k),
                  a3 = load8(w3 + k), x0 = load8(v0 + k);
        c00 += a0 * x0, c10 += a1 * x0, c20 += a2 * x0, c30 += a3 * x0;
        if (nv > 1) {
            const v8f x1 = load8(v1 + k);
            c01 += a0 * x1, c11 += a1 * x1, c21 += a2 * x1, c31 += a3 * x1;
        }
        if (rb > 4) {
            const v8f a4 = load8(w4 + k), a5 = load8(w5 + k), a6 = load8(w6 + k),
                      a7 = load8(w7 + k);
            c40 += a4 * x0, c50 += a5 * x0, c60 += a6 * x0, c70 += a7 * x0;
            if (nv > 1) {
                const v8f x1 = load8(v1 + k);
                c41 += a4 * x1, c51 += a5 * x1, c61 += a6 * x1, c71 += a7 * x1;
            }
        }
    }
    const int Q = rb / 4;
    out[0] = sum8x4(c00, c10, c20, c30);
    if (rb > 4) out[1] = sum8x4(c40, c50, c60, c70);
    if (nv > 1) {
        out[Q] = sum8x4(c01, c11, c21, c31);
        if (rb > 4) out[Q + 1] = sum8x4(c41, c51, c61, c71);
    }
    for (; k < n; ++k)
        for (int i = 0; i < nv; ++i) {
            const float vk = (i ? v1 : v0)[k];
            for (int q = 0; q < Q; ++q)
                out[i * Q + q] += (v4f){w[4 * q][k] * vk, w[4 * q + 1][k] * vk,
                                        w[4 * q + 2][k] * vk, w[4 * q + 3][k] * vk};
        }
}

/* The shrink of a block: h[i][r] = A[r] . x_i for i < count (x_i: rows of n floats at stride
 * n) and r < rank (A: rank rows of n floats). RB rank rows at a time (a short group repeats
 * its last rank row), each group over every row of the block, 2 rows at a time (a short pair
 * repeats its last row): the group's RB rows of A stay in L1 while the block's rows stream
 * by, each vector of A read once for 2 rows and each of x once for RB rank rows. A row
 * alone (a decode step's) takes 4 rank rows at a time (fewer streams of A from L2: 8 took up
 * to 1.2x the time). Before session 51 each tile of 4 rows read all of A once per rank row. */
static void shrink_rows(const float *a, const float *x, int64_t n, int64_t rank, int64_t count,
                        float *h) {
    const int rb = count == 1 ? 4 : RB;
    for (int64_t r = 0; r < rank; r += rb) {
        const int64_t m = rank - r < rb ? rank - r : rb;
        const float *w[RB];
        for (int j = 0; j < RB; ++j) w[j] = a + (r + (j < m ? j : m - 1)) * n;
        v4f sums[2 * RB / 4];
        if (count == 1) {
            shrink_block(w, x, x, 4, 1, n, sums);
            for (int64_t j = 0; j < m; ++j) h[r + j] = sums[0][j];
            continue;
        }
        for (int64_t i = 0; i < count; i += 2) {
            shrink_block(w, x + i * n, x + (i + 1 < count ? i + 1 : i) * n, RB, 2, n, sums);
            for (int t = 0; t < (i + 1 < count ? 2 : 1); ++t)
                for (int64_t j = 0; j < m; ++j)
                    h[(i + t) * rank + r + j] = sums[t * (RB / 4) + j / 4][j % 4];
        }
    }
}

/* d[i][n] = sum over r ascending of h_i[r] * bt[r][n] for i < count <= TILE (h_i: rows of
 * length rank; bt: rank rows of out at stride ldb; d: rows of out). A short tile repeats its
 * last row, so every row's sums run in one fixed order whatever the tile (a row's bits do not
 * depend on the step's mix of adapters). Blocks of 4 vectors of outputs (AVX512 builds: 16
 * accumulators; 0.65x the time of blocks of 2 on 64 rows, session 51), then 2, then 1, then
 * single outputs. */
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
#if defined(__AVX512F__) /* 16 accumulators: 32 vector registers hold them */
    for (; n + 4 * VN <= out; n += 4 * VN) {
        vnf a0 = {0}, b0 = {0}, e0 = {0}, f0 = {0}, a1 = {0}, b1 = {0}, e1 = {0}, f1 = {0};
        vnf a2 = {0}, b2 = {0}, e2 = {0}, f2 = {0}, a3 = {0}, b3 = {0}, e3 = {0}, f3 = {0};
        for (int64_t r = 0; r < rank; ++r) {
            const float *row = bt + r * ldb + n;
            const vnf v0 = loadvn(row), v1 = loadvn(row + VN), v2 = loadvn(row + 2 * VN),
                      v3 = loadvn(row + 3 * VN);
            const vnf g0 = (vnf){0} + h0[r], g1 = (vnf){0} + h1[r], g2 = (vnf){0} + h2[r],
                      g3 = (vnf){0} + h3[r];
            a0 += g0 * v0, b0 += g0 * v1, e0 += g0 * v2, f0 += g0 * v3;
            a1 += g1 * v0, b1 += g1 * v1, e1 += g1 * v2, f1 += g1 * v3;
            a2 += g2 * v0, b2 += g2 * v1, e2 += g2 * v2, f2 += g2 * v3;
            a3 += g3 * v0, b3 += g3 * v1, e3 += g3 * v2, f3 += g3 * v3;
        }
        storevn(d3 + n, a3), storevn(d3 + n + VN, b3), storevn(d3 + n + 2 * VN, e3),
            storevn(d3 + n + 3 * VN, f3);
        storevn(d2 + n, a2), storevn(d2 + n + VN, b2), storevn(d2 + n + 2 * VN, e2),
            storevn(d2 + n + 3 * VN, f2);
        storevn(d1 + n, a1), storevn(d1 + n + VN, b1), storevn(d1 + n + 2 * VN, e1),
            storevn(d1 + n + 3 * VN, f1);
        storevn(d0 + n, a0), storevn(d0 + n + VN, b0), storevn(d0 + n + 2 * VN, e0),
            storevn(d0 + n + 3 * VN, f0);
    }
#endif
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
    int64_t block_rows; /* rows of one slot a block takes, <= BLOCK */
    int64_t chunk;      /* outputs an expand pass takes (a multiple of 4 VN, or out) */
} LoraArgs;

/* Outputs an expand pass takes: B's rank rows of them fill about EXPAND_BYTES (kept in L1
 * while every tile of the block reads them), a multiple of 4 VN (so every output takes the
 * vector path it takes in one pass over all of them: a row's bits do not depend on the
 * chunk), or all of them. */
static int64_t expand_chunk(int64_t rank, int64_t out) {
    int64_t chunk = EXPAND_BYTES / ((int64_t)sizeof(float) * rank) / (4 * VN) * (4 * VN);
    if (chunk < 4 * VN) chunk = 4 * VN;
    return chunk < out ? chunk : out;
}

/* Scratch floats of one block: block_rows rows of x and of h, TILE rows of delta and a row of
 * widened y (a chunk of outputs each, or all of them: a block of one tile), B^T's rank rows
 * of a chunk packed (none for blocks of one tile). */
static size_t block_scratch(const LoraArgs *p) {
    return (size_t)(p->block_rows * (p->in + p->rank) + (TILE + 1) * p->out +
                    (p->block_rows > TILE ? p->rank * p->chunk : 0));
}

/* One block: rows `rows[0..count)` of slot `slot` (count <= block_rows). First the shrink of
 * every row, a tile of TILE rows at a time (h: count rows of rank); then the expand in chunks
 * of outputs, every tile of the block over one chunk before the next, so B's part for a chunk
 * is read from cache for all of them (before session 51 every tile of 4 rows read all of B:
 * 1.5 MB at rank 64 on SmolLM2's gate_up, past the L2 of an Ice Lake core), each tile's
 * delta added to its rows' chunk of y at once. */
static void lora_block(const LoraArgs *p, const int32_t *rows, int64_t count, int64_t slot,
                       float *scratch) {
    const int64_t in = p->in, out = p->out, rank = p->rank;
    /* one tile reads B once whatever the order: no chunks, no packing (a decode step's row) */
    const int64_t chunk = count > TILE ? p->chunk : out;
    float *xs = scratch, *h = xs + p->block_rows * in, *d = h + p->block_rows * rank,
          *wide = d + TILE * out, *pack = wide + out;
    const size_t xes = elem_size(p->xdt), yes = elem_size(p->ydt);
    const float *a = p->a + slot * rank * in, *b = p->b + slot * out * rank;
    for (int64_t i = 0; i < count; ++i) /* x's rows widened */
        load_row(p->xdt, (const char *)p->x + rows[i] * p->x_stride * xes, xs + i * in, in);
    shrink_rows(a, xs, in, rank, count, h); /* h[i][r] = A[r] . x_i */
    for (int64_t n0 = 0; n0 < out; n0 += chunk) {
        const int64_t width = out - n0 < chunk ? out - n0 : chunk;
        /* B^T's chunk for every tile: packed (rank rows of width side by side) where several
         * tiles read it; in place its rows lie out floats apart, a multiple of 4 KiB for
         * SmolLM2's outputs, all in a few L1 sets */
        const float *bt = b + n0;
        int64_t ldb = out;
        if (p->b_transposed && count > TILE) {
            for (int64_t r = 0; r < rank; ++r)
                memcpy(pack + r * width, b + r * out + n0, (size_t)width * sizeof(float));
            bt = pack, ldb = width;
        }
        for (int64_t t = 0; t < count; t += TILE) {
            const int tile = count - t < TILE ? (int)(count - t) : TILE;
            const float *ht = h + t * rank;
            if (p->b_transposed) { /* expand: d[i] = sum_r h_i[r] B^T[r] */
                expand_rows(bt, ldb, ht, rank, tile, width, d);
            } else {
                float col[TILE];
                for (int64_t n = 0; n < width; ++n) { /* expand: d[i][n] = B[n] . h_i */
                    dot_tile(b + (n0 + n) * rank, ht, rank, rank, tile, col);
                    for (int i = 0; i < tile; ++i) d[i * width + n] = col[i];
                }
            }
            for (int i = 0; i < tile; ++i)
                add_row(p->ydt, (char *)p->y + (rows[t + i] * p->y_stride + n0) * yes,
                        d + i * width, wide, width);
        }
    }
}

/* Rows grouped by slot (order[], ascending slot, rows ascending within one) and the blocks
 * of up to block_rows rows of one slot over them (block_start[], block_count + 1 entries).
 * Returns the block count. */
static int64_t plan_blocks(const int32_t *slots, int64_t rows, int64_t max_loras,
                           int64_t block_rows, int32_t *order, int64_t *block_start,
                           int64_t *counts) {
    memset(counts, 0, (size_t)(max_loras + 1) * sizeof(int64_t));
    for (int64_t t = 0; t < rows; ++t)
        if (slots[t] >= 0) counts[slots[t] + 1]++;
    for (int64_t s = 0; s < max_loras; ++s) counts[s + 1] += counts[s];
    for (int64_t t = 0; t < rows; ++t)
        if (slots[t] >= 0) order[counts[slots[t]]++] = (int32_t)t;
    /* counts[s] is now the end of slot s's rows */
    int64_t blocks = 0, start = 0;
    for (int64_t s = 0; s < max_loras; ++s) {
        for (int64_t i = start; i < counts[s]; i += block_rows) block_start[blocks++] = i;
        start = counts[s];
    }
    block_start[blocks] = start;
    return blocks;
}

/* Block `block` of the plan: up to block_rows rows of one slot. */
static void run_block(const LoraArgs *p, const int32_t *order, const int64_t *block_start,
                      int64_t blocks, int64_t block, const int32_t *slots, float *work) {
    const int64_t first = block_start[block];
    int64_t end = first + p->block_rows;
    const int64_t slot = slots[order[first]];
    for (int64_t i = first + 1; i < end; ++i) /* a block ends at block_rows or its slot's last */
        if (i >= block_start[blocks] || slots[order[i]] != slot) end = i;
    lora_block(p, order + first, end - first, slot, work);
}

/* Rows with a slot, or -1 when a slot is >= max_loras. */
static int64_t adapted_rows(const int32_t *slots, int64_t rows, int64_t max_loras) {
    int64_t adapted = 0;
    for (int64_t t = 0; t < rows; ++t) {
        if (slots[t] >= max_loras) return -1;
        adapted += slots[t] >= 0;
    }
    return adapted;
}

int kvflow_lora(void *y, int64_t y_stride, int ydt, const void *x, int64_t x_stride, int xdt,
                const float *lora_a, const float *lora_b, int b_transposed,
                const int32_t *slots, int64_t rows, int64_t in, int64_t out, int64_t rank,
                int64_t max_loras, int num_threads) {
    if (rows <= 0 || rank <= 0) return 0;
    const int64_t adapted = adapted_rows(slots, rows, max_loras);
    if (adapted <= 0) return adapted < 0 ? 2 : 0; /* a bad slot, or no row with an adapter */
    int threads = adapted * rank * (in + out) < PARALLEL_MACS || num_threads < 1 ? 1
                                                                               : num_threads;
    /* blocks of BLOCK rows, or fewer so that every thread gets one (in whole tiles) */
    int64_t block_rows = (adapted + threads - 1) / threads;
    block_rows = (block_rows + TILE - 1) / TILE * TILE;
    block_rows = block_rows < BLOCK ? block_rows : BLOCK;
    int32_t *order = malloc((size_t)adapted * sizeof(int32_t));
    int64_t *block_start = malloc((size_t)(adapted + 1) * sizeof(int64_t));
    int64_t *counts = malloc((size_t)(max_loras + 1) * sizeof(int64_t));
    int status = 0;
    if (!order || !block_start || !counts) {
        status = 1;
        goto done;
    }
    const int64_t blocks = plan_blocks(slots, rows, max_loras, block_rows, order, block_start,
                                       counts);
    if (blocks < 2) threads = 1;
    const LoraArgs p = {y,      y_stride, ydt, x,   x_stride, xdt,          lora_a,
                        lora_b, in,       out, rank, b_transposed, block_rows,
                        expand_chunk(rank, out)};
    const size_t scratch = block_scratch(&p) * sizeof(float);
    if (threads == 1) { /* no parallel region: a 1-thread one costs a fraction of a
                         * microsecond more (benchmarks/cpu_omp_regions.c) */
        float *work = malloc(scratch);
        if (!work) {
            status = 1;
            goto done;
        }
        for (int64_t block = 0; block < blocks; ++block)
            run_block(&p, order, block_start, blocks, block, slots, work);
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
            for (int64_t block = 0; block < blocks; ++block)
                run_block(&p, order, block_start, blocks, block, slots, work);
            free(work);
        }
    }
done:
    free(order);
    free(block_start);
    free(counts);
    return status;
}
