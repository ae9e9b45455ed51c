"""What a run of the harness covered and found: distinct cases, outcomes, known bugs, failures."""

from __future__ import annotations

import collections
import json
from typing import Optional

import grammar as G
from known import Known
from runner import Outcome


class Tally:
    def __init__(self) -> None:
        self.runs = 0
        self.distinct: set[tuple[str, str, str]] = set()
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.known: collections.Counter[str] = collections.Counter()  # failing cases per KNOWN entry
        self.known_passed: collections.Counter[str] = collections.Counter()  # matching cases that passed
        self.failures: list[str] = []
        self.forms: collections.Counter[str] = collections.Counter()  # call forms of several arguments: outcomes

    def record(self, case: G.Case, outcome: Outcome, entry: Optional[Known]) -> None:
        self.runs += 1
        self.distinct.add((case.model_key(), case.entry_key(), case.convention))
        self.outcomes[outcome.status] += 1
        if case.form:
            self.forms[outcome.status] += 1
        if entry is not None:
            label = f"{entry.letter}: {entry.description[:70]}"
            (self.known_passed if outcome.ok else self.known)[label] += 1
        elif not outcome.ok:
            self.failures.append(f"{outcome.status}: {outcome.detail.splitlines()[0][:300]}\n    case: {case.describe()}")

    def summary(self) -> list[str]:
        entries = {e for _, e, _ in self.distinct}
        lines = [f"{self.runs} cases run, {len(self.distinct)} distinct model x entry-point x convention "
                 f"({len({m for m, _, _ in self.distinct})} models, {len(entries)} entry points with options, "
                 f"{len({c for _, _, c in self.distinct})} conventions)",
                 "outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())),
                 f"call forms of several arguments: {sum(self.forms.values())} cases, "
                 + ", ".join(f"{k} {v}" for k, v in sorted(self.forms.items()))]
        lines += [f"known (failing, counted not failed) {v:5d}  {k}" for k, v in sorted(self.known.items())]
        lines += [f"known but passed                   {v:5d}  {k}" for k, v in sorted(self.known_passed.items())]
        lines += [f"FAILED {f}" for f in self.failures[:20]]
        return lines

    def dump(self, path: str) -> None:
        with open(path, "w") as fh:
            json.dump({"runs": self.runs, "distinct": len(self.distinct), "outcomes": self.outcomes,
                       "known": self.known, "known_passed": self.known_passed, "forms": self.forms, "failures": self.failures}, fh, indent=1)
