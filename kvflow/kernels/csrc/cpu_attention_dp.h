/* bf16 prefill tiles by bf16 dot products (VDPBF16PS), for builds with AVX512-BF16: the
 * register-tiled path of cpu_attention_tiled.h with both products on bf16 operands. Included by
 * cpu_attention.c after cpu_attention_tiled.h (static functions, specialized in place).
 *
 * VDPBF16PS (Intel SDM vol. 2) adds to each of 16 fp32 lanes the products of one pair of bf16
 * values of each operand: twice the multiplies of an fp32 FMA per instruction, and no widening
 * of the 16-bit cache. The pair runs along the reduction dimension of each product:
 *
 * Per KV head and super-block of up to SB_DP keys (whole cache blocks):
 *
 *   S^T[t][r] = k_t . q_r       pairs over head_dim: the broadcast operand is a 32-bit pair
 *                               of a key row read in place from the cache; Q^T is packed once
 *                               per tile as qp[d / 2][r] pairs (16 rows r per vector, by 16 x 16
 *                               register transposes), the queries unscaled (exact). Register
 *                               tile: MR_DP keys x up to NV_DP vectors of 16 rows. Its epilogue
 *                               masks (causal / window: a prefix / suffix of the rows per key,
 *                               by a lane compare) and keeps the running max per row, so S is
 *                               written once and not re-read before the softmax. S is stored
 *                               as the raw products (scale > 0 commutes with the max; the
 *                               softmax folds it into its exponent), or, with a softcap, scaled
 *                               in fp32 and capped first;
 *   online softmax over t       fp32, vectorized across 16 rows: one pass per 16 rows computes
 *                               the new max, the rescale factor corr, exp(s - m) (exp16_shifted),
 *                               the running sums l, and packs P rounded to bf16 (relative error
 *                               <= 2^-9 per weight, as GPU FlashAttention keeps P in 16 bits)
 *                               as pp[t / 2][r] pairs. The running sums l stay fp32 of the
 *                               unrounded P;
 *   O[r][:] = O corr + P V      pairs over keys: P the broadcast operand, V packed as
 *                               vp[t / 2][d] pairs (vector operand), one pack per super-block
 *                               and KV head; register tile MR_PV rows x up to NV_PV vectors of
 *                               16 columns, corr applied in its epilogue (one FMA per output
 *                               vector instead of a pass over O).
 *
 * Rows of a KV head are laid out with stride ld (rows_h rounded up to 16): its softmax state
 * (m, l) and accumulators O; rows past rows_h (zero queries) are computed and never stored.
 * Products and accumulation are fp32 (bf16 x bf16 products are exact in fp32), so S carries
 * the error of an fp32 dot product of the bf16 inputs. Needs head_dim % 16 == 0. Not
 * batch-invariant (a tile's sums depend on its rows and super-blocks); --deterministic takes
 * the decode path instead (cpu_attention.c).
 */
#ifndef KVFLOW_CPU_ATTENTION_DP_H
#define KVFLOW_CPU_ATTENTION_DP_H

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* Register tiles: scores MR_DP keys x NV_DP vectors of 16 rows = 24 accumulators (plus NV_DP
 * vector operands and one broadcast: 28 of the 32 zmm registers), values MR_PV rows x NV_PV
 * vectors of 16 columns = 16 (head_dim 64 in one pass). Each broadcast feeds NV products. */
enum { MR_DP = 8, NV_DP = 3, MR_PV = 4, NV_PV = 4 };

/* exp((s - m) a) on 16 lanes for s <= m (s = -inf allowed), given k = a log2(e) and km = k m:
 * t = s k - km (one FMA), 2^t = 2^floor(t) 2^f with f = t - floor(t) in [0, 1] (VREDUCEPS;
 * 0 for t = -inf), 2^f by a degree-5 polynomial (least-squares fit of 2^f at Chebyshev nodes
 * of [0, 1]: relative error 1e-7 with its fp32 coefficients), 2^floor(t) applied by VSCALEFPS
 * (which takes the floor itself); t below -126 (weights under 2^-126 of the row's largest,
 * masked keys) gives exactly 0, never a subnormal. t's own rounding adds |t| 2^-24 ln 2
 * relative, largest for the smallest weights (at most 2e-8 of the row's largest weight). */
