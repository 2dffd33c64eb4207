"""The optimizer side: :func:`~jaxaccum._optim.accumulate.accumulate` across
calls, reading its state from inside any optimizer state, the batch-size
autopilot, float16 loss scaling and the scaling rules for a larger batch."""
