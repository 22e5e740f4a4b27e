"""`pagedllm router`: an OpenAI-compatible front door over several
`pagedllm serve` backends, routed by a routing policy (plugin kind `router`)."""
