"""Is an FP8 attention backward worth building? cuDNN's FP8 backward (the only one on Hopper) against bf16 backwards,
time and gradient error, on one Hopper GPU:

    python tools/bench_cudnn_fp8_bwd.py [--head-dims 64 128] [--lengths 4096 16384] [--rounds 5] [--skip-time]

Needs the cuDNN frontend's Python package (``import cudnn``; PyPI ``nvidia-cudnn-frontend``, 1.23.0 checked here): it
loads the libcudnn that torch's wheel brings (cuDNN >= 9.1, not 9.10.0, for the FP8 backward). On a machine that cannot
download, carry the wheel and install it into a folder on ``PYTHONPATH`` (fetched where pip can download:
``pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .cudnnfe
nvidia-cudnn-frontend==1.23.0``, 3 MB; on the GPU machine ``pip install --no-index --no-deps --target DIR
.cudnnfe/*.whl``).

Times (ms, ``do_bench`` medians, the steps taking turns in every round as ``longattn.bench.interleaved.time_rounds``
gives them), bf16 inputs, B·N = 16k, heads·D = 2048, D = 64/128, N = 4k/16k, causal or not:

- ``cuDNN bf16 bwd``: SDPA with the cuDNN backend forced (``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``), backward alone
  (``torch.autograd.grad`` with ``retain_graph``, the forward run once before); ``ours bf16 bwd``: the same for
  ``longattn.flash_attention(..., backend="triton")`` (``--ours-backend``);
- ``FP8 bwd``: cuDNN's FP8 backward graph (``pygraph.sdpa_fp8_backward``) alone, on q, k, v, dO quantized per tensor to
  float8_e4m3fn (scale = 448 / amax) and the FP8 output and statistics of cuDNN's FP8 forward (``pygraph.sdpa_fp8``);
  ``FP8 bwd+casts``: the same with what a bf16 caller adds around it (quantizing dO: its amax and a cast; dq, dk, dv
  back to bf16), in eager PyTorch (so an upper bound on fused casts);
- forward+backward of each (``... f+b``; the FP8 one: the two graphs, no casts);
- ``FP8 / cuDNN bwd``, ``FP8+casts / cuDNN bwd`` and ``FP8 / ours bwd``: FP8 backward time over the bf16 one,
  paired within rounds (``paired_ratio``); below 1 / 1.3 = 0.77 is the 1.3x bar. A row whose FP8 graphs cuDNN
  rejects (on Hopper the FP8 backward takes D = 128 only) prints n/a and the reason, and times nothing.

Scales: P (softmax probabilities, at most 1) is quantized with scale 448; dS (``scale_dP``), O and dq/dk/dv (FP8 outputs
on Hopper) with scales from the amax that the graphs return, calibrated by running each graph until its amax inputs
are known (delayed scaling with a perfect history; the outputs' scales get ``--margin`` of headroom).

Gradient error (``--skip-error`` leaves it out): on B=1, N=1024, H=4 (``--error-shape``), the error of dq, dk, dv as
max |x - ref| / max |ref| and as the relative RMS, each against float64 autograd of ``longattn.reference
.flash_attention``: FP8 against the reference on its dequantized inputs and dequantized dO (``FP8 (kernel)``: what the
backward adds) and against the reference on the original bf16 inputs (``FP8 (total)``: with the inputs' quantization),
beside the bf16 backwards against the latter.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from typing import Callable, Dict, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from torch import Tensor  # noqa: E402

E4M3_MAX = 448.0
Shape = Tuple[int, int, int, int]  # (B, N, H, D)


def _cudnn():
    """The cuDNN frontend module, imported after torch so that it finds the libcudnn torch has loaded."""
    torch.backends.cudnn.version()  # loads torch's libcudnn.so.9 before the frontend looks for one
    import cudnn

    return cudnn


_HANDLE: Dict[str, int] = {}


def _handle() -> int:
    """One cuDNN handle for every graph, on torch's current stream."""
    if "h" not in _HANDLE:
        cudnn = _cudnn()
        _HANDLE["h"] = cudnn.create_handle()
        cudnn.set_stream(handle=_HANDLE["h"], stream=torch.cuda.current_stream().cuda_stream)
    return _HANDLE["h"]


def quantize(x: Tensor) -> Tuple[Tensor, Tensor]:
    """``(x8, descale)``: ``x`` in float8_e4m3fn with one scale for the tensor (448 / amax), and the float32 factor
    ``(1, 1, 1, 1)`` that turns it back (``x8.float() * descale``)."""
    amax = x.detach().abs().amax().float().clamp_min(1e-12)
    x8 = (x.detach().float() * (E4M3_MAX / amax)).to(torch.float8_e4m3fn)
    return x8, (amax / E4M3_MAX).reshape(1, 1, 1, 1)


