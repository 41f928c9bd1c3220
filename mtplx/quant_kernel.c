/* Batch-invariant product of float32 rows with an MLX affine-quantized weight:
 *
 *     y[m, n] = sum_k x[m, k] * w[n, k],   w[n, k] = scale[n, g] * q[n, k] + bias[n, g]
 *
 * with g = k / group_size, q in 4 or 8 bits packed as MLX packs them (little-endian uint32
 * words, element j of a word in bits [b j, b (j + 1)) for b bits), group sizes 32, 64, 128.
 *
 * Why a kernel of its own: MLX's CPU quantized_matmul dequantizes the weight again for every
 * row (a verify of 8 tokens costs 8 single-token products), and its summation order, like
 * any BLAS's, may depend on the shape. Decoding needs the opposite on both counts: a step of
 * many rows should cost little more than a step of one (weights are read and unpacked once
 * per call, for every row), and a token's logits must not depend on how many other tokens
 * share its forward, so that speculative decoding and continuous batching give the tokens
 * plain decoding gives.
 *
 * Order (the invariance): each weight is dequantized on its own, w = scale q + bias in one
 * multiply-add, and an element's sum runs over "chunks" of 2 W consecutive k (W = the vector
 * width: 8, or 16 for AVX-512 builds) into W lanes: each chunk adds its first vector of W
 * terms, then its second, to the lanes with a multiply-add, chunks in ascending k; the lanes
 * are then added in a fixed halving tree. Which k of a chunk goes to which lane is fixed by
 * the bit width (4-bit chunks are unpacked even elements first, odd elements second, and x
 * is permuted to match; 8-bit chunks are in order). Every step depends on the element's own
 * inputs only: how many rows or columns a call has, how they are tiled into registers and
 * which thread computes a column never changes a bit of it.
 *
 * Whether a multiply-add rounds once or twice is fixed per build (fused with FMA, as every
 * x86 vector variant here is built), never by the compiler's choice (-ffp-contract=off).
 *
 * Speed: a column's weights are unpacked once per call. Up to TILE_ROWS rows they are
 * unpacked in registers and applied to every row at once; beyond, a tile of columns is
 * unpacked to a small scratch panel that stays in L1 while all row tiles pass over it.
 * Columns are split between the calling thread and helpers in chunks of CHUNK_COLS.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define W 16
#define COLS_1 8 /* register tile columns for 1, 2, 3, 4 rows (32 vector registers) */
#define COLS_2 6
#define COLS_3 5
#define COLS_4 4
#else
#define W 8
#define COLS_1 4 /* 16 vector registers: rows x cols accumulators + 2 cols weights + x */
#define COLS_2 3
#define COLS_3 2
#define COLS_4 2
#endif
#define TILE_ROWS 4
#define SPAN (2 * W) /* weights per chunk */

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint8_t vb __attribute__((vector_size(W)));

