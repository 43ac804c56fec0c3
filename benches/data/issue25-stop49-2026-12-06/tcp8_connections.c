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
int main(int argc,char**argv){int conns=atoi(argv[1]),samples=atoi(argv[2]),k=atoi(argv[3]);
 int l=socket(AF_INET,SOCK_STREAM,0);struct sockaddr_in a={0};a.sin_family=AF_INET;a.sin_addr.s_addr=htonl(0x7f000001);
 bind(l,(void*)&a,sizeof a);listen(l,16);socklen_t al=sizeof a;getsockname(l,(void*)&a,&al);
 int one=1;pid_t c=fork();
 if(c==0){pin(1);for(int q=0;q<conns;q++){int s=socket(AF_INET,SOCK_STREAM,0);connect(s,(void*)&a,sizeof a);setsockopt(s,IPPROTO_TCP,TCP_NODELAY,&one,4);
   char b[8];long tot=(long)samples*k;for(long i=0;i<tot;i++){ wr(s,b);rd(s,b);} char x; recv(s,&x,1,0); close(s);} exit(0);}
 pin(0);double *t=malloc(sizeof(double)*samples);
 printf("pair:");
 for(int q=0;q<conns;q++){int s=accept(l,0,0);setsockopt(s,IPPROTO_TCP,TCP_NODELAY,&one,4);char b[8]={0};
 for(int j=0;j<samples;j++){double t0=now();for(int i=0;i<k;i++){wr(s,b);rd(s,b);}t[j]=(now()-t0)/k;}
 close(s);qsort(t,samples,sizeof(double),cmp);printf(" %.2f",t[samples/2]);}
 waitpid(c,0,0);printf("\n");return 0;}
