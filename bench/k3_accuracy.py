"""Where the torch backend's float32 ``linear_policy_loss`` loses accuracy with the k3 KL, on this device.

``python -m bench.k3_accuracy [--device cuda]``

The CUDA test ``tests/test_fused_policy.py::test_linear_policy_loss_matches_float64_truth[temperature=0.7,
kl_coef=0.05,kl_estimator=k3-seq-mean-token-sum-norm-torch-cuda]`` failed on three H200 leases (2026-11-27:
``d_hidden`` relative error 2.03e-6 against eager's 4.5e-7) while the same path on the CPU errs 3.9e-7 (eager
there: 2.0e-6). The k3 estimator's gradient multiplies the error of ``log p`` by ``exp(ref - log p)``, so this
prints, for that test's inputs and a few neighbours (k3 off, temperature 1, the Triton row where it runs), each
provider's error against the float64 truth: the per-token log-probs (absolute, and weighted by the k3 factor
``exp(ref - log p)`` at the masked-in tokens) and each gradient (relative, as the test measures it). A log-prob
error that eager does not have points at the statistics; equal log-probs with a worse ``d_hidden`` point at dz
or the GEMMs. No bound: this is an accuracy probe, nothing is timed.
"""
from __future__ import annotations

import argparse
import zlib

import torch


def _errors(x, options, dtype, backend):
    from tests.helpers import rel_error
    from tests.test_fused_policy import _fused, _truth

    _, _, t_grads, t_logp = _truth(x, options, 1.7, lambda t: t.double())
    mask = x["mask"] & (x["labels"] != -100)  # [B, T]
    k3_weight = torch.exp(x["ref_logp"].double() - t_logp.double())  # [B, T]: the k3 gradient's factor on log p
    if backend == "eager":
        _, _, grads, logp = _truth(x, options, 1.7, lambda t: t.to(dtype))
    else:
        _, metrics, grads = _fused(x, options, 1.7, dtype, backend)
        logp = metrics["token_logp"]
    err = (logp.double() - t_logp.double()).abs()  # [B, T]
    return dict(logp_abs_max=err[mask].max().item(), logp_k3_weighted_max=(err * k3_weight)[mask].max().item(),
                **{f"d_{name}": rel_error(g, t) for name, g, t in zip(("hidden", "weight", "bias"), grads, t_grads)})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.k3_accuracy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    from tests.test_fused_policy import _inputs

    agg = "seq-mean-token-sum-norm"
    failing = dict(temperature=0.7, kl_coef=0.05, kl_estimator="k3")
    x = _inputs(4, 9, 24, 1000, seed=zlib.crc32(f"{agg}{failing}".encode()) % 1000, device=args.device)
    variants = {"the failing case": failing, "k3 off": dict(temperature=0.7),
                "temperature 1": dict(kl_coef=0.05, kl_estimator="k3")}
    backends = ["eager", "torch", "reference"] + (["triton"] if args.device == "cuda" else [])
    print(f"device {args.device}, torch {torch.__version__}; B=4 T=9 H=24 V=1000 float32, agg={agg}, upstream 1.7")
    print(f"{'variant':18} {'provider':10} {'logp abs max':>13} {'x k3 factor':>12} {'d_hidden':>10} "
          f"{'d_weight':>10} {'d_bias':>10}")
    for name, options in variants.items():
        for backend in backends:
            e = _errors(x, dict(options, agg=agg), torch.float32, backend)
            print(f"{name:18} {backend:10} {e['logp_abs_max']:13.3e} {e['logp_k3_weighted_max']:12.3e} "
                  f"{e['d_hidden']:10.3e} {e['d_weight']:10.3e} {e['d_bias']:10.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
