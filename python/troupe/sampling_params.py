"""vLLM's ``SamplingParams`` (field names and meanings), checked as troupe's engine will
use them."""

import json
from typing import Any, Dict, List, Optional, Union

from . import _core


class GuidedDecodingParams:
    """Structured output (vLLM's ``GuidedDecodingParams``): the output follows a JSON
    schema (``json``: a dict or its text), is any JSON object (``json_object``), is one of
    ``choice``, or is text that ``regex`` matches whole. Grammars (``grammar``) are
    refused."""

    def __init__(
        self,
        *,
        json: Optional[Union[str, Dict[str, Any]]] = None,
        json_object: Optional[bool] = None,
        choice: Optional[List[str]] = None,
        regex: Optional[str] = None,
        grammar: Optional[str] = None,
    ) -> None:
        if grammar is not None:
            raise ValueError("troupe's structured output takes json, json_object, choice or "
                             "regex; grammar is not supported")
        given = [x for x in (json, json_object or None, choice, regex) if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, json_object, choice and regex")
        self.json = json
        self.json_object = bool(json_object)
        self.choice = list(choice) if choice is not None else None
        self.regex = regex


#: vLLM's newer name for the same.
StructuredOutputsParams = GuidedDecodingParams


def _require(name: str, value: Any, allowed: Any) -> None:
    if value != allowed:
        raise ValueError(f"troupe does not support {name}={value!r} (only {allowed!r})")


class SamplingParams:
    """How to sample a request's outputs, with vLLM's names and defaults. Unknown fields are
    a ``TypeError``; values out of range a ``ValueError`` (checked again by the engine);
    vLLM fields troupe does not act on are accepted only at their defaults."""

    def __init__(
        self,
        *,
        n: int = 1,
        best_of: Optional[int] = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: Optional[int] = None,
        stop: Optional[Union[str, List[str]]] = None,
        stop_token_ids: Optional[List[int]] = None,
        bad_words: Optional[List[str]] = None,
        ignore_eos: bool = False,
        max_tokens: Optional[int] = 16,
        min_tokens: int = 0,
        logprobs: Optional[int] = None,
        prompt_logprobs: Optional[int] = None,
        logit_bias: Optional[Dict[int, float]] = None,
        guided_decoding: Optional[GuidedDecodingParams] = None,
        structured_outputs: Optional[GuidedDecodingParams] = None,
        detokenize: bool = True,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        logits_processors: Optional[list] = None,
        truncate_prompt_tokens: Optional[int] = None,
        allowed_token_ids: Optional[List[int]] = None,
        extra_args: Optional[Dict[str, Any]] = None,
    ) -> None:
        self.n = n
        self.best_of = best_of
        self.presence_penalty = presence_penalty
        self.frequency_penalty = frequency_penalty
        self.repetition_penalty = repetition_penalty
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.min_p = min_p
        self.seed = seed
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        self.stop_token_ids = list(stop_token_ids or [])
        self.bad_words = list(bad_words or [])
        self.ignore_eos = ignore_eos
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.logit_bias = dict(logit_bias or {})
        if guided_decoding is not None and structured_outputs is not None:
            raise ValueError("give guided_decoding or structured_outputs, not both")
        self.guided_decoding = guided_decoding if guided_decoding is not None else structured_outputs
        _require("detokenize", detokenize, True)
        _require("skip_special_tokens", skip_special_tokens, True)
        _require("spaces_between_special_tokens", spaces_between_special_tokens, True)
        _require("include_stop_str_in_output", include_stop_str_in_output, False)
        _require("logits_processors", logits_processors, None)
        _require("truncate_prompt_tokens", truncate_prompt_tokens, None)
        _require("allowed_token_ids", allowed_token_ids, None)
        _require("extra_args", extra_args, None)
        self._check()

    def _check(self) -> None:
        def integer(name: str, value: Any, low: int, high: int = 2**31 - 1) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an integer in [{low}, {high}], not {value!r}")

        integer("n", self.n, 1)
        if self.best_of is not None:
            integer("best_of", self.best_of, self.n)
        if self.max_tokens is not None:
            integer("max_tokens", self.max_tokens, 1)
        integer("min_tokens", self.min_tokens, 0)
        integer("top_k", self.top_k, -1)
        if self.seed is not None:
            integer("seed", self.seed, 0, 2**63 - 1)
        if self.logprobs is not None:
            integer("logprobs", self.logprobs, 0, 20)
        if self.prompt_logprobs is not None:
            integer("prompt_logprobs", self.prompt_logprobs, 0, 20)
        for t in self.stop_token_ids:
            integer("stop_token_ids", t, 0)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, not {value!r}")
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a string or a list of strings")

    def _core(self, max_model_len: int, default_seed: Optional[int] = None) -> "_core.SamplingParamsCore":
        """The engine's form of these parameters (``max_tokens`` None: up to the model's
        length, as vLLM's)."""
        c = _core.SamplingParamsCore()
        c.n = self.n
        c.best_of = self.best_of or 0
        c.temperature = float(self.temperature)
        c.top_p = float(self.top_p)
        c.top_k = -1 if self.top_k in (0, -1) else self.top_k
        c.min_p = float(self.min_p)
        seed = self.seed if self.seed is not None else default_seed
        c.seed = -1 if seed is None else seed
        c.max_tokens = max_model_len if self.max_tokens is None else self.max_tokens
        c.min_tokens = self.min_tokens
        c.logprobs = self.logprobs or 0
        c.prompt_logprobs = -1 if self.prompt_logprobs is None else self.prompt_logprobs
        c.stop_token_ids = self.stop_token_ids
        c.ignore_eos = self.ignore_eos
        c.repetition_penalty = float(self.repetition_penalty)
        c.presence_penalty = float(self.presence_penalty)
        c.frequency_penalty = float(self.frequency_penalty)
        c.logit_bias_ids = [int(k) for k in self.logit_bias]
        c.logit_bias_values = [float(v) for v in self.logit_bias.values()]
        c.bad_words = self.bad_words
        g = self.guided_decoding
        if g is not None:
            if g.json is not None:
                c.guided_json = g.json if isinstance(g.json, str) else json.dumps(g.json)
            c.guided_json_object = g.json_object
            if g.choice is not None:
                c.guided_choice = g.choice
            if g.regex is not None:
                c.guided_regex = g.regex
        return c

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"SamplingParams({fields})"
