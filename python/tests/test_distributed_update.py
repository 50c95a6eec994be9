"""Weights from a trainer in another process over a weight-update group (SGLang's
init_weights_update_group / update_weights_from_distributed): transformers' tokens on the
new weights at TP 1 and 2; a refused update tells the trainer and changes nothing."""

import multiprocessing
import socket

import pytest

from troupe import LLM, SamplingParams, TroupeError, WeightSender, describe
from conftest import first_logprob, fixture, read_safetensors, reference

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer(port: int, world_size: int, updates: list, results) -> None:
    """A trainer process: joins as member 0 and sends each update in turn."""
    try:
        sender = WeightSender("127.0.0.1", port, world_size, timeout=60)
        for weights in updates:
            try:
                sender.send(weights)
                results.put("sent")
            except TroupeError as e:
                results.put(f"refused: {e}")
            except TypeError as e:  # a tensor it cannot read
                results.put(f"could not send: {e}")
    except Exception as e:  # reported to the test, which fails on it
        results.put(f"error: {type(e).__name__}: {e}")


def tokens(llm: LLM, ref: dict) -> list:
    outs = llm.generate([{"prompt_token_ids": p["token_ids"]} for p in ref["prompts"]], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("tp", [1, 2])
def test_weights_from_a_trainer_process(other_model, tp):
    ref = reference("llama-gqa")
    path, theirs = other_model("llama-gqa")
    good = read_safetensors(fixture("llama-gqa") + "/model.safetensors")
    bad = dict(good)
    bad["model.layers.0.mlp.up_proj.weight"] = good["model.layers.0.mlp.up_proj.weight"][:8]
    unreadable = dict(good)
    unreadable["model.norm.weight"] = good["model.norm.weight"].tolist()
    llm = LLM(path, kv_cache_memory_bytes=2 << 20, block_size=4, tensor_parallel_size=tp)
    before = tokens(llm, ref)
    assert before != [p["greedy"] for p in ref["prompts"]]
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=trainer, args=(port, 1 + tp, [bad, unreadable, good], results))
    child.start()
    try:
        llm.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=1 + tp)
        # A shape that does not fit: refused on the engine, the trainer told, nothing sent.
        with pytest.raises(TroupeError, match="up_proj"):
            llm.update_weights_from_distributed(*describe(bad))
        assert results.get(timeout=60).startswith("refused")
        assert tokens(llm, ref) == before
        # A tensor the trainer cannot read: it raises, the engine hears so at once.
        with pytest.raises(TroupeError, match="the trainer called the update off"):
            llm.update_weights_from_distributed(*describe(good))
        assert results.get(timeout=60).startswith("could not send: tensor 'model.norm.weight'")
        assert tokens(llm, ref) == before
        llm.update_weights_from_distributed(*describe(good))
        assert results.get(timeout=60) == "sent"
        assert tokens(llm, ref) == [p["greedy"] for p in ref["prompts"]]
        out = llm.generate({"prompt_token_ids": ref["prompts"][0]["token_ids"]},
                           SamplingParams(max_tokens=1, temperature=0, logprobs=0))[0].outputs[0]
        assert out.logprobs[0][out.token_ids[0]].logprob == pytest.approx(
            first_logprob(ref["prompts"][0]), abs=1e-4)
        assert llm.weight_version == 1
        llm.destroy_weights_update_group()
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def test_a_trainer_that_never_comes_is_a_timeout():
    llm = LLM(fixture("llama-gqa"), kv_cache_memory_bytes=2 << 20)
    with pytest.raises(TroupeError) as e:
        llm.init_weights_update_group("127.0.0.1", free_port(), 1, 2, timeout=1.0)
    assert e.value.errc in ("timeout", "worker_error")
    with pytest.raises(TroupeError, match="no weight-update group"):
        llm.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]])
    # The update's own mistake is the error said, not what it caused after.
    with pytest.raises(TroupeError, match="model.nope.weight"):
        llm.update_weights_from_distributed(["model.nope.weight"], ["float32"], [[64]])


def test_nccl_is_for_gpus_and_an_unknown_backend_is_named():
    llm = LLM(fixture("llama-gqa"), kv_cache_memory_bytes=2 << 20)
    with pytest.raises(TroupeError, match="backend 'nccl' needs GPU workers; rank 0 computes on "
                                          "cpu:0") as e:
        llm.init_weights_update_group("127.0.0.1", free_port(), 1, 2, backend="nccl", timeout=5)
    assert e.value.errc == "unsupported"
    with pytest.raises(TroupeError, match=r"backend 'mpi' \(gloo or nccl\)"):
        llm.init_weights_update_group("127.0.0.1", free_port(), 1, 2, backend="mpi", timeout=5)
    # The trainer's end: a GPU that is not there is refused at once, not after the meeting.
    with pytest.raises(TroupeError) as e:
        WeightSender("127.0.0.1", free_port(), 2, backend="nccl", device="cuda:4096", timeout=30)
    assert e.value.errc == "unsupported" or "cuda:4096 does not exist" in str(e.value)


def test_the_senders_gpu_is_an_index_a_name_or_a_torch_device():
    from troupe.weights import gpu_index

    torch = pytest.importorskip("torch")
    assert gpu_index(3) == 3
    assert gpu_index("cuda:2") == 2
    assert gpu_index(torch.device("cuda", 1)) == 1
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    assert gpu_index(None) == current
    assert gpu_index("cuda") == current
    with pytest.raises(ValueError, match="'cpu' is no GPU"):
        gpu_index("cpu")
