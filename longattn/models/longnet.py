"""A small decoder-only LongNet language model built on :class:`longattn.nn.MultiheadDilatedAttention`."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from longattn import _validation as V
from longattn.nn.dilated import MultiheadDilatedAttention


@dataclass
class LongNetConfig:
    """Hyper-parameters of :class:`LongNet`.

    ``segment_lengths``/``dilation_rates`` configure every layer's dilated attention. ``rotary`` gives the
    attention relative positions (rotary embedding of q and k; there is no absolute position embedding).
    ``dropout`` applies to the attention output before its output projection, to the MLP's hidden layer and to the
    residual branches. ``gradient_checkpointing`` recomputes each block in the backward instead of keeping its
    activations, so long sequences fit in memory. ``backend`` is passed to the attention.
    """

    vocab_size: int
    embed_dim: int
    num_heads: int
    num_layers: int
    segment_lengths: Sequence[int]
    dilation_rates: Sequence[int]
    num_kv_heads: Optional[int] = None
    mlp_ratio: int = 4
    dropout: float = 0.0
    causal: bool = True
    head_split: bool = False
    rotary: bool = True
    bias: bool = True
    layer_norm_eps: float = 1e-5
    gradient_checkpointing: bool = False
    backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "embed_dim", "num_heads", "num_layers", "mlp_ratio"):
            val = getattr(self, name)
            if not V._is_int(val) or val < 1:
                raise ValueError(f"LongNetConfig: {name} must be a positive int, got {val!r}")
        self.segment_lengths, self.dilation_rates = V.check_dilated_args(self.segment_lengths, self.dilation_rates,
                                                                         fn="LongNetConfig")
        # (the other flags are checked by the attention layers; this one only LongNet reads, and bool("False") is True)
        self.gradient_checkpointing = V.check_flag(self.gradient_checkpointing, "gradient_checkpointing",
                                                   "LongNetConfig")

    @property
    def init_gain(self) -> float:
        """MAGNETO's initialisation gain ``sqrt(log(2 * num_layers))`` for v, out and MLP weights."""
        return math.sqrt(math.log(2 * self.num_layers))


def _check_tokens(tokens) -> None:
    if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
        got = f"{tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, Tensor) else type(tokens).__name__
        raise ValueError(f"LongNet: tokens must be an int64 tensor of shape (batch, seq), got {got}")


def _check_ids(vocab_size: int, ids: Dict[str, Tensor]) -> None:
    """Every value of the tensors ``ids`` (by the names errors give them) is a token id in ``[0, vocab_size)``: an
    id past the embedding would be an IndexError on a CPU and a device-side assert on a GPU. One ``aminmax`` per
    tensor and one device-to-host copy for all; tensors without values (meta, or fake while tracing) are skipped.
    Under ``torch.compile`` and ``torch.export`` (whose trace reads no values) the check is an assertion of the graph:
    the same ``ValueError``'s condition, raised as PyTorch's ``RuntimeError`` when the graph runs."""
    if torch.compiler.is_compiling():
        for name, t in ids.items():
            torch._assert_async(((t >= 0) & (t < vocab_size)).all(),
                                f"LongNet: {name} must be token ids in [0, {vocab_size}) (vocab_size)")
        return
    ids = {name: t for name, t in ids.items() if t.numel() and V.has_values(t)}
    if not ids:
        return
    bounds = torch.stack([torch.stack(torch.aminmax(t)).long() for t in ids.values()]).tolist()
    for name, (lo, hi) in zip(ids, bounds):
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"LongNet: {name} must be token ids in [0, {vocab_size}) (vocab_size), got values in "
                             f"[{lo}, {hi}]")


class LongNetBlock(nn.Module):
    """Pre-norm block: ``x + Attn(LN(x))``, then ``x + MLP(LN(x))`` with a GELU MLP of ``mlp_ratio * E`` hidden."""

    def __init__(self, config: LongNetConfig, device=None, dtype=None):
        super().__init__()
        c, factory = config, {"device": device, "dtype": dtype}
        self.attn_norm = nn.LayerNorm(c.embed_dim, eps=c.layer_norm_eps, **factory)
        self.attn = MultiheadDilatedAttention(
            c.embed_dim, c.num_heads, c.segment_lengths, c.dilation_rates, num_kv_heads=c.num_kv_heads,
            dropout=c.dropout, bias=c.bias, causal=c.causal, head_split=c.head_split,
            layer_norm_eps=c.layer_norm_eps, rotary=c.rotary, init_gain=c.init_gain, backend=c.backend, **factory,
        )
        self.mlp_norm = nn.LayerNorm(c.embed_dim, eps=c.layer_norm_eps, **factory)
        hidden = c.mlp_ratio * c.embed_dim
        self.fc1 = nn.Linear(c.embed_dim, hidden, bias=c.bias, **factory)
        self.fc2 = nn.Linear(hidden, c.embed_dim, bias=c.bias, **factory)
        self.init_gain = c.init_gain
        self._init_mlp()
        self.dropout = float(c.dropout)

    def _init_mlp(self) -> None:
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_normal_(fc.weight, gain=self.init_gain)
            if fc.bias is not None:
                nn.init.zeros_(fc.bias)

    def reset_parameters(self) -> None:
        """The block's initialisation at construction: unit LayerNorms, the attention's
        (:meth:`MultiheadDilatedAttention.reset_parameters`), Xavier-normal MLP weights of gain ``init_gain`` and zero
        biases."""
        self.attn_norm.reset_parameters()
        self.attn.reset_parameters()
        self.mlp_norm.reset_parameters()
        self._init_mlp()

    def forward(self, x: Tensor) -> Tensor:
        return self.step(x, self.attn)

    def step(self, x: Tensor, attend) -> Tensor:
        """The block with ``attend`` (a function of the normalized input) in place of the attention: generation
        passes the attention's prefill or decode."""
        x = x + F.dropout(attend(self.attn_norm(x)), self.dropout, self.training)
        h = F.dropout(F.gelu(self.fc1(self.mlp_norm(x))), self.dropout, self.training)
        return x + F.dropout(self.fc2(h), self.dropout, self.training)


