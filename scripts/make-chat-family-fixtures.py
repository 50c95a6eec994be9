#!/usr/bin/env python3
"""Chat fixtures of every family troupe runs, for `troupe serve` through the openai client
(tests/serve_openai_test.py): a tiny random-weight model of each family with its own chat
template (tests/fixtures/chat-templates, the real ones) and tests/fixtures/tiny-tokenizer's
byte-level BPE, and transformers' greedy tokens for a conversation rendered by that template.

    python3 scripts/make-chat-family-fixtures.py

Each tests/fixtures/chat-families/<family>/ holds the tokenizer as transformers saves it
(the tiny one with the family's control tokens added as special tokens, as its real
tokenizer holds them, the template, the bos and eos tokens) and links to a model's
config.json and weights (a family fixture whose vocabulary covers the tokenizer's ids, or
one written here: llama-chat, qwen2-chat); families.json holds each family's conversation,
the prompt's token ids as apply_chat_template gives them, and 8 greedy tokens. Needs torch and transformers (the
environment scripts/fidelity.sh makes)."""
import json
import os
import pathlib
import shutil

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

from fixture_lib import tiny_random_model

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
OUT = FIXTURES / "chat-families"
TOKENIZER = FIXTURES / "tiny-tokenizer" / "tokenizer.json"

# family: (model fixture, template in chat-templates, bos_token, eos_token, the other
# control tokens of the family's tokenizer that the template writes)
QWEN = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
FAMILIES = {
    "llama-3.1": ("chat-families/llama-chat", "llama-3.1", "<|begin_of_text|>", "<|eot_id|>",
                  ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"]),
    "mistral-nemo": ("mixtral-experts", "mistral-nemo", "<s>", "</s>",
                     ["[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                      "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]),
    "mistral-v3": ("chat-families/llama-chat", "mistral-v3", "<s>", "</s>",
                   ["[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                    "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]),
    "qwen2.5": ("chat-families/qwen2-chat", "qwen2.5", None, "<|im_end|>", QWEN),
    "qwen3": ("qwen3-norms", "qwen3", None, "<|im_end|>", QWEN),
    "qwen3-moe": ("qwen3-moe", "qwen3", None, "<|im_end|>", QWEN),
    "gemma-2": ("gemma2-softcap", "gemma-2", "<bos>", "<eos>",
                ["<start_of_turn>", "<end_of_turn>"]),
    "gemma-3": ("gemma3-layers", "gemma-3", "<bos>", "<eos>",
                ["<start_of_turn>", "<end_of_turn>"]),
    "phi-3.5": ("phi3-fused", "phi-3.5", "<s>", "<|endoftext|>",
                ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]),
    "phi-4": ("phi3-fused", "phi-4", None, "<|im_end|>", ["<|im_sep|>"]),
    "deepseek-r1-distill": ("chat-families/qwen2-chat", "deepseek-r1-distill",
                            "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                            ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]),
    "smollm3": ("chat-families/llama-chat", "smollm3", None, "<|im_end|>",
                ["<think>", "</think>"]),
}

# Alternating roles (Gemma's templates refuse anything else), non-ASCII text.
CONVERSATION = [
    {"role": "user", "content": "Hello! Who are you?"},
    {"role": "assistant", "content": "A tiny model, très petit."},
    {"role": "user", "content": "Say «bonjour» twice."},
]
GREEDY_TOKENS = 8


def models():
    """The families' models beyond the family fixtures: Llama and Qwen2 with a vocabulary
    that covers the tokenizer (theirs have 256 ids)."""
    common = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2, torch_dtype="float32")
    yield "llama-chat", LlamaConfig(rope_theta=500000.0, **common)
    yield "qwen2-chat", Qwen2Config(rope_theta=1000000.0, use_sliding_window=False, **common)


def link(target, name):
    """A relative link `name` to `target`, replacing one that is there."""
    if name.is_symlink() or name.exists():
        name.unlink()
    name.symlink_to(os.path.relpath(target, name.parent))


def main():
    OUT.mkdir(exist_ok=True)
    for name, config in models():
        directory = OUT / name
        tiny_random_model(config).save_pretrained(directory, safe_serialization=True)
        print("wrote", directory)
    families = {}
    for family, (model, template_name, bos, eos, controls) in FAMILIES.items():
        template = (FIXTURES / "chat-templates" / f"{template_name}.jinja").read_text()
        directory = OUT / family
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        for f in ("config.json", "model.safetensors"):
            link(FIXTURES / model / f, directory / f)
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER), bos_token=bos,
                                            eos_token=eos, chat_template=template)
        tokenizer.add_special_tokens({"additional_special_tokens": controls})
        tokenizer.save_pretrained(directory)
        ids = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        lm = AutoModelForCausalLM.from_pretrained(FIXTURES / model, dtype=torch.float32).eval()
        assert max(ids) < lm.config.vocab_size, family
        prompt = torch.tensor([ids])
        with torch.no_grad():
            out = lm.generate(prompt, attention_mask=torch.ones_like(prompt),
                              max_new_tokens=GREEDY_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        families[family] = {"model": model, "template": template_name,
                            "messages": CONVERSATION, "prompt_token_ids": ids,
                            "greedy": out[0, len(ids):].tolist()}
        print("wrote", directory)
    with open(OUT / "families.json", "w") as f:
        json.dump(families, f, ensure_ascii=False, indent=1)


if __name__ == "__main__":
    main()
