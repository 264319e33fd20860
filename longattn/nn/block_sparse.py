"""Placeholder: block-sparse attention modules (being written)."""
BlockSparseAttention = MultiheadBlockSparseAttention = None
