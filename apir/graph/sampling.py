"""The SAMPLE op's ``params`` operand: one draw's knobs, named, and their wire layout.

On the wire (and in a graph) ``params`` is an F32 vector of ``PARAMS_SIZE`` values,
one per field in declaration order::

    [0] temperature  <= 0: argmax (greedy), the other fields are ignored
    [1] top_k        keep the k most likely tokens; <= 0 keeps all
    [2] top_p        keep the shortest prefix whose mass reaches top_p; >= 1 keeps all
    [3] min_p        drop tokens below min_p * p_max; <= 0 keeps all
    [4] u            a uniform draw in [0, 1) from the guest's seeded RNG

The engine packs it, the executors unpack it (see Op.SAMPLE in ``apir.graph.ops``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SampleArgs:
    temperature: float
    top_k: float
    top_p: float
    min_p: float
    u: float

    def values(self) -> tuple[float, float, float, float, float]:
        """The fields in wire order (named, not dataclasses.astuple's deep copy: a batched
        step packs one per sequence, ~20 us each that way)."""
        return self.temperature, self.top_k, self.top_p, self.min_p, self.u

    def pack(self) -> np.ndarray:
        """The F32 vector a graph's ``params`` input takes."""
        return np.array(self.values(), np.float32)

    @classmethod
    def unpack(cls, params: Any) -> SampleArgs:  # an ndarray, or a torch tensor on the host
        """The fields of packed vectors (..., PARAMS_SIZE), each of shape (...): scalars
        from one vector, tensors from a device tensor (so a kernel reads them without a
        host sync)."""
        return cls(*(params[..., i] for i in range(PARAMS_SIZE)))

    @property
    def greedy(self) -> bool:
        """Whether every draw is an argmax."""
        return bool(np.all(np.asarray(self.temperature) <= 0))


PARAMS_SIZE = len(fields(SampleArgs))
GREEDY = SampleArgs(0.0, 1, 1.0, 0.0, 0.0)
