"""The model zoo (tests/_zoo_models.py) through every entry point and mode that applies.

Every cell of the coverage table in docs/coverage.md is one test here: the result equals the
float64 autograd.grad loop, or the call raises the declared error with the declared wording, and
in both cases the model and x are left exactly as they were. Cells the library does not get
right yet are strict xfails (they fail loudly once fixed, so the declaration gets updated).
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from conftest import assert_unchanged, snapshot

import jacmode as jm
from _zoo_models import (  # noqa: F401 -- one_intra_op_thread is an autouse fixture
    CALLS, DOC, LABELS, NA, ZOO, Case, call, check_result, instantiate, one_intra_op_thread, table, table_in_doc,
)

# Fallbacks may announce themselves with a JacmodeWarning; the zoo checks values and errors only.
pytestmark = pytest.mark.filterwarnings("ignore::jacmode.JacmodeWarning")


def _cells() -> list:
    params = []
    for case in ZOO:
        for label in LABELS:
            if case.outcome(label) == NA:
                continue
            marks = []
            if label in case.gaps:
                exc, why = case.gaps[label]
                marks.append(pytest.mark.xfail(strict=True, raises=exc, reason=why))
            params.append(pytest.param(case, label, marks=marks, id=f"{case.name}-{label}"))
    return params


@pytest.mark.parametrize(("case", "label"), _cells())
def test_cell(case: Case, label: str) -> None:
    model, x = instantiate(case)
    before, x_before, x_flag = snapshot(model), x.clone(), x.requires_grad
    outcome = case.outcome(label)
    try:
        if isinstance(outcome, tuple):
            with pytest.raises(outcome[0], match=outcome[1]):
                call(case, label, model, x)
        else:
            result = call(case, label, model, x)
            check_result(case, label, model, x, result)
        _check_plan(case, label, model, x)
    finally:
        assert_unchanged(model, before)
        assert torch.equal(x, x_before) and x.requires_grad == x_flag


def _check_plan(case: Case, label: str, model: torch.nn.Module, x: torch.Tensor) -> None:
    """plan() accepts every call that jacobian() gets right and refuses those that fail validation
    (errors met while differentiating, such as a missing jvp rule, only jacobian() can see)."""
    outcome = case.outcome(label)
    kwargs = dict(dict(CALLS)[label], structure=case.structure)
    if not isinstance(outcome, tuple):
        chosen = jm.plan(model, x, **kwargs)
        assert chosen.mode == kwargs["mode"] if kwargs["mode"] != "auto" else chosen.mode in ("forward", "reverse")
    elif outcome[0] in (TypeError, jm.CoupledBatchError):
        with pytest.raises(outcome[0], match=outcome[1]):
            jm.plan(model, x, **kwargs)


def test_zoo_is_large_enough() -> None:
    distinct = {case.build for case in ZOO}
    assert len(distinct) >= 14
    assert all(sum(p.numel() for p in instantiate(c)[0].parameters()) < 1000 for c in ZOO)


def test_coverage_doc_is_current() -> None:
    """docs/coverage.md shows what these tests check (regenerate: see the page)."""
    text = (pathlib.Path(__file__).resolve().parents[1] / DOC).read_text()
    assert table_in_doc(text) == table(lambda case, label: case.cell(label)).strip()


@pytest.mark.parametrize(
    ("case_name", "select"),
    [("Returns a dict", lambda out: out["logits"]), ("Returns a tuple (raw `nn.LSTM`)", lambda out: out[0])],
)
@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_the_fix_named_by_the_multi_output_error_works(case_name: str, select, mode: str) -> None:
    from conftest import ref_input_jacobian

    case = next(c for c in ZOO if c.name == case_name)
    model, x = instantiate(case)
    f = lambda x: select(model(x))  # noqa: E731
    torch.testing.assert_close(jm.jacobian(f, x, mode=mode), ref_input_jacobian(f, x), rtol=1e-7, atol=1e-9)


def test_coupled_batchnorm_error_names_every_way_out() -> None:
    case = next(c for c in ZOO if c.name == "BatchNorm train")
    model, x = instantiate(case)
    with pytest.raises(jm.CoupledBatchError) as info:
        jm.jacobian(model, x)
    for way_out in ("model.eval()", "batched=False", "structure='coupled'", "structure='independent'"):
        assert way_out in str(info.value)
