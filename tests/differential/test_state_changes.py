"""State changes between repeated calls (state_changes.py): every call exact or a clear error.

CI runs a fixed, seeded set of cases: by default the 299 cases of the seeded walk of 700
(``S.covering_cases``) that meet every change class x entry point x convention and every change x
convention the whole walk meets, 44% of its calls (the whole walk took 53 s on a quiet 2-core
machine, over 200 s on a busy one); JACMODE_STATE_CASES=N runs the first N of the walk instead.
JACMODE_SOAK_SECONDS=N draws new random cases for N seconds. Both fail on
any silently wrong result, raw error or model left changed, and print the table of failing cases
(change class, change, entry point, call indices, max error). A sample of the numeric
disagreements is recomputed by float64 central differences (``settle``) so that the table says
whether the oracle or jacmode is wrong. JACMODE_STATE_REPORT=<path> writes it all as JSON.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import pytest
import state_changes as S
import torch

import jacmode as jm

CI_CASES = int(os.environ["JACMODE_STATE_CASES"]) if os.environ.get("JACMODE_STATE_CASES") else None


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _finish(tally: S.StateTally, what: str) -> None:
    tally.settle_sample()
    lines = tally.summary()
    print(f"\n== state changes ({what}) ==")
    print("\n".join(lines))
    if os.environ.get("JACMODE_STATE_REPORT"):
        tally.dump(os.environ["JACMODE_STATE_REPORT"])
    if tally.failing:
        raise AssertionError(f"{len(tally.failing)} failing calls (silently wrong, raw errors or state left changed)"
                             f" of {sum(tally.calls.values())}:\n" + "\n".join(lines))


def test_every_call_after_a_state_change_is_exact_or_a_clear_error() -> None:
    if os.environ.get("JACMODE_SOAK_SECONDS"):
        pytest.skip("JACMODE_SOAK_SECONDS is set: the soak runs instead")
    tally = S.StateTally()
    cases = S.covering_cases() if CI_CASES is None else S.fixed_cases(CI_CASES)
    for case in cases:
        tally.record(case, S.run_case(case))
    _finish(tally, f"CI: {len(cases)} fixed cases" + (" covering the walk of 700" if CI_CASES is None else ""))


def test_soak() -> None:
    """JACMODE_SOAK_SECONDS=N: random cases for N seconds (a new seed each run, printed)."""
    seconds = float(os.environ.get("JACMODE_SOAK_SECONDS", "0"))
    if not seconds:
        pytest.skip("the soak runs only with JACMODE_SOAK_SECONDS=<seconds>")
    seed = int(os.environ.get("JACMODE_SOAK_SEED", str(int(time.time()))))
    rng = random.Random(seed)
    tally = S.StateTally()
    stop = time.monotonic() + seconds
    k = 0
    while time.monotonic() < stop:
        case = S.draw(rng, seed * 1000 + k)
        tally.record(case, S.run_case(case))
        k += 1
    _finish(tally, f"soak: {seconds:g} s, seed {seed}")


# ---------------------------------------------------------------------------------------------
# The harness's own parts.


@pytest.mark.parametrize("entry", sorted(S.ENTRIES))
def test_the_oracle_agrees_with_finite_differences(entry: str) -> None:
    """Every entry point's float64 oracle equals float64 central differences (a third method) on a
    model whose forward reads Python state, with a frozen parameter."""
    en = S.ENTRIES[entry]
    d = 1 if entry.startswith("derivative") else 2
    torch.manual_seed(0)
    net = S.DictAttr(d, 2 if entry != "divergence" else d).double()
    net.opts["scale"] = 1.3
    net.l1.bias.requires_grad_(entry == "jacobian_subset")
    x = torch.randn(3, d, dtype=torch.float64)
    want = S.oracle(en, net, net, x)
    fd = S.finite_differences(en, net, net, x)
    bad, err = S.compare(fd, want, torch.float64, 1)
    assert bad is None or err <= {1: 1e-6, 2: 1e-4}[en.order] * (S._max_abs(want) + 0.01), (bad, err)


@pytest.mark.parametrize("change", sorted(S.CHANGES))
def test_every_change_is_applied_and_undone(change: str) -> None:
    """A change moves what the harness expects (the oracle's numbers, the coupling, the output size, the
    batch or the dtype), and undoing it restores the first state exactly: else a stale result would
    pass unnoticed, or a 'changed back' call would be judged against the wrong state."""
    case = S.Case(seed=5, change=change, entry="jacobian", convention="eager", calls=3, at=1, back=2, batch=3,
                  d_in=2, d_out=S.CHANGES[change].d_out or 2)
    w = S.build(case)
    seen = []
    try:
        for i in range(3):
            S.advance(case, w, i)
            x = torch.ones(w.batch, w.d_in, dtype=torch.float64) * 0.3
            net64 = S.copy.deepcopy(w.target()).double()
            f64 = w.oracle_f(net64)
            out = f64(x)
            out = out[0] if isinstance(out, tuple) else out
            j = S.oracle(S.ENTRIES["jacobian_params"], f64, net64, x) if change == "requires_grad_off" else None
            seen.append((out.detach(), S.coupled_now(w), w.dtype, isinstance(f64(x), tuple), j))
    finally:
        S._reset_globals()

    def same(a: Any, b: Any) -> bool:
        return (a[0].shape == b[0].shape and torch.equal(a[0], b[0]) and a[1:4] == b[1:4]
                and (a[4] is None or torch.equal(a[4], b[4])))

    assert not same(seen[0], seen[1]), f"{change} changes nothing the harness can see"
    assert same(seen[0], seen[2]), f"{change}: undoing it does not restore the first state"


def test_a_stale_result_is_silently_wrong_and_a_raw_error_is_raw() -> None:
    """The judge: a result computed on the old state is 'silently_wrong'; torch's RuntimeError 'raw_error';
    a CoupledBatchError where the samples are coupled 'clear_error'."""
    case = S.Case(seed=1, change="act_attr", entry="jacobian", convention="eager", calls=2, at=1, back=None, batch=2,
                  d_in=2, d_out=2)
    w = S.build(case)
    x = S.make_x(case, w, 1)
    old = jm.jacobian(w.net, x)
    S.advance(case, w, 1)
    net64 = S.copy.deepcopy(w.net).double()
    rec = S.CallRecord(1, S.ENTRIES["jacobian"], got=old, want=S.oracle(S.ENTRIES["jacobian"], net64, net64, x.double()))
    S.judge(case, w, rec)
    assert rec.status == "silently_wrong", rec
    raw = S.CallRecord(1, S.ENTRIES["jacobian"], error=RuntimeError("shape '[4, 3, 2]' is invalid"), want=rec.want)
    S.judge(case, w, raw)
    assert raw.status == "raw_error", raw
    coupled = S.Case(seed=1, change="centre_on", entry="jacobian", convention="eager", calls=2, at=0, back=None,
                     batch=2, d_in=2, d_out=2)
    w = S.build(coupled)
    S.advance(coupled, w, 0)
    with pytest.raises(jm.CoupledBatchError) as info:
        jm.jacobian(w.net, S.make_x(coupled, w, 0))
    rec = S.CallRecord(0, S.ENTRIES["jacobian"], error=info.value)
    S.judge(coupled, w, rec)
    assert rec.status == "clear_error", rec
    rec = S.CallRecord(0, S.ENTRIES["jacobian"], got=torch.zeros(2, 2, 2))
    S.judge(coupled, w, rec)
    assert rec.status == "silently_wrong" and "coupled" in rec.detail, rec
