/* Paged attention on x86-64 CPUs (AVX2 + FMA): one call per layer for the whole packed batch.
 *
 * What it computes: for every sequence b and every query row i of it (position
 * p = seq_lens[b] - q_len + i), for every query head h (KV head g = h / (H / Hkv)):
 *
 *     out[row, h] = softmax_k(scale * q[row, h] . K[b, k, g]) @ V[b, k, g]    over keys k in [lo, p]
 *
 * with lo = 0, or p - window + 1 under a sliding window; K/V row k of sequence b lives in the paged
 * cache at block block_table[b, k / bs], offset k % bs.  Decode rows (q_len 1) and prefill/extend
 * chunks go through the same loop: no gather, no padding, no mask tensor.
 *
 * Layouts: q, out [T, H, D] float32; k_cache, v_cache [num_blocks, bs, Hkv, D] float32 / bfloat16 /
 * float16; block_table [B, table_stride] int32; query_start_loc [B + 1], seq_lens [B] int32.
 * D and bs are multiples of 8 (the host checks; the kernel returns an error code otherwise).
 *
 * Bits do not depend on chunking.  Each (row, head) is computed by the same sequence of
 * floating-point operations whatever else is in the call: keys are visited in units of 32 aligned to
 * absolute positions 0, 32, 64, ... (the online softmax rescales once per unit), a score is reduced over
 * D in a fixed order, and P @ V accumulates keys in position order.  Rows are tiled (up to 32 (row, head)
 * lanes share each unit's K/V while it is in L1); the AVX-512 build puts two lanes in each 16-float register
 * (lanes that take a whole unit four at a time, attend_unit_block; two heads of one row, attend_unit_pair),
 * each K/V vector loaded once for all of them, only to halve the instructions: a lane's arithmetic never
 * reads another lane's, and it is the AVX2 build's.  The AVX2 build takes the lanes below the diagonal two at
 * a time (attend_unit_block: one K or V load for both lanes' FMAs, the same per-lane arithmetic; a 512-token
 * prompt's layer on a Zen 3 EPYC, 4 prompts, 17.1 -> 15.3 ms).  So a prompt prefilled in one chunk or in ten, on
 * the prefill node or the decode node, publishes the same KV bytes — what the store's digest check requires
 * (the fused SDPA kernel tiles by the chunk's length and did not).  Built with -ffp-contract=off and no
 * fast-math so the compiler cannot re-associate; every FMA is an explicit intrinsic.
 *
 * Memory: a decode row reads its whole context once (K and V, fp32: 512 B a token for 2 KV heads of 64), so
 * decode steps run at the speed the cache streams from DRAM.  The next unit's rows are prefetched into L2
 * (not L1: K and V of two units fill a 32 KiB L1 and the prefetch evicted the unit being read) and the unit
 * after it into L3/L2 (T2); on a Zen 4 EPYC a layer's decode over 32 x ~550 tokens, its cache in DRAM
 * (devbench/cpu_kv_memory.py), went from 2.0 to 1.4 ms (9 to 13 GB/s).  A decode row (its sequence's only query
 * row) is one work item for all KV heads (attend_row_all_heads): each key's row of all heads -- contiguous --
 * is prefetched and read in one pass, not in Hkv passes over strided halves (7-15% less time on that bench
 * on a Zen 3 EPYC: 1.94-1.97 -> 1.68-1.81 ms).  A decode row also asks again, at every unit, for the units
 * 2 to 4 ahead (a software prefetch that finds the miss queue full is dropped: asking once per unit left
 * gaps), and the next work item's first units are asked for before an item starts (they were cold misses):
 * devbench/cpu_kv_memory.py on a Zen 4 EPYC, 1.50-1.63 -> 1.25-1.31 ms a layer (12 -> 14 GB/s).  A cache that
 * sits in L3 pays for the extra prefetch instructions: its "hot" figure went 0.52 -> 0.63 ms (asking for units
 * 3-4 only: DRAM 1.45, hot 0.55-0.56; a decode step's cache is DRAM-sized).  On a Sapphire Rapids Xeon the
 * extra requests cost more than they bring: asking for unit 2 only (AHEAD 2), DRAM 1.76-1.95 -> 1.44-1.55 ms
 * and hot 0.69-0.71 -> 0.53-0.54, so Intel builds take AHEAD 2.  None of this changes any arithmetic: the bits
 * are the same.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_vec.h"

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
enum { OK = 0, ERR_SHAPE = 1, ERR_NOMEM = 2 };
#define MAX_LANES 32   /* (row, head) lanes per tile: their accumulators (32 x D floats) stay in L1/L2 */
#define GROUP 8        /* keys per score vector: one AVX register */
#define UNIT 32        /* keys per online-softmax step (4 groups), aligned to absolute positions */
#define NG (UNIT / GROUP)
#ifndef AHEAD          /* a decode row asks for the units 2 .. AHEAD ahead of the one it reads (the build sets it
                        * per CPU vendor: kernels/cpu_attention.py, PREFETCH_AHEAD) */
#define AHEAD 4
#endif

/* lane j of the result = sum of a[j]'s 8 lanes, in a fixed order */
INLINE __m256 hsum8x8(const __m256 a[8]) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

