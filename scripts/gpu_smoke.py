"""Quick GPU smoke check of the kernels (bf16) against float32 math: run first in a device session."""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import longattn  # noqa: E402


def math_ref(q, k, v, causal=False, window=(-1, -1), allowed=None):
    B, N, Hq, D = q.shape
    M, Hk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(Hq // Hk, 2)
    v = v.repeat_interleave(Hq // Hk, 2)
    s = torch.einsum("bnhd,bmhd->bhnm", q, k) * D ** -0.5
    i = torch.arange(N, device=q.device)[:, None] + M - N
    j = torch.arange(M, device=q.device)[None, :]
    ok = torch.ones(N, M, dtype=torch.bool, device=q.device)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    ok = ok.expand(B, Hq, N, M)
    if allowed is not None:
        ok = ok & allowed
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(ok, torch.exp(s - lse[..., None]), 0.0)
    return torch.einsum("bhnm,bmhd->bnhd", p, v), lse


def check(name, fn, ref_fn, shapes, dtype=torch.bfloat16):
    (B, N, M, Hq, Hk, D) = shapes
    q = torch.randn(B, N, Hq, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, M, Hk, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, M, Hk, D, device="cuda", dtype=dtype, requires_grad=True)
    t = time.time()
    o, lse = fn(q, k, v)
    do = torch.randn_like(o)
    g = torch.autograd.grad(o, (q, k, v), do)
    torch.cuda.synchronize()
    t = time.time() - t
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ro, rl = ref_fn(qf, kf, vf)
    rg = torch.autograd.grad(ro, (qf, kf, vf), do.float())
    rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()
    fin = torch.isfinite(rl)
    lerr = (lse[fin] - rl[fin]).abs().max().item()
    same_inf = torch.equal(torch.isfinite(lse), fin)
    errs = [rel(o, ro)] + [rel(a, b) for a, b in zip(g, rg)]
    ok = all(e < 2e-2 for e in errs) and lerr < 5e-2 and same_inf and all(torch.isfinite(x).all() for x in g)
    print(f"{'OK ' if ok else 'BAD'} {name:38s} {shapes} o {errs[0]:.1e} dq {errs[1]:.1e} dk {errs[2]:.1e} "
          f"dv {errs[3]:.1e} lse {lerr:.1e} inf-match {same_inf} ({t:.1f}s incl. compile)", flush=True)
    return ok


def main():
    results = []
    for D in (32, 64, 96, 128, 256):
        results.append(check(f"dense D{D}", lambda q, k, v: longattn.flash_attention(
            q, k, v, return_lse=True, backend="triton"), math_ref, (2, 1000, 1000, 4, 4, D)))
    results.append(check("causal N<M gqa", lambda q, k, v: longattn.flash_attention(
        q, k, v, causal=True, return_lse=True, backend="triton"),
        lambda q, k, v: math_ref(q, k, v, causal=True), (2, 777, 1283, 8, 2, 128)))
    results.append(check("causal N>M (masked rows)", lambda q, k, v: longattn.flash_attention(
        q, k, v, causal=True, return_lse=True, backend="triton"),
        lambda q, k, v: math_ref(q, k, v, causal=True), (1, 1283, 777, 4, 1, 64)))
    results.append(check("window (200, 65)", lambda q, k, v: longattn.flash_attention(
        q, k, v, window=(200, 65), return_lse=True, backend="triton"),
        lambda q, k, v: math_ref(q, k, v, window=(200, 65)), (2, 1537, 1537, 6, 3, 64)))
    N, M, bs = 1100, 1300, 128
    mask = torch.rand(2, 4, -(-N // bs), -(-M // bs), device="cuda") < 0.3
    allowed = mask.repeat_interleave(bs, 2).repeat_interleave(bs, 3)[:, :, :N, :M]
    results.append(check("block sparse causal", lambda q, k, v: longattn.block_sparse_attention(
        q, k, v, block_mask=mask, block_size=bs, causal=True, return_lse=True, backend="triton"),
        lambda q, k, v: math_ref(q, k, v, causal=True, allowed=allowed), (2, N, M, 4, 2, 64)))
    print("ALL OK" if all(results) else "SOME FAILED", flush=True)


if __name__ == "__main__":
    main()
