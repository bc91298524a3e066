/* What both attention kernels (cpu_decode_attention.c, cpu_prefill_attention.c) compute with: a
   sequence's keys and values in tiles of KEYS positions, tiles starting at multiples of KEYS, and a flash
   attention of query rows over them (each key's score a sum over the dimensions in order, keys in vector
   lanes; online softmax; value product). A decode's row gets the bits a prefill chunk's row at the same
   position gets: a token decoded and the same token recomputed in a prompt (after preemption, or in a
   prompt that finds another request's answer in the prefix cache) get the same keys and values, so the
   same logits. Both libraries are built with the same flags, without reassociation: every sum runs in
   the order written, whatever the rows and keys beside it. */

#ifndef INFLIGHT_CPU_ATTENTION_TILES_H
#define INFLIGHT_CPU_ATTENTION_TILES_H

#include "cpu_kernels.h"

/* The register tiles are sized to the target's vector registers: spilled, they run several times slower
   than torch (an AVX-512 tiling built for AVX2 ran at 10 GFLOP/s against SDPA's 60). */
#if defined(__AVX512F__)
#define LANES 16     /* floats in one vector */
#define REGISTERS 32 /* vector registers */
#define KEYS 64      /* keys per tile */
#else                /* AVX2: 16 registers of 8 floats; NEON: 32 of 4, as many floats */
#define LANES 8
#define REGISTERS 16
#define KEYS 32
#endif

enum {
    KV = KEYS / LANES,                      /* vectors in a row of a tile's scores: 4 */
    SCORE_ROWS = (REGISTERS - KV - 1) / KV, /* a block's rows: registers for their sums, keys, a query */
    VALUE_VECTORS = 4,                      /* most vectors of a value row one block sums */
};

/* LANES floats; GCC lowers the arithmetic to what the target has. */
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

ALWAYS_INLINE vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

ALWAYS_INLINE void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* CALL(bytes, fp8_shift) with the cache element's size a constant: each call site compiles the loads of
   one kind. */
#define WITH_CACHE_BYTES(CALL, cache_bytes, fp8_shift) \
    do {                                               \
        if ((cache_bytes) == 2)                        \
            CALL(2, 0);                                \
        else if ((cache_bytes) == 1)                   \
            CALL(1, fp8_shift);                        \
        else                                           \
            CALL(4, 0);                                \
    } while (0)

/* A head of head_dim elements as the tiles hold it: padded with zeros to 16, 32, 64, 128 or 256. */
static inline int64_t padded_head_dim(int64_t head_dim) {
    return head_dim <= 16 ? 16 : head_dim <= 32 ? 32 : head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256;
}

/* c[r] = sum over i < n of a[r][i] * b[i] for R rows of CV vectors, each row's sums in registers: the
   scores of query rows a against a tile's keys b ([n][KEYS], the keys in lanes). Rows of a, b and c lie
   `a_stride`, `b_stride` and `c_stride` floats apart. The sums' array has a fixed size (not R x CV,
   which GCC would allocate on the stack as a variable-length array even where inlining makes both
   constants), so that every element lives in a register. Each lane's sum runs over i in order, whatever
   R: a row's result does not depend on the rows computed beside it. */
ALWAYS_INLINE void tile_product(const float *a, int64_t a_stride, const float *b, int64_t b_stride, float *c,
                                int64_t c_stride, const int R, const int CV, int64_t n) {
    vec acc[REGISTERS];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < CV; v++) acc[r * CV + v] = (vec){0};
    for (int64_t i = 0; i < n; i++) {
        vec x[KV];
        for (int v = 0; v < CV; v++) x[v] = load(b + i * b_stride + v * LANES);
        for (int r = 0; r < R; r++) {
            const vec broadcast = (vec){0} + a[r * a_stride + i];
            for (int v = 0; v < CV; v++) acc[r * CV + v] += broadcast * x[v];
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < CV; v++) store(c + r * c_stride + v * LANES, acc[r * CV + v]);
}

/* The rows left after a product's full blocks (fewer than `block`), in blocks of 16, 8, 4, 2 and 1 rows:
   each size a constant, each row's sums in registers beside the others'. */
#define REMAINING_ROWS(block, PRODUCT)                             \
    do {                                                           \
        if (16 < (block) && r + 16 <= rows) PRODUCT(16), r += 16;   \
        if (8 < (block) && r + 8 <= rows) PRODUCT(8), r += 8;       \
        if (4 < (block) && r + 4 <= rows) PRODUCT(4), r += 4;       \
        if (2 < (block) && r + 2 <= rows) PRODUCT(2), r += 2;       \
        if (r < rows) PRODUCT(1);                                  \
    } while (0)

