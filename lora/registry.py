"""The front end's registered adapters: what turns a `LoRARequest` (a name
and a folder) into the `LoRARef` its requests carry to the engine core.

Registering loads and validates the adapter against the base model (rank,
target modules, shapes: lora/adapter.py) and computes its content digest,
so a bad adapter is an error before any request reaches the core. A folder
is read again only when its files changed (their size, mtime and inode), so
generating again with the same LoRARequest does not hash the weights again,
while new weights under the same name or folder get a new digest, hence
never another adapter's cached KV.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pagedllm.core.lora import LoRARef

if TYPE_CHECKING:
    from pagedllm.core.config import LoRAConfig
    from pagedllm.lora.request import LoRARequest

# A folder's files as stat() sees them: (name, size, mtime_ns, inode), sorted.
FilesStamp = tuple[tuple[str, int, int, int], ...]


class LoRARegistry:
    def __init__(
        self, model_path: str, config: LoRAConfig, adaptable_modules: Mapping[str, tuple[int, int]] | None = None
    ) -> None:
        """`adaptable_modules`: the modules the model holds adapter slots for,
        with their (out, in) (the engine's READY); None: the checkpoint's
        linear modules, read on first use."""
        self.model_path = model_path
        self.config = config
        # The base model's modules -> (out, in) (None: no checks).
        self._base_modules: Mapping[str, tuple[int, int]] | None = adaptable_modules
        self._base_modules_read = adaptable_modules is not None
        # Folder (real path) -> (its files' stamp, the digest read from them).
        self._digests: dict[str, tuple[FilesStamp, str]] = {}
        self._lock = threading.Lock()

    def ref_for(self, lora_request: LoRARequest) -> LoRARef:
        """The LoRARef of `lora_request`'s adapter (LoRAAdapterError if it is
        not a valid adapter for this model). Blocking: reads and hashes the
        weights when the folder is new or its files changed."""
        return self.register(lora_request.lora_name, lora_request.lora_path)

    def register(self, name: str, path: str) -> LoRARef:
        folder = os.path.realpath(path)
        stamp = _files_stamp(folder)
        with self._lock:
            known = self._digests.get(folder)
        if known is not None and stamp is not None and known[0] == stamp:
            return LoRARef(name, known[1], folder)
        digest = self._load_digest(name, folder)
        if stamp is not None:
            with self._lock:
                self._digests[folder] = (stamp, digest)
        return LoRARef(name, digest, folder)

    def _load_digest(self, name: str, folder: str) -> str:
        from pagedllm.lora.adapter import base_model_modules, load_lora_adapter

        if not self._base_modules_read:
            self._base_modules = base_model_modules(self.model_path)
            self._base_modules_read = True
        adapter = load_lora_adapter(
            folder, name=name, max_rank=self.config.max_lora_rank, max_bytes=self.config.max_lora_bytes,
            base_modules=self._base_modules,
        )
        return adapter.ref.digest


def _files_stamp(folder: str) -> FilesStamp | None:
    """None when the folder cannot be listed (the loader then says why)."""
    try:
        entries = [entry for entry in os.scandir(folder) if entry.is_file()]
        stats = [(entry.name, entry.stat()) for entry in entries]
    except OSError:
        return None
    return tuple(sorted((name, st.st_size, st.st_mtime_ns, st.st_ino) for name, st in stats))
