import time
from bench.peers import payload, llama_layout, KVCache, HEAD_DIM, KV_HEADS
from kdn.client.shm import SharedSegment
from kdn.client.staged import Staged
import torch
kv=payload(16<<20, seed=1)
_, layers, tokens, _ = kv.shape
lay=llama_layout(layers)
def hm(t): return t.view(tokens, KV_HEADS, HEAD_DIM).transpose(0,1).contiguous()
c_kv=KVCache(lay,[(hm(kv[0,l]),hm(kv[1,l])) for l in range(layers)])
seg=SharedSegment(1<<30)
print(torch.get_num_threads())
for i in range(3):
    t=time.perf_counter(); st=Staged(lay,c_kv.num_tokens,0,seg,own_memory=False); t1=time.perf_counter()
    for (k,v),(a,b) in zip(st.layers,c_kv.layers): k.copy_(a); v.copy_(b)
    t2=time.perf_counter()
    print("make %.1f ms copy %.1f ms"%((t1-t)*1e3,(t2-t1)*1e3), st.layers[0][0].stride(), st.layers[0][0].is_contiguous(), c_kv.layers[0][0].stride())
    st.close()
import numpy as np
st=Staged(lay,c_kv.num_tokens,0,seg,own_memory=False)
t=time.perf_counter()
for (k,v),(a,b) in zip(st.layers,c_kv.layers): np.copyto(k.numpy(), a.numpy()); np.copyto(v.numpy(), b.numpy())
print("numpy copy %.1f ms"%((time.perf_counter()-t)*1e3))
torch.set_num_threads(1)
t=time.perf_counter()
for (k,v),(a,b) in zip(st.layers,c_kv.layers): k.copy_(a); v.copy_(b)
print("torch 1 thread copy %.1f ms"%((time.perf_counter()-t)*1e3))
print(st.layers[0][0].dtype, c_kv.layers[0][0].dtype)