static inline __m512 exp16_shifted(__m512 s, __m512 k, __m512 km) {
    const __m512 t = _mm512_fmsub_ps(s, k, km);
    const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(1.8762329e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.992584e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5823606e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4015453e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9315296e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99999994f));
    const __mmask16 keep = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
    return _mm512_maskz_scalef_ps(keep, p, t);
}

/* What the score tile's epilogue needs: the super-block's first key position and its number
 * of keys n (keys from n on are padding), the tile's first / last query positions, the GQA
 * group, and the call's scale / softcap / window; scaled: S is stored times scale (and
 * soft-capped), else as the raw products q . k (scale > 0, no softcap: the max commutes with
 * the scale, which the softmax then folds into its exponent). */
typedef struct {
    int64_t base, n, first_pos, last_pos, group, window;
    float scale, softcap;
    int scaled;
} ScoreEpilogue;

/* A row bound clamped to [0, 2^30] (rows are fewer), for a 32-bit lane compare. */
static inline int32_t row_index(int64_t x) {
    return (int32_t)(x < 0 ? 0 : x > (1 << 30) ? (1 << 30) : x);
}

/* Scores of keys t0 .. t0 + MR_DP - 1 (key rows keys[0..MR_DP); padding keys past the
 * super-block's n keys repeat its last key and are masked in every row, so their scores never
 * raise the max (left unmasked they raised it where the window hid that last key, and a max
 * 87 or more above a row's visible scores zeroed its weights) against the NV x 16
 * rows c .. of Q^T pairs qp (row stride ld, 32-bit pairs): st[t][c + j] = S^T (mode 2: scaled
 * and soft-capped), masked (mode 1; mode 2 where mask), mx[j] the running max. */
static inline __attribute__((always_inline)) void score_tile(
        int NV, int mode, int64_t pairs, const char *const *keys, const int32_t *qp,
        int64_t ld, int64_t t0, int64_t c, const ScoreEpilogue *e, int mask, float *st,
        float *mx) {
    __m512 acc[MR_DP][NV_DP];
    const int32_t *k[MR_DP];
    for (int r = 0; r < MR_DP; ++r) {
        k[r] = (const int32_t *)keys[r];
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
    }
    for (int64_t p = 0; p < pairs; ++p) {
        __m512bh b[NV_DP];
        for (int v = 0; v < NV; ++v)
            b[v] = (__m512bh)_mm512_loadu_si512(qp + p * ld + 16 * v);
        for (int r = 0; r < MR_DP; ++r) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(k[r][p]);
            for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
        }
    }
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 scale = _mm512_set1_ps(e->scale);
    const float cap = e->softcap; /* locals: st's stores may not alias them */
    const int64_t window = e->window, group = e->group, rel = e->base + t0 - e->first_pos;
    const int masked = mode == 1 || (mode == 2 && mask);
    __m512 m[NV_DP];
    for (int v = 0; v < NV; ++v) m[v] = _mm512_loadu_ps(mx + 16 * v);
    for (int r = 0; r < MR_DP; ++r) {
        /* mask_rows' rule for key position kp = base + t0 + r: rows before (kp - first_pos)
         * group, and (a window) from (kp + window - first_pos) group on, see -inf; every row
         * for a padding key (t0 + r >= n) */
        const __m512i before = _mm512_set1_epi32(
            t0 + r >= e->n ? 1 << 30 : row_index((rel + r) * group));
        const __m512i after = _mm512_set1_epi32(
            window > 0 ? row_index((rel + r + window) * group) : 1 << 30);
        for (int v = 0; v < NV; ++v) {
            __m512 s = acc[r][v];
            if (mode == 2) {
                s = _mm512_mul_ps(s, scale);
                float tmp[16];
                _mm512_storeu_ps(tmp, s);
                soft_cap_scores(tmp, 16, cap);
                s = _mm512_loadu_ps(tmp);
            }
            if (masked) {
                const __m512i row = _mm512_add_epi32(lane,
                                                     _mm512_set1_epi32((int32_t)(c + 16 * v)));
                const __mmask16 hide = _mm512_cmplt_epi32_mask(row, before)
                    | _mm512_cmpge_epi32_mask(row, after);
                s = _mm512_mask_mov_ps(s, hide, _mm512_set1_ps(-INFINITY));
            }
            _mm512_storeu_ps(st + (t0 + r) * ld + c + 16 * v, s);
            m[v] = _mm512_max_ps(m[v], s);
        }
    }
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(mx + 16 * v, m[v]);
}

