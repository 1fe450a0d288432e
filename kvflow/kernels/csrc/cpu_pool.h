/* kvflow's straggler-tolerant thread pool (cpu_pool.c): the interface the kernels use.
 *
 * A job is n independent items. The calling thread and the pool's workers claim items from one
 * counter; the caller never waits for a worker that has not started (it simply takes more
 * items), and when a worker holds an item for longer than the caller expects (descheduled by a
 * busy neighbour on its core), the caller computes that item again itself. So a worker writes
 * an item into its private scratch first and publishes it (commit) only if the caller has not
 * taken it over; the caller writes its items in place.
 *
 * Everything a worker reads must stay valid after the caller returns (a late worker may still
 * be reading when the next job starts; its result is then thrown away): the context is copied
 * into the pool, inputs that the caller may free go into pool buffers (kvflow_pool_buffer),
 * other pointers must be to long-lived data (packed weights).
 */
#ifndef KVFLOW_CPU_POOL_H
#define KVFLOW_CPU_POOL_H

#include <stddef.h>
#include <stdint.h>

typedef struct KvflowPool KvflowPool;

/* Computes item `item` of the job whose context is ctx: into scratch (a worker; scratch holds
 * the job's scratch_floats floats) or in place (scratch NULL: the caller). Returns 0, or
 * nonzero when it could not (out of memory): a worker's item is then left to the caller. */
typedef int (*pool_item_fn)(const void *ctx, int64_t item, float *scratch);
/* Copies a worker's finished item from scratch to its place in the output. */
typedef void (*pool_commit_fn)(const void *ctx, int64_t item, const float *scratch);

enum { POOL_CTX_BYTES = 256, POOL_SCRATCH_FLOATS = 1 << 16 };

/* Takes the pool for the calling thread (1), or 0 when another thread holds it (or pool is
 * NULL): then run the job another way. Jobs and buffers are used between begin and end. */
int kvflow_pool_begin(KvflowPool *pool);
void kvflow_pool_end(KvflowPool *pool);

/* Runs items [0, n) of a job (context of ctx_bytes <= POOL_CTX_BYTES, copied); returns when
 * every item's output is in place: 0, or nonzero when an item failed on the caller.
 * scratch_floats <= POOL_SCRATCH_FLOATS. A NULL pool or one without workers runs every item on
 * the caller. */
int kvflow_pool_run(KvflowPool *pool, pool_item_fn fn, pool_commit_fn commit, const void *ctx,
                     size_t ctx_bytes, int64_t scratch_floats, int64_t n);

/* A pool-owned buffer of at least `bytes` (slot 0..POOL_BUFFERS-1) for the inputs of the next
 * job; valid until the pool is destroyed (a larger request allocates anew and keeps the old one
 * alive until then). NULL when memory runs out. */
enum { POOL_BUFFERS = 3 };
void *kvflow_pool_buffer(KvflowPool *pool, int slot, size_t bytes);

/* Workers still inside a finished job (they may read its inputs). */
int kvflow_pool_late_workers(const KvflowPool *pool);

#endif
