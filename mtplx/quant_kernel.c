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
 * Columns are split between the calling thread and helpers in chunks of CHUNK_COLS (a
 * prompt chunk's last one in halves when the chunks do not divide between the threads).
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
    const float *dx;  /* [M, T, 16] each term lane's step d (0 in padding; a unit block's
                       * lanes at its first term's place, see quantize_rows) */
    const float *xs;  /* [M, GB] each group's d * S (0 in padding) */
    int KP, T, GB;    /* K padded to whole terms, the terms, G padded to 16 */
    int NB;           /* leading blocks summed by units (8-bit weights; 0 for 4-bit) */
} qmm_t;

/* A scale or bias, element i of row: float32, or float16 when half (half the bytes to read;
 * GGUF's own scales are float16, so nothing is rounded). The conversion is exact either way. */
static inline __attribute__((always_inline)) float param_at(const void *row, long i,
                                                             const int half) {
    if (half) {
        uint16_t h;
        memcpy(&h, (const uint16_t *)row + i, sizeof h);
#if defined(__F16C__)
        return _cvtsh_ss(h);
#else
        _Float16 f;
        memcpy(&f, &h, sizeof f);
        return (float)f;
#endif
    }
    return ((const float *)row)[i];
}

/* The same for a call's parameters, its type from the call. */
static inline float param(const qmm_t *p, const void *base, long i) {
    return param_at(base, i, p->half);
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

static void columns_int8(const qmm_t *p, int n0, int n1, int down);

/* Columns n0..n1 of the product, all rows; down: the integer-dot mode walks them from n1
 * down (a helper taking chunks from the far end, see take_chunks). The order of the columns
 * changes no element's arithmetic. */
static void columns(const qmm_t *p, int n0, int n1, int down) {
    if (p->int8) columns_int8(p, n0, n1, down);
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
enum { WAIT_SPINS = 256, HALF_COLS = CHUNK_COLS / 2 }; /* the caller's spins on a helper's last chunk before yielding */

static int threads_wanted = 1;
static int num_helpers = 0;
static qmm_t shared;
/* The call's work when it is not a product (mtplx_parallel_rows): rows in chunks of
 * shared_grain, each handed to shared_fn. */
static void (*shared_fn)(void *ctx, int lo, int hi);
static void *shared_ctx;
static int shared_grain, shared_rows;
/* A product's chunks: the first shared_whole are CHUNK_COLS wide, the rest half that (a
 * prompt chunk's last columns in halves, so the threads finish together). */
static int shared_whole;
/* serial << 32 | end << 16 | next: chunks next .. end - 1 are left. The calling thread takes
 * them from the front (next), helpers, in a product of few rows, from the back (end): each
 * thread then streams one contiguous run of weights, ascending or descending, which its
 * prefetches (tile_int8) can run ahead in, and the two meet wherever their speeds put the
 * meeting, as a shared queue from one end would balance them. */
static atomic_ulong ticket;
/* Whether helpers take chunks from the back (a product of few rows, no chunk in halves). */
static int shared_from_back;
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

/* Takes chunks of the current call until none is left: from the front, or from the back
 * (back: a helper where shared_from_back is set). */
static void take_chunks(int back) {
    unsigned long t = atomic_load_explicit(&ticket, memory_order_acquire);
    for (;;) {
        const unsigned long end = (t >> 16) & 0xffff, first = t & 0xffff;
        if (first >= end) return;
        const unsigned long next = back ? end - 1 : first;
        const unsigned long taken = back ? t - (1UL << 16) : t + 1;
        if (!atomic_compare_exchange_weak_explicit(&ticket, &t, taken, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        if (shared_fn) {
            const int lo = (int)next * shared_grain, hi = lo + shared_grain;
            shared_fn(shared_ctx, lo, hi < shared_rows ? hi : shared_rows);
        } else {
            const int whole = shared_whole, i = (int)next;
            const int n0 = i < whole ? i * CHUNK_COLS : whole * CHUNK_COLS + (i - whole) * HALF_COLS;
            const int n1 = n0 + (i < whole ? CHUNK_COLS : HALF_COLS);
            columns(&shared, n0, n1 < shared.N ? n1 : shared.N, back);
        }
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
        take_chunks(shared_from_back);
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

/* Hands `chunks` chunks of the call set up in shared / shared_fn to the helpers and takes
 * its own share; returns once every chunk is done. The caller holds call_lock. */
static void split(long chunks) {
    start_helpers();
    atomic_fetch_add_explicit(&split_calls, 1, memory_order_relaxed);
    unsigned long serial = (atomic_load(&ticket) >> 32) + 1;
    pthread_mutex_lock(&wake_lock);
    atomic_store_explicit(&ticket, (serial << 32) | ((unsigned long)chunks << 16),
                          memory_order_release);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&wake_lock);
    take_chunks(0);
    /* Every chunk is taken; wait for the helpers still computing theirs. Spin briefly, then
     * yield: on a loaded machine a descheduled helper would otherwise cost the caller's
     * whole time slice in spins. */
    for (int spins = 0; atomic_load_explicit(&busy_helpers, memory_order_acquire) != 0;) {
        if (++spins < WAIT_SPINS) cpu_relax();
        else sched_yield();
    }
    pthread_mutex_unlock(&call_lock);
}

static void run(const qmm_t *p) {
    const long work = (long)p->N * p->K * p->M;
    long chunks = ((long)p->N + CHUNK_COLS - 1) / CHUNK_COLS;
    if (threads_wanted <= 1 || work < MIN_PARALLEL_WORK || chunks < 2 || chunks > 0xffff ||
        pthread_mutex_trylock(&call_lock) != 0) {
        columns(p, 0, p->N, 0);
        return;
    }
    shared = *p;
    shared_fn = NULL;
    shared_from_back = p->M <= TILE_ROWS;
    shared_whole = (int)chunks;
    /* Many rows (a prompt chunk): a chunk takes long, and chunks that do not divide between
     * the threads leave all but one waiting for the last (9 chunks on 2 threads: 5 against
     * 4). The last whole chunk then goes in halves, the columns' work unchanged. */
    if (p->M > TILE_ROWS && chunks % threads_wanted != 0) {
        shared_whole = (int)chunks - 1;
        chunks = shared_whole + ((long)p->N - (long)shared_whole * CHUNK_COLS + HALF_COLS - 1) /
                                    HALF_COLS;
    }
    split(chunks);
}

/* fn(ctx, lo, hi) over rows [0, rows) in chunks of `grain` rows, split between the calling
 * thread and the product's helpers (the same pool, the same thread setting), or all on the
 * calling thread when there is one chunk, one thread, or another split is running. For
 * row-wise steps around the products (norms, RoPE, activations, the rows' reordering and
 * quantization): a prompt chunk's hundreds of rows would otherwise leave the helpers
 * waiting. fn must compute each row on its own, so the split changes no bit. */
void mtplx_parallel_rows(void (*fn)(void *ctx, int lo, int hi), void *ctx, int rows, int grain) {
    grain = grain < 1 ? 1 : grain;
    const long chunks = ((long)rows + grain - 1) / grain;
    if (rows <= 0) return;
    if (threads_wanted <= 1 || chunks < 2 || chunks > 0xffff ||
        pthread_mutex_trylock(&call_lock) != 0) {
        fn(ctx, 0, rows);
        return;
    }
    shared_fn = fn;
    shared_from_back = 0;
    shared_ctx = ctx;
    shared_grain = grain;
    shared_rows = rows;
    split(chunks);
}

/* How many threads (the caller included, at most MAX_THREADS) may split a product. */
void mtplx_qmm_set_threads(int threads) {
    threads_wanted = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
}

int mtplx_qmm_threads(void) { return threads_wanted; }

/* Products computed by more than one thread so far (lets tests see the split happen). */
unsigned long mtplx_qmm_split_calls(void) { return atomic_load(&split_calls); }

/* Rows a chunk of mtplx_parallel_rows takes for row-wise work on rows of K floats: about
 * 16K elements (a chunk's work well above the handshake's cost). */
static int rows_grain(int K) { return K >= (1 << 14) ? 1 : (1 << 14) / K; }

typedef struct {
    const float *x;
    float *xp;
    int K;
} reorder_t;

/* Rows lo..hi of x in chunk lane order (see mtplx_qmm). */
static void reorder_rows(void *ctx, int lo, int hi) {
    const reorder_t *r = ctx;
    const int K = r->K;
    for (int m = lo; m < hi; m++) {
        const float *xr = r->x + (long)m * K;
        float *out = r->xp + (long)m * K;
        for (int k = 0; k < K; k += SPAN)
            for (int l = 0; l < W; l++) {
                out[k + l] = xr[k + 2 * l];
                out[k + W + l] = xr[k + 2 * l + 1];
            }
    }
}

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
        reorder_t r = {x, xp, K};
        mtplx_parallel_rows(reorder_rows, &r, M, rows_grain(K));
    }
    qmm_t p = {.x = xp ? xp : x, .w = (const uint8_t *)w, .scales = scales, .biases = biases,
               .y = y, .M = M, .N = N, .K = K, .G = G, .bits = bits, .group = group,
               .half = half != 0};
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
 *     s[m, g] = d[m, g] * S[m, g],  S = the group's sum of x8           (float32, one rounding)
 *
 * and each output element is summed in 16 float32 lanes, llama.cpp's order made fixed:
 *
 *   terms: K in terms of E elements (E = 128 for 4-bit weights, 64 for 8-bit), the last
 *     padded with zeros; lane L of term t covers the E / 16 consecutive elements
 *     k = t E + L E / 16 + i (i < E / 16), all in one group g(t, L), and holds their exact
 *     integer sum P = sum q[n, k] x8[m, k];
 *   8-bit weights first sum their whole blocks of 16 units (a unit: 16 consecutive
 *     elements, 16 weight bytes, inside one group; a block: 256 elements), one lane a unit:
 *     for blocks c < K / 256 ascending, lane L takes unit u = 16 c + block_unit(L)
 *     (4 (L % 4) + L / 4), P its exact integer sum, g its group:
 *                     acc[L] = fma(scale[n, g] * d[m, g], P, acc[L]);
 *     then the terms after the blocks (4-bit weights: every term) as follows;
 *   for t ascending:  acc[L] = fma(scale[n, g] * d[m, g], P, acc[L])   (the product rounded,
 *     then one fused multiply-add; lanes past K have scale = d = P = 0);
 *   then the biases, 16 groups at a time, ascending (G padded to 16 with zeros):
 *                     acc[j] = fma(bias[n, 16 c + j], s[m, 16 c + j], acc[j]);
 *   y[m, n] = the lanes in a fixed tree: h[i] = acc[i] + acc[i + 8], r[i] = h[i] + h[i + 4],
 *             (r[0] + r[2]) + (r[1] + r[3]).
 *
 * The integer sums are exact whatever their order, and the float steps read the element's
 * own inputs only, so every variant (AVX-512 VNNI's vpdpbusd, AVX-512BW's and AVX2's
 * vpmaddubsw + vpmaddwd, portable C with fmaf) gives the same bits, for any number of rows,
 * columns or threads, and any tiling. Padding adds exactly nothing: an accumulator starts
 * at +0 and is never -0 (x + -x is +0), so fma(0, 0, acc) = acc.
 *
 * Cost: a lane sums 8 (4-bit) or 4 (8-bit) products in integers, and each lane of each term
 * costs one conversion, one multiply and one multiply-add per row and column (llama.cpp:
 * the same per block of 32, on 8 lanes). An 8-bit unit block's lanes sum 16 products
 * each: AVX-512 VNNI builds transpose a column's 256 block bytes in registers (their 32-bit
 * words within each 128-bit quarter: 8 shuffles, shared by the tile's rows) so that four
 * vpdpbusd leave whole units in the lanes, and the float steps run once per 16 elements
 * instead of 4; other builds sum each term's lanes per quarter (the same integers). 4-bit
 * weights keep the terms: their 8 products a lane leave less float work to save than the
 * transpose costs (benchmarks/results/2026-12-03-int8-lanes-order/). A tile of rows x
 * columns shares each term's weight loads and unpacking (the columns') and each row's loads
 * (the rows').
 *
 * vpmaddubsw adds two u8 x s8 products into an int16 with saturation: 4-bit weights (at
 * most 2 x 15 x 127) never reach it, 8-bit ones (2 x 255 x 127) would, so 8-bit weights are
 * split into their nibbles (q = lo + 16 hi) where vpdpbusd is missing.
 *
 * Element order: x8 is stored in the order the variant's weight loads produce. 4-bit weights
 * are unpacked low nibbles (even elements) first, then high nibbles (odd elements), per
 * XCHUNK elements; 8-bit weights and the portable variant keep the natural order, but for
 * an AVX-512 VNNI build's 8-bit unit blocks (see quantize_rows). A lane's elements are the
 * same set in every variant.
 */
#if defined(__AVX512BW__)
#define XCHUNK 128 /* a 64-byte load of packed 4-bit weights */
#elif defined(__AVX2__)
#define XCHUNK 64 /* a 32-byte load */
#else
#define XCHUNK 0
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));

/* Elements of a term (E) for a bit width. */
#define TERM(bits) ((bits) == 4 ? 128 : 64)

#if defined(__AVX2__)
#define MAYBE_INLINE inline __attribute__((always_inline))
#else
#define MAYBE_INLINE __attribute__((noinline)) /* portable: small code, built quickly */
#endif

static MAYBE_INLINE v16f fma16(v16f a, v16f b, v16f c) {
#if defined(__AVX512F__)
    return _mm512_fmadd_ps(a, b, c);
#elif defined(__FMA__)
    const __m256 lo = _mm256_fmadd_ps(__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7),
                                      __builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
                                      __builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 hi =
        _mm256_fmadd_ps(__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
                        __builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
                        __builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
    const v8f l = lo, h = hi;
    return __builtin_shufflevector(l, h, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    for (int i = 0; i < 16; i++) c[i] = __builtin_fmaf(a[i], b[i], c[i]); /* fused always */
    return c;
#endif
}

/* The fixed tree over an element's 16 lanes. */
static inline float reduce16(v16f v) {
    const v8f h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    typedef float v4 __attribute__((vector_size(16)));
    const v4 r = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (r[0] + r[2]) + (r[1] + r[3]);
}

static inline v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 8-bit unit blocks (see above): a unit is 16 weight bytes (16 elements), a block 16 units.
 * Lane L of a block takes unit block_unit(L) of it: the 4 x 4 transpose of 32-bit words
 * within each 128-bit quarter of four 64-byte loads puts unit 4 p + b in lane 4 b + p (an
 * involution: the unit's lane is block_unit(unit) too). */
static inline int block_unit(int l) { return 4 * (l % 4) + l / 4; }

/* AVX-512 VNNI builds transpose a unit block's weights in registers (once per column, for
 * all the rows), so a lane's integer products are one unit's; their rows' x8 is stored to
 * match. Other builds sum each term's integer lanes per quarter instead (the same
 * integers). */
#if defined(__AVX512VNNI__)
#define I8_TRANSPOSED 1
#else
#define I8_TRANSPOSED 0
#endif

/* Where element k of a row goes in its x8 row (4-bit weights; 8-bit keep k). */
static inline long x8_position(long k) {
#if XCHUNK
    const long base = k - k % XCHUNK, o = k % XCHUNK;
    return base + (o % 2) * (XCHUNK / 2) + o / 2;
#else
    return k;
#endif
}

/* Per-thread scratch for a call's quantized rows: a decode step's few KB are kept and reused
 * (a step makes ~120 products, each would otherwise allocate and free its rows' buffers); a
 * prompt chunk's (MBs) is allocated for the call and freed, so no thread holds it after.
 * kept_scratch returns 64-byte aligned memory of at least `bytes`, or NULL. */
enum { KEPT_SCRATCH = 1 << 20 };
typedef struct {
    void *p;
    size_t bytes;
} kept_t;

static void *kept_scratch(kept_t *k, size_t bytes) {
    bytes = (bytes + 63) / 64 * 64;
    if (bytes > KEPT_SCRATCH) return aligned_alloc(64, bytes);
    if (bytes > k->bytes) {
        free(k->p);
        k->p = aligned_alloc(64, KEPT_SCRATCH);
        k->bytes = k->p ? KEPT_SCRATCH : 0;
    }
    return k->p;
}

static void kept_release(const kept_t *k, void *p) {
    if (p != k->p) free(p);
}

static __thread kept_t kept_rows;  /* the call's x8, dx and xs (mtplx_qmm_int8) */
static __thread kept_t kept_steps; /* quantize_rows's per-group steps */

/* The rows quantized per group (see above): x8 [M, KP] (padding zero), each term lane's d
 * [M, T, 16] and each group's d * S [M, GB] (0 in padding). */
static void quantize_rows(const float *x, int M, int K, int group, int bits, int KP, int T,
                          int NB, int GB, int8_t *x8, float *dx, float *xs) {
    const int G = K / group, E = TERM(bits), per = E / 16, upg = group * bits / 128;
    /* group and upg are powers of two (mtplx_qmm_int8 takes groups of 32, 64, 128): the
     * lanes' group indices below by shifts, not a division each (of nonnegative ints: the
     * same quotients) */
    const int group_shift = __builtin_ctz((unsigned)group), upg_shift = __builtin_ctz((unsigned)upg);
    /* Elements in unit blocks, stored in the transposed order (I8_TRANSPOSED). */
    const long blocked = I8_TRANSPOSED ? (long)NB * 256 : 0;
    float *d = kept_scratch(&kept_steps, sizeof(float) * (size_t)G);
    memset(x8, 0, (size_t)M * KP);
    for (int m = 0; m < M; m++) {
        const float *xr = x + (long)m * K;
        int8_t *out = x8 + (long)m * KP;
        for (int g = 0; g < G; g++) {
            const float *xg = xr + (long)g * group;
            float amax = 0.0f;
            int finite = 1, sum = 0;
#if defined(__AVX512F__)
            /* The same operations 16 lanes at a time: max(a, most) keeps most where a is
             * NaN, as the scalar comparison does; a max is exact in any order. */
            __m512 most = _mm512_setzero_ps();
            for (int i = 0; i < group; i += 16) {
                const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(xg + i));
                most = _mm512_max_ps(a, most);
                finite &= _mm512_cmp_ps_mask(a, _mm512_set1_ps(3.40282347e38f), _CMP_LE_OQ) ==
                          0xffff;
            }
            amax = _mm512_reduce_max_ps(most);
#else
            for (int i = 0; i < group; i++) {
                const float a = __builtin_fabsf(xg[i]);
                amax = a > amax ? a : amax;
                finite &= a <= 3.40282347e38f; /* false for inf and NaN */
            }
#endif
            float dg = amax / 127.0f;
            if (!finite) {
                /* A NaN or infinity reaches the outputs as NaN (as in a float product),
                 * not as whatever an 8-bit rounding of it would be. */
                dg = __builtin_nanf("");
            } else if (dg > 0.0f) {
                int qs[128]; /* group <= 128 */
                int stored = 0; /* by the pairs path below, else element by element */
#if defined(__AVX512F__)
                /* x / d rounded to the nearest integer, ties to even (rintf in the default
                 * rounding mode), clamped: IEEE operations, the scalar's bits. */
                const __m512 dv = _mm512_set1_ps(dg), top = _mm512_set1_ps(127.0f);
                __m512i sums = _mm512_setzero_si512();
                for (int i = 0; i < group; i += 16) {
                    __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(xg + i), dv),
                                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    v = _mm512_max_ps(_mm512_min_ps(v, top), _mm512_set1_ps(-127.0f));
                    const __m512i qi = _mm512_cvtps_epi32(v);
                    _mm512_storeu_si512(qs + i, qi);
                    sums = _mm512_add_epi32(sums, qi);
                }
                sum = _mm512_reduce_add_epi32(sums); /* integers: exact in any order */
#else
                for (int i = 0; i < group; i++) {
                    float v = __builtin_rintf(xg[i] / dg);
                    v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
                    qs[i] = (int)v;
                    sum += qs[i];
                }
#endif
                const long k0 = (long)g * group;
                if (k0 < blocked) {
                    /* 8-bit, a group in one unit block (upg divides 16): unit u's elements
                     * 4 j + i at j 64 + 4 L + i of its block, L its lane (block_unit), as the
                     * transposed weights' 32-bit word j of lane L holds them. */
                    for (int uu = 0; uu < upg; uu++) {
                        const long u = (long)g * upg + uu;
                        const int *qu = qs + uu * 16;
                        int8_t *base = out + (u / 16) * 256 + 4 * block_unit((int)(u % 16));
                        for (int j = 0; j < 4; j++)
                            for (int i = 0; i < 4; i++) base[j * 64 + i] = (int8_t)qu[4 * j + i];
                    }
                    stored = 1;
                }
#if XCHUNK
                if (!stored && bits == 4 && group <= XCHUNK && XCHUNK % group == 0) {
                    /* The group lies in one XCHUNK: its even elements go to consecutive
                     * places from x8_position(k0), its odd ones from XCHUNK / 2 further. */
                    int8_t *even = out + x8_position(k0), *odd = even + XCHUNK / 2;
#if defined(__AVX512F__)
                    /* 32 elements at a time: the even ones gathered, then the odd ones,
                     * each narrowed to bytes (exact: |q| <= 127). */
                    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18,
                                                            20, 22, 24, 26, 28, 30);
                    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
                    for (int i = 0; i < group; i += 32) {
                        const __m512i lo = _mm512_loadu_si512(qs + i);
                        const __m512i hi = _mm512_loadu_si512(qs + i + 16);
                        _mm_storeu_si128((__m128i *)(even + i / 2),
                                         _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(lo, evens, hi)));
                        _mm_storeu_si128((__m128i *)(odd + i / 2),
                                         _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(lo, odds, hi)));
                    }
#else
                    for (int j = 0; j < group / 2; j++) {
                        even[j] = (int8_t)qs[2 * j];
                        odd[j] = (int8_t)qs[2 * j + 1];
                    }
#endif
                    stored = 1;
                }
#endif
                if (!stored)
                    for (int i = 0; i < group; i++)
                        out[bits == 4 ? x8_position(k0 + i) : k0 + i] = (int8_t)qs[i];
            } else {
                dg = 0.0f;
            }
            d[g] = dg;
            xs[(long)m * GB + g] = dg * (float)sum; /* S exact (|S| < 2^24) */
        }
        for (int g = G; g < GB; g++) xs[(long)m * GB + g] = 0.0f;
        for (int t = 0; t < T; t++)
            for (int l = 0; l < 16; l++) {
                /* unit block t / 4: its lanes' steps at term 4 c's place (the block's other
                 * terms' places unused); a term's after the blocks */
                const int g = t < 4 * NB ? (t % 4 ? G : (4 * t + block_unit(l)) >> upg_shift)
                                         : (t * E + l * per) >> group_shift;
                dx[((long)m * T + t) * 16 + l] = g < G ? d[g] : 0.0f;
            }
    }
    kept_release(&kept_steps, d);
}

