#!/usr/bin/env python3
"""The Python package against its anchors, in one run, alternating, medians; prints JSON.

1. LLM.generate throughput against the C++ `troupe bench generate` on the same batch
   (--num-prompts × --input-len token ids drawn as it draws them, --output-len greedy
   tokens each).
2. update_weights_from_distributed of a SmolLM2-135M-shaped float32 model from a trainer
   process, against a bare torch.distributed.broadcast (Gloo) of the same tensors between
   two Python processes (needs PyTorch).
3. update_weights_from_tensors of the same tensors (NumPy, in this process) against a
   memcpy of the same bytes (numpy.copyto into arrays already allocated).

    python scripts/bench-python.py --model ~/.cache/troupe/models/SmolLM2-135M-Instruct.Q4_1.gguf

Run with the Python environment the package is installed in (scripts/test.sh's).
"""

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import troupe
from troupe import LLM, SamplingParams, WeightSender, describe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_safetensors(path):
    import struct

    data = open(path, "rb").read()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    out = {}
    for name, info in header.items():
        if name != "__metadata__":
            b, e = info["data_offsets"]
            out[name] = np.frombuffer(data[8 + size + b : 8 + size + e], np.float32).reshape(info["shape"]).copy()
    return out


def bench_generate(model, args):
    cli = [sys.executable, "-m", "troupe", "bench", "generate", "--model", model, "--json",
           "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len)]
    # The engine as the command makes it: weights mapped from its weight cache.
    cache = os.environ.get("TROUPE_WEIGHT_CACHE") or os.path.expanduser("~/.cache/troupe/weights")
    llm = LLM(model, weight_cache=cache)
    # The C++ bench's very batch: its std::mt19937 seeded 0 is NumPy's legacy MT19937.
    vocab = llm.get_tokenizer().vocab_size
    words = np.random.RandomState(0).randint(0, 2**32, size=args.num_prompts * args.input_len,
                                             dtype=np.uint64)
    ids = (words % vocab).reshape(args.num_prompts, args.input_len)
    prompts = [{"prompt_token_ids": row.tolist()} for row in ids]
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], sp)  # warm
    python, cpp = [], []
    for _ in range(args.rounds):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate(prompts, sp)
        took = time.perf_counter() - start
        python.append(sum(len(o.outputs[0].token_ids) for o in outs) / took)
        line = subprocess.run(cli, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
        cpp.append(json.loads(line)["output_tokens_per_s"])
    llm.close()
    p, c = statistics.median(python), statistics.median(cpp)
    return {"python_tokens_per_s": round(p, 2), "cpp_tokens_per_s": round(c, 2),
            "ratio": round(p / c, 3), "runs": {"python": python, "cpp": cpp}}


def _torch_receiver(port, path, rounds):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    tensors = [torch.empty_like(torch.from_numpy(t)) for t in read_safetensors(path).values()]
    for _ in range(rounds):
        dist.barrier()
        for t in tensors:
            dist.broadcast(t, src=0)
        dist.barrier()
    dist.destroy_process_group()


def torch_run(path, rounds):
    """Seconds per round of a bare Gloo broadcast of the tensors between two processes."""
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    times = ctx.Manager().list()
    receiver = ctx.Process(target=_torch_receiver, args=(port, path, rounds))
    sender = ctx.Process(target=_torch_sender, args=(port, path, rounds, times))
    receiver.start()
    sender.start()
    sender.join()
    receiver.join()
    return list(times)


def _torch_sender(port, path, rounds, out):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    tensors = [torch.from_numpy(t) for t in read_safetensors(path).values()]
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        for t in tensors:
            dist.broadcast(t, src=0)
        dist.barrier()
        out.append(time.perf_counter() - start)
    dist.destroy_process_group()


def _troupe_trainer(port, path, rounds):
    weights = read_safetensors(path)
    sender = WeightSender("127.0.0.1", port, 2, timeout=120)
    for _ in range(rounds):
        sender.send(weights)


def bench_updates(args):
    work = tempfile.mkdtemp(prefix="troupe-bench-")
    subprocess.run([sys.executable, "-m", "troupe", "make-model", "--preset", "smollm2-135m",
                    "--out", work], check=True, capture_output=True)
    path = os.path.join(work, "model.safetensors")
    weights = read_safetensors(path)
    nbytes = sum(t.nbytes for t in weights.values())
    llm = LLM(work, kv_cache_memory_bytes=16 << 20, max_model_len=256)
    result = {"bytes": nbytes}
    # From tensors, against memcpy of the same bytes.
    targets = {n: np.empty_like(t) for n, t in weights.items()}
    update, copy = [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        llm.update_weights_from_tensors(weights)
        update.append(time.perf_counter() - start)
        start = time.perf_counter()
        for n, t in weights.items():
            np.copyto(targets[n], t)
        copy.append(time.perf_counter() - start)
    u, c = statistics.median(update), statistics.median(copy)
    result["from_tensors"] = {"seconds": round(u, 4), "memcpy_seconds": round(c, 4),
                              "gb_per_s": round(nbytes / u / 1e9, 2),
                              "memcpy_gb_per_s": round(nbytes / c / 1e9, 2), "ratio": round(c / u, 3)}
    # From a trainer process, against torch.distributed.broadcast between two processes.
    try:
        import torch  # noqa: F401
    except ImportError:
        result["from_distributed"] = {"skipped": "PyTorch is not installed"}
        return result
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    trainer = ctx.Process(target=_troupe_trainer, args=(port, path, args.rounds + 1))
    trainer.start()
    llm.init_weights_update_group("127.0.0.1", port, 1, 2, timeout=120)
    names, dtypes, shapes = describe(weights)
    llm.update_weights_from_distributed(names, dtypes, shapes)  # warm: buffers allocated
    # In turns: a round of troupe's (the trainer waits in its next send meanwhile), then
    # torch's second round (its first warms it alike), so that both see the machine alike.
    ours, theirs = [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        llm.update_weights_from_distributed(names, dtypes, shapes)
        ours.append(time.perf_counter() - start)
        theirs.append(torch_run(path, 2)[-1])
    trainer.join()
    llm.destroy_weights_update_group()
    o, t = statistics.median(ours), statistics.median(theirs)
    result["from_distributed"] = {"seconds": round(o, 4), "torch_broadcast_seconds": round(t, 4),
                                  "gb_per_s": round(nbytes / o / 1e9, 2),
                                  "torch_gb_per_s": round(nbytes / t / 1e9, 2), "ratio": round(t / o, 3),
                                  "runs": {"troupe": ours, "torch": theirs}}
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the model of the generate comparison")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    out = {"troupe": troupe.__version__, "generate": bench_generate(os.path.expanduser(args.model), args),
           "weight_updates": bench_updates(args)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
