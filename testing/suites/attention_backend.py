"""The attention backend suite: what a backend declares, it computes.

Every numeric rule builds a random mixed batch (a prefill chunk after cached
context, a fresh prefill, decodes) over shuffled physical blocks whose
unwritten slots hold NaN, runs it through the backend on the test device
(``PAGEDLLM_TEST_DEVICE``, default cpu) and compares the output with
plain-torch attention (``pagedllm.testing.attention_reference``), with a
tolerance by dtype. Only what the backend declares is exercised: its dtypes,
block sizes (``block_size_multiple``), head sizes, sliding window, fp8 KV
cache dtypes. A backend that cannot run on this machine (another device,
a package not installed) has its numeric rules skipped, with the reasons.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.testing.components import load, registration
from pagedllm.testing.suite import ConformanceError, RuleSkipped, Suite

if TYPE_CHECKING:
    import torch

    from pagedllm.attention_backends.base import AttentionBackend, AttentionCapabilities
    from pagedllm.testing.attention_case import AttentionCase

KIND = "attention_backend"
SUITE = Suite(KIND)

# A prefill chunk after cached context, a fresh prefill, decodes (one at a block edge).
MIXED = dict(seq_lens=[37, 20, 50, 9, 32], query_lens=[12, 20, 1, 1, 1])
# (num_heads, num_kv_heads): MHA, GQA 2 and 4, MQA.
GQA_SHAPES = [(4, 4), (4, 2), (8, 2), (4, 1)]
# max abs/rel error against the float32 reference, by compute dtype.
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}


@dataclass(frozen=True)
class Target:
    """The backend under test and the sizes it declares it runs."""

    backend: type[AttentionBackend]
    caps: AttentionCapabilities
    head_size: int
    block_sizes: tuple[int, ...]
    dtypes: tuple[str, ...]


def _head_size(caps: AttentionCapabilities) -> int:
    if caps.head_sizes:
        return min(caps.head_sizes)
    multiple = caps.head_size_multiple or 1
    return multiple * -(-16 // multiple)  # the smallest multiple >= 16


def _platform() -> Any:
    from pagedllm.platforms import load_platform_cls
    from pagedllm.testing.attention_case import DEVICE

    return load_platform_cls(DEVICE.type)()


def _target(rule: str, name: str) -> Target:
    """The backend, or RuleSkipped when it declares it cannot run here."""
    import torch

    from pagedllm.attention_backends.selector import check_backend
    from pagedllm.platforms.interface import dtype_name

    caps = registration(rule, KIND, name).info
    platform = _platform()
    runnable = [dtype_name(d) for d in platform.supported_dtypes()]
    dtypes = tuple(d for d in (caps.dtypes or ("float32",)) if d in runnable)
    multiple = caps.block_size_multiple or 16
    block_sizes = (multiple, 2 * multiple)
    head_size = _head_size(caps)
    dtype = getattr(torch, dtypes[0]) if dtypes else torch.float32
    reasons = check_backend(
        registration(rule, KIND, name), platform, head_size=head_size, dtype=dtype, block_size=block_sizes[0]
    )
    if not dtypes:
        reasons.append(f"none of its dtypes ({', '.join(caps.dtypes or ())}) runs on {platform.describe()}")
    if reasons:
        raise RuleSkipped(rule, f"{name} cannot run on {platform.describe()}: {'; '.join(reasons)}")
    return Target(load(rule, KIND, name), caps, head_size, block_sizes, dtypes)


def _in_backend_layout(backend: type[AttentionBackend], case: AttentionCase) -> AttentionCase:
    """The case with its (standard-layout) cache moved into the backend's layout."""
    import dataclasses

    import torch

    from pagedllm.attention_backends.base import STANDARD_KV_CACHE_LAYOUT

    layout = backend.get_kv_cache_layout()
    if layout is STANDARD_KV_CACHE_LAYOUT:
        return case
    shape = layout.kv_cache_shape(case.num_blocks, case.block_size, case.num_kv_heads, case.head_size)
    cache = torch.full(shape, float("nan"), dtype=case.kv_cache.dtype, device=case.kv_cache.device)
    block_ids = torch.arange(case.num_blocks, device=cache.device)
    layout.scatter_blocks(cache, block_ids, case.kv_cache.transpose(0, 1).contiguous())
    return dataclasses.replace(case, kv_cache=cache)


