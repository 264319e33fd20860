"""Correctness and scaling check of ring attention on 2-4 GPUs (NCCL), or on CPU processes (gloo).

    torchrun --nproc-per-node 4 tools/gpu_ring_check.py                  # GPUs, NCCL
    torchrun --nproc-per-node 2 tools/gpu_ring_check.py --device cpu     # CPU, gloo, tiny sizes

1. Correctness in bf16: ring_attention (both layouts, causal or not, GQA) and ring_dilated_attention (segments
   inside and across shards, head_split) against the float32 reference on the gathered sequence; the error is
   compared with that of the single-device bf16 op on the full sequence.
2. Timing of ring_attention for N = P x n (n tokens per GPU), H=16, D=128, forward and forward+backward, causal
   (zigzag) and not: T_P; and the single-GPU flash_attention on the whole N when it fits: T_1 (the configurations
   are spread over the ranks, each timing on its own GPU). Scaling efficiency = T_1 / (P * T_P).
3. The longest sequence ring_dilated_attention runs forward (H=16, D=64, bf16, segments (2048, 4096, 8192, 16384),
   rates (1, 2, 4, 8)), doubling the tokens per GPU.
4. Packed variable-length batches (``cu_seqlens=``): ring_attention and ring_dilated_attention in bf16 against the
   float32 reference (documents crossing shards, causal and not, GQA), and the scaling efficiency of ring_attention
   on a long-tailed packed batch (document lengths log-uniform in 64..16k, seed 0; ``--varlen-tokens-per-gpu``,
   default 128k) against ``flash_attention_varlen`` on the gathered batch on one GPU.

NVLink multicast (NVLS) is disabled: NCCL_NVLS_ENABLE=0 is set before NCCL starts.
"""
from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"  # never use NVLink multicast

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import longattn  # noqa: E402
from longattn import reference  # noqa: E402
from longattn.bench.varlen_suite import document_lengths  # noqa: E402
from longattn.distributed import ring_attention, ring_dilated_attention, shard  # noqa: E402
from longattn.utils import cu_seqlens_of  # noqa: E402

PROBE_SEGMENTS, PROBE_RATES = (2048, 4096, 8192, 16384), (1, 2, 4, 8)


def _ints(text: str):
    return [int(x) for x in text.split(",") if x]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tokens-per-gpu", type=_ints, default=None, help="timing sizes, default 32768,131072")
    p.add_argument("--heads", type=int, default=None, help="timing heads (default 16)")
    p.add_argument("--head-dim", type=int, default=None, help="timing head dim (default 128)")
    p.add_argument("--check-tokens-per-gpu", type=int, default=None, help="correctness size (default 1024)")
    p.add_argument("--probe-tokens-per-gpu", type=_ints, default=None,
                   help="dilated probe sizes per GPU, ascending (default 1M, 2M, 4M, 8M, 12M, 16M)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--varlen-tokens-per-gpu", type=int, default=None, help="packed batch per GPU (default 131072)")
    p.add_argument("--skip", default="", help="comma list of parts to skip: check,ring,single,probe,varlen")
    p.add_argument("--timeout-min", type=float, default=20.0, help="process-group timeout")
    a = p.parse_args()
    cpu = a.device == "cpu"
    a.tokens_per_gpu = a.tokens_per_gpu or ([64, 128] if cpu else [32768, 131072])
    a.heads = a.heads or (2 if cpu else 16)
    a.head_dim = a.head_dim or (16 if cpu else 128)
    a.check_tokens_per_gpu = a.check_tokens_per_gpu or (48 if cpu else 1024)
    a.probe_tokens_per_gpu = a.probe_tokens_per_gpu or (
        [1024, 2048] if cpu else [1 << 20, 2 << 20, 4 << 20, 8 << 20, 12 << 20, 16 << 20])
    a.varlen_tokens_per_gpu = a.varlen_tokens_per_gpu or (96 if cpu else 131072)
    a.skip = set(s for s in a.skip.split(",") if s)
    return a