INLINE float hsum(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

INLINE float hmax(__m256 x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* 8 cache elements -> float32 */
INLINE __m256 load8(const void *p, int dt) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)p);
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (dt == DT_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

typedef struct {            /* one call's shapes */
    int H, Hkv, D, bs, window, dt;
    size_t esize;           /* bytes per cache element */
    float scale;
} Shape;

typedef struct {            /* one (row, head) lane's running state */
    const float *q;
    float *acc;             /* [D] */
    float m, l;
    int pos, lo;
} Lane;

/* the scores of keys k0..k0+7 for one lane: dot products over D (d in order), reduced in a fixed order;
 * the 8 keys' chains are independent, so the FMAs pipeline */
INLINE __m256 scores8(const Lane *ln, const void *const krow[GROUP], const Shape *s) {
    __m256 a[GROUP];
    for (int j = 0; j < GROUP; j++) a[j] = _mm256_setzero_ps();
    for (int d = 0; d < s->D; d += 8) {
        __m256 qd = _mm256_loadu_ps(ln->q + d);
        size_t off = (size_t)d * s->esize;
        for (int j = 0; j < GROUP; j++)
            a[j] = _mm256_fmadd_ps(qd, load8((const char *)krow[j] + off, s->dt), a[j]);
    }
    return _mm256_mul_ps(hsum8x8(a), _mm256_set1_ps(s->scale));
}

/* acc[d..d+8*W) += sum_j p_j v_j[...], keys first..last in order; W independent chains */
#define PV_CHUNK(W)                                                                                      \
    for (; d + 8 * (W) <= s->D; d += 8 * (W)) {                                                          \
        __m256 acc[W];                                                                                   \
        for (int w = 0; w < (W); w++) acc[w] = _mm256_loadu_ps(ln->acc + d + 8 * w);                     \
        for (int j = first; j <= last; j++) {                                                            \
            __m256 pb = _mm256_set1_ps(pj[j]);                                                           \
            const char *vr = (const char *)vrow[j] + (size_t)d * s->esize;                               \
            for (int w = 0; w < (W); w++)                                                                \
                acc[w] = _mm256_fmadd_ps(pb, load8(vr + (size_t)8 * w * s->esize, s->dt), acc[w]);      \
        }                                                                                                \
        for (int w = 0; w < (W); w++) _mm256_storeu_ps(ln->acc + d + 8 * w, acc[w]);                     \
    }

/* lane j of the result: all ones where first <= j <= last */
INLINE __m256 mask8(int first, int last) {
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(first - 1)),
                                                _mm256_cmpgt_epi32(_mm256_set1_epi32(last + 1), idx)));
}

/* a lane whose unit maximum is m_new: a new running max rescales what was accumulated */
INLINE void lane_rescale(Lane *ln, float m_new, const Shape *s) {
    if (m_new > ln->m) {
        float alpha = _mm256_cvtss_f32(exp8(_mm256_set1_ps(ln->m - m_new)));
        __m256 va = _mm256_set1_ps(alpha);
        for (int d = 0; d < s->D; d += 8)
            _mm256_storeu_ps(ln->acc + d, _mm256_mul_ps(_mm256_loadu_ps(ln->acc + d), va));
        ln->l *= alpha;
        ln->m = m_new;
    }
}

/* a lane's online softmax over one unit: groups g0..g1's scores sc (masked keys at -inf, valid: their lanes),
 * one max and one rescale for the unit, then pj = exp(score - max) (0 where masked) and the denominator */
INLINE void unit_softmax(Lane *ln, const __m256 sc[NG], const __m256 valid[NG], int g0, int g1, float pj[UNIT],
                         const Shape *s) {
    __m256 umax = _mm256_set1_ps(-__builtin_inff());
    for (int gi = g0; gi <= g1; gi++) umax = _mm256_max_ps(umax, sc[gi]);
    lane_rescale(ln, hmax(umax), s);
    __m256 psum = _mm256_setzero_ps(), vm = _mm256_set1_ps(ln->m);
    for (int gi = g0; gi <= g1; gi++) {
        __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(sc[gi], vm)), valid[gi]);
        _mm256_storeu_ps(pj + gi * GROUP, p);
        psum = _mm256_add_ps(psum, p);
    }
    ln->l += hsum(psum);
}

/* one lane takes keys [first, last] of the unit starting at k0 into its online softmax: the unit's groups'
 * scores (independent: they pipeline), unit_softmax, then P @ V in key order */
INLINE void attend_unit(Lane *ln, const void *const krow[UNIT], const void *const vrow[UNIT], int k0,
                        const Shape *s) {
    int first = ln->lo > k0 ? ln->lo - k0 : 0, last = ln->pos - k0 < UNIT - 1 ? ln->pos - k0 : UNIT - 1;
    int g0 = first / GROUP, g1 = last / GROUP;
    __m256 sc[NG], valid[NG];
    for (int gi = g0; gi <= g1; gi++) {
        valid[gi] = mask8(first - gi * GROUP, last - gi * GROUP);
        sc[gi] = _mm256_blendv_ps(_mm256_set1_ps(-__builtin_inff()), scores8(ln, krow + gi * GROUP, s), valid[gi]);
    }
    float pj[UNIT];
    unit_softmax(ln, sc, valid, g0, g1, pj, s);
    int d = 0;                                /* acc += p_j v_j: 8 chains, then whatever D leaves */
    PV_CHUNK(8)
    PV_CHUNK(1)
}