/* -- a term's integer lanes, per variant -------------------------------------------------- */
#if defined(__AVX512BW__)
/* One column's term, loaded and unpacked once for all the rows of a tile: 4-bit: a = low
 * nibbles (even elements), b = high nibbles; 8-bit: a = the bytes (VNNI) or their low
 * nibbles and b their high nibbles. */
typedef struct {
    __m512i a, b;
} wterm;

static inline __attribute__((always_inline)) wterm unpack_term(const uint8_t *w,
                                                                const int bits,
                                                                const long avail) {
    /* avail >= 0: a row's partial last term, only avail bytes read (masked, nothing past
     * the row), the rest zero. */
    const __m512i raw =
        avail < 0 ? _mm512_loadu_si512(w)
                  : _mm512_maskz_loadu_epi8(avail >= 64 ? ~0ULL : (1ULL << avail) - 1, w);
    const __m512i nib = _mm512_set1_epi8(15);
    wterm u;
    (void)bits;
#if defined(__AVX512VNNI__)
    if (bits == 8) {
        u.a = raw;
        u.b = raw;
        return u;
    }
#endif
    u.a = _mm512_and_si512(raw, nib);
    u.b = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
    return u;
}

static inline __attribute__((always_inline)) v16i dot_term(const wterm u, const int8_t *x,
                                                            const int bits) {
    __m512i acc;
#if defined(__AVX512VNNI__)
    if (bits == 4)
        acc = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u.a,
                                                      _mm512_loadu_si512(x)),
                                  u.b, _mm512_loadu_si512(x + 64));
    else
        acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u.a, _mm512_loadu_si512(x));
