"""Training small MoE models (flax-free, jax + optax): the shipped demo model and its dense baseline.

``jaxmoe train`` runs ``loop.train``; ``jaxmoe eval`` scores any model on held-out text
(``evaluate``). Nothing here is imported by serving.
"""
