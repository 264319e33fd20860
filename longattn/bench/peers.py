"""The implementations the benchmark measures: longattn and what a user would run instead.

Each :class:`Peer` says whether it can run a workload (:meth:`Peer.unsupported` gives the reason when not) and
prepares a callable ``fn(q, k, v) -> out`` on ``(B, N, H, D)`` tensors, differentiable in q, k and v. Masks a peer
needs are built once per workload and device in :meth:`Peer.prepare` (outside the measured region).

- ``longattn``: :func:`longattn.flash_attention` / ``dilated_attention`` / ``block_sparse_attention`` with
  ``backend="auto"`` (its note says which kernel auto ran: SDPA, our Triton kernels or the PyTorch backend).
- ``longattn-triton``: the same with ``backend="triton"`` (our kernels forced; GPUs only).
- ``sdpa``: ``scaled_dot_product_attention`` with no backend chosen: what a user gets by default (cuDNN on an
  H100, flash on other recent GPUs, the CPU's own kernel on a CPU).
- ``sdpa-flash``, ``sdpa-cudnn``, ``sdpa-efficient``, ``sdpa-math``: ``scaled_dot_product_attention`` restricted to
  one backend with ``torch.nn.attention.sdpa_kernel``; window and block-sparse patterns go in as a boolean
  ``(N, N)`` mask (which the flash backend does not take).
- ``flex``: FlexAttention compiled with ``torch.compile`` (CUDA only), patterns as a ``BlockMask``.
- ``fa4``: FlashAttention-4 (``flash_attn.cute.flash_attn_func``, Hopper and Blackwell) where it is installed: dense,
  causal and window workloads (the fastest installable peer on an H200, docs/benchmarks.md).
- ``materialized``: the N x N score matrix, masked, softmax, matmul: what attention costs written plainly.
- ``composition``: dilated attention composed of plain parts (:mod:`longattn.bench.composition`).

SDPA does not apply to the dilated workload (the composition runs it per branch) and the composition applies only
to it: :meth:`Peer.applies` leaves such pairs out of the tables.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from longattn.bench.workloads import Workload

AttnFn = Callable[[Tensor, Tensor, Tensor], Tensor]


class Unsupported(Exception):
    """Raised by a peer (or recognised from an error) when it cannot run the given inputs."""


class Peer:
    """Base class of the measured implementations."""

    name = "peer"
    description = ""
    compiles = False  # the first call on a new shape compiles (its time is not the run's)

    def applies(self, kind: str) -> bool:
        """Whether this peer is a meaningful comparison for workload ``kind`` at all (no row otherwise)."""
        return True

    def unsupported(self, w: Workload, device: torch.device, dtype: torch.dtype) -> Optional[str]:
        """Why this peer cannot run ``w`` on ``device`` in ``dtype`` (None when it can)."""
        return None

    def prepare(self, w: Workload, device: torch.device, dtype: torch.dtype) -> AttnFn:
        """A callable ``fn(q, k, v) -> out`` for ``w``; masks are built here, once."""
        raise NotImplementedError

    def note(self, w: Workload, device: torch.device, dtype: torch.dtype) -> str:
        """Which path the peer takes (shown in the report), or ''."""
        return ""

    def extra_bytes(self, w: Workload, dtype: torch.dtype, pass_: str) -> int:
        """Rough memory this peer needs beyond the inputs (used to skip hopeless sizes on a CPU); 0: small."""
        return 0

    def same_kernel_as(self, w: Workload, device: torch.device, dtype: torch.dtype, pass_: str) -> Optional[str]:
        """The name of another peer whose kernel this one runs on ``w``'s ``pass_`` (None: its own)."""
        return None

    def compile_key(self, w: Workload, device: torch.device, dtype: torch.dtype, pass_: str) -> Optional[tuple]:
        """The kernel variant whose first call compiles on ``w``'s ``pass_``: ``(what compiles, variant...)``, the
        same for calls sharing compiled code (:mod:`longattn.bench.first_calls`); None when nothing compiles."""
        return None