/* Blocks of the register tile, then what is left. */
static inline void scores_rows(const float *q, const float *kt, float *s, int64_t rows, int64_t dp) {
    int64_t r = 0;
#define SCORES(R) tile_product(q + r * dp, dp, kt, KEYS, s + r * KEYS, KEYS, R, KV, dp)
    for (; r + SCORE_ROWS <= rows; r += SCORE_ROWS) SCORES(SCORE_ROWS);
    REMAINING_ROWS(SCORE_ROWS, SCORES);
#undef SCORES
}

typedef uint16_t half_lanes __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t word_lanes __attribute__((vector_size(LANES * sizeof(uint32_t))));

/* LANES elements of a cache row from element d on, widened to float32 (bfloat16: each the top half of a
   float32's bits). */
ALWAYS_INLINE vec load_widened(const void *row, int64_t d, const int bytes, const int fp8_shift) {
    if (bytes == 4) return load((const float *)row + d);
    if (bytes == 2) {
        half_lanes halves;
        memcpy(&halves, (const uint16_t *)row + d, sizeof halves);
        const word_lanes words = __builtin_convertvector(halves, word_lanes) << 16;
        vec v;
        memcpy(&v, &words, sizeof v);
        return v;
    }
    float x[LANES];
    for (int l = 0; l < LANES; l++) x[l] = element(row, d + l, bytes, fp8_shift);
    return load(x);
}

/* c[r] += sum over i < n of a[r][i] * b_rows[i][col..] for R rows of CV vectors: the value product,
   whose rows (the tile's values, of `bytes` an element, widened as they are read) lie wherever `b_rows`
   points, each row's sums in registers, in order of i. */
ALWAYS_INLINE void rows_product(const float *a, int64_t a_stride, const void *const *b_rows, int64_t col, float *c,
                                int64_t c_stride, const int R, const int CV, int64_t n, const int bytes,
                                const int fp8_shift) {
    vec acc[REGISTERS];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < CV; v++) acc[r * CV + v] = load(c + r * c_stride + v * LANES);
    for (int64_t i = 0; i < n; i++) {
        vec x[VALUE_VECTORS];
        for (int v = 0; v < CV; v++) x[v] = load_widened(b_rows[i], col + v * LANES, bytes, fp8_shift);
        for (int r = 0; r < R; r++) {
            const vec broadcast = (vec){0} + a[r * a_stride + i];
            for (int v = 0; v < CV; v++) acc[r * CV + v] += broadcast * x[v];
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < CV; v++) store(c + r * c_stride + v * LANES, acc[r * CV + v]);
}

/* Rows of CV vectors, value rows of BYTES an element: blocks of as many rows as leave a register for the
   value row and one for p. */
