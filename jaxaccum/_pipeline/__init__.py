"""Pipeline parallelism: micro-batches through stages of stacked layers on a
mesh axis, equal to a ``lax.scan`` over the layers."""