/* Pairs (the AVX-512 build): one 16-float register holds two lanes' 8-float vectors side by side (the first lane
 * in the low half), and each K or V row's 8 floats are loaded once, into both halves, for every pair's FMA.  Each
 * lane's operations and their order are attend_unit's -- an FMA on a register half is the 8-float FMA, exp16 is
 * exp8 lane by lane, the pair's horizontal sums pair the same values as hsum8x8, a masked move keeps or zeroes
 * what the 8-float AND does -- so the bits are those of the AVX2 build (tests/test_cpu_attention.py compares
 * them); a pair only halves the instructions.  Two kinds of pair:
 *   - a block: LB lanes that take every key of a unit (prompt rows below the diagonal: most of a prompt's work),
 *     LB / 2 pairs of any lanes of the tile; LB 4 keeps the scores' 16 accumulators, two q pairs and a K row in
 *     19 of the 32 registers (LB 6 and 8 measured no faster);
 *   - two heads of one query row (its diagonal unit, a window's first, and every unit of a decode row): the same
 *     keys and the same mask for both.
 * On a Sapphire Rapids Xeon (devbench/cpu_attention.py --prefill, 4 q / 2 KV heads of 64) a 512-token prompt's layer
 * went from 2.28 to ~1.8 ms with blocks of pairs.  (The 8-float blocking before it, 4 lanes sharing each load,
 * took the same prompt from 10.2 to 7.9 ms a layer for 4 prompts on a Zen 4 EPYC.)  The AVX2 build has 16 vector
 * registers, too few for either: its blocks are two lanes of 8-float vectors (below). */
#ifdef __AVX512F__
#define LB 4
#define NP (LB / 2)            /* pairs in a block */

/* lane a's 8 floats in the low half, lane b's in the high */
INLINE __m512 pair8(__m256 a, __m256 b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}

INLINE __m256 low8(__m512 x) { return _mm512_castps512_ps256(x); }
INLINE __m256 high8(__m512 x) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)); }

/* 8 cache elements -> float32, in both halves (fp32: one broadcast load) */
INLINE __m512 load8_both(const void *p, int dt) {
    if (dt == DT_F32) return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd((const double *)p)));
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(load8(p, dt))));
}

/* _mm256_hadd_ps in each half: the same two values summed for every output */
INLINE __m512 hadd_pair(__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
}

/* hsum8x8 for both halves: the same tree, then the halves' 128-bit quarters put back in place */
INLINE __m512 hsum8x8_pair(const __m512 a[GROUP]) {
    __m512 t0 = hadd_pair(a[0], a[1]), t1 = hadd_pair(a[2], a[3]);
    __m512 t2 = hadd_pair(a[4], a[5]), t3 = hadd_pair(a[6], a[7]);
    __m512 u0 = hadd_pair(t0, t1), u1 = hadd_pair(t2, t3);
    __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),      /* [a lo | b lo | a hi | b hi] */
                               _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_shuffle_f32x4(sum, sum, _MM_SHUFFLE(3, 1, 2, 0));
}

/* scores8 for np pairs of lanes (ls[2p], ls[2p + 1]), a pair per register: each K row feeds every pair's FMA */
INLINE void scores8_pairs(Lane *const *ls, int np, const void *const krow[GROUP], const Shape *s, __m512 out[]) {
    __m512 a[NP][GROUP];
    for (int p = 0; p < np; p++)
        for (int j = 0; j < GROUP; j++) a[p][j] = _mm512_setzero_ps();
    for (int d = 0; d < s->D; d += 8) {
        __m512 qd[NP];
        for (int p = 0; p < np; p++)
            qd[p] = pair8(_mm256_loadu_ps(ls[2 * p]->q + d), _mm256_loadu_ps(ls[2 * p + 1]->q + d));
        size_t off = (size_t)d * s->esize;
        for (int j = 0; j < GROUP; j++) {
            __m512 kv = load8_both((const char *)krow[j] + off, s->dt);
            for (int p = 0; p < np; p++) a[p][j] = _mm512_fmadd_ps(qd[p], kv, a[p][j]);
        }
    }
    for (int p = 0; p < np; p++) out[p] = _mm512_mul_ps(hsum8x8_pair(a[p]), _mm512_set1_ps(s->scale));
}

/* unit_softmax for a pair of lanes (sc: groups g0..g1's scores side by side, masked keys at -inf; valid: their
 * keys): the maximum, the exps and the denominator's sums lane by lane in unit_softmax's order; pa, pb: weights */
