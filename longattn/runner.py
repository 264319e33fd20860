"""The one place a described call meets a backend.

Every public entry point reads the same way: check the arguments, describe the call once
(:class:`longattn.call.AttentionCall`), then :func:`run` it (or :func:`decode` it, for a KV-cache call). This
module is where the rest happens, once for every entry point: zero-size calls get their zeros here (no backend sees
them), the backend is chosen here (:func:`longattn.backends.dispatch.choose`, which orders the candidates), and
the chosen backend's ``attention`` or ``decode`` runs the call. FP8 inputs take the same road: their call carries
a :class:`~longattn.call.Descale` and an output dtype, and SDPA is never a candidate for them.

:func:`explain` runs a public function on the planning-only path: the function checks and describes the call as
always, and where :func:`run` or :func:`decode` would run it, they return its :class:`~longattn.backends.plan.Plan`
instead (the backend, and each pass's kernel with the candidates not chosen and why).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import replace
from types import ModuleType
from typing import Callable, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from longattn import _autocast
from longattn._autograd import transform_reason
from longattn._empty import empty_result, is_empty
from longattn._validation import check_backend
from longattn.backends import backend_module
from longattn.backends import dispatch
from longattn.backends import fa4 as fa4_backend
from longattn.backends import sdpa as sdpa_backend
from longattn.backends.device import facts as device_facts
from longattn.backends.plan import Kept, Plan, Rejected
from longattn.backends.routing import current as current_routing
from longattn.backends.triton import support as triton_support
from longattn.call import AttentionCall, add_sinks

Result = Tuple[Tensor, Optional[Tensor]]  # (out, lse); lse is None where SDPA ran (it gives none)


def check_call(call: AttentionCall, fn: str) -> None:
    """``ValueError`` for a call that asks what no backend computes: a dilated call (``branches``) with score
    modifications (``softcap``, ``alibi``, ``sinks``; dilated attention has none, and a backend's dilated path would
    leave them out). Every call passes here: :func:`run`, :func:`choose` (which every attention call and explicit
    pass goes through) and :func:`decode` (KV-cache calls)."""
    if call.branches:
        mods = [name for name, on in (("softcap", bool(call.softcap)), ("alibi", call.alibi is not None),
                                      ("sinks", call.sinks is not None)) if on]
        if mods:
            raise ValueError(f"{fn}: dilated attention takes no score modifications: {', '.join(mods)} must be off "
                             f"(softcap 0, alibi and sinks None) in a call with dilated branches")


def fa4_call(q: Tensor, k: Optional[Tensor], v: Optional[Tensor], call: AttentionCall,
             ) -> Tuple[Optional[dispatch.Fa4Call], Optional[str]]:
    """``(the call described for the dispatch where FlashAttention-4 computes it, else None; why not)``. ``k``
    None: an explicit pass without autograd (the ring's blocks), which FA4's backend does not offer."""
    if k is None and call.cache is None:
        return None, "explicit forward or backward passes (FA4's backend runs whole calls with autograd)"
    why = fa4_backend.unsupported_reason(q, call)
    if why is not None:
        return None, why
    keys = call.seqlens.max_k if call.seqlens is not None else k.shape[1]
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad)
                                              or (v is not None and v.requires_grad))
    return dispatch.Fa4Call(fa4_backend.kind_of(call), keys, needs_grad), None


def choose(backend: str, q: Tensor, call: AttentionCall, *, fn: str,
           sdpa: Optional[dispatch.SdpaCall] = None, k: Optional[Tensor] = None, v: Optional[Tensor] = None) -> str:
    """The implementation that runs ``call`` for ``backend`` (``"auto"``, ``"triton"``, ``"torch"`` or ``"fa4"``):
    ``"sdpa"``, ``"fa4"``, ``"triton"`` or ``"torch"``. ``sdpa`` describes the call where PyTorch's SDPA computes it
    exactly (a deterministic call that needs gradients never runs there); ``k``, ``v`` given: a whole call with
    autograd, which FlashAttention-4 may run (:func:`fa4_call`). Refuses a call :func:`check_call` refuses."""
    check_call(call, fn)
    return _choose(backend, q, call, fn, sdpa, k, v)


def _choose(backend: str, q: Tensor, call: AttentionCall, fn: str, sdpa: Optional[dispatch.SdpaCall],
            k: Optional[Tensor], v: Optional[Tensor]) -> str:
    """:func:`choose` for a call :func:`check_call` has passed: made once per :func:`choice_key` where the call has
    one (the choice reads only what the key holds), every time elsewhere. Inputs under a ``torch.func`` transform or
    with forward-mode tangents (:func:`longattn._autograd.transform_reason`) run the PyTorch backend, whose
    operations PyTorch differentiates in every mode: ``"auto"`` chooses it, another backend is a ``ValueError``
    naming it."""
    why = transform_reason(q, k, v, call.sinks, call.alibi)
    if why is not None:
        check_backend(backend, fn)
        if backend not in ("auto", "torch"):
            raise ValueError(f"{fn}: backend={backend!r} cannot run: {why}, which its kernels do not support; "
                             f"backend='torch' (or 'auto') computes it")
        return "torch"
    key = choice_key(backend, q, call, sdpa, k, v)
    if key is None:
        return _choose_now(backend, q, call, fn, sdpa, k, v)
    return CHOICES.get(key, lambda: _choose_now(backend, q, call, fn, sdpa, k, v))


CHOICES = Kept(1024)  # the backend chosen, by choice_key


def choice_key(backend: str, q: Tensor, call: AttentionCall, sdpa: Optional[dispatch.SdpaCall],
               k: Optional[Tensor] = None, v: Optional[Tensor] = None) -> Optional[tuple]:
    """What the choice of a backend for a call on CUDA tensors reads (:func:`_choose_now`): the backend asked for,
    the device, dtype and head dim, the keys, whether the call is an explicit pass (no ``k``) and builds an autograd
    graph, the band, ``deterministic``, the score modifications, a packed batch, the output dtype, and SDPA's
    description of the call. None (choose every time) off CUDA (the interpreter and the checks of non-finite CPU
    inputs read more), under ``torch.compile`` tracing, and for dilated, block-sparse, KV-cache, FP8 and ALiBi calls.
    Device facts (capability, whether FA4 imports) do not change in a process; routing settings do not enter the
    choice of a backend, only its plans."""
    if (not q.is_cuda or call.branches or call.blocks is not None or call.cache is not None
            or call.descale is not None or call.alibi is not None or torch.compiler.is_compiling()):
        return None
    grad = torch.is_grad_enabled() and (q.requires_grad or (k is not None and (k.requires_grad or v.requires_grad)))
    s = call.seqlens
    keys = s.max_k if s is not None else None if k is None else k.shape[1]
    return (backend, q.device, q.dtype, q.shape[-1], keys, k is None, grad, call.causal, call.window,
            call.deterministic, call.softcap, call.sinks is not None, s is not None, call.out_dtype, sdpa)


def _choose_now(backend: str, q: Tensor, call: AttentionCall, fn: str, sdpa: Optional[dispatch.SdpaCall],
                k: Optional[Tensor], v: Optional[Tensor]) -> str:
    block_size = call.blocks.block_size if call.blocks is not None else None
    plain = call.descale is None and call.sinks is None and not call.softcap and call.alibi is None
    fa4, fa4_reason = fa4_call(q, k, v, call) if backend in ("auto", "fa4") else (None, None)
    return dispatch.choose(backend, q, fn=fn, block_size=block_size, sdpa=sdpa if plain else None,
                           triton_reason=triton_support.call_unsupported_reason(call),
                           deterministic=call.deterministic, fa4=fa4, fa4_reason=fa4_reason)


class Known(NamedTuple):
    """What a public function's checks and choice gave for one signature of plain calls on CUDA tensors: the
    implementation that ran and the call it ran (:func:`known_key`); ``module``, the backend's module where its
    ``attention`` runs such a call as it is (not empty, no sinks to add after it: both fixed by the signature), else
    None (:func:`run_on` runs it)."""

    impl: str
    call: AttentionCall
    module: Optional[ModuleType] = None

    @staticmethod
    def of(impl: str, q: Tensor, k: Tensor, call: AttentionCall) -> "Known":
        """The :class:`Known` of ``call`` on ``impl`` for inputs shaped as ``q`` and ``k``."""
        module = None if is_empty(q, k) else backend_module(impl)
        if module is not None and _sinks_after(module, call, "ATTENTION_SINKS")[1] is not None:
            module = None
        return Known(impl, call, module)


KNOWN = Kept(1024)  # Known, by known_key
_OPTION_TYPES = (bool, int, float, str, type(None))  # (a known call's options; tuples of two ints besides)


def known_key(fn: str, q, k, v, options: tuple, deterministic_mode: bool) -> Optional[tuple]:
    """The signature of a call of public function ``fn`` without score modifications, FP8 or packed batches, under
    which its checks, its description (:class:`AttentionCall`) and its backend's choice give the same answer every
    time, so that they run once (:func:`run` keeps their result in :data:`KNOWN`) and later calls go straight to the
    backend (:func:`run_known`). ``options``: the function's other arguments, each a ``bool``, ``int``, ``float``,
    ``str``, None or a tuple of two ints (their exact types, which the checks read: ``causal=1`` is refused, not
    taken as ``True``). The key holds the three tensors' shapes, dtypes, devices and whether each builds an autograd
    graph, grad mode and ``deterministic_mode`` (PyTorch's, read once by the caller, which describes the call with
    that same reading: another thread may switch it between two readings). None (check and choose as always) for
    anything else: tensors other than plain CUDA tensors (subclasses, nested), other option types, autocast on,
    ``torch.compile`` tracing, :func:`explain`, and inputs under a ``torch.func`` transform or with forward-mode
    tangents (:func:`_choose` runs those on the PyTorch backend)."""
    if (type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor or not q.is_cuda or q.is_nested
            or k.is_nested or v.is_nested):
        return None
    kinds = []  # (in the key: 1 == True, but a check that refuses one takes the other)
    for o in options:
        t = type(o)
        if t is tuple:
            if len(o) != 2 or type(o[0]) is not int or type(o[1]) is not int:
                return None
        elif t not in _OPTION_TYPES:
            return None
        kinds.append(t)
    if (torch.compiler.is_compiling() or _PLANNING.get() or _autocast.enabled("cuda")  # (q's device type)
            or transform_reason(q, k, v) is not None):
        return None
    grad = torch.is_grad_enabled()
    return (fn, options, tuple(kinds), q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device,
            v.device, grad, q.requires_grad, k.requires_grad, v.requires_grad, deterministic_mode)


def run_known(known: Known, q: Tensor, k: Tensor, v: Tensor) -> Result:
    """A call whose :func:`known_key` was kept: ``known.call`` on ``known.impl`` (:func:`run_on`), unchecked."""
    if known.module is None:
        return run_on(known.impl, q, k, v, known.call)
    return known.module.attention(q, k, v, known.call)


def _sinks_after(module, call: AttentionCall, adds_them: str) -> Tuple[AttentionCall, Optional[Tensor]]:
    """``(the call module runs, the sinks to add to its result)``: the sinks stay in the call where the module adds
    them itself (its flag ``adds_them`` is true), else they leave it and :func:`longattn.call.add_sinks` adds them
    after it (``module`` None: no backend runs)."""
    if call.sinks is None or getattr(module, adds_them, False):
        return call, None
    return replace(call, sinks=None), call.sinks


def run_on(impl: str, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Result:
    """``call`` on ``impl`` (from :func:`choose`), with autograd: ``(out, lse)``; zeros and ``-inf`` for a call
    with nothing to compute. Attention sinks (``call.sinks``) are added here to the backend's result (by
    :func:`longattn.call.add_sinks`), unless the backend adds them itself (its ``ATTENTION_SINKS``)."""
    module = None if is_empty(q, k) else backend_module(impl)
    call, sinks = _sinks_after(module, call, "ATTENTION_SINKS")
    if module is None:
        out, lse = empty_result(q, k, v, call.out_dtype)
    else:
        out, lse = module.attention(q, k, v, call)
    return (out, lse) if sinks is None else add_sinks(out, lse, sinks)


_PLANNING: contextvars.ContextVar[bool] = contextvars.ContextVar("longattn_planning", default=False)


class _Planned(Exception):
    """How a planning-only call (:func:`explain`) returns its plan from inside the public function."""

    def __init__(self, plan: Plan):
        super().__init__("planned")
        self.plan = plan


def _rejected_backends(backend: str, impl: str, q: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                       call: AttentionCall, sdpa: Optional[dispatch.SdpaCall]) -> Tuple[Rejected, ...]:
    """The backends ordered before ``impl`` for this call (SDPA, FlashAttention-4, Triton, PyTorch) and why each
    was not chosen."""
    order = ("sdpa", "fa4", "triton", "torch")
    plain = call.descale is None and call.sinks is None and not call.softcap and call.alibi is None
    block_size = call.blocks.block_size if call.blocks is not None else None
    out = []
    empty = k is not None and is_empty(q, k)
    for cand in order[:order.index(impl)]:
        if empty:
            why = "a zero-size call (no batch, query, query head or key): its zeros need no kernel"
        elif backend != "auto":
            why = f"backend={backend!r}"
        elif cand == "fa4":
            why = fa4_call(q, k, v, call)[1] or "the dispatch table measured another backend faster here"
        elif cand == "sdpa" and k is None and call.cache is None:
            why = "explicit forward or backward passes (SDPA runs whole calls)"
        elif cand == "sdpa":
            why = (_sdpa_reason(q, k, call) if sdpa is None or not plain
                   else "a deterministic call that needs gradients" if call.deterministic and sdpa.needs_grad
                   else "the dispatch table measured our kernels faster here")
        else:
            why = (triton_support.call_unsupported_reason(call)
                   or triton_support.unsupported_reason(q, block_size, call.cache is not None and q.dtype != (
                       call.cache.k_cache.dtype))
                   or ("not a CUDA tensor (the interpreter is never an automatic choice)" if not q.is_cuda
                       else "the dispatch table measured SDPA's default faster here"))
        out.append(Rejected(cand, why))
    return tuple(out)


def _sdpa_reason(q: Tensor, k: Tensor, call: AttentionCall) -> str:
    """Why PyTorch's SDPA does not run ``call``: the kinds of call it has no form for (a KV cache, a packed batch,
    block-sparse or dilated attention, FP8 inputs, sinks, soft-capping, ALiBi), or for a plain dense call what
    :func:`longattn.backends.sdpa.unsupported_reason` names (a window, the log-sum-exp, ...)."""
    kinds = [name for name, present in (
        ("a KV cache", call.cache is not None), ("a packed batch", call.seqlens is not None),
        ("block-sparse attention", call.blocks is not None), ("dilated attention", bool(call.branches)),
        ("FP8 inputs", call.descale is not None), ("attention sinks", call.sinks is not None),
        ("soft-capping", bool(call.softcap)), ("ALiBi", call.alibi is not None)) if present]
    if not kinds:
        reason = sdpa_backend.unsupported_reason(q, k, causal=call.causal, window=call.window,
                                                 need_lse=call.need_lse)
        kinds = [reason] if reason is not None else []
    return "PyTorch's SDPA does not compute this call exactly" + (f": {', '.join(kinds)}" if kinds else "")


def _plan(impl: str, q: Tensor, k: Optional[Tensor], v: Optional[Tensor], call: AttentionCall, backend: str,
          sdpa: Optional[dispatch.SdpaCall]) -> Plan:
    """The plan of ``call`` on ``impl``, without running it."""
    rejected = _rejected_backends(backend, impl, q, k, v, call, sdpa)
    facts = current_routing().device or device_facts(q.device)
    if impl != "triton" or (k is not None and is_empty(q, k)):
        return Plan(impl, (), rejected, str(q.device))
    from longattn.backends.triton import entry  # (imports Triton, which the other backends do without)

    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v))
    return Plan(impl, entry.plan(q, k, v, call, needs_grad), rejected, str(facts))


def _explicit_plan(impl: str, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall, backend: str,
                   backward: Optional[tuple] = None) -> Plan:
    """The plan of an explicit pass of :mod:`longattn.ops` without running it: its forward, or with ``backward``
    ``= (do, grad_dtype, has_dlse)`` its backward, as :func:`forward` and :func:`backward` would run them."""
    rejected = _rejected_backends(backend, impl, q, None, None, call, None)
    if impl != "triton" or is_empty(q, k):
        return Plan(impl, (), rejected, str(q.device))
    from longattn.backends.triton import entry  # (imports Triton, which the other backends do without)

    facts = current_routing().device or device_facts(q.device)
    passes = entry.plan(q, k, v, call, False) if backward is None else entry.plan_backward(q, k, v, call, *backward)
    return Plan(impl, passes, rejected, str(facts))


def _planning() -> bool:
    """Whether this call only plans (under :func:`explain`; dynamo traces no ContextVar)."""
    return not torch.compiler.is_compiling() and _PLANNING.get()


def refuse_planning(fn: str) -> None:
    """Where a collective call across ranks begins: under :func:`explain`, ``ValueError`` naming ``fn`` before any
    communication (a plan of one rank's block would describe one block, and a pass left half-way would leave its
    peers waiting)."""
    if _planning():
        raise ValueError(f"explain: {fn} is a collective call across ranks, which explain does not plan; explain "
                         "the call one rank's blocks make (longattn.flash_attention, longattn.ops) instead")


def plan_nothing(q: Tensor, what: str) -> None:
    """Where a call has nothing to compute and returns without a backend (``what`` says why): under
    :func:`explain`, its plan (the PyTorch backend's zeros, no kernel), before anything is written."""
    if _planning():
        why = f"a zero-size call ({what}): its zeros need no kernel"
        raise _Planned(Plan("torch", (), tuple(Rejected(b, why) for b in ("sdpa", "fa4", "triton")), str(q.device)))


def explain(fn: Callable, *args, **kwargs) -> Plan:
    """What ``fn(*args, **kwargs)`` would run, for any public attention function (``flash_attention``, the
    dilated, block-sparse, packed and KV-cache ones, and :mod:`longattn.ops`' explicit passes; not the collective
    calls of :mod:`longattn.distributed`, which it refuses): its :class:`~longattn.backends.plan.Plan` (the backend
    and the ones not chosen with why; for the Triton backend each pass's kernel and tiles, and the kernels not
    chosen with why), without running an attention kernel (a block-sparse call planned on the Triton backend has its
    block mask turned into block lists first, as a real call would, a kernel on a GPU; a given pattern keeps them
    for later calls). The function checks its arguments and describes the call as always (its
    errors are raised as always); ``str(plan)`` reads as a list. Where the inputs need gradients the plan holds the
    backward's passes too. Under ``longattn.routing(...)`` it plans with those settings (made-up device facts
    included: with ``backend="triton"`` and the Triton interpreter on (``TRITON_INTERPRET=1``), as the CPU tests
    run, ``routing(device=Device(capability=(9, 0)))`` plans the Triton backend's passes as on an sm_90 GPU; the
    choice among backends (``"auto"``) still follows the tensors' own device).

    ``fn`` is called and stopped at its first attention call: a public function has only checked its arguments by
    then, but a wrapper (a lambda around a public function, a module's method) runs its own code before that for
    real, side effects included (a module's ``prefill`` writes its cache first). A callable that makes no
    attention call runs to its end, then ``ValueError``. A function compiled by ``torch.compile`` (or one that calls
    one) is planned as it runs eagerly (``torch.compiler.set_stance("force_eager")``, PyTorch 2.6 and newer; before,
    the compiled call runs for real and explain ends in the ``ValueError``: tracing reads no planning flag); compiled,
    FlashAttention-4's calls run our kernels instead (FA4 runs eagerly only)."""
    token = _PLANNING.set(True)
    try:
        with _eager():
            fn(*args, **kwargs)
    except _Planned as planned:
        return planned.plan
    finally:
        _PLANNING.reset(token)
    raise ValueError(f"explain: {getattr(fn, '__name__', fn)!r} ran no attention call (not a public attention "
                     "function? a torch.compile'd one plans only with PyTorch 2.6 or newer)")


def _eager():
    """A context in which ``torch.compile``'d functions run eagerly (their attention calls then reach the planning
    path), or none where this PyTorch cannot say so (before 2.6)."""
    stance = getattr(torch.compiler, "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


def run(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall, *, backend: str, fn: str,
        sdpa: Optional[dispatch.SdpaCall] = None,
        prepare: Optional[Callable[[str, AttentionCall], AttentionCall]] = None, known: Optional[tuple] = None,
        ) -> Result:
    """Choose the backend and run ``call`` on it (:func:`choose`, :func:`run_on`). ``prepare(impl, call)`` gives
    the call in the chosen backend's form where it needs one (a block-sparse call's block lists for the Triton
    kernels). ``known``: the call's :func:`known_key` (not None), under which the choice is kept in :data:`KNOWN`
    where the choice itself is kept (:func:`choice_key`)."""
    check_call(call, fn)  # (also for an empty call, which runs no backend)
    impl = "torch" if is_empty(q, k) else _choose(backend, q, call, fn, sdpa, k, v)
    if _planning():
        raise _Planned(_plan(impl, q, k, v, call if prepare is None else prepare(impl, call), backend, sdpa))
    if known is not None and prepare is None and choice_key(backend, q, call, sdpa, k, v) is not None:
        # (no FP8 call: its Descale holds tensors, and no choice_key)
        KNOWN.get(known, lambda: Known.of(impl, q, k, call))
    with _autocast.off(q):  # the inputs already have the autocast dtype (longattn._autocast)
        return run_on(impl, q, k, v, call if prepare is None else prepare(impl, call))


def forward(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall, *, backend: str, fn: str) -> Tuple[Tensor, Tensor]:
    """``call``'s forward without autograd on the chosen backend (the explicit building blocks of
    :mod:`longattn.ops`): ``(out, lse)``, attention sinks included as in :func:`run_on`."""
    impl = choose(backend, q, call, fn=fn)
    if _planning():
        raise _Planned(_explicit_plan(impl, q, k, v, call, backend))
    with torch.no_grad(), _autocast.off(q):
        module = None if is_empty(q, k) else backend_module(impl)  # (as its plan: no pass, :func:`_explicit_plan`)
        call, sinks = _sinks_after(module, call, "ATTENTION_SINKS")
        out, lse = empty_result(q, k, v, call.out_dtype) if module is None else module.forward(q, k, v, call)
        return (out, lse) if sinks is None else add_sinks(out, lse, sinks)


def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, call: AttentionCall, *,
             backend: str, fn: str, grad_dtype=None, dlse: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """The gradients of ``call`` from the given output and log-sum-exp, without autograd, on the chosen backend:
    ``(dq, dk, dv)``. ``dlse``: a gradient of the log-sum-exp too (or None; the ring's blocks pass the merged
    result's), added to ``dS`` by the backend's backward."""
    impl = choose(backend, q, call, fn=fn)
    if _planning():
        raise _Planned(_explicit_plan(impl, q, k, v, call, backend, (do, grad_dtype, dlse is not None)))
    with torch.no_grad(), _autocast.off(q):
        if is_empty(q, k):  # no query sees a key: zero gradients, no pass (as its plan, :func:`_explicit_plan`)
            return tuple(torch.zeros(x.shape, dtype=grad_dtype or x.dtype, device=x.device) for x in (q, k, v))
        return backend_module(impl).backward(do, q, k, v, o, lse, call, dlse=dlse, grad_dtype=grad_dtype)


def decode(impl: str, q: Tensor, call: AttentionCall, return_lse: bool,
           rejected: Tuple[Rejected, ...] = ()) -> Result:
    """A KV-cache call (``call.cache``) on ``impl`` (chosen once per call signature by the caller, through
    :func:`longattn.backends.dispatch.choose_decode`): ``(out, lse (B, Hq, Nq) or None)``. No autograd. Attention
    sinks are added to the backend's result here, as in :func:`run_on`, unless the backend adds them itself (its
    ``DECODE_SINKS``). ``rejected``: the backends the caller tried before ``impl`` and why (what
    :func:`longattn.explain` reports). Refuses a call :func:`check_call` refuses."""
    check_call(call, "decode")
    if _planning():
        raise _Planned(replace(_plan(impl, q, None, None, call, "auto", None), rejected=rejected))
    with _autocast.off(q):  # a decode call computes in its caches' dtype, as without autocast
        return _decode(backend_module(impl), q, call, return_lse)


def _decode(module, q: Tensor, call: AttentionCall, return_lse: bool) -> Result:
    call, sinks = _sinks_after(module, call, "DECODE_SINKS")
    if sinks is None:
        return module.decode(q, call, return_lse)
    out, lse = module.decode(q, call, True)
    out_sunk, lse = add_sinks(out, lse, sinks)
    out = call.cache.out.copy_(out_sunk) if call.cache.out is not None else out_sunk
    return out, (lse if return_lse else None)
