/* Decode attention on a CPU, straight from the paged cache: one query token per sequence. The query,
   the output and all arithmetic are float32; the cache is float32, bfloat16 or fp8 (each element widened
   as it is read: a bfloat16 is the top half of a float32, an fp8 byte's bits moved into a float32's).

   Built and loaded by cpu_kernels.py. A decode's query heads attend as a prefill chunk's row at the same
   position does in cpu_prefill_attention.c (cpu_attention_tiles.h), so that both give a token the same
   bits: tile by tile, the scores of the query heads sharing a KV head against the tile's keys (blocks of
   LANES keys by LANES dimensions transposed in registers, straight from the cache: each key's sum over
   the dimensions in the order the prefill kernel's packed tiles give it), then the softmax and the value
   product the prefill kernel runs. Each row of the context is read from memory once; the next tile's
   rows are fetched while a tile computes (into the second-level cache: fetched into the first, they took
   the room the loads need and the step ran slower than without them).

   Work item: a decode with all its KV heads, or one KV head of it where that spreads the work over the
   threads better (paged_decode_attention). Items run in parallel on the OpenMP runtime torch has already
   loaded (same soname), with torch's thread count passed in. A model's softcap bounds the scores before
   the softmax; its sinks (a logit per query head) join each softmax's denominator. */

#include <stdlib.h>

#include "cpu_attention_tiles.h"

/* The next tile's rows on their way to this core's second-level cache while a tile computes: the key
   cache's rows at `slots` (to the first -1), `row_bytes` of each from byte `first`, then the same rows
   of the value cache. `row`: the row being fetched, from its byte `line`; NULL once all are on their way. */
struct ahead {
    const char *cache, *value_cache, *row;
    const int64_t *slots;
    int64_t slot_bytes, first, row_bytes, next, line;
};

/* The row after `row`: the next slot's, the value cache's first once the key cache's are done, or NULL. */
ALWAYS_INLINE void next_row(struct ahead *a) {
    a->line = 0;
    if (a->next == KEYS || a->slots[a->next] < 0) {
        a->cache = a->value_cache, a->value_cache = NULL, a->next = 0;
        if (a->cache == NULL || a->slots[0] < 0) {
            a->row = NULL;
            return;
        }
    }
    a->row = a->cache + a->slots[a->next++] * a->slot_bytes + a->first;
}

/* The fetches of the rows at `slots`, none on their way yet. */
ALWAYS_INLINE struct ahead rows_ahead(const void *key_cache, const void *value_cache, const int64_t *slots,
                                      int64_t slot_bytes, int64_t first, int64_t row_bytes) {
    struct ahead a = {key_cache, value_cache, NULL, slots, slot_bytes, first, row_bytes, 0, 0};
    next_row(&a);
    return a;
}

/* The next `lines` lines on their way, spread over the scores' loop so that the fetches leave the loads
   room (a row's lines in one tight loop: the bookkeeping per line cost a fifth of the kernel's time
   when the cache already held the rows). */
ALWAYS_INLINE void fetch_ahead(struct ahead *a, int64_t lines) {
    while (lines > 0 && a->row) {
        const int64_t end = a->line + lines * 64 < a->row_bytes ? a->line + lines * 64 : a->row_bytes;
        lines -= (end - a->line + 63) / 64;
        for (; a->line < end; a->line += 64) __builtin_prefetch(a->row + a->line, 0, 1);
        if (a->line >= a->row_bytes) next_row(a);
    }
}

/* The scores of `rows` query rows (q: [rows][dp], zero-padded) against the tile's keys straight from
   their rows (k_rows) into s ([rows][KEYS]): blocks of LANES keys transposed in registers, each key's
   sum over the dimensions in the order scores_rows runs it on packed keys (the dimensions past
   head_dim, zeros, add nothing), so the bits are the same. */
ALWAYS_INLINE void scores_from_rows(const float *q, const void *const *k_rows, float *s, int64_t rows, int64_t head_dim,
                                    int64_t dp, const int bytes, const int fp8_shift, struct ahead *ahead,
                                    int64_t heads) {
    const int64_t blocks = KEYS / LANES * ((head_dim + LANES - 1) / LANES);
    const int64_t per_block = (2 * KEYS * ((ahead->row_bytes + 63) / 64) + blocks * heads - 1) / (blocks * heads);
    for (int64_t j0 = 0; j0 < KEYS; j0 += LANES)
        for (int64_t d0 = 0; d0 < head_dim; d0 += LANES) {
            vec t[LANES];
            fetch_ahead(ahead, per_block);
            transposed_keys(t, k_rows + j0, d0, head_dim, bytes, fp8_shift);
            for (int64_t r = 0; r < rows; r++) {
                vec acc = d0 ? load(s + r * KEYS + j0) : (vec){0};
                for (int i = 0; i < LANES; i++) {
                    const vec broadcast = (vec){0} + q[r * dp + d0 + i];
                    acc += broadcast * t[i];
                }
                store(s + r * KEYS + j0, acc);
            }
        }
}

/* KV heads [h0, h0 + heads) of one decode: its query row `token`, its visible positions [start, end).
   Tile by tile, head by head: the scores straight from the key rows, then the softmax and the value
   product (over the value rows where they lie, widened as they are read, when a head fills dp; else
   widened and padded first). Scratch: v: a tile [KEYS][dp]; q, o: [heads x group][dp]; s: [group][KEYS]; max, sum:
   [heads x group]. `bytes`, the cache element's size, is a constant at each call site: the loads compile
   to one kind each. */
