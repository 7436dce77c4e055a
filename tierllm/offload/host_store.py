"""One offloaded layer as one contiguous byte buffer: the layout of its tensors, packing them into a (pinned)
host buffer, and re-pointing the module's parameters and buffers at views of a staging buffer on the device."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

ALIGN = 256                                    # byte alignment of every tensor in a packed buffer


@dataclass(frozen=True)
class TensorSlot:
    name: str                                  # parameter or buffer name inside the layer module
    offset: int                                # byte offset in the packed buffer
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class LayerLayout:
    slots: tuple[TensorSlot, ...]              # every tensor of the layer, in module order
    nbytes: int                                # packed size, a multiple of ALIGN


def _layer_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.named_parameters()) + list(module.named_buffers())


def layer_layout(module: nn.Module) -> LayerLayout:
    slots, offset = [], 0
    for name, tensor in _layer_tensors(module):
        slots.append(TensorSlot(name, offset, tensor.dtype, tuple(tensor.shape)))
        offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    return LayerLayout(tuple(slots), offset)


def pack_layer(module: nn.Module, layout: LayerLayout, pin_memory: bool) -> torch.Tensor:
    """The layer's tensors copied into one new host buffer -> [layout.nbytes] uint8."""
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=pin_memory)
    tensors = dict(_layer_tensors(module))
    for slot in layout.slots:
        view_of(buffer, slot).copy_(tensors[slot.name])
    return buffer


def view_of(buffer: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """The slot's tensor as a typed view of a packed uint8 buffer."""
    return buffer[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def bind_layer(module: nn.Module, layout: LayerLayout, buffer: torch.Tensor) -> None:
    """Point the module's parameters and buffers at views of `buffer` (a staging buffer on the compute device):
    whatever is copied into the buffer is what the layer computes with. Frees the old storage."""
    for slot in layout.slots:
        owner_name, _, attr = slot.name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        tensor = getattr(owner, attr)
        if isinstance(tensor, nn.Parameter):
            tensor.data = view_of(buffer, slot)
        else:
            owner._buffers[attr] = view_of(buffer, slot)


class HostLayerStore:
    """Offloaded layers kept packed in host memory, pinned when CUDA is there so copies run asynchronously."""

    def __init__(self, layers: dict[int, nn.Module], pin_memory: bool, progress=None):
        self.layouts: dict[int, LayerLayout] = {}
        self.buffers: dict[int, torch.Tensor] = {}        # layer index -> [nbytes] uint8 host buffer
        for index, module in layers.items():
            self.layouts[index] = layer_layout(module)
            self.buffers[index] = pack_layer(module, self.layouts[index], pin_memory)
            if progress is not None:
                progress.update(1)

    def close(self) -> None:
        self.buffers.clear()
