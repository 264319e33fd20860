"""Glue to other libraries. Each integration imports its library lazily, on first use:

- :mod:`longattn.integrations.transformers`: longattn as Hugging Face transformers attention implementations.
"""
