/* Decode attention on a CPU, straight from the paged cache: one query token per sequence. The query,
   the output and all arithmetic are float32; the cache is float32, bfloat16 or fp8 (each element widened
   as it is read: a bfloat16 is the top half of a float32, an fp8 byte's bits moved into a float32's).

   Built and loaded by cpu_kernels.py. Work item: a decode with all its KV heads, or one KV head of it
   while decodes are too few to keep the threads busy. Pass 1 walks its key rows in block-table order,
   whole (every KV head of the item: contiguous memory), the next block prefetched, and scores each row
   against the query heads it serves; pass 2 takes the softmax per query head (float32, max subtracted);
   pass 3 walks the value rows the same way into per-head sums. Each row of the context is read from
   memory once. Items run in parallel on the OpenMP runtime torch has already loaded (same soname), with
   torch's thread count passed in. A model's softcap bounds the scores before the softmax; its sinks
   (a logit per query head) join each softmax's denominator. */

#include <stdlib.h>

#include "cpu_kernels.h"

/* The address `elements` cache elements past `base`. */
ALWAYS_INLINE const void *advance(const void *base, int64_t elements, const int bytes) {
    return (const char *)base + elements * bytes;
}

ALWAYS_INLINE float dot(const float *a, const void *row, const int64_t n, const int bytes, const int fp8_shift) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t d = 0; d < n; d++) sum += a[d] * element(row, d, bytes, fp8_shift);
    return sum;
}

ALWAYS_INLINE void add_scaled(float *acc, const void *row, float weight, const int64_t n, const int bytes,
                              const int fp8_shift) {
#pragma omp simd
    for (int64_t d = 0; d < n; d++) acc[d] += weight * element(row, d, bytes, fp8_shift);
}

/* The rows of one decode, through its block table: BODY for each (POSITION, ROW) in order,
   while the same position of the next block is prefetched: the blocks of a table lie anywhere in the
   cache, where the hardware's prefetcher cannot follow. */
#define FOR_EACH_ROW(CACHE, POSITION, ROW, BODY)                                                       \
    for (int64_t b = start / block_size; b * block_size < end; b++) {                                 \
        const int64_t first = b * block_size > start ? b * block_size : start;                         \
        const int64_t last = (b + 1) * block_size < end ? (b + 1) * block_size : end;                  \
        const int64_t base = table[b] * block_size - b * block_size; /* plus the position */           \
        const int64_t next = last < end ? table[b + 1] * block_size - b * block_size : base;           \
        for (int64_t POSITION = first; POSITION < last; POSITION++) {                                  \
            const void *ROW = advance(CACHE, (base + POSITION) * row_stride, bytes);                   \
            PREFETCH(CACHE, (next + POSITION) * row_stride)                                            \
            BODY                                                                                        \
        }                                                                                               \
    }

/* The heads' part of the row at `offset` into the cache (keys or values), on its way to this core's
   cache: a prefetch per 64-byte line. */
#define PREFETCH(CACHE, offset)                                                                        \
    for (int64_t d = 0; d < heads * head_dim; d += 64 / bytes)                                         \
        __builtin_prefetch(advance(CACHE, (offset) + d, bytes));

/* `heads` KV heads of one decode: k_cache and v_cache point at the first one's part of slot 0, q and o at
   its first query head's row. head_dim is a constant where it is 64 or 128 (the call sites below), so
   that the loops over it unroll; bytes (the cache element's size) is a constant at every call site. */
ALWAYS_INLINE void attend(const float *q, const int64_t *table, const void *k_cache, const void *v_cache,
                          int64_t start, int64_t end, int64_t heads, int64_t group, int64_t row_stride,
                          int64_t block_size, const int64_t head_dim, const int bytes, const int fp8_shift,
                          float scale, float softcap, const float *sinks, float *scores, float *acc, float *o) {
    const int64_t len = end - start, rows = heads * group;
    float *s = scores - start;
    FOR_EACH_ROW(k_cache, p, k, {
        for (int64_t h = 0; h < heads; h++)
            for (int64_t r = h * group; r < (h + 1) * group; r++)
                s[r * len + p] = scale * dot(q + r * head_dim, advance(k, h * head_dim, bytes), head_dim, bytes,
                                             fp8_shift);
    })
    for (int64_t r = 0; r < rows; r++) {
        float *sr = scores + r * len;
        if (softcap > 0.0f) apply_softcap(sr, 0, len, softcap);
        float top = sinks ? sinks[r] : sr[0], total = 0.0f;
#pragma omp simd reduction(max : top)
        for (int64_t j = 0; j < len; j++) top = sr[j] > top ? sr[j] : top;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < len; j++) {
            sr[j] = expf(sr[j] - top);
            total += sr[j];
        }
        if (sinks) total += expf(sinks[r] - top);
        const float inverse = 1.0f / total;
        for (int64_t j = 0; j < len; j++) sr[j] *= inverse;
    }
    for (int64_t d = 0; d < rows * head_dim; d++) acc[d] = 0.0f;
    FOR_EACH_ROW(v_cache, p, v, {
        for (int64_t h = 0; h < heads; h++)
            for (int64_t r = h * group; r < (h + 1) * group; r++)
                add_scaled(acc + r * head_dim, advance(v, h * head_dim, bytes), s[r * len + p], head_dim, bytes,
                           fp8_shift);
    })
    for (int64_t d = 0; d < rows * head_dim; d++) o[d] = acc[d];
}

