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

/* The tail (k >= K rounded down to 16) goes into the same lanes, by k mod 16. */
static void add_tail(v8 *lo, v8 *hi, const float *a, long sa, const float *b, long sb, int k,
                     int K) {
    float t[LANES] = {0};
    for (int l = 0; k < K; k++, l++) t[l] = a[k * sa] * b[k * sb];
    *lo += load8(t);
    *hi += load8(t + 8);
}

/* sum_k a[k*sa] * b[k*sb] in the fixed order; strided operands take the scalar gather. */
static float dot_fixed(const float *a, long sa, const float *b, long sb, int K) {
    v8 lo = {0}, hi = {0};
    int k = 0;
    if (sa == 1 && sb == 1) {
        for (; k + LANES <= K; k += LANES) {
            lo += load8(a + k) * load8(b + k);
            hi += load8(a + k + 8) * load8(b + k + 8);
        }
    } else {
        for (; k + LANES <= K; k += LANES) {
            v8 x, y, u, w;
            for (int l = 0; l < 8; l++) {
                x[l] = a[(k + l) * sa], y[l] = b[(k + l) * sb];
                u[l] = a[(k + 8 + l) * sa], w[l] = b[(k + 8 + l) * sb];
            }
            lo += x * y;
            hi += u * w;
        }
    }
    add_tail(&lo, &hi, a, sa, b, sb, k, K);
    return reduce_lanes(lo, hi);
}

/* Four rows of A against one contiguous column of B: the same arithmetic per element as
 * dot_fixed, with each chunk of b loaded once for all four rows. */
static void dot4_fixed(const float *a, long am, const float *b, int K, float *out) {
    v8 lo0 = {0}, hi0 = {0}, lo1 = {0}, hi1 = {0}, lo2 = {0}, hi2 = {0}, lo3 = {0}, hi3 = {0};
    const float *a0 = a, *a1 = a + am, *a2 = a + 2 * am, *a3 = a + 3 * am;
    int k = 0;
    for (; k + LANES <= K; k += LANES) {
        v8 bl = load8(b + k), bh = load8(b + k + 8);
        lo0 += load8(a0 + k) * bl, hi0 += load8(a0 + k + 8) * bh;
        lo1 += load8(a1 + k) * bl, hi1 += load8(a1 + k + 8) * bh;
        lo2 += load8(a2 + k) * bl, hi2 += load8(a2 + k + 8) * bh;
        lo3 += load8(a3 + k) * bl, hi3 += load8(a3 + k + 8) * bh;
    }
    add_tail(&lo0, &hi0, a0, 1, b, 1, k, K);
    add_tail(&lo1, &hi1, a1, 1, b, 1, k, K);
    add_tail(&lo2, &hi2, a2, 1, b, 1, k, K);
    add_tail(&lo3, &hi3, a3, 1, b, 1, k, K);
    out[0] = reduce_lanes(lo0, hi0), out[1] = reduce_lanes(lo1, hi1);
    out[2] = reduce_lanes(lo2, hi2), out[3] = reduce_lanes(lo3, hi3);
}

static void store(float *c, float value, float alpha, float beta) {
    *c = beta == 0.0f ? alpha * value : alpha * value + beta * *c;
}

/* One product, A's rows contiguous (A(m, k) = A[m*am + k]), B(k, n) = B[k*bk + n*bn]. */
typedef struct {
    int M, N, K;
    float alpha, beta;
    const float *A, *B;
    long am, bk, bn, ldc;
    float *C;
} product_t;

/* Columns [n0, n1) of C = alpha * A B + beta * C. */
static void gemm_columns(const product_t *p, int n0, int n1) {
    const int M = p->M, K = p->K;
    const float *A = p->A, *B = p->B;
    const long am = p->am, bk = p->bk, bn = p->bn, ldc = p->ldc;
    const float alpha = p->alpha, beta = p->beta;
    float *C = p->C;
    if (bk == 1) {
        /* B's columns are contiguous in k (x @ W^T): one dot product per element; each row of
         * B^T stays in cache while all M rows of A use it. */
        for (int n = n0; n < n1; n++) {
            const float *b = B + n * bn;
            int m = 0;
            for (; m + 4 <= M; m += 4) {
                float out[4];
                dot4_fixed(A + m * am, am, b, K, out);
                for (int i = 0; i < 4; i++) store(&C[(m + i) * ldc + n], out[i], alpha, beta);
            }
            for (; m < M; m++)
                store(&C[m * ldc + n], dot_fixed(A + m * am, 1, b, 1, K), alpha, beta);
        }
    } else {
        /* B's rows are contiguous in n (scores @ V): a strided dot product per element, with
         * the same reduction order as above. Blocks of columns keep B's rows in cache. */
        enum { BLOCK = 64 };
        for (int b0 = n0; b0 < n1; b0 += BLOCK) {
            int b1 = b0 + BLOCK < n1 ? b0 + BLOCK : n1;
            for (int m = 0; m < M; m++)
                for (int n = b0; n < b1; n++)
                    store(&C[m * ldc + n], dot_fixed(A + m * am, 1, B + n * bn, bk, K), alpha,
                          beta);
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
    float *packed = NULL;
    if (ak != 1) { /* pack A's rows contiguous: a copy, no arithmetic */
        packed = malloc(sizeof(float) * (size_t)M * (size_t)(K > 0 ? K : 1));
        for (int m = 0; m < M; m++)
            for (int k = 0; k < K; k++) packed[(long)m * K + k] = A[m * am + k * ak];
        A = packed, am = K;
    }
    product_t p = {M, N, K, alpha, beta, A, B, am, bk, bn, ldc, C};
    gemm_parallel(&p);
    free(packed);
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
