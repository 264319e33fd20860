"""A bounds check of every memory access the Triton interpreter makes, for the CPU test suite.

On a GPU a kernel that reads or writes past its tensors gives garbage or corrupts a neighbour silently (or faults
much later); in the interpreter the same access reads the process's heap, and crashes a test worker only where
the address happens to be unmapped. Installed by ``tests/conftest.py`` when ``TRITON_INTERPRET=1``, this check makes
every such access fail the test that caused it: each launch records the memory of its tensor arguments (their whole
storages), and each load and store of the interpreted kernel (masked-off lanes excepted) must lie inside one of them.

It wraps two private hooks of Triton's interpreter (``GridExecutor._init_args_hst``, which prepares a launch's
arguments, and ``InterpreterBuilder.create_masked_load`` / ``create_masked_store``, which every ``tl.load`` /
``tl.store`` reaches); where a Triton version lacks them, :func:`install` returns False and changes nothing.
"""
from __future__ import annotations

import numpy as np


class OutOfBounds(AssertionError):
    """A kernel run by the interpreter touched memory outside its tensor arguments."""


def install() -> bool:
    """Wrap the interpreter's hooks (once); False where this Triton has none of the expected names."""
    try:
        from triton.runtime import interpreter as I
        executor, builder = I.GridExecutor, I.InterpreterBuilder
        prepare, load, store = executor._init_args_hst, builder.create_masked_load, builder.create_masked_store
        np_dtype, unwrap = I._get_np_dtype, I._unwrap_tensor
    except (ImportError, AttributeError):
        return False
    if getattr(prepare, "_bounds_checked", False):
        return True
    spans = {"starts": None, "ends": None, "kernel": ""}

    def storages(args) -> list:
        found = []
        for a in args:
            if isinstance(a, (tuple, list)):
                found += storages(a)
            elif hasattr(a, "data_ptr"):
                s = unwrap(a).untyped_storage()
                found.append((s.data_ptr(), s.data_ptr() + s.nbytes()))
            elif hasattr(getattr(a, "base", None), "data_ptr"):  # (a tensor descriptor)
                found += storages([a.base])
        return found

    def checked_prepare(self, args_dev, kwargs):
        args_hst, kwargs_hst = prepare(self, args_dev, kwargs)
        found = sorted(storages(list(args_hst) + list(kwargs_hst.values())))
        spans["starts"] = np.array([s for s, _ in found], dtype=np.uint64)
        spans["ends"] = np.array([e for _, e in found], dtype=np.uint64)
        spans["kernel"] = getattr(self.fn, "__name__", repr(self.fn))
        return args_hst, kwargs_hst

    def check(ptrs, mask, what: str) -> None:
        starts = spans["starts"]
        if starts is None:
            return
        p = np.asarray(ptrs.data)
        if mask is not None:
            p = p[np.broadcast_to(np.asarray(mask.data), p.shape)]
        p = p.astype(np.uint64).ravel()
        if not p.size:
            return
        size = np.uint64(np_dtype(ptrs.get_element_ty()).itemsize)
        i = np.searchsorted(starts, p, side="right").astype(np.int64) - 1
        inside = (i >= 0) & (p + size <= spans["ends"][np.maximum(i, 0)])
        if not inside.all():
            bad = p[~inside]
            raise OutOfBounds(f"kernel {spans['kernel']}: {bad.size} {what}(s) outside its tensor arguments, "
                              f"e.g. at {[hex(int(x)) for x in bad[:3]]}; arguments' memory "
                              f"{[(hex(int(s)), int(e - s)) for s, e in zip(starts, spans['ends'])]}")

    def checked_load(self, ptrs, mask, other, *args, **kwargs):
        check(ptrs, mask, "load")
        return load(self, ptrs, mask, other, *args, **kwargs)

    def checked_store(self, ptrs, value, mask, *args, **kwargs):
        check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *args, **kwargs)

    checked_prepare._bounds_checked = True
    executor._init_args_hst = checked_prepare
    builder.create_masked_load = checked_load
    builder.create_masked_store = checked_store
    return True