#if defined(__FMA__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__FMA__) || defined(__AVX512F__)
#define MTPLX_FUSED 1
#if W == 16
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
#else
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
#endif
static inline float sfma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#elif defined(__FP_FAST_FMAF)
#define MTPLX_FUSED 1
static inline vf vfma(vf a, vf b, vf c) {
    for (int i = 0; i < W; i++) c[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return c;
}
static inline float sfma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#else
#define MTPLX_FUSED 0
static inline vf vfma(vf a, vf b, vf c) { return c + a * b; }
static inline float sfma(float a, float b, float c) { return a * b + c; }
#endif

/* Build facts for tests and reports. */
int mtplx_qmm_fused(void) { return MTPLX_FUSED; }
int mtplx_qmm_lanes(void) { return W; }

static inline vf loadf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf splat(float s) { return (vf){0} + s; }

/* The fixed tree over an element's W lanes: the upper half added lane-wise to the lower
 * half until one lane is left. */
typedef float vh __attribute__((vector_size(W * 2)));
static inline float reduce(vf v) {
#if W == 16
    vh h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    typedef float v4 __attribute__((vector_size(16)));
    v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
#else
    typedef float v4 __attribute__((vector_size(16)));
    v4 q = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#endif
    const float a = q[0] + q[2], b = q[1] + q[3];
    return a + b;
}

/* W consecutive bytes, zero-extended to W int32 lanes (one vpmovzxbd where there is one:
 * GCC's generic conversion goes through scalar registers). */
static inline vi widen(const uint8_t *p) {
#if W == 16
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    vi out;
    memcpy(&out, &v, sizeof out);
    return out;
#elif defined(__AVX2__)
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    vi out;
    memcpy(&out, &v, sizeof out);
    return out;
#else
    vb raw;
    memcpy(&raw, p, sizeof raw);
    return __builtin_convertvector(raw, vi);
#endif
}

#if W == 16
/* 0, 1, ..., 15 as floats: the 4-bit values a table holds (exact). */
static inline vf iota16(void) {
    return (vf){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
}
#endif

/* One chunk of a column's weights, dequantized (w = scale * q + bias, one multiply-add):
 * *a holds the chunk's first W (lane order as described above), *b its second W. */
static inline __attribute__((always_inline)) void unpack(const uint8_t *p, const int bits,
                                                          float scale, float bias, vf *a,
                                                          vf *b) {
    const vf s = splat(scale), o = splat(bias);
    if (bits == 4) {
        vi v = widen(p);
#if W == 16
        /* The group's 16 possible weights, table[q] = scale * q + bias by the same
         * multiply-add as below, then looked up by nibble: two permutes instead of two
         * conversions and two multiply-adds, the same bits. (vpermps reads only an index's
         * low 4 bits, so the low nibble needs no mask.) */
        const vf table = vfma(iota16(), s, o);
        __m512 t, lo, hi;
        __m512i ilo, ihi;
        memcpy(&t, &table, sizeof t);
        memcpy(&ilo, &v, sizeof ilo);
        const vi shifted = v >> 4;
        memcpy(&ihi, &shifted, sizeof ihi);
        lo = _mm512_permutexvar_ps(ilo, t);
        hi = _mm512_permutexvar_ps(ihi, t);
        memcpy(a, &lo, sizeof lo);
        memcpy(b, &hi, sizeof hi);
#else
        *a = vfma(__builtin_convertvector(v & 15, vf), s, o);
        *b = vfma(__builtin_convertvector(v >> 4, vf), s, o);
#endif
    } else {
        *a = vfma(__builtin_convertvector(widen(p), vf), s, o);
        *b = vfma(__builtin_convertvector(widen(p + W), vf), s, o);
    }
}

typedef struct {
    const float *x;      /* [M, K] rows in chunk lane order (see prepare) */
    const uint8_t *w;    /* [N, K * bits / 8] */
    const void *scales; /* [N, G], float32 or float16 (half) */
    const void *biases; /* [N, G], the same type */
    float *y;            /* [M, N] */
    int M, N, K, G, bits, group, half;
    /* Integer-dot mode (mtplx_qmm_int8): the rows quantized to 8 bits per group. */
    int int8;
    const int8_t *x8; /* [M, KP] in the variant's element order (see quantize_rows) */
    const float *xd;  /* [M, GP] each group's step d (0 for an all-zero group) */
    const float *xs;  /* [M, GP] each group's sum of x8, as a float (exact) */
    int KP, GP;       /* K and G padded to whole blocks of 4 groups */
} qmm_t;

/* A scale or bias: float32, or float16 (half the bytes to read; GGUF's own scales are
 * float16, so nothing is rounded). The conversion is exact either way. */
static inline float param(const qmm_t *p, const void *base, long i) {
    if (p->half) {
        uint16_t h;
        memcpy(&h, (const uint16_t *)base + i, sizeof h);
#if defined(__F16C__)
        return _cvtsh_ss(h);
#else
        _Float16 f;
        memcpy(&f, &h, sizeof f);
        return (float)f;
#endif
    }
    return ((const float *)base)[i];
}

/* The stores: each element's lanes reduced in the fixed tree. */
static inline __attribute__((always_inline)) void finish_tile(const qmm_t *p, int m0,
                                                               const int R, int n0,
                                                               const int C, vf acc[][8]) {
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) p->y[(long)(m0 + r) * p->N + n0 + c] = reduce(acc[r][c]);
}

/* Rows m0..m0+R, columns n0..n0+C, weights unpacked in registers. */
static inline __attribute__((always_inline)) void tile_direct(const qmm_t *p, const int bits,
                                                               int m0, const int R, int n0,
                                                               const int C) {
    vf acc[TILE_ROWS][8];
    const long row_bytes = (long)p->K * bits / 8, chunk_bytes = SPAN * bits / 8;
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) acc[r][c] = (vf){0};
    const int per_group = p->group / SPAN;
    for (int g = 0; g < p->G; g++) {
        float scale[8], bias[8];
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) {
            scale[c] = param(p, p->scales, (long)(n0 + c) * p->G + g);
            bias[c] = param(p, p->biases, (long)(n0 + c) * p->G + g);
        }
        for (int j = 0; j < per_group; j++) {
            const long k = ((long)g * per_group + j) * SPAN;
            vf a[8], b[8];
#pragma GCC unroll 8
            for (int c = 0; c < C; c++)
                unpack(p->w + (long)(n0 + c) * row_bytes + (k / SPAN) * chunk_bytes, bits,
                       scale[c], bias[c], &a[c], &b[c]);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const float *xr = p->x + (long)(m0 + r) * p->K + k;
                vf xa = loadf(xr), xb = loadf(xr + W);
#pragma GCC unroll 8
                for (int c = 0; c < C; c++) {
                    acc[r][c] = vfma(xa, a[c], acc[r][c]);
                    acc[r][c] = vfma(xb, b[c], acc[r][c]);
                }
            }
        }
    }
    finish_tile(p, m0, R, n0, C, acc);
}

/* Rows m0..m0+R against C columns already unpacked into panel [C][K] (same values and lane
 * order as tile_direct's registers, so the same bits). */
static inline __attribute__((always_inline)) void tile_panel(const qmm_t *p, const float *panel,
                                                              int m0, const int R, int n0,
                                                              const int C) {
    vf acc[TILE_ROWS][8];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) acc[r][c] = (vf){0};
    for (long k = 0; k < p->K; k += SPAN) {
        vf a[4], b[4];
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) {
            a[c] = loadf(panel + (long)c * p->K + k);
            b[c] = loadf(panel + (long)c * p->K + k + W);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const float *xr = p->x + (long)(m0 + r) * p->K + k;
            vf xa = loadf(xr), xb = loadf(xr + W);
#pragma GCC unroll 4
            for (int c = 0; c < C; c++) {
                acc[r][c] = vfma(xa, a[c], acc[r][c]);
                acc[r][c] = vfma(xb, b[c], acc[r][c]);
            }
        }
    }
    finish_tile(p, m0, R, n0, C, acc);
}

