#!/usr/bin/env python3
"""Writes the fixtures of the model families beyond Llama, Mistral and Qwen2: tiny
random-weight models written by transformers itself, their reference outputs, and GGUF
copies made by llama.cpp's own convert_hf_to_gguf.py (from the llama.cpp tree of the
llama-cpp-python sdist that scripts/llamacpp-lib.sh unpacks), whose outputs come from
transformers on each file's weights dequantized by gguf-py. CI only reads the committed files; run this again
after changing what it writes:

    python3 scripts/make-family-fixtures.py [--llamacpp DIR] [NAME ...]

Needs torch, transformers, gguf and accelerate (the environment scripts/fidelity.sh makes).
The tiny models carry tests/fixtures/tiny-tokenizer's byte-level BPE vocabulary so that the
converter has one to write; its pre-tokenizer is no published model's, so the converter's
check of that (which only names the pre-tokenizer) is told "qwen2"."""
import argparse
import glob
import json
import os
import pathlib
import shutil
import sys
import tempfile

ap = argparse.ArgumentParser(description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
trees = sorted(glob.glob(os.path.expanduser(
    "~/.cache/troupe/llamacpp/llama_cpp_python-*/vendor/llama.cpp")))
ap.add_argument("--llamacpp", default=trees[-1] if trees else None, help="llama.cpp's source tree")
ap.add_argument("names", nargs="*", help="only these fixtures (default: all)")
args = ap.parse_args()
if not args.llamacpp:
    raise SystemExit("no llama.cpp tree: run scripts/bench-vs-llamacpp.sh once, or pass --llamacpp")
llamacpp = pathlib.Path(args.llamacpp)
# The converter with its own gguf-py, before anything imports another gguf.
sys.path.insert(0, str(llamacpp))
sys.path.insert(0, str(llamacpp / "gguf-py"))

import safetensors.torch  # noqa: E402
import torch  # noqa: E402
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig,  # noqa: E402
                          MixtralConfig, Phi3Config, Qwen3Config, Qwen3MoeConfig)

import convert_hf_to_gguf  # noqa: E402
import gguf  # noqa: E402
from conversion.base import TextModel  # noqa: E402
from conversion.gemma import Gemma2Model  # noqa: E402
from fixture_lib import (GGUF_BLOCK_NAMES, GGUF_TOP_NAMES, reference_runs,  # noqa: E402
                         tiny_random_model)

out = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
tokenizer_json = out / "tiny-tokenizer" / "tokenizer.json"


