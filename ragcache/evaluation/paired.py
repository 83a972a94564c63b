"""Is one configuration's KL lower than another's on the same questions, or only on these? A paired sign-flip
(permutation) test: under "no difference" each question's difference is as likely negative as positive, so the
observed mean is compared with the means of every way of flipping the differences' signs. Exact (all 2^n flips)
up to EXACT questions, else a fixed-seed sample of them; no distribution assumed, which matters at n = 10–20
where one question can carry a mean (BENCHMARKS.md, "APE over lead KV")."""
from __future__ import annotations

import itertools
import random

EXACT = 16  # questions up to which every sign flip is enumerated (65,536 of them)
DRAWS = 65_536  # past that, this many random flips, seeded: the same data gives the same p


def p_lower(diffs: list[float]) -> float:
    """The one-sided p-value of mean(diffs) < 0 arising by chance: the share of sign flips whose mean is at least as
    low as the observed one (the observed flip included, so never 0). 1.0 for no data."""
    if not diffs:
        return 1.0
    observed, tie = sum(diffs), 1e-12 * max(1.0, sum(map(abs, diffs)))  # a flip that ties the observed sum counts
    if len(diffs) <= EXACT:
        flips = itertools.product((1, -1), repeat=len(diffs))
    else:
        rng = random.Random(0)
        flips = itertools.chain([(1,) * len(diffs)], ([rng.choice((1, -1)) for _ in diffs] for _ in range(DRAWS - 1)))
    total = low = 0
    for signs in flips:
        total += 1
        low += sum(s * d for s, d in zip(signs, diffs)) <= observed + tie
    return low / total
