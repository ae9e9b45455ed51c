"""jacmode: fast Jacobians for PyTorch.

Forward mode (vmap over jvp) or reverse mode (vmap over vjp), chosen from the sizes involved, with
fast paths for independent samples and elementwise maps, and the derivative operators that
physics-informed training needs.

Example:
    >>> import torch, jacmode as jm
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 20), torch.nn.Tanh(), torch.nn.Linear(20, 4))
    >>> t = torch.rand(100, 1)
    >>> jm.derivative(net, t).shape   # dy_i/dt at each of the 100 time steps
    torch.Size([100, 4])
"""

from ._cache import clear_cache
from ._data import jacobians
from ._derivatives import derivative, divergence, hessian, laplacian, partial, partials
from ._errors import BatchError, CoupledBatchError, JacmodeWarning
from ._jacobian import jacfn, jacobian, plan
from ._operators import OperatorPlan, biharmonic, operator, operator_plan
from ._planning.autotune import autotune_cache
from ._planning.ntk import NtkPlan
from ._planning.plan import Plan
from ._products import ggn, ntk, ntk_plan, per_sample_grads
from ._transform import Transformed, transform
from . import _transform
from ._sparse import (
    Coloring,
    SparsityPattern,
    coloring,
    sparse_hessian,
    sparse_jacobian,
    sparsity,
)
from ._vector import Linearized, hvp, jvp, linearize, vjp

__version__ = "0.1.0"

# the entry points that jm.transform accepts (see _transform.py)
for _op in (jacobian, derivative, partial, partials, hessian, laplacian, divergence, operator, biharmonic,
            per_sample_grads, ggn, ntk):
    _transform.register(_op)
del _op

__all__ = [
    "BatchError",
    "Coloring",
    "CoupledBatchError",
    "JacmodeWarning",
    "Linearized",
    "NtkPlan",
    "OperatorPlan",
    "Plan",
    "SparsityPattern",
    "Transformed",
    "autotune_cache",
    "biharmonic",
    "clear_cache",
    "coloring",
    "derivative",
    "divergence",
    "ggn",
    "hessian",
    "hvp",
    "jacfn",
    "jacobian",
    "jacobians",
    "jvp",
    "laplacian",
    "linearize",
    "ntk",
    "ntk_plan",
    "operator",
    "operator_plan",
    "partial",
    "partials",
    "per_sample_grads",
    "plan",
    "sparse_hessian",
    "sparse_jacobian",
    "sparsity",
    "transform",
    "vjp",
]
