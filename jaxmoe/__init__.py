"""jaxmoe: a JAX serving runtime for Mixture-of-Experts language models.

Public API::

    from jaxmoe import LLM, SamplingParams
    llm = LLM("demo")                      # or a Hugging Face checkpoint directory
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=16))

    engine = build_engine(RuntimeConfig(model="demo", mesh="meshes/cpu-8.yaml"))  # the engine itself
"""

from jaxmoe.assembly import RuntimeConfig, build_engine
from jaxmoe.brownout import BrownoutConfig, BrownoutError
from jaxmoe.checkpoint import CheckpointError, load_params, restore_converted, save_converted
from jaxmoe.config import ModelConfig, UnsupportedModelError, from_hf_config, load_config
from jaxmoe.engine.engine import EngineConfig, LLMEngine, RequestOutput
from jaxmoe.engine.hooks import LayerHook, StepHook
from jaxmoe.sampling import SamplingParams
from jaxmoe.engine.scheduler import OverloadedError
from jaxmoe.engine.sequence import Priority
from jaxmoe.llm import LLM, load_model

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "LLMEngine",
    "EngineConfig",
    "RuntimeConfig",
    "build_engine",
    "StepHook",
    "LayerHook",
    "Priority",
    "OverloadedError",
    "ModelConfig",
    "load_config",
    "from_hf_config",
    "load_model",
    "load_params",
    "save_converted",
    "restore_converted",
    "CheckpointError",
    "UnsupportedModelError",
    "BrownoutConfig",
    "BrownoutError",
]