def _run(rule: str, target: Target, case: AttentionCase) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, cache after in the standard layout) of the backend on ``case``."""
    import torch

    from pagedllm.testing.attention_case import run_backend

    try:
        out, cache = run_backend(target.backend, _in_backend_layout(target.backend, case))
    except Exception as exc:
        raise ConformanceError(rule, f"forward raised {type(exc).__name__}: {exc}") from exc
    layout = target.backend.get_kv_cache_layout()
    blocks = layout.gather_blocks(cache, torch.arange(case.num_blocks, device=cache.device))
    return out, blocks.transpose(0, 1)


def _compare(rule: str, what: str, target: Target, case: AttentionCase, dtype: str) -> None:
    import torch

    from pagedllm.testing.attention_reference import reference_attention

    out, _ = _run(rule, target, case)
    expected_shape = (case.query.shape[0], case.num_heads, case.head_size)
    if tuple(out.shape) != expected_shape:
        raise ConformanceError(rule, f"{what}: output shape {tuple(out.shape)}, expected {expected_shape}")
    scale = case.head_size**-0.5
    reference = torch.cat(
        [reference_attention(q, k, v, scale, case.sliding_window, case.soft_cap, case.sinks)
         for q, k, v in case.requests]
    )
    tolerance = TOLERANCE.get(dtype, 3e-2)
    error = (out.float().cpu() - reference).abs()
    bound = tolerance + tolerance * reference.abs()
    if not bool((error <= bound).all()):  # NaN fails too
        worst = int((error - bound).flatten().nan_to_num(float("inf")).argmax())
        row = worst // (case.num_heads * case.head_size)
        raise ConformanceError(
            rule,
            f"{what}: output differs from plain-torch attention (token row {row}: "
            f"max abs error {error.nan_to_num(float('inf')).max().item():.3g} > tolerance {tolerance:g} for {dtype})",
        )


def _case(target: Target, **kwargs: Any) -> AttentionCase:
    from pagedllm.testing.attention_case import build_case

    options: dict[str, Any] = dict(MIXED, head_size=target.head_size, block_size=target.block_sizes[0])
    options.update(kwargs)
    return build_case(**options)


@SUITE.rule("loads")
def check_loads(name: str) -> None:
    """The target imports, subclasses AttentionBackend, and its impl class subclasses AttentionImpl."""
    from pagedllm.attention_backends.base import AttentionImpl

    backend = load("loads", KIND, name)
    impl = backend.get_impl_cls()
    if not (isinstance(impl, type) and issubclass(impl, AttentionImpl)):
        raise ConformanceError("loads", f"get_impl_cls() returned {impl!r}, not an AttentionImpl subclass")


@SUITE.rule("declared-limits-rejected-with-reasons")
def check_declared_limits(name: str) -> None:
    """Each declared limit (dtype, head size, block size, sliding window, soft
    cap, sinks, KV cache dtype) turns a configuration past it into a rejection
    with a reason."""
    import torch

    from pagedllm.attention_backends.base import AttentionRequirements
    from pagedllm.attention_backends.selector import check_backend

    rule = "declared-limits-rejected-with-reasons"
    reg = registration(rule, KIND, name)
    caps: AttentionCapabilities = reg.info
    platform = _platform()
    dtype = getattr(torch, caps.dtypes[0]) if caps.dtypes else torch.float32
    fine: dict[str, Any] = dict(head_size=_head_size(caps), dtype=dtype, block_size=caps.block_size_multiple or 16)
    past_limits: dict[str, dict[str, Any]] = {}
    undeclared = [d for d in ("float32", "float16", "bfloat16") if caps.dtypes is not None and d not in caps.dtypes]
    if undeclared:
        past_limits[f"dtype {undeclared[0]}"] = dict(dtype=getattr(torch, undeclared[0]))
    if caps.block_size_multiple is not None and caps.block_size_multiple > 1:
        past_limits[f"block size {caps.block_size_multiple + 1}"] = dict(block_size=caps.block_size_multiple + 1)
    if caps.max_head_size is not None:
        past_limits[f"head size {caps.max_head_size * 2}"] = dict(head_size=caps.max_head_size * 2)
    if caps.head_size_multiple is not None and caps.head_size_multiple > 1:
        past_limits[f"head size {caps.head_size_multiple + 1}"] = dict(head_size=caps.head_size_multiple + 1)
    if not caps.supports_sliding_window:
        past_limits["a sliding window"] = dict(sliding_window=8)
    if not caps.supports_logits_soft_cap:
        past_limits["a logit soft cap"] = dict(requirements=AttentionRequirements((fine["head_size"],), None, 30.0))
    if not caps.supports_sinks:
        past_limits["attention sinks"] = dict(requirements=AttentionRequirements((fine["head_size"],), sinks=True))
    if "float8_e5m2" not in caps.kv_cache_dtypes:
        past_limits["KV cache dtype float8_e5m2"] = dict(kv_cache_dtype=torch.float8_e5m2)
    # NOTE: compared with the reasons against an ordinary configuration, which
    # a backend for another device has too: each limit must add its own.
    ordinary = set(check_backend(reg, platform, **fine))
    for what, change in past_limits.items():
        reasons = check_backend(reg, platform, **{**fine, **change})
        if not set(reasons) - ordinary or not all(isinstance(r, str) and r for r in reasons):
            raise ConformanceError(rule, f"{what} is past what {name} declares, but it is not rejected with a reason")


@SUITE.rule("mixed-batch-matches-reference")
def check_mixed_batch(name: str) -> None:
    """A mixed prefill/decode batch equals plain-torch attention in every declared dtype."""
    import torch

    rule = "mixed-batch-matches-reference"
    target = _target(rule, name)
    for seed, dtype in enumerate(target.dtypes):
        case = _case(target, dtype=getattr(torch, dtype), seed=seed)
        _compare(rule, f"{dtype} mixed batch", target, case, dtype)


@SUITE.rule("gqa-ratios-match-reference")
def check_gqa(name: str) -> None:
    """MHA, grouped-query (2 and 4 query heads per KV head) and MQA batches equal the reference."""
    import torch

    rule = "gqa-ratios-match-reference"
    target = _target(rule, name)
    dtype = target.dtypes[0]
    for seed, (num_heads, num_kv_heads) in enumerate(GQA_SHAPES, start=10):
        case = _case(target, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=getattr(torch, dtype), seed=seed)
        _compare(rule, f"{num_heads} query heads over {num_kv_heads} KV heads", target, case, dtype)


@SUITE.rule("block-sizes-match-reference")
def check_block_sizes(name: str) -> None:
    """Every block size tried (the declared multiple and twice it) gives the reference output."""
    import torch

    rule = "block-sizes-match-reference"
    target = _target(rule, name)
    dtype = target.dtypes[0]
    for seed, block_size in enumerate(target.block_sizes, start=20):
        case = _case(target, block_size=block_size, dtype=getattr(torch, dtype), seed=seed)
        _compare(rule, f"block size {block_size}", target, case, dtype)


@SUITE.rule("writes-kv-at-slot-mapping")
def check_kv_write(name: str) -> None:
    """The step's keys and values land at slot_mapping, bit for bit, and no other slot changes."""
    import torch

    rule = "writes-kv-at-slot-mapping"
    target = _target(rule, name)
    dtype = getattr(torch, target.dtypes[0])
    case = _case(target, dtype=dtype, seed=30)
    _, cache = _run(rule, target, case)
    expected = case.kv_cache.clone()
    slots = case.metadata.slot_mapping
    expected[0].view(-1, case.num_kv_heads, case.head_size)[slots] = case.key
    expected[1].view(-1, case.num_kv_heads, case.head_size)[slots] = case.value
    if not torch.equal(cache.isnan(), expected.isnan()) or not torch.equal(
        cache.nan_to_num(), expected.nan_to_num()
    ):
        changed = (cache.nan_to_num() != expected.nan_to_num()) | (cache.isnan() != expected.isnan())
        raise ConformanceError(
            rule, f"the KV cache after the step differs from the expected one in {int(changed.sum())} values"
        )