INLINE void unit_softmax_pair(Lane *a, Lane *b, const __m512 sc[NG], const __mmask16 valid[NG], int g0, int g1,
                              float pa[UNIT], float pb[UNIT], const Shape *s) {
    __m512 umax = _mm512_set1_ps(-__builtin_inff());
    for (int gi = g0; gi <= g1; gi++) umax = _mm512_max_ps(umax, sc[gi]);
    lane_rescale(a, hmax(low8(umax)), s);
    lane_rescale(b, hmax(high8(umax)), s);
    __m512 psum = _mm512_setzero_ps(), vm = pair8(_mm256_set1_ps(a->m), _mm256_set1_ps(b->m));
    for (int gi = g0; gi <= g1; gi++) {
        __m512 p = _mm512_maskz_mov_ps(valid[gi], exp16(_mm512_sub_ps(sc[gi], vm)));
        _mm256_storeu_ps(pa + gi * GROUP, low8(p));
        _mm256_storeu_ps(pb + gi * GROUP, high8(p));
        psum = _mm512_add_ps(psum, p);
    }
    a->l += hsum(low8(psum));
    b->l += hsum(high8(psum));
}

/* acc[l][d..d+8*W) += sum_j pj[l][j] v_j[...] for np pairs of lanes, keys J0..J1 in order: PV_CHUNK's chains, a
 * pair per register, each V load shared by all pairs */
#define PV_PAIRS_CHUNK(W, NPV, J0, J1)                                                                   \
    for (; d + 8 * (W) <= s->D; d += 8 * (W)) {                                                          \
        __m512 acc[NP][W];                                                                               \
        for (int p = 0; p < (NPV); p++)                                                                  \
            for (int w = 0; w < (W); w++)                                                                \
                acc[p][w] = pair8(_mm256_loadu_ps(ls[2 * p]->acc + d + 8 * w),                           \
                                  _mm256_loadu_ps(ls[2 * p + 1]->acc + d + 8 * w));                      \
        for (int j = (J0); j <= (J1); j++) {                                                             \
            __m512 pb[NP];                                                                               \
            for (int p = 0; p < (NPV); p++)                                                              \
                pb[p] = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(pj[2 * p][j]),                       \
                                             _mm512_set1_ps(pj[2 * p + 1][j]));                          \
            const char *vr = (const char *)vrow[j] + (size_t)d * s->esize;                               \
            for (int w = 0; w < (W); w++) {                                                              \
                __m512 vv = load8_both(vr + (size_t)8 * w * s->esize, s->dt);                            \
                for (int p = 0; p < (NPV); p++) acc[p][w] = _mm512_fmadd_ps(pb[p], vv, acc[p][w]);       \
            }                                                                                            \
        }                                                                                                \
        for (int p = 0; p < (NPV); p++)                                                                  \
            for (int w = 0; w < (W); w++) {                                                              \
                _mm256_storeu_ps(ls[2 * p]->acc + d + 8 * w, low8(acc[p][w]));                           \
                _mm256_storeu_ps(ls[2 * p + 1]->acc + d + 8 * w, high8(acc[p][w]));                      \
            }                                                                                            \
    }

/* attend_unit for LB lanes that each take all UNIT keys of the unit: the scores of all of them, each pair's
 * softmax (attend_unit's operations on unmasked keys), then P @ V */
INLINE void attend_unit_block(Lane *const ls[LB], const void *const krow[UNIT], const void *const vrow[UNIT],
                              const Shape *s) {
    __m512 sc[NP][NG], out[NP];
    __mmask16 all[NG];
    for (int gi = 0; gi < NG; gi++) {
        scores8_pairs(ls, NP, krow + gi * GROUP, s, out);
        for (int p = 0; p < NP; p++) sc[p][gi] = out[p];
        all[gi] = 0xFFFF;
    }
    float pj[LB][UNIT];
    for (int p = 0; p < NP; p++)
        unit_softmax_pair(ls[2 * p], ls[2 * p + 1], sc[p], all, 0, NG - 1, pj[2 * p], pj[2 * p + 1], s);
    int d = 0;
    PV_PAIRS_CHUNK(8, NP, 0, UNIT - 1)
    PV_PAIRS_CHUNK(1, NP, 0, UNIT - 1)
}

/* attend_unit for two heads of one query row (the same position and first key: the same keys of the unit) */
INLINE void attend_unit_pair(Lane *a, Lane *b, const void *const krow[UNIT], const void *const vrow[UNIT], int k0,
                             const Shape *s) {
    int first = a->lo > k0 ? a->lo - k0 : 0, last = a->pos - k0 < UNIT - 1 ? a->pos - k0 : UNIT - 1;
    int g0 = first / GROUP, g1 = last / GROUP;
    uint32_t keys = (uint32_t)(((uint64_t)1 << (last + 1)) - 1) & ~(uint32_t)(((uint64_t)1 << first) - 1);
    Lane *ls[2] = {a, b};
    __m512 sc[NG];
    __mmask16 valid[NG];
    for (int gi = g0; gi <= g1; gi++) {
        uint32_t g = keys >> (gi * GROUP) & 0xFF;
        valid[gi] = (__mmask16)(g | g << 8);
        __m512 raw;
        scores8_pairs(ls, 1, krow + gi * GROUP, s, &raw);
        sc[gi] = _mm512_mask_blend_ps(valid[gi], _mm512_set1_ps(-__builtin_inff()), raw);
    }
    float pj[2][UNIT];
    unit_softmax_pair(a, b, sc, valid, g0, g1, pj[0], pj[1], s);
    int d = 0;
    PV_PAIRS_CHUNK(8, 1, first, last)
    PV_PAIRS_CHUNK(1, 1, first, last)
}

