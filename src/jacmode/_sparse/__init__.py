"""Sparse Jacobians and Hessians: pattern detection, colouring, compressed evaluation.

``sets.py`` (index sets as CSR arrays), ``rules.py`` (a rule per operation), ``detect.py`` (the
tracer, scopes, cache, fallback), ``coloring.py`` (greedy distance-2 and star colourings),
``evaluate.py`` (one vectorised product per colour, decompression), ``api.py`` (entry points).
"""

from .api import coloring, sparse_hessian, sparse_jacobian, sparsity
from .coloring import Coloring
from .pattern import SparsityPattern

__all__ = ["Coloring", "SparsityPattern", "coloring", "sparse_hessian", "sparse_jacobian", "sparsity"]