# ----------------------------------------------------------------------------------------------------------- masks
def pair_mask(w: Workload, device: torch.device) -> Optional[Tensor]:
    """The bool mask of allowed pairs: ``(N, N)``, or ``(H, N, N)`` for dilated (offsets differ by head); None
    for dense. Cached on the workload per device."""
    key = f"pair_mask:{device}"
    if key in w.cache:
        return w.cache[key]
    n = w.n
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    mask: Optional[Tensor]
    if w.kind == "dense":
        mask = None
    elif w.kind == "causal":
        mask = j <= i
    elif w.kind == "window":
        mask = (j <= i) & (j >= i - w.window[0])
    elif w.kind == "block_sparse":
        bs = w.block_size
        mask = w.block_mask[0, 0].to(device)[i // bs, j // bs]
    elif w.kind == "dilated":
        mask = dilated_multiplicity(w, device) > 0
    else:  # pragma: no cover - guarded by make_workload
        raise ValueError(f"unknown workload {w.kind!r}")
    w.cache[key] = mask
    return mask


def dilated_multiplicity(w: Workload, device: torch.device) -> Tensor:
    """int8 ``(H, N, N)``: how many branches of the dilated workload ``w`` compute each pair. The log-sum-exp merge
    counts a key that ``c`` branches give a query ``c`` times, so attention over the pairs with a score bias
    ``log(c)`` equals dilated attention."""
    n = w.n
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    heads = torch.arange(w.heads, device=device)[:, None, None]
    count = torch.zeros(w.heads, n, n, dtype=torch.int8, device=device)
    for seg, r in zip(w.segments, w.rates):
        seg = min(seg, n)
        off = heads % r
        count += ((i // seg) == (j // seg)) & ((i % seg) % r == off) & ((j % seg) % r == off)
    return count


def _heads_first(*xs: Tensor):
    return tuple(x.transpose(1, 2) for x in xs)


def _score_bytes(w: Workload, dtype: torch.dtype, pass_: str) -> int:
    elt = torch.empty((), dtype=dtype).element_size()
    per = w.batch * w.heads * w.n * w.n * (2 * elt + 4)  # scores, probabilities, float32 softmax
    return per * (2 if pass_ == "fwd_bwd" else 1)


# ----------------------------------------------------------------------------------------------------------- peers
AUTO_PEERS = {"sdpa": "sdpa", "triton": "longattn-triton", "fa4": "fa4"}  # auto's kernel -> the peer running it


class LongAttn(Peer):
    name = "longattn"
    description = "longattn, backend='auto'"
    backend = "auto"

    def prepare(self, w, device, dtype):
        import longattn

        be = self.backend
        if w.kind in ("dense", "causal", "window"):
            return lambda q, k, v: longattn.flash_attention(q, k, v, causal=w.causal, window=w.window, backend=be)
        if w.kind == "dilated":
            return lambda q, k, v: longattn.dilated_attention(
                q, k, v, segment_lengths=w.segments, dilation_rates=w.rates, causal=w.causal, backend=be)
        from longattn.patterns import BlockSparsePattern

        # Like FlexAttention's BlockMask (built once, outside the timing): the pattern converts to block lists once.
        pattern = BlockSparsePattern(w.block_mask.to(device), w.block_size, seq_lens=(w.n, w.n))
        return lambda q, k, v: longattn.block_sparse_attention(q, k, v, block_mask=pattern, backend=be)

    def kernel(self, w: Workload, device: torch.device, dtype: torch.dtype, pass_: str = "fwd") -> str:
        """Which backend ``auto`` runs on ``w``'s ``pass_``: ``"sdpa"``, ``"fa4"``, ``"triton"`` or ``"torch"`` (its
        plan, :func:`longattn.explain`, on probe tensors of ``w``'s length and head dim; no kernel runs)."""
        import longattn

        # finite values on a CPU, where a non-finite q or k keeps auto off SDPA (no values read elsewhere)
        make = torch.zeros if device.type == "cpu" else torch.empty
        probe = make(1, w.n, 1, w.head_dim, device=device, dtype=dtype).requires_grad_(pass_ == "fwd_bwd")
        fn = self.prepare(w, device, dtype)
        return longattn.explain(fn, probe, probe, probe).backend

    def note(self, w, device, dtype):
        """Which kernel ``auto`` runs on this workload's forward (``sdpa``, ``triton`` or ``torch backend``)."""
        choice = self.kernel(w, device, dtype)
        return "torch backend" if choice == "torch" else choice

    def same_kernel_as(self, w, device, dtype, pass_):
        """``sdpa`` where ``auto`` runs SDPA's default kernel, ``longattn-triton`` where it runs our kernels."""
        return AUTO_PEERS.get(self.kernel(w, device, dtype, pass_))

    def compile_key(self, w, device, dtype, pass_):
        """Our Triton/Gluon kernels for ``w``'s pattern, pass, head dim and dtype, where they run (a GPU)."""
        kernel = self.kernel(w, device, dtype, pass_) if device.type == "cuda" else None
        if kernel not in ("triton", "fa4"):
            return None
        from longattn.bench.first_calls import FA4, TRITON

        return ({"triton": TRITON, "fa4": FA4}[kernel], w.kind, pass_, w.head_dim, str(dtype))


class LongAttnTriton(LongAttn):
    name = "longattn-triton"
    description = "longattn, backend='triton' (our kernels forced)"
    backend = "triton"

    def unsupported(self, w, device, dtype):
        from longattn.backends.triton import support

        probe = torch.empty(1, 1, 1, w.head_dim, device=device, dtype=dtype)
        block = (w.block_size, w.block_size) if w.kind == "block_sparse" else None
        if device.type != "cuda":
            return "GPU only (on a CPU the kernels run only in Triton's interpreter)"
        return support.unsupported_reason(probe, block)

    def note(self, w, device, dtype):
        return "triton"

    def same_kernel_as(self, w, device, dtype, pass_):
        return None

    def kernel(self, w, device, dtype, pass_="fwd"):
        return "triton"


class SdpaDefault(Peer):
    """``scaled_dot_product_attention`` with no backend chosen: what a user gets by default."""

    name = "sdpa"
    description = "torch SDPA, no backend chosen (the default)"

    def applies(self, kind):
        return kind in ("dense", "causal")  # a mask would take SDPA off its fused kernels

    def prepare(self, w, device, dtype):
        from longattn.backends import sdpa as sdpa_backend

        return lambda q, k, v: sdpa_backend.flash_attention(q, k, v, causal=w.causal)


class Sdpa(Peer):
    """``scaled_dot_product_attention`` restricted to one backend."""

    _ENUM = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
             "math": "MATH"}

    def __init__(self, which: str):
        self.which = which
        self.name = f"sdpa-{which}"
        self.description = f"torch SDPA, {which} backend only"

    def _backend(self):
        try:
            from torch.nn.attention import SDPBackend
        except ImportError:
            return None
        return getattr(SDPBackend, self._ENUM[self.which], None)

    def applies(self, kind):
        return kind != "dilated"  # the composition peer runs SDPA per dilated branch

    def unsupported(self, w, device, dtype):
        if self._backend() is None:
            return f"SDPBackend.{self._ENUM[self.which]} not in torch {torch.__version__}"
        if self.which == "flash" and w.kind in ("window", "block_sparse"):
            return "flash backend takes no attention mask"
        return None

    def prepare(self, w, device, dtype):
        from torch.nn.attention import sdpa_kernel

        backend = self._backend()
        mask = pair_mask(w, device) if w.kind in ("window", "block_sparse") else None
        is_causal = w.causal and mask is None

        def fn(q, k, v):
            qh, kh, vh = _heads_first(q, k, v)
            with sdpa_kernel([backend]):
                try:
                    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=is_causal)
                except RuntimeError as err:
                    if "No available kernel" in str(err) or "No viable backend" in str(err):
                        raise Unsupported(f"no {self.which} kernel for these inputs on {device.type}") from None
                    raise
            return out.transpose(1, 2)

        return fn

    def extra_bytes(self, w, dtype, pass_):
        return _score_bytes(w, dtype, pass_) if self.which == "math" else 0


class Flex(Peer):
    name = "flex"
    description = "FlexAttention compiled with torch.compile"
    compiles = True
    _compiled = None

    def unsupported(self, w, device, dtype):
        if device.type != "cuda":
            return "GPU only here (compiling for the CPU takes minutes)"
        try:
            import torch.nn.attention.flex_attention  # noqa: F401
        except ImportError:
            return f"needs torch >= 2.5 (have {torch.__version__})"
        return None

    def compile_key(self, w, device, dtype, pass_):
        """One graph per shape, pattern and pass."""
        from longattn.bench.first_calls import FLEX

        return (FLEX, w.kind, w.n, w.batch, w.heads, w.head_dim, pass_, str(dtype))

    @classmethod
    def _compiled_flex(cls):
        if cls._compiled is None:
            import torch._dynamo
            from torch.nn.attention.flex_attention import flex_attention

            # one graph per shape, mask and grad mode: allow enough recompiles for a whole benchmark run
            for opt in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                        "accumulated_recompile_limit"):
                if hasattr(torch._dynamo.config, opt):
                    setattr(torch._dynamo.config, opt, 512)
            cls._compiled = torch.compile(flex_attention, dynamic=False)
        return cls._compiled

    @staticmethod
    def mask_mod(w: Workload, device: torch.device):
        """The FlexAttention ``mask_mod`` of ``w`` (None for dense)."""
        if w.kind == "dense":
            return None
        if w.kind == "causal":
            return lambda b, h, i, j: j <= i
        if w.kind == "window":
            left = w.window[0]
            return lambda b, h, i, j: (j <= i) & (i - j <= left)
        if w.kind == "block_sparse":
            blocks, bs = w.block_mask[0, 0].to(device), w.block_size
            return lambda b, h, i, j: blocks[i // bs, j // bs]
        branches = [(min(s, w.n), r) for s, r in zip(w.segments, w.rates)]

        def dilated(b, h, i, j):
            allowed = None
            for seg, r in branches:
                o = h % r
                term = ((i // seg) == (j // seg)) & ((i % seg) % r == o) & ((j % seg) % r == o)
                allowed = term if allowed is None else allowed | term
            return allowed

        return dilated

    @staticmethod
    def score_mod(w: Workload):
        """For dilated: add ``log(c)``, ``c`` the number of branches computing the pair (see
        :func:`dilated_multiplicity`); None otherwise."""
        if w.kind != "dilated":
            return None
        branches = [(min(s, w.n), r) for s, r in zip(w.segments, w.rates)]

        def multiplicity(score, b, h, i, j):
            count = None
            for seg, r in branches:
                o = h % r
                term = (((i // seg) == (j // seg)) & ((i % seg) % r == o) & ((j % seg) % r == o)).to(score.dtype)
                count = term if count is None else count + term
            return score + torch.log(count)

        return multiplicity

    def prepare(self, w, device, dtype):
        from torch.nn.attention.flex_attention import create_block_mask

        key = f"flex_mask:{device}"
        if key not in w.cache:
            mod = self.mask_mod(w, device)
            block_mask = None
            if mod is not None:
                heads = w.heads if w.kind == "dilated" else None
                try:
                    block_mask = create_block_mask(mod, None, heads, w.n, w.n, device=device, _compile=True)
                except TypeError:
                    block_mask = create_block_mask(mod, None, heads, w.n, w.n, device=device)
            w.cache[key] = block_mask
        block_mask = w.cache[key]
        flex = self._compiled_flex()
        score_mod = self.score_mod(w)

        def fn(q, k, v):
            qh, kh, vh = _heads_first(q, k, v)
            return flex(qh, kh, vh, score_mod=score_mod, block_mask=block_mask).transpose(1, 2)

        return fn


class Materialized(Peer):
    name = "materialized"
    description = "N x N scores, mask, softmax (float32), matmul"

    def prepare(self, w, device, dtype):
        mask, bias = None, None
        if w.kind == "dilated":  # pairs two branches compute count twice in the merge: bias log(multiplicity)
            key = f"bias:{device}:{dtype}"
            if key not in w.cache:
                w.cache[key] = dilated_multiplicity(w, device).to(dtype).log()
            bias = w.cache[key]
        else:
            mask = pair_mask(w, device)
        scale = w.head_dim ** -0.5
        soft_dtype = torch.promote_types(dtype, torch.float32)

        def fn(q, k, v):
            qh, kh, vh = _heads_first(q, k, v)
            scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
            if bias is not None:
                scores = scores + bias
            elif mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=soft_dtype).to(q.dtype)
            return torch.matmul(probs, vh).transpose(1, 2)

        return fn

    def extra_bytes(self, w, dtype, pass_):
        return _score_bytes(w, dtype, pass_)


class Composition(Peer):
    name = "composition"
    description = "dilated: slice each branch, attention with log-sum-exp, scatter back, merge by log-sum-exp"

    def applies(self, kind):
        return kind == "dilated"

    def prepare(self, w, device, dtype):
        from longattn.bench.composition import dilated_composition

        kernel = self.note(w, device, dtype)
        return lambda q, k, v: dilated_composition(q, k, v, w.segments, w.rates, causal=w.causal, kernel=kernel)

    def note(self, w, device, dtype):
        from longattn.bench.composition import default_kernel

        return default_kernel(device, dtype)


class Fa4(Peer):
    """FlashAttention-4 as a user who installed it calls it (``flash_attn.cute.flash_attn_func``)."""

    name = "fa4"
    description = "FlashAttention-4 (flash-attn-4, CuTe DSL), where installed"
    compiles = True

    def applies(self, kind):
        return kind in ("dense", "causal", "window")

    def unsupported(self, w, device, dtype):
        from longattn.backends import fa4

        probe = torch.empty(1, 1, 1, w.head_dim, device=device, dtype=dtype)
        if device.type != "cuda":
            return "GPU only"
        why = fa4.device_reason(probe)
        if why is None and dtype not in fa4.DTYPES:
            why = f"dtype {dtype}"
        return why

    def prepare(self, w, device, dtype):
        from flash_attn.cute import flash_attn_func

        window = tuple(None if x < 0 else x for x in w.window)
        return lambda q, k, v: flash_attn_func(q, k, v, causal=w.causal, window_size=window)[0]

    def compile_key(self, w, device, dtype, pass_):
        from longattn.bench.first_calls import FA4

        return (FA4, w.kind, pass_, w.head_dim, str(dtype))


def all_peers() -> List[Peer]:
    """Every implementation, longattn first."""
    return [LongAttn(), LongAttnTriton(), SdpaDefault(), Sdpa("flash"), Sdpa("cudnn"), Sdpa("efficient"),
            Sdpa("math"), Flex(), Fa4(), Materialized(), Composition()]


PEER_NAMES = tuple(p.name for p in all_peers())
