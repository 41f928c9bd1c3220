/* A llama decoder layer's two halves around attention, each in one call, for the CPU:
 *
 *   before: h = rms_norm(x) * norm_w;  [q | k | v] = h @ Wqkv^T;  q, k = rope(q), rope(k)
 *   after:  x1 = x + attended @ Wo^T;  h = rms_norm(x1) * norm_w;  [g | u] = h @ Wgu^T;
 *           out = x1 + (silu(g) * u) @ Wdown^T
 *
 * with every product on the batch-invariant quantized kernel (quant_kernel.c's mtplx_qmm).
 *
 * Why: on MLX's CPU backend these are ~20 graph nodes a layer (norms, RoPE, activation,
 * residuals, slices and reshapes around the products), each costing a dispatch and an
 * allocation whatever it computes; a decode step of the default model spends about as long
 * dispatching them as computing. Here each half is one node.
 *
 * Bits: every elementwise step is MLX's own operation on its CPU backend, in MLX's order,
 * one IEEE rounding each (this file is built with -ffp-contract=off, so no multiply-add is
 * fused): the output equals MLX's ops (mx.fast.rms_norm's CPU fallback, mlx's RoPE applied as
 * the trunk applies it, mlx-lm's swiglu) bit for bit.
 * - rms_norm: s = sum of x_i * x_i in ascending i, one float accumulator from 0 (MLX's CPU
 *   sum over a contiguous axis with its scalar SIMD width on x86); m = s * (1 / H) (mean's
 *   normaliser, a float32 constant); r = 1 / sqrt(m + eps); out_i = (x_i * r) * w_i.
 * - RoPE (mlx's non-traditional layout): out_j = x_j c_j - x_{j+h} s_j, out_{j+h} = x_j s_j +
 *   x_{j+h} c_j, each product rounded, over the first `dims` features, the rest copied; the
 *   angles' cos and sin come from the caller (computed once per forward by MLX).
 * - silu(g) * u: sigmoid as MLX's CPU sigmoid (y = 1 / (1 + exp(|g|)), g < 0 ? y : 1 - y,
 *   with MLX's own CPU exp, mlx_exp below), then (g * sig) * u.
 * - residual adds: one addition each.
 * Every step reads only its own row (token), so a token's result does not depend on the
 * other rows of the call: batch invariance is the products' (mtplx_qmm), kept.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

extern int mtplx_qmm(const float *x, int M, int K, const uint32_t *w, const void *scales,
                     const void *biases, int half, int N, int bits, int group, float *y);
extern void mtplx_parallel_rows(void (*fn)(void *ctx, int lo, int hi), void *ctx, int rows,
                                int grain);
extern int mtplx_qmm_int8(const float *x, int M, int K, const uint32_t *w, const void *scales,
                          const void *biases, int half, int N, int bits, int group, float *y);

/* A quantized weight as mtplx_qmm takes it: [N, K] in MLX's affine layout. */
typedef struct {
    const uint32_t *w;
    const void *scales;
    const void *biases;
    int half; /* scales and biases are float16 (else float32) */
    int N, K, bits, group;
    int int8; /* the product's rows quantized to 8 bits per group (mtplx_qmm_int8) */
} mtplx_qweight;

/* Scratch for a call's intermediate rows: a decode step's (a few KB) is kept per thread and
 * reused, since malloc and free of it in every call of every layer showed in profiles; a
 * prompt chunk's (MBs) is allocated for the call and freed, so no thread holds it after. */
enum { KEPT_SCRATCH = 1 << 20 };
static __thread float *kept;
static __thread size_t kept_bytes;

static float *scratch(size_t bytes) {
    if (bytes > KEPT_SCRATCH) return malloc(bytes);
    if (bytes > kept_bytes) {
        free(kept);
        kept = malloc(KEPT_SCRATCH);
        kept_bytes = kept ? KEPT_SCRATCH : 0;
    }
    return kept;
}

static void release(float *p) {
    if (p != kept) free(p);
}