#else
    const __m512i one = _mm512_set1_epi16(1);
    if (bits == 4) {
        acc = _mm512_add_epi32(
            _mm512_madd_epi16(_mm512_maddubs_epi16(u.a, _mm512_loadu_si512(x)), one),
            _mm512_madd_epi16(_mm512_maddubs_epi16(u.b, _mm512_loadu_si512(x + 64)), one));
    } else {
        const __m512i s = _mm512_loadu_si512(x);
        acc = _mm512_add_epi32(
            _mm512_madd_epi16(_mm512_maddubs_epi16(u.a, s), one),
            _mm512_madd_epi16(_mm512_maddubs_epi16(u.b, s), _mm512_set1_epi16(16)));
    }
#endif
    v16i out;
    memcpy(&out, &acc, sizeof out);
    return out;
}
#elif defined(__AVX2__)
/* Lanes 0-7 from (a0, b0), 8-15 from (a1, b1): 4-bit: low and high nibbles of each 32-byte
 * half; 8-bit: low and high nibbles of each 32-byte half (vpmaddubsw would saturate). */
typedef struct {
    __m256i a0, b0, a1, b1;
} wterm;

static inline __attribute__((always_inline)) wterm unpack_term(const uint8_t *w,
                                                                const int bits,
                                                                const long avail) {
    (void)bits;
    uint8_t tail[64];
    if (avail >= 0) { /* a row's partial last term: a zero-padded copy */
        memset(tail, 0, sizeof tail);
        memcpy(tail, w, (size_t)(avail < 64 ? avail : 64));
        w = tail;
    }
    const __m256i nib = _mm256_set1_epi8(15);
    const __m256i r0 = _mm256_loadu_si256((const __m256i *)w);
    const __m256i r1 = _mm256_loadu_si256((const __m256i *)(w + 32));
    wterm u;
    u.a0 = _mm256_and_si256(r0, nib);
    u.b0 = _mm256_and_si256(_mm256_srli_epi16(r0, 4), nib);
    u.a1 = _mm256_and_si256(r1, nib);
    u.b1 = _mm256_and_si256(_mm256_srli_epi16(r1, 4), nib);
    return u;
}

