/* bf16 prefill tiles by bf16 dot products (VDPBF16PS), for builds with AVX512-BF16: the
 * register-tiled path of cpu_attention_tiled.h with both products on bf16 operands. Included by
 * cpu_attention.c after cpu_attention_tiled.h (static functions, specialized in place).
 *
 * VDPBF16PS (Intel SDM vol. 2) adds to each of 16 fp32 lanes the products of one pair of bf16
 * values of each operand: twice the multiplies of an fp32 FMA per instruction, and no widening
 * of the 16-bit cache. The pair runs along the reduction dimension of each product:
 *
 *   S^T[t][r] = k_t . q_r       pairs over head_dim: the broadcast operand is a 32-bit pair
 *                               of a key row read in place from the cache; Q^T is packed once
 *                               per tile as qp[d / 2][r] pairs (16 rows r per vector), the
 *                               queries unscaled (exact), S scaled in fp32 after the product;
 *   online softmax over t       fp32, cpu_attention_tiled.h's softmax_step_rows;
 *   O[r][:] += P V              pairs over keys: P is rounded to bf16 (relative error <= 2^-9
 *                               per weight, as GPU FlashAttention keeps P in 16 bits) and
 *                               packed as pp[t / 2][r] pairs (broadcast operand), V as
 *                               vp[t / 2][d] pairs (vector operand), one pack per super-block
 *                               and KV head. The running sums l stay fp32 of the unrounded P.
 *
 * Products and accumulation are fp32 (bf16 x bf16 products are exact in fp32), so S carries
 * the error of an fp32 dot product of the bf16 inputs. Needs head_dim % 16 == 0.
 */
#ifndef KVFLOW_CPU_ATTENTION_DP_H
#define KVFLOW_CPU_ATTENTION_DP_H

#if defined(__AVX512BF16__)
#include <immintrin.h>

enum { MR_DP = 12 }; /* rows per register tile: 12 accumulators of 16 lanes */

/* c[R][16] (row stride ldc) = (accumulate ? c : 0) + scale * sum_p A_p[r] . B_p, where A_p[r]
 * is the 32-bit bf16 pair at arow[r] + p * aps and B_p the 16 pairs at b + p * bps (32-bit
 * units). R: 1..MR_DP, a constant wherever this is inlined. */
static inline __attribute__((always_inline)) void tile_dp(
        int R, int64_t pairs, const int32_t *const *arow, int64_t aps, const int32_t *b,
        int64_t bps, float *c, int64_t ldc, int accumulate, float scale) {
    __m512 acc[MR_DP];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        const __m512bh bv = (__m512bh)_mm512_loadu_si512(b + p * bps);
        for (int r = 0; r < R; ++r)
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(arow[r][p * aps]), bv);
    }
    const __m512 sv = _mm512_set1_ps(scale);
    for (int r = 0; r < R; ++r) {
        __m512 v = _mm512_mul_ps(acc[r], sv);
        if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(c + r * ldc));
        _mm512_storeu_ps(c + r * ldc, v);
    }
}

/* tile_dp over `rows` A rows, MR_DP at a time (the rest by a copy specialized for its count). */
static void tile_dp_rows(int64_t rows, int64_t pairs, const int32_t *const *arow, int64_t aps,
                         const int32_t *b, int64_t bps, float *c, int64_t ldc, int accumulate,
                         float scale) {
    for (int64_t r0 = 0; r0 < rows; r0 += MR_DP) {
        const int64_t R = rows - r0 < MR_DP ? rows - r0 : MR_DP;
        const int32_t *const *ar = arow + r0;
        float *cr = c + r0 * ldc;
#define TDP(n) tile_dp(n, pairs, ar, aps, b, bps, cr, ldc, accumulate, scale)
        switch (R) {
        case 1: TDP(1); break;
        case 2: TDP(2); break;
        case 3: TDP(3); break;
        case 4: TDP(4); break;
        case 5: TDP(5); break;
        case 6: TDP(6); break;
        case 7: TDP(7); break;
        case 8: TDP(8); break;
        case 9: TDP(9); break;
        case 10: TDP(10); break;
        case 11: TDP(11); break;
        default: TDP(12); break;
        }
#undef TDP
    }
}