class Env:
    def __init__(self, args):
        self.args = args
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        local = int(os.environ.get("LOCAL_RANK", 0))
        if args.device == "cuda":
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
        extra = {"device_id": self.device} if args.device == "cuda" else {}  # binds NCCL to this rank's GPU
        dist.init_process_group(backend, timeout=timedelta(minutes=args.timeout_min), **extra)
        self.cuda = args.device == "cuda"
        self.backend = "auto" if self.cuda else "torch"

    def log(self, *msg):
        if self.rank == 0:
            print(*msg, flush=True)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def max_over_ranks(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def all_true(self, ok: bool) -> bool:
        t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())


# ---------------------------------------------------------------------------------------------------------------
# 1. correctness

def _randn(env, seed, *shape, dtype=torch.float32):
    g = torch.Generator(device=env.device).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=env.device, dtype=torch.float32).to(dtype)


def _max_err(a, b):
    return (a.float() - b.float()).abs().max().item()


def _check_one(env, name, layout, n_full, Hq, Hk, D, ring_fn, ref_fn, single_fn, packed=False, seed=100):
    """Errors of ring (bf16) and of the single-device op (bf16) against the float32 reference. ``packed``: tensors
    ``(n_full, H, D)`` of a packed batch, split contiguously along the rows."""
    lead = () if packed else (1,)
    q, k, v, g = (_randn(env, seed + i, *lead, n_full, h, D) for i, h in enumerate((Hq, Hk, Hk, Hq)))
    dim = 0 if packed else 1
    full32 = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = ref_fn(*full32)
    ref.backward(g)
    want = [ref.detach()] + [t.grad for t in full32]

    full16 = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    single = single_fn(*full16)
    single.backward(g.to(torch.bfloat16))
    single_got = [single.detach()] + [t.grad for t in full16]

    parts = [shard(t.to(torch.bfloat16), layout=layout, dim=dim).requires_grad_() for t in (q, k, v)]
    out = ring_fn(*parts)
    out.backward(shard(g.to(torch.bfloat16), layout=layout, dim=dim))
    ring_got = [out.detach()] + [t.grad for t in parts]

    rows = []
    for what, r, s, w in zip(("out", "dq", "dk", "dv"), ring_got, single_got, want):
        e_ring = env.max_over_ranks(_max_err(r, shard(w, layout=layout, dim=dim)))
        e_single = _max_err(s, w)
        ok = e_ring <= 2.0 * e_single + 2e-3
        rows.append((name, what, e_ring, e_single, ok))
    return rows


def correctness(env):
    args = env.args
    n = args.check_tokens_per_gpu
    N = n * env.world
    D = 64 if env.cuda else 16
    rows = []
    for layout in ("zigzag", "contiguous"):
        for causal in (False, True):
            for Hq, Hk in ((8, 8), (8, 2)):
                name = f"ring {layout} {'causal' if causal else 'full'} Hq={Hq} Hk={Hk}"
                rows += _check_one(
                    env, name, layout, N, Hq, Hk, D,
                    lambda q, k, v: ring_attention(q, k, v, causal=causal, layout=layout, backend=env.backend),
                    lambda q, k, v: reference.flash_attention(q, k, v, causal=causal),
                    lambda q, k, v: longattn.flash_attention(q, k, v, causal=causal, backend=env.backend),
                )
    w = n // 4
    dil = [
        ((w, n, 4 * n), (1, 2, 4), False, False, 8, 8),
        ((w, n, 4 * n), (1, 2, 4), True, False, 8, 2),
        ((w, 2 * n, 4 * n), (2, 2, 4), True, True, 8, 4),
    ]
    for segs, rates, causal, head_split, Hq, Hk in dil:
        kw = dict(segment_lengths=segs, dilation_rates=rates, causal=causal, head_split=head_split)
        name = f"dilated segs={segs} rates={rates}{' causal' if causal else ''}{' head_split' if head_split else ''}"
        rows += _check_one(
            env, name, "contiguous", N, Hq, Hk, D,
            lambda q, k, v: ring_dilated_attention(q, k, v, backend=env.backend, **kw),
            lambda q, k, v: reference.dilated_attention(q, k, v, **kw),
            lambda q, k, v: longattn.dilated_attention(q, k, v, backend=env.backend, **kw),
        )
    return _report(env, f"correctness (bf16 vs float32 reference), {env.world} ranks, N = {N}", rows)


