"""The train step: gradients over micro-batches (recomputed, accumulated, reduced by the layout), then the
optimizer update (step.py). Everything above it (the simulator, evaluation, train.py) runs this one step."""