/* out[r][16 v + j] (row stride D) = out * corr[r] + sum_p P_p[r] . V_p[16 v + j] for MR_PV rows
 * and NV vectors, P_p[r] the 32-bit pair at pp + p * ld + r and V_p the pairs at vp + p * D. */
static inline __attribute__((always_inline)) void value_tile(
        int NV, int64_t pairs, const int32_t *pp, int64_t ld, const int32_t *vp, int64_t D,
        const float *corr, float *out) {
    __m512 acc[MR_PV][NV_PV];
    for (int r = 0; r < MR_PV; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        __m512bh b[NV_PV];
        for (int v = 0; v < NV; ++v)
            b[v] = (__m512bh)_mm512_loadu_si512(vp + p * D + 16 * v);
        for (int r = 0; r < MR_PV; ++r) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pp[p * ld + r]);
            for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
        }
    }
    for (int r = 0; r < MR_PV; ++r) {
        const __m512 cr = _mm512_set1_ps(corr[r]);
        for (int v = 0; v < NV; ++v) {
            float *o = out + r * D + 16 * v;
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), cr, acc[r][v]));
        }
    }
}

/* S^T of the e->n keys for all ld rows into st (rows up to n rounded up to MR_DP written;
 * those past n, of padding keys, -inf and unused), mx the rows' max. A key tile is masked
 * only where one of its keys lies past the first query (causal) or, with a window, at or
 * before the last query minus the window, or it holds padding keys. */
static void scores_dp(int64_t pairs, const char *const *keys, const int32_t *qp, int64_t ld,
                      const ScoreEpilogue *e, float *st, float *mx) {
    const int64_t n = e->n;
    for (int64_t r = 0; r < ld; ++r) mx[r] = -INFINITY;
    for (int64_t t0 = 0; t0 < n; t0 += MR_DP) {
        const int64_t k0 = e->base + t0; /* positions k0 .. k0 + MR_DP - 1 (padding too) */
        const int mask = k0 + MR_DP - 1 > e->first_pos || t0 + MR_DP > n
            || (e->window > 0 && k0 <= e->last_pos - e->window);
        const int mode = e->scaled ? 2 : mask ? 1 : 0;
        for (int64_t c = 0; c < ld; c += 16 * NV_DP) {
            const int64_t nv = (ld - c) / 16;
#define STILE(NV, M) \
    score_tile(NV, M, pairs, keys + t0, qp + c, ld, t0, c, e, mask, st, mx + c)
#define SMODE(NV) (mode == 0 ? STILE(NV, 0) : mode == 1 ? STILE(NV, 1) : STILE(NV, 2))
            if (nv >= 3) SMODE(3); else if (nv == 2) SMODE(2); else SMODE(1);
#undef SMODE
#undef STILE
        }
    }
}

/* O = O corr + P V for the rows [0, rows) (a multiple of MR_PV) of one KV head: pp the P pairs
 * (row stride ld), vp the V pairs (stride D), np pairs of keys, O rows of D floats. */
