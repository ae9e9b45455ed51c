"""Suite 1: per-sample parameter Jacobians (B, Y, P).

``ParamJacobian``: problem 1's class ``MLP`` (fc1 -> ReLU -> fc2, P = 15910): the users' loop
(B <= 64), vmap(jacrev) over functional_call written by hand,
torch.autograd.functional.jacobian(vectorize=True), jacmode in auto, forward and reverse mode and on
the class's ``nn.Sequential`` twin, and two floors: the hand-derived rule for this model and
allocating and filling a tensor of the result's size.

``ModelClasses``: the classes of ``bench.param_models`` (a conv-conv-linear CNN at B = 64,
a residual MLP with GELU and LayerNorm at B = 256, a transformer encoder layer at B = 32): jacmode,
vmap(jacrev) and allocate+fill.
"""

from bench import param_models
from bench.baselines import allocate_fill, params_vmap_jacrev

from ._common import DEVICE, _ProblemSuite, params_of, sync

import jacmode as jm


class ParamJacobian(_ProblemSuite):
    problem = "params"
    params = params_of("params")


MODEL_METHODS = {
    "jacmode": lambda model, x: jm.jacobian(model, x, wrt="params"),
    "vmap(jacrev)": params_vmap_jacrev,
    "allocate+fill": allocate_fill,
}


class ModelClasses:
    params = (list(param_models.MODELS), list(MODEL_METHODS))
    param_names = ["model", "method"]
    timeout = 600

    def setup(self, name: str, method: str) -> None:
        model, x = param_models.make(name)
        self.model, self.x = model.to(DEVICE), x.to(DEVICE)
        self.fn = MODEL_METHODS[method]
        self.fn(self.model, self.x[:2])  # one-time costs (caches, the completeness check) out of the timings
        sync()

    def time_jacobian(self, name: str, method: str) -> None:
        self.fn(self.model, self.x)
        sync()

    def peakmem_jacobian(self, name: str, method: str) -> None:
        self.fn(self.model, self.x)
