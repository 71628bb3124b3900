"""The test tiers, marked by pyproject.toml's markers.

    python -m pytest -q             the fast tier: every module at its own level and one small multi-process
                                    parity case per parallelism (a few minutes on 2 cores)
    python -m pytest -q -m slow     the full parity matrix, compiled steps, train.py under torchrun, faults
    python -m pytest -q -m ranks8   the 8-process layouts
.ci/run runs all three. A test of the slow tier is marked `@slow`; a parametrized list that spans both tiers
is built with `tiered`, and a fixture that launches processes for many cases asks `selected` which of them
the chosen tests need.
"""
from __future__ import annotations

import pytest

slow = pytest.mark.slow


def tiered(cases, fast) -> list:
    """pytest params of `cases` (tuples), each not in `fast` marked slow: one list serves both tiers."""
    return [pytest.param(*c, marks=() if c in fast else slow) for c in cases]


def selected(request, fixture: str, key) -> list:
    """What the selected tests of the requesting module need from a module fixture that launches processes:
    key(item) for each test that survived -m / -k selection and uses `fixture`, so that a tier (or one
    test run alone) launches only its own cases."""
    return sorted({key(item) for item in request.session.items
                   if item.module is request.module and fixture in item.fixturenames})