static inline __attribute__((always_inline)) __m256i dot_half(__m256i a, __m256i b,
                                                               const int8_t *x, const int bits) {
    const __m256i one = _mm256_set1_epi16(1);
    if (bits == 4) /* x: 32 even elements, then 32 odd ones */
        return _mm256_add_epi32(
            _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_loadu_si256((const __m256i *)x)),
                              one),
            _mm256_madd_epi16(
                _mm256_maddubs_epi16(b, _mm256_loadu_si256((const __m256i *)(x + 32))), one));
    const __m256i s = _mm256_loadu_si256((const __m256i *)x);
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(a, s), one),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(b, s), _mm256_set1_epi16(16)));
}

static inline __attribute__((always_inline)) v16i dot_term(const wterm u, const int8_t *x,
                                                            const int bits) {
    const long half = bits == 4 ? 64 : 32; /* x8 elements per half term */
    const __m256i lo = dot_half(u.a0, u.b0, x, bits);
    const __m256i hi = dot_half(u.a1, u.b1, x + half, bits);
    v16i out;
    memcpy(&out, &lo, 32);
    memcpy((char *)&out + 32, &hi, 32);
    return out;
}
#else
/* Portable: the lanes' sums straight from the definition (natural element order). */
typedef struct {
    const uint8_t *w;
    long avail; /* bytes readable from w, or -1: all */
} wterm;