def _report(env, title, rows):
    """Print the rows of :func:`_check_one`; whether all passed."""
    env.log(f"\n== {title} ==")
    env.log(f"{'case':58s} {'grad':4s} {'ring err':>9s} {'1-dev err':>9s}  ok")
    for name, what, e_ring, e_single, ok in rows:
        env.log(f"{name:58s} {what:4s} {e_ring:9.2e} {e_single:9.2e}  {'PASS' if ok else 'FAIL'}")
    return all(r[-1] for r in rows)


# ---------------------------------------------------------------------------------------------------------------
# 2. timing

def _time(env, fn, barrier=True):
    """Mean seconds per call of ``fn`` (after warm-up); with ``barrier``, the slowest rank's."""
    for _ in range(env.args.warmup):
        fn()
    env.sync()
    if barrier:
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(env.args.iters):
        fn()
    env.sync()
    dt = (time.perf_counter() - t0) / env.args.iters
    return env.max_over_ranks(dt) if barrier else dt


def _qkv(env, n, H, D, grad):
    dtype = torch.bfloat16 if env.cuda else torch.float32
    return [torch.randn(1, n, H, D, device=env.device, dtype=dtype).requires_grad_(grad) for _ in range(3)]


def _fwd_and_fwdbwd(env, attn, n, H, D, barrier=True):
    return _fwd_and_fwdbwd_on(env, attn, *_qkv(env, n, H, D, True), barrier=barrier)


def _fwd_and_fwdbwd_on(env, attn, q, k, v, barrier):
    """Seconds per forward and per forward+backward of ``attn(q, k, v)`` (see :func:`_time`)."""
    do = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            attn(q, k, v)

    def fwdbwd():
        q.grad = k.grad = v.grad = None
        attn(q, k, v).backward(do)

    return _time(env, fwd, barrier), _time(env, fwdbwd, barrier)


def ring_timing(env):
    a = env.args
    res = {}
    for n in a.tokens_per_gpu:
        for causal in (False, True):
            def attn(q, k, v, causal=causal):
                return ring_attention(q, k, v, causal=causal, layout="zigzag", backend=env.backend)

            try:
                res[(n, causal)] = _fwd_and_fwdbwd(env, attn, n, a.heads, a.head_dim)
            except torch.cuda.OutOfMemoryError:
                res[(n, causal)] = None
            env.log(f"ring  n/GPU={n} causal={causal}: T_P fwd, fwd+bwd = {res[(n, causal)]}")
            if env.cuda:
                torch.cuda.empty_cache()
    return res


def single_timing(env):
    """T_1 on the whole sequence, each configuration on one rank's device; gathered on every rank."""
    a = env.args
    configs = [(n, causal) for n in a.tokens_per_gpu for causal in (False, True)]
    mine = {}
    for i, (n, causal) in enumerate(configs):
        if i % env.world != env.rank:
            continue
        N = n * env.world
        try:
            mine[(n, causal)] = _fwd_and_fwdbwd(
                env, lambda q, k, v: longattn.flash_attention(q, k, v, causal=causal, backend=env.backend),
                N, a.heads, a.head_dim, barrier=False)
        except torch.cuda.OutOfMemoryError:
            mine[(n, causal)] = None
        if env.cuda:
            torch.cuda.empty_cache()
    every = [None] * env.world
    dist.all_gather_object(every, mine)
    out = {}
    for d in every:
        out.update(d)
    return out


# ---------------------------------------------------------------------------------------------------------------
# 3. longest dilated sequence

