#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
typedef int (*fn_t)(const float *, int, int, const uint32_t *, const void *, const void *, int, int, int, int, float *);
#define V(n) int n(const float *, int, int, const uint32_t *, const void *, const void *, int, int, int, int, float *);
V(v0) V(v1) V(v2) V(v3)
static fn_t fns[4]={v0,v1,v2,v3};
static double now(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){
  int shapes[5][4]={{960,576,4,32},{576,576,4,32},{3072,576,4,32},{576,1536,4,32},{49152,576,8,32}};
  const char*names[5]={"qkv","o","gate_up","down","lm_head"};
  int M=atoi(argv[1]), nv=atoi(argv[2]), R=31;
  int s0=argc>3?atoi(argv[3]):0; for(int s=s0;s<5;s++){
    int N=shapes[s][0],K=shapes[s][1],bits=shapes[s][2],g=shapes[s][3];
    size_t wb=(size_t)N*K*bits/8; uint32_t*w=malloc(wb); for(size_t i=0;i<wb/4;i++)w[i]=rand()*2654435761u;
    int G=K/g; float*sc=malloc(4*(size_t)N*G),*bi=malloc(4*(size_t)N*G);
    for(size_t i=0;i<(size_t)N*G;i++){sc[i]=(rand()%1000+1)*1e-4f;bi[i]=(rand()%1000-500)*1e-4f;}
    float*x=malloc(4*(size_t)6*K),*y=malloc(4*(size_t)6*N),*y0=malloc(4*(size_t)6*N);
    for(int i=0;i<6*K;i++)x[i]=(rand()%2001-1000)*1e-3f;
    int reps=bits==8?30:100; double t[4][2][R];
    int same=1;
    for(int r=0;r<R;r++) for(int j=0;j<nv;j++){int v=(j+r)%nv;
      for(int mm=0;mm<2;mm++){int m=((r+mm)%2)?1:M;
      double a=now(); for(int i=0;i<reps;i++) fns[v](x,m,K,w,sc,bi,0,N,bits,g,y); t[v][m==1?0:1][r]=(now()-a)/reps;
      if(m==M){ if(v==0&&r==0) memcpy(y0,y,4*(size_t)M*N); else same&=!memcmp(y0,y,4*(size_t)M*N);} }}
    printf("%-8s",names[s]);
    for(int v=0;v<nv;v++){qsort(t[v][0],R,sizeof(double),cmp);qsort(t[v][1],R,sizeof(double),cmp);
      printf(" | v%d M1 %7.1f M%d %7.1f (%.3f)",v,t[v][0][R/2],M,t[v][1][R/2],t[v][1][R/2]/t[v][0][R/2]);}
    printf(" same=%d\n",same); free(w);free(sc);free(bi);free(x);free(y);free(y0);
  }
}
