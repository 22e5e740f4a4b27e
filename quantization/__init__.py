"""Quantization methods (plugin kind ``quantization_method``): the interface
in ``base``, the built-in ``int8`` weight-only method in ``int8``."""
