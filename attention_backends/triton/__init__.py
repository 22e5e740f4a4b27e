"""The Triton attention backend (CUDA; any compute capability >= 7.0).

The first GPU backend a Turing card (7.5) can run, where FlashAttention
cannot. Importing this package imports triton: the selector only does so
once the backend is chosen.
"""

from pagedllm.attention_backends.triton.backend import TritonAttentionImpl, TritonBackend, TritonMetadata

__all__ = ["TritonAttentionImpl", "TritonBackend", "TritonMetadata"]
