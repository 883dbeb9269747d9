"""Choices the command line offers, named without importing JAX (``jaxmoe --help`` and ``jaxmoe
client`` stay fast); ``tests/cli/test_fast_cli.py`` keeps them in step with the ops."""

EXPERT_IMPLS = (
    "reference",
    "dense",
    "bucketed_loop",
    "grouped",
    "ragged_dot",
    "padded_einsum",
    "pallas",
    "cpu_kernel",
    "cpu_kernel_invariant",
)
