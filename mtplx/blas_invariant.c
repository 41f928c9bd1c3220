/* Batch-invariant single-precision GEMM for the products of decoding (up to
 * INVARIANT_MAX_ROWS = 128 rows: a continuous-batching step of 16 sequences x 6 tokens).
 *
 * Why: OpenBLAS picks kernels, blockings and thread splits by matrix shape, so the same
 * output element is summed in a different order when a product has 1 row (plain decoding,
 * one token) than when it has K+1 rows (a speculative verify forward). The logits then differ
 * in the last bits, and a greedy argmax on a near tie can differ: speculative output would
 * no longer equal plain decoding token for token. Here every output element is reduced in
 * one fixed order that depends only on the reduction length and the element's own inputs --
 * never on how many rows or columns the call has, nor on trailing zero terms (masked
 * attention keys) -- so a token's logits are bitwise the same however many tokens share the
 * forward.
 *
 * Order: products a[k] * b[k] are accumulated into 16 partial sums by k mod 16 (k ascending),
 * then the partial sums are added in a fixed tree. Written with GCC vector extensions, never
 * reassociated (no -ffast-math); whether a multiply-add is fused is fixed at compile time.
 *
 * mtplx_sgemm_rows(row_major, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)
 * computes C = alpha * op(A) op(B) + beta * C for a row-major C of M rows (a column-major
 * call is turned into the row-major product of the transposes).
 *
 * Threads: a large product's columns are split between the calling thread and helper
 * threads (mtplx_invariant_set_threads). Each output element is still computed whole, by
 * one thread, in the order above, so the split changes no bit of the result.
 *
 * Speed: register tiles of 4 rows x 3 columns (each A load feeds 3 multiply-adds, each B
 * load 4), panels of B's columns that stay in L2 while blocks of A's rows pass them, and B
 * read as three long streams; see "Register tiles" and "Panels" below. None of it changes
 * an element's arithmetic.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#if defined(__FMA__)
#include <immintrin.h>
#endif

/* Sixteen partial sums: two 8-wide vectors, lane l of vector v holds the terms with
 * k mod 16 == 8 v + l. GCC vector extensions keep it portable; no reassociation happens. */
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
#define LANES 16

/* Whether a multiply-add rounds once (fused) or twice changes bits, so it is decided here,
 * by the target the shim is compiled for, and never by the compiler: the shim is built with
 * -ffp-contract=off, and fused operations are written out. One build (one flag set) thus
 * gives one set of bits on every CPU it runs on; a build for another flag set may differ in
 * the last bits, which is why the flags are part of the shim's cache key (mtplx.blas_shim). */
#if defined(__FMA__) /* x86 FMA3 (-mfma) */
#define MTPLX_FUSED 1
static inline v8 fma8(v8 a, v8 b, v8 acc) { return _mm256_fmadd_ps(a, b, acc); }
#elif defined(__FP_FAST_FMAF) /* hardware fmaf, e.g. every aarch64 */
#define MTPLX_FUSED 1
static inline v8 fma8(v8 a, v8 b, v8 acc) {
    for (int i = 0; i < 8; i++) acc[i] = __builtin_fmaf(a[i], b[i], acc[i]);
    return acc;
}
#else /* baseline x86-64 (SSE2): multiply, round, add, round */
#define MTPLX_FUSED 0
static inline v8 fma8(v8 a, v8 b, v8 acc) { return acc + a * b; }
#endif

static inline float fma1(float a, float b, float c) {
#if MTPLX_FUSED
    return __builtin_fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

/* 1 when this build fuses its multiply-adds (tests pick the matching reference). */
int mtplx_invariant_fused(void) { return MTPLX_FUSED; }

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The fixed tree over one element's 16 partial sums, given s = lo + hi (lane l: partial l +
 * partial l + 8): ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)). */
static inline float reduce_sum(v8 s) {
    v4 s_lo, s_hi, u;
    memcpy(&s_lo, &s, sizeof s_lo);
    memcpy(&s_hi, (const char *)&s + sizeof s_lo, sizeof s_hi);
    u = s_lo + s_hi; /* u[j] = s[j] + s[j + 4] */
    return (u[0] + u[2]) + (u[1] + u[3]);
}

