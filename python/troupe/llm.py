"""vLLM's ``LLM`` on troupe's engine, with SGLang's weight-update calls for RL trainers."""

import itertools
import json
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from . import _core
from .lora import LoRARequest
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams
from .weights import before_cuda, dtype_name, host_array

PromptType = Union[str, Dict[str, Any]]

# Engine arguments, vLLM's names first, and how each sets troupe's configuration.
_GIB = 1 << 30


def _set(field: str, convert: Callable[[Any], Any] = lambda v: v) -> Callable[[Any, Any], None]:
    def apply(config: Any, value: Any) -> None:
        setattr(config, field, convert(value))

    return apply


_ENGINE_ARGS: Dict[str, Callable[[Any, Any], None]] = {
    "load_format": _set("load_format"),
    "cpu_precision": _set("cpu_precision"),
    "enforce_eager": _set("enforce_eager", bool),
    "enable_expert_parallel": _set("enable_expert_parallel", bool),
    "weight_cache": _set("weight_cache"),
    "kv_cache_memory_bytes": _set("kv_cache_memory_bytes", int),
    "gpu_memory_utilization": _set("gpu_memory_utilization", float),
    # vLLM's swap_space is in GiB.
    "swap_space": _set("swap_space_bytes", lambda v: int(float(v) * _GIB)),
    "max_loras": _set("max_loras", int),
    "max_lora_rank": _set("max_lora_rank", int),
    "device": _set("device"),
    "block_size": _set("block_size", int),
    "max_num_seqs": _set("max_num_seqs", int),
    "max_num_batched_tokens": _set("max_num_batched_tokens", int),
    "enable_prefix_caching": _set("enable_prefix_caching", bool),
    "async_scheduling": _set("async_scheduling", bool),
    "chat_template": _set("chat_template"),
    # Seconds a call to the workers may take.
    "rpc_timeout": _set("rpc_timeout_seconds", float),
    # Workers replaced when they die (troupe's recovery; 0: a death ends the engine).
    "max_restarts": _set("max_restarts", int),
}
# Accepted for vLLM's sake, with nothing for troupe to do: LoRA is always on (max_loras
# slots), no remote code is ever run, the tokenizer is the model's own.
_ACCEPTED = {"enable_lora", "trust_remote_code", "disable_log_stats", "tokenizer_mode"}


def _logprob_dicts(
    sampled: Sequence[int], sampled_lp: Sequence[float], ranks: Sequence[int],
    top: Sequence[Sequence[Any]]
) -> List[Dict[int, Logprob]]:
    """vLLM's per-position logprobs: the most likely tokens by rank, and the sampled one
    with its own rank."""
    out = []
    for i, (token, lp, rank) in enumerate(zip(sampled, sampled_lp, ranks)):
        d: Dict[int, Logprob] = {}
        for place, t in enumerate(top[i] if i < len(top) else [], start=1):
            d[t.token] = Logprob(t.logprob, place)
        if token not in d:
            d[token] = Logprob(lp, rank)
        out.append(d)
    return out


