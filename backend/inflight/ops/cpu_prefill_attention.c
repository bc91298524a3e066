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

   Built and loaded by cpu_kernels.py with the decode kernel's flags (FMA contraction on) but for
   reassociation: every sum runs in the order written, so a query row's result does not depend on the rows
   or keys its work item holds beside it, and a prompt's attention is the same bit for bit however the
   engine's steps cut it into chunks. Items run in parallel on torch's OpenMP runtime, the costliest (the
   last query tiles: the most keys) first. */

#include <stdlib.h>

#include "cpu_kernels.h"

/* The register tiles below are sized to the target's vector registers: spilled, they run several
   times slower than torch (an AVX-512 tiling built for AVX2 ran at 10 GFLOP/s against SDPA's 60). */
#if defined(__AVX512F__)
#define LANES 16     /* floats in one vector */
#define REGISTERS 32 /* vector registers */
#define KEYS 64      /* keys per tile */
#else                /* AVX2: 16 registers of 8 floats; NEON: 32 of 4, as many floats */
#define LANES 8
#define REGISTERS 16
#define KEYS 32
#endif
#define ROWS 96 /* query rows per work item, unless one position's group of heads is more */

enum {
    KV = KEYS / LANES,                          /* vectors in a row of a tile's scores: 4 */
    SCORE_ROWS = (REGISTERS - KV - 1) / KV,     /* a block's rows: registers for their sums, keys, a query */
    VALUE_VECTORS = 4,                          /* most vectors of a value row one block sums */
};

/* LANES floats; GCC lowers the arithmetic to what the target has. */
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

ALWAYS_INLINE vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

ALWAYS_INLINE void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* c[r] (+)= sum over i < n of a[r][i] * b[i] for R rows of CV vectors, each row's sums in registers:
   the product both halves of a tile use (scores: a = queries, b = the tile's keys [dp][KEYS]; values:
   a = the probabilities, b = the tile's values [KEYS][dp], a block of their columns). Rows of a, b and
   c lie `a_stride`, `b_stride` and `c_stride` floats apart; `accumulate`: add to c instead of
   overwriting it. The sums' array has a fixed size (not R x CV, which GCC would allocate on the stack as
   a variable-length array even where inlining makes both constants), so that every element lives in a
   register. */
ALWAYS_INLINE void tile_product(const float *a, int64_t a_stride, const float *b, int64_t b_stride, float *c,
                                int64_t c_stride, const int R, const int CV, int64_t n, const int accumulate) {
    vec acc[REGISTERS];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < CV; v++) acc[r * CV + v] = accumulate ? load(c + r * c_stride + v * LANES) : (vec){0};
    for (int64_t i = 0; i < n; i++) {
        vec x[VALUE_VECTORS > KV ? VALUE_VECTORS : KV];
        for (int v = 0; v < CV; v++) x[v] = load(b + i * b_stride + v * LANES);
        for (int r = 0; r < R; r++) {
            const vec broadcast = (vec){0} + a[r * a_stride + i];
            for (int v = 0; v < CV; v++) acc[r * CV + v] += broadcast * x[v];
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < CV; v++) store(c + r * c_stride + v * LANES, acc[r * CV + v]);
}

/* Blocks of the register tile and one row at a time for what is left. */
static void scores_rows(const float *q, const float *kt, float *s, int64_t rows, int64_t dp) {
    int64_t r = 0;
    for (; r + SCORE_ROWS <= rows; r += SCORE_ROWS)
        tile_product(q + r * dp, dp, kt, KEYS, s + r * KEYS, KEYS, SCORE_ROWS, KV, dp, 0);
    for (; r < rows; r++) tile_product(q + r * dp, dp, kt, KEYS, s + r * KEYS, KEYS, 1, KV, dp, 0);
}

/* Rows of CV vectors: blocks of as many rows as leave a register for the value row and one for p. */
#define VALUE_ROWS(CV)                                                                                    \
    static void values_rows_##CV(const float *p, const float *v, float *o, int64_t rows, int64_t keys,    \
                                 int64_t stride) {                                                        \
        const int block = (REGISTERS - CV - 1) / CV;                                                      \
        int64_t r = 0;                                                                                    \
        for (; r + block <= rows; r += block)                                                             \
            tile_product(p + r * KEYS, KEYS, v, stride, o + r * stride, stride, block, CV, keys, 1);      \
        for (; r < rows; r++)                                                                             \
            tile_product(p + r * KEYS, KEYS, v, stride, o + r * stride, stride, 1, CV, keys, 1);          \
    }
VALUE_ROWS(1)
VALUE_ROWS(2)
VALUE_ROWS(4)

/* The value product of `rows` rows of dv vectors, in blocks of columns of at most VALUE_VECTORS. */
static void values_rows(const float *p, const float *v, float *o, int64_t rows, int64_t keys, int64_t dv) {
    const int64_t stride = dv * LANES;
    for (int64_t c0 = 0; c0 < dv; c0 += VALUE_VECTORS) {
        const float *vc = v + c0 * LANES;
        float *oc = o + c0 * LANES;
        switch (dv - c0 < VALUE_VECTORS ? dv - c0 : VALUE_VECTORS) { /* dv: a power of two */
            case 1: values_rows_1(p, vc, oc, rows, keys, stride); break;
            case 2: values_rows_2(p, vc, oc, rows, keys, stride); break;
            default: values_rows_4(p, vc, oc, rows, keys, stride); break;
        }
    }
}

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