#define VALUE_ROWS(CV, BYTES)                                                                              \
    static void values_rows_##CV##_##BYTES(const float *p, const void *const *v_rows, int64_t col, float *o, \
                                          int64_t rows, int64_t keys, int64_t stride, int fp8_shift) {     \
        enum { block = (REGISTERS - CV - 1) / CV };                                                        \
        int64_t r = 0;                                                                                     \
        for (; r + block <= rows; r += block) VALUES(block, CV, BYTES);                                    \
        REMAINING_ROWS(block, VALUES_##CV##_##BYTES);                                                      \
    }
#define VALUES(R, CV, BYTES) \
    rows_product(p + r * KEYS, KEYS, v_rows, col, o + r * stride + col, stride, R, CV, keys, BYTES, fp8_shift)
#define VALUES_1_4(R) VALUES(R, 1, 4)
#define VALUES_2_4(R) VALUES(R, 2, 4)
#define VALUES_4_4(R) VALUES(R, 4, 4)
#define VALUES_1_2(R) VALUES(R, 1, 2)
#define VALUES_2_2(R) VALUES(R, 2, 2)
#define VALUES_4_2(R) VALUES(R, 4, 2)
#define VALUES_1_1(R) VALUES(R, 1, 1)
#define VALUES_2_1(R) VALUES(R, 2, 1)
#define VALUES_4_1(R) VALUES(R, 4, 1)
VALUE_ROWS(1, 4)
VALUE_ROWS(2, 4)
VALUE_ROWS(4, 4)
VALUE_ROWS(1, 2)
VALUE_ROWS(2, 2)
VALUE_ROWS(4, 2)
VALUE_ROWS(1, 1)
VALUE_ROWS(2, 1)
VALUE_ROWS(4, 1)
#undef VALUES

/* The value product of `rows` rows of dv vectors, in blocks of columns of at most VALUE_VECTORS; value
   rows of `bytes` an element. */
static void values_rows(const float *p, const void *const *v_rows, float *o, int64_t rows, int64_t keys, int64_t dv,
                        int bytes, int fp8_shift) {
    const int64_t stride = dv * LANES;
#define COLUMNS(BYTES, SHIFT)                                                                                 \
    do {                                                                                                        \
        for (int64_t c0 = 0; c0 < dv; c0 += VALUE_VECTORS) {                                                    \
            switch (dv - c0 < VALUE_VECTORS ? dv - c0 : VALUE_VECTORS) { /* dv: a power of two */               \
                case 1: values_rows_1_##BYTES(p, v_rows, c0 * LANES, o, rows, keys, stride, SHIFT); break;      \
                case 2: values_rows_2_##BYTES(p, v_rows, c0 * LANES, o, rows, keys, stride, SHIFT); break;      \
                default: values_rows_4_##BYTES(p, v_rows, c0 * LANES, o, rows, keys, stride, SHIFT); break;     \
            }                                                                                                   \
        }                                                                                                       \
    } while (0)
    WITH_CACHE_BYTES(COLUMNS, bytes, fp8_shift);
#undef COLUMNS
}

/* The cache slots of a sequence's positions [t0, t0 + count) (its block-table row `table`), -1 for the
   rest of the tile. */
ALWAYS_INLINE void tile_slots(int64_t *slots, const int64_t *table, int64_t t0, int64_t count, int64_t block_size) {
    int64_t block = t0 / block_size, offset = t0 % block_size;
    for (int64_t j = 0; j < KEYS; j++) {
        slots[j] = j < count ? table[block] * block_size + offset : -1;
        if (++offset == block_size) offset = 0, block++;
    }
}

/* What a tile's rows past the sequence's end read: zeros (a head of at most 256 float32s). Their scores
   are masked and the value product stops before them (a NaN here changes no test's result). */
static const float zero_row[256];

/* Where KV head h's keys and values of those slots start; zero_row where there is no slot (every row
   a pointer to read: the loads need no branches). */
ALWAYS_INLINE void tile_rows(const void **k_rows, const void **v_rows, const int64_t *slots, const void *key_cache,
                             const void *value_cache, int64_t h, int64_t num_kv_heads, int64_t head_dim,
                             const int bytes) {
    for (int64_t j = 0; j < KEYS; j++) {
        const int64_t offset = (slots[j] * num_kv_heads + h) * head_dim * bytes;
        k_rows[j] = slots[j] < 0 ? (const void *)zero_row : (const char *)key_cache + offset;
        v_rows[j] = slots[j] < 0 ? (const void *)zero_row : (const char *)value_cache + offset;
    }
}

typedef int32_t lane_index __attribute__((vector_size(LANES * sizeof(int32_t))));

/* The lanes of a transposition's step of b: pairs of rows (i, i + b) swap their off-diagonal blocks of b
   lanes; `low` picks row i's new lanes from (row i, row i + b), `high` row i + b's. */
#define LOW_LANE(l, b) ((l) & (b) ? LANES + (l) - (b) : (l))
#define HIGH_LANE(l, b) ((l) & (b) ? LANES + (l) : (l) + (b))
#if LANES == 16
#define LANE_LIST(F, b) \
    {F(0, b), F(1, b), F(2, b), F(3, b), F(4, b), F(5, b), F(6, b), F(7, b), \
     F(8, b), F(9, b), F(10, b), F(11, b), F(12, b), F(13, b), F(14, b), F(15, b)}
#else
#define LANE_LIST(F, b) {F(0, b), F(1, b), F(2, b), F(3, b), F(4, b), F(5, b), F(6, b), F(7, b)}
#endif

ALWAYS_INLINE void transpose_step(vec r[LANES], const int b, const lane_index low, const lane_index high) {
    for (int i = 0; i < LANES; i++)
        if (!(i & b)) {
            const vec a = r[i], c = r[i + b];
            r[i] = __builtin_shuffle(a, c, low);
            r[i + b] = __builtin_shuffle(a, c, high);
        }
}

/* r[i][l] becomes r[l][i]. */
ALWAYS_INLINE void transpose(vec r[LANES]) {
#if LANES == 16
    transpose_step(r, 8, (lane_index)LANE_LIST(LOW_LANE, 8), (lane_index)LANE_LIST(HIGH_LANE, 8));
#endif
    transpose_step(r, 4, (lane_index)LANE_LIST(LOW_LANE, 4), (lane_index)LANE_LIST(HIGH_LANE, 4));
    transpose_step(r, 2, (lane_index)LANE_LIST(LOW_LANE, 2), (lane_index)LANE_LIST(HIGH_LANE, 2));
    transpose_step(r, 1, (lane_index)LANE_LIST(LOW_LANE, 1), (lane_index)LANE_LIST(HIGH_LANE, 1));
}

/* LANES keys (their rows from k_rows) by LANES dimensions from d0 (zeros past head_dim), transposed:
   t[i] holds dimension d0 + i of each key. */
ALWAYS_INLINE void transposed_keys(vec t[LANES], const void *const *k_rows, int64_t d0, int64_t head_dim,
                                   const int bytes, const int fp8_shift) {
    if (d0 + LANES <= head_dim) {
        for (int l = 0; l < LANES; l++) t[l] = load_widened(k_rows[l], d0, bytes, fp8_shift);
    } else {
        for (int l = 0; l < LANES; l++) {
            float x[LANES];
            for (int i = 0; i < LANES; i++)
                x[i] = d0 + i < head_dim ? element(k_rows[l], d0 + i, bytes, fp8_shift) : 0.0f;
            t[l] = load(x);
        }
    }
    transpose(t);
}

/* The tile's keys (k_rows) transposed into kt ([dp][KEYS]), widened to float32, zeros past head_dim. */
ALWAYS_INLINE void pack_keys(float *kt, const void *const *k_rows, int64_t head_dim, int64_t dp, const int bytes,
                             const int fp8_shift) {
    for (int64_t j0 = 0; j0 < KEYS; j0 += LANES)
        for (int64_t d0 = 0; d0 < dp; d0 += LANES) {
            vec t[LANES];
            transposed_keys(t, k_rows + j0, d0, head_dim, bytes, fp8_shift);
            for (int l = 0; l < LANES; l++) store(kt + (d0 + l) * KEYS + j0, t[l]);
        }
}

/* The tile's values (v_rows) widened into v ([KEYS][dp], zeros past head_dim). */
ALWAYS_INLINE void pack_values(float *v, const void *const *v_rows, int64_t head_dim, int64_t dp, const int bytes,
                               const int fp8_shift) {
    for (int64_t j = 0; j < KEYS; j++) {
        float *row = v + j * dp;
        for (int64_t d = 0; d < head_dim; d++) row[d] = element(v_rows[j], d, bytes, fp8_shift);
        memset(row + head_dim, 0, sizeof(float) * (size_t)(dp - head_dim));
    }
}

/* The query rows of `m` positions from token row `token`, the `group` query heads of KV head h, scaled
   into q ([m x group][dp], zero-padded); their sums o zeroed, their running max and sum started (a sink
   counts as a key whose value is zero). */
static void begin_rows(const float *query, int64_t q_stride, int64_t token, int64_t m, int64_t h, int64_t group,
                       int64_t head_dim, int64_t dp, float scale, const float *sinks, float *q, float *o,
                       float *row_max, float *row_sum) {
    const int64_t rows = m * group;
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < group; g++) {
            const float *src = query + (token + i) * q_stride + (h * group + g) * head_dim;
            float *dst = q + (i * group + g) * dp;
            for (int64_t d = 0; d < head_dim; d++) dst[d] = src[d] * scale;
            for (int64_t d = head_dim; d < dp; d++) dst[d] = 0.0f;
        }
    memset(o, 0, sizeof(float) * rows * dp);
    for (int64_t r = 0; r < rows; r++) {
        row_max[r] = sinks ? sinks[h * group + r % group] : -INFINITY;
        row_sum[r] = sinks ? 1.0f : 0.0f;
    }
}

