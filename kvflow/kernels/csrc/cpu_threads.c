/*
 * Pinning the OpenMP threads kvflow and torch share to CPUs (the idea of vLLM's
 * VLLM_CPU_OMP_THREADS_BIND). libgomp keeps one pool of threads per calling thread and gives
 * team member i of every later parallel region of that thread the same pool thread, so pinning
 * each member once, from the thread that runs the model, pins every later region's threads.
 */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>
#include <stdint.h>

/* Pins team member i of an n-thread parallel region to cpus[i] (member 0 is the caller); a
 * negative cpus[i] leaves member i's mask as it is. Returns the number of threads that could
 * not be pinned (0 on success). */
int kvflow_bind_threads(const int32_t *cpus, int n) {
    int failed = 0;
#pragma omp parallel num_threads(n) reduction(+ : failed)
    {
        const int i = omp_get_thread_num();
        cpu_set_t set;
        CPU_ZERO(&set);
        if (cpus[i] < 0) {
            /* left unpinned */
        } else if (cpus[i] < CPU_SETSIZE) {
            CPU_SET(cpus[i], &set);
            failed += sched_setaffinity(0, sizeof set, &set) != 0;
        } else {
            failed += 1;
        }
        failed += omp_get_num_threads() != n && i == 0;
    }
    return failed;
}
