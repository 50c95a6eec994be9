"""Weights updated in place from Python, as an RL trainer pushes them: from disk and from
NumPy/PyTorch tensors at TP 1 and 2, all ranks or none, while asleep."""

import numpy as np
import pytest

from troupe import LLM, SamplingParams, TroupeError, WorkerFault
from conftest import first_logprob, fixture, read_safetensors, reference

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def tiny(model: str, **kw) -> LLM:
    return LLM(model, kv_cache_memory_bytes=2 << 20, block_size=4, **kw)


def tokens(llm: LLM, ref: dict) -> list:
    outs = llm.generate([{"prompt_token_ids": p["token_ids"]} for p in ref["prompts"]], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def greedy_of(ref: dict) -> list:
    return [p["greedy"] for p in ref["prompts"]]


def matches_transformers(llm: LLM, ref: dict) -> bool:
    """transformers' greedy tokens, and its logprob of the first one (within 1e-4)."""
    outs = llm.generate([{"prompt_token_ids": p["token_ids"]} for p in ref["prompts"]],
                        SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=0))
    for o, p in zip(outs, ref["prompts"]):
        first = o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob
        if o.outputs[0].token_ids != p["greedy"] or abs(first - first_logprob(p)) > 1e-4:
            return False
    return True


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ["llama-gqa", "phi3-fused"])
def test_updates_give_transformers_tokens_on_the_new_weights(other_model, tp, name):
    ref = reference(name)
    path, _ = other_model(name)
    llm = tiny(path, tensor_parallel_size=tp)
    assert tokens(llm, ref) != greedy_of(ref)
    assert llm.weight_version == 0
    llm.update_weights_from_disk(fixture(name))
    assert matches_transformers(llm, ref)
    assert llm.weight_version == 1
    llm.update_weights_from_disk(path)
    assert tokens(llm, ref) != greedy_of(ref)
    # NumPy arrays under Hugging Face names, as a dict.
    llm.update_weights_from_tensors(read_safetensors(fixture(name) + "/model.safetensors"))
    assert matches_transformers(llm, ref)
    assert llm.weight_version == 3


def test_non_contiguous_and_half_arrays():
    ref = reference("llama-gqa")
    weights = read_safetensors(fixture("llama-gqa") + "/model.safetensors")
    llm = tiny(fixture("llama-gqa"))
    # A transposed view (not contiguous) of a transposed copy is the same matrix; pairs, not
    # a dict, as SGLang takes them.
    pairs = [(n, np.ascontiguousarray(t.T).T if t.ndim == 2 else t) for n, t in weights.items()]
    llm.update_weights_from_tensors(pairs)
    assert tokens(llm, ref) == greedy_of(ref)
    # float16 values are converted as a load converts them: close to, not the float32 tokens.
    llm.update_weights_from_tensors({n: t.astype(np.float16) for n, t in weights.items()})
    assert llm.weight_version == 2


def test_a_refused_update_changes_no_rank(other_model):
    ref = reference("llama-gqa")
    path, theirs = other_model("llama-gqa")
    llm = tiny(path, tensor_parallel_size=2)
    before = tokens(llm, ref)
    good = read_safetensors(fixture("llama-gqa") + "/model.safetensors")
    names = list(good)
    # A bad name in the middle: the names before it are good ones.
    bad = [(n, good[n]) for n in names[: len(names) // 2]]
    bad.append(("model.layers.0.self_attn.r_proj.weight", good[names[0]]))
    bad += [(n, good[n]) for n in names[len(names) // 2 :]]
    with pytest.raises(TroupeError) as e:
        llm.update_weights_from_tensors(bad)
    assert e.value.errc == "invalid_argument" and "r_proj" in str(e.value)
    assert tokens(llm, ref) == before
    wrong = dict(good)
    wrong["model.layers.1.mlp.down_proj.weight"] = good["model.layers.1.mlp.down_proj.weight"].T.copy()
    with pytest.raises(TroupeError, match="down_proj"):
        llm.update_weights_from_tensors(wrong)
    nan = dict(good)
    nan["model.norm.weight"] = good["model.norm.weight"].copy()
    nan["model.norm.weight"][3] = np.nan
    with pytest.raises(TroupeError, match="model.norm.weight"):
        llm.update_weights_from_tensors(nan)
    with pytest.raises(TroupeError, match="model.embed_tokens.weight"):
        llm.update_weights_from_tensors({"model.embed_tokens.weight": good["model.embed_tokens.weight"].astype(np.int32)})
    with pytest.raises(TypeError):
        llm.update_weights_from_tensors({"model.norm.weight": [1.0] * 64})
    with pytest.raises(TroupeError, match="differs"):
        llm.update_weights_from_disk(fixture("qwen2-bias"))
    assert tokens(llm, ref) == before
    assert llm.weight_version == 0


@pytest.mark.parametrize("level", [1, 2])
def test_an_update_while_asleep(other_model, level):
    ref = reference("llama-gqa")
    path, _ = other_model("llama-gqa")
    llm = tiny(path, tensor_parallel_size=2, enable_sleep_mode=True)
    llm.sleep(level)
    llm.update_weights_from_tensors(read_safetensors(fixture("llama-gqa") + "/model.safetensors"))
    # The weights woke for it; the KV cache sleeps until wake_up.
    assert llm.is_sleeping()
    llm.wake_up(["kv_cache"])
    assert not llm.is_sleeping()
    assert tokens(llm, ref) == greedy_of(ref)


def test_quantized_weights_take_floats_only_when_asked():
    gguf = fixture("llama-gqa-gguf") + "/llama-gqa-q8_0.gguf"
    ref = {"prompts": reference("llama-gqa-gguf")["Q8_0"]}
    llm = tiny(gguf)
    assert tokens(llm, ref) == greedy_of(ref)
    floats = read_safetensors(fixture("llama-gqa") + "/model.safetensors")
    with pytest.raises(TroupeError, match="quantize_on_update"):
        llm.update_weights_from_tensors(floats)
    # Q8_0 blocks made again from the weights they were made from are the same blocks.
    llm.update_weights_from_tensors(floats, quantize_on_update=True)
    assert tokens(llm, ref) == greedy_of(ref)


def test_torch_tensors_when_torch_is_there():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed in this venv")
    ref = reference("llama-gqa")
    weights = read_safetensors(fixture("llama-gqa") + "/model.safetensors")
    llm = tiny(fixture("llama-gqa"), tensor_parallel_size=2)
    params = {n: torch.nn.Parameter(torch.from_numpy(t)) for n, t in weights.items()}
    llm.update_weights_from_tensors(params)  # requires_grad: detached, read in place
    assert tokens(llm, ref) == greedy_of(ref)
    llm.update_weights_from_tensors({n: p.detach().to(torch.bfloat16) for n, p in params.items()})
    assert llm.weight_version == 2


def test_a_replaced_worker_has_the_updated_weights(other_model):
    ref = reference("llama-gqa")
    path, _ = other_model("llama-gqa")
    llm = tiny(path, tensor_parallel_size=2, max_restarts=2)
    llm.update_weights_from_tensors(read_safetensors(fixture("llama-gqa") + "/model.safetensors"))

    def break_rank_1(worker):
        if worker.rank == 1:
            raise WorkerFault("its device is gone")

    with pytest.raises(TroupeError):
        llm.collective_rpc(break_rank_1)
    # The replacement loaded the checkpoint and then the update its predecessor had.
    assert tokens(llm, ref) == greedy_of(ref)
    assert [h["restarts"] for h in llm.worker_healths()] == [0, 1]