/* lanes [i, i + 2) are two heads of one query row: attend_tile's lanes run row by row, G heads a row */
INLINE int same_row(int i, int n, int G) { return i % G + 1 < G && i + 1 < n; }
#define HAS_PAIRS 1
#else
/* Blocks of two (the AVX2 build): two lanes that take every key of a unit share each K and V load.  Scores: each
 * lane's 8 partial sums a key are scores8's (d in order), four keys of both lanes at a time, and one hsum8x8 sums
 * the 8 of them (its lane j sums a[j] alone, in its fixed order); P @ V: each lane's chain of FMAs per d is
 * PV_CHUNK's, keys in order, two lanes a V load.  So each lane's bits are attend_unit's. */
#define HAS_PAIRS 0
#ifdef PD_ONE_LANE_AT_A_TIME   /* (tests: the same source with every lane through attend_unit, to compare bits) */
#define LB 1
#else
#define LB 2

/* scores8 for lanes a and b: *sa, *sb */
INLINE void scores8_two(const Lane *a, const Lane *b, const void *const krow[GROUP], const Shape *s, __m256 *sa,
                        __m256 *sb) {
    __m256 half[2];
    for (int hf = 0; hf < 2; hf++) {
        __m256 acc[GROUP];                    /* [0, 4): lane a's keys 4 hf .. 4 hf + 3; [4, 8): lane b's */
        for (int j = 0; j < GROUP; j++) acc[j] = _mm256_setzero_ps();
        for (int d = 0; d < s->D; d += 8) {
            __m256 qa = _mm256_loadu_ps(a->q + d), qb = _mm256_loadu_ps(b->q + d);
            size_t off = (size_t)d * s->esize;
            for (int j = 0; j < 4; j++) {
                __m256 kv = load8((const char *)krow[4 * hf + j] + off, s->dt);
                acc[j] = _mm256_fmadd_ps(qa, kv, acc[j]);
                acc[4 + j] = _mm256_fmadd_ps(qb, kv, acc[4 + j]);
            }
        }
        half[hf] = hsum8x8(acc);
    }
    __m256 scale = _mm256_set1_ps(s->scale);
    *sa = _mm256_mul_ps(_mm256_permute2f128_ps(half[0], half[1], 0x20), scale);
    *sb = _mm256_mul_ps(_mm256_permute2f128_ps(half[0], half[1], 0x31), scale);
}

/* acc[d..d+8*W) += sum_j p_j v_j[...] for lanes a and b, keys 0 .. UNIT - 1 in order */
#define PV_TWO_CHUNK(W)                                                                                  \
    for (; d + 8 * (W) <= s->D; d += 8 * (W)) {                                                          \
        __m256 xa[W], xb[W];                                                                             \
        for (int w = 0; w < (W); w++) {                                                                  \
            xa[w] = _mm256_loadu_ps(ls[0]->acc + d + 8 * w);                                             \
            xb[w] = _mm256_loadu_ps(ls[1]->acc + d + 8 * w);                                             \
        }                                                                                                \
        for (int j = 0; j < UNIT; j++) {                                                                 \
            __m256 p0 = _mm256_set1_ps(pj[0][j]), p1 = _mm256_set1_ps(pj[1][j]);                         \
            const char *vr = (const char *)vrow[j] + (size_t)d * s->esize;                               \
            for (int w = 0; w < (W); w++) {                                                              \
                __m256 vv = load8(vr + (size_t)8 * w * s->esize, s->dt);                                 \
                xa[w] = _mm256_fmadd_ps(p0, vv, xa[w]);                                                  \
                xb[w] = _mm256_fmadd_ps(p1, vv, xb[w]);                                                  \
            }                                                                                            \
        }                                                                                                \
        for (int w = 0; w < (W); w++) {                                                                  \
            _mm256_storeu_ps(ls[0]->acc + d + 8 * w, xa[w]);                                             \
            _mm256_storeu_ps(ls[1]->acc + d + 8 * w, xb[w]);                                             \
        }                                                                                                \
    }

/* attend_unit for two lanes that each take all UNIT keys of the unit */
INLINE void attend_unit_block(Lane *const ls[LB], const void *const krow[UNIT], const void *const vrow[UNIT],
                              const Shape *s) {
    __m256 sc[2][NG], all[NG];
    for (int gi = 0; gi < NG; gi++) {
        scores8_two(ls[0], ls[1], krow + gi * GROUP, s, &sc[0][gi], &sc[1][gi]);
        all[gi] = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    }
    float pj[2][UNIT];
    unit_softmax(ls[0], sc[0], all, 0, NG - 1, pj[0], s);
    unit_softmax(ls[1], sc[1], all, 0, NG - 1, pj[1], s);
    int d = 0;
    PV_TWO_CHUNK(4)
    PV_TWO_CHUNK(1)
}
#endif
#endif

/* the K and V rows of keys k0 .. min(k0 + UNIT - 1, kmax) (block and offset tracked across calls, no
 * division); prefetch: ask for their cache lines now, they are the next unit's */
