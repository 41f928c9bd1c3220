/* prod_ab N K BITS ROWS REPS INNER A.so B.so [C.so ...]: one product of mtplx_qmm_int8
 * (group 32, float16 scales and biases, random weights), weights hot (the same product
 * repeated), one thread; the builds take turns in one process (order rotating each round);
 * medians over REPS rounds of calling-thread CPU us per call (INNER calls a round).
 * maxreldiff: largest |B - A| / (|A| + 1e-3) over the outputs, each build against the first. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
typedef int (*qmm_fn)(const float *, int, int, const uint32_t *, const void *, const void *, int, int, int, int, float *);
static double now(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static int cmp(const void*a,const void*b){double x=*(const double*)a,y=*(const double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){
  int N=atoi(argv[1]),K=atoi(argv[2]),bits=atoi(argv[3]),M=atoi(argv[4]),reps=atoi(argv[5]),inner=atoi(argv[6]);
  int nb=argc-7; qmm_fn f[8];
  for(int i=0;i<nb;i++){void*h=dlopen(argv[7+i],RTLD_NOW|RTLD_LOCAL);if(!h){fprintf(stderr,"%s\n",dlerror());return 1;}f[i]=(qmm_fn)dlsym(h,"mtplx_qmm_int8");((void(*)(int))dlsym(h,"mtplx_qmm_set_threads"))(1);}
  long wb=(long)N*K*bits/8,G=K/32;
  srand(1);
  uint8_t*w=aligned_alloc(64,(wb+63)/64*64);for(long i=0;i<wb;i++)w[i]=rand();
  uint16_t*s=malloc(N*G*2),*b=malloc(N*G*2);
  for(long i=0;i<N*G;i++){_Float16 a=(_Float16)((rand()%1000)*1e-5f),c=(_Float16)(-(rand()%1000)*1e-4f);memcpy(&s[i],&a,2);memcpy(&b[i],&c,2);}
  float*x=malloc(sizeof(float)*M*K);for(long i=0;i<(long)M*K;i++)x[i]=(rand()%2001-1000)*1e-3f;
  float*y[8]; double*t[8];
  for(int i=0;i<nb;i++){y[i]=malloc(4L*M*N);t[i]=malloc(8*reps);f[i](x,M,K,(uint32_t*)w,s,b,1,N,bits,32,y[i]);}
  for(int r=0;r<reps;r++) for(int k=0;k<nb;k++){int i=(k+r)%nb; double t0=now(); for(int j=0;j<inner;j++) f[i](x,M,K,(uint32_t*)w,s,b,1,N,bits,32,y[i]); t[i][r]=(now()-t0)/inner*1e6;}
  printf("N %5d K %4d bits %d rows %3d:",N,K,bits,M);
  qsort(t[0],reps,8,cmp);
  for(int i=0;i<nb;i++){ if(i) qsort(t[i],reps,8,cmp);
    double maxd=0; for(long e=0;e<(long)M*N;e++){double d=y[i][e]-y[0][e]; if(d<0)d=-d; double a=y[0][e]<0?-y[0][e]:y[0][e]; if(d/(a+1e-3)>maxd)maxd=d/(a+1e-3);}
    printf("  %s %.1f us", strrchr(argv[7+i],'/')?strrchr(argv[7+i],'/')+1:argv[7+i], t[i][reps/2]);
    if(i) printf(" (%.3f, diff %.1e)", t[i][reps/2]/t[0][reps/2], maxd);
  }
  printf("\n");
}
