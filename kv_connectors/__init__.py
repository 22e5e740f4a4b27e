"""KV connectors: KV blocks moving between engines or memory tiers.

The interface is `base.KVConnectorBase`; built in are `shared_storage`
(disaggregated prefill through a shared directory) and `cpu_offload` (a CPU
tier under the paged cache). Plugins add more through `register_kv_connectors`.
"""
