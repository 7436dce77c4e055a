"""tierllm: run transformer LLMs at any size on the hardware at hand."""
from tierllm.api import LLM, GenerationProfile, InferenceEngine, init_inference
from tierllm.config import OffloadConfig, QuantConfig
from tierllm.engine.outputs import CompletionOutput, RequestOutput
from tierllm.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "InferenceEngine", "GenerationProfile", "init_inference", "SamplingParams", "RequestOutput",
           "CompletionOutput", "OffloadConfig", "QuantConfig"]
