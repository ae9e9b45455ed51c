"""Suite 2: dy/dt at every time step, (B, 4), of problem 2's tanh MLP.

Linear(1, 20) -> tanh -> Linear(20, 20) -> tanh -> Linear(20, 4): the users' loop and the full
Jacobian then its diagonal (both B <= 1000), torch.autograd.grad with a cotangent of ones,
torch.func.jvp with a tangent of ones, jacmode.derivative and jacmode.jacobian.
"""

from ._common import _ProblemSuite, params_of


class TimeDerivative(_ProblemSuite):
    problem = "dydt"
    params = params_of("dydt")
