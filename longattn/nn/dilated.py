"""Dilated-attention modules (LongNet): :class:`DilatedAttention` and :class:`MultiheadDilatedAttention`."""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from longattn import _validation as V
from longattn.call import check_head_split
from longattn.nn._checks import check_dropout, check_layer_input, check_module_backend, check_not_a_mask
from longattn.functional import dilated_attention
from longattn.kvcache import check_block_table, dilated_attention_with_kvcache, write_cache
from longattn.varlen import dilated_attention_varlen


class DilatedAttention(nn.Module):
    """:func:`longattn.dilated_attention` with fixed segments and dilation rates, as a module (no parameters).

    Args:
        segment_lengths: segment length of each branch, ints >= 1.
        dilation_rates: dilation rate of each branch, ints >= 1, as many as ``segment_lengths``.
        causal: each selected query sees only the selected keys at or before its own position.
        head_split: split the heads into one contiguous group per branch (see :func:`longattn.dilated_attention`).
        scale: softmax scale, default ``head_dim ** -0.5``.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        deterministic: bitwise-identical gradients from run to run (see :func:`longattn.dilated_attention`).

    ``forward(q, k, v)``: q ``(B, N, Hq, D)``, k and v ``(B, N, Hk, D)`` with ``Hq % Hk == 0``; returns
    ``(B, N, Hq, D)`` in q's dtype. ``forward(q, k, v, cu_seqlens=cu)``: a packed batch, q ``(total, Hq, D)`` and
    k, v ``(total, Hk, D)``, each sequence attended on its own (:func:`longattn.dilated_attention_varlen`).
    ``cu``: host reads: its values are read on the host on every call for a CPU tensor, once per tensor object,
    version counter and data pointer for a CUDA one; a write into the same memory that bypasses the version counter
    (``.data.copy_``, DLPack, a custom kernel, a CUDA graph replay) is not seen (see
    :func:`longattn.remember_host_reads`).
    """

    def __init__(self, segment_lengths: Sequence[int], dilation_rates: Sequence[int], *, causal: bool = False,
                 head_split: bool = False, scale: Optional[float] = None, backend: str = "auto",
                 deterministic: bool = False):
        super().__init__()
        fn = "DilatedAttention"
        self.segment_lengths, self.dilation_rates = V.check_dilated_args(segment_lengths, dilation_rates, fn=fn)
        self.causal = V.check_flag(causal, "causal", fn)
        self.head_split = V.check_flag(head_split, "head_split", fn)
        self.scale = None if scale is None else V.check_scale(scale, 1, fn=fn)
        self.backend = check_module_backend(backend, fn, "dilated attention")
        self.deterministic = V.check_flag(deterministic, "deterministic", fn)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Optional[Tensor] = None) -> Tensor:
        kw = dict(segment_lengths=self.segment_lengths, dilation_rates=self.dilation_rates, causal=self.causal,
                  head_split=self.head_split, scale=self.scale, backend=self.backend,
                  deterministic=self.deterministic)
        if cu_seqlens is not None:
            check_not_a_mask(cu_seqlens, "DilatedAttention", "the module takes no attention mask (its fourth "
                             "argument is not SDPA's attn_mask); padded sequences go packed, with their boundaries")
            return dilated_attention_varlen(q, k, v, cu_seqlens=cu_seqlens, **kw)
        return dilated_attention(q, k, v, **kw)

    def extra_repr(self) -> str:
        return (f"segment_lengths={self.segment_lengths}, dilation_rates={self.dilation_rates}, causal={self.causal}, "
                f"head_split={self.head_split}, scale={self.scale}, backend={self.backend!r}"
                + (", deterministic=True" if self.deterministic else ""))


def rotary_tables(n: int, head_dim: int, base: float, device: torch.device,
                  start: int = 0, dtype: torch.dtype = torch.float32) -> Tuple[Tensor, Tensor]:
    """``cos`` and ``sin`` of the rotary angles ``pos * base ** (-2i / head_dim)``, each ``(n, 1, head_dim // 2)``
    in ``dtype`` (float32, or float64 for float64 inputs) for positions ``start .. start + n - 1``."""
    return rotary_tables_at(torch.arange(start, start + n, device=device), head_dim, base, dtype)


