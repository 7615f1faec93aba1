/* The model's elementwise and per-row operations on x86-64 CPUs (AVX2 + FMA), float32: one call per tensor
 * where torch needs several passes (and several dispatches) for the same expression.
 *
 *   pd_rotary        neox-style rotary embedding: the torch expression's operations in its order, each rounded
 *                    once, so its bits (x * cos + cat(-x2, x1) * sin)
 *   pd_rms_norm      y = w * (x * (1 / sqrt(mean(x^2) + eps))), HF's expression; only the sum of squares is
 *                    ordered differently from torch's reduction (a fixed order per row: 4 accumulators of 8
 *                    lanes, then a fixed tree), so a row's bits do not depend on the other rows
 *   pd_silu_and_mul  y = silu(g) * u with silu(g) = g / (1 + exp(-g)); exp is cpu_vec.h's (~1 ulp)
 *
 * Built with -ffp-contract=off: no multiply is fused into an add unless an intrinsic says so (exp's polynomial).
 * Rows are x_stride floats apart (column slices of a fused projection); outputs are contiguous.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "cpu_vec.h"

/* ---------------------------------------------------------------------------------------------- rotary */

/* x1 = x[:D/2], x2 = x[D/2:]:  o[:D/2] = x1 c1 + (-x2) s1,  o[D/2:] = x2 c2 + x1 s2 */
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

/* x: T rows of nh heads x D (heads contiguous); cos, sin: [T, D]; out: [T, nh, D] */
int pd_rotary(const float *x, int64_t x_stride, float *out, const float *cos, const float *sin, int64_t T, int nh,
              int D) {
    if (D <= 0 || D % 2 || nh <= 0 || T < 0) return 1;
    for (int64_t t = 0; t < T; t++)
        for (int h = 0; h < nh; h++)
            rotate_head(x + t * x_stride + (int64_t)h * D, out + (t * nh + h) * D, cos + t * D, sin + t * D, D / 2);
    return 0;
}

/* ------------------------------------------------------------------------------------------- rms norm */

/* sum of x[0..D)^2: x^2 rounded, then added; 8-float chunks go round-robin to 4 vector accumulators, which
 * are added ((a0 + a1) + (a2 + a3)) and reduced over lanes in a fixed tree; the D % 8 tail is added last */
static float sum_squares(const float *x, int D) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int d = 0;
    for (int i = 0; d + 8 <= D; d += 8, i = (i + 1) & 3) {
        __m256 v = _mm256_loadu_ps(x + d);
        acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(v, v));
    }
    __m256 t = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    float sum = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    for (; d < D; d++) {
        float sq = x[d] * x[d];
        sum = sum + sq;
    }
    return sum;
}

/* x: rows of D floats, x_stride apart; w: [D]; y: [rows, D] */
int pd_rms_norm(const float *x, int64_t x_stride, const float *w, float *y, int64_t rows, int D, float eps) {
    if (D <= 0 || rows < 0) return 1;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *yr = y + r * D;
        float mean = sum_squares(xr, D) / (float)D;
        float inv = 1.0f / sqrtf(mean + eps);
        __m256 vinv = _mm256_set1_ps(inv);
        int d = 0;
        for (; d + 8 <= D; d += 8)
            _mm256_storeu_ps(yr + d, _mm256_mul_ps(_mm256_loadu_ps(w + d), _mm256_mul_ps(_mm256_loadu_ps(xr + d), vinv)));
        for (; d < D; d++) {
            float h = xr[d] * inv;
            yr[d] = w[d] * h;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- silu and mul */

/* silu(g) = g / (1 + exp(-g)); where exp(-g) overflows float (-g > 88.72) it is +inf, as in torch, and the
 * result is -0 (exp8 itself saturates near there) */
INLINE __m256 silu8(__m256 g) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    __m256 ng = _mm256_xor_ps(g, sign), e = exp8(ng);
    e = _mm256_blendv_ps(e, _mm256_set1_ps(__builtin_inff()), _mm256_cmp_ps(ng, _mm256_set1_ps(88.72283f), _CMP_GT_OQ));
    return _mm256_div_ps(g, _mm256_add_ps(one, e));
}

/* gu: rows of [gate (I floats) | up (I floats)], gu_stride apart; y: [rows, I] */
int pd_silu_and_mul(const float *gu, int64_t gu_stride, float *y, int64_t rows, int I) {
    if (I <= 0 || rows < 0) return 1;
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * gu_stride, *u = g + I;
        float *yr = y + r * (int64_t)I;
        int i = 0;
        for (; i + 8 <= I; i += 8) {
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
        }
        if (i < I) {                         /* the tail through the same vector code: lanes past I are unused */
            float gt[8] = {0}, ut[8] = {0}, yt[8];
            for (int j = 0; i + j < I; j++) { gt[j] = g[i + j]; ut[j] = u[i + j]; }
            _mm256_storeu_ps(yt, _mm256_mul_ps(silu8(_mm256_loadu_ps(gt)), _mm256_loadu_ps(ut)));
            for (int j = 0; i + j < I; j++) yr[i + j] = yt[j];
        }
    }
    return 0;
}
