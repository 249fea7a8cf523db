"""Does an encoder's CUDA-graph memory go when the encoder goes? (diagnostic, GPU machine)"""

import gc
import sys
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gpusparse.encode import SpladeEncoder

model = str(Path(__file__).resolve().parents[1] / "shared" / "models" / "splade-tiny")
texts = ["the wing of an aircraft in supersonic flow " * (i % 7 + 1) for i in range(300)]
print("start", torch.cuda.memory_allocated())
enc = SpladeEncoder(model, device="cuda", doc_max_length=64)
enc.encode_documents(texts)
print("after encode", torch.cuda.memory_allocated(), enc.cuda_graph_stats)
refs = {"encoder": weakref.ref(enc), "bucketed": weakref.ref(enc._graphs), "model": weakref.ref(enc.model)}
del enc
gc.collect()
torch.cuda.empty_cache()
print("after del+gc", torch.cuda.memory_allocated(), {k: r() is not None for k, r in refs.items()})
for name, r in refs.items():
    obj = r()
    if obj is None:
        continue
    for ref in gc.get_referrers(obj):
        if ref is refs:
            continue
        print(name, "held by", type(ref), repr(ref)[:200])
        for ref2 in gc.get_referrers(ref)[:5]:
            print("   held by", type(ref2), repr(ref2)[:200])