INLINE void unit_rows(const void *rows[2][UNIT], int k0, int kmax, int *blk, int *off, const char *kc,
                      const char *vc, const int32_t *table, size_t row_bytes, size_t head_off, size_t span,
                      const Shape *s, int prefetch) {
    for (int kk = k0; kk < k0 + UNIT && kk <= kmax; kk += GROUP) {    /* a group never straddles blocks */
        size_t base = ((size_t)table[*blk] * s->bs + *off) * row_bytes + head_off;
        for (int j = 0; j < GROUP; j++) {
            rows[0][kk - k0 + j] = kc + base + j * row_bytes;
            rows[1][kk - k0 + j] = vc + base + j * row_bytes;
            if (prefetch)
                for (size_t b = 0; b < span; b += 64) {
                    _mm_prefetch((const char *)rows[0][kk - k0 + j] + b, _MM_HINT_T1);
                    _mm_prefetch((const char *)rows[1][kk - k0 + j] + b, _MM_HINT_T1);
                }
        }
        if ((*off += GROUP) == s->bs) { *off = 0; (*blk)++; }
    }
}

/* ask for the K and V rows of keys k0 .. min(k0 + UNIT - 1, kmax) into L3/L2 (T2): the unit after the next */
INLINE void prefetch_far(int k0, int kmax, const char *kc, const char *vc, const int32_t *table, size_t row_bytes,
                         size_t head_off, size_t span, const Shape *s) {
    for (int kk = k0; kk < k0 + UNIT && kk <= kmax; kk += GROUP) {
        size_t base = ((size_t)table[kk / s->bs] * s->bs + kk % s->bs) * row_bytes + head_off;
        for (int j = 0; j < GROUP; j++)
            for (size_t b = 0; b < span; b += 64) {
                _mm_prefetch(kc + base + j * row_bytes + b, _MM_HINT_T2);
                _mm_prefetch(vc + base + j * row_bytes + b, _MM_HINT_T2);
            }
    }
}

/* the first key a query at position pos sees: 0, or pos - window + 1 under a sliding window */
INLINE int first_key(int pos, const Shape *s) {
    return s->window > 0 && pos - s->window + 1 > 0 ? pos - s->window + 1 : 0;
}

/* a lane for query row r, head h, at position pos: empty accumulator, its first key under the window */
INLINE void lane_init(Lane *ln, const float *q, float *acc, int r, int h, int pos, const Shape *s) {
    ln->q = q + ((size_t)r * s->H + h) * s->D;
    ln->acc = acc;
    for (int d = 0; d < s->D; d++) ln->acc[d] = 0.0f;
    ln->m = -__builtin_inff(); ln->l = 0.0f;
    ln->pos = pos;
    ln->lo = first_key(pos, s);
}

/* out[r, h] = the lane's accumulator / its softmax denominator */
INLINE void lane_write(const Lane *ln, float *out, int r, int h, const Shape *s) {
    float *o = out + ((size_t)r * s->H + h) * s->D;
    __m256 inv = _mm256_set1_ps(ln->l);
    for (int d = 0; d < s->D; d += 8)
        _mm256_storeu_ps(o + d, _mm256_div_ps(_mm256_loadu_ps(ln->acc + d), inv));
}

/* rows [r0, r1) of one sequence (first row at position pos0), KV head g: every key group any lane needs */
INLINE void attend_tile(const float *q, float *out, const char *kc, const char *vc, const int32_t *table,
                        int r0, int r1, int pos0, int g, Lane *lanes, float *accs, const Shape *s) {
    int G = s->H / s->Hkv, n = 0, kmin = 1 << 30, kmax = 0;
    for (int r = r0; r < r1; r++)
        for (int h = g * G; h < (g + 1) * G; h++, n++) {
            Lane *ln = &lanes[n];
            lane_init(ln, q, accs + (size_t)n * s->D, r, h, pos0 + (r - r0), s);
            if (ln->lo < kmin) kmin = ln->lo;
            if (ln->pos > kmax) kmax = ln->pos;
        }
    size_t row_bytes = (size_t)s->Hkv * s->D * s->esize, head_bytes = (size_t)s->D * s->esize;
    size_t head_off = (size_t)g * head_bytes;
    int k0 = kmin / UNIT * UNIT, blk = k0 / s->bs, off = k0 % s->bs;
    const void *rows[2][2][UNIT];             /* [this unit, the next][k, v][key]: the next one is prefetched */
    unit_rows(rows[0], k0, kmax, &blk, &off, kc, vc, table, row_bytes, head_off, head_bytes, s, 0);
    for (int u = 0; k0 <= kmax; k0 += UNIT, u ^= 1) {
        if (k0 + UNIT <= kmax)
            unit_rows(rows[u ^ 1], k0 + UNIT, kmax, &blk, &off, kc, vc, table, row_bytes, head_off, head_bytes, s, 1);
        if (k0 + 2 * UNIT <= kmax)
            prefetch_far(k0 + 2 * UNIT, kmax, kc, vc, table, row_bytes, head_off, head_bytes, s);
        Lane *block[LB];                      /* lanes taking the whole unit, LB at a time; the rest (a row's
                                               * diagonal unit, a window's first) one by one */
        int nb = 0;
        for (int i = 0; i < n; i++) {
            if (lanes[i].pos < k0 || lanes[i].lo >= k0 + UNIT) continue;
#if LB > 1
            if (lanes[i].lo <= k0 && lanes[i].pos >= k0 + UNIT - 1) {
                block[nb++] = &lanes[i];
                if (nb == LB) { attend_unit_block(block, rows[u][0], rows[u][1], s); nb = 0; }
                continue;
            }
#endif
#if HAS_PAIRS
            if (same_row(i, n, G)) {          /* the row's next head: the same keys */
                attend_unit_pair(&lanes[i], &lanes[i + 1], rows[u][0], rows[u][1], k0, s);
                i++;
                continue;
            }
#endif
            attend_unit(&lanes[i], rows[u][0], rows[u][1], k0, s);
        }
        int i = 0;
#if HAS_PAIRS
        for (; i + 1 < nb; i += 2) attend_unit_pair(block[i], block[i + 1], rows[u][0], rows[u][1], k0, s);
#endif
        for (; i < nb; i++) attend_unit(block[i], rows[u][0], rows[u][1], k0, s);
    }
    for (int i = 0, r = r0; r < r1; r++)
        for (int h = g * G; h < (g + 1) * G; h++, i++)
            lane_write(&lanes[i], out, r, h, s);
}

