"""The model runner's adapters: what each slot holds, each request's
adapter, and each row's slot in a step.

The scheduler decides which adapter sits in which slot (1..max_loras) and
says so on the SchedulerOutput when a slot's adapter changes
(`lora_loads`): this rank copies its shard into the layers' slots before
the step's forward. A request names its adapter once, when it is new
(`NewRequestData.lora`); its rows take the slot its adapter holds in each
step (an adapter keeps its slot while any of its requests runs), rows of
the base model slot 0. A step in which no row has an adapter sets
`LoRABatchState.token_slots` to None and the layers add nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.core.lora import NO_LORA_SLOT

if TYPE_CHECKING:
    from pagedllm.core.scheduler_output import SchedulerOutput
    from pagedllm.lora.model import LoRAModelSlots


class LoRABatch:
    def __init__(self, slots: LoRAModelSlots, device: torch.device) -> None:
        self.slots = slots
        self.device = device
        self.slot_of_digest: dict[str, int] = {}
        self.digest_of_request: dict[str, str] = {}
        # This step's slot per row (int32 [T]); None: no row has an adapter.
        self.step_slots: torch.Tensor | None = None

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the step's slot loads; learn new requests' adapters, forget finished ones'."""
        for load in scheduler_output.lora_loads:
            self.slot_of_digest = {d: s for d, s in self.slot_of_digest.items() if s != load.slot}
            self.slots.load_slot(load.slot, load.weights)
            self.slot_of_digest[load.digest] = load.slot
        for req_id in scheduler_output.finished_req_ids:
            self.digest_of_request.pop(req_id, None)
        for new_req in scheduler_output.scheduled_new_reqs:
            if new_req.lora is None:
                self.digest_of_request.pop(new_req.req_id, None)
            else:
                self.digest_of_request[new_req.req_id] = new_req.lora.digest

    def prepare_step(self, req_ids: list[str], query_lens: np.ndarray) -> None:
        """Each row's slot for a step of these requests (rows in request
        order, `query_lens` rows each), and the layers told it."""
        request_slots = np.fromiter((self._slot(req_id) for req_id in req_ids), dtype=np.int32, count=len(req_ids))
        self.step_slots = None
        if request_slots.any():
            self.step_slots = torch.from_numpy(np.repeat(request_slots, query_lens)).to(self.device)
        self.activate()

    def activate(self) -> None:
        """Point the layers at this step's slots (again: a graph captured
        since pointed them at its own buffer)."""
        self.slots.state.token_slots = self.step_slots

    def _slot(self, req_id: str) -> int:
        digest = self.digest_of_request.get(req_id)
        if digest is None:
            return NO_LORA_SLOT
        slot = self.slot_of_digest.get(digest)
        if slot is None:
            # The scheduler loads a request's adapter before scheduling it.
            raise RuntimeError(f"request {req_id} is scheduled but its adapter {digest[:16]} is in no slot")
        return slot
