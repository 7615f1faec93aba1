/* Few-row fp32 matmuls on AVX-512 CPUs: y = x W^T for the 1-32 rows of a decode step, streaming W once.
 *
 * oneDNN reads W for such a step at 5-8 GB/s (its kernels are made for many rows); this one keeps each 16
 * outputs' weights as one contiguous panel, [N / 16][K][16] (made once by the loader), and runs 8 rows x 32
 * outputs a tile: per k, two panel vectors loaded (the next panels asked for into L2), each row's x[k]
 * broadcast, 16 FMAs.
 *
 * Bits: the sum for y[m, n] is the one oneDNN's fp32 kernels compute -- K split into blocks of kb (the caller
 * finds kb by comparing with oneDNN, kernels/cpu_linear.py), each block one FMA chain over k in order from 0,
 * the blocks' sums added in order -- and it depends on nothing but row m of x and the weights: not on M, not
 * on the tile.  Built with -ffp-contract=off; every FMA is an explicit intrinsic.
 */
#include <immintrin.h>
#include <stdint.h>

#define INLINE static inline __attribute__((always_inline))
#define MT 8            /* rows a tile */
#define NV 2            /* 16-output panels a tile */

/* rows [0, mt) of x (x_stride apart) against nv panels: y[m, 0 .. 16 nv) (y_stride apart) */
INLINE void tile(const float *x, int64_t x_stride, const float *wp, int64_t panel, float *y, int64_t y_stride,
                 const int mt, const int nv, int K, int kb) {
    for (int k0 = 0; k0 < K; k0 += kb) {
        int k1 = k0 + kb < K ? k0 + kb : K;
        __m512 acc[MT][NV];
        for (int m = 0; m < mt; m++)
            for (int v = 0; v < nv; v++) acc[m][v] = _mm512_setzero_ps();
        for (int k = k0; k < k1; k++) {
            __m512 w[NV];
            for (int v = 0; v < nv; v++) {
                w[v] = _mm512_loadu_ps(wp + v * panel + (int64_t)k * 16);
                _mm_prefetch((const char *)(wp + (nv + v) * panel + (int64_t)k * 16), _MM_HINT_T1);
            }
            for (int m = 0; m < mt; m++) {
                __m512 xk = _mm512_set1_ps(x[m * x_stride + k]);
                for (int v = 0; v < nv; v++) acc[m][v] = _mm512_fmadd_ps(xk, w[v], acc[m][v]);
            }
        }
        for (int m = 0; m < mt; m++)
            for (int v = 0; v < nv; v++) {
                float *o = y + m * y_stride + v * 16;
                _mm512_storeu_ps(o, k0 == 0 ? acc[m][v] : _mm512_add_ps(_mm512_loadu_ps(o), acc[m][v]));
            }
    }
}

/* tile with mt and nv constants (the accumulators stay in registers) */
#define ROWS(NVC)                                                                                        \
    switch (mt) {                                                                                        \
    case 1: tile(x, x_stride, wp, panel, y, y_stride, 1, NVC, K, kb); break;                            \
    case 2: tile(x, x_stride, wp, panel, y, y_stride, 2, NVC, K, kb); break;                            \
    case 3: tile(x, x_stride, wp, panel, y, y_stride, 3, NVC, K, kb); break;                            \
    case 4: tile(x, x_stride, wp, panel, y, y_stride, 4, NVC, K, kb); break;                            \
    case 5: tile(x, x_stride, wp, panel, y, y_stride, 5, NVC, K, kb); break;                            \
    case 6: tile(x, x_stride, wp, panel, y, y_stride, 6, NVC, K, kb); break;                            \
    case 7: tile(x, x_stride, wp, panel, y, y_stride, 7, NVC, K, kb); break;                            \
    default: tile(x, x_stride, wp, panel, y, y_stride, 8, NVC, K, kb); break;                           \
    }

static void tile_any(const float *x, int64_t x_stride, const float *wp, int64_t panel, float *y, int64_t y_stride,
                     int mt, int nv, int K, int kb) {
    if (nv == 2) ROWS(2) else ROWS(1)
}

/* x: [M, K] rows x_stride apart; wp: W [N, K] as panels [N / 16][K][16]; y: [M, N] contiguous.
 * 1 = bad shape (N not a multiple of 16, kb < 1) */
int pd_skinny_linear(const float *x, int64_t x_stride, const float *wp, float *y, int M, int N, int K, int kb) {
    if (M < 0 || N <= 0 || N % 16 || K <= 0 || kb < 1) return 1;
    int64_t panel = (int64_t)K * 16;
    for (int n0 = 0; n0 < N;) {
        int nv = N - n0 >= 16 * NV ? NV : 1;
        for (int m0 = 0; m0 < M; m0 += MT)
            tile_any(x + (int64_t)m0 * x_stride, x_stride, wp + (int64_t)(n0 / 16) * panel, panel,
                     y + (int64_t)m0 * N + n0, N, M - m0 < MT ? M - m0 : MT, nv, K, kb);
        n0 += 16 * nv;
    }
    return 0;
}
