/*
 * What an OpenMP region of another team size costs between a decode step's 2-thread GEMMs
 * (issue 23): each iteration runs a 2-thread region streaming N fp32 values (a GEMM's weight
 * pass; N = 30000 is 120 KB, a small GEMM, 300000 is 1.2 MB, SmolLM2-135M's MLP GEMMs) and then
 * S RMSNorm-sized passes (576 values, one decode row) in one of three ways:
 *
 *   mode 0: each pass in a 1-thread region (`num_threads(threads_for(...))` = 1, as the native
 *           row-wise kernels do at decode sizes);
 *   mode 1: each pass called directly, no region;
 *   mode 2: each pass in a 2-thread region of the GEMMs' team size (thread 0 works).
 *
 * The modes alternate, R rounds of I iterations each; it prints each mode's min and median
 * microseconds per iteration and the median over rounds of mode / mode 1 (paired, so robust to
 * the load of a shared machine). Run with torch's libgomp, the runtime kvflow's kernels use,
 * and kvflow's GOMP_SPINCOUNT:
 *
 *     cc -O2 -fopenmp benchmarks/cpu_omp_regions.c -o /tmp/omp_regions
 *     LD_LIBRARY_PATH=.venv/lib/python3.11/site-packages/torch/lib GOMP_SPINCOUNT=10000 \
 *         /tmp/omp_regions [N=30000] [S=4] [R=400] [I=20]
 */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

/* The GEMM stand-in: each of nt threads sums its share of w[0:n]. */
static void gemm_like(const float *w, float *acc, int64_t n, int nt) {
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), tt = omp_get_num_threads();
        float s = 0.f;
        for (int64_t i = n * t / tt; i < n * (t + 1) / tt; ++i) s += w[i] * 1.0001f;
        acc[t * 16] += s;
    }
}

/* An RMSNorm-sized pass over x[0:h], in place. */
static void row_pass(float *x, int64_t h) {
    float ss = 0.f;
    for (int64_t i = 0; i < h; ++i) ss += x[i] * x[i];
    const float inv = 1.f / (1.f + ss);
    for (int64_t i = 0; i < h; ++i) x[i] *= inv;
}

static double run(int mode, const float *w, float *acc, float *x, int64_t n, int passes,
                  int iters) {
    const double t0 = now_us();
    for (int it = 0; it < iters; ++it) {
        gemm_like(w, acc, n, 2);
        for (int s = 0; s < passes; ++s) {
            if (mode == 0) {
#pragma omp parallel num_threads(1)
                row_pass(x, 576);
            } else if (mode == 1) {
                row_pass(x, 576);
            } else {
#pragma omp parallel num_threads(2)
                if (omp_get_thread_num() == 0) row_pass(x, 576);
            }
        }
    }
    return (now_us() - t0) / iters;
}

static int cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int main(int argc, char **argv) {
    const int64_t n = argc > 1 ? atoll(argv[1]) : 30000;
    const int passes = argc > 2 ? atoi(argv[2]) : 4, rounds = argc > 3 ? atoi(argv[3]) : 400;
    const int iters = argc > 4 ? atoi(argv[4]) : 20;
    float *w = malloc(sizeof(float) * n), *acc = calloc(64, sizeof(float)), x[576];
    double *t[3], *ratio[3];
    if (!w || !acc || rounds < 1) return 1;
    for (int64_t i = 0; i < n; ++i) w[i] = (float)(i % 7) * 0.1f;
    for (int i = 0; i < 576; ++i) x[i] = 1.f;
    for (int m = 0; m < 3; ++m) {
        t[m] = malloc(sizeof(double) * rounds), ratio[m] = malloc(sizeof(double) * rounds);
        if (!t[m] || !ratio[m]) return 1;
    }
    for (int r = 0; r < rounds; ++r) /* the order alternates: 0 1 2, 2 1 0, ... */
        for (int j = 0; j < 3; ++j) {
            const int m = r % 2 ? 2 - j : j;
            t[m][r] = run(m, w, acc, x, n, passes, iters);
        }
    static const char *names[3] = {"1-thread region", "no region", "2-thread region"};
    for (int m = 0; m < 3; ++m)
        for (int r = 0; r < rounds; ++r) ratio[m][r] = t[m][r] / t[1][r];
    printf("N=%lld floats, %d passes per GEMM, %d rounds x %d iterations\n", (long long)n, passes,
           rounds, iters);
    for (int m = 0; m < 3; ++m) {
        const double rm = median(ratio[m], rounds), med = median(t[m], rounds);
        printf("%-16s us/iteration: min %8.2f median %8.2f; / no region: median %.3f\n",
               names[m], t[m][0], med, rm); /* t sorted by median(): t[m][0] is the min */
    }
    return (int)(acc[0] == 12345.f);
}
