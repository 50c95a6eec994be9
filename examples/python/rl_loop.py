"""An RL loop on troupe: the rollout engine in this process, a PyTorch trainer in another.

Each iteration troupe generates a batch with the current policy, sleeps (level 1: the
weights go to host memory, the KV cache is freed) while the trainer takes an optimizer step
(a REINFORCE step that rewards tokens with an even id), wakes, and receives the trainer's
new weights over a weight-update group (Gloo, the trainer's process is member 0). After
each update troupe's greedy tokens are checked against transformers' on the trainer's
weights, and the engine's resident memory is read before, during and after the sleep.

    python examples/python/rl_loop.py --model tests/fixtures/llama-gqa --iterations 3

Prints one JSON line per iteration; exits 1 when troupe's tokens differ from
transformers'. Needs torch and transformers (the trainer's side).
"""

import argparse
import json
import multiprocessing
import socket
import sys

from troupe import LLM, SamplingParams, WeightSender, describe


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def greedy_tokens(model, prompts, steps):
    """transformers' greedy continuation of each prompt, EOS ignored."""
    import torch

    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(steps):
                nxt = model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            out.append(ids[0, len(p):].tolist())
    return out


def trainer(model_path, port, world_size, prompts, steps, conn):
    """Member 0: holds the policy, takes a step per batch, sends the new weights."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    sender = WeightSender("127.0.0.1", port, world_size)
    while True:
        batch = conn.recv()
        if batch is None:
            break
        # REINFORCE with a reward of 1 for each even token, 0 otherwise.
        model.train()
        loss = 0.0
        for prompt, generated in zip(prompts, batch):
            ids = torch.tensor([prompt + generated])
            logprobs = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1], dim=-1)
            taken = logprobs[torch.arange(len(generated)), torch.tensor(generated)]
            reward = torch.tensor([1.0 if t % 2 == 0 else 0.0 for t in generated])
            loss = loss - (taken * (reward - reward.mean())).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.eval()
        params = list(model.state_dict().items())
        conn.send((describe(params), greedy_tokens(model, prompts, steps), float(loss.detach())))
        sender.send(params)
    sender.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face directory (float32)")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()

    prompts = [[1, 15, 27, 99, 3], [1, 200, 7], [1, 42, 43, 44]]
    llm = LLM(args.model, tensor_parallel_size=args.tensor_parallel_size, enable_sleep_mode=True,
              kv_cache_memory_bytes=64 << 20, swap_space=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = 1 + args.tensor_parallel_size
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=trainer,
                        args=(args.model, port, world, prompts, args.tokens, theirs))
    child.start()
    llm.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=world)
    sampling = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    ok = True
    for it in range(args.iterations):
        batch = [o.outputs[0].token_ids for o in llm.generate(requests, sampling)]
        awake = resident_bytes()
        llm.sleep(1)
        asleep = resident_bytes()
        ours.send(batch)
        metadata, expected, loss = ours.recv()
        llm.update_weights_from_distributed(*metadata)  # wakes the weights for the update
        llm.wake_up()
        after = [o.outputs[0].token_ids for o in llm.generate(requests, sampling)]
        same = after == expected
        ok = ok and same
        print(json.dumps({"iteration": it, "loss": round(loss, 4), "weight_version": llm.weight_version,
                          "tokens_equal_transformers": same, "tokens_changed": after != batch,
                          "rss_awake_mb": round(awake / 2**20, 1),
                          "rss_asleep_mb": round(asleep / 2**20, 1)}), flush=True)
    ours.send(None)
    child.join(timeout=60)
    llm.destroy_weights_update_group()
    return 0 if ok and child.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
