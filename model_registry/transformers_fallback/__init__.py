"""The Transformers fallback (vLLM's Transformers modeling backend): any
decoder-only architecture that transformers knows and no plugin registers
runs through transformers' own modeling code, with pagedllm's paged
attention plugged in through transformers' attention interface."""
