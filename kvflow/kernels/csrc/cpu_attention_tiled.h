/* The register-tiled path of cpu_attention.c for prefill tiles, included there after its
 * Args and Scratch (static functions: specialized in place by the compiler). */
#ifndef KVFLOW_CPU_ATTENTION_TILED_H
#define KVFLOW_CPU_ATTENTION_TILED_H

/* ---- Register-tiled prefill tiles ----------------------------------------------------------
 * A tile of nq query tokens (nq > 1) attends its context as two small GEMMs per KV head and
 * super-block of up to SB keys, with an online softmax between them (Dao et al.,
 * FlashAttention, 2022, on CPU registers instead of GPU shared memory). The rows of a KV head
 * are the tile's (query token i, head j of the GQA group) pairs, rows_h = nq * group of them.
 *
 *   S^T[t][r] = k_t . q_r       keys as GEMM rows: K is read in place from the cache, Q^T
 *                               ([head_dim][rows], fp32, transposed once per tile) is the
 *                               16-column operand;
 *   online softmax over t       vectorized across the rows r (contiguous in S^T), masking a
 *                               prefix / suffix of rows per key near the diagonal / window;
 *   O[r][:] = O * corr + P V    P^T read as a strided operand, V rows read in place, widened
 *                               from 16 bits in registers.
 *
 * Both products run an MR_T x 16 register tile (12 eight-lane accumulators): one load of the
 * 16-column operand and MR_T broadcasts per k step feed 2 * MR_T independent FMAs, where the
 * row-by-row path spends a load and a horizontal sum per dot product. Operand rows are passed
 * as pointers, so keys of different cache blocks form one super-block. Needs head_dim % 16 == 0.
 */

