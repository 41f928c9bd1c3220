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
 * Threads: (token, kv head) items are taken in chunks by whichever thread is free; each item
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

/* One (token, kv head) item: its heads / kv query heads, one after another. scratch holds
 * count rounded up to W floats. */
static void item(const attn_t *p, int i, int g, float *scores) {
    const int d = p->d, L = p->count[i], repeats = p->heads / p->kv;
    const int dvec = d - d % W, padded = (L + W - 1) / W * W;
    const long base = ((long)p->slot[i] * p->kv + g) * p->cap;
    const float *K = p->keys + base * d;
    const float *V = p->values + base * p->dv;
    float qs[512]; /* scaled query; d <= 512 is checked by the caller */
    for (int r = 0; r < repeats; r++) {
        const int h = g * repeats + r;
        const float *q = p->q + ((long)i * p->heads + h) * d;
        for (int e = 0; e < d; e++) qs[e] = q[e] * p->scale;
        float top = -INFINITY;
        for (int j = 0; j < L; j++) {
            const float *k = K + (long)j * d;
            float s;
            if (dvec) {
                vf acc = loadf(qs) * loadf(k);
                for (int e = W; e < dvec; e += W) acc = vfma(loadf(qs + e), loadf(k + e), acc);
                s = reduce(acc);
            } else {
                s = 0.0f;
            }
            for (int e = dvec; e < d; e++) s = sfma(qs[e], k[e], s);
            scores[j] = s;
            top = s > top ? s : top;
        }
        /* exp over the row, then the normaliser; pads weigh exactly 0 (x + 0 = x). */
        const vf m = splat(top);
        vf total = (vf){0};
        for (int j = 0; j < padded; j += W) {
            vf e = vexp(loadf(scores + j) - m);
            if (j + W > L)
                for (int l = L - j; l < W; l++) e[l] = 0.0f;
            storef(scores + j, e);
            total += e;
        }
        const float denom = reduce(total);
        float *o = p->out + ((long)i * p->heads + h) * d;
        for (int e = 0; e < dvec; e += W) {
            vf acc = (vf){0};
            for (int j = 0; j < L; j++) acc = vfma(splat(scores[j]), loadf(V + (long)j * p->dv + e), acc);
            storef(o + e, acc / splat(denom));
        }
        for (int e = dvec; e < d; e++) {
            float acc = 0.0f;
            for (int j = 0; j < L; j++) acc = sfma(scores[j], V[(long)j * p->dv + e], acc);
            o[e] = acc / denom;
        }
    }
}

/* -- threads: items in chunks, taken by whichever thread is free ------------------------ */

enum { MAX_THREADS = 8, CHUNK_ITEMS = 8 };
/* Below this many multiply-adds a call stays on the calling thread (a decode step's layer:
 * starting helpers would cost more than it saves). */
static const double MIN_PARALLEL_WORK = 4.0e6;

extern int mtplx_qmm_threads(void); /* the quantized kernel's thread setting, shared */

typedef struct {
    const attn_t *p;
    atomic_int next;
    int max_count;
} run_t;

static void *worker(void *arg) {
    run_t *run = arg;
    const attn_t *p = run->p;
    const int items = p->n * p->kv;
    float *scores = aligned_alloc(64, sizeof(float) * ((size_t)(run->max_count + W - 1) / W * W) + 64);
    if (scores == NULL) return (void *)1;
    for (;;) {
        const int start = atomic_fetch_add(&run->next, CHUNK_ITEMS);
        if (start >= items) break;
        const int end = start + CHUNK_ITEMS < items ? start + CHUNK_ITEMS : items;
        for (int it = start; it < end; it++) item(p, it / p->kv, it % p->kv, scores);
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
    if (heads <= 0 || kv <= 0 || heads % kv != 0 || d <= 0 || d > 512 || dv < d) return -1;
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
    run_t run = {&p, 0, max_count};
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
    return failed ? -3 : 0;
}
