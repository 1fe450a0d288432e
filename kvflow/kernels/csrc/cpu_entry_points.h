/*
 * The entry points kvflow_replay (cpu_replay.c) calls. Declared once here and included by
 * the files that define them too, so the compiler checks that the replay thunks call each
 * with its own prototype.
 */
#ifndef KVFLOW_CPU_ENTRY_POINTS_H
#define KVFLOW_CPU_ENTRY_POINTS_H

#include <stdint.h>

int kvflow_gemm(const void *x, int64_t x_stride, int xdt, const void *packed, int wdt,
                const float *bias, void *y, int64_t y_stride, int ydt, int64_t m, int64_t n,
                int64_t k, int num_threads);
int kvflow_gemm_rows(const void *packed, int wdt, int64_t n, int64_t k, const int64_t *ids,
                     int64_t m, void *out, int64_t out_stride);
int kvflow_rms_norm(const void *x, int64_t x_stride, const void *residual, int64_t r_stride,
                    void *residual_out, const void *weight, void *out, int64_t rows,
                    int64_t hidden, float eps, int dtype, int num_threads);
int kvflow_embedding_rows(const void *table, int64_t table_stride, int64_t n, int64_t k,
                          int64_t elem_bytes, const int64_t *ids, int64_t m, void *out);
int kvflow_int8_embedding_rows(const int8_t *table, int64_t table_stride, const float *scale,
                               int64_t n, int64_t k, const int64_t *ids, int64_t m, void *out,
                               int odt, int num_threads);
int kvflow_silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int64_t inter,
                        int dtype, int num_threads);
int kvflow_gelu(const void *x, int64_t x_stride, void *out, int64_t rows, int64_t n,
                int approximate, int dtype, int num_threads);
int kvflow_gelu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows,
                        int64_t inter, int approximate, int dtype, int num_threads);
int kvflow_rotary(const int64_t *positions, void *q, int64_t q_stride, int64_t num_heads,
                  void *k, int64_t k_stride, int64_t num_kv_heads, int64_t head_dim,
                  int64_t rot_dim, const float *cos_sin, int64_t max_position, int64_t tokens,
                  int neox, int dtype, int num_threads);
int kvflow_paged_attention(const void *q, int64_t q_stride, const void *k_cache,
                           const void *v_cache, void *out, const int32_t *block_table,
                           int64_t bt_stride, const int32_t *query_start_loc,
                           const int32_t *seq_lens, int64_t num_reqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           float scale, int64_t window, float softcap, int dtype,
                           int num_threads, int tiled);
int kvflow_store_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                    void *k_cache, void *v_cache, const int64_t *slot_mapping, int64_t n,
                    int64_t num_slots, int64_t row_elems, int dtype, int num_threads);
int kvflow_int8_gemm(const void *x, int64_t xs, int xdt, const int8_t *q, int64_t qs,
                     const float *scale, const float *bias, void *y, int64_t ys, int ydt,
                     int64_t m, int64_t n, int64_t k, int num_threads);
int kvflow_int8_gemm_grouped(const void *x, int64_t xs, int xdt, const int8_t *q, int64_t qs,
                             const float *scale, int64_t group, const float *bias, void *y,
                             int64_t ys, int ydt, int64_t m, int64_t n, int64_t k,
                             int num_threads);
int kvflow_lora(void *y, int64_t y_stride, int ydt, const void *x, int64_t x_stride, int xdt,
                const float *lora_a, const float *lora_b, int b_transposed,
                const int32_t *slots, int64_t rows, int64_t in, int64_t out, int64_t rank,
                int64_t max_loras, int num_threads);

#endif
