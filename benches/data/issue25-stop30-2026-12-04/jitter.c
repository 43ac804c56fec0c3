// jitter: spin on one core for S seconds, histogram of clock gaps (a core taken away)
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <sched.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
int main(int c,char**v){int cpu=atoi(v[1]);double secs=atof(v[2]);
 cpu_set_t s;CPU_ZERO(&s);CPU_SET(cpu,&s);sched_setaffinity(0,sizeof s,&s);
 double b[]={10,50,200,1000,5000,1e12};long h[6]={0};double tot[6]={0};
 double t0=now(),p=t0,end=t0+secs*1e6,mx=0;
 while(p<end){double q=now();double g=q-p;if(g>=10){int i=0;while(g>=b[i+1])i++;h[i]++;tot[i]+=g;if(g>mx)mx=g;}p=q;}
 printf("cpu%d %.0fs: ",cpu,secs);const char*n[]={"10-50us","50-200us","0.2-1ms","1-5ms",">5ms"};
 double lost=0;for(int i=0;i<5;i++){printf("%s:%ld ",n[i],h[i]);lost+=tot[i];}
 printf("| lost %.2f%% max %.0fus\n",lost/(secs*1e6)*100,mx);}