static inline wterm unpack_term(const uint8_t *w, const int bits, const long avail) {
    (void)bits;
    wterm u = {w, avail};
    return u;
}

static MAYBE_INLINE v16i dot_term(const wterm u, const int8_t *x, const int bits) {
    const int per = TERM(bits) / 16;
    v16i out;
    for (int l = 0; l < 16; l++) {
        int32_t sum = 0;
        for (int i = 0; i < per; i++) {
            const long k = (long)l * per + i, byte = bits == 4 ? k / 2 : k;
            if (u.avail >= 0 && byte >= u.avail) continue;
            const int q = bits == 4 ? (u.w[byte] >> (4 * (k & 1))) & 15 : u.w[byte];
            sum += q * x[k];
        }
        out[l] = sum;
    }
    return out;
}
#endif

/* A column's scales for term t's lanes: lane l = row[g(t, l)], 0 past G. row: the column's
 * G parameters; whole: every group the term spans is below G (all but a row's partial last
 * term), so the loads need no mask. */
static inline __attribute__((always_inline)) v16f term_scales(const void *row, int t, int G,
                                                               const int bits, const int group,
                                                               const int half,
                                                               const int whole) {
    const int E = TERM(bits);
#if defined(__AVX512BW__)
    const int spread = E / group; /* groups a term spans: 4, 2, 1, or 0 (half a group) */
    if (spread <= 1) return (v16f){0} + param_at(row, (long)t * E / group, half);
    const int g0 = t * spread;
    __m128 v;
    if (whole) { /* 4 or 2 parameters: one plain load (these loads assume no alignment or type) */
        const void *at = (const char *)row + (long)g0 * (half ? 2 : 4);
        const int bytes = spread * (half ? 2 : 4);
        const __m128i raw = bytes == 16 ? _mm_loadu_si128((const __m128i *)at)
                            : bytes == 8 ? _mm_loadu_si64(at)
                                         : _mm_loadu_si32(at);
        v = half ? _mm_cvtph_ps(raw) : _mm_castsi128_ps(raw);
    } else {
        const int count = G - g0 < spread ? G - g0 : spread;
        const __mmask8 mask = (__mmask8)((1u << count) - 1);
        v = half ? _mm_cvtph_ps(_mm_maskz_loadu_epi16(mask, (const uint16_t *)row + g0))
                 : _mm_maskz_loadu_ps(mask, (const float *)row + g0);
    }
    const __m512i idx = spread == 4 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3,
                                                        3, 3, 3)
                                    : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1,
                                                        1, 1, 1);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
#else
    (void)whole;
    v16f out;
    for (int l = 0; l < 16; l++) {
        const int g = (t * E + l * (E / 16)) / group;
        out[l] = g < G ? param_at(row, g, half) : 0.0f;
    }
    return out;
#endif
}

/* A column's scales for block c's lanes: lane L = row[g(16 c + block_unit(L))], 0 past G.
 * row: the column's G parameters; upg: units a group (group * bits / 128). */
static inline __attribute__((always_inline)) v16f block_scales(const void *row, int c, int G,
                                                                const int upg,
                                                                const int half) {
#if defined(__AVX512BW__)
    const int per = 16 / upg, g0 = c * per; /* the block's groups */
    const int count = G - g0 < per ? G - g0 : per;
    const __mmask16 mask = (__mmask16)((1u << count) - 1);
    const __m512 v = half ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)row + g0))
                          : _mm512_maskz_loadu_ps(mask, (const float *)row + g0);
    /* lane L: the group of unit block_unit(L), 4 (L % 4) + L / 4, relative to g0 */
    __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    if (upg == 2) idx = _mm512_srli_epi32(idx, 1);
    else if (upg == 4) idx = _mm512_srli_epi32(idx, 2);
    else if (upg == 8) idx = _mm512_srli_epi32(idx, 3);
    return _mm512_permutexvar_ps(idx, v);
#else
    v16f out;
    for (int l = 0; l < 16; l++) {
        const int g = (16 * c + block_unit(l)) / upg;
        out[l] = g < G ? param_at(row, g, half) : 0.0f;
    }
    return out;
#endif
}

/* A column's biases for groups 16 c .. 16 c + 15, 0 past G (row: the column's G biases). */
static inline __attribute__((always_inline)) v16f bias_lanes(const void *row, int c, int G,
                                                              const int half) {
    const int g0 = 16 * c, count = G - g0 < 16 ? G - g0 : 16;
#if defined(__AVX512BW__)
    if (count == 16)
        return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + g0)))
                    : _mm512_loadu_ps((const float *)row + g0);
    const __mmask16 mask = (__mmask16)((1u << count) - 1);
    if (half)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)row + g0));
    return _mm512_maskz_loadu_ps(mask, (const float *)row + g0);
#else
    v16f out;
    for (int j = 0; j < 16; j++) out[j] = j < count ? param_at(row, g0 + j, half) : 0.0f;
    return out;
#endif
}

/* Register tiles: rows x columns of accumulators (16 lanes each). */
#if defined(__AVX512F__)
#define I8_ROWS 6 /* 18 accumulators, 6 + 3 weight and scale vectors, x: 32 registers */
#define I8_COLS_1 4
/* Two rows (a depth-1 verify) of 4-bit weights: 4 columns, each term's unpacked weights and
 * scales shared by both rows (8 accumulators, 8 weight and 4 scale vectors); 3 columns
 * measured slower (benchmarks/results/2026-12-03-verify-rows). 8-bit weights' unit blocks
 * keep 3 (4 measured slower on the LM head). */
