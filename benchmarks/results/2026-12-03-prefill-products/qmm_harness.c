#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
int mtplx_qmm_int8(const float *x, int M, int K, const uint32_t *w, const void *scales,
                   const void *biases, int half, int N, int bits, int group, float *y);
void mtplx_qmm_set_threads(int);
static double now(){struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t); return t.tv_sec+t.tv_nsec*1e-9;}
static uint64_t s=88172645463325252ULL; static uint64_t rnd(){s^=s<<13;s^=s>>7;s^=s<<17;return s;}
static float rf(){return ((rnd()>>40)/(double)(1<<24))*2-1;}
int main(int argc,char**argv){
  int M=atoi(argv[1]); int reps=atoi(argv[2]); const char*out=argc>3?argv[3]:NULL;
  int shapes[4][2]={{960,576},{576,576},{3072,576},{576,1536}}; const char*nm[4]={"qkv","o","gate_up","down"};
  mtplx_qmm_set_threads(1); double tot=0; FILE*f=out?fopen(out,"wb"):NULL;
  for(int i=0;i<4;i++){int N=shapes[i][0],K=shapes[i][1],G=K/32;
    uint32_t*w=malloc((size_t)N*K/2); for(long j=0;j<(long)N*K/2/4;j++) w[j]=(uint32_t)rnd();
    uint16_t*sc=malloc(2*(size_t)N*G),*bi=malloc(2*(size_t)N*G);
    for(long j=0;j<(long)N*G;j++){ sc[j]=0x2000+(rnd()&0x3ff); bi[j]=0xa000+(rnd()&0x3ff);} /* small half values */
    float*x=malloc(4*(size_t)M*K),*y=malloc(4*(size_t)M*N); for(long j=0;j<(long)M*K;j++) x[j]=rf();
    double best=1e9; double ts[64];
    for(int r=0;r<reps;r++){double t=now(); mtplx_qmm_int8(x,M,K,w,sc,bi,1,N,4,32,y); ts[r]=now()-t;}
    /* median */ for(int a=0;a<reps;a++)for(int b=a+1;b<reps;b++) if(ts[b]<ts[a]){double c=ts[a];ts[a]=ts[b];ts[b]=c;}
    best=ts[0]; tot+=best;
    printf("%-8s %7.3f ms %6.1f GMAC/s\n",nm[i],best*1e3,(double)M*N*K/best/1e9);
    if(f) fwrite(y,4,(size_t)M*N,f);
    free(w);free(sc);free(bi);free(x);free(y);}
  printf("total %.3f ms\n",tot*1e3); if(f) fclose(f); return 0;}
