/* Fused causal attention over a KV store, batch-invariant:
 *
 *     out[i, h] = sum_{j < L_i} p_j v_j / sum_{j < L_i} p_j,
 *     p_j = exp(s_j - max_j s_j),   s_j = (scale q[i, h]) . k_j,
 *
 * for every query token i and head h, with k_j, v_j the keys and values of the token's slot
 * (store index slot[i]) and kv head h / (heads / kv_heads), and L_i = count[i] the keys the
 * token sees (its position + 1: the causal mask and the row's length in one number).
 *
 * Why a kernel of its own: on MLX's CPU backend the same attention is ~40 small ops a layer
 * (scores, mask, max, exp, products) and MLX's exp is not vectorised; prefill spends most of
 * its attention time there. Here one call per layer does it all, reading each key and value
 * once per (token, head), with a vectorised exp.
 *
 * Order (the invariance): everything a (token, head) result depends on is that token's query,
 * the first L_i keys and values of its slot, and L_i -- never the other tokens of the call,
 * how they are split between threads, the chunk size or the store's capacity:
 * - a score: q scaled element-wise (one rounding), then W lanes over d (lane l holds the terms
 *   d = l mod W), the first W terms multiplied, the later ones multiply-added in ascending d,
 *   the lanes added in a fixed halving tree, a tail of d mod W terms multiply-added after;
 * - the max: exact in any order;
 * - p_j: the vectorised exp below on s_j - max (the same operations in every lane);
 * - the normaliser: W lanes over j (lane l holds j = l mod W), ascending j, the halving tree;
 * - the weighted sum: per output element, ascending j, one multiply-add each;
 * - the result: the weighted sum divided by the normaliser.
 * Whether a multiply-add rounds once or twice is fixed per build, as in quant_kernel.c.
 *
 * Blocks (data reuse only, no arithmetic): consecutive tokens of one slot (a prompt chunk's,
 * a verify's) are taken a few at a time with one kv head, so that each key is loaded once for
 * two query rows (their scores W / 2 keys at a time, reduced together: the same chains and
 * the same tree) and each value once for up to HEAD_BLOCK rows (every row's weighted sum
 * over the keys all of them see, then each row alone over the rest of its own). A row never
 * reads a key or value past its own count, whatever block it is in.
 *
 * Threads: (block, kv head) items are taken in chunks by whichever thread is free; each item
 * is computed whole by one thread, so the split changes no bit.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define W 16
#else
#define W 8
#endif

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

#if defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#define ATTN_FUSED 1
#if W == 16
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
#else
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
#endif
static inline float sfma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#elif defined(__FP_FAST_FMAF)
#define ATTN_FUSED 1
static inline vf vfma(vf a, vf b, vf c) {
    for (int i = 0; i < W; i++) c[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return c;
}
static inline float sfma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#else
#define ATTN_FUSED 0
static inline vf vfma(vf a, vf b, vf c) { return c + a * b; }
static inline float sfma(float a, float b, float c) { return a * b + c; }
#endif

int mtplx_attn_fused(void) { return ATTN_FUSED; }
int mtplx_attn_lanes(void) { return W; }

static inline vf loadf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storef(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf splat(float s) { return (vf){0} + s; }
static inline vi splat_i(int32_t s) { return (vi){0} + s; }
#if W == 16
static const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
static const vi lane = {0, 1, 2, 3, 4, 5, 6, 7};
#endif

/* The fixed tree over W lanes: the upper half added lane-wise to the lower half until one
 * lane is left (the same tree as quant_kernel.c's). */
typedef float vh __attribute__((vector_size(W * 2)));
static inline float reduce(vf v) {
    typedef float v4 __attribute__((vector_size(16)));
#if W == 16
    vh h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
#else
    v4 q = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#endif
    const float a = q[0] + q[2], b = q[1] + q[3];
    return a + b;
}

