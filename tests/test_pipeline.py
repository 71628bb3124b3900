"""Pipeline parallel equals serial: each schedule, and pp composed with data and tensor parallel.

The harness is tests/test_parallel.py's (tests/parity.py under torchrun on gloo, the serial run of the
same model, data and seed; losses and gradient norms at every step and the final parameters within
1e-5 relative). The model is the parity model with 4 blocks (`deep`), so that pp = 2 with two virtual
stages per rank (interleaved 1F1B, ZB-V) still gives every stage a block; 4 micro-batches per step.
"""
from __future__ import annotations

import shutil

import pytest
import torch

import test_parallel as tp
from nanomega.config import parse_args
from nanomega.parallel import schedules
from tiers import selected, slow, tiered

DEEP = ["--model.n_layers=4", "--train.grad_accum=4"]

LAYOUTS = {
    "pp2_1f1b": ["--parallel.pp=2"],
    "pp2_gpipe": ["--parallel.pp=2", "--parallel.pp_schedule=gpipe"],
    "pp2_interleaved": ["--parallel.pp=2", "--parallel.pp_virtual=2", "--parallel.pp_schedule=interleaved_1f1b"],
    "pp2_zbv": ["--parallel.pp=2", "--parallel.pp_virtual=2", "--parallel.pp_schedule=zb_v"],
    "pp2_uneven": ["--parallel.pp=2", "--parallel.pp_layers=3,1"],
    "pp2_dp2": ["--parallel.pp=2", "--parallel.dp_replicate=2"],
    "pp2_tp2_sp": ["--parallel.pp=2", "--parallel.tp=2", "--parallel.sequence_parallel=true"],
    "pp2_fsdp2": ["--parallel.pp=2", "--parallel.dp_shard=2"],
    "pp2_zbv_fsdp2_ac": ["--parallel.pp=2", "--parallel.pp_virtual=2", "--parallel.pp_schedule=zb_v",
                         "--parallel.dp_shard=2", "--train.activation_checkpointing=full"],
    "pp2_ep2": ["--parallel.pp=2", "--parallel.dp_replicate=2", "--parallel.ep=2"],
    "pp2_zbv_ep2": ["--parallel.pp=2", "--parallel.pp_virtual=2", "--parallel.pp_schedule=zb_v",
                    "--parallel.dp_shard=2", "--parallel.ep=2"],
    "pp2_moe": ["--parallel.pp=2"],
}
LAYOUTS.update({    # 8 processes, three or four dims
    "pp2_cp2_tp2": ["--parallel.pp=2", "--parallel.cp=2", "--parallel.tp=2", "--parallel.sequence_parallel=true"],
    "pp2_dp2_tp2": ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.tp=2"],
    "pp2_dp2_ep2_tp2": ["--parallel.pp=2", "--parallel.dp_replicate=2", "--parallel.ep=2", "--parallel.tp=2"],
})
WORLD = {name: parse_args(tp.parity.BASE + args).parallel.world_size for name, args in LAYOUTS.items()}
CASES = [("pp2_1f1b", "adamw"), ("pp2_1f1b", "muon"), ("pp2_gpipe", "adamw"), ("pp2_interleaved", "adamw"),
         ("pp2_zbv", "adamw"), ("pp2_zbv", "sgd"), ("pp2_uneven", "shampoo"), ("pp2_uneven", "sgd"),
         ("pp2_dp2", "adamw"), ("pp2_tp2_sp", "adamw"), ("pp2_fsdp2", "muon"), ("pp2_zbv_fsdp2_ac", "adamw"),
         # MoE: the router losses of every stage in the objective, experts folded onto each stage's ranks
         ("pp2_moe", "adamw+moe"), ("pp2_ep2", "adamw+moe"), ("pp2_ep2", "sgd+deepseek"), ("pp2_zbv_ep2", "muon+moe"),
         # fp8: amaxes reduced within a stage; delayed scaling's histories combined by max over micro-batches
         ("pp2_1f1b", "sgd+fp8_delayed"), ("pp2_zbv", "sgd+fp8_rowwise"), ("pp2_tp2_sp", "sgd+fp8_tensorwise"),
         ("pp2_interleaved", "adamw+docs")]     # document masking: every stage makes its own mask from the tokens
# 8 processes on this machine's 2 cores take ~2 min: behind the `ranks8` marker, which the default run
# leaves out and .ci/run runs on its own
CASES_8 = [("pp2_cp2_tp2", "adamw"), ("pp2_dp2_tp2", "muon"), ("pp2_dp2_ep2_tp2", "adamw+moe")]


