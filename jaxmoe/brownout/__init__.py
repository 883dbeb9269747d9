"""BrownoutServe (arXiv:2507.17133): united experts, brownout routing in the expert computation, and
SLO-aware latency control.

``config.BrownoutConfig`` (threshold, full or partial brownout), ``routing`` (Algorithm 1 as the
expert routing ``BrownoutRouting`` both executors run: each token's experts split into originals and
united experts, the threshold the executor's traced ``routing_state``, so changing it does not
recompile; ``set_threshold`` / ``threshold`` move and read it), ``controller`` (SALC driving a running
engine), ``united`` (united experts: built from groups of k experts, distilled with optax, saved
beside a checkpoint), ``salc`` (the SLO analyzer's windowed P90 and Algorithm 2).
"""

from jaxmoe.brownout.config import BrownoutConfig, BrownoutError
from jaxmoe.brownout.salc import SALC, SLOAnalyzer

__all__ = ["SALC", "BrownoutConfig", "BrownoutError", "SLOAnalyzer"]
