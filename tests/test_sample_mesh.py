"""The end-of-run sample under torchrun runs on the mesh with the sharded parameters: the same text as the
serial model's greedy sample on those parameters, and the whole model is never gathered onto one rank. That it
keeps NCCL's contracts and reads nothing on the host: tests/test_contracts.py (its "sample" phase)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nanomega.config import parse_args
from nanomega.data.sources import ByteTokenizer
from nanomega.eval.generate import sample
from nanomega.parallel.gather_checkpoint import whole_params
from test_train import tiny_args
from ranks import crash_report, torchrun
from tiers import slow

ROOT = Path(__file__).resolve().parent.parent

# train.py with every way of gathering the whole model onto one rank made to fail
NO_WHOLE_MODEL = """
import sys
import train
from nanomega.parallel.parallelize import Parallel
from nanomega.parallel.pipeline import Pipeline

def refuse(self, *args, **kwargs):
    raise AssertionError("the whole model was gathered onto one rank")

Parallel.full_on_main = Parallel.full = Pipeline.full_on_main = refuse
train.main(sys.argv[1:])
"""


def printed_sample(stdout: str) -> str:
    return stdout.split("--- sample ---\n", 1)[1].rsplit("\n--------------", 1)[0]


@slow    # train.py under torchrun: the slow tier (tests/tiers.py)
@pytest.mark.parametrize("layout", [["--parallel.dp_shard=2", "--parallel.tp=2", "--parallel.sequence_parallel=true"], ["--parallel.pp=2"],
                                    ["--parallel.cp=2", "--parallel.dp_shard=2"]],
                         ids=["fsdp2_tp2_sp", "pp2", "cp2_fsdp2"])
def test_the_parallel_sample_is_the_serial_models_and_gathers_no_whole_model(corpus, tmp_path, one_thread, layout):
    out = tmp_path / "run"
    args = tiny_args(corpus, out, "--train.steps=2", "--train.ckpt_every=2", "--train.eval_every=2",
                     "--train.sample_tokens=24", "--train.temperature=0", "--train.grad_accum=2",
                     "--train.sample_prompt=def ", *layout)     # the prompt named: a corpus's default is its own text
    cfg = parse_args(args)
    driver = tmp_path / "train_without_whole_model.py"
    driver.write_text(NO_WHOLE_MODEL)
    done = torchrun(cfg.parallel.world_size, driver, *args, env={"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, crash_report(done.stderr)
    assert done.stdout.count("--- sample ---") == 1, done.stdout[-2000:]     # every rank samples, one prints

    params, _ = whole_params(out / "ckpt-00000002")     # the parameters the run sampled with, whole, here
    prompt = torch.tensor([ByteTokenizer().encode("def ")])
    serial = sample(params, cfg.model, prompt, 24, temperature=0)
    assert printed_sample(done.stdout) == ByteTokenizer().decode(serial[0].tolist())
