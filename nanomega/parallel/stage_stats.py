"""A pipeline step's loss and MoE statistics, summed over the stages that computed them.

Under pipeline parallel no rank sees the whole objective: the last stage has the cross-entropy, and
each stage the router losses and expert loads of its own MoE layers. `RouterStats` collects a rank's
parts during the schedule and sums every rank's with one all-reduce over pp, so the step reports the
serial step's numbers (step.py): the mean loss with every layer's router losses in it, and the stats
"ce", "aux_loss", "z_loss" (means per MoE layer), "expert_load" [MoE layers, E] and "dropped".
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


class RouterStats:
    """One rank's parts of a step's loss and MoE statistics (module doc); a layer's loads go to the row of its
    place among the model's MoE layers."""

    def __init__(self, pipe, model_cfg, device: torch.device):
        self.pipe, self.n_layers = pipe, model_cfg.n_moe_layers
        self.rows = {s: [sum(map(model_cfg.is_moe_layer, range(i))) for i in blocks if model_cfg.is_moe_layer(i)]
                     for s, blocks in enumerate(pipe.blocks)}
        self.terms, self.aux, self.z = [], [], []
        # [MoE layers, E], rows as above, on the rank's device: the all-reduce over pp takes nothing else on NCCL
        self.load = torch.zeros(self.n_layers, model_cfg.n_experts, device=device)
        self.dropped = torch.zeros(self.n_layers, device=device)

    def add(self, stage: int, moe: list) -> None:
        for row, layer in zip(self.rows[stage], moe):
            self.aux.append(layer.aux_loss.detach())
            self.z.append(layer.z_loss.detach())
            self.load[row] += layer.load
            self.dropped[row] += layer.dropped

    def finish(self, loss, ce, n: int):
        """(the step's mean loss, stats) on every rank, from this rank's mean loss and cross-entropy (None
        without the last stage) over n micro-batches; router losses of stages without the head are added."""
        def total(values):   # summed from the first value, not from 0 (a DTensor partial sum)
            return sum(values[1:], values[0]) if values else None
        scalars = {"loss": loss, "ce": ce, "terms": total(self.terms), "aux": total(self.aux), "z": total(self.z)}
        scalars = {k: v for k, v in scalars.items() if v is not None}
        if self.pipe.par is not None:   # partial sums over the stage's data-parallel ranks: as plain tensors
            scalars.update(self.pipe.par.scalars({k: v for k, v in scalars.items() if isinstance(v, DTensor)}))
        zero = torch.zeros((), device=self.load.device)
        mean_loss = scalars.get("loss", zero) + scalars.get("terms", zero) / n
        if not self.n_layers:
            return self.pipe.sum_over_stages(mean_loss.reshape(1))[0], {}
        firsts = torch.stack([mean_loss] + [scalars.get(k, zero) for k in ("ce", "aux", "z")]).float()
        packed = self.pipe.sum_over_stages(torch.cat([firsts, self.load.flatten(), self.dropped]))
        means = packed[2:4] / (n * self.n_layers)
        return packed[0], {"ce": packed[1], "aux_loss": means[0], "z_loss": means[1],
                           "expert_load": packed[4:4 + self.load.numel()].view_as(self.load),
                           "dropped": packed[-self.n_layers:]}
