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
int main(int argc,char**argv){int rounds=atoi(argv[1]),k=atoi(argv[2]);int c0=argc>3?atoi(argv[3]):0,c1=argc>4?atoi(argv[4]):1;
 int l=socket(AF_INET,SOCK_STREAM,0);struct sockaddr_in a={0};a.sin_family=AF_INET;a.sin_addr.s_addr=htonl(0x7f000001);
 bind(l,(void*)&a,sizeof a);listen(l,64);socklen_t al=sizeof a;getsockname(l,(void*)&a,&al);
 int one=1;pid_t c=fork();
 if(c==0){pin(c1);int s=socket(AF_INET,SOCK_STREAM,0);connect(s,(void*)&a,sizeof a);setsockopt(s,IPPROTO_TCP,TCP_NODELAY,&one,4);
   char b[8];for(long i=0;i<(long)rounds*k;i++){wr(s,b);rd(s,b);} exit(0);}
 pin(c0);int s=accept(l,0,0);setsockopt(s,IPPROTO_TCP,TCP_NODELAY,&one,4);char b[8]={0};
 double T0=now();
 for(int r=0;r<rounds;r++){double t0=now();for(int i=0;i<k;i++){wr(s,b);rd(s,b);}printf("%.0f %.2f\n",(t0-T0)/1000,(now()-t0)/k);}
 waitpid(c,0,0);return 0;}
