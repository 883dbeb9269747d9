"""jaxmoe: a JAX serving runtime for Mixture-of-Experts language models."""
