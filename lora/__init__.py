"""LoRA adapters: loading and validating PEFT adapters, their content
identity, the engine core's store of loaded adapters, the slots a model's
layers hold, and the resolver plugin kind (docs/lora.md)."""