#define I8_COLS_2(bits) ((bits) == 4 ? 4 : 3)
/* 4 to 6 rows of 4-bit weights (a deeper verify, a few streams): 4 columns too, measured
 * faster than 3 paired (the 6-row tile spills some registers and still gains: each term's
 * unpacking serves a third more outputs). 3 rows (mixed) and 8-bit weights keep 3. */
#define I8_COLS_MORE(bits) ((bits) == 4 ? 4 : 3)
#define I8_COLS 3
#elif defined(__AVX2__)
#define I8_ROWS 2
#define I8_COLS_1 2
#define I8_COLS_2(bits) 2
#define I8_COLS_MORE(bits) 2
#define I8_COLS 2
#else
#define I8_ROWS 1
#define I8_COLS_1 1
#define I8_COLS_2(bits) 1
#define I8_COLS_MORE(bits) 1
#define I8_COLS 1
#endif
/* Prefetching the weights, I8_AHEAD columns ahead of the column being read. A product whose
 * weights reach I8_FAR_BYTES (an LM head: tens of MB, one long stream from memory)
 * prefetches into L2 (prefetcht2): an L1 prefetch holds one of the core's few L1 miss
 * buffers until its line arrives, which caps the weights in flight well below what memory
 * delivers, and the L2 tracks many more. Smaller products (a layer's, a few hundred KB) come
 * out faster prefetching into L1: their stream is short, and what an L2 prefetch gains in
 * flight it loses moving each line on to L1. Either way every element's arithmetic is the
 * same. */
#ifndef I8_AHEAD
#define I8_AHEAD 8
#endif
#ifndef I8_FAR_BYTES
#define I8_FAR_BYTES (2L << 20)
#endif
#define I8_MAXC (I8_COLS_1 > I8_COLS ? I8_COLS_1 : I8_COLS)
/* A prompt chunk's rows (more than I8_ROWS): tiles of I8_ROWS rows x I8_MANY_COLS columns.
 * With 3 columns the 6-row tile's 18 accumulators, 6 weight and 3 scale vectors leave too
 * few of the 32 registers for the rows' steps and products, and the compiler spills them
 * (a store and a reload per row and column); 2 columns fit, and measured ~10% faster at
 * 384 rows (benchmarks/results/2026-12-03-prefill-products). A tile's shape changes no bit:
 * each element's arithmetic is the same in any tile. Few-row products (decode, a verify)
 * keep the I8_COLS tiles, which load each row's x8 for one more column. */
#if defined(__AVX512F__)
#define I8_MANY_COLS 2
#else
#define I8_MANY_COLS I8_COLS
#endif
static int many_rows_tiles = 1; /* 0: I8_COLS tiles for every row count (benchmarks, tests) */

/* Whether products of more than I8_ROWS rows take the I8_MANY_COLS tiles (the default);
 * for paired benchmarks and tests (the bits are the same either way). */
void mtplx_qmm_set_many_rows_tiles(int on) { many_rows_tiles = on != 0; }

/* One term of a tile: C columns' weights and scales loaded and unpacked once, applied to R
 * rows. whole: a term read in full (else a row's partial last term: masked loads). */
static inline __attribute__((always_inline)) void term_int8(
    const qmm_t *p, int m0, const int R, const int C, int t, const int bits, const int group,
    const int half, const int whole, const uint8_t *const *wc, const void *const *sr,
    const v16f *given, v16f acc[][I8_MAXC]) {
    const int E = TERM(bits);
    const long row_bytes = (long)p->K * bits / 8, term_bytes = (long)E * bits / 8;
    const long avail = whole ? -1 : row_bytes - t * term_bytes;
    wterm u[I8_MAXC];
    v16f sc[I8_MAXC];
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) {
        u[c] = unpack_term(wc[c] + t * term_bytes, bits, avail);
        sc[c] = given ? given[c] : term_scales(sr[c], t, p->G, bits, group, half, whole);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        const int8_t *xr = p->x8 + (long)(m0 + r) * p->KP + (long)t * E;
        const v16f dx = load16(p->dx + ((long)(m0 + r) * p->T + t) * 16);
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) {
            const v16f P = __builtin_convertvector(dot_term(u[c], xr, bits), v16f);
            acc[r][c] = fma16(sc[c] * dx, P, acc[r][c]); /* exact P: |P| < 2^24 */
        }
    }
}

/* Each 128-bit quarter's four integer lanes summed, in all four (exact). */
static inline __attribute__((always_inline)) v16i quarter_sums(v16i v) {
#if defined(__AVX512F__)
    __m512i a;
    memcpy(&a, &v, sizeof a);
    a = _mm512_add_epi32(a, _mm512_shuffle_epi32(a, _MM_PERM_CDAB));
    a = _mm512_add_epi32(a, _mm512_shuffle_epi32(a, _MM_PERM_BADC));
    memcpy(&v, &a, sizeof v);
    return v;
#else
    v = v + __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v + __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
#endif
}

/* fma(a, b, c) in the lanes L with L % 4 == sel; c's other lanes as they are. */
static inline __attribute__((always_inline)) v16f fma16_sel(v16f a, v16f b, v16f c,
                                                           const int sel) {
#if defined(__AVX512F__)
    return _mm512_mask3_fmadd_ps(a, b, c, (__mmask16)(0x1111u << sel));
#elif defined(__FMA__)
    const v16f f = fma16(a, b, c);
    const v16i lane = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
    const v16i take = lane == sel; /* all ones where taken */
    v16i fi, ci;
    memcpy(&fi, &f, sizeof fi);
    memcpy(&ci, &c, sizeof ci);
    const v16i out = (fi & take) | (ci & ~take);
    memcpy(&c, &out, sizeof c);
    return c;
#else
    for (int l = sel; l < 16; l += 4) c[l] = __builtin_fmaf(a[l], b[l], c[l]); /* fused always */
    return c;
#endif
}

/* Term t of a unit block by its integer lanes (builds without I8_TRANSPOSED): C columns'
 * weights loaded and unpacked once, applied to R rows; each quarter b of the term's lanes is
 * unit 4 t + b's sum, added to lane 4 b + t % 4 of the accumulators (its lane, block_unit).
 * sc: the block's scales. */
static inline __attribute__((always_inline)) void term_units(
    const qmm_t *p, int m0, const int R, const int C, int t, const int bits,
    const uint8_t *const *wc, const v16f *sc, v16f acc[][I8_MAXC]) {
    const int E = TERM(bits);
    const long term_bytes = (long)E * bits / 8;
    wterm u[I8_MAXC];
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) u[c] = unpack_term(wc[c] + t * term_bytes, bits, -1);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        const int8_t *xr = p->x8 + (long)(m0 + r) * p->KP + (long)t * E;
        const v16f dx = load16(p->dx + ((long)(m0 + r) * p->T + t / 4 * 4) * 16);
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) {
            const v16i P = quarter_sums(dot_term(u[c], xr, bits));
            acc[r][c] = fma16_sel(sc[c] * dx, __builtin_convertvector(P, v16f), acc[r][c],
                                  t % 4); /* exact P: |P| < 2^24 */
        }
    }
}