/* reduce() of W vectors at once: lane k of the result is reduce(v[k]), bit for bit. The same
 * additions of the same partial sums as the halving tree (float addition is commutative, so
 * only which partials meet matters), done across vectors: each level pairs two vectors,
 * gathers the lower halves of their partials into one and the upper halves into another,
 * and adds them, W / 2 partial sums per instruction instead of one. */
static inline vf reduce_many(vf v[W]) {
#if W == 16
    vf c[8], dd[4], e[2];
    for (int m = 0; m < 8; m++) /* h[l] = v[l] + v[l + 8] */
        c[m] = __builtin_shufflevector(v[2 * m], v[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                       18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * m], v[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int m = 0; m < 4; m++) /* q[l] = h[l] + h[l + 4] */
        dd[m] = __builtin_shufflevector(c[2 * m], c[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                        18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(c[2 * m], c[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20,
                                        21, 22, 23, 28, 29, 30, 31);
    for (int m = 0; m < 2; m++) /* a = q0 + q2, b = q1 + q3 */
        e[m] = __builtin_shufflevector(dd[2 * m], dd[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                       20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(dd[2 * m], dd[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18,
                                       19, 22, 23, 26, 27, 30, 31);
    /* a + b */
    return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                   28, 30) +
           __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                   29, 31);
#else
    vf dd[4], e[2];
    for (int m = 0; m < 4; m++) /* q[l] = v[l] + v[l + 4] */
        dd[m] = __builtin_shufflevector(v[2 * m], v[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(v[2 * m], v[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int m = 0; m < 2; m++) /* a = q0 + q2, b = q1 + q3 */
        e[m] = __builtin_shufflevector(dd[2 * m], dd[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(dd[2 * m], dd[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

/* exp(x) for x <= 0 (a score minus the row's max), W lanes at once: Cephes' expf, as
 * vector arithmetic only (MLX's CPU exp is scalar, ~16 ns an element). x is clamped at
 * -87 (exp(-87) ~ 1.6e-38, the smallest scale 2^n here stays a normal number), n =
 * round(x log2 e) by the 1.5 * 2^23 trick, r = x - n ln 2 in two steps, a degree-6
 * polynomial, and 2^n built in the exponent bits. Relative error ~2 ulp; every lane runs
 * the same operations, so an element's bits do not depend on its neighbours. */
static inline vf vexp(vf x) {
    const vf lo = splat(-87.0f);
    const vi below = x < lo; /* all ones where x < -87 (a vector ?: is C++ only) */
    x = (vf)((below & (vi)lo) | (~below & (vi)x));
    const vf magic = splat(12582912.0f); /* 1.5 * 2^23 */
    vf n = (x * splat(1.44269504088896341f) + magic) - magic;
    vf r = vfma(n, splat(-0.693359375f), x);
    r = vfma(n, splat(2.12194440e-4f), r);
    vf p = splat(1.9875691500e-4f);
    p = vfma(p, r, splat(1.3981999507e-3f));
    p = vfma(p, r, splat(8.3333452e-3f));
    p = vfma(p, r, splat(4.1665795894e-2f));
    p = vfma(p, r, splat(1.6666665459e-1f));
    p = vfma(p, r, splat(5.0000001201e-1f));
    const vf rr = r * r;
    vf y = vfma(p, rr, r) + splat(1.0f);
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    vf two_n;
    memcpy(&two_n, &e, sizeof two_n);
    return y * two_n;
}

/* Scalar view of vexp for tests: exp of one value, through lane 0 of the vector code. */
float mtplx_attn_exp(float x) {
    vf v = splat(x);
    return vexp(v)[0];
}

typedef struct {
    const float *q;       /* [n, heads, d] */
    const float *keys;    /* [S, kv, cap, d] */
    const float *values;  /* [S, kv, cap, dv], the first d features read */
    const int32_t *slot;  /* [n] */
    const int32_t *count; /* [n] */
    float *out;           /* [n, heads, d] */
    int n, heads, kv, d, cap, dv;
    float scale;
} attn_t;

/* BLOCK_ROWS: the query rows (tokens x the heads of a kv head) a block of consecutive tokens
 * of one slot gathers, so that each value is loaded once for HEAD_BLOCK rows; a kv head of
 * more heads than that takes one token a block. */
enum { MAX_REPEATS = 64, HEAD_BLOCK = 6, VEC_BLOCK = 4, BLOCK_ROWS = 12 };
enum { MAX_BLOCK_ROWS = MAX_REPEATS > BLOCK_ROWS ? MAX_REPEATS : BLOCK_ROWS };

/* Weighted sums of H (<= HEAD_BLOCK) rows of p (a token's head each) over V, keys j0 .. j1,
 * output vectors e0 .. e0 + E (E <= VEC_BLOCK): H x E independent accumulators (a single
 * one per element would chain every multiply-add on the previous one's latency), each
 * element still summed in ascending j, continuing from what acc holds (the caller clears it
 * before j = 0), so a row's keys may be taken in several ranges with the same bits. */
static inline __attribute__((always_inline)) void weighted(const float *V, long dv, int j0,
                                                            int j1, const float *const *p,
                                                            const int H, int e0, const int E,
                                                            vf acc[][VEC_BLOCK]) {
    for (int j = j0; j < j1; j++) {
        const float *v = V + (long)j * dv + e0;
        vf x[VEC_BLOCK];
#pragma GCC unroll 4
        for (int e = 0; e < E; e++) x[e] = loadf(v + e * W);
#pragma GCC unroll 6
        for (int h = 0; h < H; h++) {
            const vf w = splat(p[h][j]);
#pragma GCC unroll 4
            for (int e = 0; e < E; e++) acc[h][e] = vfma(w, x[e], acc[h][e]);
        }
    }
}

/* Partial scores of W consecutive keys k (rows of d floats) against q: d outer, keys inner,
 * W independent accumulators, each key's own chain of multiply-adds in ascending d (as in
 * the one-key path), the first term multiplied. */
static inline __attribute__((always_inline)) void key_block(const float *k, const float *q,
                                                             const int d, const int dvec,
                                                             vf acc[W]) {
    const vf q0 = loadf(q);
#pragma GCC unroll 16
    for (int u = 0; u < W; u++) acc[u] = q0 * loadf(k + (long)u * d);
#pragma GCC unroll 8
    for (int e = W; e < dvec; e += W) {
        const vf qe = loadf(q + e);
#pragma GCC unroll 16
        for (int u = 0; u < W; u++) acc[u] = vfma(qe, loadf(k + (long)u * d + e), acc[u]);
    }
}

/* A value kept in a register: the compiler would otherwise fold its load into each of the
 * two multiply-adds that use it, loading it twice. */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && (W == 16 || defined(__AVX__))
#define PIN(v) __asm__("" : "+v"(v))
#else
#define PIN(v) (void)0
#endif

/* Partial scores of W / 2 consecutive keys k against two queries qa, qb: d outer, keys
 * inner, each key loaded once for both; acc[u] (u < W / 2) is qa's with key u, acc[W / 2 +
 * u] qb's: the same chains as key_block's, so reduce_many gives the same bits. */
static inline __attribute__((always_inline)) void key_pair(const float *k, const float *qa,
                                                            const float *qb, const int d,
                                                            vf acc[W]) {
    enum { KP = W / 2 };
    vf a = loadf(qa), b = loadf(qb);
#pragma GCC unroll 8
    for (int u = 0; u < KP; u++) {
        vf key = loadf(k + (long)u * d);
        PIN(key);
        acc[u] = a * key;
        acc[KP + u] = b * key;
    }
#pragma GCC unroll 8
    for (int e = W; e < d; e += W) {
        a = loadf(qa + e);
        b = loadf(qb + e);
#pragma GCC unroll 8
        for (int u = 0; u < KP; u++) {
            vf key = loadf(k + (long)u * d + e);
            PIN(key);
            acc[u] = vfma(a, key, acc[u]);
            acc[KP + u] = vfma(b, key, acc[KP + u]);
        }
    }
}

/* Scores of rows ra and rb (two query heads over the same keys) for keys 0 .. n (n a
 * multiple of W / 2), W / 2 keys at a time. */
static void pair_scores(const float *K, const float *qa, const float *qb, int d, int n,
                        float *ra, float *rb) {
    typedef float vhalf __attribute__((vector_size(W * 2)));
    for (int j0 = 0; j0 < n; j0 += W / 2) {
        vf acc[W];
        if (d == 64) key_pair(K + (long)j0 * d, qa, qb, 64, acc);
        else if (d == 128) key_pair(K + (long)j0 * d, qa, qb, 128, acc);
        else key_pair(K + (long)j0 * d, qa, qb, d, acc);
        const vf s = reduce_many(acc);
#if W == 16
        const vhalf lo = __builtin_shufflevector(s, s, 0, 1, 2, 3, 4, 5, 6, 7);
        const vhalf hi = __builtin_shufflevector(s, s, 8, 9, 10, 11, 12, 13, 14, 15);
#else
        const vhalf lo = __builtin_shufflevector(s, s, 0, 1, 2, 3);
        const vhalf hi = __builtin_shufflevector(s, s, 4, 5, 6, 7);
#endif
        memcpy(ra + j0, &lo, sizeof lo);
        memcpy(rb + j0, &hi, sizeof hi);
    }
}

/* The softmax of a block's rows: tokens i0 .. i0 + T - 1 of one slot, each with the
 * repeats query heads of kv head g (row t * repeats + r: query head g * repeats + r of token
 * i0 + t). Row h's scores over its count[h] keys, max, exp and normaliser go to scores + h
 * * stride (stride: at least the largest count rounded up to W) and denom[h]. scaled: the
 * rows' scaled queries, T x repeats x d floats of scratch.
 *
 * Every score is the order of the header (a W-lane chain over d, the halving tree), however
 * its key is reached: rows in pairs over the keys both see (W / 2 keys a time), then each
 * row alone over the rest, W keys a time, then key by key; each its own bits. */
static void block_softmax(const attn_t *p, int i0, int T, int g, float *scores, long stride,
                          float *scaled, const int *count, float *denom) {
    const int d = p->d, repeats = p->heads / p->kv, nrows = T * repeats;
    const int dvec = d - d % W;
    const float *K = p->keys + ((long)p->slot[i0] * p->kv + g) * p->cap * d;
#define qs(h) (scaled + (long)(h) * d)
#define row_of(h) (scores + (long)(h) * stride)
    int done[MAX_BLOCK_ROWS];
    for (int h = 0; h < nrows; h++) {
        const int t = h / repeats, r = h % repeats;
        const float *q = p->q + ((long)(i0 + t) * p->heads + g * repeats + r) * d;
        for (int e = 0; e < d; e++) qs(h)[e] = q[e] * p->scale;
        done[h] = 0;
    }
    if (dvec == d) /* rows in pairs: each key loaded once for two rows */
        for (int h = 0; h + 1 < nrows; h += 2) {
            const int common = count[h] < count[h + 1] ? count[h] : count[h + 1];
            const int n = common - common % (W / 2);
            pair_scores(K, qs(h), qs(h + 1), d, n, row_of(h), row_of(h + 1));
            done[h] = done[h + 1] = n;
        }
    for (int h = 0; h < nrows; h++) {
        const int L = count[h], padded = (L + W - 1) / W * W;
        float *row = row_of(h);
        int j0 = done[h];
        if (dvec) /* W keys at a time, their W scores reduced together (the same bits) */
            for (; j0 + W <= L; j0 += W) {
                vf acc[W];
                const float *k = K + (long)j0 * d;
                /* The usual head sizes as constants: the keys' addresses are then offsets
                 * from one pointer. */
                if (d == 64) key_block(k, qs(h), 64, 64, acc);
                else if (d == 128) key_block(k, qs(h), 128, 128, acc);
                else key_block(k, qs(h), d, dvec, acc);
                storef(row + j0, reduce_many(acc));
                for (int u = 0; u < W && dvec < d; u++) {
                    const float *kt = K + (long)(j0 + u) * d;
                    for (int e = dvec; e < d; e++) row[j0 + u] = sfma(qs(h)[e], kt[e], row[j0 + u]);
                }
            }
        for (int j = j0; j < L; j++) { /* key by key */
            const float *k = K + (long)j * d;
            float s;
            if (dvec) {
                vf acc = loadf(qs(h)) * loadf(k);
                for (int e = W; e < dvec; e += W) acc = vfma(loadf(qs(h) + e), loadf(k + e), acc);
                s = reduce(acc);
            } else {
                s = 0.0f;
            }
            for (int e = dvec; e < d; e++) s = sfma(qs(h)[e], k[e], s);
            row[j] = s;
        }
        /* the max (exact in any order) */
        vf most = splat(-INFINITY);
        int j = 0;
        for (; j + W <= L; j += W) {
            const vf v = loadf(row + j);
            const vi more = v > most;
            most = (vf)((more & (vi)v) | (~more & (vi)most));
        }
        float top = -INFINITY;
        for (int l = 0; l < W; l++) top = most[l] > top ? most[l] : top;
        for (; j < L; j++) top = row[j] > top ? row[j] : top;
        /* exp over the row, then the normaliser; pads weigh exactly 0 (x + 0 = x). */
        const vf m = splat(top);
        vf total = (vf){0};
        for (j = 0; j < padded; j += W) {
            /* Lanes past L (the last vector's pads) are cleared by a mask: writing single
             * lanes would keep the vector in memory through the whole loop. */
            const vi keep = (lane + j) < splat_i(L);
            const vf e = (vf)((vi)vexp(loadf(row + j) - m) & keep);
            storef(row + j, e);
            total += e;
        }
        denom[h] = reduce(total);
    }
#undef row_of
#undef qs
}

/* Weighted sums of H (<= HEAD_BLOCK, a constant at each call) rows over the first vectors
 * e0 .. e0 + E of V: row h over its own count[h] keys, all rows together over the keys they
 * all see, then each row on alone over the rest (the same multiply-adds in the same order:
 * a row's bits do not depend on the rows beside it); out[h] + e0 = the sums / denom[h]. */
static inline __attribute__((always_inline)) void weighted_rows(
    const float *V, long dv, const float *const *rows, const int *count, const float *denom,
    float *const *out, const int H, int e0, const int E) {
    vf acc[HEAD_BLOCK][VEC_BLOCK];
    int common = count[0];
    for (int h = 0; h < H; h++) {
        common = count[h] < common ? count[h] : common;
        for (int e = 0; e < VEC_BLOCK; e++) acc[h][e] = (vf){0};
    }
    weighted(V, dv, 0, common, rows, H, e0, E, acc);
    for (int h = 0; h < H; h++) {
        if (count[h] > common) weighted(V, dv, common, count[h], rows + h, 1, e0, E, acc + h);
        for (int e = 0; e < E; e++) storef(out[h] + e0 + e * W, acc[h][e] / splat(denom[h]));
    }
}

/* The attention outputs of nrows rows (a token's head each, all over the same keys and
 * values V: one slot and kv head) from their exp'd scores: rows[h] (count[h] of them),
 * normaliser denom[h], written to out[h] (d floats). Tiles of HEAD_BLOCK rows x VEC_BLOCK
 * vectors load each value once for the tile's rows. */
static void outputs(const attn_t *p, const float *V, int nrows, const float *const *rows,
                    const int *count, const float *denom, float *const *out) {
    const int d = p->d, dvec = d - d % W;
    for (int h0 = 0; h0 < nrows; h0 += HEAD_BLOCK) {
        const int H = nrows - h0 < HEAD_BLOCK ? nrows - h0 : HEAD_BLOCK;
        for (int e0 = 0; e0 < dvec; e0 += VEC_BLOCK * W) {
            const int E = (dvec - e0) / W < VEC_BLOCK ? (dvec - e0) / W : VEC_BLOCK;
            /* Constant H and E (the compiler keeps the accumulators in registers). */
#define ROWS(h_, e_)                                                                        \
    case (h_) * VEC_BLOCK + (e_):                                                           \
        weighted_rows(V, p->dv, rows + h0, count + h0, denom + h0, out + h0, h_, e0, e_);   \
        break
#define ROWS_E(h_) ROWS(h_, 1); ROWS(h_, 2); ROWS(h_, 3); ROWS(h_, 4)
            switch (H * VEC_BLOCK + E) {
                ROWS_E(1); ROWS_E(2); ROWS_E(3); ROWS_E(4); ROWS_E(5); ROWS_E(6);
            default: break;
            }
#undef ROWS_E
#undef ROWS
        }
        for (int h = h0; h < h0 + H; h++)
            for (int e = dvec; e < d; e++) {
                float acc = 0.0f;
                for (int j = 0; j < count[h]; j++)
                    acc = sfma(rows[h][j], V[(long)j * p->dv + e], acc);
                out[h][e] = acc / denom[h];
            }
    }
}

/* A block of T consecutive tokens i0 .. i0 + T - 1 of one slot, kv head g: the T x repeats
 * query heads that share its keys and values. Each row's softmax is its own (softmax_rows);
 * the weighted sums load each value once for a tile of rows (outputs). scores holds T x
 * repeats rows of stride floats (the block's largest count rounded up to W); scaled, repeats
 * x d floats. */
static void block(const attn_t *p, int i0, int T, int g, float *scores, long stride,
                  float *scaled) {
    const int repeats = p->heads / p->kv, nrows = T * repeats;
    const float *V = p->values + ((long)p->slot[i0] * p->kv + g) * p->cap * p->dv;
    float denom[MAX_BLOCK_ROWS];
    const float *rows[MAX_BLOCK_ROWS];
    int count[MAX_BLOCK_ROWS];
    float *out[MAX_BLOCK_ROWS];
    for (int h = 0; h < nrows; h++) {
        const int i = i0 + h / repeats, r = h % repeats;
        rows[h] = scores + (long)h * stride;
        count[h] = p->count[i];
        out[h] = p->out + ((long)i * p->heads + g * repeats + r) * p->d;
    }
    block_softmax(p, i0, T, g, scores, stride, scaled, count, denom);
    outputs(p, V, nrows, rows, count, denom, out);
}

/* -- threads: items in chunks, taken by whichever thread is free ------------------------ */

enum { MAX_THREADS = 8, CHUNK_ITEMS = 2 };

/* The most tokens a block gathers: BLOCK_ROWS rows' worth, at least one token. */
static int block_tokens(const attn_t *p) {
    const int repeats = p->heads / p->kv;
    return repeats >= BLOCK_ROWS ? 1 : BLOCK_ROWS / repeats;
}
/* Below this many multiply-adds a call stays on the calling thread (a decode step's layer:
 * starting helpers would cost more than it saves). */
static const double MIN_PARALLEL_WORK = 4.0e6;

extern int mtplx_qmm_threads(void); /* the quantized kernel's thread setting, shared */

typedef struct {
    const attn_t *p;
    const int *starts; /* [blocks + 1]: the first token of each block, then n */
    int blocks;
    atomic_int next;
    int max_count;
} run_t;

static void *worker(void *arg) {
    run_t *run = arg;
    const attn_t *p = run->p;
    const int items = run->blocks * p->kv;
    const size_t stride = (size_t)(run->max_count + W - 1) / W * W;
    const size_t rows = (size_t)(p->heads / p->kv) * (size_t)block_tokens(p);
    /* Scratch on the heap (threads' stacks may be small): a block's rows of scores, then
     * their scaled queries. */
    const size_t bytes = sizeof(float) * (stride + (size_t)p->d) * rows;
    float *scores = aligned_alloc(64, (bytes + 127) / 64 * 64);
    if (scores == NULL) return (void *)1;
    float *scaled = scores + stride * rows;
    for (;;) {
        const int start = atomic_fetch_add(&run->next, CHUNK_ITEMS);
        if (start >= items) break;
        const int end = start + CHUNK_ITEMS < items ? start + CHUNK_ITEMS : items;
        for (int it = start; it < end; it++) {
            const int b = it / p->kv;
            block(p, run->starts[b], run->starts[b + 1] - run->starts[b], it % p->kv, scores,
                  (long)stride, scaled);
        }
    }
    free(scores);
    return NULL;
}

static int threads_override = 0;
static atomic_ulong split_calls;

/* Threads for attention (0: the quantized kernel's setting); for tests. */
void mtplx_attn_set_threads(int threads) { threads_override = threads < 0 ? 0 : threads; }
unsigned long mtplx_attn_split_calls(void) { return atomic_load(&split_calls); }

/* out [n, heads, d] = the attention above. Returns 0, -1 for shapes the kernel does not take,
 * -2 for a slot or count out of the store's range (nothing read out of bounds), -3 when
 * memory runs out. */
int mtplx_attend(const float *q, const float *keys, const float *values, const int32_t *slot,
                 const int32_t *count, int n, int heads, int kv, int d, int slots, int cap,
                 int dv, float scale, float *out) {
    if (heads <= 0 || kv <= 0 || heads % kv != 0 || heads / kv > MAX_REPEATS || d <= 0 ||
        d > 512 || dv < d)
        return -1;
    int max_count = 1;
    double work = 0.0;
    for (int i = 0; i < n; i++) {
        if (slot[i] < 0 || slot[i] >= slots || count[i] < 1 || count[i] > cap) {
            /* A bug upstream: nothing is read, and the result is NaN, visibly (an error
             * raised on MLX's worker thread does not reach the caller). */
            for (long e = 0; e < (long)n * heads * d; e++) out[e] = NAN;
            return -2;
        }
        max_count = count[i] > max_count ? count[i] : max_count;
        work += (double)count[i];
    }
    work *= 2.0 * heads * d;
    attn_t p = {q, keys, values, slot, count, out, n, heads, kv, d, cap, dv, scale};
    /* Blocks: runs of consecutive tokens of one slot, at most block_tokens each (a prompt
     * chunk's tokens, a verify's; decode rows are blocks of one). */
    int *starts = malloc(sizeof(int) * ((size_t)n + 1));
    if (starts == NULL) return -3;
    int blocks = 0;
    for (int i = 0, most = block_tokens(&p); i < n; blocks++) {
        const int first = i;
        starts[blocks] = i++;
        while (i < n && i - first < most && slot[i] == slot[first]) i++;
    }
    starts[blocks] = n;
    run_t run = {&p, starts, blocks, 0, max_count};
    int threads = threads_override ? threads_override : mtplx_qmm_threads();
    threads = threads > MAX_THREADS ? MAX_THREADS : threads;
    if (work < MIN_PARALLEL_WORK) threads = 1;
    pthread_t helpers[MAX_THREADS];
    int started = 0;
    for (int t = 1; t < threads; t++)
        if (pthread_create(&helpers[started], NULL, worker, &run) == 0) started++;
    if (started) atomic_fetch_add(&split_calls, 1);
    void *failed = worker(&run);
    for (int t = 0; t < started; t++) {
        void *result = NULL;
        pthread_join(helpers[t], &result);
        failed = failed ? failed : result;
    }
    free(starts);
    return failed ? -3 : 0;
}
