/*
 * kvflow's straggler-tolerant thread pool (interface and contract: cpu_pool.h).
 *
 * Why not OpenMP: an OpenMP parallel region ends in a barrier that waits for every thread of
 * the team. With a busy process sharing one of two cores, the thread on that core is
 * descheduled for whole time slices (milliseconds), and every region that needs it (an engine
 * step has hundreds) waits for it: the step runs at the pace of the shared core, about half the
 * quiet speed, however the work is split. Here the caller waits only for items a worker has
 * actually started, and not even for those once they take longer than it would itself.
 *
 * Protocol (one job at a time; only the caller, the thread that calls kvflow_pool_run, starts
 * jobs):
 *   - `next` packs (generation << 32 | next item). The caller writes the job (function, context,
 *     item count) and then publishes a new generation with item 0 (release); a claim is a
 *     compare-and-swap of `next` to the following item. A worker reads the job after seeing
 *     `next` and before its claim: a successful claim proves the job was still unfinished, hence
 *     not yet overwritten, while it read (a seqlock whose validation is the claim itself).
 *   - state[item] = generation << 8 | status records what happened to a worker's item: the
 *     worker marks it CLAIMED, computes into its scratch, moves it CLAIMED -> COMMITTING, copies
 *     the scratch out and marks it DONE. The caller, out of unclaimed items, waits for each item
 *     it did not compute: while it is COMMITTING always, otherwise until a deadline of about
 *     twice its own time per item; then it moves the item to STOLEN and computes it in place.
 *     A worker whose CLAIMED -> COMMITTING fails (stolen) drops its result, so every output
 *     element is written by exactly one thread, from the same arithmetic either way.
 *   - Idle workers spin on `next` for a short while, then sleep on a futex (`wake`).
 */
#define _GNU_SOURCE
#include "cpu_pool.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

enum { ST_CLAIMED = 1, ST_COMMITTING = 2, ST_DONE = 3, ST_STOLEN = 4, MAX_RETIRED = 64 };

typedef struct {
    pool_item_fn fn;
    pool_commit_fn commit;
    int64_t n, scratch_floats;
    uint64_t *state; /* the item states (grow-only; an old array stays alive) */
    _Alignas(16) unsigned char ctx[POOL_CTX_BYTES];
} Job;

typedef struct {
    KvflowPool *pool;
    uint32_t active; /* the generation this worker is claiming or computing in, 0 when idle */
    int index, cpu;
    float *scratch;
    pthread_t thread;
} Worker;

