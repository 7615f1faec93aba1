/* The model's elementwise and per-row operations on x86-64 CPUs (AVX2 + FMA), float32: one call per tensor
 * where torch needs several passes (and several dispatches) for the same expression.
 *
 *   pd_rotary        neox-style rotary embedding: the torch expression's operations in its order, each rounded
 *                    once, so its bits (x * cos + cat(-x2, x1) * sin); a NaN result is NaN, its sign bit not
 *                    matched
 *   pd_rms_norm      y = w * (x * (1 / sqrt(mean(x^2) + eps))), HF's expression; only the sum of squares is
 *                    computed differently from torch's reduction (in double, rounded once: the float nearest
 *                    the exact sum), in a fixed order per row, so a row's bits do not depend on the other rows
 *   pd_silu_and_mul  y = silu(g) * u with silu(g) = g / (1 + exp(-g)); exp is cpu_vec.h's (~1 ulp)
 *   pd_write_kv      the step's new K and V rows into a float32 paged cache at their slots: copies, so the bits
 *                    of torch's index_copy_ (kernels/reference.py: write_to_cache), in one pass per tensor
 *
 * Built with -ffp-contract=off: no multiply is fused into an add unless an intrinsic says so (exp's polynomial).
 * Rows are x_stride floats apart (column slices of a fused projection); outputs are contiguous.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* sum of x[0..D)^2 in double: each square is exact there and the sum's error stays far below a float ulp at
 * any D, so the result is the float nearest the exact sum (torch's cascade sum is within ~3 ulp of it).  Four
 * lanes; 4-float chunks in order; the lanes are added ((l0 + l1) + (l2 + l3)); the D % 4 tail is added last.
 * R rows at once, each its own chain in that order (the same bits): one row's chain of dependent adds left the
 * adder idle (a 2048 x 256 step, Zen 3: 0.24 ms) */
#define SUMSQ_ROWS 4
INLINE void sum_squares_rows(const float *const xr[], int R, int D, float out[]) {
    __m256d acc[SUMSQ_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_pd();
    int d = 0;
    for (; d + 4 <= D; d += 4)
        for (int r = 0; r < R; r++) {
            __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(xr[r] + d));
            acc[r] = _mm256_add_pd(acc[r], _mm256_mul_pd(v, v));
        }
    for (int r = 0; r < R; r++) {
        __m128d h = _mm_add_pd(_mm256_castpd256_pd128(acc[r]), _mm256_extractf128_pd(acc[r], 1));
        double sum = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
        for (int t = d; t < D; t++)
            sum += (double)xr[r][t] * (double)xr[r][t];
        out[r] = (float)sum;
    }
}

/* x: rows of D floats, x_stride apart; w: [D]; y: [rows, D] */
int pd_rms_norm(const float *x, int64_t x_stride, const float *w, float *y, int64_t rows, int D, float eps) {
    if (D <= 0 || rows < 0) return 1;
    for (int64_t r0 = 0; r0 < rows; r0 += SUMSQ_ROWS) {
        int R = rows - r0 < SUMSQ_ROWS ? (int)(rows - r0) : SUMSQ_ROWS;
        const float *xs[SUMSQ_ROWS];
        float sums[SUMSQ_ROWS];
        for (int i = 0; i < R; i++) xs[i] = x + (r0 + i) * x_stride;
        sum_squares_rows(xs, R, D, sums);
        for (int i = 0; i < R; i++) {
            const float *xr = xs[i];
            float *yr = y + (r0 + i) * D;
            float mean = sums[i] / (float)D;
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
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- silu and mul */

/* silu(g) = g / (1 + exp(-g)).  exp8 saturates at 88.3 (its 2^n must stay a normal float), so above 88 exp(-g)
 * is exp(-g / 2)^2 (~2 ulp), which also overflows to +inf past 88.72 as float's exp does: the result is -0 */
INLINE __m256 silu8(__m256 g) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    __m256 ng = _mm256_xor_ps(g, sign), e = exp8(ng);
    __m256 big = _mm256_cmp_ps(ng, _mm256_set1_ps(88.0f), _CMP_GT_OQ);
    if (_mm256_movemask_ps(big)) {          /* (rare: the second exp only where a lane needs it) */
        __m256 half = exp8(_mm256_mul_ps(ng, _mm256_set1_ps(0.5f)));
        e = _mm256_blendv_ps(e, _mm256_mul_ps(half, half), big);
    }
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

/* -------------------------------------------------------------------------------------------- KV write */

/* row t of k and of v (row_elems floats each, k_stride / v_stride apart) to flat slot slots[t] of kc and vc
 * ([num_slots, row_elems]); a negative slot is a padding row, skipped.  Every slot is checked before anything is
 * written: 2 = a slot past the cache, and the cache is untouched. */
int pd_write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, const int64_t *slots, int64_t T,
                float *kc, float *vc, int64_t row_elems, int64_t num_slots) {
    if (T < 0 || row_elems <= 0) return 1;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= num_slots) return 2;
    size_t bytes = (size_t)row_elems * sizeof(float);
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        memcpy(kc + slots[t] * row_elems, k + t * k_stride, bytes);
        memcpy(vc + slots[t] * row_elems, v + t * v_stride, bytes);
    }
    return 0;
}
