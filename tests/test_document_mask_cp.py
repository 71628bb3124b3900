"""Document-masked attention under context parallel (nanomega/parallel/context.py) against the serial mask.

- The plan, on the host: for cp 2 and 4 and random packings, a block of (queries, keys) is skipped exactly where
  no row's query sees a key of its own document in it, runs with the documents' mask exactly where documents hide
  one of its causal pairs in some row, and the blocks run cover each visible pair once.
- Attention on real ranks: one torchrun launch of 4 processes (tests/context_worker.py ... documents) runs both
  methods, each block by the CPU's fused kernel (taking the mask) and by the plain fallback, cp 4 over the world
  and cp 2 on a 2x2 mesh, for packings with a document across chunks and ranks, many short ones, rows packed
  differently, a row that is one document, and every token its own (context_worker.document_runs: every packing for
  GQA on the fused kernel, two for the plain kernel, MLA and bfloat16); outputs and gradients of q, k, v equal SDPA
  on the whole sequence with hints.same_document's mask, in float64 (to 1e-12; MLA's narrower value heads, and
  bfloat16 to its rounding). Every rank's count of fused kernel calls is the count of blocks whose documents
  meet, found from the serial mask: the blocks that do not are skipped, the others are not.
- Under a fake mode (the simulator) document ids have no values: every causally visible block runs masked (the
  worst case), on CUDA's memory-efficient kernel (FlashAttention-2 takes no mask), holding no block's scores in
  the plain path, and the peak is not below the unmasked one; `python -m nanomega.sim.estimate` runs with the
  mask under cp; the contract checker counts the forward's one host read within the layout's budget.
- Training: tests/test_parallel.py's ("cp2", "adamw+docs"), ("cp2_ring", "sgd+docs"), ("cp2_tp2_sp", "muon+docs")
  against the serial run with the same mask (slow tier).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from context_worker import CASES, DOCUMENTS, METHODS, document_runs
from ranks import crash_report, torchrun
from test_context import TOLERANCE, simulated_attention
from tiers import slow
from nanomega.hints import same_document
from nanomega.parallel.context import _blocks, _document_mask, documents_of, shard_indices

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {"cp4": 4, "cp2mesh": 2}     # the worker's layouts and their cp


# ------------------------------------------------------------------ the plan

def packings(T: int):
    """(name, opens [B, T]): random packings from long documents to single tokens, and rows unlike each other."""
    gen = torch.Generator().manual_seed(0)
    for rate in (0.03, 0.1, 0.3, 0.7):
        yield f"random{rate}", torch.rand(3, T, generator=gen) < rate
    yield "rows_differ", torch.stack([torch.zeros(T, dtype=torch.bool), torch.arange(T) % 5 == 2,
                                      torch.arange(T) == T // 2])


@pytest.mark.parametrize("cp", [2, 4])
def test_blocks_are_skipped_where_documents_do_not_meet_and_masked_where_they_cut(cp):
    T = 48
    for name, opens in packings(T):
        documents = documents_of(opens)
        visible = same_document(opens)[:, 0]                              # [B, T, T]: the serial mask
        for r in range(cp):
            q_pos = shard_indices(T, cp, r)
            for j in range(cp):
                k_pos = shard_indices(T, cp, j)
                want = visible[:, q_pos][:, :, k_pos]                      # [B, tq, tk]
                covered = torch.zeros(want.shape, dtype=torch.int64)
                for qs, ks, causal, position_mask, by_documents in _blocks(q_pos, k_pos, documents.bounds):
                    part, pattern = want[:, qs, ks], q_pos[qs][:, None] >= k_pos[ks][None, :]
                    assert part.any(), (name, r, j)                        # run only where some row's pair meets
                    if by_documents is None:     # documents hide none of its causal pairs, in any row
                        assert torch.equal(part, pattern.expand_as(part)), (name, r, j)
                        assert causal == torch.equal(q_pos[qs], k_pos[ks]) and position_mask is None
                    else:                        # they hide some: the mask it is run with is the serial one
                        assert not torch.equal(part, pattern.expand_as(part)), (name, r, j)
                        assert torch.equal(_document_mask(documents.start, *by_documents)[:, 0], part)
                    covered[:, qs, ks] += 1
                assert covered.max() <= 1 and not (want & (covered == 0)).any(), (name, r, j)   # skipped: nothing


def test_a_row_that_is_one_document_plans_as_causal_attention_and_singletons_plan_the_diagonal():
    T, cp = 32, 4
    for r in range(cp):
        q_pos = shard_indices(T, cp, r)
        for j in range(cp):
            k_pos = shard_indices(T, cp, j)
            causal = [b[:4] for b in _blocks(q_pos, k_pos)]
            one = _blocks(q_pos, k_pos, documents_of(torch.zeros(2, T, dtype=torch.bool)).bounds)
            assert [b[:4] for b in one] == causal and all(b[4] is None for b in one)
            alone = _blocks(q_pos, k_pos, documents_of(torch.ones(2, T, dtype=torch.bool)).bounds)
            assert len(alone) == (2 if j == r else 0) and all(b[4] is not None for b in alone)


# ------------------------------------------------------------------ attention on real ranks

@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One torchrun launch of 4 processes runs every layout, case, method, kernel and packing; {name: result}."""
    out = tmp_path_factory.mktemp("documents")
    proc = torchrun(4, ROOT / "tests" / "context_worker.py", out, "documents", timeout=600)
    assert proc.returncode == 0, crash_report(proc.stderr)
    return {p.stem: torch.load(p) for p in out.glob("*.pt")}


