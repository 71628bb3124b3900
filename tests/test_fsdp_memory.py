"""What FSDP's backward holds, counted by hand: the running gradient sum and the reduce-scatter's buffer.

The simulator (nanomega/sim/estimate.py: the real step on fake tensors, memory_tracker's categories) runs rank 0
of FSDP 2 on a model whose bytes are easy to count: d 256, 4 blocks (q and o 256 x 256, k and v 256 x 128, a
SwiGLU MLP of 3 x 256 x 1024, two norms), a 256-token vocabulary, untied head; full recomputation keeps the
activations out of the way. Every dim is even, so rank 0 holds exactly half of every parameter.

Two defects docs/memory.md found at Mixtral's FSDP 16 peak, each checked against the count it should hold:
- gradient accumulation: each micro-batch's reduced shards are added into the running sum as their
  reduce-scatter is waited (deferred.add_into), so the backward holds one sharded gradient set, not the sum
  beside the last micro-batch's own shards;
- the reduce-scatter: each gradient is converted to train.reduce_dtype by its copy into the packed buffer
  (packing.Bucket.reduce_scatter), not cast first: bf16 gradients reduced in fp32 no longer hold an fp32
  copy of the unit's gradients beside the buffer.
"""
from __future__ import annotations

from nanomega.config import parse_args
from nanomega.parallel.packing import Bucket
from nanomega.sim import estimate
from tiers import slow

D, FFN, VOCAB, LAYERS, KV = 256, 1024, 256, 4, 128     # KV: 2 kv heads of 64
ARGS = [f"--model.vocab_size={VOCAB}", "--model.vocab_multiple=1", f"--model.d_model={D}",
        f"--model.n_layers={LAYERS}", "--model.n_heads=4", "--model.n_kv_heads=2", f"--model.ffn_dim={FFN}",
        "--model.max_seq_len=16", "--train.batch_size=2", "--train.seq_len=8", "--train.compile=false",
        "--train.device=cpu", "--parallel.dp_shard=2", "--train.activation_checkpointing=full"]

BLOCK = 2 * D * D + 2 * D * KV + 3 * D * FFN + 2 * D      # attention, MLP, two norms
PARAMS = VOCAB * D + LAYERS * BLOCK + D + D * VOCAB       # embedding, blocks, final norm, head
SHARDED_SET = 4 * PARAMS // 2                              # rank 0's fp32 gradient shards, in bytes


def simulate(*args: str) -> dict:
    return estimate._in_child(estimate.simulate_rank, parse_args(ARGS + list(args)), 0)


def forward_backward(result: dict) -> dict:
    return result["phases"]["forward_backward"]


def test_the_hand_count_is_what_a_rank_holds():
    """The counts below are the model's: rank 0's gradients, as the optimizer receives them, are one set."""
    assert simulate("--train.grad_accum=1")["held_after"]["gradients"] == SHARDED_SET


def test_accumulated_gradients_peak_at_one_sharded_set():
    """With 2 and 3 micro-batches the forward-backward's peak holds exactly one set of gradient shards (the
    running sum; the last micro-batch's are added into it as their reduce-scatters are waited), where adding
    each micro-batch's gradients after its backward held the sum and the last micro-batch's own shards (2
    micro-batches here: 14.2 MB against 8.1). A third micro-batch adds nothing but its loss and stats scalars."""
    two, three = simulate("--train.grad_accum=2"), simulate("--train.grad_accum=3")
    assert forward_backward(two)["by_category"]["gradients"] == SHARDED_SET
    assert forward_backward(three)["by_category"]["gradients"] == SHARDED_SET
    assert 0 <= three["peak_bytes"] - two["peak_bytes"] <= 1024


@slow
def test_bf16_gradients_are_converted_by_their_copy_into_the_reduce_scatter_buffer(monkeypatch):
    """bf16 gathers reduced in fp32: the peak is at a block's reduce-scatter, and packing each gradient with a
    cast first (the former path, run here as the reference) holds exactly one more fp32 copy of that block's
    gradients, 4 bytes per parameter of the block."""
    bf16 = ["--train.param_dtype=bfloat16", "--train.reduce_dtype=float32", "--train.grad_accum=1"]
    converted = simulate(*bf16)
    former_path(monkeypatch.setattr)     # (its sum out of place changes nothing with one micro-batch)
    cast_first = simulate(*bf16)
    assert cast_first["peak_bytes"] - converted["peak_bytes"] == 4 * BLOCK


