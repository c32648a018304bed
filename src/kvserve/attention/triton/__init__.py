"""Triton attention: a paged KV store kernel, varlen causal prefill and split-KV paged decode.

Importing this package decorates the kernels: set TRITON_INTERPRET=1 in the environment before
the first import to run them on the CPU (slowly; for tests).
"""
from kvserve.attention.triton.backend import TritonBackend
from kvserve.attention.triton.kernels import decode_attention, prefill_attention, store_kv

__all__ = ["TritonBackend", "decode_attention", "prefill_attention", "store_kv"]