/* The tail (k >= K rounded down to 16, K not a multiple of 16) goes into the same lanes,
 * by k mod 16, through the same multiply-add as a full chunk; lanes past K add +0.0 (a
 * multiply-add of zeros). So a product whose A row is padded with trailing zeros (a row's
 * masked attention keys in a batch) gives exactly the bits of the unpadded one: its zeros
 * only add +0.0. (With no tail every lane adds +0.0 too, which is not a no-op for a lane
 * that underflowed to -0.0: tile_fixed.) */
static inline void add_tail(v8 *lo, v8 *hi, const float *a, const float *b, int k, int K) {
    float ta[LANES] = {0}, tb[LANES] = {0};
    for (int l = 0; k < K; k++, l++) ta[l] = a[k], tb[l] = b[k];
    *lo = fma8(load8(ta), load8(tb), *lo);
    *hi = fma8(load8(ta + 8), load8(tb + 8), *hi);
}

/* ---- Register tiles ------------------------------------------------------------------- */
/* A tile is up to TILE_ROWS rows of A against up to TILE_COLS columns of B. Per 16-k chunk
 * each A vector loaded feeds TILE_COLS multiply-adds and each B vector TILE_ROWS, where one
 * row against one column needs two loads per multiply-add (load-bound). Every element of
 * the tile keeps its own 16 partial sums, updated in k order by the same multiply-add, then
 * add_tail and reduce_sum: its bits depend neither on the tile's shape nor on its
 * neighbours, so neither on the row nor on the column count of the product.
 *
 * An element's partial sums are two 8-wide accumulators (lanes 0-7 and 8-15 of a chunk), so
 * 4 x 3 elements would need 24 of AVX2's 16 vector registers. The two halves are separate
 * chains, though: a large tile sweeps K twice, lanes 0-7 of every chunk, then lanes 8-15,
 * with 12 accumulators, 3 B vectors and 1 A vector live: 7 loads per 12 multiply-adds. A
 * tile of at most SINGLE_SWEEP accumulators (2 R C) sweeps both halves at once.
 *
 * KBLOCK: the two sweeps take K in blocks, so that a block of the tile's rows and columns
 * (7 x 768 floats, 21 KiB) is still in L1 for the second sweep even when K is long (the
 * MLP's down projection, K = 1536); each lane still meets its terms in k order (KBLOCK is
 * a multiple of 16, so blocks never split a chunk). */
enum { TILE_ROWS = 4, TILE_COLS = 3, SINGLE_SWEEP = 12, KBLOCK = 768 };

typedef v8 tile_acc[TILE_ROWS][TILE_COLS];

/* acc[r][c] += a[r*am + k + l] * b[c*bn + k + l] for the chunks k in [k0, k1), in k order,
 * lane l in 0..7: the caller offsets a and b by 0 (lanes 0-7 of each chunk) or 8 (8-15). */
static inline __attribute__((always_inline)) void sweep_half(const float *a, long am,
                                                             const float *b, long bn, int k0,
                                                             int k1, int R, int C,
                                                             tile_acc acc) {
    for (int k = k0; k < k1; k += LANES) {
        v8 bv[TILE_COLS];
        for (int c = 0; c < C; c++) bv[c] = load8(b + c * bn + k);
        for (int r = 0; r < R; r++) {
            v8 av = load8(a + r * am + k);
            for (int c = 0; c < C; c++) acc[r][c] = fma8(av, bv[c], acc[r][c]);
        }
    }
}

/* Both halves in one sweep over the chunks [0, K16): the same chains, interleaved. */
static inline __attribute__((always_inline)) void sweep_both(const float *a, long am,
                                                             const float *b, long bn, int K16,
                                                             int R, int C, tile_acc lo,
                                                             tile_acc hi) {
    for (int k = 0; k < K16; k += LANES) {
        v8 bl[TILE_COLS], bh[TILE_COLS];
        for (int c = 0; c < C; c++) {
            bl[c] = load8(b + c * bn + k);
            bh[c] = load8(b + c * bn + k + 8);
        }
        for (int r = 0; r < R; r++) {
            v8 al = load8(a + r * am + k), ah = load8(a + r * am + k + 8);
            for (int c = 0; c < C; c++) {
                lo[r][c] = fma8(al, bl[c], lo[r][c]);
                hi[r][c] = fma8(ah, bh[c], hi[r][c]);
            }
        }
    }
}

