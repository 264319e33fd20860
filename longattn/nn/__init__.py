"""``nn.Module`` front-ends of the functional API."""
from longattn.nn.block_sparse import BlockSparseAttention, MultiheadBlockSparseAttention
from longattn.nn.dilated import DilatedAttention, MultiheadDilatedAttention

__all__ = ["DilatedAttention", "MultiheadDilatedAttention", "BlockSparseAttention", "MultiheadBlockSparseAttention"]
