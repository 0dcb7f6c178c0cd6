"""A functional check of benchmarks/xdit_flux.py on CPU (gloo ranks, float32, the tiny FLUX preset), for machines
without a GPU. Not a benchmark: it checks that every implementation's harness runs and computes the same thing.

xfuser and yunchang are GPU-only in places, so each rank process patches them first (`patch`, below):
- xfuser decides at import that there is no accelerator; we claim a CUDA version, make its set_device a
  no-op and give it yunchang's process groups (which it only wires up when torch.cuda.is_available());
- neither has a CPU attention kernel that returns a log-sum-exp (ring attention needs it): xfuser's
  SDPA_EFFICIENT backend and yunchang's torch_flash/torch_efficient kernels are replaced by the same
  computation done explicitly in float32. yunchang's torch_cudnn/torch_math kernels keep their real
  behaviour (a log-sum-exp of zeros), so a ring with them shows a large error, as on GPU.

    PYTHONPATH=$PWD:SITE python benchmarks/xdit_cpu_check.py

SITE: where xfuser, yunchang, distvae, einops and triton are (`pip install --no-deps --target SITE xfuser==0.7.0
yunchang==0.6.4 distvae==0.1.0 einops triton`; xfuser imports triton, which a CPU torch does not bring).

It runs both implementations eagerly (`--mode eager`), which takes about a minute. The compiled mode compiles
xDiT's whole forward once per length and configuration, 30-55 s each on 2 cores; it was checked by hand
(2026-11-23: 1 and 2 ranks, ring2 and ulysses2, 2 lengths, 5 minutes, every output within 1e-5 of ours):

    PYTHONPATH=$PWD:SITE python benchmarks/xdit_flux.py --device cpu --preset tiny --gpus 1,2 --height 128 \\
        --width 128 --configs ring2,ulysses2 --methods allgather_kv --xdit-attention-backend SDPA_EFFICIENT \\
        --setup benchmarks.xdit_cpu_check:patch

Exits non-zero if a row is missing, an implementation failed, or an output differs from the reference.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def _math_attention(q, k, v):
    """[B, H, S, D] attention and its log-sum-exp [B, H, S], in float32."""
    import torch

    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = scores.logsumexp(dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()).to(q.dtype), lse


def patch() -> None:
    """Make xfuser and yunchang run on CPU ranks (see the module docstring)."""
    import torch

    torch.version.cuda = torch.version.cuda or "13.0"  # xfuser's envs raise at import without an accelerator

    import yunchang.globals
    import yunchang.kernels

    try:
        import xfuser.envs
    except ImportError:  # no xfuser: its rows are recorded as failed, the others still run
        xfuser = None
    if xfuser is not None:
        from xfuser.core.distributed import parallel_state
        from xfuser.core.distributed.attention_backend import ATTENTION_FUNCTION_REGISTRY, AttentionBackendType
        from xfuser.model_executor.layers import usp

        parallel_state.set_device = lambda *args, **kwargs: None
        xfuser.envs.PACKAGES_CHECKER.packages_info["has_long_ctx_attn"] = True
        for name, module in list(sys.modules.items()):  # the modules that copied the answer at import
            if name.startswith("xfuser") and hasattr(module, "HAS_LONG_CTX_ATTN"):
                module.HAS_LONG_CTX_ATTN = True
        usp.PROCESS_GROUP = yunchang.globals.PROCESS_GROUP

        def xfuser_attention(query, key, value, dropout_p, is_causal, attention_kwargs=None):
            return _math_attention(query, key, value)

        ATTENTION_FUNCTION_REGISTRY[AttentionBackendType.SDPA_EFFICIENT] = xfuser_attention

    def yunchang_attention(q, k, v, dropout_p=0.0, softmax_scale=None, causal=True, window_size=(-1, -1),
                           softcap=None, alibi_slopes=None, return_softmax=False, op_type="flash"):
        out, lse = _math_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        if op_type in ("cudnn", "math"):  # what yunchang 0.6 returns for these kernels
            lse = torch.zeros_like(lse)
        return out.transpose(1, 2), lse.to(q.dtype)

    yunchang.kernels.pytorch_attn_forward = yunchang_attention


def main() -> int:
    from benchmarks import xdit_flux

    with tempfile.TemporaryDirectory() as output_dir:
        argv = ["--device", "cpu", "--preset", "tiny", "--mode", "eager", "--gpus", "1,2,4", "--height", "128,192",
                "--width", "128,192", "--methods", "ulysses", "--yunchang-attn", "auto",
                "--xdit-attention-backend", "SDPA_EFFICIENT", "--warmup", "0", "--iterations", "1",
                "--output-dir", output_dir, "--setup", "benchmarks.xdit_cpu_check:patch", "--time-limit", "600"]
        xdit_flux.main(argv)
        results = json.loads((Path(output_dir) / "results.json").read_text())
    failures = list(results["failures"])
    configs = ((1, "1 GPU"), (2, "ulysses2"), (2, "ring2"), (4, "ulysses4"), (4, "usp u2r2"), (4, "ring4"))
    expected = {(part, gpus, f"{peer} {config}") for gpus, config in configs
                for part, peer in (("forward", "xDiT"), ("attention", "xDiT"), ("attention", "yunchang"))}
    found = {("forward", r["gpus"], r["method"]) for r in results["forward"]}
    found |= {("attention", r["gpus"], r["method"].split(" (")[0]) for r in results["attention"]}
    failures += [f"missing row {key}" for key in sorted(expected - found)]
    for part, key in (("forward", "error_vs_1gpu"), ("attention", "error")):
        for r in results[part]:
            peer = r["method"].startswith(("xDiT", "yunchang"))
            checked = part == "attention" or r["size"] == "128x128"  # the bench checks forwards at the first size
            if peer and checked and not r.get(key, float("inf")) < 1e-4:
                failures.append(f"{part} {r['gpus']} {r['method']}: {key} {r.get(key)}")
    print("\n".join(["CPU check:", *failures] if failures else ["CPU check: every row ran and matched"]))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