ALWAYS_INLINE void attend_decode(const float *query, int64_t token, const int64_t *table, const void *key_cache,
                                 const void *value_cache, int64_t start, int64_t end, int64_t h0, int64_t heads,
                                 int64_t group, int64_t num_kv_heads, int64_t head_dim, int64_t dp, int64_t block_size,
                                 const int bytes, const int fp8_shift, float scale, float softcap, const float *sinks,
                                 float *out, float *v, float *q, float *o, float *s, float *row_max, float *row_sum) {
    const int64_t q_stride = num_kv_heads * group * head_dim;
    /* What the prefill kernel's window would be for this row: its keys are [start, end) either way. */
    const int64_t window = start > 0 ? end - start : 0;
    for (int64_t h = h0; h < h0 + heads; h++) {
        const int64_t r = (h - h0) * group;
        begin_rows(query, q_stride, token, 1, h, group, head_dim, dp, scale, sinks, q + r * dp, o + r * dp,
                   row_max + r, row_sum + r);
    }
    int64_t slots[KEYS], next[KEYS];
    tile_slots(next, table, start / KEYS * KEYS, end - start / KEYS * KEYS, block_size);
    for (int64_t t0 = start / KEYS * KEYS; t0 < end; t0 += KEYS) {
        memcpy(slots, next, sizeof slots);
        tile_slots(next, table, t0 + KEYS, end - t0 - KEYS, block_size);
        /* The next tile's rows on their way while this one computes. */
        struct ahead ahead = rows_ahead(key_cache, value_cache, next, num_kv_heads * head_dim * bytes,
                                        h0 * head_dim * bytes, heads * head_dim * bytes);
        for (int64_t h = h0; h < h0 + heads; h++) {
            const int64_t r = (h - h0) * group;
            const void *k_rows[KEYS], *v_rows[KEYS];
            tile_rows(k_rows, v_rows, slots, key_cache, value_cache, h, num_kv_heads, head_dim, bytes);
            scores_from_rows(q + r * dp, k_rows, s, group, head_dim, dp, bytes, fp8_shift, &ahead, heads);
            int value_bytes = bytes;
            if (head_dim < dp) { /* padded to dp first; else the value rows read where they are */
                pack_values(v, v_rows, head_dim, dp, bytes, fp8_shift);
                for (int64_t j = 0; j < KEYS; j++) v_rows[j] = v + j * dp;
                value_bytes = 4;
            }
            softmax_values(s, v_rows, value_bytes, fp8_shift, o + r * dp, row_max + r, row_sum + r, group, group,
                           end - 1, t0, window, softcap, dp);
        }
    }
    for (int64_t h = h0; h < h0 + heads; h++) {
        const int64_t r = (h - h0) * group;
        end_rows(o + r * dp, row_sum + r, q_stride, token, 1, h, group, head_dim, dp, out);
    }
}

/* query, out: [tokens, Hq, D] float32 contiguous; caches: [slots, Hkv, D] contiguous, of `cache_bytes` an
   element: float32 (4), bfloat16 (2) or fp8 (1, `fp8_shift` 20 for e4m3, 21 for e5m2); block_tables: rows
   `table_stride` apart. For decode i: its query row token_rows[i], its table row table_rows[i], its
   visible positions [starts[i], ends[i]), at least one. head_dim at most 256. softcap: 0 for none; sinks:
   [Hq] float32, or NULL. Returns 0, or -1 when memory for the scratch ran out. */
int paged_decode_attention(const float *query, const int64_t *token_rows, const void *key_cache,
                           const void *value_cache, const int64_t *block_tables, int64_t table_stride,
                           const int64_t *table_rows, const int64_t *starts, const int64_t *ends, int64_t decodes,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                           float softcap, const float *sinks, float *out, int num_threads, int cache_bytes,
                           int fp8_shift) {
    const int64_t group = num_heads / num_kv_heads, dp = padded_head_dim(head_dim);
    /* Work item: a decode's heads, all of them, or one KV head each where that spreads the work over the
       threads better. An item of one head costs ~1.25x its share of a whole decode (its rows strided in
       the cache, a tile's bookkeeping for one head: 1.16x on Llama-3-8B's shape, 1.33x on the default
       model's), so a decode is cut only where threads would otherwise wait: one decode on two threads,
       not two (1.15-1.35x slower cut). Units of a quarter head. */
    const int64_t whole = (decodes + num_threads - 1) / num_threads * num_kv_heads * 4;
    const int64_t cut = (decodes * num_kv_heads + num_threads - 1) / num_threads * 5;
    const int64_t parts = cut < whole ? num_kv_heads : 1, heads = num_kv_heads / parts;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int64_t rows = heads * group;
        /* Each array 64-byte aligned, as the prefill kernel's are (the softmax's vector loops run alike). */
        float *v = aligned_alloc(64, sizeof(float) * (size_t)((KEYS * dp + rows * 2 * dp + group * KEYS + 2 * rows
                                                               + 15) / 16 * 16));
        float *q = v + KEYS * dp, *o = q + rows * dp, *s = o + rows * dp;
        float *row_max = s + group * KEYS, *row_sum = row_max + rows;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < decodes * parts; item++) {
            if (v == NULL) { /* every thread still takes its share of the loop, as OpenMP requires */
                failed = 1;
                continue;
            }
            const int64_t i = item / parts, h0 = item % parts * heads;
            const int64_t *table = block_tables + table_rows[i] * table_stride;
#define ITEM(BYTES, SHIFT)                                                                                   \
    attend_decode(query, token_rows[i], table, key_cache, value_cache, starts[i], ends[i], h0, heads, group, \
                  num_kv_heads, head_dim, dp, block_size, BYTES, SHIFT, scale, softcap, sinks, out, v, q, o, s, \
                  row_max, row_sum)
            WITH_CACHE_BYTES(ITEM, cache_bytes, fp8_shift);
#undef ITEM
        }
        free(v);
    }
    return failed ? -1 : 0;
}