static int product(const float *x, int M, const mtplx_qweight *w, float *y) {
    return (w->int8 ? mtplx_qmm_int8 : mtplx_qmm)(x, M, w->K, w->w, w->scales, w->biases,
                                                  w->half, w->N, w->bits, w->group, y);
}

/* rms_norm of n rows of H: see the header for the order. */
static void rms_norm(const float *x, const float *w, float eps, int n, int H, float *out) {
    const float inv = (float)(1.0 / (double)H);
    for (int i = 0; i < n; i++) {
        const float *row = x + (long)i * H;
        float *o = out + (long)i * H;
        float s = 0.0f;
        for (int e = 0; e < H; e++) {
            const float sq = row[e] * row[e];
            s = s + sq;
        }
        const float r = 1.0f / sqrtf(s * inv + eps);
        for (int e = 0; e < H; e++) {
            const float scaled = row[e] * r;
            o[e] = scaled * w[e];
        }
    }
}

/* mx.fast.rms_norm on the CPU, alone (for tests). */
void mtplx_layer_rms_norm(const float *x, const float *w, float eps, int n, int H, float *out) {
    rms_norm(x, w, eps, n, H, out);
}

/* MLX's CPU exp (simd::exp at its scalar width): 2^(x log2 e) as 2^round(.) times a
 * degree-6 polynomial of the fraction in fused multiply-adds (fmaf: one rounding each, in
 * hardware or in the C library alike), the bounds and NaN as MLX selects them. */
