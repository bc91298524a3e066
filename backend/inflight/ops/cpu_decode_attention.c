/* Decode attention on a CPU, float32, straight from the paged cache: one query token per sequence.

   Built and loaded by cpu_kernels.py. Work item: a decode with all its KV heads, or one KV head of it
   while decodes are too few to keep the threads busy. Pass 1 walks its key rows in block-table order,
   whole (every KV head of the item: contiguous memory), the next block prefetched, and scores each row
   against the query heads it serves; pass 2 takes the softmax per query head (float32, max subtracted);
   pass 3 walks the value rows the same way into per-head sums. Each row of the context is read from
   memory once. Items run in parallel on the OpenMP runtime torch has already loaded (same soname), with
   torch's thread count passed in. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__x86_64__) && defined(__GLIBC__)
/* glibc's vector expf (libmvec), which <math.h> declares only under -ffast-math. That flag is not used:
   in a shared library, GCC before 13 links a constructor that turns on flush-to-zero for the thread
   that loads it, which would change every later float operation of the engine. */
#pragma omp declare simd notinbranch
float expf(float);
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float dot(const float *a, const float *b, const int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t d = 0; d < n; d++) sum += a[d] * b[d];
    return sum;
}

ALWAYS_INLINE void add_scaled(float *acc, const float *row, float weight, const int64_t n) {
#pragma omp simd
    for (int64_t d = 0; d < n; d++) acc[d] += weight * row[d];
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
            const float *ROW = (CACHE) + (base + POSITION) * row_stride;                               \
            PREFETCH(CACHE, (next + POSITION) * row_stride)                                            \
            BODY                                                                                        \
        }                                                                                               \
    }

/* The heads' part of the row at `offset` into the cache (keys or values), on its way to this core's cache. */
#define PREFETCH(CACHE, offset)                                                                        \
    for (int64_t d = 0; d < heads * head_dim; d += 16) __builtin_prefetch((CACHE) + (offset) + d);

/* `heads` KV heads of one decode: k_cache and v_cache point at the first one's part of slot 0, q and o at
   its first query head's row. head_dim is a constant where it is 64 or 128 (the call sites below), so
   that the loops over it unroll. */
ALWAYS_INLINE void attend(const float *q, const int64_t *table, const float *k_cache, const float *v_cache,
                          int64_t start, int64_t end, int64_t heads, int64_t group, int64_t row_stride,
                          int64_t block_size, const int64_t head_dim, float scale, float *scores, float *acc,
                          float *o) {
    const int64_t len = end - start, rows = heads * group;
    float *s = scores - start;
    FOR_EACH_ROW(k_cache, p, k, {
        for (int64_t h = 0; h < heads; h++)
            for (int64_t r = h * group; r < (h + 1) * group; r++)
                s[r * len + p] = scale * dot(q + r * head_dim, k + h * head_dim, head_dim);
    })
    for (int64_t r = 0; r < rows; r++) {
        float *sr = scores + r * len, top = sr[0], total = 0.0f;
#pragma omp simd reduction(max : top)
        for (int64_t j = 1; j < len; j++) top = sr[j] > top ? sr[j] : top;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < len; j++) {
            sr[j] = expf(sr[j] - top);
            total += sr[j];
        }
        const float inverse = 1.0f / total;
        for (int64_t j = 0; j < len; j++) sr[j] *= inverse;
    }
    for (int64_t d = 0; d < rows * head_dim; d++) acc[d] = 0.0f;
    FOR_EACH_ROW(v_cache, p, v, {
        for (int64_t h = 0; h < heads; h++)
            for (int64_t r = h * group; r < (h + 1) * group; r++)
                add_scaled(acc + r * head_dim, v + h * head_dim, s[r * len + p], head_dim);
    })
    for (int64_t d = 0; d < rows * head_dim; d++) o[d] = acc[d];
}

/* query, out: [tokens, Hq, D] contiguous; caches: [slots, Hkv, D] contiguous; block_tables: rows
   `table_stride` apart. For decode i: its query row token_rows[i], its table row table_rows[i], its
   visible positions [starts[i], ends[i]), at least one. Returns 0, or -1 when memory for the scores ran
   out. */
int paged_decode_attention_f32(const float *query, const int64_t *token_rows, const float *key_cache,
                               const float *value_cache, const int64_t *block_tables, int64_t table_stride,
                               const int64_t *table_rows, const int64_t *starts, const int64_t *ends,
                               int64_t decodes, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t block_size, int64_t max_len, float scale, float *out, int num_threads) {
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
            const float *k = key_cache + h0 * head_dim, *v = value_cache + h0 * head_dim;
            if (head_dim == 64)
                attend(query + offset, table, k, v, starts[i], ends[i], heads, group, row_stride, block_size, 64,
                       scale, scores, acc, out + offset);
            else if (head_dim == 128)
                attend(query + offset, table, k, v, starts[i], ends[i], heads, group, row_stride, block_size, 128,
                       scale, scores, acc, out + offset);
            else
                attend(query + offset, table, k, v, starts[i], ends[i], heads, group, row_stride, block_size,
                       head_dim, scale, scores, acc, out + offset);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