/* Many rows: PANEL_COLS columns are unpacked to a panel (in L2) at a time, then each tile of
 * TILE_ROWS rows (in L1) passes over the whole panel, PANEL_TILE columns at a time. Rows are
 * thus read once per panel, not once per column pair: for a prompt chunk of hundreds of rows
 * x itself outgrows the caches, and re-reading it for every column pair made the product
 * bound by memory. Tiling changes no element's arithmetic. */
#define PANEL_COLS 64
#if W == 16
#define PANEL_TILE 4 /* 16 accumulators + 8 weight vectors + 2 x vectors of 32 registers */
#else
#define PANEL_TILE 2 /* 16 registers */
#endif

static inline __attribute__((always_inline)) void unpack_panel(const qmm_t *p, const int bits,
                                                                int n0, int C, float *panel) {
    const long row_bytes = (long)p->K * bits / 8, chunk_bytes = SPAN * bits / 8;
    const int per_group = p->group / SPAN;
    for (int c = 0; c < C; c++) {
        const uint8_t *wr = p->w + (long)(n0 + c) * row_bytes;
        for (int g = 0; g < p->G; g++) {
            const float scale = param(p, p->scales, (long)(n0 + c) * p->G + g);
            const float bias = param(p, p->biases, (long)(n0 + c) * p->G + g);
            for (int j = 0; j < per_group; j++) {
                const long chunk = (long)g * per_group + j;
                vf a, b;
                unpack(wr + chunk * chunk_bytes, bits, scale, bias, &a, &b);
                memcpy(panel + (long)c * p->K + chunk * SPAN, &a, sizeof a);
                memcpy(panel + (long)c * p->K + chunk * SPAN + W, &b, sizeof b);
            }
        }
    }
}

#define DIRECT_ROWS(R, CR)                                                                   \
    do {                                                                                     \
        int n = n0;                                                                          \
        for (; n + (CR) <= n1; n += (CR)) tile_direct(p, bits, 0, R, n, CR);                 \
        for (; n < n1; n++) tile_direct(p, bits, 0, R, n, 1);                                \
    } while (0)

/* Columns n0..n1 of the product, all rows. */
static inline __attribute__((always_inline)) void columns_bits(const qmm_t *p, const int bits,
                                                                int n0, int n1) {
    switch (p->M) {
    case 1: DIRECT_ROWS(1, COLS_1); return;
    case 2: DIRECT_ROWS(2, COLS_2); return;
    case 3: DIRECT_ROWS(3, COLS_3); return;
    case 4: DIRECT_ROWS(4, COLS_4); return;
    default: break;
    }
    float *panel = aligned_alloc(64, sizeof(float) * (size_t)PANEL_COLS * (size_t)p->K + 64);
    for (int n = n0; n < n1; n += PANEL_COLS) {
        const int C = n1 - n < PANEL_COLS ? n1 - n : PANEL_COLS;
        unpack_panel(p, bits, n, C, panel);
        int m = 0;
        for (; m + TILE_ROWS <= p->M; m += TILE_ROWS) {
            int c = 0;
            for (; c + PANEL_TILE <= C; c += PANEL_TILE)
                tile_panel(p, panel + (long)c * p->K, m, TILE_ROWS, n + c, PANEL_TILE);
            for (; c < C; c++) tile_panel(p, panel + (long)c * p->K, m, TILE_ROWS, n + c, 1);
        }
        const int R = p->M - m;
        for (int c = 0; c < C; c++) { /* the last rows, one column at a time */
            const float *col = panel + (long)c * p->K;
            qmm_t q = *p;
            switch (R) {
            case 1: tile_panel(&q, col, m, 1, n + c, 1); break;
            case 2: tile_panel(&q, col, m, 2, n + c, 1); break;
            case 3: tile_panel(&q, col, m, 3, n + c, 1); break;
            default: break;
            }
        }
    }
    free(panel);
}

static void columns_int8(const qmm_t *p, int n0, int n1);

static void columns(const qmm_t *p, int n0, int n1) {
    if (p->int8) columns_int8(p, n0, n1);
    else if (p->bits == 4) columns_bits(p, 4, n0, n1);
    else columns_bits(p, 8, n0, n1);
}

/* -- threads: columns in chunks, taken by whichever thread is free ---------------------- */

/* A product is split only when its multiply-adds (rows x columns x K) reach
 * MIN_PARALLEL_WORK. A sleeping helper costs a futex call and a context switch to wake, but
 * a fused layer's products come close together (attention and a few elementwise steps
 * between them), so a helper spinning between them (SPIN_ROUNDS) takes the next one at
 * once: from a quarter of a million multiply-adds, the size of a single-row attention
 * projection of a small model, splitting shortens the step (at the price of the spins:
 * where other work shares the cores, MTPLX_QUANT_THREADS=1 keeps every product on one). */
enum { MAX_THREADS = 8, SPIN_ROUNDS = 4000, CHUNK_COLS = 64, MIN_PARALLEL_WORK = 1 << 18 };
enum { WAIT_SPINS = 256 }; /* the caller's spins on a helper's last chunk before yielding */

