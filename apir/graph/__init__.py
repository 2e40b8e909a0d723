"""The tensor/graph API models are written against. Pure Python + numpy: no torch here."""

from .dtypes import DType
from .graph import Graph, GraphBuilder, Node, Value, last_reads, releases
from .ops import OPS, Alias, GraphError, Op, T
from .sampling import SampleArgs

__all__ = ["Alias", "DType", "Graph", "GraphBuilder", "GraphError", "Node", "OPS", "Op",
           "SampleArgs", "T", "Value", "last_reads", "releases"]
