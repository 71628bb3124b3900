"""--train.profile: a torch.profiler trace of chosen steps, on every rank, that Perfetto (ui.perfetto.dev) and
TensorBoard's profiler open, and on CUDA a memory snapshot of the same steps (pytorch.org/memory_viz opens it).

    python train.py --train.profile=4          # step 4 (the loop's step numbers, as the log prints them)
    python train.py --train.profile=4:6        # steps 4, 5 and 6
    python -m nanomega.run.measured runs/x     # the measured split beside the step-time model's (measured.py)

Written under <out_dir>/profile/: trace-rank<r>.json (chrome trace JSON), memory-rank<r>.pickle (CUDA only) and,
from rank 0, run.json (the config, the steps, the world and each rank's threads: what measured.py needs to
predict the same run). Each profiled step is a "ProfilerStep#<n>" annotation, as torch.profiler's own schedule
names it (HolisticTraceAnalysis reads those), and inside it "nanomega: forward_backward" and "nanomega: update"
(annotate), so a reader splits the step the way the step-time model's phases do.

Off (the default, ""), train.py makes no StepProfile and calls nothing here: no cost. Earlier steps are left out
on purpose: the first steps compile and warm the allocator, which is not the steady step a user asks about.
"""
from __future__ import annotations

import json
import os
from contextlib import nullcontext
from pathlib import Path

import torch

from nanomega.config.schema import profile_steps

FOLDER = "profile"


class StepProfile:
    """Starts torch.profiler (and on CUDA the allocator's history) before the first chosen step, annotates each
    step, and writes the rank's files after the last. train.py calls begin(step) before a step and end(step)
    after it, `step` being the count of steps done so far / just done."""

    def __init__(self, spec: str, steps: int, out_dir: str, device: torch.device, config: dict | None = None):
        self.first, self.last = profile_steps(spec, steps)
        self.folder = Path(out_dir) / FOLDER
        self.cuda = device.type == "cuda"
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.config = config
        self._profiler = None
        self._step = nullcontext()

    def annotate(self, fns):
        """The step functions (train/step.py's StepFns) with each call inside a named annotation."""
        def named(name, fn):
            def run(*args, **kwargs):
                with torch.profiler.record_function(f"nanomega: {name}"):
                    return fn(*args, **kwargs)
            return run
        return fns._replace(grads=named("forward_backward", fns.grads), update=named("update", fns.update))

    def begin(self, done: int) -> None:
        step = done + 1
        if step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.memory._record_memory_history(max_entries=200_000)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.start()
        if self._profiler is not None:
            self._step = torch.profiler.record_function(f"ProfilerStep#{step}")
            self._step.__enter__()

    def end(self, done: int) -> None:
        if self._profiler is None:
            return
        if self.cuda:
            torch.cuda.synchronize()        # the step's kernels end inside its annotation's trace
        self._step.__exit__(None, None, None)
        self._step = nullcontext()
        if done == self.last:
            self._write()

    def _write(self) -> None:
        self._profiler.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._profiler.export_chrome_trace(str(self.folder / f"trace-rank{self.rank}.json"))
        if self.cuda:
            torch.cuda.memory._dump_snapshot(str(self.folder / f"memory-rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        self._profiler = None
        threads = [torch.get_num_threads()]
        if self.world > 1:
            gathered = [None] * self.world
            torch.distributed.all_gather_object(gathered, threads[0])
            threads = gathered
        if self.rank == 0:
            info = {"steps": [self.first, self.last], "world_size": self.world, "threads": threads,
                    "device": "cuda" if self.cuda else "cpu", "cores": len(os.sched_getaffinity(0))
                    if hasattr(os, "sched_getaffinity") else os.cpu_count(), "config": self.config}
            (self.folder / "run.json").write_text(json.dumps(info, indent=1))
