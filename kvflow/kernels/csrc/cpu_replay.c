/*
 * Replaying a recorded CPU step's native calls from C (kvflow/worker/cpu_graphs.py).
 *
 * A replayed decode step of SmolLM2-135M is ~300 calls; from Python each pays ctypes'
 * argument conversion and the interpreter's loop (~1.3 us for kvflow_gemm's 13 arguments on
 * a Zen 4 EPYC), while the other OpenMP thread waits. kvflow_replay runs a whole run of
 * calls in one ctypes call instead. A call is encoded as 1 + argc 64-bit words: the entry
 * point's index in ENTRIES, then its arguments in order (pointers and integers as their
 * values, a float as its IEEE-754 bits in the low 32 bits). Each entry has a thunk that
 * unpacks the words into the entry point's own prototype, so every call is an ordinary,
 * type-correct C call of the same function with the same arguments as from Python.
 * kernels/cpu_native_replay.py encodes programs and checks each entry point's name, argument
 * count and address against this table before it trusts it.
 */
#include "cpu_common.h"

#include "cpu_entry_points.h"

#define P(i) ((void *)(intptr_t)a[i])
#define I(i) ((int)a[i])

static float F(int64_t word) {
    const uint32_t bits = (uint32_t)word;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static int gemm(const int64_t *a) {
    return kvflow_gemm(P(0), a[1], I(2), P(3), I(4), P(5), P(6), a[7], I(8), a[9], a[10],
                       a[11], I(12));
}
static int gemm_rows(const int64_t *a) {
    return kvflow_gemm_rows(P(0), I(1), a[2], a[3], P(4), a[5], P(6), a[7]);
}
static int rms_norm(const int64_t *a) {
    return kvflow_rms_norm(P(0), a[1], P(2), a[3], P(4), P(5), P(6), a[7], a[8], F(a[9]),
                           I(10), I(11));
}
static int embedding_rows(const int64_t *a) {
    return kvflow_embedding_rows(P(0), a[1], a[2], a[3], a[4], P(5), a[6], P(7));
}
static int int8_embedding_rows(const int64_t *a) {
    return kvflow_int8_embedding_rows(P(0), a[1], P(2), a[3], a[4], P(5), a[6], P(7), I(8),
                                      I(9));
}
static int silu_and_mul(const int64_t *a) {
    return kvflow_silu_and_mul(P(0), a[1], P(2), a[3], a[4], I(5), I(6));
}
static int gelu(const int64_t *a) {
    return kvflow_gelu(P(0), a[1], P(2), a[3], a[4], I(5), I(6), I(7));
}
static int gelu_and_mul(const int64_t *a) {
    return kvflow_gelu_and_mul(P(0), a[1], P(2), a[3], a[4], I(5), I(6), I(7));
}
static int rotary(const int64_t *a) {
    return kvflow_rotary(P(0), P(1), a[2], a[3], P(4), a[5], a[6], a[7], a[8], P(9), a[10],
                         a[11], I(12), I(13), I(14));
}
static int paged_attention(const int64_t *a) {
    return kvflow_paged_attention(P(0), a[1], P(2), P(3), P(4), P(5), a[6], P(7), P(8), a[9],
                                  a[10], a[11], a[12], a[13], F(a[14]), a[15], F(a[16]), I(17),
                                  I(18), I(19));
}
static int store_kv(const int64_t *a) {
    return kvflow_store_kv(P(0), a[1], P(2), a[3], P(4), P(5), P(6), a[7], a[8], a[9], I(10),
                           I(11));
}
static int int8_gemm(const int64_t *a) {
    return kvflow_int8_gemm(P(0), a[1], I(2), P(3), a[4], P(5), P(6), P(7), a[8], I(9), a[10],
                            a[11], a[12], I(13));
}
static int int8_gemm_grouped(const int64_t *a) {
    return kvflow_int8_gemm_grouped(P(0), a[1], I(2), P(3), a[4], P(5), a[6], P(7), P(8), a[9],
                                    I(10), a[11], a[12], a[13], I(14));
}
static int lora(const int64_t *a) {
    return kvflow_lora(P(0), a[1], I(2), P(3), a[4], I(5), P(6), P(7), I(8), P(9), a[10],
                       a[11], a[12], a[13], a[14], I(15));
}

typedef struct {
    const char *name;
    int argc;
    int (*thunk)(const int64_t *args);
    const void *fn; /* the entry point itself (its address, checked by the encoder) */
} Entry;

static const Entry ENTRIES[] = {
    {"kvflow_gemm", 13, gemm, (const void *)kvflow_gemm},
    {"kvflow_gemm_rows", 8, gemm_rows, (const void *)kvflow_gemm_rows},
    {"kvflow_rms_norm", 12, rms_norm, (const void *)kvflow_rms_norm},
    {"kvflow_embedding_rows", 8, embedding_rows, (const void *)kvflow_embedding_rows},
    {"kvflow_int8_embedding_rows", 10, int8_embedding_rows,
     (const void *)kvflow_int8_embedding_rows},
    {"kvflow_silu_and_mul", 7, silu_and_mul, (const void *)kvflow_silu_and_mul},
    {"kvflow_gelu", 8, gelu, (const void *)kvflow_gelu},
    {"kvflow_gelu_and_mul", 8, gelu_and_mul, (const void *)kvflow_gelu_and_mul},
    {"kvflow_rotary", 15, rotary, (const void *)kvflow_rotary},
    {"kvflow_paged_attention", 20, paged_attention, (const void *)kvflow_paged_attention},
    {"kvflow_store_kv", 12, store_kv, (const void *)kvflow_store_kv},
    {"kvflow_int8_gemm", 14, int8_gemm, (const void *)kvflow_int8_gemm},
    {"kvflow_int8_gemm_grouped", 15, int8_gemm_grouped, (const void *)kvflow_int8_gemm_grouped},
    {"kvflow_lora", 16, lora, (const void *)kvflow_lora},
};
enum { NUM_ENTRIES = sizeof ENTRIES / sizeof ENTRIES[0] };

/* Entries kvflow_replay can call: their count. */
int64_t kvflow_replay_entries(void) { return NUM_ENTRIES; }

/* Entry i's name, argument count (*argc) and address (*fn); NULL when i is out of range. */
const char *kvflow_replay_entry(int64_t i, int64_t *argc, int64_t *fn) {
    if (i < 0 || i >= NUM_ENTRIES) return NULL;
    *argc = ENTRIES[i].argc;
    *fn = (int64_t)(intptr_t)ENTRIES[i].fn;
    return ENTRIES[i].name;
}

/* Runs the `calls` encoded calls of `program` (see the header) in order. Returns 0 when every
 * call returned 0; else stops at the first that did not and returns its position + 1, or
 * -(position + 1) when its entry index is out of range (nothing of it runs). */
int64_t kvflow_replay(const int64_t *program, int64_t calls) {
    const int64_t *word = program;
    for (int64_t c = 0; c < calls; ++c) {
        const int64_t e = word[0];
        if (e < 0 || e >= NUM_ENTRIES) return -(c + 1);
        if (ENTRIES[e].thunk(word + 1)) return c + 1;
        word += 1 + ENTRIES[e].argc;
    }
    return 0;
}
