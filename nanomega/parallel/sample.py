"""The end-of-run sample on the mesh, with the parameters as they are sharded: no rank ever holds the whole
model (gathered onto rank 0, a 70B model took 280 GB in fp32 there, after the last checkpoint).

    logits_of = next_logits(par, params, model_cfg, run, autocast)    # run: step.make_runner(par=...)
    tokens = generate.sample(params, model_cfg, prompt, n, temperature, top_k, gen, next_logits=logits_of)

Every rank runs the same context. Its rows are replicated over the data-parallel dims (a batch of one
cannot be split; each data-parallel rank computes the same rows), and laid out on the sequence as
training lays tokens out (context parallel: the load-balanced order; tp under sequence parallel), after
padding the sequence on the right to a length the layout divides: attention is causal, so the padding
changes no logit before it. Each unit's parameters are gathered only while it runs, as in evaluation.
The logits come out vocab-sharded under tp: gathered whole on every rank ([B, T, padded vocab] per new
token, an activation, never a parameter), and the last real position's row is read. Under pipeline
parallel the context goes through the stages as Pipeline.cross_entropy sends a batch, and the last stage's
row is summed over pp with zeros from the other stages (exact: x + 0 = x), so every rank gets the same
logits and draws the same token from the same generator.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, distribute_tensor

from nanomega.parallel import context
from nanomega.parallel.mesh import DP_DIMS, sequence_multiple


def place(par, tokens: torch.Tensor, position: int):
    """A context [B, T] (the same on every rank) -> (tokens as the mesh runs them, [1]: the index along the
    sequence of the row that holds `position`, a tensor, so nothing is read on the host). Replicated over
    the data-parallel dims, otherwise placed as Parallel.batch places a training batch."""
    order = torch.arange(tokens.shape[1])
    if "cp" in par.mesh.mesh_dim_names:
        order = context.load_balanced_order(tokens.shape[1], par.cfg.parallel.cp)
        tokens = tokens.index_select(1, order.to(tokens.device))
    placements = tuple(Replicate() if d in DP_DIMS else p
                       for d, p in zip(par.mesh.mesh_dim_names, par.token_placements))
    row = torch.argsort(order)[position:position + 1].to(tokens.device)
    return distribute_tensor(tokens, par.mesh, placements, src_data_rank=None), row


def next_logits(par, params: dict, model_cfg, run, autocast):
    """next_logits(context [B, T]) -> [B, padded vocab] for generate.sample, on every rank (module doc).
    par: the run's Layout (a Parallel or a Pipeline: parallelize.py); run: a unit runner on par.unit_par;
    autocast(): the training's autocast context. A collective: every rank calls it with the same context."""
    stage_par = par.unit_par
    multiple = sequence_multiple(par.cfg)
    longest = model_cfg.max_seq_len // multiple * multiple

    def logits_of(context_tokens: torch.Tensor) -> torch.Tensor:
        context_tokens = context_tokens[:, -longest:]     # the padded context must fit the model's positions
        length = context_tokens.shape[1]
        padded = F.pad(context_tokens, (0, -length % multiple))
        if stage_par is None:     # a pipeline of one process per stage
            row = torch.tensor([length - 1], device=padded.device)
            return par.logits_at(params, padded, row, model_cfg, run, autocast)
        with stage_par.context():
            tokens, row = place(stage_par, padded, length - 1)
            return par.logits_at(params, tokens, row, model_cfg, run, autocast)
    return logits_of