#if I8_TRANSPOSED
/* 8-bit unit block blk of a tile: each column's 256 block bytes loaded once, their 32-bit
 * words transposed within 128-bit quarters (lane L: unit block_unit(L)), then R rows'
 * integer sums of whole units (x8 stored to match, see quantize_rows), one conversion and
 * multiply-add per lane. */
static inline __attribute__((always_inline)) void block_int8(const qmm_t *p, int m0,
                                                             const int R, const int C, int blk,
                                                             const uint8_t *const *wc,
                                                             const v16f *sc,
                                                             v16f acc[][I8_MAXC]) {
    const int8_t *xb = p->x8 + (long)m0 * p->KP + (long)blk * 256;
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) {
        const uint8_t *w = wc[c] + (long)blk * 256;
        const __m512i r0 = _mm512_loadu_si512(w), r1 = _mm512_loadu_si512(w + 64);
        const __m512i r2 = _mm512_loadu_si512(w + 128), r3 = _mm512_loadu_si512(w + 192);
        const __m512i a = _mm512_unpacklo_epi32(r0, r1), b = _mm512_unpackhi_epi32(r0, r1);
        const __m512i e = _mm512_unpacklo_epi32(r2, r3), f = _mm512_unpackhi_epi32(r2, r3);
        const __m512i o[4] = {_mm512_unpacklo_epi64(a, e), _mm512_unpackhi_epi64(a, e),
                              _mm512_unpacklo_epi64(b, f), _mm512_unpackhi_epi64(b, f)};
        /* Two integer chains a row (even and odd words), added at the end: half the
         * latency of one chain of 4. */
        __m512i P[I8_ROWS], Q[I8_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const int8_t *x = xb + (long)r * p->KP;
            P[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), o[0], _mm512_loadu_si512(x));
            Q[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), o[1], _mm512_loadu_si512(x + 64));
            P[r] = _mm512_dpbusd_epi32(P[r], o[2], _mm512_loadu_si512(x + 128));
            Q[r] = _mm512_dpbusd_epi32(Q[r], o[3], _mm512_loadu_si512(x + 192));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const v16f dx = load16(p->dx + ((long)(m0 + r) * p->T + 4L * blk) * 16);
            const __m512i sum = _mm512_add_epi32(P[r], Q[r]);
            v16i Pi;
            memcpy(&Pi, &sum, sizeof Pi);
            acc[r][c] = fma16(sc[c] * dx, __builtin_convertvector(Pi, v16f), acc[r][c]);
        }
    }
}
#endif

/* Rows m0..m0+R, columns n0..n0+C: each element's arithmetic is the same whatever R and C
 * are; they only decide which loads and unpackings are shared. Everything per column (its
 * pointers, what it prefetches) is worked out once here, not per term. */
static inline __attribute__((always_inline)) void tile_int8(const qmm_t *p, int m0, const int R,
                                                             int n0, const int C, const int bits,
                                                             const int group, const int half,
                                                             const int far, const long ahead) {
    const int E = TERM(bits), G = p->G, psize = half ? 2 : 4;
    const long row_bytes = (long)p->K * bits / 8;
    const int full = p->K / E; /* terms read in full; the next, if any, is partial */
    const uint8_t *wc[I8_MAXC];
    const void *sr[I8_MAXC], *br[I8_MAXC];
    v16f acc[I8_ROWS][I8_MAXC];
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) {
        const long n = n0 + c, next = n + ahead;
        wc[c] = p->w + n * row_bytes;
        /* The weights `ahead` columns on (negative: walking down), all their lines now: a
         * row's weights are a few hundred bytes, too short a stream for the hardware
         * prefetcher to find at one row a call, and it stops at page boundaries. */
        if (next >= 0 && next < p->N) {
            const uint8_t *ahead_w = p->w + next * row_bytes;
            if (far)
                for (long b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead_w + b, 0, 1);
            else
                for (long b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead_w + b, 0, 3);
        }
        sr[c] = (const char *)p->scales + n * G * psize;
        br[c] = (const char *)p->biases + n * G * psize;
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) acc[r][c] = (v16f){0};
    int first = 0; /* the first term summed by lanes */
    if (bits == 8) {
        /* 8-bit weights: the whole unit blocks first (see above), then the terms left */
        const int upg = group * bits / 128;
        for (int blk = 0; blk < p->NB; blk++) {
            v16f sc[I8_MAXC];
#pragma GCC unroll 8
            for (int c = 0; c < C; c++) sc[c] = block_scales(sr[c], blk, G, upg, half);
#if I8_TRANSPOSED
            block_int8(p, m0, R, C, blk, wc, sc, acc);
#else
            for (int t = 4 * blk; t < 4 * blk + 4; t++)
                term_units(p, m0, R, C, t, bits, wc, sc, acc);
#endif
        }
        first = 4 * p->NB;
    }
#if defined(__AVX512BW__)
    if (E / group >= 2 && R == 1 && first == 0) {
        /* A term's scales are 4 (or 2) consecutive parameters, each spread over 4 (or 8)
         * lanes: the 16 groups of 16 / spread terms are converted once, each term's lanes
         * then one permute of them away (the same values). With one row the per-term loads
         * and conversions were a good part of a term's work; with more they are shared, and
         * the registers go to the rows' accumulators (two rows' 4-column tile: 4 registers
         * of converted scales fewer, measured faster than with them). */
        const int spread = E / group, B = 16 / spread;
        const __m512i first = spread == 4 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2,
                                                               2, 3, 3, 3, 3)
                                          : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1,
                                                               1, 1, 1, 1, 1);
        for (int t0 = 0; t0 < p->T; t0 += B) {
            v16f S[I8_MAXC], sc[I8_MAXC];
#pragma GCC unroll 8
            for (int c = 0; c < C; c++) S[c] = bias_lanes(sr[c], t0 / B, G, half);
            __m512i idx = first;
            const int stop = full < t0 + B ? full : t0 + B;
            for (int t = t0; t < stop; t++) {
#pragma GCC unroll 8
                for (int c = 0; c < C; c++) sc[c] = _mm512_permutexvar_ps(idx, S[c]);
                term_int8(p, m0, R, C, t, bits, group, half, 1, wc, sr, sc, acc);
                idx = _mm512_add_epi32(idx, _mm512_set1_epi32(spread));
            }
            if (stop == full && full < p->T && full < t0 + B) { /* the partial last term */
#pragma GCC unroll 8
                for (int c = 0; c < C; c++) sc[c] = _mm512_permutexvar_ps(idx, S[c]);
                term_int8(p, m0, R, C, full, bits, group, half, 0, wc, sr, sc, acc);
            }
        }
    } else