static void values_dp(int64_t rows, int64_t np, const int32_t *pp, int64_t ld,
                      const int32_t *vp, int64_t D, const float *corr, float *o) {
    for (int64_t r0 = 0; r0 < rows; r0 += MR_PV)
        for (int64_t c = 0; c < D; c += 16 * NV_PV) {
            const int64_t nv = (D - c) / 16;
#define VTILE(NV) value_tile(NV, np, pp + r0, ld, vp + c, D, corr + r0, o + r0 * D + c)
            if (nv >= 4) VTILE(4); else if (nv == 3) VTILE(3); else if (nv == 2) VTILE(2);
            else VTILE(1);
#undef VTILE
        }
}

/* One online-softmax step over the n keys of S^T st (row stride ld, in units of 1 / a: a the
 * scale not yet applied, or 1; mx the rows' max over them) for all ld rows, 16 at a time: m, l
 * updated (l *= corr, then += each p in key order), corr[r] the factor O must be scaled by,
 * and P = exp((s - m) a) rounded to bf16 into pp[t / 2][r] pairs (an odd n's last pair
 * (p[n-1][r], 0)); rows with m = -inf get p = 0 (km = 0 there, so every t is -inf). */
static void softmax_pack_dp(const float *st, int64_t n, int64_t ld, float a, const float *mx,
                            float *m, float *l, float *corr, int32_t *pp) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                           1, 16, 0);
    const __m512 k = _mm512_set1_ps(a * 1.44269504f);
    for (int64_t c = 0; c < ld; c += 16) {
        const __m512 m_old = _mm512_loadu_ps(m + c);
        const __m512 m_new = _mm512_max_ps(m_old, _mm512_loadu_ps(mx + c));
        const __mmask16 live = _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(-INFINITY),
                                                  _CMP_NEQ_OQ);
        const __m512 km = _mm512_maskz_mul_ps(live, m_new, k); /* dead rows: p = 0 below */
        const __m512 cr = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), live,
                                             exp16_shifted(m_old, k, km));
        __m512 lv = _mm512_mul_ps(_mm512_loadu_ps(l + c), cr);
        int64_t t = 0;
        for (; t + 2 <= n; t += 2) {
            const __m512 p0 = exp16_shifted(_mm512_loadu_ps(st + t * ld + c), k, km);
            const __m512 p1 = exp16_shifted(_mm512_loadu_ps(st + (t + 1) * ld + c), k, km);
            lv = _mm512_add_ps(_mm512_add_ps(lv, p0), p1);
            /* lanes 0-15: p0's 16 values, 16-31: p1's, then interleaved into pairs */
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
            _mm512_storeu_si512(pp + (t / 2) * ld + c, _mm512_permutexvar_epi16(order, both));
        }
        if (t < n) { /* an odd n's last key, paired with 0 */
            const __m512 p0 = exp16_shifted(_mm512_loadu_ps(st + t * ld + c), k, km);
            lv = _mm512_add_ps(lv, p0);
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_setzero_ps(), p0);
            _mm512_storeu_si512(pp + (t / 2) * ld + c, _mm512_permutexvar_epi16(order, both));
        }
        _mm512_storeu_ps(m + c, m_new);
        _mm512_storeu_ps(l + c, lv);
        _mm512_storeu_ps(corr + c, cr);
    }
}

/* dst[k * ld + j] = x[j][k] for k < cols (<= 16): a 16 x 16 transpose of 32-bit elements
 * (pairs within 128-bit lanes, then quads, then 128-bit lanes in two steps). */
