"""Launching a multi-process test job: `torchrun` over gloo processes, one place for how.

Every launch runs with one OpenMP thread per rank (the ranks share the machine's cores) and Python's
faulthandler on (PYTHONFAULTHANDLER), so a rank that dies in native code prints every thread's Python stack.

A rank killed by a native crash signal (SIGSEGV, SIGBUS, SIGILL, SIGABRT) is launched once more, and the first
launch's stacks are kept as a warning in pytest's summary. Why: twice in about a dozen clean-clone CI runs
(2026-12-03) one rank of a gloo job died of SIGSEGV, in different tests, with and without the code first
suspected; neither crash reproduced in 29 reruns, some under load (docs/testing.md, "A rare crash in a gloo
rank"). On 2026-12-05 a rank of the fast tier's 2-process parity batch died of SIGABRT ("terminate called without
an active exception": C++'s std::terminate, a thread destroyed while still joinable) in one of six fast-tier runs of
the same tree; the batch rerun passed. The retry keeps one unexplained native crash from failing a whole tier while
keeping its evidence; a second crash, any Python exception, a wrong number or a timeout fails as before. Nothing else is retried.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# torchrun's summary of a rank killed by a signal: "exitcode  : -11 (pid: ...)"; the signal's own line
# "Signal 11 (SIGSEGV) received by PID ..."
NATIVE_CRASH = re.compile(r"exitcode\s*:\s*-(4|6|7|11)\b|\((SIGSEGV|SIGBUS|SIGILL|SIGABRT)\)")


class NativeCrashWarning(UserWarning):
    """A rank died of a native crash signal and its launch was retried (see the module docstring)."""


def torchrun(nproc: int, script: str | Path, *args: str, timeout: float = 600, env: dict | None = None,
             cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --standalone --nproc-per-node=<nproc> <script> <args>`, its output
    captured; retried once if a rank died of a native crash (the module docstring says why)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(script), *map(str, args)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    if done.returncode != 0 and native_crash(done.stderr):
        warnings.warn(NativeCrashWarning(f"a rank of `{' '.join(cmd[3:6])} {Path(script).name}` died of a native "
                                         f"crash; launched again. Its stacks:\n{crash_report(done.stderr)}"))
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    return done


def native_crash(stderr: str) -> bool:
    return NATIVE_CRASH.search(stderr) is not None


def crash_report(stderr: str) -> str:
    """What a failed launch printed that says why: native aborts and faulthandler's stacks first, then the tail."""
    lines = stderr.splitlines()
    telling = [line for line in lines if any(k in line for k in ("terminate called", "what():", "Fatal Python",
                                                                   "File \"", "Error", "Signal", "exitcode"))]
    return "\n".join(telling[-60:]) + "\n...\n" + stderr[-2000:]
