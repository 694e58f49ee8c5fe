import struct, sys, numpy as np
DT={0:np.float32,1:np.int8,2:np.int16,3:np.int32,4:np.float16}
def read(path):
    f=open(path,'rb'); r=lambda fmt: struct.unpack(fmt,f.read(struct.calcsize(fmt)))[0]
    def s():
        n=r('H'); return f.read(n)[:-1].decode()
    ver=r('I'); name=s(); rev=r('I'); n=r('I'); out={}
    for _ in range(n):
        k=s(); nd=r('B'); shape=[r('I') for _ in range(nd)]; dt=r('B'); nb=r('I'); b=f.read(nb)
        if dt==5: # bfloat16
            a=(np.frombuffer(b,np.uint16).astype(np.uint32)<<16).view(np.float32)
        else: a=np.frombuffer(b,DT[dt])
        out[k]=(a.reshape(shape) if shape else a, dt)
    na=r('I'); aliases={s():s() for _ in range(na)}
    return ver,name,rev,out,aliases
if __name__=='__main__':
    ver,name,rev,out,al=read(sys.argv[1]); print(ver,name,rev,len(out),al)
    from collections import Counter; print(Counter(d for _,d in out.values()))
    for k,(a,d) in list(out.items())[:40]: print(k,a.shape,d)