static void store_transposed16(const __m512i x[16], int32_t *dst, int64_t ld, int64_t cols) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(x[i], x[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(x[i], x[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* u[i + j], lane L: column 4 L + j of rows i .. i + 3 */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; ++j) {
        const __m512i a = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
        const __m512i b = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
        const __m512i c = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        const __m512i d = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
        const __m512i col[4] = {_mm512_shuffle_i32x4(a, c, 0x88), _mm512_shuffle_i32x4(b, d, 0x88),
                                _mm512_shuffle_i32x4(a, c, 0xdd), _mm512_shuffle_i32x4(b, d, 0xdd)};
        for (int L = 0; L < 4; ++L)
            if (4 * L + j < cols) _mm512_storeu_si512(dst + (4 * L + j) * ld, col[L]);
    }
}

/* Q^T of the tile for every KV head as bf16 pairs: qp[h][d / 2][r] = (q_r[d], q_r[d + 1]),
 * rows r < ld as in load_queries_transposed (padding rows zero), unscaled: 16 rows x 16 pairs
 * loaded, transposed in registers, stored. */
static void pack_queries_dp(const Args *a, int32_t *qp, int64_t first_token, int64_t nq,
                            int64_t ld) {
    const int64_t D = a->head_dim, Hkv = a->num_kv_heads, group = a->num_heads / Hkv;
    const int64_t rows_h = nq * group, pairs = D / 2;
    const uint16_t *q0 = (const uint16_t *)a->q + first_token * a->q_stride;
    for (int64_t c = 0; c < ld; c += 16) {
        /* row c + j = (token i, head h * group + g), i = (c + j) / group, g = (c + j) % group:
         * element offset i q_stride + (h group + g) D from q0 */
        int64_t off[16];
        for (int64_t j = 0, i = c / group, g = c % group; j < 16; ++j) {
            off[j] = i * a->q_stride + g * D;
            if (++g == group) g = 0, ++i;
        }
        for (int64_t h = 0; h < Hkv; ++h)
            for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
                const int64_t cols = pairs - p0 < 16 ? pairs - p0 : 16;
                const __mmask16 k = (__mmask16)((1u << cols) - 1);
                __m512i x[16];
                for (int j = 0; j < 16; ++j)
                    x[j] = c + j < rows_h ? _mm512_maskz_loadu_epi32(
                        k, q0 + off[j] + (h * group * D + 2 * p0)) : _mm512_setzero_si512();
                store_transposed16(x, qp + (h * pairs + p0) * ld + c, ld, cols);
            }
    }
}

/* vp[t / 2][d] = (v_t[d], v_{t+1}[d]) for the n value rows (bf16, in place); an odd n's last
 * pair is (v_{n-1}[d], 0). Interleaves 32 columns of two rows per two permutes. */
static void pack_values_dp(const char *const *vals, int64_t n, int64_t D, int32_t *vp) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                        40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                        32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    const uint16_t zero[32] = {0};
    for (int64_t t = 0; t < n; t += 2) {
        const uint16_t *v0 = (const uint16_t *)vals[t];
        const uint16_t *v1 = t + 1 < n ? (const uint16_t *)vals[t + 1] : zero;
        const int64_t step = t + 1 < n ? 32 : 0; /* the odd tail's zero row stays put */
        int32_t *dst = vp + (t / 2) * D;
        int64_t d = 0;
        for (; d + 32 <= D; d += 32, v1 += step) {
            const __m512i x0 = _mm512_loadu_si512(v0 + d), x1 = _mm512_loadu_si512(v1);
            _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(x0, lo, x1));
            _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(x0, hi, x1));
        }
        if (d < D) { /* D % 32 == 16: a half */
            const __m512i x0 = _mm512_maskz_loadu_epi16(0xffffu, v0 + d);
            const __m512i x1 = _mm512_maskz_loadu_epi16(0xffffu, v1);
            _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(x0, lo, x1));
        }
    }
}

/* dst[0:n] = bf16(src[0:n] * inv), n % 16 == 0: f32_to_bf16's rounding (nearest even, NaN
 * quieted) on 16 lanes, bit for bit. */
static void store_scaled_bf16(const float *src, float inv, uint16_t *dst, int64_t n) {
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
    for (int64_t i = 0; i < n; i += 16) {
        const __m512i u = _mm512_castps_si512(
            _mm512_mul_ps(_mm512_loadu_ps(src + i), _mm512_set1_ps(inv)));
        const __m512i hi = _mm512_srli_epi32(u, 16);
        const __m512i rounded = _mm512_srli_epi32(
            _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(hi, one))), 16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(
            _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
        const __m512i out = _mm512_mask_mov_epi32(
            rounded, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtepi32_epi16(out));
    }
}

