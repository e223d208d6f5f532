import time, sys
from bench.peers import payload, llama_layout, KVCache, HEAD_DIM, KV_HEADS
from bench.common import kdn_server
from kdn.client import Client
from kdn import codec, keys
import tempfile, pathlib
from pathlib import Path
kv=payload(16<<20, seed=1)
_, layers, tokens, _ = kv.shape
lay=llama_layout(layers)
def hm(t): return t.view(tokens, KV_HEADS, HEAD_DIM).transpose(0,1).contiguous()
c_kv=KVCache(lay,[(hm(kv[0,l]),hm(kv[1,l])) for l in range(layers)])
with tempfile.TemporaryDirectory() as d, kdn_server(Path(d)/"k", "--ram-bytes","2GiB","--max-message-bytes",str(256<<20),"--max-entry-bytes",str(1<<30)) as addr:
    c=Client(addr, max_message_bytes=256<<20)
    w=c._writes
    for i in range(4):
        t=time.perf_counter(); st=w._written_staged(c_kv,"raw","",0); t1=time.perf_counter()
        r=w._store_staged("default",[(keys.chunk_key([i],lay),st)],None,None); t2=time.perf_counter(); st.close()
        print("staged make+copy %.1f ms store %.1f ms"%((t1-t)*1e3,(t2-t1)*1e3))
        t=time.perf_counter(); c.store(keys.chunk_key([100+i],lay), c_kv, mode="raw"); print("store(kv) %.1f ms"%((time.perf_counter()-t)*1e3))
    c.close()
