"""Fixtures shared by several test files (the test tiers: tests/tiers.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ranks import crash_report, torchrun


def pytest_configure(config):
    """Under pytest-xdist the workers share the cores: each worker's torch (and each process it starts) gets one
    intra-op thread, not one per core contended by the other worker."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With pytest-xdist's `--dist loadfile` (.ci/run runs its tiers as `-n 2 --dist loadfile`): every test
    file is one unit of work, so a module fixture that launches processes for its file's cases runs once, on one
    worker; and every file that reads parity_launch (it defines `parity_cases`) is one unit together, so the
    session's launch runs once too. (xdist's own `loadgroup` marks do nothing under pytest 9: it rewrites a node
    id that pytest no longer reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling
    here = Path(__file__).parent
    parity_files = {f"tests/{f.name}" for f in here.glob("test_*.py") if "\ndef parity_cases(" in f.read_text()}

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            return "parity" if path in parity_files else path

    return ByFile(config, log)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: one thread is much faster than two contended ones on a small CPU box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """~40 KB of real text: this interpreter's os.py."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(Path(os.__file__).read_text())
    return path


@pytest.fixture(scope="session")
def parity_launch(request, tmp_path_factory) -> dict:
    """Every parity case (tests/parity.py) that the session's selected tests need, from every test file, run in
    one torchrun launch per world size: {(kind, args): result}. A test file that uses it names its tests' cases
    in a module function `parity_cases(item) -> [(world, kind, args)]`. Why one launch: each one starts a
    launcher and its ranks, each importing torch, and sets up gloo before its first case: 7.8 CPU-s on 2 ranks,
    14.5 on 4 (2026-12-05), a dozen launches in the slow tier before. A case that two files share (the same kind
    and args) runs once."""
    wanted: dict[int, dict] = {}
    for item in request.session.items:
        if "parity_launch" in item.fixturenames:
            for world, kind, args in item.module.parity_cases(item):
                wanted.setdefault(world, {}).setdefault((kind, tuple(args)), None)
    results = {}
    for world, cases in sorted(wanted.items()):
        out = tmp_path_factory.mktemp(f"parity{world}")
        names = {key: f"{n:04d}" for n, key in enumerate(cases)}
        batch = [{"name": names[key], "kind": key[0], "args": list(key[1])} for key in cases]
        # a hang guard, not a budget: a case takes 1-3 s on 2 quiet cores, ~10 s loaded; a compiled one a minute
        proc = torchrun(world, Path(__file__).parent / "parity.py", out, json.dumps(batch),
                        timeout=600 + 20 * len(batch))
        assert proc.returncode == 0, crash_report(proc.stderr)
        results.update({key: torch.load(out / f"{name}.pt") for key, name in names.items()})
    return results
