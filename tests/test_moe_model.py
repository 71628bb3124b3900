"""MoE around the layer: aux-loss-free balancing by the expert bias (and the train step that moves
it), the model's MoE layout and active parameters, the matrix optimizers on stacked experts, and
config validation. The layer itself against per-token references: tests/test_moe.py."""
import pytest
import torch

from nanomega import optim
from nanomega.config import ModelConfig, OptimConfig
from nanomega.sim.counting import count_params
from nanomega.models import moe
from nanomega.models.transformer import init, run_units
from nanomega.optim import hidden_matrix
from nanomega.train.step import make_step_fns, move_expert_biases
from nanomega.tree import named_leaves, tree_map
from test_moe import D, F_DIM, assert_close, layer_cfg, randn

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---------------------------------------------------------------- 5. aux-loss-free balancing

def cv(load):
    return (load.std(unbiased=False) / load.mean()).item()


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_expert_bias_balances_a_skewed_router(score):
    E, N = 8, 512
    cfg = layer_cfg(n_experts=E, top_k=2, router_score=score, expert_bias_rate=1e-2)
    u = torch.zeros(D)
    u[0] = 1.0
    x = randn(N, D, seed=22) * 0.5 + 2.0 * u            # every token shares a direction ...
    W = randn(E, D, seed=23, scale=0.3)
    W[0] += 2.0 * u                                      # ... that experts 0 and 1 love
    W[1] += 1.5 * u
    bias = torch.zeros(E)
    load0 = moe.expert_counts(moe.route({"weight": W}, x, cfg).experts, E).float()
    assert load0[:2].sum() > 0.6 * N * 2 and cv(load0) > 1.0
    params = {"layers": [{"moe": {"router": {"weight": W, "expert_bias": bias}}}]}
    for _ in range(200):
        r = moe.route({"weight": W, "expert_bias": bias}, x, cfg)
        load = moe.expert_counts(r.experts, E).float()
        new = moe.expert_bias_step(bias, load, cfg.expert_bias_rate)
        assert torch.equal(new, bias + cfg.expert_bias_rate * torch.sign(load.mean() - load))
        params = move_expert_biases(params, load[None], cfg.expert_bias_rate, cfg)   # the step's version agrees
        assert torch.equal(params["layers"][0]["moe"]["router"]["expert_bias"], new)
        bias = new
    final = moe.expert_counts(moe.route({"weight": W, "expert_bias": bias}, x, cfg).experts, E).float()
    assert cv(final) < 0.5 * cv(load0), (cv(load0), cv(final))
    # the weights are still the unbiased scores of the chosen experts
    r = moe.route({"weight": W, "expert_bias": bias}, x, cfg)
    logits = x @ W.t()
    scores = logits.sigmoid() if score == "sigmoid" else logits.softmax(-1)
    w = scores.gather(1, r.experts)
    assert_close(r.weights, w / w.sum(-1, True), what="weights")


