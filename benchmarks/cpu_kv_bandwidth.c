/* What one core reads from memory per second in the pattern of a decode step's paged K/V
 * (issue 23): 6 KB blocks (16 tokens x 3 KV heads x 64 dims of bf16, SmolLM2's cache block)
 * scattered over a buffer larger than the last-level cache, each read front to back and its
 * bf16 widened and summed (what the attention kernel's loads do), with and without software
 * prefetch of the blocks ahead.
 *
 *   cc -O2 -march=x86-64-v4 benchmarks/cpu_kv_bandwidth.c -o /tmp/kvbw && /tmp/kvbw [MB] [huge]
 *
 * With "huge" the buffer is madvise(MADV_HUGEPAGE)d before it is first touched (2 MB pages
 * where the kernel's transparent huge pages allow it: one TLB entry per 2 MB instead of 4 KB).
 *
 * Prints GB/s (best of 5 passes, process CPU time) per access pattern:
 *   seq          blocks in address order (the hardware prefetchers' best case);
 *   rand         blocks in random order, no software prefetch;
 *   rand+pfN     random order, block b + N's lines prefetched (PREFETCHT0) spread over the
 *                reading of block b, one line per line read;
 *   rand+pfN-t2  the same into L2 only (PREFETCHT2);
 *   rand+burstN  random order, block b + N's 96 lines prefetched at once when block b starts.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

enum { BLOCK = 6144, LINES = BLOCK / 64 };

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

/* Sum of a block's bf16 values widened to fp32 (both halves of each 32-bit lane). */
static inline __m512 read_block(const char *p, __m512 acc, const char *pf, int hint) {
    const __m512i mask = _mm512_set1_epi32((int)0xffff0000u);
    for (int i = 0; i < LINES; ++i) {
        const __m512i v = _mm512_loadu_si512((const void *)(p + 64 * i));
        acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
        acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_and_si512(v, mask)));
        if (pf) {
            if (hint == 0) _mm_prefetch(pf + 64 * i, _MM_HINT_T0);
            else _mm_prefetch(pf + 64 * i, _MM_HINT_T2);
        }
    }
    return acc;
}

static double run(const char *buf, const int64_t *order, int64_t n, int dist, int hint,
                  int burst) {
    double best = 1e30;
    float sink = 0.f;
    for (int pass = 0; pass < 5; ++pass) {
        const double t0 = now();
        __m512 acc = _mm512_setzero_ps();
        for (int64_t b = 0; b < n; ++b) {
            const char *ahead = dist && b + dist < n ? buf + order[b + dist] * BLOCK : NULL;
            if (burst && ahead) {
                for (int i = 0; i < LINES; ++i) _mm_prefetch(ahead + 64 * i, _MM_HINT_T0);
                ahead = NULL;
            }
            acc = read_block(buf + order[b] * BLOCK, acc, ahead, hint);
        }
        const double t = now() - t0;
        sink += _mm512_reduce_add_ps(acc);
        if (t < best) best = t;
    }
    if (sink == 12345.f) puts("");
    return (double)n * BLOCK / best / 1e9;
}

int main(int argc, char **argv) {
    const int64_t mb = argc > 1 ? atoll(argv[1]) : 512;
    const int64_t n = mb * 1024 * 1024 / BLOCK;
    const int huge = argc > 2 && strcmp(argv[2], "huge") == 0;
    const size_t bytes = ((size_t)n * BLOCK + (2u << 20) - 1) / (2u << 20) * (2u << 20);
    char *buf = aligned_alloc(2u << 20, bytes);
    if (huge && madvise(buf, bytes, MADV_HUGEPAGE)) perror("madvise");
    int64_t *seq = malloc(sizeof(int64_t) * n), *rnd = malloc(sizeof(int64_t) * n);
    for (int64_t i = 0; i < (int64_t)n * BLOCK / 2; ++i) ((uint16_t *)buf)[i] = 0x3f80;
    srand(1);
    for (int64_t i = 0; i < n; ++i) seq[i] = rnd[i] = i;
    for (int64_t i = n - 1; i > 0; --i) {
        const int64_t j = rand() % (i + 1), t = rnd[i];
        rnd[i] = rnd[j];
        rnd[j] = t;
    }
    printf("%lld MB in %lld blocks of %d B, %s pages\n", (long long)mb, (long long)n, BLOCK,
           huge ? "huge (madvise)" : "default");
    printf("seq          %6.2f GB/s\n", run(buf, seq, n, 0, 0, 0));
    printf("rand         %6.2f GB/s\n", run(buf, rnd, n, 0, 0, 0));
    for (int d = 1; d <= 4; d *= 2) {
        printf("rand+pf%d     %6.2f GB/s\n", d, run(buf, rnd, n, d, 0, 0));
        printf("rand+pf%d-t2  %6.2f GB/s\n", d, run(buf, rnd, n, d, 1, 0));
        printf("rand+burst%d  %6.2f GB/s\n", d, run(buf, rnd, n, d, 0, 1));
    }
    free(buf);
    free(seq);
    free(rnd);
    return 0;
}
