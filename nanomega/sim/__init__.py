"""Simulation and planning, no GPU needed: what a model costs (counting.py: parameters, FLOPs per token), the
allocation tracker (memory_tracker.py), the real step on fake tensors (estimate.py), what a rank holds from the
plan alone (rank_bytes.py), the step-time model over a device table (step_time.py, devices.py), the layout
planner (plan.py) and the NCCL contract checker (contracts.py); the tools run as `python -m nanomega.sim.<tool>`.

One memory accountant per question: rank_bytes.py answers "what does a rank hold between steps" from the
sharding plan alone (no allocation: the preflight's first, instant check), estimate.py "what is the step's
peak" by running the real step on fake tensors. The first builds optimizer state on meta tensors
(optim/memory.py), the second allocates it on fake ones, so an optimizer declares no byte count of its own."""