static int threads_wanted = 1;
static int num_helpers = 0;
static qmm_t shared;
static atomic_ulong ticket; /* serial << 32 | chunks << 16 | next chunk */
static atomic_int busy_helpers;
static atomic_ulong split_calls;
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t wake_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static void take_chunks(void) {
    unsigned long t = atomic_load_explicit(&ticket, memory_order_acquire);
    for (;;) {
        unsigned long count = (t >> 16) & 0xffff, next = t & 0xffff;
        if (next >= count) return;
        if (!atomic_compare_exchange_weak_explicit(&ticket, &t, t + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        int n0 = (int)next * CHUNK_COLS, n1 = n0 + CHUNK_COLS;
        columns(&shared, n0, n1 < shared.N ? n1 : shared.N);
        t = atomic_load_explicit(&ticket, memory_order_acquire);
    }
}

static void *helper_main(void *arg) {
    (void)arg;
    unsigned long serial = atomic_load(&ticket) >> 32;
    for (;;) {
        int spins = 0;
        /* Spin briefly (a forward's products come in quick runs), then sleep. */
        while ((atomic_load_explicit(&ticket, memory_order_acquire) >> 32) == serial) {
            if (++spins < SPIN_ROUNDS) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&wake_lock);
            while ((atomic_load(&ticket) >> 32) == serial) pthread_cond_wait(&wake, &wake_lock);
            pthread_mutex_unlock(&wake_lock);
            spins = 0;
        }
        serial = atomic_load(&ticket) >> 32;
        atomic_fetch_add(&busy_helpers, 1);
        take_chunks();
        atomic_fetch_sub(&busy_helpers, 1);
    }
    return NULL;
}

static void after_fork_in_child(void) {
    num_helpers = 0;
    atomic_store(&busy_helpers, 0);
    pthread_mutex_init(&call_lock, NULL);
    pthread_mutex_init(&wake_lock, NULL);
    pthread_cond_init(&wake, NULL);
}

static void start_helpers(void) {
    static int fork_handler = 0;
    if (!fork_handler) fork_handler = pthread_atfork(NULL, NULL, after_fork_in_child) == 0;
    while (num_helpers < threads_wanted - 1) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, helper_main, NULL) != 0) break;
        pthread_detach(thread);
        num_helpers++;
    }
}

static void run(const qmm_t *p) {
    const long work = (long)p->N * p->K * p->M;
    const long chunks = ((long)p->N + CHUNK_COLS - 1) / CHUNK_COLS;
    if (threads_wanted <= 1 || work < MIN_PARALLEL_WORK || chunks < 2 || chunks > 0xffff ||
        pthread_mutex_trylock(&call_lock) != 0) {
        columns(p, 0, p->N);
        return;
    }
    start_helpers();
    atomic_fetch_add_explicit(&split_calls, 1, memory_order_relaxed);
    shared = *p;
    unsigned long serial = (atomic_load(&ticket) >> 32) + 1;
    pthread_mutex_lock(&wake_lock);
    atomic_store_explicit(&ticket, (serial << 32) | ((unsigned long)chunks << 16),
                          memory_order_release);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&wake_lock);
    take_chunks();
    /* Every chunk is taken; wait for the helpers still computing theirs. Spin briefly, then
     * yield: on a loaded machine a descheduled helper would otherwise cost the caller's
     * whole time slice in spins. */
    for (int spins = 0; atomic_load_explicit(&busy_helpers, memory_order_acquire) != 0;) {
        if (++spins < WAIT_SPINS) cpu_relax();
        else sched_yield();
    }
    pthread_mutex_unlock(&call_lock);
}

/* How many threads (the caller included, at most MAX_THREADS) may split a product. */
void mtplx_qmm_set_threads(int threads) {
    threads_wanted = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
}

int mtplx_qmm_threads(void) { return threads_wanted; }

/* Products computed by more than one thread so far (lets tests see the split happen). */
unsigned long mtplx_qmm_split_calls(void) { return atomic_load(&split_calls); }

/* y[M, N] = x[M, K] @ dequantize(w, scales, biases)^T, scales and biases float32, or
 * float16 when half is nonzero. Returns 0, or -1 for arguments the
 * kernel does not take (bits other than 4/8, a group size not a multiple of 2 W, K not a
 * multiple of the group size), before touching y. */
int mtplx_qmm(const float *x, int M, int K, const uint32_t *w, const void *scales,
              const void *biases, int half, int N, int bits, int group, float *y) {
    if ((bits != 4 && bits != 8) || group <= 0 || group % SPAN != 0 || K % group != 0)
        return -1;
    if (M <= 0 || N <= 0) return 0;
    const int G = K / group;
    float *xp = NULL;
    if (bits == 4) { /* x in chunk lane order: even elements, then odd ones */
        xp = malloc(sizeof(float) * (size_t)M * K + 64);
        for (int m = 0; m < M; m++) {
            const float *xr = x + (long)m * K;
            float *out = xp + (long)m * K;
            for (int k = 0; k < K; k += SPAN)
                for (int l = 0; l < W; l++) {
                    out[k + l] = xr[k + 2 * l];
                    out[k + W + l] = xr[k + 2 * l + 1];
                }
        }
    }
    qmm_t p = {xp ? xp : x, (const uint8_t *)w, scales, biases, y, M, N, K, G, bits, group,
               half != 0, 0, NULL, NULL, NULL, 0, 0};
    run(&p);
    free(xp);
    return 0;
}

