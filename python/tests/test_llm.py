"""troupe.LLM against transformers' reference tokens, the troupe command, and vLLM's API."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import troupe
from troupe import LLM, LoRARequest, SamplingParams, TroupeError
from conftest import fixture, reference

GREEDY = dict(temperature=0, ignore_eos=True)


def tiny(name: str = "llama-gqa", **kw) -> LLM:
    kw.setdefault("kv_cache_memory_bytes", 2 << 20)
    kw.setdefault("block_size", 4)
    return LLM(fixture(name), **kw)


def token_prompts(ref: dict) -> list:
    return [{"prompt_token_ids": p["token_ids"]} for p in ref["prompts"]]


@pytest.mark.parametrize("tp", [1, 2])
def test_token_prompts_give_transformers_greedy_tokens(tp):
    ref = reference("llama-gqa")
    with tiny(tensor_parallel_size=tp) as llm:
        outs = llm.generate(token_prompts(ref), SamplingParams(max_tokens=32, **GREEDY))
        assert [o.outputs[0].token_ids for o in outs] == [p["greedy"] for p in ref["prompts"]]
        assert [o.prompt_token_ids for o in outs] == [p["token_ids"] for p in ref["prompts"]]
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        assert all(o.finished for o in outs)


def cli_json(model: str, *args: str) -> list:
    out = subprocess.run([sys.executable, "-m", "troupe", "generate", "--model", model, "--json",
                          "--kv-cache-memory", str(32 << 20), "--max-model-len", "512", *args],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def test_text_chat_and_sampling_equal_the_command(smollm2):
    llm = LLM(smollm2, kv_cache_memory_bytes=32 << 20, max_model_len=512)
    prompt = "The capital of France is"
    cases = [
        ([prompt], SamplingParams(max_tokens=12, temperature=0), []),
        ([prompt], SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7),
         ["--temperature", "0.8", "--top-p", "0.9", "--seed", "7"]),
    ]
    for prompts, sp, flags in cases:
        ours = llm.generate(prompts, sp)[0].outputs[0]
        theirs = cli_json(smollm2, "--prompt", prompt, "--max-tokens", "12", *flags)[0]
        assert ours.token_ids == theirs["token_ids"]
        assert ours.text == theirs["text"]
    chat = llm.chat([{"role": "user", "content": prompt}], SamplingParams(max_tokens=12, temperature=0))
    theirs = cli_json(smollm2, "--prompt", prompt, "--chat", "--max-tokens", "12")[0]
    assert chat[0].outputs[0].token_ids == theirs["token_ids"]
    # The rendered prompt is the template's, as transformers renders it.
    rendered = llm.render_chat([{"role": "user", "content": prompt}])
    assert rendered.endswith("<|im_start|>assistant\n") and prompt in rendered
    assert llm.get_tokenizer().decode(llm.get_tokenizer().encode(prompt, False)) == prompt
    # Structured output: a regular expression, a choice, a schema.
    import re

    from troupe import GuidedDecodingParams

    phone = llm.generate("Call me at", SamplingParams(max_tokens=20, temperature=0.7, seed=1,
                         guided_decoding=GuidedDecodingParams(regex=r"\d{3}-\d{4}")))
    assert re.fullmatch(r"\d{3}-\d{4}", phone[0].outputs[0].text)
    pick = llm.generate("Is the sky blue?", SamplingParams(
        max_tokens=8, temperature=0, guided_decoding=GuidedDecodingParams(choice=["yes", "no"])))
    assert pick[0].outputs[0].text in ("yes", "no")
    person = llm.generate("A person as JSON:", SamplingParams(max_tokens=60, temperature=0,
        guided_decoding=GuidedDecodingParams(json={"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 10}}, "required": ["name"]})))
    assert isinstance(json.loads(person[0].outputs[0].text)["name"], str)
    with pytest.raises(TroupeError, match="lookaround"):
        llm.generate("x", SamplingParams(guided_decoding=GuidedDecodingParams(regex="(?=a)")))


def test_logprobs_n_and_stop():
    llm = tiny()
    p = {"prompt_token_ids": [1, 15, 27, 99, 3]}
    out = llm.generate(p, SamplingParams(max_tokens=6, logprobs=3, **GREEDY))[0].outputs[0]
    assert len(out.logprobs) == 6
    for token, position in zip(out.token_ids, out.logprobs):
        ranks = sorted(lp.rank for lp in position.values())
        assert ranks == [1, 2, 3]  # greedy: the sampled token is the most likely
        assert position[token].rank == 1
    assert out.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(out.token_ids, out.logprobs)))
    # Outside the top logprobs the sampled token still has its rank, as in vLLM.
    drawn = llm.generate(p, SamplingParams(max_tokens=12, logprobs=0, temperature=2.0,
                                           seed=3))[0].outputs[0]
    ranks = [d[t].rank for t, d in zip(drawn.token_ids, drawn.logprobs)]
    assert all(isinstance(r, int) and r >= 1 for r in ranks) and max(ranks) > 1
    none = llm.generate(p, SamplingParams(max_tokens=2, **GREEDY))[0].outputs[0]
    assert none.logprobs is None
    many = llm.generate(p, SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=5))[0]
    assert [o.index for o in many.outputs] == [0, 1, 2]
    per_prompt = llm.generate([p, p], [SamplingParams(max_tokens=2, **GREEDY),
                                       SamplingParams(max_tokens=5, **GREEDY)])
    assert [len(o.outputs[0].token_ids) for o in per_prompt] == [2, 5]
    stopped = llm.generate(p, SamplingParams(max_tokens=20, stop_token_ids=[out.token_ids[2]], **GREEDY))
    assert stopped[0].outputs[0].token_ids == out.token_ids[:3]
    assert stopped[0].outputs[0].finish_reason == "stop"


def test_bad_input_is_an_exception_naming_it():
    with pytest.raises(TypeError, match="temprature"):
        SamplingParams(temprature=0.5)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=True)
    with pytest.raises(ValueError, match="include_stop_str_in_output"):
        SamplingParams(include_stop_str_in_output=True)
    with pytest.raises(TypeError, match="max_num_seq"):
        tiny(max_num_seq=4)
    llm = tiny()
    # A token id past the vocabulary (256 ids): the engine's own check.
    with pytest.raises(TroupeError) as e:
        llm.generate({"prompt_token_ids": [1, 256]}, SamplingParams(max_tokens=2))
    assert e.value.errc == "invalid_argument" and "256" in str(e.value)
    with pytest.raises(TroupeError) as e:
        llm.generate("text", SamplingParams(max_tokens=2))  # no tokenizer
    assert e.value.errc == "invalid_argument"
    with pytest.raises(TroupeError) as e:
        LLM(fixture("no-such-model"))
    assert "no-such-model" in str(e.value)
    # The engine is still fine.
    assert llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_collective_rpc_named_methods_and_callables():
    llm = tiny(tensor_parallel_size=2)
    assert llm.collective_rpc("list_loras") == [[], []]
    health = llm.collective_rpc("check_health")
    assert [h["rank"] for h in health] == [0, 1] and all(h["healthy"] for h in health)
    assert health[0]["memory"]["kv_cache"]["allocated_bytes"] == 2 << 20
    with pytest.raises(TroupeError) as e:
        llm.collective_rpc("no_such_method")
    assert e.value.errc == "unknown_method"

    def where(worker, offset, scale=1):
        return (worker.rank, worker.world_size, worker.model_architecture, (offset + worker.rank) * scale)

    assert llm.collective_rpc(where, args=(10,), kwargs={"scale": 2}) == [
        (0, 2, "LlamaForCausalLM", 20), (1, 2, "LlamaForCausalLM", 22)]
    # A worker's named method from a callable, in its own thread.
    assert llm.collective_rpc(lambda w: w.call("list_loras")) == [[], []]

    class Refused(Exception):
        pass

    def fails_on_one(worker):
        if worker.rank == 1:
            raise Refused("rank 1 says no")
        return worker.rank

    with pytest.raises(Refused, match="rank 1 says no"):
        llm.collective_rpc(fails_on_one)
    kept = []
    llm.collective_rpc(lambda w: kept.append(w))
    with pytest.raises(TroupeError, match="only valid during its call"):
        kept[0].rank
    assert llm.collective_rpc(where, args=(0,))[1][0] == 1


def test_sleep_and_wake_up_keep_the_tokens():
    ref = reference("llama-gqa")
    sp = SamplingParams(max_tokens=32, **GREEDY)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        tiny().sleep(1)
    llm = tiny(tensor_parallel_size=2, enable_sleep_mode=True)
    for level in (1, 2):
        llm.sleep(level)
        assert llm.is_sleeping()
        llm.wake_up(["weights"])
        if level == 2:
            # Discarded: refilled from the checkpoint.
            llm.update_weights_from_disk(fixture("llama-gqa"))
        llm.wake_up()
        assert not llm.is_sleeping()
        outs = llm.generate(token_prompts(ref), sp)
        assert [o.outputs[0].token_ids for o in outs] == [p["greedy"] for p in ref["prompts"]]


def test_lora_adapters_give_peft_tokens():
    ref = reference("llama-gqa-adapters")
    adapters = fixture("llama-gqa-adapters")
    llm = tiny(max_loras=2)
    lora = LoRARequest("all", 1, adapters + "/lora-all")
    outs = llm.generate([{"prompt_token_ids": p} for p in ref["prompts"]],
                        SamplingParams(max_tokens=16, **GREEDY), lora_request=lora)
    assert [o.outputs[0].token_ids for o in outs] == [x["greedy"] for x in ref["adapters"]["lora-all"]]
    assert outs[0].outputs[0].lora_request == lora
    assert llm.list_loras() == [1]
    assert llm.add_lora(LoRARequest("qv", 2, adapters + "/lora-qv"))
    assert llm.list_loras() == [1, 2]
    assert llm.remove_lora(1)
    assert llm.list_loras() == [2]
    with pytest.raises(ValueError):
        LoRARequest("bad", 0, adapters + "/lora-qv")


def test_ctrl_c_stops_a_generate_and_the_engine_goes_on():
    llm = tiny(max_num_seqs=4)
    many = [{"prompt_token_ids": [1, 2 + i]} for i in range(64)]
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        llm.generate(many, SamplingParams(max_tokens=400, **GREEDY))
    assert time.monotonic() - started < 60
    ref = reference("llama-gqa")
    outs = llm.generate(token_prompts(ref), SamplingParams(max_tokens=32, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == [p["greedy"] for p in ref["prompts"]]


def test_the_gil_is_released_while_the_engine_works():
    llm = tiny(max_num_seqs=8)
    done = threading.Event()
    ticks = 0

    def run():
        llm.generate([{"prompt_token_ids": [1, 2 + i]} for i in range(16)],
                     SamplingParams(max_tokens=200, **GREEDY))
        done.set()

    worker = threading.Thread(target=run)
    worker.start()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    worker.join()
    # The main thread ran while generate did (a held GIL would allow none of it).
    assert ticks > 10


def test_python_m_troupe_runs_the_command():
    out = subprocess.run([sys.executable, "-m", "troupe", "generate", "--model", fixture("llama-gqa"),
                          "--prompt-token-ids", "1,15,27,99,3", "--max-tokens", "32",
                          "--kv-cache-memory", "2000000"],
                         check=True, capture_output=True, text=True).stdout
    greedy = reference("llama-gqa")["prompts"][0]["greedy"]
    assert "output ids: [" + ",".join(map(str, greedy)) + "]" in out
    assert troupe.__version__
