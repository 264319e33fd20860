"""longattn: exact attention for very long sequences.

Public functional API (batch-first, ``(batch, seq, heads, head_dim)``):

- :func:`flash_attention`: dense / causal / sliding-window attention with grouped-query heads.
- :func:`dilated_attention`: LongNet's dilated attention (segments x dilation rates, softmax-denominator merge).
- :func:`block_sparse_attention`: attention restricted to the allowed pairs of a block mask.

Every function takes ``backend="auto" | "triton" | "torch"``: ``auto`` runs the Triton kernels on a CUDA GPU and
PyTorch elsewhere.
"""
from longattn.functional import block_sparse_attention, dilated_attention, flash_attention

__version__ = "0.1.0"

__all__ = ["flash_attention", "dilated_attention", "block_sparse_attention", "__version__"]