/* out[r*C + c] = sum_k a[r*am + k] * b[c*bn + k] in the fixed order, for r < R, c < C.
 * Inlined with constant R and C (tile_R_C below), so the accumulators live in registers.
 * The common cases (K within one block, no tail) are spelled out apart: as straight-line
 * code the compiler keeps the accumulators out of memory (~10% on 576-long products). */
static inline __attribute__((always_inline)) void tile_fixed(const float *a, long am,
                                                             const float *b, long bn, int K,
                                                             int R, int C, float *out) {
    const int K16 = K & ~(LANES - 1);
    tile_acc lo, hi;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) lo[r][c] = hi[r][c] = (v8){0};
    if (2 * R * C <= SINGLE_SWEEP) {
        sweep_both(a, am, b, bn, K16, R, C, lo, hi);
    } else if (K16 <= KBLOCK) {
        sweep_half(a, am, b, bn, 0, K16, R, C, lo);
        sweep_half(a + LANES / 2, am, b + LANES / 2, bn, 0, K16, R, C, hi);
    } else {
        for (int k0 = 0; k0 < K16; k0 += KBLOCK) {
            const int k1 = K16 - k0 < KBLOCK ? K16 : k0 + KBLOCK;
            sweep_half(a, am, b, bn, k0, k1, R, C, lo);
            sweep_half(a + LANES / 2, am, b + LANES / 2, bn, k0, k1, R, C, hi);
        }
    }
    if (K16 == K) { /* add_tail with no tail: +0.0 to every lane */
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
                out[r * C + c] = reduce_sum((lo[r][c] + (v8){0}) + (hi[r][c] + (v8){0}));
        return;
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            add_tail(&lo[r][c], &hi[r][c], a + r * am, b + c * bn, K16, K);
            out[r * C + c] = reduce_sum(lo[r][c] + hi[r][c]);
        }
}

typedef void tile_fn(const float *a, long am, const float *b, long bn, int K, float *out);
#define TILE(R, C)                                                                             \
    static void tile_##R##_##C(const float *a, long am, const float *b, long bn, int K,         \
                               float *out) {                                                   \
        tile_fixed(a, am, b, bn, K, R, C, out);                                                \
    }
TILE(1, 1) TILE(1, 2) TILE(1, 3)
TILE(2, 1) TILE(2, 2) TILE(2, 3)
TILE(3, 1) TILE(3, 2) TILE(3, 3)
TILE(4, 1) TILE(4, 2) TILE(4, 3)
#undef TILE
static tile_fn *const tiles[TILE_ROWS][TILE_COLS] = {
    {tile_1_1, tile_1_2, tile_1_3},
    {tile_2_1, tile_2_2, tile_2_3},
    {tile_3_1, tile_3_2, tile_3_3},
    {tile_4_1, tile_4_2, tile_4_3},
};

/* beta == 0 never reads C (BLAS semantics: C may hold NaN or garbage then). */
static inline void store(float *c, float value, float alpha, float beta) {
    *c = beta == 0.0f ? alpha * value : fma1(beta, *c, alpha * value);
}

/* ---- Panels ---------------------------------------------------------------------------- */
/* One product; A's rows are contiguous in k: A(m, k) = A[m*am + k]; C is row-major. B's
 * columns are contiguous in k, B(k, n) = B[n*bn + k], or (b_rows) its rows are contiguous
 * in n, B(k, n) = B[k*bk + n]. */
typedef struct {
    int M, N, K;
    float alpha, beta;
    const float *A, *B;
    long am, bn, ldc;
    float *C;
    int panel;  /* columns per panel: the unit of cache reuse and of the thread split */
    int b_rows; /* B stored by rows (gemm_b_rows) */
    long bk;
} product_t;

/* A panel of B's columns is read from memory once, then stays in L2 (PANEL_BYTES of its
 * 512 KiB, leaving room for A) while blocks of ROW_BLOCK rows of A, each in L1, pass it: up
 * to 8 rows one pass does it all; 128 rows re-read the panel from L2, not from memory, 16
 * times. A panel is a multiple of TILE_COLS columns, at most PANEL_COLS. */
