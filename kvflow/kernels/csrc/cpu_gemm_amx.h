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

enum { AMX_K = 32, AMX_ROWS = 16, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };

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

/* Rows [ic, ic + mb) of x times k-paired panel p into y (row stride ldy, column 0 = the panel's
 * first), plus bias. Full panels are stored straight from the tiles; an edge panel (fewer than
 * NR columns) goes through a scratch tile. */
static void amx_block_panel(const Gemm *g, int64_t ic, int64_t mb, int64_t p, float *y,
                            int64_t ldy) {
    const int64_t cols = min64(g->n - p * NR, NR), k = g->k;
    const uint16_t *panel = (const uint16_t *)g->packed + p * k * NR;
    const int64_t xs = g->x_stride * 2, bs = 2 * NR * 2; /* bytes per x row / pair row */
    float scratch[2 * AMX_ROWS * NR];
    for (int64_t ir = 0; ir < mb; ir += 2 * AMX_ROWS) {
        const int rows0 = (int)min64(mb - ir, AMX_ROWS);
        const int rows1 = (int)(mb - ir > AMX_ROWS ? min64(mb - ir - AMX_ROWS, AMX_ROWS) : 0);
        amx_configure(rows0, rows1);
        const char *x0 = (const char *)g->x + (ic + ir) * xs, *x1 = x0 + AMX_ROWS * xs;
        _tile_zero(0);
        _tile_zero(1);
        if (rows1) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int64_t kc = 0; kc < k; kc += AMX_K) {
            const uint16_t *b = panel + kc * NR; /* pair row kc / 2 */
            _tile_loadd(6, b, bs);
            _tile_loadd(7, b + AMX_ROWS * 2, bs);
            _tile_loadd(4, x0 + kc * 2, xs);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (rows1) {
                _tile_loadd(5, x1 + kc * 2, xs);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        const int direct = cols == NR;
        float *c = direct ? y + ir * ldy : scratch;
        const int64_t ldc = direct ? ldy : NR, cb = ldc * 4;
        _tile_stored(0, c, cb);
        _tile_stored(1, c + AMX_ROWS, cb);
        if (rows1) {
            _tile_stored(2, c + AMX_ROWS * ldc, cb);
            _tile_stored(3, c + AMX_ROWS * ldc + AMX_ROWS, cb);
        }
        const int rows = rows0 + rows1;
        if (!direct)
            for (int i = 0; i < rows; ++i)
                memcpy(y + (ir + i) * ldy, scratch + i * NR, (size_t)cols * sizeof(float));
        if (g->bias)
            for (int i = 0; i < rows; ++i)
                for (int64_t j = 0; j < cols; ++j) y[(ir + i) * ldy + j] += g->bias[p * NR + j];
    }
}

#endif
