/* Prefill attention on a CPU, straight from the paged cache: every prefill chunk of a step (causal over
   its own tokens, after the context already cached; optionally a sliding window) in one call. The query,
   the output and all arithmetic are float32; the cache is float32, bfloat16 or fp8 (widened as it is
   packed).

   torch's fused CPU attention reached 60-120 GFLOP/s on the default model's shapes (head_dim 64, 9 query
   heads on 3 KV heads; 2 cores, AVX-512) where its matrix products reach ~300; this kernel, a flash
   attention shaped for them, 170-290 (client/bench_cpu_attention.py). Phase 1 packs each sequence's
   keys, per KV head, into tiles of KEYS keys transposed ([dim][key]) and its values into rows, both
   padded to 16, 32, 64, 128 or 256 dimensions with zeros: every query tile of that head reads them again,
   from the caches. Phase 2 takes work items of up to ROWS query rows (positions x the query heads
   sharing one KV head, which share its keys too) and walks their key tiles: scores by a register-blocked
   product (a block of rows x KEYS keys of sums in registers, one broadcast per row and dimension), the
   online softmax in float32 (running max and sum, rows rescaled when the max grows), then the value
   product into the rows' sums, a block of columns at a time. Tiles no query of the item can see are
   skipped. A model's softcap bounds the scores before the softmax; its sinks (a logit per query head)
   start each row's running sum as a key whose value is zero would.

   The tiles and their computation are the decode kernel's too (cpu_attention_tiles.h): a token gets the
   same bits from either. Built and loaded by cpu_kernels.py with the decode kernel's flags (FMA
   contraction on, no reassociation): every sum runs in the order written, so a query row's result does
   not depend on the rows or keys its work item holds beside it, and a prompt's attention is the same bit
   for bit however the engine's steps cut it into chunks (tiles start at multiples of KEYS, whatever the
   chunk's window). Items run in parallel on torch's OpenMP runtime, the costliest (the last query tiles:
   the most keys) first. */

#include <stdlib.h>

#include "cpu_attention_tiles.h"

/* What one prefill chunk needs: its query rows [q_start, q_start + q_len), which are positions
   [seq_len - q_len, seq_len) of a sequence whose keys from position `first_key` on are packed at
   `packed`: per KV head, `tiles` tiles of keys, then as many of values, KEYS x dp floats each. */
struct prefill {
    int64_t q_start, q_len, seq_len, first_key, tiles;
    float *packed;
};

/* Tile `tile` of KV head h's packed keys ([dp][KEYS]), and of its values ([KEYS][dp]). */
static inline float *key_tile(const struct prefill *f, int64_t h, int64_t tile, int64_t dp) {
    return f->packed + (2 * h * f->tiles + tile) * KEYS * dp;
}

static inline float *value_tile(const struct prefill *f, int64_t h, int64_t tile, int64_t dp) {
    return key_tile(f, h, f->tiles + tile, dp);
}

/* Phase 1, tile `tile` of KV head h of prefill `f`; `bytes`, the cache element's size, a constant at each
   call site. */
ALWAYS_INLINE void pack(const struct prefill *f, const int64_t *table, const void *key_cache, const void *value_cache,
                        int64_t h, int64_t tile, int64_t num_kv_heads, int64_t head_dim, int64_t dp,
                        int64_t block_size, const int bytes, const int fp8_shift) {
    const int64_t t0 = f->first_key + tile * KEYS;
    int64_t slots[KEYS];
    const void *k_rows[KEYS], *v_rows[KEYS];
    tile_slots(slots, table, t0, f->seq_len - t0, block_size);
    tile_rows(k_rows, v_rows, slots, key_cache, value_cache, h, num_kv_heads, head_dim, bytes);
    pack_keys(key_tile(f, h, tile, dp), k_rows, head_dim, dp, bytes, fp8_shift);
    pack_values(value_tile(f, h, tile, dp), v_rows, head_dim, dp, bytes, fp8_shift);
}

#define ROWS 96 /* query rows per work item, unless one position's group of heads is more */

/* Phase 2, one work item: positions [p0, p0 + m) of prefill `f` (chunk-relative), the `group` query
   heads of KV head h. Scratch: q, o [ROWS or more][dp]; s [same rows][KEYS]; max, sum [rows]. */
static void attend_item(const struct prefill *f, const float *query, int64_t q_stride, float *out, int64_t h,
                        int64_t p0, int64_t m, int64_t group, int64_t head_dim, int64_t dp, int64_t window, float scale,
                        float softcap, const float *sinks, float *q, float *o, float *s, float *row_max,
                        float *row_sum) {
    const int64_t rows = m * group, first = f->seq_len - f->q_len + p0, last = first + m - 1;
    begin_rows(query, q_stride, f->q_start + p0, m, h, group, head_dim, dp, scale, sinks, q, o, row_max, row_sum);
    int64_t lowest = window > 0 ? first - window + 1 : 0; /* the first key any of the item's queries sees */
    if (lowest < f->first_key) lowest = f->first_key;
    for (int64_t tile = (lowest - f->first_key) / KEYS; tile * KEYS + f->first_key <= last; tile++) {
        const float *values = value_tile(f, h, tile, dp);
        const void *v_rows[KEYS];
        for (int64_t j = 0; j < KEYS; j++) v_rows[j] = values + j * dp;
        scores_rows(q, key_tile(f, h, tile, dp), s, rows, dp);
        softmax_values(s, v_rows, 4, 0, o, row_max, row_sum, rows, group, first, f->first_key + tile * KEYS, window,
                       softcap, dp);
    }
    end_rows(o, row_sum, q_stride, f->q_start + p0, m, h, group, head_dim, dp, out);
}

