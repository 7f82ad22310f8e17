"""Measuring the admission's cost model on the engine's own model and device (DESIGN.md §4,
red line 1): timed cold prefills of random tokens and each enabled tier's round trip
(:meth:`~engine.cache.admission.CostModel.measure` fits the figures)."""

from __future__ import annotations

import torch

from engine.cache.admission import CostModel
from engine.cache.tiers import TierStore, round_trip
from engine.model.base import CausalLM
from engine.parallel.group import TensorParallelGroup


def measure_cost_model(model: CausalLM, vocab_size: int, device: torch.device, tiers: TierStore | None, group: TensorParallelGroup | None) -> CostModel:
    """The cost model measured now. With tensor parallelism every rank runs the same timed
    prefills in lockstep (their collectives meet) and rank 0's figures are broadcast, so every
    rank prices its plans alike and chooses the same one."""
    where = {} if tiers is None else {t: tiers.disk_dir for t, on in tiers.enabled.items() if on}

    def prefill(n: int) -> None:
        ids = torch.randint(0, vocab_size, (n,), device=device)
        with torch.no_grad():
            model(ids, torch.arange(n, device=device), model.new_dense_state())

    costs = CostModel.measure(prefill, where, round_trip)
    if group is not None:
        measured = group.broadcast_object(costs)
        assert isinstance(measured, CostModel)
        costs = measured
    return costs
