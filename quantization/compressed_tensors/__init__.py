"""compressed-tensors checkpoints (what llm-compressor writes): scheme.py
reads config.json's `quantization_config`, weights.py gives each layer the
checkpoint's tensors, scaled_linear.py holds the W8A8 GEMMs, method.py is the
registered `compressed-tensors` quantization method."""
