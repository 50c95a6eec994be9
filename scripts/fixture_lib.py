"""What the fixture scripts share: the prompts and transformers' runs of them, and a llama
checkpoint written as a GGUF file the way llama.cpp's converter writes it (Q and K rows
permuted into llama.cpp's interleaved rotary layout, 2-D weights in `qtype` through gguf-py's
quantizers, norms F32)."""
import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM

PROMPTS = [[1, 15, 27, 99, 3], [1, 200, 7], [5, 9, 13, 17, 21, 25, 29, 33, 37]]
GREEDY_TOKENS = 32


def tiny_random_model(config):
    """A model of `config` with random weights (seed 1234); random init leaves norms at 1
    and biases at 0, so these are perturbed too, that they matter."""
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def reference_runs(model, all_logits_of_first=False):
    """Per prompt: the last-position logits (and every position's, for the first prompt
    when asked) and the greedy continuation, from transformers."""
    runs = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            logits = model(ids).logits[0]
            generated = model.generate(ids, attention_mask=torch.ones_like(ids),
                                       max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
        run = {"token_ids": prompt, "last_logits": [float(v) for v in logits[-1]]}
        if all_logits_of_first:
            run["all_logits"] = ([[float(v) for v in row] for row in logits]
                                 if prompt is PROMPTS[0] else [])
        run["greedy"] = generated[0, len(prompt):].tolist()
        runs.append(run)
    return runs


# Hugging Face's tensor names as llama.cpp's converter writes them: outside the blocks, and
# within block N (`blk.N.`).
GGUF_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                  "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
GGUF_BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def permute(w, n_head):
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(model_dir, path, qtype):
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta") else 10000.0)
    w.add_file_type(0)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>".encode() for i in range(cfg.vocab_size)])
    w.add_token_scores([0.0] * cfg.vocab_size)
    w.add_token_types([1] * cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    for name, tensor in model.state_dict().items():
        data = tensor.numpy().astype(np.float32)
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{layer}.{GGUF_BLOCK_NAMES[rest]}"
            if rest == "self_attn.q_proj.weight":
                data = permute(data, cfg.num_attention_heads)
            elif rest == "self_attn.k_proj.weight":
                data = permute(data, cfg.num_key_value_heads)
        else:
            gname = GGUF_TOP_NAMES[name]
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            q = gguf.quants.quantize(data, qtype)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