@slow     # one 4-process launch of 60 runs (~40 s on 2 cores): the fast tier checks the plan above instead
@pytest.mark.parametrize("layout,case,method,kernel,packing", document_runs(LAYOUTS))
def test_sharded_attention_with_documents_equals_serial_sdpa_with_their_mask(results, layout, case, method, kernel,
                                                                          packing):
    got = results[f"{layout}-{case}-{method}-{kernel}-{packing}"]
    assert "error" not in got, got.get("error")
    q, k, v = (got[n].double().requires_grad_() for n in "qkv")
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=same_document(got["opens"]), scale=CASES[case][6],
                                          enable_gqa=q.shape[1] != k.shape[1])
    grads = torch.autograd.grad(want, (q, k, v), got["grad_out"].double())
    tol = TOLERANCE[CASES[case][7]]
    for name, expected in zip(("out", "dq", "dk", "dv"), (want, *grads)):
        assert got[name].dtype == CASES[case][7] and got[name].shape == expected.shape, name
        err = (got[name].double() - expected).abs().max().item()
        assert err <= tol * max(1.0, expected.abs().max().item()), f"{name}: max error {err:.2e}"


@slow
@pytest.mark.parametrize("packing", list(DOCUMENTS))
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_runs_a_kernel_for_exactly_the_blocks_whose_documents_meet(results, layout, method, packing):
    """Blocks are a rank's two query chunks against every chunk of keys (2 * cp chunks of T / 2cp positions); the
    serial mask says which hold a visible pair in some row: one fused kernel call each, none for the others."""
    got = results[f"{layout}-gqa-{method}-device-{packing}"]
    cp, T = LAYOUTS[layout], got["opens"].shape[1]
    meets = same_document(got["opens"])[:, 0].view(-1, 2 * cp, T // (2 * cp), 2 * cp, T // (2 * cp))
    meets = meets.any(4).any(2).any(0)                                     # [query chunk, key chunk]
    want = [int(meets[[r, 2 * cp - 1 - r]].sum()) for r in range(cp)]
    assert got["calls"].tolist() == want
    if packing == "one":
        assert want == [2 * cp + 1] * cp     # the causal plan: nothing skipped beyond it
    if packing == "singletons":
        assert want == [2] * cp              # a rank's two chunks against themselves, the rest skipped


# ------------------------------------------------------------------ the simulator: no values

@pytest.mark.parametrize("method", METHODS)
def test_under_a_fake_mode_every_causal_block_runs_masked_on_a_kernel_that_takes_the_mask(method):
    """Simulated as a GPU runs it (bf16): the documents' ids have no values, so every block the causal plan runs
    (2 * cp + 1 on a rank) is masked, on the memory-efficient kernel with its bias (FlashAttention-2 takes none),
    forward and backward; no scores held by a plain path; the peak is not below the unmasked run's."""
    cp = 2
    plain_peak, plain_ops = simulated_attention(method, "cuda", torch.bfloat16, cp=cp, tl=4096)
    peak, ops = simulated_attention(method, "cuda", torch.bfloat16, cp=cp, tl=4096, documents=True)
    efficient = "_scaled_dot_product_efficient_attention"
    assert plain_ops[efficient] == 0 and plain_ops["_scaled_dot_product_flash_attention"] == 2 * cp + 1
    assert ops[efficient] == ops[efficient + "_backward"] == 2 * cp + 1, sorted(ops.items())
    assert ops["_scaled_dot_product_flash_attention"] == 0 and not {"bmm", "logsumexp"} & ops.keys()
    assert peak >= plain_peak


SMALL = ["--model.d_model=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
         "--model.ffn_dim=128", "--model.vocab_size=251", "--train.batch_size=2", "--train.seq_len=512",
         "--model.max_seq_len=512", "--train.grad_accum=1", "--parallel.cp=2", "--ranks=0"]


def estimated_peak(args: list[str]) -> int:
    proc = subprocess.run([sys.executable, "-m", "nanomega.sim.estimate", *SMALL, *args, "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])["peak_bytes"]


@slow     # a subprocess simulation each (~10 s)
@pytest.mark.parametrize("method", METHODS)
def test_the_simulator_runs_document_masking_under_cp_and_charges_at_least_the_unmasked_peak(method):
    masked = estimated_peak([f"--parallel.cp_method={method}", "--data.mask=document"])
    assert masked >= estimated_peak([f"--parallel.cp_method={method}"])


# ------------------------------------------------------------------ NCCL's contracts: the host read is counted

@slow
def test_the_contract_checker_counts_one_host_read_per_forward_for_document_masking_under_cp():
    from nanomega.config import parse_args
    from nanomega.sim import contracts
    cfg = parse_args(["--model.d_model=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
                      "--model.ffn_dim=64", "--model.vocab_size=251", "--train.batch_size=2", "--train.seq_len=16",
                      "--train.grad_accum=2", "--train.compile=false", "--parallel.cp=2", "--parallel.tp=2",
                      "--parallel.sequence_parallel=true", "--data.mask=document"])
    result = contracts.check(cfg)
    assert result["violations"] == []
    assert contracts.host_read_budget(cfg) == 2 * 2         # two steps of two micro-batches, one read each
    assert {res["syncs"].get("step", 0) for res in result["ranks"].values()} == {contracts.host_read_budget(cfg)}
