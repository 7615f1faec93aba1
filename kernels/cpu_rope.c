/* Rotary position embedding, neox style (rotate_half), on x86-64 CPUs (AVX2): one call per tensor.
 *
 *     out[t, h, :D/2] = x1 * cos[t, :D/2] + (-x2) * sin[t, :D/2]
 *     out[t, h, D/2:] = x2 * cos[t, D/2:] +   x1  * sin[t, D/2:]        x1 = x[t, h, :D/2], x2 = x[t, h, D/2:]
 *
 * The same operations, in the same order and each rounded once, as the torch expression it replaces
 * (``x * cos + cat(-x2, x1) * sin``, engine/models/rope.py), so the bits are the same; built with
 * -ffp-contract=off so the compiler fuses no multiply into the add.  x: rows of nh heads x D floats,
 * heads contiguous, rows x_stride floats apart (q and k are column slices of the qkv output); out, cos and
 * sin are contiguous.  D must be even.
 */
#include <immintrin.h>
#include <stdint.h>

static void rotate_head(const float *x, float *o, const float *c, const float *s, int half) {
    int d = 0;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (; d + 8 <= half; d += 8) {
        __m256 x1 = _mm256_loadu_ps(x + d), x2 = _mm256_loadu_ps(x + half + d);
        __m256 a = _mm256_mul_ps(x1, _mm256_loadu_ps(c + d));
        __m256 b = _mm256_mul_ps(_mm256_xor_ps(x2, sign), _mm256_loadu_ps(s + d));
        _mm256_storeu_ps(o + d, _mm256_add_ps(a, b));
        a = _mm256_mul_ps(x2, _mm256_loadu_ps(c + half + d));
        b = _mm256_mul_ps(x1, _mm256_loadu_ps(s + half + d));
        _mm256_storeu_ps(o + half + d, _mm256_add_ps(a, b));
    }
    for (; d < half; d++) {
        float x1 = x[d], x2 = x[half + d];
        o[d] = x1 * c[d] + (-x2) * s[d];
        o[half + d] = x2 * c[half + d] + x1 * s[half + d];
    }
}

int pd_rotary(const float *x, int64_t x_stride, float *out, const float *cos, const float *sin, int64_t T, int nh,
              int D) {
    if (D <= 0 || D % 2 || nh <= 0 || T < 0) return 1;
    for (int64_t t = 0; t < T; t++)
        for (int h = 0; h < nh; h++)
            rotate_head(x + t * x_stride + (int64_t)h * D, out + (t * nh + h) * D, cos + t * D, sin + t * D, D / 2);
    return 0;
}