/* Phase 1, one tile of keys and values of KV head h of prefill `f`. */
static void pack_tile(const struct prefill *f, const int64_t *table, const void *key_cache, const void *value_cache,
                      int64_t h, int64_t tile, int64_t num_kv_heads, int64_t head_dim, int64_t dp, int64_t block_size,
                      int bytes, const int fp8_shift) {
    float *kt = key_tile(f, h, tile, dp), *v = value_tile(f, h, tile, dp);
    for (int64_t j = 0; j < KEYS; j++) {
        const int64_t position = f->first_key + tile * KEYS + j;
        if (position >= f->seq_len) {
            for (int64_t d = 0; d < dp; d++) kt[d * KEYS + j] = v[j * dp + d] = 0.0f;
            continue;
        }
        const int64_t slot = table[position / block_size] * block_size + position % block_size;
        const int64_t offset = (slot * num_kv_heads + h) * head_dim * bytes;
        const void *k_row = (const char *)key_cache + offset, *v_row = (const char *)value_cache + offset;
        for (int64_t d = 0; d < head_dim; d++) {
            kt[d * KEYS + j] = element(k_row, d, bytes, fp8_shift);
            v[j * dp + d] = element(v_row, d, bytes, fp8_shift);
        }
        for (int64_t d = head_dim; d < dp; d++) kt[d * KEYS + j] = v[j * dp + d] = 0.0f;
    }
}

/* Phase 2, one work item: positions [p0, p0 + m) of prefill `f` (chunk-relative), the `group` query
   heads of KV head h. Scratch: q, o [ROWS or more][dp]; s [same rows][KEYS]; max, sum [rows]. */
static void attend_item(const struct prefill *f, const float *query, int64_t q_stride, float *out, int64_t h,
                        int64_t p0, int64_t m, int64_t group, int64_t head_dim, int64_t dp, int64_t window, float scale,
                        float softcap, const float *sinks, float *q, float *o, float *s, float *row_max,
                        float *row_sum) {
    const int64_t rows = m * group, context = f->seq_len - f->q_len;
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < group; g++) {
            const float *src = query + (f->q_start + p0 + i) * q_stride + (h * group + g) * head_dim;
            float *dst = q + (i * group + g) * dp;
            for (int64_t d = 0; d < head_dim; d++) dst[d] = src[d] * scale;
            for (int64_t d = head_dim; d < dp; d++) dst[d] = 0.0f;
        }
    memset(o, 0, sizeof(float) * rows * dp);
    for (int64_t r = 0; r < rows; r++) {
        row_max[r] = sinks ? sinks[h * group + r % group] : -INFINITY;
        row_sum[r] = sinks ? 1.0f : 0.0f;
    }
    /* Absolute positions: the item's queries [first, last]; key k is visible to query p when
       k <= p and, with a window, p - k < window. */
    const int64_t first = context + p0, last = context + p0 + m - 1;
    int64_t lowest = window > 0 ? first - window + 1 : 0;
    if (lowest < f->first_key) lowest = f->first_key;
    for (int64_t tile = (lowest - f->first_key) / KEYS; tile * KEYS + f->first_key <= last; tile++) {
        const int64_t t0 = f->first_key + tile * KEYS; /* position of the tile's key 0 */
        const float *kt = key_tile(f, h, tile, dp), *v = value_tile(f, h, tile, dp);
        scores_rows(q, kt, s, rows, dp);
        int64_t keys = 0; /* keys of the tile any row sees: the value product stops there */
        for (int64_t r = 0; r < rows; r++) {
            const int64_t position = first + r / group;
            float *sr = s + r * KEYS;
            int64_t from = window > 0 ? position - window + 1 - t0 : 0, to = position - t0 + 1;
            if (from < 0) from = 0;
            if (to > KEYS) to = KEYS;
            if (from >= to) {
                memset(sr, 0, sizeof(float) * KEYS);
                continue;
            }
            if (to > keys) keys = to;
            if (softcap > 0.0f) apply_softcap(sr, from, to, softcap);
            float top = row_max[r];
#pragma omp simd reduction(max : top)
            for (int64_t j = from; j < to; j++) top = sr[j] > top ? sr[j] : top;
            const float rescale = expf(row_max[r] - top); /* 0 while the row had no key yet */
            float total = 0.0f;
            for (int64_t j = 0; j < from; j++) sr[j] = 0.0f;
#pragma omp simd reduction(+ : total)
            for (int64_t j = from; j < to; j++) {
                sr[j] = expf(sr[j] - top);
                total += sr[j];
            }
            for (int64_t j = to; j < KEYS; j++) sr[j] = 0.0f;
            row_max[r] = top;
            row_sum[r] = row_sum[r] * rescale + total;
            if (rescale != 1.0f) {
                float *orow = o + r * dp;
#pragma omp simd
                for (int64_t d = 0; d < dp; d++) orow[d] *= rescale;
            }
        }
        values_rows(s, v, o, rows, keys, dp / LANES);
    }
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < group; g++) {
            const int64_t r = i * group + g;
            const float inverse = 1.0f / row_sum[r];
            float *dst = out + (f->q_start + p0 + i) * q_stride + (h * group + g) * head_dim;
            for (int64_t d = 0; d < head_dim; d++) dst[d] = o[r * dp + d] * inverse;
        }
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
    const int64_t dp = head_dim <= 16 ? 16 : head_dim <= 32 ? 32 : head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256;
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
        int64_t first_key = window > 0 ? context - window + 1 : 0;
        if (first_key < 0) first_key = 0;
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
            pack_tile(&f[i], block_tables + table_rows[i] * table_stride, key_cache, value_cache, h, tile,
                      num_kv_heads, head_dim, dp, block_size, cache_bytes, fp8_shift);
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
