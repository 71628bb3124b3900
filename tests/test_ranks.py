"""tests/ranks.py's launcher: a rank's native crash is launched again once, with a warning; nothing else is."""
from __future__ import annotations

import pytest

from ranks import NativeCrashWarning, torchrun
from tiers import slow

pytestmark = slow    # five torchrun launches (~4 s each on 2 cores)

CRASH_ONCE = """
import os, signal, sys
from pathlib import Path
launches = Path(sys.argv[1])
n = int(launches.read_text()) + 1 if launches.exists() else 1
launches.write_text(str(n))
if sys.argv[2] == "segfault" and n == 1:
    os.kill(os.getpid(), signal.SIGSEGV)
if sys.argv[2] == "abort" and n == 1:     # as std::terminate does
    os.abort()
if sys.argv[2] == "raise":
    raise ValueError("a Python error is a failure, not a crash")
"""


@pytest.mark.parametrize("how, launches, returncode", [("segfault", 2, 0), ("abort", 2, 0), ("raise", 1, 1)])
def test_only_a_native_crash_is_launched_again(tmp_path, how, launches, returncode):
    script = tmp_path / "crash_once.py"
    script.write_text(CRASH_ONCE)
    count = tmp_path / "launches"
    if how in ("segfault", "abort"):
        with pytest.warns(NativeCrashWarning, match="native crash"):
            done = torchrun(1, script, count, how, timeout=120)
    else:
        done = torchrun(1, script, count, how, timeout=120)
    assert int(count.read_text()) == launches
    assert (done.returncode == 0) == (returncode == 0), done.stderr[-2000:]
