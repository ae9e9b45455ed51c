"""Differential testing: drawn models x inputs x conventions x entry points against float64 oracles.

Every case must end correct (to the tolerance of its dtype and derivative order, runner.TOL) or
with one of jacmode's own clear errors (runner.clear_error); a mismatch, a raw error or a missing
error fails, unless a narrow entry of known.KNOWN describes the case (a bug being fixed on another
branch). CI draws a fixed, derandomised set of cases (JACMODE_DIFF_EXAMPLES, default 1500);
``pytest tests/differential --soak 20`` (or JACMODE_SOAK=20) draws random ones for 20 minutes and
lists every failure at the end. The summary section at the end of the run says how many distinct
model x entry-point x convention cases ran, the outcomes, and the KNOWN entries that matched
(JACMODE_DIFF_REPORT=<path> writes it as JSON).
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from typing import Any, Optional

import grammar as G
import known as K
import oracles as O
import pytest
import runner as R
import torch
import vectors as V
from conftest import DIFFERENTIAL
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tally import Tally
from torch import nn
from torch.func import jacfwd, jacrev

import jacmode as jm

TALLY = Tally()
CI_EXAMPLES = int(os.environ.get("JACMODE_DIFF_EXAMPLES", "1500"))  # about a minute alone on 2 cores
RELAXED = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(autouse=True, scope="module")
def _tally(request: pytest.FixtureRequest) -> Any:
    request.config.stash[DIFFERENTIAL] = TALLY
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    if os.environ.get("JACMODE_DIFF_REPORT"):
        TALLY.dump(os.environ["JACMODE_DIFF_REPORT"])


def judge(case: G.Case, raise_on_failure: bool = True) -> None:
    assume(R.valid(case) and V.valid(case))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallbacks warn (JacmodeWarning); the numbers are judged
        outcome = R.run_case(case)
    entry = K.known(case)
    TALLY.record(case, outcome, entry)
    if raise_on_failure and not outcome.ok and entry is None:
        raise AssertionError(f"{outcome.status}: {outcome.detail}\ncase: {case.describe()}\n{case!r}")


@settings(max_examples=CI_EXAMPLES, derandomize=True, **RELAXED)
@given(G.cases())
def test_every_drawn_case_is_exact_or_a_clear_error(case: G.Case) -> None:
    judge(case)


@settings(max_examples=max(50, CI_EXAMPLES // 5), derandomize=True, **RELAXED)
@given(G.cases(forms=True))
def test_every_drawn_call_form_is_exact_or_a_clear_error(case: G.Case) -> None:
    """Call forms of several arguments only: the main draw reaches them in a few percent of cases."""
    judge(case)


VECTOR_EXAMPLES = int(os.environ.get("JACMODE_DIFF_VECTOR_EXAMPLES", str(max(100, int(CI_EXAMPLES // 2.5)))))


@settings(max_examples=VECTOR_EXAMPLES, derandomize=True, **RELAXED)
@given(V.vector_cases())
def test_every_drawn_vector_product_is_exact_or_a_clear_error(case: G.Case) -> None:
    """jvp, vjp, hvp, ggn(v=), linearize, wrt=<dict> and fn(params, x) (vectors.py), model left as found."""
    judge(case)


def test_soak(soak_minutes: Optional[float]) -> None:
    """Random draws for --soak MINUTES; every failure is collected and listed at the end."""
    if not soak_minutes:
        pytest.skip("soak runs only with --soak MINUTES or JACMODE_SOAK=<minutes>")
    stop = time.monotonic() + 60 * soak_minutes
    before = len(TALLY.failures)

    @settings(max_examples=100, derandomize=False, phases=["generate"], **RELAXED)
    @given(st.one_of(G.cases(), V.vector_cases()))
    def batch(case: G.Case) -> None:
        if time.monotonic() < stop:
            judge(case, raise_on_failure=False)

    while time.monotonic() < stop:
        batch()
    found = TALLY.failures[before:]
    assert not found, f"{len(found)} failing cases:\n" + "\n".join(found)


# ---------------------------------------------------------------------------------------------
# The harness's own parts: the error criterion, the oracle's decompositions.


def test_clear_error_accepts_jacmodes_validation_and_rejects_raw_errors() -> None:
    with pytest.raises(ValueError) as info:
        jm.jacobian(nn.Linear(2, 2), torch.randn(3, 2), mode="sideways")
    assert R.clear_error(info.value) is None
    with pytest.raises(RuntimeError) as raw:
        jm.jacobian(nn.Linear(2, 2), torch.randn(3, 5))  # torch's own shape error from f
    assert "not a TypeError" in R.clear_error(raw.value)
    try:
        raise ValueError("x: expected a tensor. Pass one.")  # right words, raised outside jacmode
    except ValueError as err:
        assert "outside jacmode" in R.clear_error(err)


@pytest.mark.parametrize("kind", ["layernorm", "groupnorm", "rmsnorm", "batchnorm", "batchnorm_train",
                                  "softmax", "log_softmax"])
def test_the_oracles_decompositions_are_the_fused_ops(kind: str) -> None:
    """Value and first derivative (where torch's formulas are right) of each primitive spelling
    equal the fused op's, so the oracle differentiates the same function."""
    torch.manual_seed(0)
    norm = G.Norm(kind, 4, groups=2).double()
    if kind == "batchnorm_train":  # no running statistics to update in place under jacrev
        norm.norm.track_running_stats, norm.norm.running_mean, norm.norm.running_var = False, None, None
    x = torch.randn(3, 4, dtype=torch.float64)
    fused = norm(x), jacrev(norm)(x)
    norm.primitive = True
    torch.testing.assert_close(norm(x), fused[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(jacrev(norm)(x), fused[1], rtol=1e-10, atol=1e-10)


def test_batch_norm_training_forward_ad_is_wrong_above_first_order() -> None:
    """Why the oracle decomposes BatchNorm in training mode (and KNOWN's C entry for it): torch's
    forward-over-forward second derivative of batch_norm with batch statistics disagrees with its
    reverse-over-reverse one, with the op written in primitives, and with central differences."""
    torch.manual_seed(0)
    norm = G.Norm("batchnorm_train", 3).double()
    x = torch.randn(3, 3, dtype=torch.float64)
    w = torch.randn(3, 3, dtype=torch.float64)
    bn = norm.norm

    def fused(z: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.batch_norm(z, None, None, bn.weight, bn.bias, training=True, eps=bn.eps) * w).sum()

    def primitive(z: torch.Tensor) -> torch.Tensor:
        norm.primitive = True
        return (norm(z) * w).sum()

    grad = jacrev(primitive)
    eps, fd = 1e-5, torch.zeros(3, 3, 3, 3, dtype=torch.float64)
    for i in range(3):
        for j in range(3):
            e = torch.zeros_like(x)
            e[i, j] = eps
            fd[..., i, j] = (grad(x + e) - grad(x - e)) / (2 * eps)
    torch.testing.assert_close(jacrev(jacrev(fused))(x), fd, rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(jacfwd(jacfwd(primitive))(x), fd, rtol=1e-7, atol=1e-7)
    assert (jacfwd(jacfwd(fused))(x) - fd).abs().max() > 1e-2  # torch's forward-mode formula


def test_cross_entropy_hessian_takes_classes_on_dim_1() -> None:
    """The ggn oracle's H for outputs (C, T): one softmax per position, as torch's cross_entropy."""
    out = torch.randn(3, 2, dtype=torch.float64)
    y = torch.tensor([0, 2])
    h = torch.func.hessian(lambda o: torch.nn.functional.cross_entropy(o.reshape(1, 3, 2), y.reshape(1, 2),
                                                                     reduction="sum"))(out)
    torch.testing.assert_close(O.cross_entropy_hessian(out), h.reshape(6, 6), rtol=1e-12, atol=1e-12)


def test_a_coupled_op_inactive_at_the_drawn_batch_owes_no_error() -> None:
    """ReLU zeroes every feature of sample 0 before cumsum(z, 0): the other rows do not depend on it near x (the
    whole-batch Jacobian's cross blocks are zero), so per-sample results are exact and no error is owed; with
    sample 0 alive the coupling shows. (Soak: conv1d/relu/op-cumsum, reverse mode via functional_call, B = 2.)"""
    case = G.Case(seed=0, head="flat", head_spec={}, in_shape=(2,), blocks=[("act", "relu", "module"),
                  ("op", "cumsum", 2, 0)], width=2, out_shape=(2,), batch=2, dtype=torch.float64, entry="jacobian",
                  options={"mode": "reverse", "batched": True, "structure": "auto", "chunk_size": None},
                  convention="fcall_same")
    net64 = G.build(case, primitive=True)
    dead = torch.tensor([[-1.0, -2.0], [0.5, 1.0]], dtype=torch.float64)
    assert R.locally_independent(case, net64, [dead])
    assert not R.locally_independent(case, net64, [dead.flip(0)])  # sample 0 alive: row 1 depends on it
    ids = dataclasses.replace(case, head="embeddingbag", head_spec={"vocab": 3, "dim": 2, "padding_idx": None,
                              "mode": "sum"}, blocks=[("op", "center", 2, 0)], entry="per_sample_grads",
                              options={"loss": "sq"})
    net64 = G.build(ids, primitive=True)
    assert R.locally_independent(ids, net64, [torch.tensor([[0, 0, 2], [0, 2, 0]])])  # one bag to the model
    assert not R.locally_independent(ids, net64, [torch.tensor([[0, 0, 2], [0, 2, 2]])])
