#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <sys/mount.h>
#include <sys/syscall.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){
  int n=argc>1?atoi(argv[1]):50;
  /* syscall cost */
  double t0=now(); for(int i=0;i<10000;i++) prctl(PR_CAPBSET_READ,5); double t1=now();
  printf("prctl(PR_CAPBSET_READ): %.3f us each\n",(t1-t0)/10000);
  t0=now(); for(int i=0;i<10000;i++) syscall(SYS_getppid); t1=now();
  printf("getppid: %.3f us each\n",(t1-t0)/10000);
  struct {const char*name;int flags;} k[]={{"none",0},{"mount",CLONE_NEWNS},{"ipc",CLONE_NEWIPC},{"uts",CLONE_NEWUTS},{"net",CLONE_NEWNET},{"pid",CLONE_NEWPID},{"all",CLONE_NEWNS|CLONE_NEWIPC|CLONE_NEWUTS|CLONE_NEWNET|CLONE_NEWPID}};
  for(unsigned j=0;j<sizeof k/sizeof*k;j++){
    double v[1000]; 
    for(int i=0;i<n;i++){
      int p[2]; pipe(p);
      pid_t c=fork();
      if(c==0){ double a=now(); int r=unshare(k[j].flags); double b=now(); double d=r?-1:b-a; write(p[1],&d,sizeof d); _exit(0);}
      double d; read(p[0],&d,sizeof d); waitpid(c,0,0); close(p[0]);close(p[1]); v[i]=d;
      usleep(2000);
    }
    qsort(v,n,sizeof*v,cmp);
    printf("unshare(%s): median %.1f us min %.1f max %.1f\n",k[j].name,v[n/2],v[0],v[n-1]);
  }
  /* umount detach of old root after pivot in a new mount ns */
  {
    double v[1000];
    for(int i=0;i<n;i++){
      int p[2]; pipe(p);
      pid_t c=fork();
      if(c==0){ unshare(CLONE_NEWNS); mount(0,"/",0,MS_REC|MS_PRIVATE,0);
        double a=now(); mount("x","/tmp","tmpfs",0,"size=16k"); double b=now();
        chdir("/tmp"); syscall(SYS_pivot_root,".","."); double c2=now(); umount2(".",MNT_DETACH); double d=now();
        double r[3]={b-a,c2-b,d-c2}; write(p[1],r,sizeof r); _exit(0);}
      double r[3]; read(p[0],r,sizeof r); waitpid(c,0,0); close(p[0]);close(p[1]); v[i]=r[2];
      if(i==0) printf("first: tmpfs mount %.1f pivot %.1f detach %.1f\n",r[0],r[1],r[2]);
      usleep(2000);
    }
    qsort(v,n,sizeof*v,cmp);
    printf("umount2(old root, MNT_DETACH): median %.1f us min %.1f max %.1f\n",v[n/2],v[0],v[n-1]);
  }
  return 0;
}