def tiny_models():
    common = dict(vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    # head_dim apart from hidden / heads (4 × 32 = 128 against 64), as Qwen3-0.6B's.
    yield "qwen3-norms", Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                     rope_theta=1000000.0, tie_word_embeddings=False,
                                     use_sliding_window=False, **common)
    # Fused qkv_proj and gate_up_proj; 6 heads over 2 kv heads, so that TP 4 cuts the
    # fused rows unevenly.
    phi3 = dict(hidden_size=96, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False,
                sliding_window=None, pad_token_id=0, **common)
    yield "phi3-fused", Phi3Config(original_max_position_embeddings=512, **phi3)
    # LongRoPE: the short factors up to 8 positions, the long ones past them (the third
    # prompt and every greedy run cross it); the window slides past 12.
    phi3_long = dict(phi3, max_position_embeddings=64, sliding_window=12)
    half = 8
    yield "phi3-longrope", Phi3Config(
        original_max_position_embeddings=8,
        rope_scaling={"type": "longrope",
                      "short_factor": [1.0 + 0.25 * i for i in range(half)],
                      "long_factor": [2.0 + 1.5 * i for i in range(half)]},
        **phi3_long)
    # Phi-4-mini's partial rotation: the first three quarters of each head (12 of 16)
    # rotate, with LongRoPE factors for those 6 frequencies.
    yield "phi4-partial", Phi3Config(
        original_max_position_embeddings=8, partial_rotary_factor=0.75,
        rope_scaling={"type": "longrope",
                      "short_factor": [1.0 + 0.25 * i for i in range(6)],
                      "long_factor": [2.0 + 1.5 * i for i in range(6)]},
        **dict(phi3, max_position_embeddings=64))
    # Gemma 3: GeGLU, four norms of (1 + w) a layer, q and k norms, embeddings times
    # sqrt(hidden), query_pre_attn_scalar apart from head_dim, sliding layers (window 6)
    # between global ones, the sliding layers' own rope base, linear scaling of the global
    # one. A Hugging Face directory only: llama.cpp's gemma3 files fix the layer pattern,
    # the local base and the scalar by model size.
    yield "gemma3-layers", Gemma3TextConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        tie_word_embeddings=True, **common)
    # Gemma 2: as Gemma 3 without q and k norms or a local base, the attention scores and
    # the logits soft-capped (q and k scaled up so that the cap bites), even layers sliding.
    yield "gemma2-softcap", Gemma2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=6,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, rope_theta=10000.0,
        tie_word_embeddings=True, **common)
    # As llama.cpp's gemma2 and gemma3 files are read (neither holds the scalar, the layer
    # pattern or the local base): query_pre_attn_scalar = head_dim, Gemma 3's global layer
    # every sixth, its local base 10000; the tokenizer's 423 ids, which the gemma3
    # converter cuts the embeddings to.
    gguf_common = dict(common, vocab_size=423)
    yield "gemma2-standard", Gemma2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=6,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, rope_theta=10000.0,
        tie_word_embeddings=True, **gguf_common)
    yield "gemma3-standard", Gemma3TextConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=6,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        tie_word_embeddings=True, **gguf_common)
    # Mixture of experts. Mixtral: 6 experts, 2 a token, the weights of the two renormalized
    # (6 over 4 ranks: expert parallelism splits them unevenly).
    yield "mixtral-experts", MixtralConfig(
        hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2,
        rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False, **common)
    # Qwen3-MoE: 8 experts, 3 a token, q and k norms, head_dim apart from hidden / heads,
    # experts narrower than the dense MLP.
    qwen3_moe = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                     num_experts_per_tok=3, rope_theta=1000000.0, use_sliding_window=False,
                     tie_word_embeddings=False, **common)
    yield "qwen3-moe", Qwen3MoeConfig(num_hidden_layers=2, norm_topk_prob=True,
                                      decoder_sparse_step=1, mlp_only_layers=[], **qwen3_moe)
    # The router's top weights as they are (norm_topk_prob off), a dense layer between
    # sparse ones (mlp_only_layers), and a sparse layer every other one (decoder_sparse_step).
    # A Hugging Face directory only: llama.cpp's qwen3moe files make every layer sparse and
    # renormalize.
    yield "qwen3-moe-mixed", Qwen3MoeConfig(num_hidden_layers=4, norm_topk_prob=False,
                                            decoder_sparse_step=1, mlp_only_layers=[1],
                                            **qwen3_moe)


# Where a family's GGUF tensors differ from GGUF_BLOCK_NAMES (Hugging Face name within a
# block, by GGUF name).
FUSED_BLOCK_NAMES = {"attn_qkv.weight": "self_attn.qkv_proj.weight",
                     "ffn_up.weight": "mlp.gate_up_proj.weight"}
GEMMA_BLOCK_NAMES = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
                     "post_attention_norm.weight": "post_attention_layernorm.weight",
                     "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}


# The merged expert tensors of llama.cpp's files ([experts, rows, cols]) by their GGUF
# names: the router, and each expert's projections under Mixtral's or Qwen3-MoE's names.
MIXTRAL_EXPERTS = ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{}.{}.weight",
                   {"ffn_gate_exps.weight": "w1", "ffn_down_exps.weight": "w2",
                    "ffn_up_exps.weight": "w3"})
QWEN3_MOE_EXPERTS = ("mlp.gate.weight", "mlp.experts.{}.{}.weight",
                     {"ffn_gate_exps.weight": "gate_proj", "ffn_down_exps.weight": "down_proj",
                      "ffn_up_exps.weight": "up_proj"})


