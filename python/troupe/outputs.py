"""vLLM's ``RequestOutput`` and ``CompletionOutput``."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .lora import LoRARequest


@dataclass
class Logprob:
    """A token's log-probability under the model's logits; ``rank`` is 1 + the number of
    tokens more likely there (1 for the most likely)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    """One sample of a request."""

    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    #: With ``SamplingParams.logprobs``: for each generated token, the sampled token and
    #: the ``logprobs`` most likely ones, by token id.
    logprobs: Optional[List[Dict[int, Logprob]]]
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None
    lora_request: Optional[LoRARequest] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What one prompt produced: its ``n`` samples in ``outputs``."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    #: With ``SamplingParams.prompt_logprobs``: None for the first token, then a dict per
    #: prompt token (the token and the most likely ones).
    prompt_logprobs: Optional[List[Optional[Dict[int, Logprob]]]]
    outputs: List[CompletionOutput]
    finished: bool = True
    lora_request: Optional[LoRARequest] = None
    metrics: Optional[dict] = field(default=None)
