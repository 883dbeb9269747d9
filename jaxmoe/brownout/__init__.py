"""BrownoutServe (arXiv:2507.17133): united experts, brownout routing in the expert computation, and
SLO-aware latency control.

``config.BrownoutConfig`` (thresholds per phase, full or partial brownout), ``routing`` (Algorithm 1
as the expert routing ``BrownoutRouting`` both executors run: each token's experts split into
originals and united experts, the prefill and decode thresholds the executor's traced
``routing_state``, so changing them does not recompile; ``set_threshold`` / ``threshold`` move and read
them), ``controller`` (SALC driving a running engine, one per phase), ``united`` (united experts: built
from groups of k experts, distilled with optax, saved beside a checkpoint), ``loader`` (the Experts
Loader: united experts of another k swapped in at run time), ``salc`` (the SLO analyzer's windowed P90
and Algorithm 2).
"""

from jaxmoe.brownout.config import BrownoutConfig, BrownoutError
from jaxmoe.brownout.salc import SALC, SLOAnalyzer

__all__ = ["SALC", "BrownoutConfig", "BrownoutError", "SLOAnalyzer"]