def rotary_tables_at(positions: Tensor, head_dim: int, base: float,
                     dtype: torch.dtype = torch.float32) -> Tuple[Tensor, Tensor]:
    """:func:`rotary_tables` for the positions ``(n,)`` given (a packed batch's restart at each sequence)."""
    inv_freq = base ** (-torch.arange(0, head_dim // 2, device=positions.device, dtype=dtype) * 2.0 / head_dim)
    angles = positions.to(dtype)[:, None] * inv_freq[None, :]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def packed_positions(cu_seqlens: Tensor) -> Tensor:
    """Position of every row of a packed batch inside its own sequence: ``(total,)`` int64."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=int(cu[-1]))
    return torch.arange(int(cu[-1]), device=cu.device) - starts


def _table_dtype(x: Tensor) -> torch.dtype:
    """The rotary tables' dtype for inputs ``x``: float64 for float64, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the pairs ``(x[..., i], x[..., i + D/2])`` of ``x`` ``(B, N, H, D)`` by the angles of ``cos``/``sin``
    ``(N, 1, D/2)`` (rotary position embedding). Computed in float32 (float64 for float64 ``x`` and tables),
    returned in ``x``'s dtype."""
    half = x.shape[-1] // 2
    xf = x.to(torch.promote_types(torch.promote_types(x.dtype, cos.dtype), torch.float32))
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class MultiheadDilatedAttention(nn.Module):
    """LongNet multi-head dilated self-attention: q/k/v projections, :class:`DilatedAttention`, the sub-layer
    LayerNorm (MAGNETO's Sub-LN, as in LongNet), dropout, output projection.

    Args:
        embed_dim: model width ``E``; ``num_heads`` must divide it, ``head_dim = E // num_heads`` at most 256.
        num_heads: query heads ``Hq``.
        segment_lengths, dilation_rates: the branches, as for :func:`longattn.dilated_attention`.
        num_kv_heads: key/value heads ``Hk`` (grouped-query attention), dividing ``num_heads``; default
            ``num_heads``. k and v are projected to ``Hk * head_dim`` features.
        dropout: dropout probability applied (in training) to the attention output just before the output
            projection. The kernels have no dropout of the attention probabilities.
        bias: biases in the four projections.
        layer_norm: LayerNorm over ``E`` of the attention output before the output projection (Sub-LN);
            ``False`` drops it.
        causal: causal dilated attention (for decoders).
        head_split: one head group per branch instead of LongNet's per-head offsets.
        layer_norm_eps: epsilon of the Sub-LN.
        rotary: rotate q and k by their positions ``0 .. N-1`` (rotary position embedding, RoFormer; LongNet uses
            its variant xPos) so that scores depend on relative positions. Needs an even ``head_dim``.
        rotary_base: base of the rotary frequencies.
        init_gain: gain of the Xavier-normal initialisation of ``v_proj`` and ``out_proj`` (q and k use gain 1,
            biases start at 0). MAGNETO uses ``sqrt(log(2 * num_layers))``; :class:`longattn.models.LongNet` sets it.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        deterministic: bitwise-identical gradients of the attention from run to run (see
            :func:`longattn.dilated_attention`).
        device, dtype: of the parameters.

    ``forward(x)``: ``(B, N, E)`` -> ``(B, N, E)``, batch first (``nn.MultiheadAttention``'s ``batch_first=True``;
    a sequence-first ``(N, B, E)`` input cannot be told apart) and the output alone, no attention weights (not
    ``nn.MultiheadAttention``'s ``(output, weights)`` pair: ``out, _ = layer(x)`` would unpack the batch).
    ``forward(x, cu_seqlens=cu)``: a packed batch ``(total, E)``
    -> ``(total, E)``, each sequence attended on its own and its rotary positions restarting at 0.
    ``cu``: host reads: its values are read on the host on every call for a CPU tensor, once per tensor object,
    version counter and data pointer for a CUDA one; a write into the same memory that bypasses the version counter
    (``.data.copy_``, DLPack, a custom kernel, a CUDA graph replay) is not seen (see
    :func:`longattn.remember_host_reads`).
    """

    def __init__(self, embed_dim: int, num_heads: int, segment_lengths: Sequence[int], dilation_rates: Sequence[int],
                 *, num_kv_heads: Optional[int] = None, dropout: float = 0.0, bias: bool = True,
                 layer_norm: bool = True, causal: bool = False, head_split: bool = False,
                 layer_norm_eps: float = 1e-5, rotary: bool = False, rotary_base: float = 10000.0,
                 init_gain: float = 1.0, backend: str = "auto", deterministic: bool = False, device=None,
                 dtype=None):
        super().__init__()
        fn = "MultiheadDilatedAttention"
        for name, val in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if not V._is_int(val) or val < 1:
                raise ValueError(f"{fn}: {name} must be a positive int, got {val!r}")
        if embed_dim % num_heads:
            raise ValueError(f"{fn}: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        head_dim = embed_dim // num_heads
        if head_dim > V.MAX_HEAD_DIM:
            raise ValueError(f"{fn}: head_dim = embed_dim // num_heads = {head_dim} exceeds {V.MAX_HEAD_DIM}; use "
                             f"more heads")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if not V._is_int(num_kv_heads) or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"{fn}: num_kv_heads must be a positive int dividing num_heads ({num_heads}), got "
                             f"{num_kv_heads!r}")
        dropout = check_dropout(dropout, fn)
        for name, val in (("layer_norm_eps", layer_norm_eps), ("rotary_base", rotary_base),
                          ("init_gain", init_gain)):
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val) or val <= 0:
                raise ValueError(f"{fn}: {name} must be a positive finite number, got {val!r}")
        bias, layer_norm, rotary, deterministic = (V.check_flag(val, name, fn) for name, val in (
            ("bias", bias), ("layer_norm", layer_norm), ("rotary", rotary), ("deterministic", deterministic)))
        if rotary and head_dim % 2:
            raise ValueError(f"{fn}: rotary=True needs an even head_dim, got {head_dim}")

        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = embed_dim, num_heads, num_kv_heads, head_dim
        self.dropout = float(dropout)
        self.rotary, self.rotary_base, self.init_gain = rotary, float(rotary_base), float(init_gain)
        # the attention's own arguments, checked here too so that an error names this class
        V.check_dilated_args(segment_lengths, dilation_rates, fn=fn)
        causal, head_split = V.check_flag(causal, "causal", fn), V.check_flag(head_split, "head_split", fn)
        check_module_backend(backend, fn, "dilated attention")
        self.attention = DilatedAttention(segment_lengths, dilation_rates, causal=causal, head_split=head_split,
                                          backend=backend, deterministic=deterministic)
        check_head_split(self.attention.head_split, num_heads, len(self.attention.segment_lengths), fn)
        factory = {"device": device, "dtype": dtype}
        kv_dim = num_kv_heads * head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **factory) if layer_norm else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-normal weights (gain 1 for q and k, ``init_gain`` for v and out), zero biases, unit Sub-LN."""
        for proj, gain in ((self.q_proj, 1.0), (self.k_proj, 1.0), (self.v_proj, self.init_gain),
                           (self.out_proj, self.init_gain)):
            nn.init.xavier_normal_(proj.weight, gain=gain)
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        if self.norm is not None:
            self.norm.reset_parameters()

    @property
    def causal(self) -> bool:
        return self.attention.causal

    def project(self, x: Tensor, start: int = 0, rotate: bool = True) -> Tuple[Tensor, Tensor, Tensor]:
        """The attention inputs of ``x`` ``(B, N, E)``: q ``(B, N, Hq, D)``, k and v ``(B, N, Hk, D)`` (q and k
        rotated when ``rotary`` and ``rotate``, row ``i`` of ``x`` being sequence position ``start + i``)."""
        check_layer_input(x, self.embed_dim, self.q_proj.weight, "MultiheadDilatedAttention")
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim)
        if self.rotary and rotate:
            cos, sin = rotary_tables(n, self.head_dim, self.rotary_base, x.device, start, _table_dtype(q))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v

    def forward(self, x: Tensor, cu_seqlens: Optional[Tensor] = None) -> Tensor:
        if isinstance(cu_seqlens, Tensor) and cu_seqlens.is_floating_point():  # (layer(query, key), as in torch)
            hint = ("this layer is self-attention, forward(x) takes one input (not nn.MultiheadAttention's query, "
                    "key, value)")
        else:  # (layer(x, key_padding_mask))
            hint = ("this layer takes no key_padding_mask or attn_mask; padded sequences go packed, with their "
                    "boundaries")
        check_not_a_mask(cu_seqlens, "MultiheadDilatedAttention", hint)
        if cu_seqlens is not None:
            return self._forward_packed(x, cu_seqlens)
        q, k, v = self.project(x, self._first_position(x))  # checks x
        b, n = q.shape[:2]
        out = self._attend(q, k, v).reshape(b, n, self.embed_dim)
        return self._output(out)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """The attention of :meth:`forward`'s projected rows (a subclass adds to the call: the ring's module)."""
        return self.attention(q, k, v)

    def prefill(self, x: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Optional[Tensor] = None) -> Tensor:
        """:meth:`forward` of a prompt ``x`` ``(B, N, E)`` (positions ``0 .. N-1``, causal) that also writes its keys
        and values into an empty KV cache (rows ``0 .. N-1`` of each sequence; contiguous ``(B, M, Hk, D)`` or
        paged with ``block_table``), for :meth:`decode` to continue from. The cache gets the values only (no
        autograd graph: outside ``torch.no_grad()`` the returned output is differentiable, the cache is not). A block table's pages that the prompt fills
        are checked to lie in the cache, their values read on the host once per table (and version)."""
        if not self.causal:
            raise ValueError("MultiheadDilatedAttention.prefill: generation needs causal=True")
        q, k, v = self.project(x)
        b, n = q.shape[:2]
        self._check_prefill_cache(k_cache, v_cache, block_table, b, n, k)
        # the cache keeps values, not the prompt's autograd graph (decode is inference only)
        write_cache(k_cache, v_cache, k.detach(), v.detach(), torch.zeros(b, dtype=torch.int32, device=x.device),
                    block_table)
        return self._output(self.attention(q, k, v).reshape(b, n, self.embed_dim))

    def _check_prefill_cache(self, k_cache, v_cache, block_table, b: int, n: int, k: Tensor) -> None:
        """The caches (and block table) :meth:`prefill` writes a prompt of ``n`` tokens into, for ``b`` sequences,
        its keys and values being ``k``'s dtype and device."""
        fn = "MultiheadDilatedAttention.prefill"
        hk, d = self.num_kv_heads, self.head_dim
        layout = f"(pages, page_size, {hk}, {d})" if block_table is not None else f"({b}, max_len, {hk}, {d})"
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(c, Tensor) or c.dim() != 4 or tuple(c.shape[2:]) != (hk, d) or c.shape != k_cache.shape:
                got = tuple(c.shape) if isinstance(c, Tensor) else type(c).__name__
                raise ValueError(f"{fn}: {name} must be {layout} (as k_cache), got {got}")
            if c.dtype != k.dtype:
                raise TypeError(f"{fn}: {name} must have the dtype of the module's keys and values, {k.dtype}, got "
                                f"{c.dtype}")
            if c.device != k.device:
                raise ValueError(f"{fn}: {name} must be on the inputs' device {k.device}, got {c.device}")
        if block_table is None:
            if k_cache.shape[0] != b:
                raise ValueError(f"{fn}: k_cache must have batch {b} (x's), got {k_cache.shape[0]}")
            rows = k_cache.shape[1]
        else:
            if not isinstance(block_table, Tensor) or block_table.dim() != 2 or block_table.shape[0] != b:
                got = tuple(block_table.shape) if isinstance(block_table, Tensor) else type(block_table).__name__
                raise ValueError(f"{fn}: block_table must be ({b}, pages per sequence), got {got}")
            check_block_table(block_table, k_cache.shape[0], -(-n // max(k_cache.shape[1], 1)), k.device, fn)
            rows = block_table.shape[1] * k_cache.shape[1]
        if rows < n:
            raise ValueError(f"{fn}: the cache holds {rows} rows a sequence, fewer than the prompt's {n} tokens")

    def decode(self, x: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Union[int, Tensor],
               block_table: Optional[Tensor] = None) -> Tensor:
        """New tokens ``x`` ``(B, Nq, E)`` at positions ``cache_seqlens[b] + t``: their keys and values are appended
        to the cache in place and they attend to the whole sequence so far
        (:func:`longattn.dilated_attention_with_kvcache`); the caller then advances ``cache_seqlens`` by ``Nq``."""
        if not self.causal:
            raise ValueError("MultiheadDilatedAttention.decode: generation needs causal=True")
        q, k, v = self.project(x, rotate=False)
        b, n = q.shape[:2]
        if self.rotary:
            if V._is_int(cache_seqlens):  # (a NumPy int too, as the KV-cache functions take it)
                start = torch.full((b,), int(cache_seqlens), dtype=torch.long, device=x.device)
            elif isinstance(cache_seqlens, Tensor) and cache_seqlens.shape == (b,):
                start = cache_seqlens.long()
            else:  # (the call below names every other mistake; the rotation needs a position first)
                got = tuple(cache_seqlens.shape) if isinstance(cache_seqlens, Tensor) else type(cache_seqlens).__name__
                raise ValueError(f"MultiheadDilatedAttention.decode: cache_seqlens must be an int or a ({b},) "
                                 f"tensor of lengths, got {got}")
            pos = start[:, None] + torch.arange(n, device=x.device)  # (B, Nq)
            cos, sin = rotary_tables_at(pos.reshape(-1), self.head_dim, self.rotary_base, _table_dtype(q))
            cos, sin = cos.view(b, n, 1, -1), sin.view(b, n, 1, -1)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        a = self.attention
        out = dilated_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                             segment_lengths=a.segment_lengths, dilation_rates=a.dilation_rates,
                                             head_split=a.head_split, block_table=block_table, scale=a.scale,
                                             backend=a.backend)
        return self._output(out.reshape(b, n, self.embed_dim))

    def _forward_packed(self, x: Tensor, cu_seqlens: Tensor) -> Tensor:
        fn = "MultiheadDilatedAttention"
        if not isinstance(x, Tensor) or x.dim() != 2:
            raise ValueError(f"{fn}: with cu_seqlens, x must be a packed (total, embed_dim) tensor, got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        V.check_cu_seqlens(cu_seqlens, x.shape[0], "cu_seqlens", fn, x.device)
        q, k, v = self.project(x[None], rotate=False)
        q, k, v = q.squeeze(0), k.squeeze(0), v.squeeze(0)  # (indexing's backward would zero-fill and copy)
        if self.rotary:
            cos, sin = rotary_tables_at(packed_positions(cu_seqlens), self.head_dim, self.rotary_base,
                                        _table_dtype(q))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attention(q, k, v, cu_seqlens=cu_seqlens).reshape(x.shape[0], self.embed_dim)
        return self._output(out)

    def _output(self, out: Tensor) -> Tensor:
        if self.norm is not None:
            out = self.norm(out)
        out = nn.functional.dropout(out, self.dropout, self.training)
        return self.out_proj(out)

    def _first_position(self, x: Tensor) -> int:
        """Sequence position of the first row of ``x`` (0 here; a shard's offset in the ring module)."""
        return 0

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"dropout={self.dropout}, rotary={self.rotary}")
