/* What the CPU kernels share. Each .c file beside it includes it; cpu_kernels.py hashes it into every
   library's cache key, so that a change here rebuilds them all. */

#ifndef INFLIGHT_CPU_KERNELS_H
#define INFLIGHT_CPU_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GLIBC__)
/* glibc's vector expf (libmvec), which <math.h> declares only under -ffast-math. That flag is not used:
   in a shared library, GCC before 13 links a constructor that turns on flush-to-zero for the thread
   that loads it, which would change every later float operation of the engine. */
#pragma omp declare simd notinbranch
float expf(float);
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Element d of a cache row, widened to float32. `bytes`, the element's size, is a constant at every call
   site of the decode kernel, so each compiles to one of the three loads: a float32; a bfloat16 (the top
   half of a float32); an fp8 byte (kv_cache_dtype; `fp8_shift` 20 for e4m3, 21 for e5m2): its exponent and
   mantissa shifted into a float32's bits make its value times 2^(bias - 127), a normal or a subnormal
   float as the byte is (no table, no branch: vector code), which one multiply scales back. */
ALWAYS_INLINE float element(const void *row, int64_t d, const int bytes, const int fp8_shift) {
    if (bytes == 4) return ((const float *)row)[d];
    if (bytes == 1) {
        const uint32_t byte = ((const uint8_t *)row)[d];
        const uint32_t bits = (byte & 0x80u) << 24 | (byte & 0x7Fu) << fp8_shift;
        float value;
        memcpy(&value, &bits, sizeof value);
        return value * (fp8_shift == 20 ? 0x1p120f : 0x1p112f);
    }
    const uint32_t bits = (uint32_t)((const uint16_t *)row)[d] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* s[j] = softcap * tanh(s[j] / softcap) for j in [from, to): a model's softcap (Gemma 2), through the vector
   expf (tanh(x) = 1 - 2 / (exp(2x) + 1)) rather than a scalar tanhf. */
ALWAYS_INLINE void apply_softcap(float *s, int64_t from, int64_t to, float softcap) {
    const float twice_inverse = 2.0f / softcap, twice = 2.0f * softcap;
#pragma omp simd
    for (int64_t j = from; j < to; j++) s[j] = softcap - twice / (expf(s[j] * twice_inverse) + 1.0f);
}

#endif
