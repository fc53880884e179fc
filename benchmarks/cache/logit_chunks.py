"""Thread-independent logits (LogitChunks pads a chunk of 5-7 or 9-11 rows to 16): its cost on the
lm_head path at width 5120 and a 32,768-row vocabulary, against the unpadded chunks, side by side
(5 rounds, alternating which side goes first; medians).

    python benchmarks/cache/logit_chunks.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import time  # noqa: E402
import torch  # noqa: E402
from pipeline.target_model.capture import LogitChunks  # noqa: E402
torch.manual_seed(0)
head = torch.nn.Linear(5120, 32768, bias=False).requires_grad_(False)
def old(h, rows=256, buf=[None]):
    if buf[0] is None: buf[0] = torch.empty(rows, head.weight.shape[0])
    for a in range(0, h.shape[0], rows):
        x = h[a:a+rows]
        yield a, torch.matmul(x.float(), head.weight.T, out=buf[0][:x.shape[0]])
new = LogitChunks(head)
res = {"old": [], "new": []}
with torch.no_grad():
    for T in (261, 1033):
        h = torch.randn(T, 5120)
        for r in range(5):
            for name, f in (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old)):
                t = time.perf_counter()
                for _, c in f(h): c.max()
                res[name].append((T, time.perf_counter() - t))
for T in (261, 1033):
    o = sorted(t for n, t in res["old"] if n == T); n = sorted(t for m, t in res["new"] if m == T)
    print(f"T={T}: old median {o[2]*1e3:.1f} ms, new median {n[2]*1e3:.1f} ms, new/old {n[2]/o[2]:.3f}")