/* One work item (see below), with head_dim and the cache's type as constants where they can be. */
ALWAYS_INLINE void attend_item(const float *q, const int64_t *table, const void *k, const void *v, int64_t start,
                               int64_t end, int64_t heads, int64_t group, int64_t row_stride, int64_t block_size,
                               int64_t head_dim, const int bytes, const int fp8_shift, float scale, float softcap,
                               const float *sinks, float *scores, float *acc, float *o) {
    if (head_dim == 64)
        attend(q, table, k, v, start, end, heads, group, row_stride, block_size, 64, bytes, fp8_shift, scale, softcap,
               sinks, scores, acc, o);
    else if (head_dim == 128)
        attend(q, table, k, v, start, end, heads, group, row_stride, block_size, 128, bytes, fp8_shift, scale,
               softcap, sinks, scores, acc, o);
    else
        attend(q, table, k, v, start, end, heads, group, row_stride, block_size, head_dim, bytes, fp8_shift, scale,
               softcap, sinks, scores, acc, o);
}

/* query, out: [tokens, Hq, D] float32 contiguous; caches: [slots, Hkv, D] contiguous, of `cache_bytes` an
   element: float32 (4), bfloat16 (2) or fp8 (1, `fp8_shift` 20 for e4m3, 21 for e5m2); block_tables: rows
   `table_stride` apart. For decode i: its query row token_rows[i], its table row table_rows[i], its
   visible positions [starts[i], ends[i]), at least one. softcap: 0 for none; sinks: [Hq] float32, or
   NULL. Returns 0, or -1 when memory for the scores ran out. */
int paged_decode_attention(const float *query, const int64_t *token_rows, const void *key_cache,
                           const void *value_cache, const int64_t *block_tables, int64_t table_stride,
                           const int64_t *table_rows, const int64_t *starts, const int64_t *ends, int64_t decodes,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           int64_t max_len, float scale, float softcap, const float *sinks, float *out,
                           int num_threads, int cache_bytes, int fp8_shift) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row_stride = num_kv_heads * head_dim;  // one slot of the cache
    /* Work item: a decode's heads, all of them (its rows read whole, in order: what the memory serves
       fastest), or one KV head each while there are too few decodes to keep the threads busy. */
    const int64_t parts = decodes >= 2 * num_threads ? 1 : num_kv_heads, heads = num_kv_heads / parts;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(heads * group * (max_len + head_dim)));
        float *acc = scores + heads * group * max_len;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < decodes * parts; item++) {
            if (scores == NULL) {  // every thread still takes its share of the loop, as OpenMP requires
                failed = 1;
                continue;
            }
            const int64_t i = item / parts, h0 = item % parts * heads;
            const int64_t offset = (token_rows[i] * num_heads + h0 * group) * head_dim;
            const int64_t *table = block_tables + table_rows[i] * table_stride;
            const float *item_sinks = sinks ? sinks + h0 * group : NULL;
#define ITEM(BYTES, SHIFT)                                                                                     \
    attend_item(query + offset, table, advance(key_cache, h0 * head_dim, BYTES),                               \
                advance(value_cache, h0 * head_dim, BYTES), starts[i], ends[i], heads, group, row_stride,      \
                block_size, head_dim, BYTES, SHIFT, scale, softcap, item_sinks, scores, acc, out + offset)
            if (cache_bytes == 2)
                ITEM(2, 0);
            else if (cache_bytes == 1)
                ITEM(1, fp8_shift);
            else
                ITEM(4, 0);
#undef ITEM
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