struct KvflowPool {
    _Alignas(64) uint64_t next;     /* generation << 32 | next item */
    _Alignas(64) uint32_t wake;     /* futex word: bumped with each job */
    int sleepers, stop, running;
    _Alignas(64) Job job;
    uint32_t generation;            /* the caller's */
    int64_t state_cap, mine_cap;
    unsigned char *mine;            /* the caller's own items of the current job */
    void *buffers[POOL_BUFFERS];
    size_t buffer_bytes[POOL_BUFFERS];
    void *retired[MAX_RETIRED];     /* outgrown arrays and buffers, freed with the pool */
    int num_retired;
    int64_t spin_ns, worker_delay_us;
    int64_t stats[4];               /* items: caller, committed, stolen, dropped */
    int num_workers;
    Worker workers[];
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline uint64_t load_acq(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

static inline int cas(uint64_t *p, uint64_t *expected, uint64_t desired) {
    return __atomic_compare_exchange_n(p, expected, desired, 0, __ATOMIC_ACQ_REL,
                                       __ATOMIC_ACQUIRE);
}

static void stat_add(KvflowPool *pool, int which, int64_t v) {
    __atomic_fetch_add(&pool->stats[which], v, __ATOMIC_RELAXED);
}

/* Claims the next item of generation g: its index, or -1 when the job is finished or
 * superseded. When copy is given, the job is copied there before the claim (see above). */
static int64_t claim(KvflowPool *pool, uint32_t g, Job *copy) {
    uint64_t cur = load_acq(&pool->next);
    for (;;) {
        if ((uint32_t)(cur >> 32) != g) return -1;
        if (copy) memcpy(copy, &pool->job, sizeof *copy);
        const int64_t n = copy ? copy->n : pool->job.n;
        if ((int64_t)(cur & 0xffffffffu) >= n) return -1;
        if (cas(&pool->next, &cur, cur + 1)) return (int64_t)(cur & 0xffffffffu);
    }
}

/* A worker's part of generation g: claim, compute into scratch, commit unless stolen. */
static void work(Worker *w, uint32_t g) {
    KvflowPool *pool = w->pool;
    Job job;
    __atomic_store_n(&w->active, g, __ATOMIC_SEQ_CST);
    for (int64_t item; (item = claim(pool, g, &job)) >= 0;) {
        uint64_t *st = &job.state[item], s = load_acq(st);
        const uint64_t tag = (uint64_t)g << 8;
        if (s >> 8 == g || !cas(st, &s, tag | ST_CLAIMED)) continue; /* the caller took it */
        const int64_t delay = __atomic_load_n(&pool->worker_delay_us, __ATOMIC_RELAXED);
        if (delay > 0) usleep((useconds_t)delay); /* tests: a worker slower than the caller */
        if (job.fn(job.ctx, item, w->scratch)) continue; /* left CLAIMED: the caller takes it */
        uint64_t claimed = tag | ST_CLAIMED;
        if (cas(st, &claimed, tag | ST_COMMITTING)) {
            job.commit(job.ctx, item, w->scratch);
            __atomic_store_n(st, tag | ST_DONE, __ATOMIC_RELEASE);
            stat_add(pool, 1, 1);
        } else {
            stat_add(pool, 3, 1);
        }
    }
    __atomic_store_n(&w->active, 0, __ATOMIC_RELEASE);
}

static void *worker_main(void *arg) {
    Worker *w = arg;
    KvflowPool *pool = w->pool;
    if (w->cpu >= 0 && w->cpu < CPU_SETSIZE) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(w->cpu, &set);
        sched_setaffinity(0, sizeof set, &set);
    }
    uint32_t done = 0; /* the last generation this worker has looked at */
    for (;;) {
        const uint32_t wake = __atomic_load_n(&pool->wake, __ATOMIC_ACQUIRE);
        if (__atomic_load_n(&pool->stop, __ATOMIC_ACQUIRE)) return NULL;
        const uint32_t g = (uint32_t)(load_acq(&pool->next) >> 32);
        if (g != done) {
            done = g;
            work(w, g);
            continue;
        }
        const int64_t until = now_ns() + pool->spin_ns;
        while ((uint32_t)(load_acq(&pool->next) >> 32) == done && now_ns() < until
               && !__atomic_load_n(&pool->stop, __ATOMIC_RELAXED))
            cpu_relax();
        if ((uint32_t)(load_acq(&pool->next) >> 32) != done) continue;
        __atomic_fetch_add(&pool->sleepers, 1, __ATOMIC_SEQ_CST);
        if ((uint32_t)(load_acq(&pool->next) >> 32) == done)
            syscall(SYS_futex, &pool->wake, FUTEX_WAIT_PRIVATE, wake, NULL, NULL, 0);
        __atomic_fetch_sub(&pool->sleepers, 1, __ATOMIC_SEQ_CST);
    }
}

static void wake_workers(KvflowPool *pool) {
    __atomic_fetch_add(&pool->wake, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pool->sleepers, __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, &pool->wake, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static int retire(KvflowPool *pool, void *p) {
    if (!p) return 1;
    if (pool->num_retired == MAX_RETIRED) return 0;
    pool->retired[pool->num_retired++] = p;
    return 1;
}

/* Grows the state array and the caller's item marks to n items; 0 when memory runs out. */
static int reserve(KvflowPool *pool, int64_t n) {
    if (n > pool->state_cap) {
        const int64_t cap = n > 2 * pool->state_cap ? n : 2 * pool->state_cap;
        uint64_t *state = calloc((size_t)cap, sizeof *state);
        if (!state || !retire(pool, pool->job.state)) {
            free(state);
            return 0;
        }
        pool->job.state = state, pool->state_cap = cap;
    }
    if (n > pool->mine_cap) {
        unsigned char *mine = malloc((size_t)pool->state_cap);
        if (!mine) return 0;
        free(pool->mine);
        pool->mine = mine, pool->mine_cap = pool->state_cap;
    }
    return 1;
}

/* Waits for (or takes over) item `item`, which the caller did not compute, of generation g;
 * returns the item function's status when it computes the item, else 0. */
static int finish_item(KvflowPool *pool, uint32_t g, int64_t item, int64_t deadline) {
    uint64_t *st = &pool->job.state[item];
    const uint64_t tag = (uint64_t)g << 8;
    for (;;) {
        uint64_t s = load_acq(st);
        if (s == (tag | ST_DONE)) return 0;
        if (s == (tag | ST_COMMITTING) || now_ns() < deadline) {
            cpu_relax();
            continue;
        }
        if (cas(st, &s, tag | ST_STOLEN)) {
            stat_add(pool, 2, 1);
            return pool->job.fn(pool->job.ctx, item, NULL);
        }
    }
}

int kvflow_pool_begin(KvflowPool *pool) {
    int idle = 0;
    return pool && __atomic_compare_exchange_n(&pool->running, &idle, 1, 0, __ATOMIC_ACQUIRE,
                                               __ATOMIC_RELAXED);
}

void kvflow_pool_end(KvflowPool *pool) { __atomic_store_n(&pool->running, 0, __ATOMIC_RELEASE); }

int kvflow_pool_run(KvflowPool *pool, pool_item_fn fn, pool_commit_fn commit, const void *ctx,
                    size_t ctx_bytes, int64_t scratch_floats, int64_t n) {
    int failed = 0;
    if (n <= 0) return 0;
    if (!pool || pool->num_workers == 0 || n == 1 || ctx_bytes > POOL_CTX_BYTES
        || scratch_floats > POOL_SCRATCH_FLOATS || n >= ((int64_t)1 << 32) || !reserve(pool, n)) {
        for (int64_t i = 0; i < n; ++i) failed |= fn(ctx, i, NULL);
        if (pool) stat_add(pool, 0, n);
        return failed;
    }
    const uint32_t g = ++pool->generation ? pool->generation : ++pool->generation;
    Job *job = &pool->job;
    job->fn = fn, job->commit = commit, job->n = n, job->scratch_floats = scratch_floats;
    memcpy(job->ctx, ctx, ctx_bytes);
    memset(pool->mine, 0, (size_t)n);
    __atomic_store_n(&pool->next, (uint64_t)g << 32, __ATOMIC_RELEASE);
    wake_workers(pool);
    const int64_t start = now_ns();
    int64_t own = 0;
    for (int64_t item; (item = claim(pool, g, NULL)) >= 0; ++own) {
        pool->mine[item] = 1;
        failed |= fn(job->ctx, item, NULL);
    }
    /* a worker's item may take about as long as one of ours; allow twice that, and 20 us */
    const int64_t end = now_ns(), per_item = own > 0 ? (end - start) / own : 0;
    const int64_t deadline = end + 2 * per_item + 20000;
    for (int64_t i = 0; i < n; ++i)
        if (!pool->mine[i]) failed |= finish_item(pool, g, i, deadline);
    stat_add(pool, 0, own);
    return failed;
}

void *kvflow_pool_buffer(KvflowPool *pool, int slot, size_t bytes) {
    if (!pool || slot < 0 || slot >= POOL_BUFFERS) return NULL;
    if (bytes <= pool->buffer_bytes[slot]) return pool->buffers[slot];
    const size_t size = bytes > 2 * pool->buffer_bytes[slot] ? bytes : 2 * pool->buffer_bytes[slot];
    void *p = aligned_alloc(64, (size + 63) / 64 * 64);
    if (!p || !retire(pool, pool->buffers[slot])) {
        free(p);
        return NULL;
    }
    pool->buffers[slot] = p, pool->buffer_bytes[slot] = size;
    return p;
}

/* A pool of num_workers threads besides the caller; worker i pinned to cpus[i] when cpus is
 * given (-1: not pinned). Idle workers spin spin_us microseconds before they sleep. NULL when
 * threads or memory cannot be had. */
KvflowPool *kvflow_pool_create(int num_workers, const int32_t *cpus, int64_t spin_us) {
    if (num_workers < 0) return NULL;
    const size_t bytes = (sizeof(KvflowPool) + num_workers * sizeof(Worker) + 63) / 64 * 64;
    KvflowPool *pool = aligned_alloc(64, bytes);
    if (!pool) return NULL;
    memset(pool, 0, bytes);
    pool->spin_ns = spin_us * 1000;
    for (int i = 0; i < num_workers; ++i) {
        Worker *w = &pool->workers[i];
        w->pool = pool, w->index = i, w->cpu = cpus ? cpus[i] : -1;
        w->scratch = aligned_alloc(64, POOL_SCRATCH_FLOATS * sizeof(float));
        if (!w->scratch || pthread_create(&w->thread, NULL, worker_main, w) != 0) {
            free(w->scratch);
            break;
        }
        pool->num_workers = i + 1;
    }
    return pool;
}

/* Stops and joins the workers (each finishes the item it holds), then frees the pool. */
void kvflow_pool_destroy(KvflowPool *pool) {
    if (!pool) return;
    __atomic_store_n(&pool->stop, 1, __ATOMIC_RELEASE);
    wake_workers(pool);
    for (int i = 0; i < pool->num_workers; ++i) {
        pthread_join(pool->workers[i].thread, NULL);
        free(pool->workers[i].scratch);
    }
    for (int i = 0; i < pool->num_retired; ++i) free(pool->retired[i]);
    for (int i = 0; i < POOL_BUFFERS; ++i) free(pool->buffers[i]);
    free(pool->job.state);
    free(pool->mine);
    free(pool);
}

int kvflow_pool_workers(const KvflowPool *pool) { return pool ? pool->num_workers : 0; }

/* Workers still inside a finished job (descheduled while they held an item the caller then
 * computed itself): they may still read that job's inputs. Call between jobs. */
int kvflow_pool_late_workers(const KvflowPool *pool) {
    int late = 0;
    for (int i = 0; i < pool->num_workers; ++i)
        late += __atomic_load_n(&pool->workers[i].active, __ATOMIC_SEQ_CST) != 0;
    return late;
}

/* Tests: every worker item sleeps delay_us first (a worker on a busy core). */
void kvflow_pool_set_worker_delay(KvflowPool *pool, int64_t delay_us) {
    __atomic_store_n(&pool->worker_delay_us, delay_us, __ATOMIC_RELAXED);
}

/* Items since creation: out[0] by the caller, out[1] committed by workers, out[2] taken over
 * from a late worker, out[3] computed by a worker and dropped (taken over meanwhile). */
void kvflow_pool_stats(const KvflowPool *pool, int64_t *out) {
    for (int i = 0; i < 4; ++i) out[i] = __atomic_load_n(&pool->stats[i], __ATOMIC_RELAXED);
}
