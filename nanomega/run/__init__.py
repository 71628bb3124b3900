"""What a training run does around the step: checks before any work (preflight.py), the metrics it logs
(metrics.py) and the trackers that mirror them (tracking.py). train.py reads top to bottom over these."""
