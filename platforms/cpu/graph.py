"""Decode graphs on the CPU: record one forward's operations, replay them.

A CUDA graph removes the launch cost of a decode step's kernels; on the CPU
the same cost is Python's: module calls, the kernel wrappers' checks and
allocations, argument conversion: a large share of a decode step
(docs/performance.md), and the second core idles through all of it. A `CpuGraph` runs the forward
once while recording what actually computes, in order:

- every call of a C kernel made through `kernel_call` (tensors passed as
  their data pointers), and
- every ATen operation (a TorchDispatchMode): true views are recorded as
  nothing (they alias memory the graph already holds; `to`, `reshape` or
  `contiguous` that copied are not views), uninitialized allocations as
  nothing, in-place and out= operations as themselves, and functional ones
  as "compute again, copy into the recorded output".

A replay runs that list and nothing else, on the same memory: the graph
holds every tensor the forward created or touched, so no address it baked
in is ever freed or reused by anyone else (the cost: a captured size's
activations stay allocated, as a CUDA graph's memory pool does). Like a
CUDA graph, it re-reads its inputs in place, so whoever captures must read
only tensors, not host values that change between replays
(`AttentionBackend.supports_graph_capture`).

Recording is per thread, like the dispatch mode. What cannot be replayed
is refused at capture (`GraphCaptureError`): an operation that returns a
host value (`.item()`, `bool(t)`: the forward branched on data), a random
one, a collective, or a replay that does not reproduce the
recorded output exactly after every float tensor the forward created was
set to NaN (a computation into those tensors that bypassed both recorders
would leave its NaN behind).

NOTE: that check does not cover writes into persistent state, tensors the
forward did not create (the KV cache above all): a write there that
bypassed both recorders leaves the value of the recorded run in place, so
the check's replay still reproduces the output, and later replays silently
skip the write. What keeps those writes recorded is that no C kernel runs
outside `kernel_call`: tests/test_cpu_graph.py scans every kernel wrapper
(a module that loads a library through kernel_build.load_library) for a
library function called any other way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pagedllm.core.errors import GraphCaptureError

_recording = threading.local()  # .graph: the CpuGraph this thread is recording, if any

_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional"}
_ALLOCATIONS = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
}


def kernel_call(function: Any, *args: Any) -> Any:
    """`function(*args)`, a ctypes C kernel, with each tensor argument passed
    as its data pointer; recorded when a CpuGraph is being captured. Every
    C kernel a forward may run is called through here."""
    raw = tuple(arg.data_ptr() if isinstance(arg, torch.Tensor) else arg for arg in args)
    result = function(*raw)
    graph = getattr(_recording, "graph", None)
    if graph is not None:
        graph.add_kernel(function, raw, result, [arg for arg in args if isinstance(arg, torch.Tensor)])
    return result


def is_capturing() -> bool:
    """Whether this thread is recording a CpuGraph (a kernel may then pick
    the path that reads no host values, whatever the batch size)."""
    return getattr(_recording, "graph", None) is not None


def capturing_any_graph() -> bool:
    """Whether a graph is being captured: a CpuGraph on this thread, or a
    CUDA graph on the current stream."""
    # is_initialized, not is_available: 40x cheaper, and this runs per layer of an eager CPU step.
    return getattr(_recording, "graph", None) is not None or (
        torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
    )


def refuse_capture(reason: str) -> None:
    """Raise GraphCaptureError while a graph is being captured
    (`capturing_any_graph`): for code about to compute with host values that
    a replay would keep from the capture."""
    if capturing_any_graph():
        raise GraphCaptureError(reason)


class _AtenRecorder(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # True (torch's default) wraps __torch_dispatch__ in a Dynamo guard
        # whose first call imports torch._dynamo: 0.9 s of a cold start.
        # Nothing is compiled while a graph is recorded.
        return False

    def __init__(self, graph: CpuGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in _COLLECTIVE_NAMESPACES:  # refused before it runs: every rank stops at the same call
            raise GraphCaptureError(f"{func} is a collective, which a CPU graph does not replay")
        out = func(*args, **kwargs)
        self.graph.add_aten(func, tuple(args), dict(kwargs), out)
        return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal, NaN included (torch.equal says NaN != NaN)."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.shape == b.shape and torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def _aliases(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> bool:
    """Whether every output shares its storage with an input."""
    storages = {x.untyped_storage().data_ptr() for x in inputs if x.layout == torch.strided}
    return all(x.layout == torch.strided and x.untyped_storage().data_ptr() in storages for x in outputs)


class CpuGraph:
    """One recorded forward; `capture(run)` records and checks it."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], None]] = []
        self._held: list[Any] = []  # every tensor the recording touched: its memory stays the graph's
        self._created: list[torch.Tensor] = []  # tensors the forward produced (poisoned by the check)
        self.output: torch.Tensor | None = None

    @classmethod
    def capture(cls, run: Callable[[], torch.Tensor]) -> CpuGraph:
        run()  # warm-up: lazy kernel builds and caches happen outside the recording
        graph = cls()
        _recording.graph = graph
        try:
            with _AtenRecorder(graph):
                graph.output = run()
        finally:
            _recording.graph = None
        graph._check_replay()
        return graph

    @property
    def num_steps(self) -> int:
        return len(self._steps)

    @property
    def activation_bytes(self) -> int:
        """Bytes of the tensors the forward created, which the graph keeps
        allocated (each storage once)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self._created}
        return sum(storages.values())

    def replay(self) -> None:
        for step in self._steps:
            step()

    def add_kernel(self, function: Any, raw_args: tuple[Any, ...], result: Any, tensors: list[torch.Tensor]) -> None:
        self._held += tensors

        def step() -> None:
            if function(*raw_args) != result:
                raise RuntimeError(f"CPU graph replay: kernel {function.__name__} returned another status than "
                                   f"when captured ({result})")

        self._steps.append(step)

    def add_aten(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        outputs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        if len(outputs) != len(tree_flatten(out)[0]):
            raise GraphCaptureError(f"{func} returns a host value: the forward reads data on the host")
        if func is torch.ops.aten.dropout.default and not _dropout_trains(args, kwargs):
            return  # eval-mode dropout (transformers' modeling code calls it): the input itself, nothing to replay
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise GraphCaptureError(f"{func} draws random numbers")
        self._held += inputs + outputs
        if func.is_view and _aliases(outputs, inputs):
            return  # a view of memory the graph already holds (`to`, `reshape`, `contiguous` may copy instead)
        if func in _ALLOCATIONS:
            self._created += outputs
            return
        if any(arg.alias_info is not None and arg.alias_info.is_write for arg in func._schema.arguments):
            self._steps.append(lambda: func(*args, **kwargs))  # in place / out=: writes the same tensors again
            return
        self._created += outputs

        def step() -> None:
            for recorded, fresh in zip(outputs, tree_flatten(func(*args, **kwargs))[0], strict=True):
                recorded.copy_(fresh)

        self._steps.append(step)

    def _check_replay(self) -> None:
        """Poison what the forward created, replay, demand the recorded output."""
        assert self.output is not None
        expected = self.output.clone()
        for tensor in self._created:
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
        self.replay()
        if not _same_bits(self.output, expected):
            raise GraphCaptureError("a replay did not reproduce the captured forward: some computation was "
                                    "neither an ATen operation nor a C kernel called through kernel_call")


def _dropout_trains(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """aten.dropout(input, p, train): whether it draws (train and p > 0);
    otherwise ATen returns the input tensor itself."""
    p = args[1] if len(args) > 1 else kwargs["p"]
    train = args[2] if len(args) > 2 else kwargs["train"]
    return bool(train) and p > 0