/* == Integer-dot mode ======================================================================
 *
 * mtplx_qmm_int8 computes the product the way llama.cpp does for its quantized types: each
 * row of x is quantized per weight group to 8 bits, symmetric,
 *
 *     d[m, g] = (max over the group of |x[m, k]|) / 127                        (float32)
 *     x8[m, k] = rint(x[m, k] / d[m, g]), clamped to [-127, 127]  (ties to even; an
 *                all-zero group, or one whose d rounds to 0, has d = 0 and x8 = 0; a
 *                group holding an infinity or NaN has d = NaN and x8 = 0)
 *
 * and each output element is
 *
 *     P = sum over the group of q[n, k] x8[m, k],   S = sum over the group of x8[m, k]
 *                                                                  (integers, exact)
 *     c_g = d[m, g] * (scale[n, g] * P + bias[n, g] * S)   (float32: two products, a sum,
 *                                                           a product, each rounded; no FMA)
 *     p_j = +0 + c_j + c_(j+4) + c_(j+8) + ...   (j = 0..3: groups g = j mod 4, ascending)
 *     y[m, n] = (p_0 + p_1) + (p_2 + p_3)
 *
 * The integer sums are exact whatever their order, so the float steps above are the only
 * rounding, and they read the element's own inputs only: every variant (AVX-512 VNNI's
 * vpdpbusd, AVX-512BW's and AVX2's vpmaddubsw + vpmaddwd, portable C) gives the same bits,
 * for any number of rows, columns or threads. The four strided partial sums let one vector
 * hold 4 columns x 4 consecutive groups ("a block"); G is padded to whole blocks with groups
 * whose d, S and weights are 0, which add exactly nothing (c = +-0, and no p_j is ever -0).
 *
 * vpmaddubsw adds two u8 x s8 products into an int16 with saturation: 4-bit weights (at
 * most 2 x 15 x 127) never reach it, 8-bit ones (2 x 255 x 127) would, so 8-bit weights are
 * split into their nibbles (q = lo + 16 hi) where vpdpbusd is missing.
 *
 * Element order: x8 is stored in the order the variant's weight loads produce. 4-bit weights
 * are unpacked low nibbles (even elements) first, then high nibbles (odd elements), per
 * XCHUNK elements; 8-bit weights and the portable variant keep the natural order.
 */
#if defined(__AVX512BW__)
#define XCHUNK 128 /* a 64-byte load of packed 4-bit weights */
#define MASKED_TAIL 1 /* a row's partial last block read by masked loads, not copied */
#elif defined(__AVX2__)
#define XCHUNK 32 /* a 16-byte load, spread over a 32-byte register */
#define MASKED_TAIL 0
#else
#define XCHUNK 0
#define MASKED_TAIL 0
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v4f __attribute__((vector_size(16)));

/* Where element k of a row goes in its x8 row (4-bit weights; 8-bit keep k). */
static inline long x8_position(long k) {
#if XCHUNK
    const long base = k - k % XCHUNK, o = k % XCHUNK;
    return base + (o % 2) * (XCHUNK / 2) + o / 2;
#else
    return k;
#endif
}

/* The rows quantized per group (see above): x8 [M, KP], d and S [M, GP], padding zero. */
static void quantize_rows(const float *x, int M, int K, int group, int bits, int KP, int GP,
                          int8_t *x8, float *xd, float *xs) {
    const int G = K / group;
    memset(x8, 0, (size_t)M * KP);
    for (int m = 0; m < M; m++) {
        const float *xr = x + (long)m * K;
        int8_t *out = x8 + (long)m * KP;
        for (int g = 0; g < GP; g++) {
            float d = 0.0f;
            int sum = 0;
            if (g < G) {
                const float *xg = xr + (long)g * group;
                float amax = 0.0f;
                int finite = 1;
                for (int i = 0; i < group; i++) {
                    const float a = __builtin_fabsf(xg[i]);
                    amax = a > amax ? a : amax;
                    finite &= a <= 3.40282347e38f; /* false for inf and NaN */
                }
                d = amax / 127.0f;
                if (!finite) {
                    /* A NaN or infinity reaches the outputs as NaN (as in a float product),
                     * not as whatever an 8-bit rounding of it would be. */
                    d = __builtin_nanf("");
                } else if (d > 0.0f) {
                    for (int i = 0; i < group; i++) {
                        float v = __builtin_rintf(xg[i] / d);
                        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
                        const int q = (int)v;
                        const long k = (long)g * group + i;
                        out[bits == 4 ? x8_position(k) : k] = (int8_t)q;
                        sum += q;
                    }
                } else {
                    d = 0.0f;
                }
            }
            xd[(long)m * GP + g] = d;
            xs[(long)m * GP + g] = (float)sum;
        }
    }
}

#if defined(__AVX512BW__)
/* acc + the u8 x s8 products of u and s, four to an int32 lane; u at most 15. */
static inline __m512i dot_u4(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s),
                                                   _mm512_set1_epi16(1)));
#endif
}

/* The same for any u8 (8-bit weights): without VNNI, nibble by nibble (no saturation). */
static inline __m512i dot_u8(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    const __m512i nib = _mm512_set1_epi8(15);
    const __m512i lo = _mm512_and_si512(u, nib);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(u, 4), nib);
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(lo, s),
                                                  _mm512_set1_epi16(1)));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(hi, s),
                                                   _mm512_set1_epi16(16)));