class LLM:
    """A model ready to generate (vLLM's ``LLM``): ``model`` is a Hugging Face directory or
    a GGUF file. The engine arguments are vLLM's names (``tensor_parallel_size``,
    ``dtype``, ``max_model_len``, ``max_num_seqs``, ``swap_space`` in GiB,
    ``enable_prefix_caching`` …) and troupe's (``cpu_precision``, ``kv_cache_memory_bytes``,
    ``weight_cache``, ``rpc_timeout``); an unknown one is a ``TypeError``."""

    def __init__(
        self,
        model: str,
        *,
        tokenizer: Optional[str] = None,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        max_model_len: Optional[int] = None,
        enable_sleep_mode: bool = False,
        seed: Optional[int] = None,
        **engine_args: Any,
    ) -> None:
        unknown = sorted(set(engine_args) - set(_ENGINE_ARGS) - _ACCEPTED)
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments: {', '.join(unknown)}")
        if tokenizer is not None and tokenizer != model:
            raise ValueError("troupe uses the model's own tokenizer; tokenizer must be None or the model")
        config = _core.Config()
        config.model = str(model)
        config.tensor_parallel_size = tensor_parallel_size
        config.dtype = dtype
        if max_model_len is not None:
            config.max_model_len = max_model_len
        for name, value in engine_args.items():
            if name in _ENGINE_ARGS:
                _ENGINE_ARGS[name](config, value)
        config.validate()
        if str(engine_args.get("device", "cpu")).startswith("cuda"):
            before_cuda()
        self._engine = _core.Engine(config)
        self._sleep_mode = enable_sleep_mode
        self._seed = seed
        self._request_counter = itertools.count()
        self._max_model_len = self._engine.max_model_len()

    # -- generation ------------------------------------------------------------------

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        use_tqdm: bool = False,
        lora_request: Optional[Union[LoRARequest, Sequence[LoRARequest]]] = None,
    ) -> List[RequestOutput]:
        """Generates for every prompt, batched. A prompt is a text, or a dict with
        ``prompt`` (text) or ``prompt_token_ids``. One ``SamplingParams`` for all, or one
        per prompt. Ctrl-C stops the batch (between steps) and raises KeyboardInterrupt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, lora_request, add_special_tokens=True)

    def chat(
        self,
        messages: Union[List[Dict[str, Any]], List[List[Dict[str, Any]]]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        use_tqdm: bool = False,
        lora_request: Optional[LoRARequest] = None,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[List[Dict[str, Any]]] = None,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
    ) -> List[RequestOutput]:
        """Generates the assistant's reply to one conversation (a list of messages) or to
        each of several, rendered by the model's chat template as transformers renders it."""
        if chat_template is not None:
            raise ValueError("pass chat_template to LLM(...) (the engine's template)")
        if continue_final_message:
            raise ValueError("troupe does not support continue_final_message")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.render_chat(c, add_generation_prompt, tools, chat_template_kwargs)
                   for c in conversations]
        return self._run(prompts, sampling_params, lora_request, add_special_tokens=False)

    def render_chat(
        self,
        messages: List[Dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Optional[List[Dict[str, Any]]] = None,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
    ) -> str:
        """The prompt the model's chat template makes of a conversation."""
        return self._engine.render_chat(
            json.dumps(messages),
            json.dumps(tools) if tools else "",
            json.dumps(chat_template_kwargs) if chat_template_kwargs else "",
            add_generation_prompt,
        )

    def _run(
        self,
        prompts: List[PromptType],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]],
        lora_request: Optional[Union[LoRARequest, Sequence[LoRARequest]]],
        add_special_tokens: bool,
    ) -> List[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        loras = (
            list(lora_request)
            if isinstance(lora_request, (list, tuple))
            else [lora_request] * len(prompts)
        )
        if len(params) != len(prompts) or len(loras) != len(prompts):
            raise ValueError("give one SamplingParams (and LoRARequest) for all prompts or one each")
        requests = []
        for i, (prompt, sp, lora) in enumerate(zip(prompts, params, loras)):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"prompt {i}: sampling_params must be SamplingParams, not {type(sp).__name__}")
            r = _core.Request()
            if isinstance(prompt, str):
                r.prompt = prompt
            elif isinstance(prompt, dict):
                unknown = set(prompt) - {"prompt", "prompt_token_ids"}
                if unknown:
                    raise ValueError(f"prompt {i}: unknown keys {sorted(unknown)}")
                if "prompt_token_ids" in prompt:
                    r.prompt_token_ids = [int(t) for t in prompt["prompt_token_ids"]]
                else:
                    r.prompt = prompt["prompt"]
            else:
                raise TypeError(f"prompt {i} is a {type(prompt).__name__} (a str or a dict)")
            seed = None if self._seed is None else self._seed + next(self._request_counter)
            r.sampling = sp._core(self._max_model_len, seed)
            r.stop = sp.stop
            r.add_special_tokens = add_special_tokens
            if lora is not None:
                core = _core.LoRARequestCore()
                core.lora_name = lora.lora_name
                core.lora_int_id = lora.lora_int_id
                core.lora_path = lora.lora_path
                r.lora = core
            requests.append((r, lora, sp))
        outputs = self._engine.generate([r for r, _, _ in requests])
        results = []
        at = 0
        for i, (r, lora, sp) in enumerate(requests):
            samples = outputs[at : at + r.sampling.n]
            at += r.sampling.n
            results.append(self._request_output(i, samples, r, lora, sp.logprobs is not None))
        return results

    def _request_output(self, i: int, samples: List[Any], request: Any,
                        lora: Optional[LoRARequest], wants_logprobs: bool) -> RequestOutput:
        completions = []
        for s in samples:
            lps = list(s.logprobs)
            completions.append(
                CompletionOutput(
                    index=s.index,
                    text=s.text,
                    token_ids=list(s.token_ids),
                    cumulative_logprob=float(sum(lps)) if lps else None,
                    logprobs=_logprob_dicts(s.token_ids, lps, s.ranks, s.top_logprobs) if wants_logprobs else None,
                    finish_reason=s.finish_reason,
                    lora_request=lora,
                )
            )
        first = samples[0]
        prompt_logprobs = None
        if request.sampling.prompt_logprobs >= 0:
            prompt_logprobs = [None]
            for p in first.prompt_logprobs:
                d = {t.token: Logprob(t.logprob, rank) for rank, t in enumerate(p.top_logprobs, 1)}
                d.setdefault(p.token, Logprob(p.logprob, p.rank))
                prompt_logprobs.append(d)
        return RequestOutput(
            request_id=str(i),
            prompt=first.prompt or None,
            prompt_token_ids=list(first.prompt_token_ids),
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            lora_request=lora,
        )

    # -- sleep and wake (vLLM's enable_sleep_mode) ------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Frees the workers' memory: level 1 keeps the weights in host memory, level 2
        discards them (refill them with an update, or wake and reload). The KV cache is
        discarded either way."""
        if not self._sleep_mode:
            raise ValueError("sleep mode is not enabled: LLM(..., enable_sleep_mode=True)")
        self._engine.sleep(level)

    def wake_up(self, tags: Optional[List[str]] = None) -> None:
        """Maps the memory of ``tags`` (``"weights"``, ``"kv_cache"``) back; all when None."""
        if not self._sleep_mode:
            raise ValueError("sleep mode is not enabled: LLM(..., enable_sleep_mode=True)")
        self._engine.wake_up(list(tags or []))

    def is_sleeping(self) -> bool:
        return bool(self._engine.sleeping_tags())

    def reset_prefix_cache(self) -> bool:
        self._engine.reset_prefix_cache()
        return True

    # -- the workers ------------------------------------------------------------------------

    def collective_rpc(
        self,
        method: Union[str, Callable[..., Any]],
        timeout: Optional[float] = None,
        args: Tuple[Any, ...] = (),
        kwargs: Optional[Dict[str, Any]] = None,
    ) -> List[Any]:
        """Runs ``method`` on every worker and returns the results in rank order: a named
        method (``"check_health"``, ``"list_loras"``, ``"update_weights_from_disk"`` …) with
        arguments that are booleans, numbers, strings or lists of them; or a Python callable,
        called as ``method(worker, *args, **kwargs)`` in each worker's thread (the workers
        must be in this process). A rank's exception is raised here."""
        kwargs = dict(kwargs or {})
        if callable(method):
            return self._engine.collective_rpc_callable(method, tuple(args), kwargs, timeout)
        return self._engine.collective_rpc(method, tuple(args), kwargs, timeout)

    def worker_healths(self) -> List[Dict[str, Any]]:
        """Each worker's health report, in rank order: ``healthy``, ``detail``, memory by
        tag, sleeping tags, and ``restarts`` (how often the rank was replaced)."""
        return list(self._engine.worker_healths())

    def add_lora(self, lora_request: LoRARequest) -> bool:
        core = _core.LoRARequestCore()
        core.lora_name = lora_request.lora_name
        core.lora_int_id = lora_request.lora_int_id
        core.lora_path = lora_request.lora_path
        return self._engine.add_lora(core)

    def remove_lora(self, lora_id: int) -> bool:
        return self._engine.remove_lora(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self._engine.pin_lora(lora_id)

    def list_loras(self) -> List[int]:
        return list(self._engine.list_loras())

    # -- weight updates (SGLang's names) -------------------------------------------------------

    def update_weights_from_disk(self, model_path: str, quantize_on_update: bool = False) -> None:
        """Reads a checkpoint of the same model shape (a Hugging Face directory or a GGUF
        file) into the loaded weights' memory, all ranks or none."""
        self._engine.update_weights_from_disk(str(model_path), quantize_on_update)

    def update_weights_from_tensors(
        self,
        named_tensors: Union[Dict[str, Any], Iterable[Tuple[str, Any]]],
        quantize_on_update: bool = False,
    ) -> None:
        """Writes tensors (NumPy arrays or PyTorch CPU tensors, float32/float16/bfloat16,
        under Hugging Face parameter names, whole: each rank takes its shard) over the
        loaded weights, all ranks or none; any subset of the parameters. Contiguous arrays
        are read in place, without a copy."""
        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
        self._engine.update_weights_from_tensors(
            [(str(name), host_array(name, t)) for name, t in items], quantize_on_update
        )

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
        timeout: float = 60.0,
    ) -> None:
        """Joins every worker to the trainer's weight-update group (rank r as member
        ``rank_offset + r``; the trainer's ``WeightSender`` is member 0, with the same
        ``backend``: ``"gloo"``, or ``"nccl"`` when the workers run on GPUs). Blocks until
        all members have come."""
        self._engine.init_weights_update_group(master_address, int(master_port), int(rank_offset),
                                               int(world_size), backend, float(timeout))

    def update_weights_from_distributed(
        self,
        names: List[str],
        dtypes: List[Any],
        shapes: List[Sequence[int]],
        group_name: str = "weight_update_group",
        quantize_on_update: bool = False,
    ) -> None:
        """Receives the tensors the trainer's ``WeightSender.send`` broadcasts, in this
        order, and writes them over the weights, all ranks or none (``troupe.weights.describe``
        gives the three lists for a set of tensors)."""
        self._engine.update_weights_from_distributed(
            list(names), [dtype_name(d) for d in dtypes], [[int(x) for x in s] for s in shapes],
            quantize_on_update)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._engine.destroy_weights_update_group()

    @property
    def weight_version(self) -> int:
        """Successful weight updates so far (0: the checkpoint as loaded)."""
        return self._engine.weight_version()

    # -- the rest ------------------------------------------------------------------------------

    def get_tokenizer(self) -> "Tokenizer":
        return Tokenizer(self._engine)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def close(self) -> None:
        """Stops the workers and frees their memory now (also when the object goes)."""
        self._engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Tokenizer:
    """The model's tokenizer, as far as troupe's engine has one."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return list(self._engine.tokenize(text, add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._engine.decode(list(token_ids))

    @property
    def vocab_size(self) -> int:
        return self._engine.vocab_size()


