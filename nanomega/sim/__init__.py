"""Simulation and planning, no GPU needed: the allocation tracker (memory_tracker.py), the real step on fake
tensors (estimate.py), what a rank holds from the plan alone (rank_bytes.py), the step-time model over a
device table (step_time.py, devices.py), the layout planner (plan.py) and the NCCL contract checker
(contracts.py). Each is a `python -m nanomega.sim.<tool>` command."""
