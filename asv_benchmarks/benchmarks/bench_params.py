"""Suite 1: per-sample parameter Jacobians, (B, 10, 15910), of problem 1's MLP.

Linear(784, 20) -> ReLU -> Linear(20, 10): the users' loop (B <= 64), vmap(jacrev) over
functional_call written by hand, torch.autograd.functional.jacobian(vectorize=True), and jacmode
in auto, forward and reverse mode.
"""

from ._common import _ProblemSuite, params_of


class ParamJacobian(_ProblemSuite):
    problem = "params"
    params = params_of("params")