def args_of(layout, opt):
    return LAYOUTS[layout] + DEEP + tp.label_args(opt, "train")


FAST = {("pp2_1f1b", "adamw")}     # the fast tier's pipeline case; the rest is the slow tier's


def case_of(item) -> tuple:
    return item.callspec.params["layout"], item.callspec.params["opt"]


def parity_cases(item) -> list:
    """The parity case a collected test reads, for tests/conftest.py's parity_launch (one launch per world size)."""
    layout, opt = case_of(item)
    return [(WORLD[layout], "train", args_of(layout, opt))]


def launched(request, fixture: str, parity_launch: dict) -> dict:
    """{case name: result} of the selected tests' cases, from the session's launches."""
    return {f"{layout}-{opt}": parity_launch["train", tuple(args_of(layout, opt))]
            for layout, opt in selected(request, fixture, case_of)}


@pytest.fixture(scope="module")
def results(request, parity_launch):
    return launched(request, "results", parity_launch)


@pytest.fixture(scope="module")
def results_8(request, parity_launch):
    return launched(request, "results_8", parity_launch)


_serial: dict = {}


def serial(opt, split=False):
    """The serial run of the deep model (split: every micro-batch halved, tests/test_parallel.py's reordering)."""
    if (opt, split) not in _serial:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _serial[opt, split] = tp.parity.run(DEEP + tp.label_args(opt, "train", serial=True), split)
        finally:
            torch.set_num_threads(threads)
    return _serial[opt, split]


@pytest.mark.parametrize("layout,opt", tiered(CASES, FAST))
def test_pipeline_trains_like_the_serial_run(results, layout, opt):
    got = results[f"{layout}-{opt}"]
    assert "error" not in got, got.get("error")
    tp.assert_trains_like(got, serial(opt), reordered=tp.reordering(opt, lambda: serial(opt, split=True)),
                          **tp.fp8_bounds(opt))     # fp8: float8 rounding flips (tests/test_parallel.py)
    assert_posts_the_program(got["transfers"], parse_args(tp.parity.BASE + args_of(layout, opt)))


def assert_posts_the_program(posted: list, cfg) -> None:
    """Every rank posted, in the last step, exactly the batches of transfers schedules.p2p_program gives its
    pipeline rank: the program whose completion under blocking sends tests/test_schedules.py proves."""
    p = cfg.parallel
    placement = schedules.stage_ranks(p.pp, p.pp_virtual, "v" if p.pp_schedule == "zb_v" else "loop")
    args = (p.pp, cfg.train.grad_accum) + ((p.pp_virtual,) if p.pp_schedule == "interleaved_1f1b" else ())
    program = schedules.p2p_program(schedules.SCHEDULES[p.pp_schedule](*args), placement)
    for rank, batches in enumerate(posted):
        pp_rank = rank // (p.world_size // p.pp)          # pp is the outermost mesh dim
        expected = [[tuple(t) for t in item] for item in program[pp_rank] if isinstance(item, list)]
        assert batches == expected, f"rank {rank} (pp rank {pp_rank}) posted other batches than its program"


@pytest.mark.ranks8
@pytest.mark.parametrize("layout,opt", CASES_8)
def test_eight_process_layouts_mixing_three_dims_train_like_the_serial_run(results_8, layout, opt):
    got = results_8[f"{layout}-{opt}"]
    assert "error" not in got, got.get("error")
    tp.assert_trains_like(got, serial(opt), reordered=tp.reordering(opt, lambda: serial(opt, split=True)),
                          **tp.fp8_bounds(opt))     # fp8: float8 rounding flips (tests/test_parallel.py)


