"""Where a model's tensors lie in its one weights buffer, the same for guest and host.

The engine uploads every tensor of a GGUF into one buffer, in file order, each at the
next ALIGNMENT-aligned offset. A host that publishes a model (``apir host --model``) lays
its copy out by the same rule, so a guest's graphs name the shared copy's bytes with the
offsets it computes from its own file; ``layout_digest`` lets the host check that both
agree before the guest may use the copy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from ..backends.base import ALIGNMENT
from .gguf_file import TensorInfo
from .weights import TensorSlot


def weight_slots(tensors: Iterable[TensorInfo]) -> tuple[dict[str, TensorSlot], int]:
    """Each tensor's slot in the weights buffer, and the buffer's size in bytes."""
    slots, offset = {}, 0
    for t in tensors:
        slots[t.name] = TensorSlot(offset, t.dtype, t.shape)
        offset += -(-t.data.nbytes // ALIGNMENT) * ALIGNMENT
    return slots, offset


def layout_digest(slots: dict[str, TensorSlot]) -> bytes:
    """SHA-256 of every slot (name, dtype, shape, offset), in order: 32 bytes."""
    h = hashlib.sha256()
    for name, s in slots.items():
        h.update(f"{name}\0{int(s.dtype)}\0{','.join(map(str, s.shape))}\0{s.offset}\n".encode())
    return h.digest()
