"""The tensor/graph API models are written against. Pure Python + numpy: no torch here."""

from .dtypes import DType
from .graph import Graph, GraphBuilder, Node, Value
from .ops import OPS, GraphError, Op, T

__all__ = ["DType", "Graph", "GraphBuilder", "GraphError", "Node", "OPS", "Op", "T", "Value"]