/* Attention of query tokens j0 .. j0 + nq - 1 (nq > 1) of request r, all heads, bf16 cache and
 * queries, by bf16 dot products (see above). Scratch: w->qt holds qp, w->st the scores, w->mx
 * their max, w->pp and w->vpk the packed P and V of one super-block and KV head; m, l and acc
 * hold KV head h's rows from h * ld on. */
static void attend_tile_dp(const Args *a, Scratch *w, int64_t r, int64_t j0, int64_t nq) {
    const int64_t D = a->head_dim, bs = a->block_size, H = a->num_heads, Hkv = a->num_kv_heads;
    const int64_t group = H / Hkv, rows_h = nq * group, ld = (rows_h + 15) / 16 * 16;
    const int64_t rows_pv = (rows_h + MR_PV - 1) / MR_PV * MR_PV; /* <= ld */
    const int64_t q0 = a->query_start_loc[r], qlen = a->query_start_loc[r + 1] - q0;
    const int64_t first_pos = a->seq_lens[r] - qlen + j0, last_pos = first_pos + nq - 1;
    const int64_t lo = a->window > 0 && first_pos - a->window + 1 > 0
        ? first_pos - a->window + 1 : 0;
    const int64_t nblk = super_blocks(bs, SB_DP), row = Hkv * D;
    const int32_t *bt = a->block_table + r * a->bt_stride;
    const char **keys = w->kp, **vals = w->vp;
    int32_t *qp = (int32_t *)w->qt;
    pack_queries_dp(a, qp, q0 + j0, nq, ld);
    for (int64_t R = 0; R < Hkv * ld; ++R) {
        w->m[R] = -INFINITY;
        w->l[R] = 0.f;
    }
    memset(w->acc, 0, sizeof(float) * Hkv * ld * D);
    const int scaled = a->softcap > 0.f || !(a->scale > 0.f);
    ScoreEpilogue e = {0, 0, first_pos, last_pos, group, a->window, a->scale, a->softcap,
                       scaled};
    for (int64_t b0 = lo / bs; b0 * bs <= last_pos; b0 += nblk) {
        const int64_t base = b0 * bs, end = base + nblk * bs <= last_pos + 1
            ? base + nblk * bs : last_pos + 1, n = end - base;
        e.base = base;
        e.n = n;
        for (int64_t h = 0; h < Hkv; ++h) {
            int64_t t = 0; /* key / value rows of the super-block, block by block */
            for (int64_t b = b0; t < n; ++b) {
                const int64_t off = ((int64_t)bt[b] * bs * row + h * D) * 2;
                for (int64_t i = 0; i < bs && t < n; ++i, ++t) {
                    keys[t] = a->k_cache + off + i * row * 2;
                    vals[t] = a->v_cache + off + i * row * 2;
                }
            }
            for (; t % MR_DP; ++t) keys[t] = keys[n - 1]; /* padding keys, scores unused */
            scores_dp(D / 2, keys, qp + h * (D / 2) * ld, ld, &e, w->st, w->mx);
            softmax_pack_dp(w->st, n, ld, scaled ? 1.f : a->scale, w->mx, w->m + h * ld,
                            w->l + h * ld, w->corr, w->pp);
            pack_values_dp(vals, n, D, w->vpk);
            values_dp(rows_pv, (n + 1) / 2, w->pp, ld, w->vpk, D, w->corr, w->acc + h * ld * D);
        }
    }
    const int64_t first_out = q0 + j0;
    for (int64_t i = 0; i < nq; ++i)
        for (int64_t h = 0; h < Hkv; ++h)
            for (int64_t g = 0; g < group; ++g) { /* query head h * group + g */
                const int64_t rr = h * ld + i * group + g;
                const float inv = w->l[rr] > 0.f ? 1.f / w->l[rr] : 0.f;
                store_scaled_bf16(w->acc + rr * D, inv, (uint16_t *)(
                    a->out + ((first_out + i) * H + h * group + g) * D * 2), D);
            }
}
#endif

#endif
