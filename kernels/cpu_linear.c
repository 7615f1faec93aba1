/* Few-row fp32 matmuls: y = x W^T for the 1-32 rows of a decode step, streaming W once.
 *
 * oneDNN reads W for such a step at 5-8 GB/s (its kernels are made for many rows); this one keeps each VW
 * outputs' weights as one contiguous panel, [ceil(N / VW)][K][VW] (made once by the loader; the last panel's
 * missing outputs are zeros, never stored), and runs MT rows x 2 panels a tile: per k, two panel vectors loaded
 * (the next panels asked for into L2), each row's x[k] broadcast, 2 MT FMAs.  Built twice: AVX-512 (VW 16,
 * MT 8) where the CPU has it, else AVX2 (VW 8, MT 6: 12 accumulators, 2 weights and a broadcast in 16 ymm).
 *
 * Bits: the sum for y[m, n] is the one oneDNN's fp32 kernels compute -- K split into blocks of kb (the caller
 * finds kb by comparing with oneDNN, kernels/cpu_linear.py), each block one FMA chain over k in order from 0,
 * the blocks' sums added in order -- and it depends on nothing but row m of x and the weights: not on M, not
 * on the tile, not on VW (the vector runs across outputs, never along the sum), so both builds give the same
 * bits.  Built with -ffp-contract=off; every FMA is an explicit intrinsic.
 */
#include <immintrin.h>
#include <stdint.h>

#define INLINE static inline __attribute__((always_inline))
#define NV 2            /* panels a tile */

#ifdef __AVX512F__
#define VW 16
#define MT 8
typedef __m512 vec;
#define vzero _mm512_setzero_ps
#define vset1 _mm512_set1_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vfma _mm512_fmadd_ps
#define vadd _mm512_add_ps
/* the first n lanes: loaded (the rest zero) or stored (the rest of memory untouched) */
INLINE vec vload_n(const float *p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
INLINE void vstore_n(float *p, vec v, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v); }
#else
#define VW 8
#define MT 6
typedef __m256 vec;
#define vzero _mm256_setzero_ps
#define vset1 _mm256_set1_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vfma _mm256_fmadd_ps
#define vadd _mm256_add_ps
INLINE __m256i first_lanes(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
INLINE vec vload_n(const float *p, int n) { return _mm256_maskload_ps(p, first_lanes(n)); }
INLINE void vstore_n(float *p, vec v, int n) { _mm256_maskstore_ps(p, first_lanes(n), v); }
#endif

/* a block's sums into y[0 .. cols): stored (the first block) or added to the earlier blocks' */
INLINE void put(float *o, vec acc, int cols, int first) {
    if (cols == VW)
        vstore(o, first ? acc : vadd(vload(o), acc));
    else
        vstore_n(o, first ? acc : vadd(vload_n(o, cols), acc), cols);
}

/* rows [0, mt) of x (x_stride apart) against nv panels: y[m, 0 .. VW (nv - 1) + last) (y_stride apart) */
INLINE void tile(const float *x, int64_t x_stride, const float *wp, int64_t panel, float *y, int64_t y_stride,
                 const int mt, const int nv, int last, int K, int kb) {
    for (int k0 = 0; k0 < K; k0 += kb) {
        int k1 = k0 + kb < K ? k0 + kb : K;
        vec acc[MT][NV];
        for (int m = 0; m < mt; m++)
            for (int v = 0; v < nv; v++) acc[m][v] = vzero();
        for (int k = k0; k < k1; k++) {
            vec w[NV];
            for (int v = 0; v < nv; v++) {
                w[v] = vload(wp + v * panel + (int64_t)k * VW);
                _mm_prefetch((const char *)(wp + (nv + v) * panel + (int64_t)k * VW), _MM_HINT_T1);
            }
            for (int m = 0; m < mt; m++) {
                vec xk = vset1(x[m * x_stride + k]);
                for (int v = 0; v < nv; v++) acc[m][v] = vfma(xk, w[v], acc[m][v]);
            }
        }
        for (int m = 0; m < mt; m++)
            for (int v = 0; v < nv; v++)
                put(y + m * y_stride + v * VW, acc[m][v], v == nv - 1 ? last : VW, k0 == 0);
    }
}

/* tile with mt and nv constants (the accumulators stay in registers); cases above MT are never taken */
#define ROW(C) case C: tile(x, x_stride, wp, panel, y, y_stride, C < MT ? C : MT, NVC, last, K, kb); break;
#define ROWS(NVC_)                                                                                       \
    {                                                                                                    \
        enum { NVC = NVC_ };                                                                             \
        switch (mt) {                                                                                    \
        ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7)                                                 \
        default: tile(x, x_stride, wp, panel, y, y_stride, MT, NVC, last, K, kb);                        \
        }                                                                                                \
    }

static void tile_any(const float *x, int64_t x_stride, const float *wp, int64_t panel, float *y, int64_t y_stride,
                     int mt, int nv, int last, int K, int kb) {
    if (nv == 2) ROWS(2) else ROWS(1)
}

/* the build's panel width: the caller makes the panels [ceil(N / width)][K][width] */
int pd_skinny_width(void) { return VW; }

/* x: [M, K] rows x_stride apart; wp: W [N, K] as panels [ceil(N / VW)][K][VW]; y: [M, N] contiguous.
 * 1 = bad shape (N, K or kb < 1) */
int pd_skinny_linear(const float *x, int64_t x_stride, const float *wp, float *y, int M, int N, int K, int kb) {
    if (M < 0 || N <= 0 || K <= 0 || kb < 1) return 1;
    int64_t panel = (int64_t)K * VW;
    for (int n0 = 0; n0 < N;) {
        int left = N - n0, nv = left > VW ? NV : 1;
        int last = left >= VW * nv ? VW : left - VW * (nv - 1);
        for (int m0 = 0; m0 < M; m0 += MT)
            tile_any(x + (int64_t)m0 * x_stride, x_stride, wp + (int64_t)(n0 / VW) * panel, panel,
                     y + (int64_t)m0 * N + n0, N, M - m0 < MT ? M - m0 : MT, nv, last, K, kb);
        n0 += VW * nv;
    }
    return 0;
}
