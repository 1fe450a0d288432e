/*
 * Peak multiply-add rate of one x86 core with AVX512: 12 independent accumulator chains of
 * VDPBF16PS (bf16 pairs -> fp32, 64 FLOP per 512-bit instruction) and of VFMADD231PS (fp32,
 * 32 FLOP), timed by process CPU time. The ceiling kvflow's bf16 / fp32 GEMMs are measured
 * against (docs/benchmarks.md, "CPU-W1 time per op class"), and VFMADD231PS on 256-bit ymm (one
 * 512-bit FMA pipe or two shows as zmm at 2x or 1x the ymm rate). Needs AVX512 (VDPBF16PS only
 * where the build has AVX512-BF16):
 *
 *     cc -O2 -march=x86-64-v4 -mavx512bf16 benchmarks/cpu_peak_flops.c -o /tmp/peak && /tmp/peak
 *     cc -O2 -march=x86-64-v4 benchmarks/cpu_peak_flops.c -o /tmp/peak && /tmp/peak  # no BF16
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double cpu_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    enum { CHAINS = 12 };
    const long n = 200000000 / CHAINS;
    double t, dt;
    float sum;
#if defined(__AVX512BF16__)
    __m512 acc[CHAINS];
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_setzero_ps();
    __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80); /* bf16 pairs (1.0, 1.0) */
    const __m512bh b = a;
    t = cpu_seconds();
    for (long it = 0; it < n; it++) {
#pragma GCC unroll 12
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        __asm__ volatile("" : "+v"(a)); /* keep the loop */
    }
    dt = cpu_seconds() - t;
    sum = 0.f;
    for (int i = 0; i < CHAINS; i++) sum += _mm512_reduce_add_ps(acc[i]);
    printf("VDPBF16PS zmm: %.2f G/s -> %.0f GFLOP/s (checksum %g)\n", n * CHAINS / dt / 1e9,
           n * CHAINS * 64.0 / dt / 1e9, sum);
#else
    printf("VDPBF16PS zmm: not in this build (no AVX512-BF16)\n");
#endif

    __m512 f[CHAINS];
    for (int i = 0; i < CHAINS; i++) f[i] = _mm512_setzero_ps();
    __m512 x = _mm512_set1_ps(1.0001f);
    const __m512 y = _mm512_set1_ps(0.9999f);
    t = cpu_seconds();
    for (long it = 0; it < n; it++) {
#pragma GCC unroll 12
        for (int i = 0; i < CHAINS; i++) f[i] = _mm512_fmadd_ps(x, y, f[i]);
        __asm__ volatile("" : "+v"(x));
    }
    dt = cpu_seconds() - t;
    sum = 0.f;
    for (int i = 0; i < CHAINS; i++) sum += _mm512_reduce_add_ps(f[i]);
    printf("VFMADD231PS zmm: %.2f G/s -> %.0f GFLOP/s (checksum %g)\n", n * CHAINS / dt / 1e9,
           n * CHAINS * 32.0 / dt / 1e9, sum);

    __m256 h[CHAINS];
    for (int i = 0; i < CHAINS; i++) h[i] = _mm256_setzero_ps();
    __m256 hx = _mm256_set1_ps(1.0001f);
    const __m256 hy = _mm256_set1_ps(0.9999f);
    t = cpu_seconds();
    for (long it = 0; it < n; it++) {
#pragma GCC unroll 12
        for (int i = 0; i < CHAINS; i++) h[i] = _mm256_fmadd_ps(hx, hy, h[i]);
        __asm__ volatile("" : "+v"(hx));
    }
    dt = cpu_seconds() - t;
    sum = 0.f;
    for (int i = 0; i < CHAINS; i++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, h[i]);
        for (int j = 0; j < 8; j++) sum += lanes[j];
    }
    printf("VFMADD231PS ymm: %.2f G/s -> %.0f GFLOP/s (checksum %g)\n", n * CHAINS / dt / 1e9,
           n * CHAINS * 16.0 / dt / 1e9, sum);
    return 0;
}