# ---------------------------------------------------------------- the same numbers as the former path, bitwise

FORMER_CASES = {   # tests/parity.py's model, FSDP 2: every path the change touches
    "sgd_3_micro": ["--parallel.dp_shard=2", "--train.grad_accum=3", "--optim.name=sgd"],
    "bf16_reduce_3_micro": ["--parallel.dp_shard=2", "--train.grad_accum=3", "--train.reduce_dtype=bfloat16"],
    "bf16_gathers_recomputed": ["--parallel.dp_shard=2", "--train.param_dtype=bfloat16",
                                "--train.activation_checkpointing=full"],
    "tied_3_micro": ["--parallel.dp_shard=2", "--train.grad_accum=3", "--model.tie_embeddings=true"],
    # the sum in place of what is not a reduce-scatter's (train/step.py GradientSums: deferred.add_in_place)
    "ddp_3_micro": ["--parallel.dp_replicate=2", "--train.grad_accum=3"],
    "zero1_3_micro_buckets": ["--parallel.dp_replicate=2", "--parallel.distributed_optimizer=true",
                              "--train.grad_accum=3", f"--parallel.bucket_mb={2_000 / 2**20}"],
    "tp_sp_3_micro_tied": ["--parallel.tp=2", "--parallel.sequence_parallel=true", "--train.grad_accum=3",
                           "--model.tie_embeddings=true"],
}


def former_path(monkeypatch_setattr) -> None:
    """The step as it was: no sum in place (each micro-batch added after its backward, the reducer adding the
    last; FSDP's shards and every other gradient alike), every gradient cast to the reduce dtype before it is
    packed."""
    import nanomega.train.step as step
    pack = Bucket.reduce_scatter
    monkeypatch_setattr(step, "add_into", lambda total, g, n=1: False)
    monkeypatch_setattr(step, "add_in_place", lambda total, g, n=1: False)
    monkeypatch_setattr(Bucket, "reduce_scatter",
                        lambda self, grads, dtype=None: pack(self, [g.to(dtype) for g in grads], dtype))


@slow
def test_the_step_computes_the_former_paths_numbers_bit_for_bit(tmp_path):
    """Losses, gradient norms and every final parameter of 3 steps equal (torch.equal) those of the former path
    (`former_path`), on 2 gloo ranks: the in-place sum is (earlier + g) / n in the same order, the copy into the
    buffer the same rounding as the cast."""
    import json
    from ranks import crash_report, torchrun
    proc = torchrun(2, __file__, tmp_path, json.dumps(FORMER_CASES))
    assert proc.returncode == 0, crash_report(proc.stderr)
    import torch
    for name in FORMER_CASES:
        new, former = torch.load(tmp_path / f"{name}.pt"), torch.load(tmp_path / f"{name}.former.pt")
        assert "error" not in new and "error" not in former, (new.get("error"), former.get("error"))
        assert (new["losses"], new["grad_norms"]) == (former["losses"], former["grad_norms"]), name
        assert all(torch.equal(new["params"][n], former["params"][n]) for n in former["params"]), name


def _worker(out_dir: str, cases_json: str) -> None:
    import json
    import os
    from pathlib import Path
    import torch
    import parity
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    for name, args in json.loads(cases_json).items():
        for suffix in ("", ".former"):
            undo = []
            if suffix:
                former_path(lambda obj, attr, value: (undo.append((obj, attr, getattr(obj, attr))),
                                                      setattr(obj, attr, value)))
            try:
                result = parity.run(args)
            except Exception:
                import traceback
                result = {"error": traceback.format_exc()}
            for obj, attr, value in reversed(undo):
                setattr(obj, attr, value)
            if rank == 0:
                torch.save(result, Path(out_dir) / f"{name}{suffix}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    import sys
    _worker(sys.argv[1], sys.argv[2])