def quantize_into(x: Tensor, x8: Tensor, descale: Tensor) -> None:
    """:func:`quantize` into ``x8`` and ``descale`` in place, the multiply in ``x``'s dtype (what the timed casts do:
    an amax, a multiply and a cast in eager PyTorch, no float32 copy)."""
    amax = x.abs().amax().float().clamp_min(1e-12)
    descale.copy_((amax / E4M3_MAX).reshape(1, 1, 1, 1))
    x8.copy_(x * (E4M3_MAX / amax))


def _bhsd(x: Tensor) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """cuDNN's ``(dim, stride)`` of ``x (B, N, H, D)``: the same memory seen as ``(B, H, N, D)``."""
    (b, n, h, d), s = x.shape, x.stride()
    return (b, h, n, d), (s[0], s[2], s[1], s[3])


class CudnnFp8Attention:
    """cuDNN's FP8 forward and backward graphs for one shape and mask, with their buffers (built once; ``get`` keeps
    one per shape). q, k, v, dO, O, dq, dk, dv are ``(B, N, H, D)`` float8_e4m3fn with float32 ``(1, 1, 1, 1)``
    factors in ``s`` (O, dq, dk, dv are FP8 too: on Hopper cuDNN has no bf16 output for FP8 attention); the
    statistics (log-sum-exp of the scaled scores) float32 ``(B, H, N, 1)``."""

    cache: Dict[Tuple[Shape, bool], "CudnnFp8Attention"] = {}
    _SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o", "amax_s", "amax_o",
                "descale_o", "descale_do", "descale_dp", "scale_dq", "scale_dk", "scale_dv", "scale_dp", "amax_dq",
                "amax_dk", "amax_dv", "amax_dp")

    @classmethod
    def get(cls, shape: Shape, causal: bool) -> "CudnnFp8Attention":
        if (shape, causal) not in cls.cache:
            cls.cache[(shape, causal)] = cls(shape, causal)
        return cls.cache[(shape, causal)]

    def __init__(self, shape: Shape, causal: bool, margin: float = 1.01):
        self.cudnn = _cudnn()
        self.shape, self.causal, self.margin = shape, causal, margin
        b, n, h, d = shape
        self.q, self.k, self.v, self.o, self.do, self.dq, self.dk, self.dv = (
            torch.zeros(b, n, h, d, device="cuda", dtype=torch.float8_e4m3fn) for _ in range(8))
        self.stats = torch.zeros(b, h, n, 1, device="cuda", dtype=torch.float32)
        self.s = {name: torch.ones(1, 1, 1, 1, device="cuda", dtype=torch.float32) for name in self._SCALARS}
        self.s["scale_s"].fill_(E4M3_MAX)  # P = exp(S - lse) is at most 1
        self.s["descale_s"].fill_(1 / E4M3_MAX)
        self.fwd, self.fwd_pack = self._build_forward()
        self.bwd, self.bwd_pack = self._build_backward()
        size = max(self.fwd.get_workspace_size(), self.bwd.get_workspace_size(), 1)
        self.workspace = torch.empty(size, device="cuda", dtype=torch.uint8)

    def _graph(self):
        t = self.cudnn.data_type
        return self.cudnn.pygraph(io_data_type=t.FP8_E4M3, intermediate_data_type=t.FLOAT,
                                  compute_data_type=t.FLOAT, handle=_handle())

    def _inputs(self, g, names, pack: dict) -> list:
        """Graph tensors over this object's buffers ``names`` (a ``(B, N, H, D)`` tensor or a scalar factor),
        recorded in ``pack``."""
        out = []
        for name in names:
            x = self.s[name] if name in self.s else getattr(self, name)
            dim, stride = _bhsd(x) if x.shape[-1] != 1 else (tuple(x.shape), x.stride())
            t = g.tensor(name=name, dim=dim, stride=stride, data_type=x.dtype)
            pack[t] = x
            out.append(t)
        return out

    def _outputs(self, tensors, names, pack: dict) -> None:
        for t, name in zip(tensors, names):
            x = self.s[name] if name in self.s else getattr(self, name)
            dim, stride = _bhsd(x) if x.shape[-1] != 1 else (tuple(x.shape), x.stride())
            t.set_output(True).set_dim(list(dim)).set_stride(list(stride)).set_data_type(x.dtype)
            pack[t] = x

    def _build(self, g) -> None:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([self.cudnn.heur_mode.A, self.cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()

    def _build_forward(self):
        g, pack = self._graph(), {}
        names = ("q", "k", "v", "descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        q, k, v, dq_, dk_, dv_, ds_, ss_, so_ = self._inputs(g, names, pack)
        outs = g.sdpa_fp8(q=q, k=k, v=v, descale_q=dq_, descale_k=dk_, descale_v=dv_, descale_s=ds_, scale_s=ss_,
                          scale_o=so_, generate_stats=True, attn_scale=1.0 / math.sqrt(self.shape[3]),
                          use_causal_mask=self.causal, name="fp8_fwd")
        self._outputs(outs, ("o", "stats", "amax_s", "amax_o"), pack)
        self._build(g)
        return g, pack

    def _build_backward(self):
        g, pack = self._graph(), {}
        names = ("q", "k", "v", "o", "do", "stats", "descale_q", "descale_k", "descale_v", "descale_o", "descale_do",
                 "descale_s", "descale_dp", "scale_s", "scale_dq", "scale_dk", "scale_dv", "scale_dp")
        t = dict(zip(names, self._inputs(g, names, pack)))
        outs = g.sdpa_fp8_backward(
            q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["do"], stats=t["stats"], descale_q=t["descale_q"],
            descale_k=t["descale_k"], descale_v=t["descale_v"], descale_o=t["descale_o"],
            descale_dO=t["descale_do"], descale_s=t["descale_s"], descale_dP=t["descale_dp"], scale_s=t["scale_s"],
            scale_dQ=t["scale_dq"], scale_dK=t["scale_dk"], scale_dV=t["scale_dv"], scale_dP=t["scale_dp"],
            attn_scale=1.0 / math.sqrt(self.shape[3]), use_causal_mask=self.causal, name="fp8_bwd")
        self._outputs(outs, ("dq", "dk", "dv", "amax_dq", "amax_dk", "amax_dv", "amax_dp"), pack)
        self._build(g)
        return g, pack

    def load(self, q: Tensor, k: Tensor, v: Tensor, do: Tensor) -> None:
        """Quantize ``q, k, v, dO (B, N, H, D)`` (bf16 or any float) into the graphs' inputs (:func:`quantize`)."""
        for src, name in ((q, "q"), (k, "k"), (v, "v"), (do, "do")):
            x8, descale = quantize(src)
            getattr(self, name).copy_(x8)
            self.s[f"descale_{name}"].copy_(descale)

    def forward(self) -> None:
        self.fwd.execute(self.fwd_pack, self.workspace, handle=_handle())

    def backward(self) -> None:
        self.bwd.execute(self.bwd_pack, self.workspace, handle=_handle())

    def _scale_from_amax(self, name: str, margin: float) -> None:
        """``scale_<name> = 448 / (amax_<name> * margin)`` and ``descale_<name>`` its inverse, on the GPU."""
        a = self.s[f"amax_{name}"].clamp_min(1e-30) * margin
        self.s[f"scale_{name}"].copy_(E4M3_MAX / a)
        if f"descale_{name}" in self.s:
            self.s[f"descale_{name}"].copy_(a / E4M3_MAX)

    def calibrate(self) -> None:
        """Run the graphs until every scale comes from the amax of what it scales: O from the forward's ``amax_o``;
        dS (``scale_dP``; its amax is taken before the scale) from one backward; dq, dk, dv from a second one (their
        amax needs a well-scaled dS); then one more backward with all of them."""
        self.s["scale_o"].fill_(1.0)
        self.forward()
        self._scale_from_amax("o", self.margin)
        self.forward()
        for name in ("dp", "dq", "dk", "dv"):
            self.s[f"scale_{name}"].fill_(1.0)
        self.backward()
        self._scale_from_amax("dp", 1.0)
        self.backward()
        for name in ("dq", "dk", "dv"):
            self._scale_from_amax(name, self.margin)
        self.backward()

    def grads(self, dtype: torch.dtype = torch.bfloat16) -> Tuple[Tensor, Tensor, Tensor]:
        """dq, dk, dv dequantized to ``dtype`` (what a bf16 caller gets back)."""
        return tuple(getattr(self, n).to(dtype) * (1 / self.s[f"scale_{n}"]).reshape(()) for n in ("dq", "dk", "dv"))

    def dequantized_inputs(self) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """q, k, v, dO in float64: the values the FP8 graphs read."""
        return tuple(getattr(self, n).double() * self.s[f"descale_{n}"].double() for n in ("q", "k", "v", "do"))


def sdpa_cudnn(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """SDPA restricted to the cuDNN backend on ``(B, N, H, D)`` inputs (transposed views, no copies)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                             v.transpose(1, 2), is_causal=causal)
    return o.transpose(1, 2)


def ours(backend: str) -> Optional[Callable]:
    """``longattn.flash_attention`` with ``backend``, or None where longattn does not import."""
    try:
        import longattn
    except Exception as e:  # noqa: BLE001 - the column shows as missing
        print(f"  longattn: {type(e).__name__}: {e}", flush=True)
        return None
    return lambda q, k, v, causal: longattn.flash_attention(q, k, v, causal=causal, backend=backend)


def bwd_step(f: Callable, q: Tensor, k: Tensor, v: Tensor, do: Tensor, causal: bool) -> Callable[[], None]:
    """Backward alone: ``f``'s forward runs once here; each call runs its backward on the saved graph."""
    o = f(q, k, v, causal)

    def step() -> None:
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)

    return step


def fwd_bwd_step(f: Callable, q: Tensor, k: Tensor, v: Tensor, do: Tensor, causal: bool) -> Callable[[], None]:
    def step() -> None:
        torch.autograd.grad(f(q, k, v, causal), (q, k, v), do)

    return step


def fp8_steps(att: CudnnFp8Attention, do: Tensor) -> Dict[str, Callable[[], None]]:
    """The FP8 steps of one row: backward alone, backward with a bf16 caller's casts, forward+backward."""
    def bwd_casts() -> None:
        quantize_into(do, att.do, att.s["descale_do"])
        att.backward()
        att.grads()

    def fwd_bwd() -> None:
        att.forward()
        att.backward()

    return {"fp8_bwd": att.backward, "fp8_bwd_casts": bwd_casts, "fp8_fb": fwd_bwd}


def fp8_attention(shape: Shape, causal: bool, q: Tensor, k: Tensor, v: Tensor, do: Tensor, margin: float):
    """The calibrated :class:`CudnnFp8Attention` of a row, or ``(None, reason)`` where cuDNN has no such graph."""
    try:
        att = CudnnFp8Attention.get(shape, causal)
        att.margin = margin
        att.load(q, k, v, do)
        att.calibrate()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - cudnnGraphNotSupportedError and friends: the row shows n/a
        return None, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    return att, ""


def time_table(args) -> None:
    from longattn.bench.interleaved import env_header, paired_ratio, time_rounds

    ours_f = ours(args.ours_backend)
    print(f"\n{env_header()}; cuDNN {torch.backends.cudnn.version()}, frontend {_cudnn().__version__}\n")
    cols = ("cudnn_bwd", "ours_bwd", "fp8_bwd", "fp8_bwd_casts", "cudnn_fb", "ours_fb", "fp8_fb")
    print("| D | N | causal | cuDNN bf16 bwd | ours bf16 bwd | FP8 bwd | FP8 bwd+casts | cuDNN bf16 f+b | ours f+b | "
          "FP8 f+b | FP8 / cuDNN bwd | FP8+casts / cuDNN bwd | FP8 / ours bwd |\n|" + "---|" * 13, flush=True)
    for d in args.head_dims:
        for n in args.lengths:
            b, h = 16384 // n, 2048 // d
            for causal in (False, True):
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                               for _ in range(4))
                q, k, v = (x.requires_grad_() for x in (q, k, v))
                att, why = fp8_attention((b, n, h, d), causal, q, k, v, do, args.margin)
                if att is None:  # nothing to compare: the bf16 steps are not timed either
                    print(f"| {d} | {n // 1024}k | {'yes' if causal else 'no'} |" + " n/a |" * 10
                          + f"\n  (FP8: {why})", flush=True)
                    CudnnFp8Attention.cache.clear()
                    continue
                steps = {"cudnn_bwd": bwd_step(sdpa_cudnn, q, k, v, do, causal),
                         "cudnn_fb": fwd_bwd_step(sdpa_cudnn, q, k, v, do, causal), **fp8_steps(att, do)}
                if ours_f is not None:
                    steps.update(ours_bwd=bwd_step(ours_f, q, k, v, do, causal),
                                 ours_fb=fwd_bwd_step(ours_f, q, k, v, do, causal))
                samples = time_rounds(steps, rounds=args.rounds)
                t = {c: statistics.median(samples[c]) if samples.get(c) else float("nan") for c in cols}
                ratios = [paired_ratio(samples, "fp8_bwd", "cudnn_bwd"),
                          paired_ratio(samples, "fp8_bwd_casts", "cudnn_bwd"),
                          paired_ratio(samples, "fp8_bwd", "ours_bwd") if ours_f is not None else float("nan")]
                print(f"| {d} | {n // 1024}k | {'yes' if causal else 'no'} | "
                      + " | ".join(f"{x:.3f}" for x in [t[c] for c in cols] + ratios) + " |", flush=True)
                del steps, att
                CudnnFp8Attention.cache.clear()
                torch.cuda.empty_cache()


def _errors(got: Tuple[Tensor, ...], want: Tuple[Tensor, ...]) -> str:
    """``max |x - ref| / max |ref|`` and the relative RMS of each of dq, dk, dv, as table cells."""
    cells = []
    for x, w in zip(got, want):
        diff = x.double() - w
        if not torch.isfinite(diff).all():
            cells.append("non-finite")
            continue
        mx = (diff.abs().max() / w.abs().max().clamp_min(1e-30)).item()
        rms = (diff.norm() / w.norm().clamp_min(1e-30)).item()
        cells.append(f"{mx:.2e} / {rms:.2e}")
    return " | ".join(cells)


def _reference_grads(q: Tensor, k: Tensor, v: Tensor, do: Tensor, causal: bool) -> Tuple[Tensor, ...]:
    from longattn import reference

    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    o = reference.flash_attention(q, k, v, causal=causal)
    return torch.autograd.grad(o, (q, k, v), do.double())


def error_table(args) -> None:
    b, n, h = args.error_shape
    ours_f = ours(args.ours_backend)
    print(f"\nGradient error, B={b} N={n} H={h}: max |x - ref| / max |ref| / relative RMS, against float64 autograd "
          "(FP8 (kernel): reference on the dequantized FP8 inputs and dO; the rest: on the bf16 inputs)\n")
    print("| D | causal | backward | dq | dk | dv |\n|---|---|---|---|---|---|", flush=True)
    for d in args.head_dims:
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(1)
            q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                           for _ in range(4))
            want = _reference_grads(q, k, v, do, causal)
            rows = []
            qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
            rows.append(("cuDNN bf16", torch.autograd.grad(sdpa_cudnn(qg, kg, vg, causal), (qg, kg, vg), do), want))
            if ours_f is not None:
                rows.append((f"ours bf16 ({args.ours_backend})",
                             torch.autograd.grad(ours_f(qg, kg, vg, causal), (qg, kg, vg), do), want))
            att, why = fp8_attention((b, n, h, d), causal, q, k, v, do, args.margin)
            if att is None:
                print(f"  FP8 D={d} causal={causal}: {why}", flush=True)
            else:
                got = att.grads(torch.float32)
                rows.append(("FP8 (kernel)", got, _reference_grads(*att.dequantized_inputs(), causal)))
                rows.append(("FP8 (total)", got, want))
            for name, got, ref in rows:
                print(f"| {d} | {'yes' if causal else 'no'} | {name} | {_errors(got, ref)} |", flush=True)
            CudnnFp8Attention.cache.clear()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384], help="N of the timed rows (B = 16k / N)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds a row")
    p.add_argument("--ours-backend", default="triton", help="longattn backend of the 'ours' columns (auto, triton)")
    p.add_argument("--margin", type=float, default=1.01,
                   help="headroom of the FP8 outputs' scales (O, dq, dk, dv): scale = 448 / (amax * margin)")
    p.add_argument("--error-shape", type=int, nargs=3, default=[1, 1024, 4], metavar=("B", "N", "H"))
    p.add_argument("--skip-time", action="store_true", help="only the gradient error table")
    p.add_argument("--skip-error", action="store_true", help="only the time table")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_cudnn_fp8_bwd: needs a CUDA GPU (Hopper: cuDNN's FP8 attention runs on sm_90 and newer)")
    try:
        _cudnn()
    except ImportError as e:
        sys.exit(f"bench_cudnn_fp8_bwd: cannot import the cuDNN frontend ({e}); pip install nvidia-cudnn-frontend, "
                 "or install its carried wheel into a folder on PYTHONPATH")
    print(f"cuDNN backend {_cudnn().backend_version()}, frontend {_cudnn().__version__}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    if not args.skip_error:
        error_table(args)
    if not args.skip_time:
        time_table(args)


if __name__ == "__main__":
    main()