@slow
def test_train_py_with_pipeline_tensor_and_expert_parallel_equals_serial_and_resumes_bitwise(corpus, tmp_path,
                                                                                            one_thread):
    """`torchrun --nproc-per-node 4 train.py --parallel.pp=2 --parallel.tp=2 --parallel.sequence_parallel=true
    --parallel.ep=2 --train.grad_accum=4` on an MoE model with a balancing loss and moving expert biases:
    the serial run's losses at every step and its validation loss (evaluation runs through the stages);
    one end-of-run sample (the parameters whole on rank 0); the per-rank checkpoint (each rank its
    stage's tp shards and its experts) reassembles to the serial parameters, expert biases included;
    the run resumes bitwise from step 2; sample.py reads it."""
    from safetensors.torch import load_file

    import train as train_script
    from nanomega.config import parse_args
    from nanomega.parallel.gather_checkpoint import whole_params
    from nanomega.tree import named_leaves
    from test_parallel_train import assert_same_checkpoint_files, assert_samples_at_step, torchrun
    from test_train import read_metrics, tiny_args

    out = tmp_path / "pp"
    common = ["--train.steps=4", "--train.ckpt_every=2", "--train.eval_every=4", "--train.keep_checkpoints=5",
              "--model.n_layers=4", "--train.grad_accum=4", "--model.n_experts=4", "--model.top_k=2",
              "--model.expert_ffn_dim=32", "--model.aux_loss_coef=0.01", "--model.expert_bias_rate=0.01"]
    layout = ["--parallel.pp=2", "--parallel.tp=2", "--parallel.sequence_parallel=true", "--parallel.ep=2"]
    par = torchrun(4, tiny_args(corpus, out, *common, *layout, "--train.sample_tokens=8"))
    assert par.returncode == 0, par.stderr[-3000:]
    assert par.stdout.count("--- sample ---") == 1, par.stdout[-2000:]
    train_script.train(parse_args(tiny_args(corpus, tmp_path / "serial", *common)), quiet=True)
    got, want = read_metrics(out / "metrics.jsonl"), read_metrics(tmp_path / "serial" / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(got, want):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * b["grad_norm"], (a["step"], a["grad_norm"], b["grad_norm"])
    assert abs(got[-1]["val_loss"] - want[-1]["val_loss"]) <= 1e-5 * want[-1]["val_loss"]
    final = out / "ckpt-00000004"
    whole, meta = whole_params(final)
    serial = load_file(tmp_path / "serial" / "ckpt-00000004" / "params.safetensors")
    assert meta["layout"]["pp"] == 2 and named_leaves(whole).keys() == serial.keys()
    for name, p in named_leaves(whole).items():
        assert (p - serial[name]).norm() <= 1e-5 * serial[name].norm() + 1e-7, name
    # the balancing rule acts on both stages: one step moves every bias by +-rate (after an even number of steps a
    # bias may be back at 0, as some are here); the losses above compare the routing it steers at every step
    one = tmp_path / "one"
    first = [a for a in common if not a.startswith(("--train.steps=", "--train.ckpt_every="))]
    train_script.train(parse_args(tiny_args(corpus, one, *first, "--train.steps=1", "--train.ckpt_every=1")), quiet=True)
    moved = load_file(one / "ckpt-00000001" / "params.safetensors")
    assert all(moved[f"layers.{i}.moe.router.expert_bias"].abs().min() > 0 for i in range(4))
    assert "lm_head.weight" not in load_file(final / "params-rank00000.safetensors")   # stage 0: no head

    straight = tmp_path / "straight"
    shutil.move(final, straight)                      # as if the run had died after step 2
    resumed = torchrun(4, tiny_args(corpus, out, *common, *layout, "--train.resume=true"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = read_metrics(out / "metrics.jsonl")[4:]
    assert [r["step"] for r in records] == [3, 4]
    for r, s in zip(records, got[2:]):
        assert r["loss"] == s["loss"]   # bitwise
    assert_same_checkpoint_files(straight, final)
    assert_samples_at_step(out, 4)


def test_a_pipeline_is_a_case_of_the_layout_the_step_evaluation_and_sample_ask_for():
    """`par` is one protocol (parallelize.Layout): the step, validation and the sample call its members on a
    Parallel and on a Pipeline alike, with no test of which it is; each class carries every member, and the
    whole-model gather exists once (parallelize.gathered_on_main), which both classes' full_on_main use."""
    import inspect
    from nanomega.parallel.parallelize import Layout, Parallel
    from nanomega.parallel.pipeline import Pipeline
    members = [n for n in vars(Layout) if not n.startswith("_")]
    assert set(members) >= {"unit_par", "grads", "cross_entropy", "logits_at", "full_on_main", "layout_key"}
    for cls in (Parallel, Pipeline):
        assert all(hasattr(cls, n) for n in members), [n for n in members if not hasattr(cls, n)]
        assert "gathered_on_main" in inspect.getsource(cls.full_on_main)
        for n in ("grads", "cross_entropy", "logits_at"):
            assert list(inspect.signature(getattr(cls, n)).parameters) == \
                list(inspect.signature(getattr(Layout, n)).parameters), (cls.__name__, n)
