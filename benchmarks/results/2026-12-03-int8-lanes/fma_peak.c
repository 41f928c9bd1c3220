#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#define F(x) x = _mm512_fmadd_ps(x, m, c)
int main(void) {
    __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
    __m512 a0 = _mm512_set1_ps(0), a1 = _mm512_set1_ps(1), a2 = _mm512_set1_ps(2), a3 = _mm512_set1_ps(3), a4 = _mm512_set1_ps(4), a5 = _mm512_set1_ps(5), a6 = _mm512_set1_ps(6), a7 = _mm512_set1_ps(7), a8 = _mm512_set1_ps(8), a9 = _mm512_set1_ps(9);
    const long iters = 300000000L;
    struct timespec t0, t1; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
    for (long n = 0; n < iters; n++) {
        F(a0); F(a1); F(a2); F(a3); F(a4); F(a5); F(a6); F(a7); F(a8); F(a9);
        __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9));
    }
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
    double s = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
    __m512 t = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)), _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(_mm512_add_ps(a6, a7), _mm512_add_ps(a8, a9))));
    printf("zmm FMA: %.1f GFLOP/s (%.3f s, %.2f zmm FMA/ns) [%g]\n", iters * 10.0 * 32 / s / 1e9, s, iters * 10.0 / s / 1e9, _mm512_reduce_add_ps(t));
    return 0;
}
