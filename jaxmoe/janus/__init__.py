"""JANUS (arXiv:2512.13525): attention and experts on separate sub-meshes, plugged into the core.

The disaggregated executor itself (attention and expert programs, A2E/E2A transfers, AEBS, replica
slots) is core runtime (``jaxmoe.runtime``). This package holds what changes a running deployment:
``placement`` (activation-aware replication and placement, Algorithm 2) and ``placement_controller``
(re-places replicas from measured load, a step hook), ``reshard`` (a new layout's executor, expert
replicas and KV moved) and ``live_rescale`` (another layout built in the background and swapped in
at a step boundary, a step hook), and ``scaling`` (performance models, the SLO controller, the
cluster simulator and the autoscaler).
"""
