/*
 * AMX tiles for cpu_gemm.c's bf16 products (builds with AMX-BF16, cpu_build.py's "amx_bf16"
 * level; included by cpu_gemm.c after its Gemm type).
 *
 * Intel AMX (Intel SDM vol. 1 ch. 18; Intel Architecture Instruction Set Extensions
 * Programming Reference ch. 3) adds eight tile registers of up to 16 rows x 64 bytes and
 * TDPBF16PS, which multiplies a 16 x 32 bf16 tile A by a 32 x 16 bf16 tile B held in k-pairs
 * (16 rows of 16 column pairs) and adds the products into a 16 x 16 fp32 tile C: each fp32
 * element gets the sum of its 32 exact bf16 products, accumulated in fp32 like VDPBF16PS.
 *
 * The k-paired panels of cpu_gemm.c ([panel][k/2][32][2]) are already B tiles: pair row kp of
 * a panel holds its 32 columns' pairs (128 bytes), so columns 0-15 of pair rows kp..kp+15 are
 * one B tile at stride 128 bytes and columns 16-31 the next. A tile is 16 rows of x, 32 values
 * of k each, read in place at x's row stride. Per call of amx_block_panel: C tiles 0-3 hold
 * up to 32 rows x the panel's 32 columns (2 x 2 tiles), A tiles 4-5 two row groups, B tiles
 * 6-7 the panel's two column halves; each step of 32 k values loads 4 tiles and issues 4
 * TDPBF16PS. Only k that is a multiple of 32 runs here (a tile cannot stop inside its row
 * without another tile configuration, which would zero C); other k, and processes the kernel
 * does not let use AMX, take the VDPBF16PS micro-kernel.
 *
 * Linux hands AMX's tile data to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM
 * for XFEATURE_XTILEDATA, Documentation/arch/x86/xstate.rst); amx_ready asks once.
 */
#ifndef KVFLOW_CPU_GEMM_AMX_H
#define KVFLOW_CPU_GEMM_AMX_H

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

/* AMX_MB: rows of x per block (x block of AMX_MB x k bf16 in L2: 288 KB at k = 576, 768 KB at
 * k = 1,536, within the 2 MiB L2 per core of the AMX Xeons); AMX_KB: k values per chunk. */
enum { AMX_K = 32, AMX_ROWS = 16, AMX_MB = 256, AMX_KB = 256, ARCH_REQ_XCOMP_PERM = 0x1023,
       XFEATURE_XTILEDATA = 18 };
/* x is packed in tile order from AMX_PACK_ROWS rows (fewer rows are read by few panels' worth
 * of tile loads: packing did not pay at 32 rows); states of a block's packing (Gemm.xstate). */
enum { AMX_PACK_ROWS = 48, AMX_X_IN_PLACE = 0, AMX_X_PACKING = 1, AMX_X_PACKED = 2 };

/* The 64-byte operand of LDTILECFG, palette 1. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* 1 when this process may use AMX tiles (asked of the kernel once; 0 when refused). */
static int amx_ready(void) {
    static int state = -1; /* -1: not asked yet; written once, racing writers agree */
    int s = __atomic_load_n(&state, __ATOMIC_RELAXED);
    if (s < 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        __atomic_store_n(&state, s, __ATOMIC_RELAXED);
    }
    return s;
}

/* Loads the tile layout for rows0 (C tiles 0-1, A tile 4) and rows1 (C 2-3, A 5; 0 = unused)
 * rows of x; B tiles 6-7 are 16 pair rows of 16 column pairs. */
static inline void amx_configure(int rows0, int rows1) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, AMX_ROWS, AMX_ROWS};
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = (uint8_t)rows[t];
        cfg.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&cfg);
}

/* Whether amx_block_panel computes this product: bf16 x and k-paired bf16 panels, k a whole
 * number of tile steps, and AMX granted to the process. */
static inline int amx_applies(const Gemm *g) {
    return g->wdt == DT_BF16 && g->xdt == DT_BF16 && g->k > 0 && g->k % AMX_K == 0 &&
           amx_ready();
}

/* Loads C tiles 0-3 (rows1 = 0: only 0-1) from c (row stride cb bytes), or zeroes them. */
static inline void amx_load_c(const float *c, int64_t ldc, int rows1, int zero) {
    const int64_t cb = ldc * 4;
    if (zero) {
        _tile_zero(0);
        _tile_zero(1);
        if (rows1) {
            _tile_zero(2);
            _tile_zero(3);
        }
        return;
    }
    _tile_loadd(0, c, cb);
    _tile_loadd(1, c + AMX_ROWS, cb);
    if (rows1) {
        _tile_loadd(2, c + AMX_ROWS * ldc, cb);
        _tile_loadd(3, c + AMX_ROWS * ldc + AMX_ROWS, cb);
    }
}

static inline void amx_store_c(float *c, int64_t ldc, int rows1) {
    const int64_t cb = ldc * 4;
    _tile_stored(0, c, cb);
    _tile_stored(1, c + AMX_ROWS, cb);
    if (rows1) {
        _tile_stored(2, c + AMX_ROWS * ldc, cb);
        _tile_stored(3, c + AMX_ROWS * ldc + AMX_ROWS, cb);
    }
}

/* Packs rows [ic, ic + mb) of x into g->xtiles in tile order: 16-row strip r, k step s (32
 * values) at element (r * k / 32 + s) * 512, one 1 KB A tile whose rows are 64 bytes apart. */
