/* Batch-invariant single-precision GEMM for the few-row products of decoding.
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
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* Sixteen partial sums: two 8-wide vectors, lane l of vector v holds the terms with
 * k mod 16 == 8 v + l. GCC vector extensions keep it portable; no reassociation happens. */
typedef float v8 __attribute__((vector_size(32)));
#define LANES 16

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static float reduce_lanes(v8 lo, v8 hi) {
    v8 s = lo + hi; /* lane l: partial l + partial l + 8 */
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

/* Add one chunk of 16 terms per row: lane l of lo (hi) takes the term k0 + l (k0 + 8 + l).
 * Full chunks and the zero-padded tail go through this one expression, so a tail term is
 * rounded exactly as in a full chunk (the compiler fuses the multiply-add in both or in
 * neither): a product padded with trailing zeros (a row's masked attention keys) gives the
 * same bits as the unpadded one. */
static inline __attribute__((always_inline)) void add_chunk(v8 *lo, v8 *hi, const float *a,
                                                            long am, const float *b, int ROWS) {
    v8 bl = load8(b), bh = load8(b + 8);
    for (int r = 0; r < ROWS; r++) {
        lo[r] += load8(a + r * am) * bl;
        hi[r] += load8(a + r * am + 8) * bh;
    }
}

/* sum_k a[r*am + k] * b[k] in the fixed order for ROWS (1 to 4) rows of A against one column
 * of B; each chunk of b is loaded once for all rows, whose accumulator chains run side by
 * side. An element's arithmetic does not depend on ROWS. Inlined with a constant ROWS, so
 * the arrays live in registers. */
static inline __attribute__((always_inline)) void dot_rows_fixed(const float *a, long am,
                                                                 const float *b, int K, int ROWS,
                                                                 float *out) {
    v8 lo[4] = {{0}}, hi[4] = {{0}};
    int k = 0;
    for (; k + LANES <= K; k += LANES) add_chunk(lo, hi, a + k, am, b + k, ROWS);
    if (k < K) { /* the tail, zero-padded to a chunk */
        float ta[4 * LANES] = {0}, tb[LANES] = {0};
        for (int i = k; i < K; i++) {
            tb[i - k] = b[i];
            for (int r = 0; r < ROWS; r++) ta[r * LANES + i - k] = a[r * am + i];
        }
        add_chunk(lo, hi, ta, LANES, tb, ROWS);
    }
    for (int r = 0; r < ROWS; r++) out[r] = reduce_lanes(lo[r], hi[r]);
}

static void store(float *c, float value, float alpha, float beta) {
    *c = beta == 0.0f ? alpha * value : alpha * value + beta * *c;
}

/* One product, A's rows and B's columns contiguous in k: A(m, k) = A[m*am + k],
 * B(k, n) = B[n*bn + k]. */
typedef struct {
    int M, N, K;
    float alpha, beta;
    const float *A, *B;
    long am, bn, ldc;
    float *C;
} product_t;

/* Columns [n0, n1) of C = alpha * A B + beta * C: one dot product per element; each column
 * of B stays in cache while all M rows of A use it. */
static void gemm_columns(const product_t *p, int n0, int n1) {
    const int M = p->M, K = p->K;
    const long am = p->am, ldc = p->ldc;
    for (int n = n0; n < n1; n++) {
        const float *b = p->B + n * p->bn;
        for (int m = 0; m < M; m += 4) {
            const float *a = p->A + m * am;
            float out[4];
            switch (M - m) {
            case 1: dot_rows_fixed(a, am, b, K, 1, out); break;
            case 2: dot_rows_fixed(a, am, b, K, 2, out); break;
            case 3: dot_rows_fixed(a, am, b, K, 3, out); break;
            default: dot_rows_fixed(a, am, b, K, 4, out);
            }
            for (int i = 0; i < 4 && m + i < M; i++)
                store(&p->C[(m + i) * ldc + n], out[i], p->alpha, p->beta);
        }
    }
}

/* ---- Helper threads ------------------------------------------------------------------- */
/* A split product is cut into chunks of CHUNK columns that the caller and the helpers take
 * in any order from one atomic ticket, so a helper that wakes late (or is descheduled)
 * never stalls the caller: the caller takes whatever chunks are left. The ticket packs the
 * job's serial, its chunk count and the next free chunk, so a grab can never mix jobs. */

enum { MAX_THREADS = 8, CHUNK = 64, SPIN_ROUNDS = 4000, MIN_PARALLEL_WORK = 1 << 17 };

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
        int n0 = (int)next * CHUNK, n1 = n0 + CHUNK;
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
    long chunks = ((long)p->N + CHUNK - 1) / CHUNK;
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
    if (bk != 1) {
        /* Pack B's columns contiguous in k (attention's scores @ V): the strided dot product
         * gathers one scalar at a time and cost ~4x the contiguous one; the copy is cheap
         * next to it and the arithmetic is the same. */
        packed_b = malloc(sizeof(float) * (size_t)N * (size_t)(K > 0 ? K : 1));
        for (int k = 0; k < K; k++)
            for (int n = 0; n < N; n++) packed_b[(long)n * K + k] = B[k * bk + n * bn];
        B = packed_b, bn = K;
    }
    product_t p = {M, N, K, alpha, beta, A, B, am, bn, ldc, C};
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
