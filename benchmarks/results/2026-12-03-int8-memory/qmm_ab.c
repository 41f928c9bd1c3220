/* A/B driver for mtplx_qmm_int8: dlopen two builds, time them interleaved. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <immintrin.h>
#include <sys/mman.h>
static void *walloc(long n){ void*p=aligned_alloc(2<<20,(n+(2<<20)-1)/(2<<20)*(2<<20)); if(getenv("HUGE")) madvise(p,(n+(2<<20)-1)/(2<<20)*(2<<20),MADV_HUGEPAGE); return p;}
typedef int (*qmm_fn)(const float *, int, int, const uint32_t *, const void *, const void *, int, int, int, int, float *);
typedef void (*thr_fn)(int);
static double now(clockid_t c){struct timespec t;clock_gettime(c,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
static double stream_read(const uint8_t *p, long n){ /* one thread's read bandwidth */
  __m512i acc=_mm512_setzero_si512(); double t=now(CLOCK_MONOTONIC);
  for(long i=0;i<n;i+=64) acc=_mm512_xor_si512(acc,_mm512_load_si512(p+i));
  double dt=now(CLOCK_MONOTONIC)-t; volatile long s=_mm512_reduce_add_epi64(acc); (void)s; return n/dt/1e9;}
int main(int argc,char**argv){
  const char*only=getenv("ONLY");
  if(argc<4){fprintf(stderr,"bench libA libB threads [copies] [reps]\n");return 1;}
  int nl=2; void*h[2]; qmm_fn f[2]; thr_fn st[2];
  for(int i=0;i<nl;i++){h[i]=dlopen(argv[1+i],RTLD_NOW|RTLD_LOCAL); if(!h[i]){fprintf(stderr,"%s\n",dlerror());return 1;}
    f[i]=(qmm_fn)dlsym(h[i],"mtplx_qmm_int8"); st[i]=(thr_fn)dlsym(h[i],"mtplx_qmm_set_threads");}
  int threads=atoi(argv[3]); int copies=argc>4?atoi(argv[4]):1; int reps=argc>5?atoi(argv[5]):60;
  for(int i=0;i<nl;i++) st[i](threads);
  struct {int N,K,bits,M;} shapes[]={{49152,576,8,1},{49152,576,8,2},{1536,576,4,1},{576,1536,4,1},{1536,576,4,2},{576,1536,4,2},{576,576,4,1},{192,576,4,1},{1024,576,8,1},{8192,576,8,1}};
  srand(1);
  for(unsigned s=0;s<sizeof shapes/sizeof*shapes;s++){
    if(only&&atoi(only)!=(int)s) continue;
    int N=shapes[s].N,K=shapes[s].K,bits=shapes[s].bits,M=shapes[s].M,G=K/32;
    /* enough copies that each call reads from memory (copies>1) */
    long wb=(long)N*K*bits/8; int C=copies;
    if(C>1){ long want=(long)C; C=(int)((96L<<20)/wb)+1; if(C<want)C=(int)want; }
    uint8_t **w=malloc(sizeof(void*)*C); uint16_t **sc=malloc(sizeof(void*)*C), **bi=malloc(sizeof(void*)*C);
    for(int c=0;c<C;c++){w[c]=walloc(wb); for(long i=0;i<wb;i++) w[c][i]=rand();
      sc[c]=walloc((long)N*G*2); bi[c]=walloc((long)N*G*2);
      for(long i=0;i<(long)N*G;i++){ _Float16 a=(_Float16)((rand()%1000)*1e-5f), b=(_Float16)(-(rand()%1000)*1e-4f); memcpy(&sc[c][i],&a,2); memcpy(&bi[c][i],&b,2);} }
    float *x=malloc(sizeof(float)*M*K); for(int i=0;i<M*K;i++) x[i]=(rand()%2001-1000)*1e-3f;
    float *y[2]; for(int i=0;i<nl;i++) y[i]=malloc(sizeof(float)*M*N);
    double *tw[2],*tc[2]; for(int i=0;i<nl;i++){tw[i]=malloc(sizeof(double)*reps);tc[i]=malloc(sizeof(double)*reps);}
    int rot=0;
    for(int r=-3;r<reps;r++) for(int ii=0;ii<nl;ii++){ int i=(r&1)?1-ii:ii; int c=(rot++)%C;
      double a=now(CLOCK_MONOTONIC), b=now(CLOCK_PROCESS_CPUTIME_ID);
      f[i](x,M,K,(const uint32_t*)w[c],sc[c],bi[c],1,N,bits,32,y[i]);
      double a2=now(CLOCK_MONOTONIC), b2=now(CLOCK_PROCESS_CPUTIME_ID);
      if(r>=0){tw[i][r]=(a2-a)*1e3; tc[i][r]=(b2-b)*1e3;} }
    for(int i=0;i<nl;i++) f[i](x,M,K,(const uint32_t*)w[0],sc[0],bi[0],1,N,bits,32,y[i]);
    int same=memcmp(y[0],y[1],sizeof(float)*M*N)==0;
    double mb=(wb+(long)N*G*4)/1e6;
    printf("N=%5d K=%4d b%d M=%d C=%d:",N,K,bits,M,C);
    for(int i=0;i<nl;i++){qsort(tw[i],reps,sizeof(double),cmp);qsort(tc[i],reps,sizeof(double),cmp);
      printf("  %c wall %.3f ms (%.1f GB/s) cpu %.3f", 'A'+i, tw[i][reps/2], mb/tw[i][reps/2], tc[i][reps/2]);}
    printf("  B/A %.3f  %s\n", tw[1][reps/2]/tw[0][reps/2], same?"same bits":"DIFFERENT BITS");
    for(int c=0;c<C;c++){free(w[c]);free(sc[c]);free(bi[c]);} free(w);free(sc);free(bi);free(x);
  }
  long n=256L<<20; uint8_t *buf=aligned_alloc(64,n); memset(buf,1,n); stream_read(buf,n);
  printf("one thread streams %.1f GB/s (256 MB); ", stream_read(buf,n));
  printf("32 MB hot %.1f GB/s\n", (stream_read(buf,32<<20),stream_read(buf,32<<20)));
  return 0;
}
