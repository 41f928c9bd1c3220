#include <stdio.h>
#include <time.h>
int main(){struct timespec a,b; clock_gettime(CLOCK_MONOTONIC,&a); for(int i=0;i<4000000;i++) __builtin_ia32_pause(); clock_gettime(CLOCK_MONOTONIC,&b);
printf("pause: %.1f ns each; 4000 pauses = %.1f us\n", ((b.tv_sec-a.tv_sec)*1e9+(b.tv_nsec-a.tv_nsec))/4e6, ((b.tv_sec-a.tv_sec)*1e9+(b.tv_nsec-a.tv_nsec))/1e3);}
