/* A/B driver: a decode token's quantized products (the default model's shapes: 30 layers of
 * q|k|v 960x576, o 576x576, gate|up 3072x576, down 576x1536 at 4 bits, then the 49152x576
 * 8-bit LM head; group 32, float16 scales and biases), every layer's weights its own (~85 MB,
 * read from memory as in a decode step), through two builds of quant_kernel.c's
 * mtplx_qmm_int8, tokens alternating A, B, B, A...; medians of wall and process CPU time per
 * token, and whether both builds' outputs are bitwise equal.
 *
 *   gcc -O2 -mavx512f -mavx512bw -mf16c token_ab.c -o token_ab -ldl
 *   ./token_ab A.so B.so THREADS ROWS TOKENS [LAYERS_ONLY]
 * LAYERS_ONLY=1 skips the LM head; =2 runs the LM head alone; HOT=1 reuses layer 0's
 * weights for every layer (the arithmetic with the weights in L2). */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
typedef int (*qmm_fn)(const float *, int, int, const uint32_t *, const void *, const void *,
                      int, int, int, int, float *);
typedef void (*thr_fn)(int);
static double now(clockid_t c) {
    struct timespec t;
    clock_gettime(c, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
typedef struct {
    int N, K, bits;
    uint8_t *w;
    uint16_t *s, *b;
} prod_t;
static void fill(prod_t *p) {
    const long wb = (long)p->N * p->K * p->bits / 8, G = p->K / 32;
    p->w = aligned_alloc(64, (wb + 63) / 64 * 64);
    for (long i = 0; i < wb; i++) p->w[i] = (uint8_t)rand();
    p->s = aligned_alloc(64, (p->N * G * 2 + 63) / 64 * 64);
    p->b = aligned_alloc(64, (p->N * G * 2 + 63) / 64 * 64);
    for (long i = 0; i < p->N * G; i++) {
        _Float16 a = (_Float16)((rand() % 1000) * 1e-5f), c = (_Float16)(-(rand() % 1000) * 1e-4f);
        memcpy(&p->s[i], &a, 2);
        memcpy(&p->b[i], &c, 2);
    }
}
int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "token_ab A.so B.so THREADS ROWS TOKENS [LAYERS_ONLY]\n");
        return 1;
    }
    qmm_fn f[2];
    for (int i = 0; i < 2; i++) {
        void *h = dlopen(argv[1 + i], RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            fprintf(stderr, "%s\n", dlerror());
            return 1;
        }
        f[i] = (qmm_fn)dlsym(h, "mtplx_qmm_int8");
        ((thr_fn)dlsym(h, "mtplx_qmm_set_threads"))(atoi(argv[3]));
    }
    const int M = atoi(argv[4]), tokens = atoi(argv[5]), only = argc > 6 ? atoi(argv[6]) : 0;
    const int hot = getenv("HOT") != NULL;
    srand(1);
    enum { L = 30 };
    const int shape[4][3] = {{960, 576, 4}, {576, 576, 4}, {3072, 576, 4}, {576, 1536, 4}};
    prod_t prods[4 * L + 1];
    int np = 0;
    if (only != 2)
        for (int l = 0; l < L; l++)
            for (int j = 0; j < 4; j++) {
                prods[np] = (prod_t){shape[j][0], shape[j][1], shape[j][2], 0, 0, 0};
                if (hot && l > 0) prods[np] = prods[j];
                else fill(&prods[np]);
                np++;
            }
    if (only != 1) {
        prods[np] = (prod_t){49152, 576, 8, 0, 0, 0};
        fill(&prods[np]);
        np++;
    }
    float *x = malloc(sizeof(float) * M * 3072);
    for (int i = 0; i < M * 3072; i++) x[i] = (rand() % 2001 - 1000) * 1e-3f;
    float *y[2];
    long ysz = 0;
    for (int i = 0; i < np; i++) ysz += (long)M * prods[i].N;
    y[0] = malloc(sizeof(float) * ysz);
    y[1] = malloc(sizeof(float) * ysz);
    double *tw[2], *tc[2];
    for (int i = 0; i < 2; i++) {
        tw[i] = malloc(sizeof(double) * tokens);
        tc[i] = malloc(sizeof(double) * tokens);
    }
    long macs = 0;
    for (int i = 0; i < np; i++) macs += (long)prods[i].N * prods[i].K;
    for (int r = -2; r < tokens; r++)
        for (int ii = 0; ii < 2; ii++) {
            const int i = (r & 1) ? 1 - ii : ii;
            double a = now(CLOCK_MONOTONIC), b = now(CLOCK_PROCESS_CPUTIME_ID);
            long off = 0;
            for (int q = 0; q < np; q++) {
                f[i](x, M, prods[q].K, (const uint32_t *)prods[q].w, prods[q].s, prods[q].b, 1,
                     prods[q].N, prods[q].bits, 32, y[i] + off);
                off += (long)M * prods[q].N;
            }
            double a2 = now(CLOCK_MONOTONIC), b2 = now(CLOCK_PROCESS_CPUTIME_ID);
            if (r >= 0) {
                tw[i][r] = (a2 - a) * 1e3;
                tc[i][r] = (b2 - b) * 1e3;
            }
        }
    const int same = memcmp(y[0], y[1], sizeof(float) * ysz) == 0;
    printf("threads %s rows %d products %d (%.1f M MAC/row):", argv[3], M, np, macs / 1e6);
    for (int i = 0; i < 2; i++) {
        qsort(tw[i], tokens, sizeof(double), cmp);
        qsort(tc[i], tokens, sizeof(double), cmp);
        printf("  %c wall %.3f cpu %.3f ms", 'A' + i, tw[i][tokens / 2], tc[i][tokens / 2]);
    }
    printf("  B/A wall %.3f cpu %.3f  %s\n", tw[1][tokens / 2] / tw[0][tokens / 2],
           tc[1][tokens / 2] / tc[0][tokens / 2], same ? "same bits" : "DIFFERENT BITS");
    return 0;
}