static void amx_pack_rows(const Gemm *g, int64_t ic, int64_t mb) {
    const int64_t steps = g->k / AMX_K;
    const uint16_t *x = (const uint16_t *)g->x;
    for (int64_t r = ic; r < ic + mb; ++r)
        for (int64_t s = 0; s < steps; ++s)
            memcpy(g->xtiles + ((r / AMX_ROWS) * steps + s) * (AMX_ROWS * AMX_K) +
                       (r % AMX_ROWS) * AMX_K,
                   x + r * g->x_stride + s * AMX_K, AMX_K * 2);
}

/* Block b (rows [ic, ic + mb)) of x in tile order, packed by the first thread that asks; the
 * others go on meanwhile, reading x in place (the same values, so the same results), instead of
 * waiting for it. */
static void amx_pack_block_once(const Gemm *g, int64_t b, int64_t ic, int64_t mb) {
    uint32_t idle = AMX_X_IN_PLACE;
    if (!g->xtiles || __atomic_load_n(&g->xstate[b], __ATOMIC_RELAXED) != AMX_X_IN_PLACE ||
        !__atomic_compare_exchange_n(&g->xstate[b], &idle, AMX_X_PACKING, 0, __ATOMIC_ACQUIRE,
                                     __ATOMIC_RELAXED))
        return;
    amx_pack_rows(g, ic, mb);
    __atomic_store_n(&g->xstate[b], AMX_X_PACKED, __ATOMIC_RELEASE);
}

/* Rows [ic, ic + mb) of x (one block: ic a multiple of AMX_MB, mb <= AMX_MB) times k-paired
 * panel p into y (dtype ydt, row stride ldy elements, column 0 = the panel's first), plus bias.
 *
 * Blocking (Goto & van de Geijn's loop nest, with AMX tiles as the micro-kernel): k is walked in
 * chunks of AMX_KB values; for each chunk, every 32-row group of the block multiplies the same
 * AMX_KB x 32 slice of the panel (16 KB, which stays in L1 across the groups) by its own
 * 32 x AMX_KB slice of x (16 KB, from L2), the fp32 sums carried between chunks in C (y itself
 * for an fp32 y and a full panel, else an L1/L2 scratch rounded once at the end). So a call
 * with up to AMX_MB rows reads each weight panel from memory once. x's A tiles come from the
 * block packed in tile order when it is ready (contiguous 1 KB loads; read in place, 16 rows
 * k * 2 bytes apart, they ran 1.3-3x slower: strided rows that share cache sets), else in
 * place. */
static void amx_block_panel(const Gemm *g, int64_t ic, int64_t mb, int64_t p, void *y,
                            int64_t ldy, int ydt) {
    const int64_t cols = min64(g->n - p * NR, NR), k = g->k;
    const uint16_t *panel = (const uint16_t *)g->packed + p * k * NR;
    const int64_t bs = 2 * NR * 2; /* bytes per pair row */
    const int tiles = g->xtiles && __atomic_load_n(&g->xstate[ic / AMX_MB], __ATOMIC_ACQUIRE) ==
                                       AMX_X_PACKED;
    /* bytes between x rows and between k steps, and of one 16-row strip */
    const int64_t xs = tiles ? AMX_K * 2 : g->x_stride * 2, ks = tiles ? AMX_ROWS * AMX_K * 2 : AMX_K * 2;
    const int64_t strip = tiles ? k / AMX_K * ks : AMX_ROWS * xs;
    const char *xbase = tiles ? (const char *)(g->xtiles + ic * k) : (const char *)g->x + ic * xs;
    const int in_place = ydt == DT_F32 && cols == NR;
    _Alignas(64) float scratch[AMX_MB * NR];
    float *c = in_place ? (float *)y : scratch;
    const int64_t ldc = in_place ? ldy : NR;
    int cfg0 = -1, cfg1 = -1; /* the tile configuration loaded (another kernel may change it
                                 between calls: always loaded once per call) */
    for (int64_t kb = 0; kb < k; kb += AMX_KB) {
        const int64_t kend = min64(k, kb + AMX_KB);
        for (int64_t ir = 0; ir < mb; ir += 2 * AMX_ROWS) {
            const int rows0 = (int)min64(mb - ir, AMX_ROWS);
            const int rows1 = (int)(mb - ir > AMX_ROWS ? min64(mb - ir - AMX_ROWS, AMX_ROWS) : 0);
            if (rows0 != cfg0 || rows1 != cfg1) {
                amx_configure(rows0, rows1);
                cfg0 = rows0, cfg1 = rows1;
            }
            float *cc = c + ir * ldc;
            amx_load_c(cc, ldc, rows1, kb == 0);
            const char *x0 = xbase + ir / AMX_ROWS * strip, *x1 = x0 + strip;
            for (int64_t kc = kb; kc < kend; kc += AMX_K) {
                const uint16_t *b = panel + kc * NR; /* pair row kc / 2 */
                const int64_t at = kc / AMX_K * ks;
                _tile_loadd(6, b, bs);
                _tile_loadd(7, b + AMX_ROWS * 2, bs);
                _tile_loadd(4, x0 + at, xs);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (rows1) {
                    _tile_loadd(5, x1 + at, xs);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            amx_store_c(cc, ldc, rows1);
        }
    }
    if (in_place && !g->bias) return;
    const int64_t es = (int64_t)elem_size(ydt);
    const float *bias = g->bias ? g->bias + p * NR : NULL;
    for (int64_t i = 0; i < mb; ++i) {
        float *row = c + i * ldc;
        if (bias)
            for (int64_t j = 0; j < cols; ++j) row[j] += bias[j];
        if (!in_place) store_row(ydt, row, (char *)y + i * ldy * es, cols);
    }
}

#endif