enum { ROW_BLOCK = 8, PANEL_BYTES = 192 << 10, PANEL_COLS = 96 };

static int panel_width(int K) {
    long cols = PANEL_BYTES / ((long)(K > 0 ? K : 1) * (long)sizeof(float));
    cols = cols / TILE_COLS * TILE_COLS;
    return cols < TILE_COLS ? TILE_COLS : cols > PANEL_COLS ? PANEL_COLS : (int)cols;
}

/* Split [0, n) into `parts` ranges as even as possible (6 rows in 2 tiles: 3 + 3, not
 * 4 + 2, fuller tiles reuse more loads); this is range i's end, given its start. */
static inline int even_end(int start, int n, int parts, int i) {
    const int left = n - start, rest = parts - i;
    return start + left / rest + (left % rest != 0);
}

/* Rows [m0, m1) of C against C columns n, n + stride, ... (one column tile). */
static void column_tile(const product_t *p, int m0, int m1, int n, int stride, int C) {
    const int row_tiles = (m1 - m0 + TILE_ROWS - 1) / TILE_ROWS;
    for (int t = 0, m = m0; t < row_tiles; t++) {
        const int m_end = even_end(m, m1, row_tiles, t), R = m_end - m;
        float out[TILE_ROWS * TILE_COLS];
        tiles[R - 1][C - 1](p->A + m * p->am, p->am, p->B + n * p->bn, stride * p->bn, p->K,
                            out);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
                store(&p->C[(m + r) * p->ldc + n + c * stride], out[r * C + c], p->alpha,
                      p->beta);
        m = m_end;
    }
}

/* Columns [n0, n1) of C, one panel. A column tile takes columns L apart (n, n + L, n + 2L,
 * L a third of the panel), not adjacent ones: B is then read as three long sequential
 * streams, which the hardware prefetcher follows, instead of three new short streams every
 * tile (adjacent columns cost ~1.5x on products streaming B from memory). */
static void gemm_panel(const product_t *p, int n0, int n1) {
    const int M = p->M, L = (n1 - n0) / TILE_COLS, left = n1 - n0 - L * TILE_COLS;
    const int blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
    for (int blk = 0, m0 = 0; blk < blocks; blk++) {
        const int m1 = even_end(m0, M, blocks, blk);
        for (int i = 0; i < L; i++) column_tile(p, m0, m1, n0 + i, L, TILE_COLS);
        if (left) column_tile(p, m0, m1, n0 + L * TILE_COLS, 1, left);
        m0 = m1;
    }
}

/* ---- B stored by rows ------------------------------------------------------------------ */
/* When B's rows are contiguous in n (attention's scores @ V, V being [L, head_dim]), eight
 * columns sit side by side in one vector: the vector runs across columns, and an element's
 * sixteen partial sums become sixteen vectors, vector l holding partial l (k mod 16 == l)
 * of eight columns. Each element meets exactly the operations of tile_fixed -- the same
 * multiply-adds in k order, the tail's multiply-adds or +0.0, the same tree -- while B
 * is read in place: transposing it into a packed copy first cost 3-7x the product itself
 * for one decode row (scores @ V of a 64-wide head over 33-1089 keys: 2.3 -> 0.3 us, 34 ->
 * 10 us). Rows go one at a time, two loads per multiply-add, so from ROWS_MAX_M rows on the
 * packed copy and the tiles win again (at 16 rows over 1089 keys: 87 us against 166).
 * ROWS_PANEL (a multiple of COL_VEC) is the chunk of columns threads take. */
enum { COL_VEC = 8, ROWS_PANEL = 64, ROWS_MAX_M = 8 };

static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }

/* B(k, n .. n + cols) padded with zeros: the columns a vector holds, all 8 or the last few. */
static inline __attribute__((always_inline)) v8 load_cols(const float *b, int cols) {
    if (cols == COL_VEC) return load8(b);
    v8 v = {0};
    memcpy(&v, b, sizeof(float) * (size_t)cols);
    return v;
}