#endif
}

/* One load's products: 128 elements of 4-bit weights or 64 of 8-bit ones, into 16 lanes
 * whose 128-bit quarters each cover 32 (16) consecutive elements. */
/* 64 weight bytes at w + off; with avail >= 0 (a row's last, partial block) only those of
 * the row's avail bytes from w, the rest zero (a masked load reads nothing past the row). */
static inline __attribute__((always_inline)) __m512i load_w(const uint8_t *w, long off,
                                                             const long avail) {
    if (avail < 0) return _mm512_loadu_si512(w + off);
    const long n = avail - off < 0 ? 0 : avail - off > 64 ? 64 : avail - off;
    const __mmask64 mask = n == 64 ? ~0ULL : (1ULL << n) - 1;
    return _mm512_maskz_loadu_epi8(mask, w + off);
}

static inline __attribute__((always_inline)) __m512i step_dot(const uint8_t *w, const int8_t *x,
                                                               const int bits, int t,
                                                               const long avail) {
    if (bits == 4) {
        const __m512i packed = load_w(w, 64L * t, avail);
        const __m512i nib = _mm512_set1_epi8(15);
        const __m512i lo = _mm512_and_si512(packed, nib);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nib);
        __m512i acc = dot_u4(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x + 128L * t));
        return dot_u4(acc, hi, _mm512_loadu_si512(x + 128L * t + 64));
    }
    return dot_u8(_mm512_setzero_si512(), load_w(w, 64L * t, avail),
                  _mm512_loadu_si512(x + 64L * t));
}

/* [a0 + a1, a2 + a3, b0 + b1, b2 + b3] of 128-bit quarters. */
static inline __m512i fold2(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* A block's products for one column: quarter j holds group j's in 4 lanes. */
static inline __attribute__((always_inline)) __m512i block_dot(const uint8_t *w,
                                                                const int8_t *x, const int bits,
                                                                const int group,
                                                                const long avail) {
    const int steps = 4 * group / (bits == 4 ? 128 : 64);
    if (steps == 1) return step_dot(w, x, bits, 0, avail);
    if (steps == 2)
        return fold2(step_dot(w, x, bits, 0, avail), step_dot(w, x, bits, 1, avail));
    const int per = steps / 4;
    __m512i a[4];
    for (int j = 0; j < 4; j++) {
        a[j] = step_dot(w, x, bits, j * per, avail);
        for (int t = 1; t < per; t++)
            a[j] = _mm512_add_epi32(a[j], step_dot(w, x, bits, j * per + t, avail));
    }
    return fold2(fold2(a[0], a[1]), fold2(a[2], a[3]));
}

/* P of 4 columns x 4 groups of a block, lane 4 c + j. */
static inline __attribute__((always_inline)) v16i block_p(const uint8_t *const w[4],
                                                           const int8_t *x, const int bits,
                                                           const int group, const long avail) {
    const __m512i v0 = block_dot(w[0], x, bits, group, avail);
    const __m512i v1 = block_dot(w[1], x, bits, group, avail);
    const __m512i v2 = block_dot(w[2], x, bits, group, avail);
    const __m512i v3 = block_dot(w[3], x, bits, group, avail);
    /* A 4 x 4 transpose-and-sum inside each quarter: lane 4 j + c = P[c][j] ... */
    const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(v0, v1),
                                         _mm512_unpackhi_epi32(v0, v1));
    const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(v2, v3),
                                         _mm512_unpackhi_epi32(v2, v3));
    const __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23),
                                       _mm512_unpackhi_epi64(t01, t23));
    /* ... then column-major (lane 4 c + j), as a tile's scales are laid out. */
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i cm = _mm512_permutexvar_epi32(idx, s);
    v16i out;
    memcpy(&out, &cm, sizeof out);
    return out;
}
#elif defined(__AVX2__)
/* acc + u8 x s8 products of one 32-element unit, u at most 15 (no saturation). */
static inline __m256i dot_u4(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
}

static inline __m256i dot_u8(__m256i acc, __m256i u, __m256i s) {
    const __m256i nib = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(u, nib);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(u, 4), nib);
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, s),
                                                  _mm256_set1_epi16(1)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, s),
                                                   _mm256_set1_epi16(16)));
}

/* Group j of a block (relative to the block's start), one column, 8 partial lanes. */
static inline __attribute__((always_inline)) __m256i group_dot(const uint8_t *w, const int8_t *x, const int bits,
                                const int group, int j) {
    __m256i acc = _mm256_setzero_si256();
    for (int u = j * group / 32; u < (j + 1) * group / 32; u++) {
        if (bits == 4) {
            const __m128i packed = _mm_loadu_si128((const __m128i *)(w + 16L * u));
            const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
            const __m256i q = _mm256_and_si256(both, _mm256_set1_epi8(15));
            acc = dot_u4(acc, q, _mm256_loadu_si256((const __m256i *)(x + 32L * u)));
        } else {
            acc = dot_u8(acc, _mm256_loadu_si256((const __m256i *)(w + 32L * u)),
                         _mm256_loadu_si256((const __m256i *)(x + 32L * u)));
        }
    }
    return acc;
}