/* one decode row (position pos), every KV head at once: each key's K and V rows -- all heads, contiguous --
 * are prefetched and read in one pass instead of Hkv strided passes; each lane's arithmetic is attend_tile's */
INLINE void attend_row_all_heads(const float *q, float *out, const char *kc, const char *vc, const int32_t *table,
                                 int r, int pos, Lane *lanes, float *accs, const Shape *s) {
    int G = s->H / s->Hkv;
    for (int h = 0; h < s->H; h++)
        lane_init(&lanes[h], q, accs + (size_t)h * s->D, r, h, pos, s);
    int kmin = lanes[0].lo, kmax = pos;
    size_t row_bytes = (size_t)s->Hkv * s->D * s->esize, head_bytes = (size_t)s->D * s->esize;
    int k0 = kmin / UNIT * UNIT, blk = k0 / s->bs, off = k0 % s->bs;
    const void *rows[2][2][UNIT], *head_rows[2][UNIT];
    unit_rows(rows[0], k0, kmax, &blk, &off, kc, vc, table, row_bytes, 0, row_bytes, s, 0);
    for (int u = 0; k0 <= kmax; k0 += UNIT, u ^= 1) {
        if (k0 + UNIT <= kmax)
            unit_rows(rows[u ^ 1], k0 + UNIT, kmax, &blk, &off, kc, vc, table, row_bytes, 0, row_bytes, s, 1);
        for (int f = 2; f <= AHEAD && k0 + f * UNIT <= kmax; f++)
            prefetch_far(k0 + f * UNIT, kmax, kc, vc, table, row_bytes, 0, row_bytes, s);
        int filled = (kmax - k0) / GROUP * GROUP + GROUP;          /* unit_rows fills whole groups */
        if (filled > UNIT) filled = UNIT;
        for (int g = 0; g < s->Hkv; g++) {
            for (int j = 0; j < filled; j++) {
                head_rows[0][j] = (const char *)rows[u][0][j] + g * head_bytes;
                head_rows[1][j] = (const char *)rows[u][1][j] + g * head_bytes;
            }
            if (lanes[g * G].lo >= k0 + UNIT) continue;    /* (all heads of the row: the same keys) */
            int h = g * G;
#if HAS_PAIRS
            for (; h + 1 < (g + 1) * G; h += 2) attend_unit_pair(&lanes[h], &lanes[h + 1], head_rows[0], head_rows[1], k0, s);
#endif
            for (; h < (g + 1) * G; h++) attend_unit(&lanes[h], head_rows[0], head_rows[1], k0, s);
        }
    }
    for (int h = 0; h < s->H; h++)
        lane_write(&lanes[h], out, r, h, s);
}

/* a decode row's first units (sequence b, its one query at seq_len - 1), asked for before its item starts */
static void prefetch_row_start(int b, const void *kc, const void *vc, const int32_t *block_table, int64_t table_stride,
                               const int32_t *seq_lens, const Shape *s) {
    int pos = seq_lens[b] - 1, lo = first_key(pos, s);
    size_t row_bytes = (size_t)s->Hkv * s->D * s->esize;
    for (int k0 = lo / UNIT * UNIT, f = 0; f < AHEAD - 1 && k0 <= pos; f++, k0 += UNIT)
        prefetch_far(k0, pos, kc, vc, block_table + (int64_t)b * table_stride, row_bytes, 0, row_bytes, s);
}

/* attend_tile specialised per cache dtype and for the common head sizes: with dt, esize and D constants
 * the loads need no branch and the loops over D unroll (the arithmetic is the same in every variant) */
typedef void (*TileFn)(const float *, float *, const char *, const char *, const int32_t *, int, int, int, int,
                       Lane *, float *, const Shape *);
#define TILE_FN(NAME, DT, ESIZE, DCONST)                                                                  \
    static void NAME(const float *q, float *out, const char *kc, const char *vc, const int32_t *table,    \
                     int r0, int r1, int pos0, int g, Lane *lanes, float *accs, const Shape *s) {         \
        Shape c = *s;                                                                                     \
        c.dt = (DT); c.esize = (ESIZE);                                                                   \
        if (DCONST) c.D = (DCONST);                                                                       \
        if (g < 0) attend_row_all_heads(q, out, kc, vc, table, r0, pos0, lanes, accs, &c);                \
        else attend_tile(q, out, kc, vc, table, r0, r1, pos0, g, lanes, accs, &c);                        \
    }