/* out[i] = the fixed-order sum for row a of A and column n + i of B, i < cols. */
static inline __attribute__((always_inline)) void row_cols(const float *a, const float *b,
                                                           long bk, int K, int cols,
                                                           v8 *out) {
    const int K16 = K & ~(LANES - 1);
    v8 part[LANES];
    for (int half = 0; half < 2; half++) { /* lanes 0-7, then 8-15: 8 chains at a time */
        v8 acc[LANES / 2] = {{0}};
        for (int k = half * (LANES / 2); k < K16; k += LANES)
            for (int l = 0; l < LANES / 2; l++)
                acc[l] = fma8(splat(a[k + l]), load_cols(b + (k + l) * bk, cols), acc[l]);
        memcpy(part + half * (LANES / 2), acc, sizeof acc);
    }
    for (int l = 0; l < LANES; l++) { /* add_tail: the same multiply-add, +0.0 past K */
        const int k = K16 + l;
        part[l] = k < K ? fma8(splat(a[k]), load_cols(b + k * bk, cols), part[l])
                        : part[l] + (v8){0};
    }
    v8 s[LANES / 2], u[LANES / 4];
    for (int j = 0; j < LANES / 2; j++) s[j] = part[j] + part[j + LANES / 2];
    for (int j = 0; j < LANES / 4; j++) u[j] = s[j] + s[j + LANES / 4];
    *out = (u[0] + u[2]) + (u[1] + u[3]); /* reduce_sum's tree */
}

/* Columns [n0, n1) of C when B is stored by rows; rows one at a time (their B columns stay
 * in cache for the next row). */
static void gemm_b_rows(const product_t *p, int n0, int n1) {
    for (int n = n0; n < n1; n += COL_VEC) {
        const int cols = n1 - n < COL_VEC ? n1 - n : COL_VEC;
        for (int m = 0; m < p->M; m++) {
            v8 out;
            if (cols == COL_VEC)
                row_cols(p->A + m * p->am, p->B + n, p->bk, p->K, COL_VEC, &out);
            else
                row_cols(p->A + m * p->am, p->B + n, p->bk, p->K, cols, &out);
            for (int i = 0; i < cols; i++)
                store(&p->C[m * p->ldc + n + i], out[i], p->alpha, p->beta);
        }
    }
}

/* Columns [n0, n1) of C = alpha * A B + beta * C, panel by panel. */
static void gemm_columns(const product_t *p, int n0, int n1) {
    if (p->b_rows) {
        gemm_b_rows(p, n0, n1);
        return;
    }
    for (int n = n0; n < n1; n += p->panel)
        gemm_panel(p, n, n + p->panel < n1 ? n + p->panel : n1);
}

/* ---- Helper threads ------------------------------------------------------------------- */
/* A split product is cut into chunks (panels) that the caller and the helpers take
 * in any order from one atomic ticket, so a helper that wakes late (or is descheduled)
 * never stalls the caller: the caller takes whatever chunks are left. The ticket packs the
 * job's serial, its chunk count and the next free chunk, so a grab can never mix jobs. */

enum { MAX_THREADS = 8, SPIN_ROUNDS = 4000, MIN_PARALLEL_WORK = 1 << 17 };

static int threads_wanted = 1;
static int num_helpers = 0;
static product_t shared_product;
static atomic_ulong ticket;  /* serial << 32 | num_chunks << 16 | next_chunk */
static atomic_int busy_helpers; /* helpers inside a grab-and-compute */
static atomic_ulong split_products; /* products computed by more than one thread (tests) */
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER; /* one split product at a time */
static pthread_mutex_t wake_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

