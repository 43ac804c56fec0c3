#define _GNU_SOURCE
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <sys/wait.h>
#include <signal.h>
#include <sched.h>
static long mb(int c){return syscall(SYS_membarrier,c,0,0);}
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e9+t.tv_nsec;}
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);sched_setaffinity(0,sizeof s,&s);}
/* victim on CPU 1 does fixed work chunks; issuer on CPU 0 issues a membarrier every `gap` us (or not) */
int main(int argc,char**argv){
  int gap=atoi(argv[1]); int issue=atoi(argv[2]);
  mb(MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED);
  pid_t p=fork();
  if(!p){ pin(0); long k=0; double t=now(); for(;;){ if(issue) mb(MEMBARRIER_CMD_GLOBAL_EXPEDITED); k++; double e=now()+gap*1000.0; while(now()<e); } }
  pin(1);
  volatile unsigned long x=0; double best=1e18, sum=0; int reps=200;
  for(int r=0;r<reps;r++){ double t0=now(); for(long i=0;i<2000000;i++) x+=i; double d=now()-t0; sum+=d; if(d<best)best=d; }
  printf("gap %d us issue %d: victim chunk mean %.1f us (best %.1f)\n",gap,issue,sum/reps/1e3,best/1e3);
  kill(p,SIGKILL); waitpid(p,0,0); return 0; }
