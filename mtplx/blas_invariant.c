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
 */
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

/* Row-major C[M, N] = alpha * A B + beta * C with A(m, k) = A[m*am + k*ak] and
 * B(k, n) = B[k*bk + n*bn]. */
static void gemm_rows(int M, int N, int K, float alpha, const float *A, long am, long ak,
                      const float *B, long bk, long bn, float beta, float *C, long ldc) {
    float *packed = NULL;
    if (ak != 1) { /* pack A's rows contiguous: a copy, no arithmetic */
        packed = malloc(sizeof(float) * (size_t)M * (size_t)(K > 0 ? K : 1));
        for (int m = 0; m < M; m++)
            for (int k = 0; k < K; k++) packed[(long)m * K + k] = A[m * am + k * ak];
        A = packed, am = K, ak = 1;
    }
    if (bk == 1) {
        /* B's columns are contiguous in k (x @ W^T): one dot product per element; each row of
         * B^T stays in cache while all M rows of A use it. */
        for (int n = 0; n < N; n++) {
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
        for (int n0 = 0; n0 < N; n0 += BLOCK) {
            int n1 = n0 + BLOCK < N ? n0 + BLOCK : N;
            for (int m = 0; m < M; m++)
                for (int n = n0; n < n1; n++)
                    store(&C[m * ldc + n], dot_fixed(A + m * am, 1, B + n * bn, bk, K), alpha,
                          beta);
        }
    }
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