/* Q^T of the tile for every KV head as bf16 pairs: qp[h][d / 2][r] = (q_r[d], q_r[d + 1]),
 * rows r < ld as in load_queries_transposed (padding rows zero), unscaled. */
static void pack_queries_dp(const Args *a, int32_t *qp, int64_t first_token, int64_t nq,
                            int64_t ld) {
    const int64_t D = a->head_dim, H = a->num_heads, group = H / a->num_kv_heads;
    memset(qp, 0, sizeof(int32_t) * a->num_kv_heads * (D / 2) * ld);
    for (int64_t i = 0; i < nq; ++i)
        for (int64_t hq = 0; hq < H; ++hq) {
            const int32_t *q = (const int32_t *)(a->q + ((first_token + i) * a->q_stride
                                                          + hq * D) * 2);
            int32_t *dst = qp + (hq / group) * (D / 2) * ld + i * group + hq % group;
            for (int64_t p = 0; p < D / 2; ++p) dst[p * ld] = q[p];
        }
}

/* vp[t / 2][d] = (v_t[d], v_{t+1}[d]) for the n value rows (bf16, in place); an odd n's last
 * pair is (v_{n-1}[d], 0). Interleaves 32 columns of two rows per two permutes. */
static void pack_values_dp(const char *const *vals, int64_t n, int64_t D, int32_t *vp) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                        40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                        32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t t = 0; t < n; t += 2) {
        const uint16_t *v0 = (const uint16_t *)vals[t];
        const uint16_t *v1 = t + 1 < n ? (const uint16_t *)vals[t + 1] : NULL;
        int32_t *dst = vp + (t / 2) * D;
        for (int64_t d = 0; d < D; d += 32) {
            const __mmask32 k = D - d >= 32 ? 0xffffffffu : 0xffffu; /* D % 32 == 16: a half */
            const __m512i x0 = _mm512_maskz_loadu_epi16(k, v0 + d);
            const __m512i x1 = v1 ? _mm512_maskz_loadu_epi16(k, v1 + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(x0, lo, x1));
            if (D - d >= 32)
                _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(x0, hi, x1));
        }
    }
}

/* pp[t / 2][r] = (bf16(p[t][r]), bf16(p[t + 1][r])) from the fp32 P^T st (row stride ld), ld
 * rows r; an odd n's last pair is (p[n-1][r], 0). Round to nearest even. */
static void pack_probs_dp(const float *st, int64_t n, int64_t ld, int32_t *pp) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                           1, 16, 0);
    for (int64_t t = 0; t < n; t += 2)
        for (int64_t r = 0; r < ld; r += 16) {
            const __m512 p0 = _mm512_loadu_ps(st + t * ld + r);
            const __m512 p1 = t + 1 < n ? _mm512_loadu_ps(st + (t + 1) * ld + r)
                                        : _mm512_setzero_ps();
            /* lanes 0-15: p0's 16 values, 16-31: p1's, then interleaved into pairs */
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
            _mm512_storeu_si512(pp + (t / 2) * ld + r, _mm512_permutexvar_epi16(order, both));
        }
}

/* Attention of query tokens j0 .. j0 + nq - 1 (nq > 1) of request r, all heads, bf16 cache and
 * queries, by bf16 dot products (see above). Scratch: w->qt holds qp, w->st the scores, w->pp
 * and w->vpk the packed P and V of one super-block and KV head. */