TILE_FN(tile_f32_64, DT_F32, 4, 64)
TILE_FN(tile_f32_128, DT_F32, 4, 128)
TILE_FN(tile_f32_any, DT_F32, 4, 0)
TILE_FN(tile_bf16_64, DT_BF16, 2, 64)
TILE_FN(tile_bf16_128, DT_BF16, 2, 128)
TILE_FN(tile_bf16_any, DT_BF16, 2, 0)
TILE_FN(tile_f16_64, DT_F16, 2, 64)
TILE_FN(tile_f16_128, DT_F16, 2, 128)
TILE_FN(tile_f16_any, DT_F16, 2, 0)

static TileFn pick(int dt, int D) {
    static const TileFn fns[3][3] = {{tile_f32_64, tile_f32_128, tile_f32_any},
                                     {tile_bf16_64, tile_bf16_128, tile_bf16_any},
                                     {tile_f16_64, tile_f16_128, tile_f16_any}};
    return fns[dt][D == 64 ? 0 : D == 128 ? 1 : 2];
}

/* the work items the threads share, in order, as [b, first row, KV head] triples: a prefill/extend tile
 * is one item per KV head; a decode row (its sequence's only query row) is one item for all heads when its
 * H lanes fit (KV head -1: attend_row_all_heads) */
static int32_t *work_of(const int32_t *query_start_loc, int num_seqs, int rows_per_tile, int Hkv, int merge,
                        int *nitems) {
    int n = 0;
    for (int b = 0; b < num_seqs; b++) {
        int q_len = query_start_loc[b + 1] - query_start_loc[b];
        n += q_len == 1 && merge ? 1 : (q_len + rows_per_tile - 1) / rows_per_tile * Hkv;
    }
    int32_t *work = malloc(sizeof(int32_t) * 3 * (size_t)(n > 0 ? n : 1));
    if (work)
        for (int b = 0, t = 0; b < num_seqs; b++) {
            int start = query_start_loc[b], end = query_start_loc[b + 1];
            int merged = end - start == 1 && merge, g0 = merged ? -1 : 0, g1 = merged ? 0 : Hkv;
            for (int r = start; r < end; r += rows_per_tile)
                for (int g = g0; g < g1; g++, t++) {
                    work[3 * t] = b;
                    work[3 * t + 1] = r;
                    work[3 * t + 2] = g;
                }
        }
    *nitems = n;
    return work;
}

/* nthreads > 1: the work items are shared out dynamically (OpenMP); a lane's arithmetic does not depend on
 * which thread or which kind of item runs it, so the bits do not either */
int pd_paged_attention(const float *q, float *out, const void *k_cache, const void *v_cache, int cache_dtype,
                       const int32_t *block_table, int64_t table_stride, const int32_t *query_start_loc,
                       const int32_t *seq_lens, int num_seqs, int H, int Hkv, int D, int bs, float scale,
                       int window, int nthreads) {
    if (D % 8 || D <= 0 || bs % GROUP || bs <= 0 || Hkv <= 0 || H <= 0 || H % Hkv || cache_dtype < 0
        || cache_dtype > 2)
        return ERR_SHAPE;
    Shape s = {H, Hkv, D, bs, window, cache_dtype, cache_dtype == DT_F32 ? 4 : 2, scale};
    TileFn tile = pick(cache_dtype, D);
    int G = H / Hkv, rows_per_tile = G >= MAX_LANES ? 1 : MAX_LANES / G, lanes_max = rows_per_tile * G, nitems;
    int32_t *work = work_of(query_start_loc, num_seqs, rows_per_tile, Hkv, H <= lanes_max && Hkv > 1, &nitems);
    if (!work) return ERR_NOMEM;
    int err = OK;
    #pragma omp parallel num_threads(nthreads > 1 ? nthreads : 1) if (nthreads > 1)
    {
        Lane *lanes = malloc(sizeof(Lane) * lanes_max);
        float *accs = aligned_alloc(32, sizeof(float) * (size_t)lanes_max * D);
        #pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < nitems; i++) {
            if (!lanes || !accs) {
                #pragma omp atomic write
                err = ERR_NOMEM;
                continue;
            }
            if (i + 1 < nitems && work[3 * i + 5] < 0)       /* the next item is a decode row */
                prefetch_row_start(work[3 * i + 3], k_cache, v_cache, block_table, table_stride, seq_lens, &s);
            int b = work[3 * i], r = work[3 * i + 1], g = work[3 * i + 2];
            int start = query_start_loc[b], end = query_start_loc[b + 1];
            int r1 = r + rows_per_tile < end ? r + rows_per_tile : end;
            tile(q, out, k_cache, v_cache, block_table + (int64_t)b * table_stride, r, r1,
                 seq_lens[b] - (end - start) + (r - start), g, lanes, accs, &s);
        }
        free(lanes);
        free(accs);
    }
    free(work);
    return err;
}