static inline __attribute__((always_inline)) v16i block_p(const uint8_t *const w[4],
                                                           const int8_t *x, const int bits,
                                                           const int group, const long avail) {
    (void)avail; /* a partial block is read from a zero-padded copy */
    int32_t out[16];
    for (int c = 0; c < 4; c++) {
        const __m256i a0 = group_dot(w[c], x, bits, group, 0);
        const __m256i a1 = group_dot(w[c], x, bits, group, 1);
        const __m256i a2 = group_dot(w[c], x, bits, group, 2);
        const __m256i a3 = group_dot(w[c], x, bits, group, 3);
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
        const __m128i p = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        _mm_storeu_si128((__m128i *)(out + 4 * c), p);
    }
    v16i v;
    memcpy(&v, out, sizeof v);
    return v;
}
#else
static inline __attribute__((always_inline)) v16i block_p(const uint8_t *const w[4],
                                                           const int8_t *x, const int bits,
                                                           const int group, const long avail) {
    (void)avail; /* a partial block is read from a zero-padded copy */
    v16i out;
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < 4; j++) {
            int32_t sum = 0;
            for (int i = j * group; i < (j + 1) * group; i++) {
                const int q = bits == 4 ? (w[c][i / 2] >> (4 * (i & 1))) & 15 : w[c][i];
                sum += q * x[i];
            }
            out[4 * c + j] = sum;
        }
    return out;
}
#endif

/* 16 float16 values to float32 (exact). */
static inline void halves_to_floats(const uint16_t *h, float *out) {
#if defined(__AVX512F__)
    __m256i v;
    memcpy(&v, h, sizeof v);
    _mm512_storeu_ps(out, _mm512_cvtph_ps(v));
#elif defined(__F16C__)
    __m128i a, b;
    memcpy(&a, h, sizeof a);
    memcpy(&b, h + 8, sizeof b);
    _mm256_storeu_ps(out, _mm256_cvtph_ps(a));
    _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(b));
#else
    for (int i = 0; i < 16; i++) {
        _Float16 f;
        memcpy(&f, h + i, sizeof f);
        out[i] = (float)f;
    }
#endif
}

/* A tile's scales (or biases) per block, lane 4 c + j = param[col c][4 kb + j], 0 past G. */
static void tile_params(const qmm_t *p, const void *base, const int cols[4], int KB,
                        float *out) {
    for (int kb = 0; kb < KB; kb++) {
        float *o = out + 16L * kb;
        if (4 * kb + 4 <= p->G && p->half) {
            uint64_t h[4]; /* 4 halves a column */
            for (int c = 0; c < 4; c++)
                memcpy(h + c, (const uint16_t *)base + (long)cols[c] * p->G + 4 * kb, 8);
#if defined(__AVX512F__)
            /* Built in registers: storing h and loading it as one vector would stall on
             * store forwarding. */
            _mm512_storeu_ps(o, _mm512_cvtph_ps(_mm256_setr_epi64x((long long)h[0],
                                                                   (long long)h[1],
                                                                   (long long)h[2],
                                                                   (long long)h[3])));
#else
            halves_to_floats((const uint16_t *)h, o);
#endif
        } else if (4 * kb + 4 <= p->G) {
            for (int c = 0; c < 4; c++)
                memcpy(o + 4 * c, (const float *)base + (long)cols[c] * p->G + 4 * kb, 16);
        } else if (MASKED_TAIL) {
#if MASKED_TAIL
            const __mmask8 mask = (__mmask8)((1u << (p->G - 4 * kb)) - 1);
            if (p->half) {
                __m128i h[4];
                for (int c = 0; c < 4; c++)
                    h[c] = _mm_maskz_loadu_epi16(mask, (const uint16_t *)base +
                                                           (long)cols[c] * p->G + 4 * kb);
                const __m256i v = _mm256_set_m128i(_mm_unpacklo_epi64(h[2], h[3]),
                                                   _mm_unpacklo_epi64(h[0], h[1]));
                _mm512_storeu_ps(o, _mm512_cvtph_ps(v));
            } else {
                for (int c = 0; c < 4; c++)
                    _mm_storeu_ps(o + 4 * c,
                                  _mm_maskz_loadu_ps(mask, (const float *)base +
                                                               (long)cols[c] * p->G + 4 * kb));
            }
#endif
        } else {
            for (int c = 0; c < 4; c++)
                for (int j = 0; j < 4; j++)
                    o[4 * c + j] = 4 * kb + j < p->G
                                       ? param(p, base, (long)cols[c] * p->G + 4 * kb + j)
                                       : 0.0f;
        }
    }
}

/* Rows r0..r0+R of a 4-column tile: each row's arithmetic is the same whatever R is; R > 1
 * only lets the rows share the weights' loads and unpacking (register tiling). */
