#!/usr/bin/env python3
"""Writes PEFT adapters for the tiny llama-gqa fixture (and LoRAs for gemma3-layers,
phi3-fused and qwen3-moe, made by scripts/make-family-fixtures.py) and what transformers + peft compute
with them. CI only reads the committed files; run this again after changing what it writes
(after the scripts that write the base models):

    pip install torch transformers safetensors peft
    python3 scripts/make-adapter-fixtures.py [BASE ...]   (llama-gqa, gemma3-layers, phi3-fused,
                                                           qwen3-moe)
"""
import json
import pathlib
import shutil
import sys

import torch
from peft import LoraConfig, PeftModel, PromptTuningConfig, TaskType, get_peft_model
from transformers import AutoModelForCausalLM

fixtures = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
PROMPTS = [[1, 15, 27, 99, 3], [1, 200, 7], [5, 9, 13, 17, 21, 25, 29, 33, 37]]
GREEDY_TOKENS = 16


def base_model(base_dir):
    return AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval()


def gemma_adapters():
    # Every projection of Gemma 3's layers, rank 8.
    yield "lora-all", LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, bias="none",
                                 task_type=TaskType.CAUSAL_LM,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                 "gate_proj", "up_proj", "down_proj"])


def phi3_adapters():
    # Phi-3's fused projections, rank 4: B of qkv_proj and gate_up_proj cut by rows.
    yield "lora-fused", LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, bias="none",
                                   task_type=TaskType.CAUSAL_LM,
                                   target_modules=["qkv_proj", "o_proj", "gate_up_proj",
                                                   "down_proj"])


def moe_adapters():
    # The attention of a mixture, rank 4.
    yield "lora-attention", LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, bias="none",
                                       task_type=TaskType.CAUSAL_LM,
                                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    # The experts too: peft adapts transformers' merged expert parameters
    # (target_parameters), which troupe refuses by name.
    yield "lora-experts", LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, bias="none",
                                     task_type=TaskType.CAUSAL_LM,
                                     target_modules=["q_proj", "gate_proj", "up_proj",
                                                     "down_proj"])


def adapters():
    # Every projection, rank 8; PEFT starts B at zero, so both factors are randomised.
    yield "lora-all", LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, bias="none",
                                 task_type=TaskType.CAUSAL_LM,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                 "gate_proj", "up_proj", "down_proj"])
    # Attention only, rank 4, rank-stabilised scaling (alpha / sqrt(r)).
    yield "lora-qv", LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, bias="none",
                                use_rslora=True, task_type=TaskType.CAUSAL_LM,
                                target_modules=["q_proj", "v_proj"])
    # The MLP's row- and column-parallel layers, rank 2.
    yield "lora-mlp", LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, bias="none",
                                 task_type=TaskType.CAUSAL_LM,
                                 target_modules=["gate_proj", "down_proj"])
    yield "prompt-tuning", PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4,
                                              token_dim=64, num_transformer_submodules=1)


def greedy(model, prompt):
    """Last-position logits of the prompt and GREEDY_TOKENS greedy tokens, one full forward
    per token (no cache, so nothing of generate() is in the way)."""
    ids = list(prompt)
    last_logits = None
    for _ in range(GREEDY_TOKENS):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        if last_logits is None:
            last_logits = [float(v) for v in logits]
        ids.append(int(torch.argmax(logits)))
    return last_logits, ids[len(prompt):]


def write(base, adapter_configs):
    base_dir = fixtures / base
    out = fixtures / f"{base}-adapters"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()
    reference = {"prompts": PROMPTS, "adapters": {}}
    for seed, (name, config) in enumerate(adapter_configs):
        torch.manual_seed(100 + seed)
        model = get_peft_model(base_model(base_dir), config)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn_like(p) * 0.3)
                elif "prompt_encoder" in pname:
                    p.copy_(torch.randn_like(p) * 0.05)
        model.save_pretrained(out / name, safe_serialization=True)
        (out / name / "README.md").unlink()  # PEFT's model-card template
        config_path = out / name / "adapter_config.json"
        saved = json.loads(config_path.read_text())
        saved["base_model_name_or_path"] = base  # not this machine's path
        config_path.write_text(json.dumps(saved, indent=2) + "\n")
        # The reference comes from the saved files, loaded the way a user would.
        model = PeftModel.from_pretrained(base_model(base_dir), out / name).eval()
        runs = []
        for prompt in PROMPTS:
            last_logits, tokens = greedy(model, prompt)
            runs.append({"last_logits": last_logits, "greedy": tokens})
        reference["adapters"][name] = runs
        print("wrote", out / name)
    with open(out / "reference.json", "w") as f:
        json.dump(reference, f)


bases = {"llama-gqa": adapters, "gemma3-layers": gemma_adapters, "phi3-fused": phi3_adapters,
         "qwen3-moe": moe_adapters}
for base in sys.argv[1:] or bases:
    write(base, bases[base]())
