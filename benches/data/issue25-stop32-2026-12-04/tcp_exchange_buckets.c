#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
static double now(void){struct timespec ts;clock_gettime(CLOCK_MONOTONIC,&ts);return ts.tv_sec+ts.tv_nsec*1e-9;}
int main(int argc,char**argv){
  size_t n=65536+32; int iters=3000, bucket=100;
  int ls=socket(AF_INET,SOCK_STREAM,0); struct sockaddr_in a={0}; a.sin_family=AF_INET; a.sin_addr.s_addr=htonl(INADDR_LOOPBACK);
  bind(ls,(void*)&a,sizeof a); listen(ls,1); socklen_t al=sizeof a; getsockname(ls,(void*)&a,&al);
  pid_t c=fork(); int rank=c==0; int fd;
  cpu_set_t set; CPU_ZERO(&set); CPU_SET(rank,&set); sched_setaffinity(0,sizeof set,&set);
  if(rank){close(ls); fd=socket(AF_INET,SOCK_STREAM,0); connect(fd,(void*)&a,sizeof a);} else {fd=accept(ls,0,0); close(ls);}
  int one=1, b=8<<20; setsockopt(fd,IPPROTO_TCP,TCP_NODELAY,&one,4); setsockopt(fd,SOL_SOCKET,SO_SNDBUF,&b,4); setsockopt(fd,SOL_SOCKET,SO_RCVBUF,&b,4);
  fcntl(fd,F_SETFL,fcntl(fd,F_GETFL)|O_NONBLOCK);
  char*sb=malloc(n),*rb=malloc(n); memset(sb,1,n); memset(rb,0,n);
  double *t=calloc(iters,sizeof(double));
  for(int i=0;i<iters;i++){ double t0=now(); size_t s=0,g=0;
    while(s<n){ssize_t w=send(fd,sb+s,n-s,MSG_NOSIGNAL|MSG_DONTWAIT); if(w>0)s+=w;}
    while(g<n){ssize_t r=recv(fd,rb+g,n-g,MSG_DONTWAIT); if(r>0)g+=r; else if(r==0)exit(1);}
    t[i]=now()-t0; }
  if(rank==0){ for(int i=0;i<iters;i+=bucket){double m=0; for(int j=i;j<i+bucket;j++) m+=t[j]; printf("%.1f ",m/bucket*1e6);} printf("\n"); }
  else exit(0);
  wait(0); return 0; }