def dilated_probe(env):
    a = env.args
    largest, rows = None, []
    for n in a.probe_tokens_per_gpu:
        ok, dt, peak, err = True, float("nan"), 0.0, ""
        try:
            if env.cuda:
                torch.cuda.reset_peak_memory_stats()
            dtype = torch.bfloat16 if env.cuda else torch.float32
            q, k, v = (torch.empty(1, n, 16, 64, device=env.device, dtype=dtype).normal_() for _ in range(3))
            env.sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = ring_dilated_attention(q, k, v, segment_lengths=PROBE_SEGMENTS, dilation_rates=PROBE_RATES,
                                             backend=env.backend)
            env.sync()
            dt = time.perf_counter() - t0
            ok = bool(torch.isfinite(out[:, :4096]).all())
            if env.cuda:
                peak = torch.cuda.max_memory_allocated() / 2 ** 30
            del q, k, v, out
        except torch.cuda.OutOfMemoryError:
            ok, err = False, "OOM"
        except Exception as e:  # report, then stop probing on every rank
            ok, err = False, f"{type(e).__name__}: {e}"[:120]
        if env.cuda:
            torch.cuda.empty_cache()
        ok = env.all_true(ok)
        rows.append((n, n * env.world, ok, env.max_over_ranks(dt) if ok else float("nan"), peak, err))
        env.log(f"dilated probe n/GPU={n} N={n * env.world}: {'ok' if ok else 'failed ' + err}")
        if not ok:
            break
        largest = n * env.world
    return largest, rows


# ---------------------------------------------------------------------------------------------------------------
# 4. packed variable-length batches