def unpermute(w, n_head):
    """llama.cpp's interleaved rotary rows of q or k back in Hugging Face's order."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def convert(model_dir, outfile, outtype):
    """llama.cpp's converter on `model_dir` (with the tiny tokenizer beside it). Its gemma2
    model reads only SentencePiece files: it is given the byte-level BPE as the others."""
    TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outfile", str(outfile),
                "--outtype", outtype]
    try:
        convert_hf_to_gguf.main()
    finally:
        sys.argv = argv


def dequantized(model_dir, path):
    """The model of `model_dir` in transformers with the GGUF file's weights, dequantized
    by gguf-py (transformers' own GGUF loader takes no head_dim apart from hidden / heads).
    The weights are replaced in the checkpoint's own layout (transformers 5 holds experts
    merged in memory) and loaded from a copy of the directory."""
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    model_type = config["model_type"]
    state = safetensors.torch.load_file(str(pathlib.Path(model_dir) / "model.safetensors"))
    hf_top = {g: h for h, g in GGUF_TOP_NAMES.items()}
    hf_block = {g: h for h, g in GGUF_BLOCK_NAMES.items()}
    gemma = model_type in ("gemma2", "gemma3_text")
    if model_type == "phi3":
        hf_block.update(FUSED_BLOCK_NAMES)
    if gemma:
        hf_block.update(GEMMA_BLOCK_NAMES)
    mixtral = model_type == "mixtral"
    experts = (MIXTRAL_EXPERTS if mixtral
               else QWEN3_MOE_EXPERTS if model_type == "qwen3_moe" else None)
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.name.startswith("rope_factors_"):
            continue  # the config's LongRoPE factors
        if t.name.startswith("blk."):
            layer, rest = t.name[4:].split(".", 1)
            if experts and rest in experts[2]:
                values = gguf.quants.dequantize(t.data, t.tensor_type)
                for e in range(values.shape[0]):
                    name = f"model.layers.{layer}." + experts[1].format(e, experts[2][rest])
                    state[name] = torch.from_numpy(
                        values[e].reshape(state[name].shape).astype("float32").copy())
                continue
            if experts and rest == "ffn_gate_inp.weight":
                name = f"model.layers.{layer}.{experts[0]}"
            else:
                name = f"model.layers.{layer}.{hf_block[rest]}"
        else:
            name = hf_top[t.name]
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(state[name].shape)
        # Mixtral's files are llama's: q and k rows interleaved for llama.cpp's rotary.
        if mixtral and name.endswith("self_attn.q_proj.weight"):
            values = unpermute(values, config["num_attention_heads"])
        elif mixtral and name.endswith("self_attn.k_proj.weight"):
            values = unpermute(values, config["num_key_value_heads"])
        if gemma and name.endswith("norm.weight"):
            values = values - 1  # the converter stored 1 + w
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue  # the embeddings'
        state[name] = torch.from_numpy(values.astype("float32").copy())
    with tempfile.TemporaryDirectory() as work:
        shutil.copy(pathlib.Path(model_dir) / "config.json", work)
        safetensors.torch.save_file(state, str(pathlib.Path(work) / "model.safetensors"),
                                    metadata={"format": "pt"})
        return AutoModelForCausalLM.from_pretrained(work, dtype=torch.float32).eval()


def main():
    for name, config in tiny_models():
        if args.names and name not in args.names:
            continue
        model = tiny_random_model(config)
        if config.model_type == "gemma2":
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if "q_proj" in pname or "k_proj" in pname:
                        p.mul_(6.0)
        directory = out / name
        model.save_pretrained(directory, safe_serialization=True)
        with open(directory / "reference.json", "w") as f:
            json.dump({"prompts": reference_runs(model, all_logits_of_first=True)}, f)
        print("wrote", directory)
        if name in ("gemma2-softcap", "gemma3-layers", "qwen3-moe-mixed"):
            continue

        gguf_dir = out / f"{name}-gguf"
        gguf_dir.mkdir(exist_ok=True)
        references = {}
        with tempfile.TemporaryDirectory() as work:
            source = pathlib.Path(work) / name
            shutil.copytree(directory, source)
            shutil.copy(tokenizer_json, source / "tokenizer.json")
            # phi3's converter reads SentencePiece files unless told it is GPT-2's BPE.
            tokenizer_class = ("GPT2Tokenizer" if config.model_type == "phi3"
                               else "PreTrainedTokenizerFast")
            (source / "tokenizer_config.json").write_text(json.dumps(
                {"tokenizer_class": tokenizer_class, "bos_token": None,
                 "eos_token": None, "model_max_length": 512}))
            for outtype in ("f32", "q8_0"):
                path = gguf_dir / f"{name}-{outtype}.gguf"
                convert(source, path, outtype)
                references[outtype] = reference_runs(dequantized(directory, path))
                print("wrote", path)
        with open(gguf_dir / "reference.json", "w") as f:
            json.dump(references, f)


if __name__ == "__main__":
    main()
