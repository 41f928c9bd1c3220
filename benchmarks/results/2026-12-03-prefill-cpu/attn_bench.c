/* The attention kernel alone, one thread, before (old.c: a copy of an earlier attn_kernel.c,
 * its symbols renamed) against after (the tree's mtplx/attn_kernel.c), on the same inputs:
 * milliseconds of thread CPU (best of the repeats) and whether any output bit differs.
 * A prompt chunk: n queries (9 heads, 3 kv heads, d 64, values of 65 floats as the store
 * holds them) of one slot at counts first .. first + n - 1.
 * Build and run: see README.md. Usage: attn_bench N FIRST REPEATS. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#include <math.h>
int mtplx_qmm_threads(void) { return 1; }
int old_attend(const float *q, const float *keys, const float *values, const int32_t *slot,
                 const int32_t *count, int n, int heads, int kv, int d, int slots, int cap,
                 int dv, float scale, float *out);
int mtplx_attend(const float *q, const float *keys, const float *values, const int32_t *slot,
                 const int32_t *count, int n, int heads, int kv, int d, int slots, int cap,
                 int dv, float scale, float *out);
void mtplx_attn_set_threads(int);
void old_set_threads(int);
static double now(void){struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t); return t.tv_sec+1e-9*t.tv_nsec;}
static uint64_t s=88172645463325252ull; static float rnd(void){s^=s<<13;s^=s>>7;s^=s<<17; return ((s>>40)/(double)(1<<24))*2-1;}
int main(int argc,char**argv){
  int n=argc>1?atoi(argv[1]):384, first=argc>2?atoi(argv[2]):1025, reps=argc>3?atoi(argv[3]):5;
  int heads=9,kv=3,d=64,dv=65,cap=2048,S=2;
  float*K=malloc(sizeof(float)*S*kv*cap*d),*V=malloc(sizeof(float)*S*kv*cap*dv),*q=malloc(sizeof(float)*n*heads*d);
  for(long i=0;i<(long)S*kv*cap*d;i++)K[i]=rnd()*2; for(long i=0;i<(long)S*kv*cap*dv;i++)V[i]=rnd();
  for(long i=0;i<(long)n*heads*d;i++)q[i]=rnd()*2;
  int32_t*sl=malloc(4*(size_t)n),*ct=malloc(4*(size_t)n); for(int i=0;i<n;i++){sl[i]=1;ct[i]=first+i;}
  float*a=malloc(4L*n*heads*d),*b=malloc(4L*n*heads*d);
  mtplx_attn_set_threads(1); old_set_threads(1);
  double to=1e9,tn=1e9;
  for(int r=0;r<reps;r++){double t=now(); old_attend(q,K,V,sl,ct,n,heads,kv,d,S,cap,dv,0.125f,a); t=now()-t; if(t<to)to=t;
    t=now(); mtplx_attend(q,K,V,sl,ct,n,heads,kv,d,S,cap,dv,0.125f,b); t=now()-t; if(t<tn)tn=t;}
  long bad=0; for(long i=0;i<(long)n*heads*d;i++) if(memcmp(a+i,b+i,4)) bad++;
  double scores=0; for(int i=0;i<n;i++) scores+=ct[i]*(double)heads;
  printf("old %.2f ms (%.2f ns/score)  new %.2f ms (%.2f ns/score)  differing %ld\n",to*1e3,to*1e9/scores,tn*1e3,tn*1e9/scores,bad);
}