static inline float mlx_exp(float x_init) {
    if (isnan(x_init)) return x_init;
    if (x_init > 88.0f) return INFINITY;
    if (x_init < -88.0f) return 0.0f;
    const float x = x_init * 1.442695f;
    /* floor(x + 0.5) with 0.5 a double: exact in double, an integer that a float holds */
    const float ipart = (float)floor((double)x + 0.5);
    const float fpart = x - ipart;
    float p = 1.535336188319500e-4f;
    p = fmaf(p, fpart, 1.339887440266574e-3f);
    p = fmaf(p, fpart, 9.618437357674640e-3f);
    p = fmaf(p, fpart, 5.550332471162809e-2f);
    p = fmaf(p, fpart, 2.402264791363012e-1f);
    p = fmaf(p, fpart, 6.931472028550421e-1f);
    p = fmaf(p, fpart, 1.000000000000000f);
    const uint32_t bits = (uint32_t)((int32_t)ipart + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return scale * p;
}

float mtplx_layer_exp(float x) { return mlx_exp(x); }

/* MLX's CPU sigmoid: y = 1 / (1 + exp(|g|)), g < 0 ? y : 1 - y. */
static inline float sigmoid(float g) {
    const float y = 1.0f / (1.0f + mlx_exp(fabsf(g)));
    return g < 0.0f ? y : 1.0f - y;
}

#if defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#if defined(__AVX512F__)
#define LW 16
#else
#define LW 8
#endif
typedef float lvf __attribute__((vector_size(LW * 4)));
typedef int32_t lvi __attribute__((vector_size(LW * 4)));

/* (a splat of -0.0f this way is +0.0f: 0 + -0 = +0) */
static inline lvf lsplat(float s) { return (lvf){0} + s; }

static inline lvf lfma(lvf a, lvf b, lvf c) {
#if LW == 16
    return _mm512_fmadd_ps(a, b, c);
#else
    return _mm256_fmadd_ps(a, b, c);
#endif
}

static inline lvf lselect(lvi mask, lvf yes, lvf no) {
    return (lvf)((mask & (lvi)yes) | (~mask & (lvi)no));
}

/* mlx_exp in LW lanes, every lane the scalar's operations (the same bits): floor(x + 0.5) in
 * double is x's round-half-up, taken here as floor(x) plus one where x - floor(x) >= 0.5
 * (both exact in float for |x| < 2^23); the bounds and NaN selected after. */
static inline lvf mlx_exp_lanes(lvf x_init) {
    const lvf bound = lsplat(88.0f);
    const lvf clamped = lselect(x_init > bound, bound, lselect(x_init < -bound, -bound, x_init));
    const lvf x = lselect(x_init != x_init, lsplat(0.0f), clamped) * lsplat(1.442695f);
    lvf whole = __builtin_convertvector(__builtin_convertvector(x, lvi), lvf); /* toward 0 */
    whole = lselect(whole > x, whole - lsplat(1.0f), whole);                  /* floor */
    const lvf ipart = lselect(x - whole >= lsplat(0.5f), whole + lsplat(1.0f), whole);
    const lvf fpart = x - ipart;
    lvf p = lsplat(1.535336188319500e-4f);
    p = lfma(p, fpart, lsplat(1.339887440266574e-3f));
    p = lfma(p, fpart, lsplat(9.618437357674640e-3f));
    p = lfma(p, fpart, lsplat(5.550332471162809e-2f));
    p = lfma(p, fpart, lsplat(2.402264791363012e-1f));
    p = lfma(p, fpart, lsplat(6.931472028550421e-1f));
    p = lfma(p, fpart, lsplat(1.000000000000000f));
    const lvi bits = (__builtin_convertvector(ipart, lvi) + 127) << 23;
    lvf y = (lvf)bits * p;
    y = lselect(x_init > bound, lsplat(INFINITY), y);
    y = lselect(x_init < -bound, lsplat(0.0f), y);
    return lselect(x_init != x_init, x_init, y);
}

/* silu(g) * u in LW lanes: sigmoid's 1 / (1 + exp(|g|)) and g < 0 ? y : 1 - y, as below. */
static inline lvf swiglu_lanes(lvf g, lvf u) {
    const lvf magnitude = (lvf)((lvi)g & ((lvi){0} + 0x7fffffff)); /* fabsf */
    const lvf y = lsplat(1.0f) / (lsplat(1.0f) + mlx_exp_lanes(magnitude));
    const lvf sig = lselect(g < lsplat(0.0f), y, lsplat(1.0f) - y);
    return (g * sig) * u;
}
#endif

/* mlx-lm's swiglu over n rows: gate_up [n, 2 I] ([gate | up]) -> out [n, I]. Vector builds
 * take LW elements at a time through the lane copies above (MLX's exp is scalar on the CPU,
 * ~10 ns an element: a prompt chunk's activations showed in profiles). */
static void swiglu(const float *gate_up, int n, int I, float *out) {
    for (int i = 0; i < n; i++) {
        const float *g = gate_up + (long)i * 2 * I, *u = g + I;
        float *o = out + (long)i * I;
        int e = 0;
#if defined(__FMA__) || defined(__AVX512F__)
        for (; e + LW <= I; e += LW) {
            lvf gv, uv;
            memcpy(&gv, g + e, sizeof gv);
            memcpy(&uv, u + e, sizeof uv);
            const lvf ov = swiglu_lanes(gv, uv);
            memcpy(o + e, &ov, sizeof ov);
        }
#endif
        for (; e < I; e++) {
            const float silu = g[e] * sigmoid(g[e]);
            o[e] = silu * u[e];
        }
    }
}

void mtplx_layer_swiglu(const float *gate_up, int n, int I, float *out) {
    swiglu(gate_up, n, I, out);
}

/* One head's RoPE: src [d] -> dst [d], angles c, s [dims / 2]. */
static inline void rope(const float *src, const float *c, const float *s, int d, int dims,
                        float *dst) {
    const int half = dims / 2;
    for (int j = 0; j < half; j++) {
        const float x1 = src[j], x2 = src[j + half];
        const float a = x1 * c[j], b = x2 * s[j];
        const float e = x1 * s[j], f = x2 * c[j];
        dst[j] = a - b;
        dst[j + half] = e + f;
    }
    for (int j = dims; j < d; j++) dst[j] = src[j];
}

/* -- the row-wise steps of a call, split over rows (quant_kernel.c's pool) ------------------
 * A prompt chunk's hundreds of rows would otherwise run on one thread between products while
 * the others wait. Each row is computed on its own, so the split changes no bit. */

/* Rows a chunk takes: about 16K elements of rows of `width` floats. */
static int grain(int width) { return width >= (1 << 14) ? 1 : (1 << 14) / width; }

typedef struct {
    const float *x, *w, *add;
    float eps;
    int H;
    float *sum, *out;
} norm_t;

static void norm_some(void *ctx, int lo, int hi) {
    const norm_t *a = ctx;
    const long at = (long)lo * a->H;
    rms_norm(a->x + at, a->w, a->eps, hi - lo, a->H, a->out + at);
}

/* out = rms_norm(x) * w over n rows. */
static void rms_norm_rows(const float *x, const float *w, float eps, int n, int H, float *out) {
    norm_t a = {x, w, NULL, eps, H, NULL, out};
    mtplx_parallel_rows(norm_some, &a, n, grain(H));
}

static void add_some(void *ctx, int lo, int hi) {
    const norm_t *a = ctx;
    for (long e = (long)lo * a->H; e < (long)hi * a->H; e++) a->sum[e] = a->x[e] + a->add[e];
}

/* sum = x + add, n rows of H (sum may be add). */
static void add_rows(const float *x, const float *add, int n, int H, float *sum) {
    norm_t a = {x, NULL, add, 0.0f, H, sum, NULL};
    mtplx_parallel_rows(add_some, &a, n, grain(H));
}

typedef struct {
    const float *gate_up;
    int I;
    float *out;
} swiglu_t;

static void swiglu_some(void *ctx, int lo, int hi) {
    const swiglu_t *a = ctx;
    swiglu(a->gate_up + (long)lo * 2 * a->I, hi - lo, a->I, a->out + (long)lo * a->I);
}

typedef struct {
    const float *y, *cos, *sin;
    int width, heads, kv, d, dims, rope_rows;
    float *q, *k, *v;
} rope_t;

/* The first half's rows lo..hi: RoPE on q and k, v copied (see mtplx_layer_before). */
static void rope_some(void *ctx, int lo, int hi) {
    const rope_t *a = ctx;
    const int d = a->d, half = a->dims / 2;
    for (int i = lo; i < hi; i++) {
        const float *row = a->y + (long)i * a->width;
        const long at = a->rope_rows == 1 ? 0 : (long)i * half;
        for (int head = 0; head < a->heads; head++)
            rope(row + (long)head * d, a->cos + at, a->sin + at, d, a->dims,
                 a->q + ((long)i * a->heads + head) * d);
        for (int head = 0; head < a->kv; head++)
            rope(row + (long)(a->heads + head) * d, a->cos + at, a->sin + at, d, a->dims,
                 a->k + ((long)i * a->kv + head) * d);
        memcpy(a->v + (long)i * a->kv * d, row + (long)(a->heads + a->kv) * d,
               sizeof(float) * a->kv * d);
    }
}

/* The first half: x [n, H] -> q [n, heads, d], k [n, kv, d], v [n, kv, d] (q, k roped).
 * cos, sin: [rope_rows, dims / 2], one row per token (rope_rows == n) or one for all (1).
 * Returns 0, -1 for arguments the products do not take, -3 when memory runs out. */
int mtplx_layer_before(const float *x, int n, int H, const float *norm, float eps,
                       const mtplx_qweight *qkv, int heads, int kv, int d, int dims,
                       const float *cos, const float *sin, int rope_rows, float *q, float *k,
                       float *v) {
    const int width = qkv->N;
    if (qkv->K != H || width != (heads + 2 * kv) * d || dims > d || dims % 2) return -1;
    float *h = scratch(sizeof(float) * ((size_t)n * H + (size_t)n * width));
    if (h == NULL) return -3;
    float *y = h + (size_t)n * H;
    rms_norm_rows(x, norm, eps, n, H, h);
    int status = product(h, n, qkv, y);
    if (status == 0) {
        rope_t a = {y, cos, sin, width, heads, kv, d, dims, rope_rows, q, k, v};
        mtplx_parallel_rows(rope_some, &a, n, grain(width));
    }
    release(h);
    return status;
}

/* The second half: x [n, H], attended [n, A] -> out [n, H] (see the header).
 * Returns 0, -1 for arguments the products do not take, -3 when memory runs out. */
int mtplx_layer_after(const float *x, const float *attended, int n, int H,
                      const mtplx_qweight *o_proj, const float *norm, float eps,
                      const mtplx_qweight *gate_up, const mtplx_qweight *down, float *out) {
    const int I = down->K;
    if (o_proj->N != H || gate_up->K != H || gate_up->N != 2 * I || down->N != H) return -1;
    const size_t rows = (size_t)n;
    float *x1 = scratch(sizeof(float) * (rows * H * 2 + rows * 3 * I));
    if (x1 == NULL) return -3;
    float *h = x1 + rows * H, *gu = h + rows * H, *g = gu + rows * 2 * I;
    int status = product(attended, n, o_proj, x1);
    if (status == 0) {
        add_rows(x, x1, n, H, x1);
        rms_norm_rows(x1, norm, eps, n, H, h);
        status = product(h, n, gate_up, gu);
    }
    if (status == 0) {
        swiglu_t a = {gu, I, g};
        mtplx_parallel_rows(swiglu_some, &a, n, grain(3 * I));
        status = product(g, n, down, out);
    }
    if (status == 0) add_rows(x1, out, n, H, out);
    release(x1);
    return status;
}

/* A generic MTP head's step around its layer (mtplx/models/fused_head.py), each end one call:
 *
 *   into: out = [rms_norm(e) * w_e | rms_norm(h) * w_h] @ Wfc^T   (e: the next tokens'
 *         embeddings, h: the target's hidden states; n rows of H each, the product over 2H)
 *   out:  normed = rms_norm(x) * w;  logits = normed[at] @ Whead^T   (the rows at `at` only)
 *
 * The same steps in the same order as the compiled MLX functions they replace (the norms as
 * rms_norm above, the products mtplx_qmm's, whose sums do not depend on the row count), so the
 * same bits in one graph node each instead of ~9 and ~5. */

/* into: e, h [n, H] -> out [n, fc->N]. Returns 0, -1 for arguments the product does not
 * take, -3 when memory runs out. */
int mtplx_head_into(const float *e, const float *h, int n, int H, const float *w_e,
                    float eps_e, const float *w_h, float eps_h, const mtplx_qweight *fc,
                    float *out) {
    if (fc->K != 2 * H) return -1;
    float *joined = scratch(sizeof(float) * (size_t)n * 2 * H);
    if (joined == NULL) return -3;
    for (int i = 0; i < n; i++) { /* each row's two halves side by side: the concatenation */
        float *row = joined + (size_t)i * 2 * H;
        rms_norm(e + (size_t)i * H, w_e, eps_e, 1, H, row);
        rms_norm(h + (size_t)i * H, w_h, eps_h, 1, H, row + H);
    }
    const int status = product(joined, n, fc, out);
    release(joined);
    return status;
}

/* out: x [n, H] -> normed [n, H] (every row) and logits [R, head->N] of rows at[0 .. R-1]
 * (each clamped into 0 .. n-1, as a slice at a computed start is). Returns as
 * mtplx_head_into. */
int mtplx_head_out(const float *x, int n, int H, const float *w, float eps, const int32_t *at,
                   int R, const mtplx_qweight *head, float *logits, float *normed) {
    if (head->K != H || n < 1) return -1;
    rms_norm(x, w, eps, n, H, normed);
    float *rows = scratch(sizeof(float) * (size_t)R * H);
    if (rows == NULL) return -3;
    for (int r = 0; r < R; r++) {
        const int i = at[r] < 0 ? 0 : at[r] >= n ? n - 1 : at[r];
        memcpy(rows + (size_t)r * H, normed + (size_t)i * H, sizeof(float) * H);
    }
    const int status = product(rows, R, head, logits);
    release(rows);
    return status;
}

/* -- sampling: a temperature's softmax, the filters, the inverse-CDF draw, the exact verdict --
 * mtplx.sampling.fast_path's sampled path (mx_distribution_from_logits' softmax and top-k / top-p /
 * min-p filters, mx_sample, mx_verify_draft_tokens) one call each, every step MLX's CPU operation in MLX's order, so the
 * bits are MLX's ops' (tests/sampling/test_fast_path.py compares them bitwise):
 * - p = softmax((l - max l) / T): the max; s_j = (l_j - max) / T, two roundings; then MLX's
 *   CPU softmax of s at its scalar SIMD width on x86: M = max s, e_j = exp(s_j - M) with MLX's
 *   exp (mlx_exp, LW lanes at a time through mlx_exp_lanes: the same bits), a sequential
 *   float sum of the e_j from 0, r = 1 / sum, p_j = e_j * r. Where MLX spends ~16 ns an
 *   element in its scalar exp, the lanes take ~1.
 * - a draw: cumulative sums sequential from the first weight (MLX's CPU scan); the token is
 *   the number of sums <= u * total (the sums never decrease, so the first that exceeds it;
 *   a NaN stays NaN and exceeds nothing), or the last positive weight where that is all V.
 * - the verdict: draft i accepted while q_i(x) > 0 and u_i < p_i(x) / q_i(x) (one float
 *   division); then a draw from max(p - q, 0) at the first rejected position (from p where
 *   that has no mass), or from p after the last draft.
 * Each row on its own: a row's bits never depend on the others, nor on how many there are. */

/* max over n floats, a NaN above all (MLX's max reduction); order-free: the ±0 a tie of
 * zeros may give changes nothing downstream (x - ±0 and exp of ±0 agree). */
static float row_max(const float *x, long n) {
    float m = -INFINITY;
    long j = 0;
#if defined(__FMA__) || defined(__AVX512F__)
    if (n >= LW) {
        lvf vm = lsplat(-INFINITY);
        lvi nan = (lvi){0};
        for (; j + LW <= n; j += LW) {
            lvf v;
            memcpy(&v, x + j, sizeof v);
            vm = lselect(v > vm, v, vm);
            nan |= v != v;
        }
        for (int t = 0; t < LW; t++) {
            if (nan[t]) return NAN;
            m = vm[t] > m ? vm[t] : m;
        }
    }
#endif
    for (; j < n; j++) {
        if (x[j] != x[j]) return x[j];
        m = x[j] > m ? x[j] : m;
    }
    return m;
}

/* One row: p [V] = softmax((l - max l) / T), MLX's bits (see above). */
static void softmax_row(const float *l, long V, float T, float *p) {
    const float m = row_max(l, V);
    for (long j = 0; j < V; j++) p[j] = (l[j] - m) / T; /* vectorised by the compiler: exact */
    const float top = row_max(p, V);
    float sum = 0.0f;
    long j = 0;
#if defined(__FMA__) || defined(__AVX512F__)
    for (; j + LW <= V; j += LW) {
        lvf v;
        memcpy(&v, p + j, sizeof v);
        const lvf e = mlx_exp_lanes(v - lsplat(top));
        memcpy(p + j, &e, sizeof e);
        for (int t = 0; t < LW; t++) sum += e[t]; /* in index order: MLX's sequential sum */
    }
#endif
    for (; j < V; j++) {
        p[j] = mlx_exp(p[j] - top);
        sum += p[j];
    }
    const float r = 1.0f / sum;
    for (j = 0; j < V; j++) p[j] *= r;
}

/* The k largest of n values f(j) (k <= n), counted with their repeats, into top [k] in
 * descending order: an insertion into a sorted buffer where k is small (a value below the
 * buffer's least is one comparison), a sort of all n values otherwise. */
static int descending(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

typedef struct {
    const float *p;
    float kth;   /* keep p_j >= kth (top-k), -1: no top-k */
    float scale; /* the kept mass: values p_j / scale */
} kept_t;

static inline int kept_at(const kept_t *c, long j) { return c->p[j] > 0.0f && c->p[j] >= c->kth; }

static long kept_zeros(const kept_t *c, long V) { /* tokens not kept: 0 after the renormalising */
    long n = 0;
    for (long j = 0; j < V; j++) n += !kept_at(c, j);
    return n;
}

static void largest(const float *p, const kept_t *c, long n, int k, float *top, float *all) {
    if (k <= 256) {
        int filled = 0;
        for (long j = 0; j < n; j++) {
            const float v = c == NULL ? p[j] : (kept_at(c, j) ? p[j] : 0.0f) / c->scale;
            if (filled == k && !(v > top[k - 1])) continue;
            int at = filled < k ? filled++ : k - 1;
            while (at > 0 && top[at - 1] < v) {
                top[at] = top[at - 1];
                at--;
            }
            top[at] = v;
        }
        return;
    }
    for (long j = 0; j < n; j++)
        all[j] = c == NULL ? p[j] : (kept_at(c, j) ? p[j] : 0.0f) / c->scale;
    qsort(all, (size_t)n, sizeof(float), descending);
    memcpy(top, all, sizeof(float) * (size_t)k);
}

/* Top-p without top-k: the renormalised kept values in descending order (MLX sorts the whole
 * row) are popped from a max-heap only until the mass before the next reaches top_p, since
 * no later one can count (the masses never decrease): the value the nucleus ends at. The
 * kept zeros come last, each with the whole mass before it. heap [V]: scratch. */
static void sift_down(float *heap, long n, long at) {
    for (;;) {
        long big = at, left = 2 * at + 1, right = left + 1;
        if (left < n && heap[left] > heap[big]) big = left;
        if (right < n && heap[right] > heap[big]) big = right;
        if (big == at) return;
        const float t = heap[at];
        heap[at] = heap[big];
        heap[big] = t;
        at = big;
    }
}

static float nucleus_end(const float *p, const kept_t *c, long V, float top_p, float *heap) {
    long n = 0;
    for (long j = 0; j < V; j++)
        if (kept_at(c, j)) heap[n++] = p[j] / c->scale;
    for (long at = n / 2 - 1; at >= 0; at--) sift_down(heap, n, at);
    float before = 0.0f, last = 0.0f;
    int first = 1; /* the nucleus holds at least the first */
    while (n > 0 && (before < top_p || first)) {
        last = heap[0];
        first = 0;
        before += last;
        heap[0] = heap[--n];
        sift_down(heap, n, 0);
    }
    if (n == 0 && before < top_p && kept_zeros(c, V) > 0) return 0.0f;
    return last;
}

/* mx_apply_top_p_top_k on one row p [V] in place, MLX's bits: top-k keeps p >= the k-th
 * largest; top-p renormalises the kept p by their sequential sum, takes them in descending
 * order (the k largest with top-k), their exclusive sequential cumulative sums, keeps p whose
 * renormalised value is >= the last value whose mass before is below top_p (at least the
 * first); min-p keeps p >= min_p * max p; then p = kept / their sequential sum, one division
 * each. top [k] and all [V]: scratch. */
static void filter_row(float *p, long V, int top_k, float top_p, float min_p, float *top,
                       float *all) {
    const int use_top_k = 0 < top_k && top_k < V;
    kept_t c = {p, -1.0f, 1.0f};
    if (use_top_k) {
        largest(p, NULL, V, top_k, top, all);
        c.kth = top[top_k - 1];
    }
    float threshold = 0.0f; /* keeps every kept p where no top-p */
    if (top_p < 1.0f) {
        float mass = 0.0f;
        for (long j = 0; j < V; j++) mass += kept_at(&c, j) ? p[j] : 0.0f;
        c.scale = mass;
    }
    if (!use_top_k && top_p < 1.0f) threshold = nucleus_end(p, &c, V, top_p, all);
    if (use_top_k && top_p < 1.0f) {
        largest(p, &c, V, top_k, top, all);
        float before = 0.0f;
        int count = 0;
        for (int i = 0; i < top_k; i++) {
            count += before < top_p;
            before += top[i];
        }
        threshold = top[(count > 1 ? count : 1) - 1];
    }
    const float floor_p = min_p > 0.0f ? min_p * row_max(p, V) : 0.0f;
    float total = 0.0f;
    for (long j = 0; j < V; j++) {
        int keep = kept_at(&c, j) && (kept_at(&c, j) ? p[j] : 0.0f) / c.scale >= threshold;
        if (min_p > 0.0f) keep = keep && p[j] >= floor_p;
        all[j] = keep ? p[j] : 0.0f;
        total += all[j];
    }
    for (long j = 0; j < V; j++) p[j] = all[j] / total;
}

/* p [n, V] = softmax((logits - max) / T) per row, then filtered where top_k (0 < top_k < V),
 * top_p (< 1) or min_p (> 0) asks; scratch: top_k + V floats. */
void mtplx_softmax_rows(const float *logits, long n, long V, float T, int top_k, float top_p,
                        float min_p, float *p, float *scratch) {
    const int filter = (0 < top_k && top_k < V) || top_p < 1.0f || min_p > 0.0f;
    for (long i = 0; i < n; i++) {
        softmax_row(logits + i * V, V, T, p + i * V);
        if (filter) filter_row(p + i * V, V, top_k, top_p, min_p, scratch, scratch + top_k);
    }
}

/* The weight of token j: p_j, or max(p_j - q_j, 0) (MLX's maximum: a NaN stays). */
static inline float weight(const float *p, const float *q, long j) {
    if (q == NULL) return p[j];
    const float r = p[j] - q[j];
    return r != r ? r : r > 0.0f ? r : 0.0f;
}

/* The sequential sum of the weights: the last inclusive cumulative sum. */
static float weight_total(const float *p, const float *q, long V) {
    float c = 0.0f;
    for (long j = 0; j < V; j++) c += weight(p, q, j);
    return c;
}

/* mx_sample's token from the weights (total: weight_total's) and the uniform u. */
static int32_t draw(const float *p, const float *q, long V, float total, float u) {
    const float threshold = u * total;
    float c = 0.0f;
    for (long j = 0; j < V; j++) {
        c += weight(p, q, j);
        if (!(c <= threshold)) return (int32_t)j;
    }
    for (long j = V - 1; j >= 0; j--) /* u rounded up to the total: the last live token */
        if (weight(p, q, j) > 0.0f) return (int32_t)j;
    return (int32_t)(V - 1);
}

/* tokens [n]: a draw from each row of the weights w [n, V] with its uniform u [n]. */
void mtplx_draw_rows(const float *w, long n, long V, const float *u, int32_t *tokens) {
    for (long i = 0; i < n; i++) {
        const float *row = w + i * V;
        tokens[i] = draw(row, NULL, V, weight_total(row, NULL, V), u[i]);
    }
}

/* The exact rule over one row's k drafts: x [k + 1, V] (p where T <= 0, else logits whose
 * softmax((x - max x) / T) is p, each row's computed into scratch [V] only when the verdict
 * reaches it), drafts [k], qs: each draft position's q [V], accept_u [k], sample_u -> tokens [k + 1]
 * (the accepted drafts, the recovered or bonus token, -1 after); returns the accepted
 * count, or -1 for a draft outside the vocabulary. */
int mtplx_sampled_verdict(const float *x, long V, int k, float T, const int32_t *drafts,
                          const float *const *qs, const float *accept_u, float sample_u,
                          float *scratch, int32_t *tokens) {
    int count = 0;
    const float *p = x;
    for (;; count++) {
        p = x + (long)count * V;
        if (T > 0.0f) {
            softmax_row(p, V, T, scratch);
            p = scratch;
        }
        if (count == k) break;
        const int32_t token = drafts[count];
        if (token < 0 || token >= V) return -1;
        const float q = qs[count][token];
        if (!(q > 0.0f && accept_u[count] < p[token] / q)) break;
        tokens[count] = token;
    }
    const float *q = count < k ? qs[count] : NULL;
    float total = weight_total(p, q, V);
    if (!(total > 0.0f) && q != NULL) { /* no residual mass: p itself */
        q = NULL;
        total = weight_total(p, NULL, V);
    }
    tokens[count] = draw(p, q, V, total, sample_u);
    for (int i = count + 1; i <= k; i++) tokens[i] = -1;
    return count;
}