@SUITE.rule("sliding-window-matches-reference")
def check_sliding_window(name: str) -> None:
    """A backend declaring sliding-window support attends over the window only (others: nothing to run)."""
    import torch

    rule = "sliding-window-matches-reference"
    target = _target(rule, name)
    if not target.caps.supports_sliding_window:
        return
    dtype = target.dtypes[0]
    case = _case(target, dtype=getattr(torch, dtype), sliding_window=7, seed=40)
    _compare(rule, "sliding window 7", target, case, dtype)


@SUITE.rule("soft-cap-and-sinks-match-reference")
def check_soft_cap_and_sinks(name: str) -> None:
    """A backend declaring a logit soft cap or attention sinks applies them
    as plain torch does (others: nothing to run)."""
    import torch

    rule = "soft-cap-and-sinks-match-reference"
    target = _target(rule, name)
    dtype = target.dtypes[0]
    sinks = torch.linspace(-1.0, 4.0, 4)  # MIXED's 4 query heads; 5-60 % of a row's mass
    if target.caps.supports_logits_soft_cap:
        _compare(rule, "logit soft cap 2", target, _case(target, dtype=getattr(torch, dtype), soft_cap=2.0, seed=45),
                 dtype)
    if target.caps.supports_sinks:
        case = _case(target, dtype=getattr(torch, dtype), sinks=sinks, seed=46)
        _compare(rule, "attention sinks", target, case, dtype)
        if target.caps.supports_sliding_window:
            case = _case(target, dtype=getattr(torch, dtype), sinks=sinks, sliding_window=7, seed=47)
            _compare(rule, "attention sinks in a sliding window of 7", target, case, dtype)


@SUITE.rule("kv-cache-dtypes-match-reference")
def check_kv_cache_dtypes(name: str) -> None:
    """Each declared fp8 KV cache dtype gives the reference over the values the cache holds."""
    import torch

    rule = "kv-cache-dtypes-match-reference"
    target = _target(rule, name)
    platform = _platform()
    dtype = target.dtypes[0]
    for seed, cache_dtype in enumerate(target.caps.kv_cache_dtypes, start=50):
        needed = dict(target.caps.kv_cache_dtype_min_capability).get(cache_dtype)
        capability = platform.get_device_capability()
        if needed is not None and capability is not None and tuple(capability) < needed:
            continue
        case = _case(target, dtype=getattr(torch, dtype), kv_cache_dtype=getattr(torch, cache_dtype), seed=seed)
        _compare(rule, f"KV cache in {cache_dtype}", target, case, dtype)
