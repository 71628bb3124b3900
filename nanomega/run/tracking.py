"""Experiment tracking: rank 0 mirrors each metrics.jsonl record into TensorBoard or Weights & Biases.

metrics.jsonl (nanomega.run.metrics.MetricsLog) stays the record of a run; a tracker only shows the same numbers,
step by step, in a dashboard. Both backends are optional extras (pyproject.toml), imported only when chosen:
`require_tracker` imports the chosen one before any training work, so a missing package stops the run at
once with the pip command that installs it, not at the first logged step.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path

# tracker -> (the module whose import proves it usable, the pip command that installs it)
PACKAGES = {"tensorboard": ("torch.utils.tensorboard", "pip install tensorboard  (or: pip install 'nanomega[tensorboard]')"),
            "wandb": ("wandb", "pip install wandb  (or: pip install 'nanomega[wandb]')")}


def require_tracker(name: str):
    """The chosen backend's module (None for "none"), or a ValueError that says what to install. A real
    import, not a lookup: torch.utils.tensorboard is part of torch but fails without the tensorboard package."""
    if name == "none":
        return None
    module, pip = PACKAGES[name]
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ValueError(f"--train.tracker={name} needs a package that is not installed ({err}); "
                         f"{pip}, or pass --train.tracker=none") from None


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers as flat scalar tags, "step" left out (it is the x-axis): a list (one value per MoE
    layer) becomes name/0, name/1, ...; a dict name/key. Strings and other non-numbers are not scalars."""
    out = {}

    def visit(name: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                visit(f"{name}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(f"{name}/{i}", v)
        elif isinstance(value, (int, float)):          # bool is an int: logged as 0 / 1
            out[name] = float(value)

    for key, value in record.items():
        if key != "step":
            visit(key, value)
    return out


class TensorBoardTracker:
    """A SummaryWriter on <out_dir>/tb; each record's scalars at its step. A resumed run adds an event file
    next to the old ones, and TensorBoard shows both as one run."""

    def __init__(self, module, out_dir: str, config: dict):
        self.writer = module.SummaryWriter(log_dir=str(Path(out_dir) / "tb"))
        self.writer.add_text("config", "    " + "\n    ".join(_config_lines(config)), 0)   # indented: shown as code

    def log(self, record: dict) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()                            # as metrics.jsonl: what was logged survives a kill

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A wandb run named after out_dir's folder, with the whole config. WANDB_MODE=offline writes the run to
    disk only (no network, `wandb sync` uploads it later); WANDB_PROJECT picks the project (default
    "nanomega"); its files go under WANDB_DIR, or out_dir when that is not set."""

    def __init__(self, module, out_dir: str, config: dict):
        self.wandb = module
        name = Path(out_dir).resolve().name
        self.run = module.init(project=os.environ.get("WANDB_PROJECT", "nanomega"), name=name, config=config,
                               dir=os.environ.get("WANDB_DIR", out_dir))

    def log(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        """Finish the run, then wait until its files are on disk. run.finish() returns once the service process
        (wandb-core) has the run's last record, and only tells it, without waiting, to close the run's stream:
        the offline run file may still hold nothing but its header when finish() returns. wandb.teardown()
        waits for the service to close every stream and stop, so when train() returns `wandb sync` (or a
        reader) finds the whole run; the next wandb.init starts a new service."""
        self.run.finish()
        self.wandb.teardown()


def open_tracker(name: str, out_dir: str, config: dict):
    """The tracker for train.tracker (None for "none"); `config` is the run's config as a plain dict."""
    module = require_tracker(name)
    if module is None:
        return None
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}[name](module, out_dir, config)


def _config_lines(config: dict, prefix: str = "") -> list[str]:
    lines = []
    for key, value in config.items():
        if isinstance(value, dict):
            lines += _config_lines(value, f"{prefix}{key}.")
        else:
            lines.append(f"{prefix}{key} = {value!r}")
    return lines

