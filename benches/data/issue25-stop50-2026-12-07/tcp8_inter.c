#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <sched.h>
#include <time.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <sys/socket.h>
#include <sys/wait.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);sched_setaffinity(0,sizeof s,&s);}
static void rd(int fd,char*b){int got=0;while(got<8){ssize_t n=recv(fd,b+got,8-got,MSG_DONTWAIT);
  if(n>0)got+=n; else if(n==0){exit(3);} else if(errno!=EAGAIN&&errno!=EINTR){perror("recv");exit(2);} }}
static void wr(int fd,char*b){int s=0;while(s<8){ssize_t n=send(fd,b+s,8-s,MSG_NOSIGNAL);if(n>0)s+=n;else if(errno!=EAGAIN&&errno!=EINTR){perror("send");exit(2);}}}
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
/* conns rounds k: open conns at once; for each round, each connection in turn does k exchanges timed; print per-connection medians over rounds, and per-round rows */
int main(int argc,char**argv){int conns=atoi(argv[1]),rounds=atoi(argv[2]),k=atoi(argv[3]);
 int l=socket(AF_INET,SOCK_STREAM,0);struct sockaddr_in a={0};a.sin_family=AF_INET;a.sin_addr.s_addr=htonl(0x7f000001);
 bind(l,(void*)&a,sizeof a);listen(l,64);socklen_t al=sizeof a;getsockname(l,(void*)&a,&al);
 int one=1;pid_t c=fork();
 if(c==0){pin(1);int s[64];for(int q=0;q<conns;q++){s[q]=socket(AF_INET,SOCK_STREAM,0);connect(s[q],(void*)&a,sizeof a);setsockopt(s[q],IPPROTO_TCP,TCP_NODELAY,&one,4);}
   char b[8];for(int r=0;r<rounds;r++)for(int q=0;q<conns;q++)for(long i=0;i<k;i++){wr(s[q],b);rd(s[q],b);} exit(0);}
 pin(0);int s[64];for(int q=0;q<conns;q++){s[q]=accept(l,0,0);setsockopt(s[q],IPPROTO_TCP,TCP_NODELAY,&one,4);}
 double *t=malloc(sizeof(double)*rounds*conns);char b[8]={0};
 for(int r=0;r<rounds;r++)for(int q=0;q<conns;q++){double t0=now();for(int i=0;i<k;i++){wr(s[q],b);rd(s[q],b);}t[q*rounds+r]=(now()-t0)/k;}
 for(int q=0;q<conns;q++){qsort(t+q*rounds,rounds,sizeof(double),cmp);printf(" %.2f",t[q*rounds+rounds/2]);}
 waitpid(c,0,0);printf("\n");return 0;}