/* Take and compute chunks of the published product until none is left. */
static void take_chunks(void) {
    unsigned long t = atomic_load_explicit(&ticket, memory_order_acquire);
    for (;;) {
        unsigned long count = (t >> 16) & 0xffff, next = t & 0xffff;
        if (next >= count) return;
        if (!atomic_compare_exchange_weak_explicit(&ticket, &t, t + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue; /* t now holds the current ticket */
        int n0 = (int)next * shared_product.panel, n1 = n0 + shared_product.panel;
        gemm_columns(&shared_product, n0, n1 < shared_product.N ? n1 : shared_product.N);
        t = atomic_load_explicit(&ticket, memory_order_acquire);
    }
}

static void *helper_main(void *arg) {
    (void)arg;
    unsigned long serial = atomic_load(&ticket) >> 32;
    for (;;) {
        int spins = 0;
        /* Spin briefly (products come in quick runs within a forward), then sleep. */
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
    /* The helpers do not exist in a forked child: start new ones when next needed. */
    num_helpers = 0;
    atomic_store(&busy_helpers, 0);
    pthread_mutex_init(&call_lock, NULL);
    pthread_mutex_init(&wake_lock, NULL);
    pthread_cond_init(&wake, NULL);
}

/* Start helpers up to threads_wanted - 1; called with call_lock held. */
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

/* Split by columns when the product is large enough to repay waking the helpers. */
static void gemm_parallel(const product_t *p) {
    long work = (long)p->M * p->N * p->K;
    long chunks = ((long)p->N + p->panel - 1) / p->panel;
    if (threads_wanted <= 1 || work < MIN_PARALLEL_WORK || chunks < 2 || chunks > 0xffff ||
        pthread_mutex_trylock(&call_lock) != 0) {
        gemm_columns(p, 0, p->N);
        return;
    }
    start_helpers();
    atomic_fetch_add_explicit(&split_products, 1, memory_order_relaxed);
    /* No helper is inside a grab of the previous product (waited for below), and a late
     * one can only grab from the ticket published after this product is written. */
    shared_product = *p;
    unsigned long serial = (atomic_load(&ticket) >> 32) + 1;
    pthread_mutex_lock(&wake_lock);
    atomic_store_explicit(&ticket, (serial << 32) | ((unsigned long)chunks << 16),
                          memory_order_release);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&wake_lock);
    take_chunks();
    while (atomic_load_explicit(&busy_helpers, memory_order_acquire) != 0) cpu_relax();
    pthread_mutex_unlock(&call_lock);
}

/* How many threads (the caller included, at most MAX_THREADS) may split a large product. */
void mtplx_invariant_set_threads(int threads) {
    threads_wanted = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
}

unsigned long mtplx_invariant_split_products(void) { return atomic_load(&split_products); }

/* Row-major C[M, N] = alpha * A B + beta * C with A(m, k) = A[m*am + k*ak] and
 * B(k, n) = B[k*bk + n*bn]. */
static void gemm_rows(int M, int N, int K, float alpha, const float *A, long am, long ak,
                      const float *B, long bk, long bn, float beta, float *C, long ldc) {
    float *packed_a = NULL, *packed_b = NULL;
    if (ak != 1) { /* pack A's rows contiguous: a copy, no arithmetic */
        packed_a = malloc(sizeof(float) * (size_t)M * (size_t)(K > 0 ? K : 1));
        for (int m = 0; m < M; m++)
            for (int k = 0; k < K; k++) packed_a[(long)m * K + k] = A[m * am + k * ak];
        A = packed_a, am = K;
    }
    const int b_rows = bk != 1 && bn == 1 && M <= ROWS_MAX_M;
    if (bk != 1 && !b_rows) {
        /* Neither B's rows nor its columns are contiguous: pack its columns (a copy, no
         * arithmetic), for the tiles' contiguous loads. */
        packed_b = malloc(sizeof(float) * (size_t)N * (size_t)(K > 0 ? K : 1));
        for (int k = 0; k < K; k++)
            for (int n = 0; n < N; n++) packed_b[(long)n * K + k] = B[k * bk + n * bn];
        B = packed_b, bn = K;
    }
    const int panel = b_rows ? ROWS_PANEL : panel_width(K);
    product_t p = {M, N, K, alpha, beta, A, B, am, bn, ldc, C, panel, b_rows, bk};
    gemm_parallel(&p);
    free(packed_a);
    free(packed_b);
}

void mtplx_sgemm_rows(int row_major, int trans_a, int trans_b, int M, int N, int K, float alpha,
                      const float *A, int lda, const float *B, int ldb, float beta, float *C,
                      int ldc) {
    if (!row_major) { /* C^T = op(B)^T op(A)^T, row-major */
        const float *T = A;
        int t = M, tl = lda, tt = trans_a;
        A = B, lda = ldb, trans_a = trans_b, M = N;
        B = T, ldb = tl, trans_b = tt, N = t;
    }
    long am = trans_a ? 1 : lda, ak = trans_a ? lda : 1;
    long bk = trans_b ? 1 : ldb, bn = trans_b ? ldb : 1;
    gemm_rows(M, N, K, alpha, A, am, ak, B, bk, bn, beta, C, ldc);
}