def test_move_expert_biases_indexes_loads_by_moe_layer():
    E = 4
    cfg = ModelConfig(n_layers=3, n_experts=E, first_dense_layers=1)      # block 0 dense, blocks 1 and 2 MoE
    bias = [torch.zeros(E), torch.full((E,), 0.5)]
    params = {"tok_embed": {"weight": torch.ones(2)},
              "layers": [{"mlp": {"w": torch.ones(1)}},
                         {"moe": {"router": {"weight": torch.ones(E, 2), "expert_bias": bias[0]}}},
                         {"moe": {"router": {"weight": torch.ones(E, 2), "expert_bias": bias[1]}}}]}
    load = torch.tensor([[4.0, 0.0, 2.0, 2.0], [1.0, 1.0, 1.0, 5.0]])
    out = move_expert_biases(params, load, 0.1, cfg)
    assert torch.allclose(out["layers"][1]["moe"]["router"]["expert_bias"], torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    assert torch.allclose(out["layers"][2]["moe"]["router"]["expert_bias"], torch.tensor([0.6, 0.6, 0.6, 0.4]))
    assert out["layers"][0]["mlp"]["w"] is params["layers"][0]["mlp"]["w"]      # other leaves as they are
    assert out["tok_embed"]["weight"] is params["tok_embed"]["weight"]
    # a pipeline stage's tree holds its blocks by index: block 2 still reads row 1
    stage = move_expert_biases({"layers": {"2": params["layers"][2]}}, load, 0.1, cfg)
    moved = out["layers"][2]["moe"]["router"]["expert_bias"]
    assert torch.equal(stage["layers"]["2"]["moe"]["router"]["expert_bias"], moved)
    assert torch.equal(bias[0], torch.zeros(E))     # nothing mutated


def test_train_step_moves_expert_bias_by_loads_only():
    cfg = ModelConfig(vocab_size=50, vocab_multiple=64, d_model=D, n_layers=2, n_heads=2, max_seq_len=16,
                      n_experts=4, top_k=2, expert_ffn_dim=F_DIM, router_score="sigmoid", expert_bias_rate=0.05,
                      aux_loss_coef=0.01, z_loss_coef=0.001)
    params = init(cfg, seed=24)
    for i in range(2):   # a nonzero bias, so weight decay or Adam would show
        params["layers"][i]["moe"]["router"]["expert_bias"] = randn(4, seed=32 + i).requires_grad_(True)
    opt = optim.build(OptimConfig(name="adamw", lr=1e-2, weight_decay=0.5, warmup_steps=0, schedule="constant"), 10)
    fns = make_step_fns(cfg, opt)
    gen = torch.Generator().manual_seed(25)
    batches = [tuple(torch.randint(0, 50, (2, 8), generator=gen) for _ in range(2)) for _ in range(2)]
    _, grads, stats = fns.grads(params, batches)
    names = named_leaves(grads)
    for n in ("layers.0.moe.router.expert_bias", "layers.1.moe.router.expert_bias"):
        assert torch.equal(names[n], torch.zeros(4)), n
    # the loads are summed over the micro-batches: 2 micro-batches x 16 tokens x k = 2 per layer
    assert stats["expert_load"].shape == (2, 4) and stats["expert_load"].sum(1).tolist() == [64.0, 64.0]
    biases = [params["layers"][i]["moe"]["router"]["expert_bias"].detach().clone() for i in range(2)]
    new, _ = fns.update(grads, opt.init(params), params, stats)     # written in place (step.py)
    for i in range(2):
        before = biases[i]
        load = stats["expert_load"][i]
        after = new["layers"][i]["moe"]["router"]["expert_bias"]
        assert torch.equal(after.detach(), before + 0.05 * torch.sign(load.mean() - load))   # no decay, no Adam


# ---------------------------------------------------------------- 6. model level

MODEL = ModelConfig(vocab_size=64, vocab_multiple=64, d_model=D, n_layers=5, n_heads=2, max_seq_len=16, ffn_dim=24,
                    n_experts=4, top_k=2, expert_ffn_dim=F_DIM, shared_ffn_dim=12, shared_gate=True,
                    first_dense_layers=1, moe_layer_freq=2, expert_bias_rate=1e-3)


def test_moe_layers_and_active_parameters():
    cfg = MODEL
    assert [cfg.is_moe_layer(i) for i in range(5)] == [False, False, True, False, True]
    assert cfg.n_moe_layers == 2
    params = init(cfg, seed=26)
    assert ["moe" in layer for layer in params["layers"]] == [False, False, True, False, True]
    assert ["mlp" in layer for layer in params["layers"]] == [True, True, False, True, False]
    m = params["layers"][2]["moe"]
    assert m["router"]["weight"].shape == (4, D) and m["router"]["expert_bias"].shape == (4,)
    assert m["experts"]["w_gate"].shape == (4, F_DIM, D) and m["experts"]["w_down"].shape == (4, D, F_DIM)
    assert m["shared"]["w_up"]["weight"].shape == (12, D) and m["shared_gate"]["weight"].shape == (1, D)
    logits, stats = run_units(params, None, torch.zeros(1, 4, dtype=torch.long), cfg)
    assert len(stats) == 2

    V, d, E, k, f, fs, ff = 64, D, 4, 2, F_DIM, 12, 24
    embed = 2 * V * d + d                                # tok_embed, lm_head (untied), final norm
    per_layer = 4 * d * d + 2 * d                        # q, k, v, o (MHA, head_dim 8) + two norms
    dense = 3 * d * ff
    moe_common = E * d + 3 * d * fs + d                  # router, shared expert, shared gate (bias: not counted)
    experts_all, experts_active = 3 * E * f * d, 3 * k * f * d
    assert count_params(cfg) == embed + 5 * per_layer + 3 * dense + 2 * (moe_common + experts_all)
    assert count_params(cfg, active=True) == embed + 5 * per_layer + 3 * dense + 2 * (moe_common + experts_active)
    n_init = sum(t.numel() for n, t in named_leaves(params).items() if not n.endswith("expert_bias"))
    assert count_params(cfg, padded=True) == n_init


def test_router_and_gate_are_not_hidden_matrices():
    params = named_leaves(init(MODEL, seed=27))
    hidden = {n for n, p in params.items() if hidden_matrix(n, p)}
    assert "layers.2.moe.experts.w_gate" in hidden and "layers.4.moe.experts.w_down" in hidden
    assert "layers.2.moe.shared.w_up.weight" in hidden
    for n in ("layers.2.moe.router.weight", "layers.2.moe.router.expert_bias", "layers.2.moe.shared_gate.weight",
              "tok_embed.weight", "lm_head.weight"):
        assert n not in hidden, n


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_shampoo_and_soap_keep_per_expert_state(name):
    params = init(MODEL, seed=28)
    cfg = OptimConfig(name=name, precondition_frequency=1, warmup_steps=0, schedule="constant")
    opt = optim.build(cfg, 10)
    state = opt.init(params)
    grads = tree_map(lambda p: randn(*p.shape, seed=29), params)
    _, state = opt.update(grads, state, params)
    leaves = named_leaves(state)
    E, f = 4, F_DIM
    for w, (rows, cols) in (("w_gate", (f, D)), ("w_up", (f, D)), ("w_down", (D, f))):
        base = f"layers.2.moe.experts.{w}"
        mine = {n: t for n, t in leaves.items() if base in n}
        assert mine and all(n.startswith(f"{name}.") for n in mine)  # the matrix optimizer's group
        for n, t in mine.items():
            tail = n.split(base + ".", 1)[1].split(".")
            assert tail[0] in {str(e) for e in range(E)}, n        # "<name>.<e>[.<factor>]"
            assert t.shape != (E, E) and t.ndim <= 2, (n, t.shape)
            if len(tail) == 2:                                       # a factor / root / basis: [out,out] or [in,in]
                assert t.shape == ((rows, rows) if tail[1] == "0" else (cols, cols)), (n, t.shape)
        for e in range(E):
            assert any(n.endswith(f"{base}.{e}.0") for n in mine) and any(n.endswith(f"{base}.{e}.1") for n in mine)
    router = [n for n in leaves if "moe.router.weight" in n]
    assert router and all(n.startswith("adam.") for n in router)


@pytest.mark.parametrize("name", ["muon", "shampoo", "soap"])
def test_stacked_expert_update_equals_expert_by_expert(name):
    E, f = 4, F_DIM
    cfg = OptimConfig(name=name, grad_clip=0.0, warmup_steps=0, schedule="constant", lr=0.02,
                      settings={"muon.ns_dtype": "float32", "shampoo.precondition_frequency": 1,
                                "soap.precondition_frequency": 1})
    W = randn(E, f, D, seed=30)
    stacked = {"layers": [{"moe": {"experts": {"w_gate": W}}}]}
    opt = optim.build(cfg, 10)
    state = opt.init(stacked)
    singles = [{"layers": [{"w": W[e].clone()}]} for e in range(E)]
    single_opts = [optim.build(cfg, 10) for _ in range(E)]
    single_states = [o.init(s) for o, s in zip(single_opts, singles)]
    for step in range(3):
        G = randn(E, f, D, seed=31 + step)
        upd, state = opt.update({"layers": [{"moe": {"experts": {"w_gate": G}}}]}, state, stacked)
        for e in range(E):
            u, single_states[e] = single_opts[e].update({"layers": [{"w": G[e]}]}, single_states[e], singles[e])
            assert_close(upd["layers"][0]["moe"]["experts"]["w_gate"][e], u["layers"][0]["w"], rel=1e-5,
                         what=f"step {step} expert {e}")
    if name == "muon":   # Muon's state is the stacked momentum itself
        assert [t.shape for t in named_leaves(state).values() if t.ndim == 3] == [(E, f, D)]


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_per_expert_state_is_named_by_the_global_expert(name):
    """Two holders of two experts each (expert parallel), told their first expert's index, keep between them
    the state of the optimizer of all four, by name, and their updates are its halves (<= 1e-5: the same
    maths, batched over 2 matrices instead of 4)."""
    E, f, w = 4, F_DIM, "layers.0.moe.experts.w_gate"
    cfg = OptimConfig(name=name, grad_clip=0.0, warmup_steps=0, schedule="constant", precondition_frequency=1)
    W = randn(E, f, D, seed=32)
    tree = lambda x: {"layers": [{"moe": {"experts": {"w_gate": x}}}]}   # noqa: E731
    whole_opt = optim.build(cfg, 10)
    halves = [(optim.build(cfg, 10, first_expert={w: k}), slice(k, k + 2)) for k in (0, 2)]
    whole_state = whole_opt.init(tree(W))
    states = [o.init(tree(W[part])) for o, part in halves]
    for step in range(3):
        G = randn(E, f, D, seed=33 + step)
        upd, whole_state = whole_opt.update(tree(G), whole_state, tree(W))
        for i, (o, part) in enumerate(halves):
            u, states[i] = o.update(tree(G[part]), states[i], tree(W[part]))
            assert_close(named_leaves(u)[w], named_leaves(upd)[w][part], rel=1e-5, what=f"step {step} {part}")
    whole = {n: t for n, t in named_leaves(whole_state).items() if ".experts." in n}
    held = [{n: t for n, t in named_leaves(st).items() if ".experts." in n} for st in states]
    assert {int(n.split(w + ".")[1].split(".")[0]) for n in held[1]} == {2, 3}
    assert held[0].keys() | held[1].keys() == whole.keys() and not held[0].keys() & held[1].keys()
    for n, t in {**held[0], **held[1]}.items():
        assert_close(t.double(), whole[n].double(), rel=1e-5, what=n)


@pytest.mark.parametrize("layout", [(2, 2), (4, 2), (4, 4)], ids=["fsdp2_ep2", "fsdp4_ep2", "fsdp4_ep4"])
@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_parallel_optimizer_names_expert_state_as_the_serial_one(name, layout):
    """Each rank of FSDP x ep (simulated, one process: estimate.fake_world) names the per-expert state of the
    experts it owns by their index in the model: every rank's state names together are the serial optimizer's,
    the edp peers of an ep coordinate split that coordinate's experts between them, each expert's state on one
    owner (parallel/ownership.py), and a checkpoint records those leaves whole (state_box), shaped as the
    serial ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from nanomega.sim import estimate
    from nanomega.config import parse_args
    dp, ep = layout
    args = ["--model.d_model=16", "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=2",
            "--model.vocab_size=64",
            "--model.n_experts=4", "--model.top_k=2", f"--model.expert_ffn_dim={F_DIM}", f"--optim.name={name}",
            "--train.device=cpu"]
    serial = named_leaves(optim.build(parse_args(args).optim, 10).init(init(parse_args(args).model)))
    cfg = parse_args(args + [f"--parallel.dp_shard={dp}", f"--parallel.ep={ep}"])
    union, owned = set(), {}
    for rank in range(dp):
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with estimate.fake_world(dp, rank):
            _, params, opt, _ = estimate.build(cfg, torch.device("cpu"), lambda: fake)
            with fake:
                state = named_leaves(opt.init(params))
            union |= state.keys()
            mine = {n: t for n, t in state.items() if ".experts.w_" in n and t.ndim <= 2}
            experts = {int(n.split(".experts.")[1].split(".")[1]) for n in mine}
            assert not experts & owned.get(rank % ep, set()), (rank, experts)     # one owner per expert
            owned[rank % ep] = owned.get(rank % ep, set()) | experts
            for n, t in mine.items():
                assert opt.state_box(n, t) == (list(serial[n].shape), [0] * t.ndim), n
    per_rank = 4 // ep
    assert owned == {c: set(range(c * per_rank, (c + 1) * per_rank)) for c in range(ep)}
    assert union == serial.keys(), sorted(union ^ serial.keys())[:4]


# ---------------------------------------------------------------- 7. config validation

BAD = [
    (dict(top_k=5), "top_k"),
    (dict(top_k=0), "top_k"),
    (dict(router_groups=3), "router_groups"),
    (dict(n_experts=6, top_k=1, router_groups=4), "router_groups"),   # the group-size rule alone would pass
    (dict(n_experts=8, router_groups=2, router_topk_groups=3), "router_topk_groups"),
    (dict(n_experts=8, top_k=3, router_groups=4, router_topk_groups=2), "router_topk_groups"),
    (dict(n_experts=8, top_k=4, router_groups=4, router_topk_groups=1), "router_topk_groups"),
    (dict(pad_to_capacity=True), "pad_to_capacity"),
    (dict(capacity_factor=-1.0), "capacity_factor"),
    (dict(aux_loss_coef=-0.1), "aux_loss_coef"),
    (dict(z_loss_coef=-0.1), "z_loss_coef"),
    (dict(expert_bias_rate=-0.1), "expert_bias_rate"),
    (dict(mlp="gelu"), "mlp"),
    (dict(moe_layer_freq=0), "moe_layer_freq"),
    (dict(first_dense_layers=-1), "first_dense_layers"),
    (dict(first_dense_layers=2), "first_dense_layers"),          # n_layers=2: no MoE layer left
    (dict(first_dense_layers=1, moe_layer_freq=2), "moe_layer_freq"),
    (dict(router_score="relu"), "router_score"),
    (dict(drop_policy="random"), "drop_policy"),
    (dict(expert_kernel="triton"), "expert_kernel"),
    (dict(aux_loss="global"), "aux_loss"),
    (dict(router_softmax_first=False, router_norm_topk=False), "router_norm_topk"),
]


@pytest.mark.parametrize("kw,setting", BAD, ids=[f"{s}-{i}" for i, (_, s) in enumerate(BAD)])
def test_bad_moe_settings_are_rejected(kw, setting):
    cfg = ModelConfig(**{**dict(d_model=D, n_heads=2, n_layers=2, n_experts=4, top_k=2), **kw})
    with pytest.raises(ValueError, match=setting):
        cfg.validate()


def test_good_moe_settings_validate():
    for kw in (dict(), dict(n_experts=16, top_k=4, router_groups=4, router_topk_groups=2, router_score="sigmoid",
                            expert_bias_rate=1e-3, router_scale=2.5),
               dict(capacity_factor=1.25, pad_to_capacity=True, drop_policy="position"),
               dict(router_score="sigmoid", router_softmax_first=False, router_norm_topk=False),
               dict(first_dense_layers=1, n_layers=3, moe_layer_freq=2)):
        ModelConfig(**{**dict(d_model=D, n_heads=2, n_layers=2, n_experts=4, top_k=2), **kw}).validate()
