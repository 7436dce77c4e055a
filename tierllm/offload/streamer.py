"""Layer streaming, called explicitly in the model's layer loop: `before_layer(i)` makes the compute stream wait
until layer i's weights sit in its staging slot (and starts loading the next layers), `after_layer(i)` marks the
slot reusable once layer i's kernels are done. Offloaded layers take the slots in turn (the k-th offloaded layer
uses slot k % num_slots), so loads of the next layers overlap the compute of this one."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from tierllm.offload.host_store import HostLayerStore, bind_layer
from tierllm.offload.nvme_store import NvmeLayerStore


class ResidentLayers:
    """Every layer's weights stay where they are: nothing to wait for."""

    def before_layer(self, index: int) -> None:
        pass

    def after_layer(self, index: int) -> None:
        pass

    def close(self) -> None:
        pass


class LayerStreamer:
    def __init__(self, layers: nn.ModuleList, offloaded: list[int], store: HostLayerStore | NvmeLayerStore,
                 device: torch.device, num_slots: int):
        self.order = list(offloaded)                            # offloaded layer indices, in forward order
        self.position = {index: k for k, index in enumerate(self.order)}
        self.store = store
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.num_slots = min(num_slots, len(self.order))
        max_bytes = max(store.layouts[i].nbytes for i in self.order)
        self.slots = [torch.empty(max_bytes, dtype=torch.uint8, device=device) for _ in range(self.num_slots)]
        for k, index in enumerate(self.order):
            bind_layer(layers[index], store.layouts[index], self.slots[k % self.num_slots])
        self.copy_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.slot_owner: list[int | None] = [None] * self.num_slots      # layer whose bytes are in (or entering) it
        self.slot_released = [True] * self.num_slots                      # owner's kernels enqueued; may reuse
        self.slot_free_event: list[torch.cuda.Event | None] = [None] * self.num_slots
        self.bounce_copied: list[torch.cuda.Event | None] = [None] * self.num_slots   # NVMe: bounce buffer reusable
        self.pending: dict[int, Future | torch.cuda.Event | None] = {}    # layer -> its load, not yet waited on
        self.wait_seconds = 0.0                                           # the layer loop blocked on loads
        # NVMe reads block on the disk: loader threads keep them going while the model computes, one per slot so
        # the next layer's read starts while this one's last chunks finish (the disk queue never drains)
        self.loader = ThreadPoolExecutor(self.num_slots, thread_name_prefix="tierllm-stream") \
            if isinstance(store, NvmeLayerStore) else None

    def _load(self, index: int, slot: int, free_event) -> torch.cuda.Event | None:
        """Copy layer `index` into staging slot `slot` once its previous owner is done with it."""
        if isinstance(self.store, NvmeLayerStore):
            if self.bounce_copied[slot] is not None:
                self.bounce_copied[slot].synchronize()          # the bounce buffer's last copy has left it
            source = self.store.read(index, slot)[:self.store.layouts[index].nbytes]   # files are padded
        else:
            source = self.store.buffers[index]
        target = self.slots[slot][:source.numel()]
        if not self.is_cuda:
            target.copy_(source)
            return None
        with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
            if free_event is not None:
                self.copy_stream.wait_event(free_event)
            target.copy_(source, non_blocking=True)
            loaded = torch.cuda.Event()
            loaded.record(self.copy_stream)
        self.bounce_copied[slot] = loaded
        return loaded

    def _try_issue(self, index: int) -> None:
        slot = self.position[index] % self.num_slots
        if self.slot_owner[slot] == index or not self.slot_released[slot]:
            return                                              # already there, or the owner still computes
        free_event = self.slot_free_event[slot]
        self.slot_owner[slot], self.slot_released[slot] = index, False
        if self.loader is not None:
            self.pending[index] = self.loader.submit(self._load, index, slot, free_event)
        else:
            self.pending[index] = self._load(index, slot, free_event)

    def before_layer(self, index: int) -> None:
        k = self.position.get(index)
        if k is None:
            return                                              # a resident layer
        n = len(self.order)
        slot = k % self.num_slots
        if self.slot_owner[slot] != index and not self.slot_released[slot]:   # a forward stopped midway (error)
            self._abandon(slot)
        for j in range(k, k + self.num_slots):                  # this layer, then prefetch the next ones
            self._try_issue(self.order[j % n])
        assert self.slot_owner[slot] == index, "layer streamer: layers must run in order"
        loaded = self.pending.pop(index, None)
        if isinstance(loaded, Future):
            start = time.perf_counter()
            try:
                loaded = loaded.result()                        # raises a corrupt-file error here
            except BaseException:
                self.slot_owner[slot], self.slot_released[slot] = None, True   # the slot holds nothing usable
                raise
            finally:
                self.wait_seconds += time.perf_counter() - start
        if loaded is not None:
            torch.cuda.current_stream(self.device).wait_event(loaded)

    def _abandon(self, slot: int) -> None:
        """Forget the slot's owner after an interrupted forward: its load (if any) must finish first, so no copy
        lands in the slot afterwards; the next user reloads."""
        pending = self.pending.pop(self.slot_owner[slot], None)
        if isinstance(pending, Future):
            try:
                pending.result()
            except Exception:                                   # already reported by the forward that failed
                pass
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        self.slot_owner[slot], self.slot_released[slot] = None, True

    def after_layer(self, index: int) -> None:
        k = self.position.get(index)
        if k is None:
            return
        slot = k % self.num_slots
        if self.is_cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self.slot_free_event[slot] = done
        self.slot_released[slot] = True

    def close(self) -> None:
        if self.loader is not None:
            self.loader.shutdown(wait=True)
        self.store.close()
