"""jaxmoe: a JAX serving runtime for Mixture-of-Experts language models.

Public API::

    from jaxmoe import LLM, SamplingParams
    llm = LLM("demo")                      # or a Hugging Face checkpoint directory
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=16))

    engine = build_engine(RuntimeConfig(model="demo", mesh="meshes/cpu-8.yaml"))  # the engine itself
"""

from jaxmoe.lazy import lazy_exports

# name -> module: imported on first use (PEP 562), so ``jaxmoe --help`` and ``jaxmoe client`` do not
# pay for importing JAX
_EXPORTS = {
    "BrownoutConfig": "jaxmoe.brownout",
    "BrownoutError": "jaxmoe.brownout",
    "CheckpointError": "jaxmoe.checkpoint",
    "load_params": "jaxmoe.checkpoint",
    "restore_converted": "jaxmoe.checkpoint",
    "save_converted": "jaxmoe.checkpoint",
    "ModelConfig": "jaxmoe.config",
    "UnsupportedModelError": "jaxmoe.config",
    "from_hf_config": "jaxmoe.config",
    "load_config": "jaxmoe.config",
    "EngineConfig": "jaxmoe.engine.engine",
    "LLMEngine": "jaxmoe.engine.engine",
    "RequestOutput": "jaxmoe.engine.engine",
    "SamplingParams": "jaxmoe.sampling",
    "OverloadedError": "jaxmoe.engine.scheduler",
    "Priority": "jaxmoe.engine.sequence",
    "LLM": "jaxmoe.llm",
    "load_model": "jaxmoe.checkpoint.model",
    "RuntimeConfig": "jaxmoe.assembly",
    "build_engine": "jaxmoe.assembly",
    "StepHook": "jaxmoe.engine.hooks",
    "LayerHook": "jaxmoe.engine.hooks",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


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