/* One tile's softmax and value product, its scores s ([rows][KEYS]) computed: rows of positions
   first + r / group, the tile's key 0 at position t0 (key k is visible to the query at p when k <= p and,
   with a window, p - k < window), its value rows at v_rows (of `bytes` an element). Not inlined, nor
   specialized to its callers: both kernels run this one compiled function, vector exponentials and their
   sums included, so that a row's bits do not depend on the kernel. */
__attribute__((noipa)) static void softmax_values(float *s, const void *const *v_rows, int bytes, int fp8_shift,
                                                  float *o, float *row_max, float *row_sum, int64_t rows,
                                                  int64_t group, int64_t first, int64_t t0, int64_t window,
                                                  float softcap, int64_t dp) {
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
    values_rows(s, v_rows, o, rows, keys, dp / LANES, bytes, fp8_shift);
}

/* The rows begun by begin_rows, normalized into out. */
static void end_rows(const float *o, const float *row_sum, int64_t q_stride, int64_t token, int64_t m, int64_t h,
                     int64_t group, int64_t head_dim, int64_t dp, float *out) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < group; g++) {
            const int64_t r = i * group + g;
            const float inverse = 1.0f / row_sum[r];
            float *dst = out + (token + i) * q_stride + (h * group + g) * head_dim;
            for (int64_t d = 0; d < head_dim; d++) dst[d] = o[r * dp + d] * inverse;
        }
}

#endif
