"""The tiny Llama family (`pagedllm-tiny`, `pagedllm-tiny-draft`): tokenizer
training, model training, evaluation and model cards."""
