"""Placeholder: dilated-attention modules (being written)."""
DilatedAttention = MultiheadDilatedAttention = None
