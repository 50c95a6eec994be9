"""troupe from Python: vLLM's offline API (``LLM``, ``SamplingParams``) on troupe's engine,
with in-place weight updates for RL trainers.

    from troupe import LLM, SamplingParams
    llm = LLM("HuggingFaceTB/SmolLM2-135M-Instruct.Q4_1.gguf")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    print(out[0].outputs[0].text)
"""

from ._core import TroupeError, WorkerFault
from .llm import LLM
from .lora import LoRARequest
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from .weights import WeightSender, describe

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "SamplingParams",
    "GuidedDecodingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "LoRARequest",
    "TroupeError",
    "WorkerFault",
    "WeightSender",
    "describe",
]