#endif
    {
        for (int t = first; t < full; t++)
            term_int8(p, m0, R, C, t, bits, group, half, 1, wc, sr, NULL, acc);
        if (full < p->T) term_int8(p, m0, R, C, full, bits, group, half, 0, wc, sr, NULL, acc);
    }
    for (int k = 0; k < p->GB / 16; k++) {
        v16f b[I8_MAXC];
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) b[c] = bias_lanes(br[c], k, G, half);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const v16f s = load16(p->xs + (long)(m0 + r) * p->GB + 16L * k);
#pragma GCC unroll 8
            for (int c = 0; c < C; c++) acc[r][c] = fma16(b[c], s, acc[r][c]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) p->y[(long)(m0 + r) * p->N + n0 + c] = reduce16(acc[r][c]);
}

/* Rows m..m+R over columns n0..n1 in tiles of CR columns, then the odd columns one by one;
 * down: from n1 downwards, prefetching below (a helper's chunks, see take_chunks). One copy
 * of each tile serves both directions. */
#define I8_ROW_TILE(R, CR)                                                                   \
    do {                                                                                     \
        const int tiles = (n1 - n0) / (CR), odd = (n1 - n0) - tiles * (CR);                  \
        const long step = down ? -ahead : ahead;                                             \
        for (int i = 0; i < tiles; i++)                                                      \
            tile_int8(p, m, R, down ? n1 - (i + 1) * (CR) : n0 + i * (CR), CR, bits, group,  \
                      half, far, step);                                                      \
        for (int i = 0; i < odd; i++)                                                        \
            tile_int8(p, m, R, down ? n0 + odd - 1 - i : n1 - odd + i, 1, bits, group, half, \
                      far, step);                                                            \
    } while (0)

/* Columns n0..n1, all rows: row tiles outer (a tile's x8 rows stay in L1 while it passes
 * over the columns' weights, which stay in L1 / L2 for the next row tile). */
static inline __attribute__((always_inline)) void columns_int8_kind(const qmm_t *p, int n0,
                                                                   int n1, const int down,
                                                                   const int bits,
                                                                   const int group,
                                                                   const int half,
                                                                   const int far) {
    const long ahead = I8_AHEAD;
    int m = 0;
    if (I8_MANY_COLS != I8_COLS && many_rows_tiles && p->M > I8_ROWS)
        for (; m + I8_ROWS <= p->M; m += I8_ROWS) I8_ROW_TILE(I8_ROWS, I8_MANY_COLS);
    while (m < p->M) {
        const int R = p->M - m < I8_ROWS ? p->M - m : I8_ROWS;
        switch (R) {
        case 1: I8_ROW_TILE(1, I8_COLS_1); break;
#if I8_ROWS >= 2
        case 2: I8_ROW_TILE(2, I8_COLS_2(bits)); break;
#endif
#if I8_ROWS >= 3
        case 3: I8_ROW_TILE(3, I8_COLS); break;
#endif
#if I8_ROWS >= 4
        case 4: I8_ROW_TILE(4, I8_COLS_MORE(bits)); break;
#endif
#if I8_ROWS >= 5
        case 5: I8_ROW_TILE(5, I8_COLS_MORE(bits)); break;
#endif
#if I8_ROWS >= 6
        case 6: I8_ROW_TILE(6, I8_COLS_MORE(bits)); break;
#endif
        default: break;
        }
        m += R;
    }
}

/* Columns n0..n1 of one kind (bits, group), its parameters' type and prefetch level
 * compile-time constants in the tiles. */
#define I8_KIND(bits, group)                                                                 \
    do {                                                                                     \
        columns_int8_kind(p, n0, n1, down, bits, group, p->half, far);               \
        (void)0;                      \
    } while (0)

/* Columns n0..n1, all rows, in the integer-dot mode: one specialised copy per kind. */
static void columns_int8(const qmm_t *p, int n0, int n1, int down) {
    const int far = (long)p->N * ((long)p->K * p->bits / 8) >= I8_FAR_BYTES;
    switch (p->bits * 1000 + p->group) {
    case 4032: I8_KIND(4, 32); return;
    case 4064: I8_KIND(4, 64); return;
    case 4128: I8_KIND(4, 128); return;
    case 8032: I8_KIND(8, 32); return;
    case 8064: I8_KIND(8, 64); return;
    default: I8_KIND(8, 128); return;
    }
}

typedef struct {
    const float *x;
    int K, group, bits, KP, T, NB, GB;
    int8_t *x8;
    float *dx, *xs;
} quantize_t;

/* quantize_rows over rows lo..hi (each row on its own: the same bits however split). */
static void quantize_some(void *ctx, int lo, int hi) {
    const quantize_t *q = ctx;
    quantize_rows(q->x + (long)lo * q->K, hi - lo, q->K, q->group, q->bits, q->KP, q->T, q->NB,
                  q->GB,
                  q->x8 + (long)lo * q->KP, q->dx + (long)lo * q->T * 16,
                  q->xs + (long)lo * q->GB);
}

/* mtplx_qmm's arguments, the integer-dot mode: x quantized to 8 bits per group and
 * integer dot products (see above). Returns 0, or -1 as mtplx_qmm does (or when no memory
 * is left for the quantized rows). */
int mtplx_qmm_int8(const float *x, int M, int K, const uint32_t *w, const void *scales,
                   const void *biases, int half, int N, int bits, int group, float *y) {
    if ((bits != 4 && bits != 8) || (group != 32 && group != 64 && group != 128) ||
        K % group != 0)
        return -1;
    if (M <= 0 || N <= 0) return 0;
    const int G = K / group, E = TERM(bits), T = (K + E - 1) / E, KP = T * E;
    const int GB = (G + 15) / 16 * 16;
    const int NB = bits == 8 ? K / 256 : 0; /* 8-bit: the whole unit blocks first */
    const size_t x8_bytes = ((size_t)M * KP + 63) / 64 * 64;
    char *rows = kept_scratch(&kept_rows, x8_bytes + sizeof(float) * ((size_t)M * T * 16 +
                                                                       (size_t)M * GB));
    if (!rows) return -1;
    int8_t *x8 = (int8_t *)rows;
    float *dx = (float *)(rows + x8_bytes);
    float *xs = dx + (long)M * T * 16;
    quantize_t qr = {x, K, group, bits, KP, T, NB, GB, x8, dx, xs};
    mtplx_parallel_rows(quantize_some, &qr, M, rows_grain(K));
    qmm_t p = {.x = x, .w = (const uint8_t *)w, .scales = scales, .biases = biases, .y = y,
               .M = M, .N = N, .K = K, .G = G, .bits = bits, .group = group,
               .half = half != 0, .int8 = 1, .x8 = x8, .dx = dx, .xs = xs, .KP = KP, .T = T,
               .GB = GB, .NB = NB};
    run(&p);
    kept_release(&kept_rows, rows);
    return 0;
}