static void attend_tile_dp(const Args *a, Scratch *w, int64_t r, int64_t j0, int64_t nq) {
    const int64_t D = a->head_dim, bs = a->block_size, H = a->num_heads, Hkv = a->num_kv_heads;
    const int64_t group = H / Hkv, rows_h = nq * group, ld = (rows_h + 15) / 16 * 16;
    const int64_t q0 = a->query_start_loc[r], qlen = a->query_start_loc[r + 1] - q0;
    const int64_t first_pos = a->seq_lens[r] - qlen + j0, last_pos = first_pos + nq - 1;
    const int64_t lo = a->window > 0 && first_pos - a->window + 1 > 0
        ? first_pos - a->window + 1 : 0;
    const int64_t nblk = super_blocks(bs), row = Hkv * D;
    const int32_t *bt = a->block_table + r * a->bt_stride;
    const char **keys = w->kp, **vals = w->vp;
    const int32_t **prow = (const int32_t **)w->qrow; /* P pair rows: pp + r */
    int32_t *qp = (int32_t *)w->qt, *pp = w->pp, *vpk = w->vpk;
    pack_queries_dp(a, qp, q0 + j0, nq, ld);
    for (int64_t R = 0; R < H * nq; ++R) {
        w->m[R] = -INFINITY;
        w->l[R] = 0.f;
    }
    memset(w->acc, 0, sizeof(float) * H * nq * D);
    for (int64_t b0 = lo / bs; b0 * bs <= last_pos; b0 += nblk) {
        const int64_t base = b0 * bs, end = base + nblk * bs <= last_pos + 1
            ? base + nblk * bs : last_pos + 1, n = end - base, np = (n + 1) / 2;
        for (int64_t h = 0; h < Hkv; ++h) {
            float *st = w->st, *acc = w->acc + h * rows_h * D;
            float *m = w->m + h * rows_h, *l = w->l + h * rows_h, *corr = w->corr;
            for (int64_t t = 0; t < n; ++t) {
                const int64_t off = ((int64_t)bt[b0 + t / bs] * bs + t % bs) * row + h * D;
                keys[t] = a->k_cache + off * 2;
                vals[t] = a->v_cache + off * 2;
            }
            for (int64_t c = 0; c < ld; c += 16) /* S^T = K Q^T, 16 rows of Q at a time */
                tile_dp_rows(n, D / 2, (const int32_t *const *)keys, 1,
                             qp + h * (D / 2) * ld + c, ld, st + c, ld, 0, a->scale);
            soft_cap_scores(st, n * ld, a->softcap); /* S^T: n keys of ld rows, unmasked */
            if (end - 1 > first_pos || (a->window > 0 && base <= last_pos - a->window))
                mask_rows(a, st, n, ld, rows_h, base, first_pos, group);
            softmax_step_rows(st, n, ld, rows_h, m, l, corr);
            for (int64_t R = 0; R < rows_h; ++R)
                if (corr[R] != 1.f)
                    for (int64_t d = 0; d < D; ++d) acc[R * D + d] *= corr[R];
            pack_probs_dp(st, n, ld, pp);
            pack_values_dp(vals, n, D, vpk);
            for (int64_t R = 0; R < rows_h; ++R) prow[R] = pp + R;
            for (int64_t c = 0; c < D; c += 16) /* O += P V, 16 columns of head_dim at a time */
                tile_dp_rows(rows_h, np, prow, ld, vpk + c, D, acc + c, D, 1, 1.f);
        }
    }
    const int64_t first_out = q0 + j0;
    for (int64_t i = 0; i < nq; ++i)
        for (int64_t hq = 0; hq < H; ++hq) {
            const int64_t rr = (hq / group) * rows_h + i * group + hq % group;
            float *acc = w->acc + rr * D;
            const float inv = w->l[rr] > 0.f ? 1.f / w->l[rr] : 0.f;
            for (int64_t d = 0; d < D; ++d) acc[d] *= inv;
            store_row(a->dtype, acc, a->out + ((first_out + i) * H + hq) * D * 2, D);
        }
}
#endif

#endif
