"""Memory calibration: workspace multipliers and the max_memory check, from subprocess peaks.

Each measurement runs one ``jacobian`` call in a fresh Python process and reads its peak resident
memory (``ru_maxrss``) above the resident memory before the call, less the result.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from . import ROOT
from .grid import Case

MARGIN = 1.3  # memory multipliers are set this much above the largest of three measured peaks

_MEMORY_SCRIPT = r"""
import json, resource, sys, torch, psutil
torch.set_num_threads(cfg_threads := 1)
import jacmode as jm
from bench.calibrate import Case
cfg = json.loads(sys.argv[1])
case = Case(**cfg["case"])
model, x = case.build()
jm.jacobian(model, x[:2], wrt=case.wrt, mode=cfg["mode"])
before = psutil.Process().memory_info().rss
p = jm.plan(model, x, wrt=case.wrt, mode=cfg["mode"], chunk_size=cfg["chunk"])
jm.jacobian(model, x, wrt=case.wrt, mode=cfg["mode"], chunk_size=cfg["chunk"])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"workspace": peak - before - p.result_bytes, "unit": p.workspace_bytes}))
"""


def measure_workspace(case: Case, mode: str, chunk: Optional[int]) -> dict[str, float]:
    """Peak resident memory of one call in a fresh subprocess, less the result (bytes)."""
    import dataclasses
    import subprocess
    import sys

    cfg = json.dumps({"case": dataclasses.asdict(case), "mode": mode, "chunk": chunk})
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, cfg], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def calibrate_memory(log: Any = print) -> dict[str, float]:
    """Scale each workspace multiplier by measured / estimated peak on a case where it dominates (x MARGIN)."""
    from jacmode._planning import calibrated as _calibrated

    memory = dict(_calibrated.MEMORY)
    probes = [  # (multiplier, case, mode, chunk)
        ("jvp_live", Case("mlp", 256, 8, 512, h=2048), "forward", 64),  # layer by layer
        ("jvp_live", Case("cnn", 16, 8, 256), "forward", 64),  # vmap over jvp
        ("vjp_tape", Case("mlp", 8, 2, 4096, h=4096), "reverse", 1),
        ("vjp_live", Case("mlp", 256, 64, 512, h=2048), "reverse", 64),
        ("sample_live", Case("seq", 32, 10, 64, wrt="params", h=1024), "reverse", 90),  # per-sample activations
        ("param_copies", Case("mlp-opaque", 64, 10, 32, wrt="params", h=512), "reverse", 40),
    ]
    seen: dict[str, float] = {}
    for name, case, mode, chunk in probes:
        runs = [measure_workspace(case, mode, chunk) for _ in range(3)]  # peaks vary with the allocator
        m = max(runs, key=lambda r: r["workspace"])
        ratio = max(m["workspace"], 0) / max(m["unit"], 1)
        log(f"{name}: measured {m['workspace'] / 2**20:.1f} MiB vs estimated {m['unit'] / 2**20:.1f} MiB "
            f"({case.label}) -> x{ratio:.2f}")
        value = round(max(0.5, memory.get(name, 1.0) * ratio * MARGIN), 2)
        memory[name] = seen[name] = max(value, seen.get(name, 0.0))  # a second probe may only raise it
    return memory


_BUDGET_SCRIPT = r"""
import json, resource, sys, torch, psutil
torch.set_num_threads(1)
import jacmode as jm
from torch.func import functional_call, jacrev, vmap
from bench.calibrate import Case
cfg = json.loads(sys.argv[1])
case = Case(**cfg["case"])
model, x = case.build()
params = {k: v.detach() for k, v in model.named_parameters()}
one = lambda p, xb: functional_call(model, p, (xb.unsqueeze(0),)).squeeze(0)
if cfg["how"] == "jacmode":
    jm.jacobian(model, x[:1], wrt="params", max_memory=cfg["budget"])
    before = psutil.Process().memory_info().rss
    plan = jm.plan(model, x, wrt="params", max_memory=cfg["budget"])
    t0 = __import__("time").perf_counter()
    J = jm.jacobian(model, x, wrt="params", max_memory=cfg["budget"])
    seconds = __import__("time").perf_counter() - t0
    extra = {"plan": repr(plan), "seconds": seconds}
else:  # the users' idiom: vmap over samples of jacrev, unchunked
    vmap(jacrev(one), in_dims=(None, 0))(params, x[:1])
    before = psutil.Process().memory_info().rss
    J = vmap(jacrev(one), in_dims=(None, 0))(params, x)
    extra = {}
result = sum(t.numel() * t.element_size() for t in (J.values() if isinstance(J, dict) else [J]))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"peak_over_baseline": peak - before, "result": result, **extra}))
"""


def memory_check(case: Optional[Case] = None, budget: str = "200MB", log: Any = print) -> dict[str, Any]:
    """Peak resident memory of a large parameter Jacobian under ``max_memory``, in subprocesses.

    Also measures the users' unchunked ``vmap(jacrev)`` on a quarter of the batch (its workspace
    is linear in B) to show what the budget saved.
    """
    import dataclasses
    import subprocess
    import sys

    from jacmode._checks import check_max_memory

    case = case or Case("seq", 32, 10, 1024, wrt="params", h=1024)

    def sub(c: Case, how: str) -> dict[str, Any]:
        cfg = json.dumps({"case": dataclasses.asdict(c), "how": how, "budget": budget})
        out = subprocess.run([sys.executable, "-c", _BUDGET_SCRIPT, cfg], capture_output=True, text=True, cwd=ROOT)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        return json.loads(out.stdout.strip().splitlines()[-1])

    quarter = dataclasses.replace(case, b=max(1, case.b // 4))
    naive = sub(quarter, "vmap(jacrev)")
    ours = sub(case, "jacmode")
    scale = case.b / quarter.b
    report = {
        "case": case.label, "budget": check_max_memory(budget), "result": ours["result"],
        "jacmode_peak_over_baseline": ours["peak_over_baseline"], "jacmode_seconds": ours["seconds"],
        "jacmode_plan": ours["plan"],
        "vmap_jacrev_workspace_at_quarter_batch": naive["peak_over_baseline"] - naive["result"],
        "vmap_jacrev_workspace_extrapolated": (naive["peak_over_baseline"] - naive["result"]) * scale,
    }
    report["within_budget_plus_result"] = report["jacmode_peak_over_baseline"] <= report["budget"] + report["result"]
    mib = 2**20
    log(f"{case.label}: result {report['result'] / mib:.0f} MiB; jacmode with max_memory={budget!r}: peak "
        f"{report['jacmode_peak_over_baseline'] / mib:.0f} MiB over baseline (budget + result = "
        f"{(report['budget'] + report['result']) / mib:.0f} MiB) in {report['jacmode_seconds']:.2f} s -> "
        f"{'within' if report['within_budget_plus_result'] else 'OVER'}; unchunked vmap(jacrev) workspace "
        f"{report['vmap_jacrev_workspace_at_quarter_batch'] / mib:.0f} MiB at B={quarter.b}, about "
        f"{report['vmap_jacrev_workspace_extrapolated'] / mib:.0f} MiB at B={case.b}")
    return report