/* Scalar element i of a row of dtype dt, as fp32. */
static inline float elem_f32(const char *row, int64_t i, int dt) {
    if (dt == DT_F32) return ((const float *)row)[i];
    if (dt == DT_F16) return (float)((const _Float16 *)row)[i];
    const uint32_t u = (uint32_t)((const uint16_t *)row)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* c[R][16] (row stride ldc) = (accumulate ? c : 0) + A[R][kc] @ B[kc][16], where A[r][kk] =
 * element kk * aks of row arow[r] (dtype adt) and B[kk][j] = element boff + j of row brow[kk]
 * (dtype bdt), both widened to fp32. R: 1..MR_T, a constant wherever this is inlined. */
static inline __attribute__((always_inline)) void tile_mk(
        int R, int64_t kc, const char *const *arow, int64_t aks, int adt,
        const char *const *brow, int64_t boff, int bdt, float *c, int64_t ldc, int accumulate) {
    v8f acc[MR_T][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = (v8f){0};
    const size_t bes = elem_size(bdt);
    for (int64_t kk = 0; kk < kc; ++kk) {
        const char *row = brow[kk] + boff * bes;
        v8f b0, b1;
        if (bdt == DT_F32) {
            b0 = load8((const float *)row);
            b1 = load8((const float *)row + 8);
        } else {
            float wide[16];
            load_row(bdt, row, wide, 16);
            b0 = load8(wide);
            b1 = load8(wide + 8);
        }
        for (int r = 0; r < R; ++r) {
            const float s = elem_f32(arow[r], kk * aks, adt);
            const v8f av = {s, s, s, s, s, s, s, s};
            acc[r][0] += av * b0;
            acc[r][1] += av * b1;
        }
    }
    for (int r = 0; r < R; ++r) {
        float *out = c + r * ldc;
        if (accumulate) {
            acc[r][0] += load8(out);
            acc[r][1] += load8(out + 8);
        }
        store8(out, acc[r][0]);
        store8(out + 8, acc[r][1]);
    }
}

/* tile_mk over `rows` A rows (MR_T at a time, the rest by a copy specialized for its count). */
static void tile_gemm(int64_t rows, int64_t kc, const char *const *arow, int64_t aks, int adt,
                      const char *const *brow, int64_t boff, int bdt, float *c, int64_t ldc,
                      int accumulate) {
    for (int64_t r0 = 0; r0 < rows; r0 += MR_T) {
        const int64_t R = rows - r0 < MR_T ? rows - r0 : MR_T;
        const char *const *ar = arow + r0;
        float *cr = c + r0 * ldc;
#define TMK(n) tile_mk(n, kc, ar, aks, adt, brow, boff, bdt, cr, ldc, accumulate)
        switch (R) {
        case 1: TMK(1); break;
        case 2: TMK(2); break;
        case 3: TMK(3); break;
        case 4: TMK(4); break;
        case 5: TMK(5); break;
        default: TMK(6); break;
        }
#undef TMK
    }
}

/* Blocks per super-block: whole blocks, about sb keys (at least one block); sb = SB here. */
static inline int64_t super_blocks(int64_t block_size, int64_t sb) {
    return block_size >= sb ? 1 : sb / block_size;
}

/* Q^T of the tile for every KV head: qt[h][d][r] (row stride ld = rows_h rounded up to 16,
 * padding rows zero), row r = (query token r / group, head h * group + r % group), scaled. */
static void load_queries_transposed(const Args *a, Scratch *w, int64_t first_token, int64_t nq,
                                    int64_t ld) {
    const int64_t D = a->head_dim, H = a->num_heads, group = H / a->num_kv_heads;
    const size_t es = elem_size(a->dtype);
    memset(w->qt, 0, sizeof(float) * a->num_kv_heads * D * ld);
    for (int64_t i = 0; i < nq; ++i)
        for (int64_t hq = 0; hq < H; ++hq) {
            float *tmp = w->acc; /* free until the first value update */
            load_row(a->dtype, a->q + ((first_token + i) * a->q_stride + hq * D) * es, tmp, D);
            float *qt = w->qt + (hq / group) * D * ld + i * group + hq % group;
            for (int64_t d = 0; d < D; ++d) qt[d * ld] = tmp[d] * a->scale;
        }
}

/* One online-softmax step over the n x ld scores st (key t, row r at st[t * ld + r]) of the
 * rows [0, rows): per row the running max m and sum l are updated, st becomes exp(s - m_new)
 * and corr[r] the factor the row's output must be scaled by first. Vectorized across rows. */
static void softmax_step_rows(float *st, int64_t n, int64_t ld, int64_t rows, float *m, float *l,
                              float *corr) {
    for (int64_t r = 0; r < rows; ++r) corr[r] = -INFINITY; /* the block's max, first */
    for (int64_t t = 0; t < n; ++t) {
        const float *s = st + t * ld;
#pragma omp simd
        for (int64_t r = 0; r < rows; ++r) corr[r] = s[r] > corr[r] ? s[r] : corr[r];
    }
    for (int64_t r = 0; r < rows; ++r) {
        const float m_new = corr[r] > m[r] ? corr[r] : m[r];
        corr[r] = m_new == -INFINITY ? 1.f : exp_nonpos(m[r] - m_new);
        m[r] = m_new;
        l[r] *= corr[r];
    }
    for (int64_t t = 0; t < n; ++t) {
        float *s = st + t * ld;
#pragma omp simd
        for (int64_t r = 0; r < rows; ++r) {
            const float p = m[r] == -INFINITY ? 0.f : exp_nonpos(s[r] - m[r]);
            s[r] = p;
            l[r] += p;
        }
    }
}

/* Scores of keys a row may not see, -inf: key position kp > the row's query position, or (a
 * window) kp <= query position - window. Rows are ordered by query token, so each is a prefix
 * (causal) or suffix (window) of the rows. */
static void mask_rows(const Args *a, float *st, int64_t n, int64_t ld, int64_t rows,
                      int64_t base, int64_t first_pos, int64_t group) {
    for (int64_t t = 0; t < n; ++t) {
        const int64_t kp = base + t, before = (kp - first_pos) * group;
        float *s = st + t * ld;
        for (int64_t r = 0; r < (before < rows ? before : rows); ++r) s[r] = -INFINITY;
        if (a->window > 0) {
            const int64_t after = (kp + a->window - first_pos) * group; /* first row too far */
            for (int64_t r = after > 0 ? after : 0; r < rows; ++r) s[r] = -INFINITY;
        }
    }
}

/* Attention of query tokens j0 .. j0 + nq - 1 (nq > 1) of request r, all heads, by register
 * tiles (see above). */
static void attend_tile_tiled(const Args *a, Scratch *w, int64_t r, int64_t j0, int64_t nq) {
    const int64_t D = a->head_dim, bs = a->block_size, H = a->num_heads, Hkv = a->num_kv_heads;
    const int64_t group = H / Hkv, rows_h = nq * group, ld = (rows_h + 15) / 16 * 16;
    const int64_t q0 = a->query_start_loc[r], qlen = a->query_start_loc[r + 1] - q0;
    const int64_t first_pos = a->seq_lens[r] - qlen + j0, last_pos = first_pos + nq - 1;
    const int64_t lo = a->window > 0 && first_pos - a->window + 1 > 0
        ? first_pos - a->window + 1 : 0;
    const int64_t nblk = super_blocks(bs, SB), row = Hkv * D;
    const int32_t *bt = a->block_table + r * a->bt_stride;
    const size_t es = elem_size(a->dtype);
    const char **keys = w->kp, **vals = w->vp, **qrows = w->qrow;
    load_queries_transposed(a, w, q0 + j0, nq, ld);
    for (int64_t R = 0; R < H * nq; ++R) {
        w->m[R] = -INFINITY;
        w->l[R] = 0.f;
    }
    memset(w->acc, 0, sizeof(float) * H * nq * D);
    for (int64_t b0 = lo / bs; b0 * bs <= last_pos; b0 += nblk) {
        const int64_t base = b0 * bs, end = base + nblk * bs <= last_pos + 1
            ? base + nblk * bs : last_pos + 1, n = end - base;
        for (int64_t h = 0; h < Hkv; ++h) {
            float *st = w->st, *acc = w->acc + h * rows_h * D, *qt = w->qt + h * D * ld;
            float *m = w->m + h * rows_h, *l = w->l + h * rows_h, *corr = w->corr;
            for (int64_t t = 0; t < n; ++t) {
                const int64_t off = ((int64_t)bt[b0 + t / bs] * bs + t % bs) * row + h * D;
                keys[t] = a->k_cache + off * es;
                vals[t] = a->v_cache + off * es;
            }
            for (int64_t d = 0; d < D; ++d) qrows[d] = (const char *)(qt + d * ld);
            for (int64_t c = 0; c < ld; c += 16) /* S^T = K Q^T, 16 rows of Q at a time */
                tile_gemm(n, D, keys, 1, a->dtype, qrows, c, DT_F32, st + c, ld, 0);
            soft_cap_scores(st, n * ld, a->softcap); /* S^T: n keys of ld rows, unmasked */
            if (end - 1 > first_pos || (a->window > 0 && base <= last_pos - a->window))
                mask_rows(a, st, n, ld, rows_h, base, first_pos, group);
            softmax_step_rows(st, n, ld, rows_h, m, l, corr);
            for (int64_t R = 0; R < rows_h; ++R) {
                if (corr[R] != 1.f)
                    for (int64_t d = 0; d < D; ++d) acc[R * D + d] *= corr[R];
                qrows[R] = (const char *)(st + R); /* row R of P = column R of P^T */
            }
            for (int64_t c = 0; c < D; c += 16) /* O += P V, 16 columns of head_dim at a time */
                tile_gemm(rows_h, n, qrows, ld, DT_F32, vals, c, a->dtype, acc + c, D, 1);
        }
    }
    const int64_t first_out = q0 + j0;
    for (int64_t i = 0; i < nq; ++i)
        for (int64_t hq = 0; hq < H; ++hq) {
            const int64_t rr = (hq / group) * rows_h + i * group + hq % group;
            float *acc = w->acc + rr * D;
            const float inv = w->l[rr] > 0.f ? 1.f / w->l[rr] : 0.f;
            for (int64_t d = 0; d < D; ++d) acc[d] *= inv;
            store_row(a->dtype, acc, a->out + ((first_out + i) * H + hq) * D * es, D);
        }
}

#endif
