"""The optimizer's share of the step (nanomega/sim/step_time.py's phases, factorization counts and amortization;
bench/optimizer_cost.py) against references that do not use them.

- Factorizations: the FLOPs charged to eigh, QR, Cholesky and solve equal the LAPACK counts by hand.
- Muon: the update's matmul FLOPs equal 5 Newton-Schulz steps x (4 m^2 n + 2 m^3) summed over the hidden
  matrices' shapes (m <= n), written out from the parameters.
- Shampoo: the refresh branch's factorization FLOPs are one eigh (9 n^3) per factor of each hidden matrix.
- The phases (forward + backward, update) sum to the step, compute, exposure and bytes alike.
- Amortization: the amortized step is the steady step plus the refresh step's extra over the frequency, and
  that extra is the cost of the refresh branch's ops less the keep branch's, summed op by op from the trace.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanomega.config import parse_args                            # noqa: E402
from nanomega.sim.devices import Efficiency, device                   # noqa: E402
from nanomega.models import init                                  # noqa: E402
from nanomega import optim                                        # noqa: E402
from nanomega.optim import hidden_matrix                          # noqa: E402
from nanomega.parallel.mesh import model_config                   # noqa: E402
from nanomega.sim.step_time import (StepTrace, branches, branches_of, op_seconds, time_step, trace,  # noqa: E402
                                update_cost)

TINY = ["--model.vocab_size=256", "--model.vocab_multiple=1", "--model.d_model=64", "--model.n_layers=2",
        "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=160", "--model.max_seq_len=64",
        "--train.batch_size=2", "--train.seq_len=64", "--train.compile=false"]
H100 = device("h100")


def _hidden_shapes(cfg) -> list[tuple[int, int]]:
    from torch.utils._pytree import keystr, tree_flatten_with_path
    params = init(model_config(cfg), 0, "meta")
    return [tuple(p.shape) for path, p in tree_flatten_with_path(params)[0]
            if hidden_matrix(keystr(path).replace("['", ".").replace("']", "").replace("[", ".").replace("]", "")
                             .lstrip("."), p)]


def _charged(run) -> list[tuple]:
    with StepTrace() as tracer:
        run()
    return [op for op in tracer.op_costs if op[0] == "linalg"]


def test_factorizations_are_charged_their_lapack_flop_counts():
    a = torch.empty(3, 8, 5, device="meta")
    s = torch.empty(2, 6, 6, device="meta")
    (qr,) = _charged(lambda: torch.linalg.qr(a))
    assert qr[1] == pytest.approx(3 * 2 * (2 * 8 * 5 ** 2 - 2 * 5 ** 3 / 3))     # R and the thin Q, each
    (r_only,) = _charged(lambda: torch.linalg.qr(a, mode="r"))
    assert r_only[1] == pytest.approx(3 * (2 * 8 * 5 ** 2 - 2 * 5 ** 3 / 3))
    (eigh,) = _charged(lambda: torch.linalg.eigh(s))
    assert eigh[1] == pytest.approx(2 * 9 * 6 ** 3)
    (chol,) = _charged(lambda: torch.linalg.cholesky(s))
    assert chol[1] == pytest.approx(2 * 6 ** 3 / 3)
    (solve,) = _charged(lambda: torch.linalg.solve(s, torch.empty(2, 6, 4, device="meta")))
    assert solve[1] == pytest.approx(2 * (2 * 6 ** 3 / 3 + 2 * 6 * 6 * 4))
    # charged at the fp32 peak times the factorization efficiency, not at the matmul rate
    seconds = op_seconds("linalg", 1e12, 0, H100, Efficiency())
    assert seconds == pytest.approx(1e12 / (67e12 * Efficiency().linalg) + Efficiency().kernel_s)


def test_muon_update_flops_are_five_newton_schulz_steps_over_the_hidden_matrices():
    cfg = parse_args(TINY + ["--optim.name=muon"])
    tr = trace(cfg)
    traced = sum(op[1] for op in tr["ops"] if op[6] == "update" and op[0] == "matmul")
    shapes = _hidden_shapes(cfg)
    assert len(shapes) == 7 * cfg.model.n_layers
    by_hand = 0
    for rows, cols in shapes:
        m, n = min(rows, cols), max(rows, cols)
        steps = optim.check(cfg.optim).ns_steps
        by_hand += steps * (2 * m * m * n + 2 * m ** 3 + 2 * m * m * n)   # X X^T, b A + c A A, B X
    assert traced == by_hand


def test_shampoo_refresh_is_one_eigh_per_factor_and_amortizes_over_the_frequency():
    cfg = parse_args(TINY + ["--optim.name=shampoo", "--optim.precondition_frequency=4"])
    tr = trace(cfg)
    assert branches_of(tr) <= set(branches()), "a new optim.linalg.branch: give it a role in its Optimizer.branches"
    refresh_fn = "scale_by_shampoo.<locals>.refresh_roots.<locals>.compute"
    keep_fn = "scale_by_shampoo.<locals>.refresh_roots.<locals>.keep"
    retry_fn = "matrix_inverse_root.<locals>.retry"
    eigh = sum(op[1] for op in tr["ops"] if op[0] == "linalg" and refresh_fn in op[7] and retry_fn not in op[7])
    assert eigh == sum(9 * (r ** 3 + c ** 3) for r, c in _hidden_shapes(cfg))      # blocks of 1,024 hold them whole

    eff = Efficiency()

    def cost(fn):   # the ops of one branch, timed one by one (no communication in a one-rank step)
        return sum(op_seconds(op[0], op[1], op[2], H100, eff, fp32=op[5]) for op in tr["ops"]
                   if fn in op[7] and retry_fn not in op[7])
    (r,) = update_cost(cfg, "h100", (eff,))
    extra = cost(refresh_fn) - cost(keep_fn)
    assert extra > 0
    assert r["refresh"]["step_s"] - r["steady"]["step_s"] == pytest.approx(extra, rel=1e-9)
    assert r["amortized"]["step_s"] == pytest.approx(r["steady"]["step_s"] + extra / 4, rel=1e-9)
    # the update's amortized compute moves by the same amount: the refresh is all in the update phase
    steady_update = r["steady"]["phases"]["update"]["compute_s"]
    assert r["amortized"]["phases"]["update"]["compute_s"] == pytest.approx(steady_update + extra / 4, rel=1e-9)


def test_the_phases_sum_to_the_step_under_fsdp():
    cfg = parse_args(TINY + ["--optim.name=muon", "--parallel.dp_shard=2"])
    tr = trace(cfg)
    r = time_step(tr, H100)
    phases = r["phases"]
    assert {"forward_backward", "update"} <= set(phases)
    assert sum(p["compute_s"] + p["exposed_s"] for p in phases.values()) == pytest.approx(r["step_s"], rel=1e-12)
    assert sum(p["compute_s"] for p in phases.values()) == pytest.approx(r["compute_s"], rel=1e-12)
    assert sum(p["exposed_s"] for p in phases.values()) == pytest.approx(sum(r["exposed_s"].values()), rel=1e-12)
    sent = {ph: sum(e["bytes_sent"] for e in tr["schedule"] if e["phase"] == ph) for ph in phases}
    assert {ph: p["comm_bytes"] for ph, p in phases.items()} == sent
    # Muon's owners: whole matrices gathered to their owner and updates sent back, all in the update phase
    assert phases["update"]["comm_bytes"] > 0
    assert any(e["kind"] == "all_to_all" and e["phase"] == "update" for e in tr["schedule"])


def test_kimi_layouts_are_the_planners_and_other_optimizers_drop_muons_settings():
    """bench/optimizer_cost.py's kimi_k2 layouts are the planner's two best on 2,048 H100 (docs/performance.md),
    spelled as plan.Candidate spells them; AdamW and SOAP there drop the config's Muon settings, which they
    would refuse, and keep their own."""
    sys.path.insert(0, str(ROOT / "bench"))
    import optimizer_cost
    from nanomega.sim.plan import Candidate
    planned = {"kimi": (Candidate(tp=1, pp=1, schedule="", virtual=1, dp_replicate=1, dp_shard=2048, micro=2,
                                  recompute="full", ep=128), 1),
               "kimi_tp": (Candidate(tp=2, pp=1, schedule="", virtual=1, dp_replicate=256, dp_shard=4, micro=1,
                                     recompute="full", ep=128), 4)}
    for layout, (candidate, grad_accum) in planned.items():
        cfg = optimizer_cost.layout_config(layout, "muon")
        assert cfg == parse_args(["--config=kimi_k2"] + candidate.flags(4096, grad_accum))
        assert cfg.train.batch_size * cfg.train.seq_len * cfg.train.grad_accum == 16_777_216
        assert dict(cfg.optim.settings) == {"muon_scale": "match_adam"}
    with pytest.raises(ValueError, match="muon_scale is not read by adamw"):
        optim.check(parse_args(optimizer_cost.LAYOUTS["kimi"][1] + ["--optim.name=adamw"]).optim)
    adamw = optimizer_cost.layout_config("kimi", "adamw").optim
    assert adamw.settings == () and optim.check(adamw) == optim.check(parse_args(["--optim.name=adamw"]).optim)
    soap = optimizer_cost.layout_config("kimi", "soap_16k").optim
    assert soap.name == "soap" and dict(soap.settings) == {"max_precond_dim": 16384}
