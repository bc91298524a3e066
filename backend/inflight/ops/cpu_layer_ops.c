/* The small operations of a Llama-family decoder layer on a CPU, float32, each one call instead of the
   six to twelve torch operations transformers' modules run (fused_layers.py swaps them in): RMSNorm,
   the residual add with the RMSNorm after it, the rotary embedding of queries and keys, and SiLU of the
   gate times the up projection. In a decode step of 48 sequences of the default model those operations
   were ~8 ms of a 74 ms step, most of it the per-operation cost of eager torch, not arithmetic.

   Built and loaded by cpu_kernels.py; without contracting multiplies and adds into FMAs, so that the
   rotary embedding equals transformers' float32 result exactly (a multiply rounds before the add there
   too). Rows are split over torch's OpenMP threads once a call is large enough to pay for waking them. */

#include "cpu_kernels.h"

/* Below this many elements a call runs on the calling thread. */
#define PARALLEL_ELEMENTS (1 << 16)

/* Llama's RMSNorm of one row: the mean of squares in float32, then weight * (x * 1/sqrt(mean + eps)). */
static inline void norm_row(const float *x, const float *weight, float *out, int64_t n, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    const float inverse = 1.0f / sqrtf(sum / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = weight[i] * (x[i] * inverse);
}

/* x: `rows` rows of n, `x_stride` apart; out: contiguous. */
void rms_norm(const float *x, int64_t x_stride, const float *weight, float *out, int64_t rows, int64_t n, float eps,
              int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * x_stride, weight, out + r * n, n, eps);
}

/* total = x + residual, out = RMSNorm(total); total and out contiguous. */
void add_rms_norm(const float *x, int64_t x_stride, const float *residual, int64_t residual_stride,
                  const float *weight, float *total, float *out, int64_t rows, int64_t n, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride, *rr = residual + r * residual_stride;
        float *tr = total + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) tr[i] = xr[i] + rr[i];
        norm_row(tr, weight, out + r * n, n, eps);
    }
}

/* out[t, h] = x[t, h] * cos[t] + rotate_half(x[t, h]) * sin[t], rotate_half(x) = (-x2, x1) for the two
   halves of the head; x at (token_stride, head_stride) with unit stride along the head dimension;
   cos, sin: [tokens, head_dim] contiguous; out: [tokens, heads, head_dim] contiguous. */
static void rotate(const float *x, int64_t token_stride, int64_t head_stride, int64_t heads, const float *cos,
                   const float *sin, float *out, int64_t tokens, int64_t head_dim, int threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(threads) if (tokens * heads * head_dim >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xr = x + t * token_stride + h * head_stride;
            float *o = out + (t * heads + h) * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) o[i] = xr[i] * c[i] + (-xr[i + half]) * s[i];
#pragma omp simd
            for (int64_t i = half; i < head_dim; i++) o[i] = xr[i] * c[i] + xr[i - half] * s[i];
        }
    }
}

void rotary(const float *q, int64_t q_token_stride, int64_t q_head_stride, int64_t q_heads, const float *k,
            int64_t k_token_stride, int64_t k_head_stride, int64_t k_heads, const float *cos, const float *sin,
            float *q_out, float *k_out, int64_t tokens, int64_t head_dim, int threads) {
    rotate(q, q_token_stride, q_head_stride, q_heads, cos, sin, q_out, tokens, head_dim, threads);
    rotate(k, k_token_stride, k_head_stride, k_heads, cos, sin, k_out, tokens, head_dim, threads);
}

/* out = silu(gate) * up, silu(g) = g / (1 + exp(-g)); gate and up rows `*_stride` apart, out contiguous. */
void silu_mul(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride, float *out, int64_t rows,
              int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * gate_stride, *u = up + r * up_stride;
        float *o = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