#define I8_ROWS 4
static inline __attribute__((always_inline)) void rows_int8(const qmm_t *p, int r0, const int R,
                                                            int n, int C, const int cols[4],
                                                            const float *sc, const float *bi,
                                                            const uint8_t *tail, const int bits,
                                                            const int group) {
    const int KB = p->GP / 4, full = p->G / 4;
    const long row_bytes = (long)p->K * bits / 8, block_bytes = 4L * group * bits / 8;
    const long block_elems = 4L * group;
    v16f acc[I8_ROWS];
    for (int rr = 0; rr < R; rr++) acc[rr] = (v16f){0};
    for (int kb = 0; kb < KB; kb++) {
        const uint8_t *wc[4];
        const int whole = kb < full || MASKED_TAIL;
        for (int c = 0; c < 4; c++)
            wc[c] = whole ? p->w + cols[c] * row_bytes + kb * block_bytes : tail + c * block_bytes;
        v16f scale, bias;
        memcpy(&scale, sc + 16L * kb, sizeof scale);
        memcpy(&bias, bi + 16L * kb, sizeof bias);
        for (int rr = 0; rr < R; rr++) {
            const long r = r0 + rr;
            const int8_t *xb = p->x8 + r * p->KP + kb * block_elems;
            const v16i P = kb < full ? block_p(wc, xb, bits, group, -1)
                                     : block_p(wc, xb, bits, group, row_bytes - full * block_bytes);
            v4f d4, s4;
            memcpy(&d4, p->xd + r * p->GP + 4 * kb, sizeof d4);
            memcpy(&s4, p->xs + r * p->GP + 4 * kb, sizeof s4);
            const v16f dv =
                __builtin_shufflevector(d4, d4, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
            const v16f sv =
                __builtin_shufflevector(s4, s4, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
            const v16f pf = __builtin_convertvector(P, v16f); /* exact: |P| < 2^24 */
            const v16f t = scale * pf + bias * sv; /* two roundings, then the sum's */
            acc[rr] = acc[rr] + dv * t;
        }
    }
    for (int rr = 0; rr < R; rr++) {
        float *yr = p->y + (long)(r0 + rr) * p->N + n;
        for (int c = 0; c < C; c++)
            yr[c] = (acc[rr][4 * c] + acc[rr][4 * c + 1]) + (acc[rr][4 * c + 2] + acc[rr][4 * c + 3]);
    }
}

static inline __attribute__((always_inline)) void columns_int8_kind(const qmm_t *p, int n0,
                                                                   int n1, const int bits,
                                                                   const int group) {
    const int KB = p->GP / 4, full = p->G / 4;
    const long row_bytes = (long)p->K * bits / 8, block_bytes = 4L * group * bits / 8;
    float *sc = aligned_alloc(64, sizeof(float) * 32 * (size_t)KB);
    float *bi = sc + 16L * KB;
    uint8_t *tail = aligned_alloc(64, (size_t)(4 * block_bytes));
    for (int n = n0; n < n1; n += 4) {
        const int C = n1 - n < 4 ? n1 - n : 4;
        int cols[4];
        for (int c = 0; c < 4; c++) cols[c] = n + c < p->N ? n + c : p->N - 1;
        tile_params(p, p->scales, cols, KB, sc);
        tile_params(p, p->biases, cols, KB, bi);
        if (!MASKED_TAIL && full < KB) { /* the last, partial block: zero-padded copies */
            memset(tail, 0, (size_t)(4 * block_bytes));
            for (int c = 0; c < 4; c++)
                memcpy(tail + c * block_bytes, p->w + cols[c] * row_bytes + full * block_bytes,
                       (size_t)(row_bytes - full * block_bytes));
        }
        int r = 0;
        for (; r + I8_ROWS <= p->M; r += I8_ROWS)
            rows_int8(p, r, I8_ROWS, n, C, cols, sc, bi, tail, bits, group);
        for (; r < p->M; r++) rows_int8(p, r, 1, n, C, cols, sc, bi, tail, bits, group);
    }
    free(tail);
    free(sc);
}

/* Columns n0..n1, all rows, in the integer-dot mode: one specialised copy per kind. */
static void columns_int8(const qmm_t *p, int n0, int n1) {
    switch (p->bits * 1000 + p->group) {
    case 4032: columns_int8_kind(p, n0, n1, 4, 32); return;
    case 4064: columns_int8_kind(p, n0, n1, 4, 64); return;
    case 4128: columns_int8_kind(p, n0, n1, 4, 128); return;
    case 8032: columns_int8_kind(p, n0, n1, 8, 32); return;
    case 8064: columns_int8_kind(p, n0, n1, 8, 64); return;
    default: columns_int8_kind(p, n0, n1, 8, 128); return;
    }
}

/* mtplx_qmm's arguments, the integer-dot mode: x quantized to 8 bits per group and
 * integer dot products (see above). Returns 0, or -1 as mtplx_qmm does. */
int mtplx_qmm_int8(const float *x, int M, int K, const uint32_t *w, const void *scales,
                   const void *biases, int half, int N, int bits, int group, float *y) {
    if ((bits != 4 && bits != 8) || (group != 32 && group != 64 && group != 128) ||
        K % group != 0)
        return -1;
    if (M <= 0 || N <= 0) return 0;
    const int G = K / group, GP = (G + 3) / 4 * 4, KP = GP * group;
    int8_t *x8 = aligned_alloc(64, ((size_t)M * KP + 63) / 64 * 64);
    float *xd = malloc(sizeof(float) * 2 * (size_t)M * GP);
    float *xs = xd + (long)M * GP;
    quantize_rows(x, M, K, group, bits, KP, GP, x8, xd, xs);
    qmm_t p = {x, (const uint8_t *)w, scales, biases, y, M, N, K, G, bits, group, half != 0,
               1, x8, xd, xs, KP, GP};
    run(&p);
    free(xd);
    free(x8);
    return 0;
}