def varlen_correctness(env):
    """bf16 ring varlen vs the float32 reference on the gathered batch, next to the single-device bf16 error."""
    total = env.args.check_tokens_per_gpu * env.world
    cu = cu_seqlens_of(document_lengths(total, low=16, high=max(32, total // 2), seed=1), env.device)
    D = 64 if env.cuda else 16
    n = env.args.check_tokens_per_gpu
    cases = [("flash", False, 8, 2, {}), ("flash", True, 8, 8, {}),
             ("dilated", True, 8, 2, dict(segment_lengths=(n // 4, n, 4 * n), dilation_rates=(1, 2, 4)))]
    rows = []
    for kind, causal, Hq, Hk, kw in cases:
        if kind == "flash":
            ring_fn = lambda q, k, v: ring_attention(q, k, v, cu_seqlens=cu, causal=causal, backend=env.backend)
            ref_fn = lambda q, k, v: reference.flash_attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                                      causal=causal)
            one_fn = lambda q, k, v: longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                                     causal=causal, backend=env.backend)
        else:
            ring_fn = lambda q, k, v: ring_dilated_attention(q, k, v, cu_seqlens=cu, causal=causal,
                                                             backend=env.backend, **kw)
            ref_fn = lambda q, k, v: reference.dilated_attention_varlen(q, k, v, cu_seqlens=cu, causal=causal, **kw)
            one_fn = lambda q, k, v: longattn.dilated_attention_varlen(q, k, v, cu_seqlens=cu, causal=causal,
                                                                       backend=env.backend, **kw)
        name = f"varlen {kind} {'causal' if causal else 'full'} Hq={Hq} Hk={Hk}"
        rows += _check_one(env, name, "contiguous", total, Hq, Hk, D, ring_fn, ref_fn, one_fn, packed=True, seed=200)
    return _report(env, f"varlen correctness (bf16 vs float32 reference), {env.world} ranks, {total} packed "
                        f"tokens, {len(cu) - 1} documents", rows)


def varlen_timing(env):
    """T_P of ring_attention(cu_seqlens) on a long-tailed packed batch and T_1 of flash_attention_varlen on the
    gathered batch (on rank 0's device); efficiency T_1 / (P T_P)."""
    a = env.args
    total = a.varlen_tokens_per_gpu * env.world
    lens = document_lengths(total, seed=0)
    cu = cu_seqlens_of(lens, env.device)
    dtype = torch.bfloat16 if env.cuda else torch.float32
    rows = []
    for causal in (False, True):
        def ring(q, k, v, causal=causal):
            return ring_attention(q, k, v, cu_seqlens=cu, causal=causal, backend=env.backend)

        q, k, v = (torch.randn(a.varlen_tokens_per_gpu, h, a.head_dim, device=env.device, dtype=dtype)
                   .requires_grad_() for h in (a.heads, a.heads // 4 or 1, a.heads // 4 or 1))
        tp = _fwd_and_fwdbwd_on(env, ring, q, k, v, barrier=True)
        t1 = None
        if env.rank == 0:
            def one(q, k, v, causal=causal):
                return longattn.flash_attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal,
                                                       backend=env.backend)

            qf, kf, vf = (torch.randn(total, t.shape[1], a.head_dim, device=env.device, dtype=dtype)
                          .requires_grad_() for t in (q, k, v))
            try:
                t1 = _fwd_and_fwdbwd_on(env, one, qf, kf, vf, barrier=False)
            except torch.cuda.OutOfMemoryError:
                t1 = None
            del qf, kf, vf
        every = [None] * env.world
        dist.all_gather_object(every, t1)
        rows.append((causal, tp, every[0]))
        if env.cuda:
            torch.cuda.empty_cache()
    env.log(f"\n== ring_attention on a packed batch, P={env.world}, {a.varlen_tokens_per_gpu} tokens per GPU, "
            f"{len(lens)} documents of {min(lens)}..{max(lens)}, Hq={a.heads}, Hk={a.heads // 4 or 1}, "
            f"D={a.head_dim} ==")
    for causal, tp, t1 in rows:
        for j, pass_name in enumerate(("fwd", "fwd+bwd")):
            eff = t1[j] / (env.world * tp[j]) if t1 else float("nan")
            t1_ms = t1[j] * 1e3 if t1 else float("nan")
            env.log(f"causal={str(causal):5s} {pass_name:>7s} T_P {tp[j] * 1e3:9.1f} ms  T_1 {t1_ms:9.1f} ms  "
                    f"eff {eff:6.3f}")
    return rows


# ---------------------------------------------------------------------------------------------------------------

def main():
    args = parse_args()
    env = Env(args)
    env.log(f"ring check: {env.world} ranks, device {args.device}, torch {torch.__version__}, "
            f"NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}")
    failed = False
    try:
        if "check" not in args.skip:
            failed |= not correctness(env)
        ring = ring_timing(env) if "ring" not in args.skip else {}
        single = single_timing(env) if "single" not in args.skip else {}
        largest, probe = dilated_probe(env) if "probe" not in args.skip else (None, [])
        if "varlen" not in args.skip:
            if "check" not in args.skip:
                failed |= not varlen_correctness(env)
            varlen_timing(env)
    except Exception:
        traceback.print_exc()
        raise
    if ring:
        env.log(f"\n== ring_attention scaling, P={env.world}, H={args.heads}, D={args.head_dim}, "
                f"{'bf16' if env.cuda else 'fp32'} ==")
        env.log(f"{'n/GPU':>8s} {'N':>9s} {'causal':>6s} {'pass':>7s} {'T_P ms':>9s} {'T_1 ms':>9s} {'eff':>6s}")
        for (n, causal), tp in ring.items():
            t1 = single.get((n, causal))
            for j, pass_name in enumerate(("fwd", "fwd+bwd")):
                tp_ms = tp[j] * 1e3 if tp else float("nan")
                t1_ms = t1[j] * 1e3 if t1 else float("nan")
                eff = t1_ms / (env.world * tp_ms) if tp and t1 else float("nan")
                env.log(f"{n:8d} {n * env.world:9d} {str(causal):>6s} {pass_name:>7s} {tp_ms:9.1f} {t1_ms:9.1f} "
                        f"{eff:6.3f}")
    if probe:
        env.log(f"\n== ring_dilated_attention forward probe, H=16, D=64, segments {PROBE_SEGMENTS}, "
                f"rates {PROBE_RATES} ==")
        env.log(f"{'n/GPU':>10s} {'N':>11s} {'ok':>4s} {'s':>8s} {'peak GiB':>9s}")
        for n, N, ok, dt, peak, err in probe:
            env.log(f"{n:10d} {N:11d} {'yes' if ok else 'no':>4s} {dt:8.3f} {peak:9.1f} {err}")
        env.log(f"largest sequence that ran: {largest}")
    env.log(f"\ncorrectness: {'FAIL' if failed else 'PASS' if 'check' not in args.skip else 'skipped'}")
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