class LongNet(nn.Module):
    """Decoder-only LongNet: token embedding, ``num_layers`` :class:`LongNetBlock`, final LayerNorm, output head
    tied to the embedding (``logits = LN(x) @ embedding.weight.T``).

    ``forward(tokens)``: int64 ``(B, N)`` -> logits ``(B, N, vocab_size)`` (in the activations' dtype, e.g.
    bfloat16 under autocast). ``forward(tokens, targets)`` returns the mean cross-entropy instead (see :meth:`loss`).
    """

    def __init__(self, config: LongNetConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        factory = {"device": device, "dtype": dtype}
        self.embedding = nn.Embedding(config.vocab_size, config.embed_dim, **factory)
        self._init_embedding()
        self.blocks = nn.ModuleList(LongNetBlock(config, **factory) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps, **factory)
        self.gradient_checkpointing = bool(config.gradient_checkpointing)

    def _init_embedding(self) -> None:
        nn.init.normal_(self.embedding.weight, std=self.config.embed_dim ** -0.5)

    def reset_parameters(self) -> None:
        """The model's initialisation at construction (embedding ``N(0, embed_dim ** -0.5)``, each block's
        :meth:`LongNetBlock.reset_parameters`, unit final LayerNorm), e.g. after ``to_empty`` of a model built on the
        meta device (``nn.Embedding``'s and ``nn.Linear``'s own ``reset_parameters`` give other initialisations)."""
        self._init_embedding()
        for block in self.blocks:
            block.reset_parameters()
        self.final_norm.reset_parameters()

    @property
    def head_weight(self) -> Tensor:
        """The output head's weight ``(vocab_size, embed_dim)``: the embedding (tied)."""
        return self.embedding.weight

    def hidden_states(self, tokens: Tensor) -> Tensor:
        """The final normalized hidden states ``(B, N, embed_dim)`` of ``tokens`` ``(B, N)``."""
        _check_tokens(tokens)
        _check_ids(self.config.vocab_size, {"tokens": tokens})
        return self._hidden_states(tokens)

    def _hidden_states(self, tokens: Tensor) -> Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.final_norm(x)

    def forward(self, tokens: Tensor, targets: Optional[Tensor] = None) -> Tensor:
        if targets is not None:
            return self.loss(tokens, targets)
        return F.linear(self.hidden_states(tokens), self.head_weight)

    def logits(self, x: Tensor) -> Tensor:
        """Logits of the last block's output ``x`` (final LayerNorm, tied head)."""
        return F.linear(self.final_norm(x), self.head_weight)

    def generate(self, tokens: Tensor, max_new_tokens: int, *, temperature: float = 0.0, top_k: Optional[int] = None,
                 page_size: Optional[int] = None, generator: Optional[torch.Generator] = None) -> Tensor:
        """Continue ``tokens`` ``(B, N)`` (prompts of one length) by ``max_new_tokens`` tokens, greedy when
        ``temperature`` is 0 (else sampled, optionally from the ``top_k`` most likely), with a KV cache: contiguous,
        or paged with pages of ``page_size`` rows. Returns ``(B, N + max_new_tokens)``; see
        :func:`longattn.models.generation.generate`. The model must be causal; runs under ``torch.no_grad()`` and in
        eval mode (no dropout; a model in training mode is put back in it afterwards)."""
        from longattn.models.generation import generate

        _check_tokens(tokens)
        _check_ids(self.config.vocab_size, {"tokens": tokens})
        return generate(self, tokens, max_new_tokens, temperature=temperature, top_k=top_k, page_size=page_size,
                        generator=generator)

    def loss(self, tokens: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
        """Mean cross-entropy (float32) of predicting ``targets`` ``(B, N)`` at every position of ``tokens``;
        positions whose target is ``ignore_index`` are skipped, and only the kept positions' logits are computed."""
        _check_tokens(tokens)
        if not isinstance(targets, Tensor) or targets.shape != tokens.shape or targets.dtype != torch.int64:
            got = f"{tuple(targets.shape)} {targets.dtype}" if isinstance(targets, Tensor) else type(targets).__name__
            raise ValueError(f"LongNet.loss: targets must be an int64 tensor of the shape of tokens "
                             f"{tuple(tokens.shape)}, got {got}")
        keep = targets != ignore_index
        _check_ids(self.config.vocab_size, {"tokens": tokens, f"targets (other than ignore_index {ignore_index})":
                                            targets.masked_fill(~keep, 0)})
        h = self._hidden_states(tokens)
        logits = F.linear(h[keep], self.head_weight)
        return F.cross_entropy(logits.float(), targets[keep])
