"""The host executor: PyTorch on cpu, cuda or mps."""

from .executor import LocalBackend, pick_device

__all__ = ["LocalBackend", "pick_device"]