/* query, out: [tokens, num_heads, head_dim] float32 contiguous; caches [slots, num_kv_heads, head_dim]
   contiguous, of `cache_bytes` an element: float32 (4), bfloat16 (2) or fp8 (1, `fp8_shift` 20 for e4m3, 21 for e5m2);
   block_tables rows `table_stride` apart. Prefill i: query
   rows [q_starts[i], q_starts[i] + q_lens[i]), the last q_lens[i] of seq_lens[i] positions, its table row
   table_rows[i]. window: keys a query sees, itself included (0: all before it). head_dim at most 256.
   softcap: 0 for none; sinks: [num_heads] float32, or NULL.
   Returns 0, or -1 when memory for the packed keys or the scratch ran out. */
int paged_prefill_attention(const float *query, const void *key_cache, const void *value_cache,
                            const int64_t *block_tables, int64_t table_stride, const int64_t *table_rows,
                            const int64_t *q_starts, const int64_t *q_lens, const int64_t *seq_lens, int64_t prefills,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            int64_t window, float scale, float softcap, const float *sinks, float *out,
                            int num_threads, int cache_bytes, int fp8_shift) {
    if (prefills <= 0) return 0;
    const int64_t group = num_heads / num_kv_heads, q_stride = num_heads * head_dim;
    const int64_t dp = padded_head_dim(head_dim);
    const int64_t m = group >= ROWS ? 1 : ROWS / group, rows = m * group; /* positions, rows per item */
    struct prefill *f = malloc(sizeof *f * (size_t)prefills);
    int64_t *pack_starts = malloc(sizeof(int64_t) * (size_t)(prefills + 1));
    int64_t *item_starts = malloc(sizeof(int64_t) * (size_t)(prefills + 1));
    if (f == NULL || pack_starts == NULL || item_starts == NULL) {
        free(f), free(pack_starts), free(item_starts);
        return -1;
    }
    pack_starts[0] = item_starts[0] = 0; /* in tiles of keys (each with one of values), in work items */
    for (int64_t i = 0; i < prefills; i++) {
        const int64_t context = seq_lens[i] - q_lens[i];
        /* The first key the chunk sees, rounded down to a tile's start: tiles start at multiples of KEYS
           whatever the chunk, as a decode's do. */
        const int64_t first_key = window > 0 && context - window + 1 > 0 ? (context - window + 1) / KEYS * KEYS : 0;
        f[i] = (struct prefill){q_starts[i], q_lens[i], seq_lens[i], first_key,
                                (seq_lens[i] - first_key + KEYS - 1) / KEYS, NULL};
        pack_starts[i + 1] = pack_starts[i] + num_kv_heads * f[i].tiles;
        item_starts[i + 1] = item_starts[i] + num_kv_heads * ((q_lens[i] + m - 1) / m);
    }
    float *packed = aligned_alloc(64, sizeof(float) * (size_t)(pack_starts[prefills] * 2 * KEYS * dp));
    if (packed == NULL) {
        free(f), free(pack_starts), free(item_starts);
        return -1;
    }
    for (int64_t i = 0; i < prefills; i++) f[i].packed = packed + pack_starts[i] * 2 * KEYS * dp;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scratch = aligned_alloc(64, sizeof(float) * (size_t)((rows * (2 * dp + KEYS + 2) + 15) / 16 * 16));
#pragma omp for schedule(dynamic, 4)
        for (int64_t t = 0; t < pack_starts[prefills]; t++) {
            int64_t i = 0;
            while (pack_starts[i + 1] <= t) i++;
            const int64_t h = (t - pack_starts[i]) / f[i].tiles, tile = (t - pack_starts[i]) % f[i].tiles;
            const int64_t *table = block_tables + table_rows[i] * table_stride;
#define PACK(BYTES, SHIFT) \
    pack(&f[i], table, key_cache, value_cache, h, tile, num_kv_heads, head_dim, dp, block_size, BYTES, SHIFT)
            WITH_CACHE_BYTES(PACK, cache_bytes, fp8_shift);
#undef PACK
        }
        /* Items numbered from the end of each chunk: its last query tiles see the most keys. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < item_starts[prefills]; t++) {
            if (scratch == NULL) { /* every thread still takes its share of the loop, as OpenMP requires */
                failed = 1;
                continue;
            }
            int64_t i = 0;
            while (item_starts[i + 1] <= t) i++;
            const int64_t tiles = (q_lens[i] + m - 1) / m, h = (t - item_starts[i]) % num_kv_heads;
            const int64_t q_tile = tiles - 1 - (t - item_starts[i]) / num_kv_heads, p0 = q_tile * m;
            const int64_t count = p0 + m <= q_lens[i] ? m : q_lens[i] - p0;
            float *q = scratch, *o = q + rows * dp, *s = o + rows * dp, *row_max = s + rows * KEYS;
            attend_item(&f[i], query, q_stride, out, h, p0, count, group, head_dim, dp, window, scale, softcap,
                        sinks, q, o, s, row_max, row_max + rows);
        }
        free(scratch);
    }
    free(packed), free(f), free(pack_starts), free(item_starts);
    return failed ? -1 : 0;
}
