"""Planned looks: the counts at which a sequential rule takes its interval, and the
confidence of each.

Looking at a 95% interval again and again and stopping the first time it is narrow finds
one narrow by chance. A rule here looks only at counts planned before it starts: the
first, then each time the count doubles, and the budget; K looks at most. Each look's
interval has confidence 1 - 5%/K (Bonferroni), so together they miss with at most 5%.
The stop rule within a run (``service.analysis.stopping``, counts of requests) and a
sweep's ``until_decided`` rule (``service.analysis.pairs``, counts of pairs) plan
their looks here.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from service.analysis.intervals import CONFIDENCE

# Each planned look after the first is at this many times the count of the one before.
GROWTH = 2


@dataclass(frozen=True)
class Looks:
    """The counts of answered requests at which the interval rule takes its interval:
    ``min_prompts``, doubling, and the budget."""

    counts: tuple[int, ...]

    @property
    def confidence(self) -> float:
        """Of each look's interval: 1 - 5%/looks, so that together they miss with at most 5%."""
        return 1 - (1 - CONFIDENCE) / len(self.counts)

    def reached(self, answered: int) -> int:
        """How many looks ``answered`` requests have reached."""
        return bisect.bisect_right(self.counts, answered)


def planned_looks(first: int, budget: int) -> Looks:
    """Looks at ``first``, each later one at ``GROWTH`` times the one before, and at the
    budget: the plan of the stop rule within a run (counts of requests) and of a sweep's
    rule over pairs of trials (``service.analysis.pairs``)."""
    counts = [first]
    while counts[-1] * GROWTH < budget:
        counts.append(counts[-1] * GROWTH)
    if counts[-1] < budget:
        counts.append(budget)
    return Looks(tuple(counts))
