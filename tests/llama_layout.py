"""GGUF files in the layout llama.cpp's own converter writes (convert_hf_to_gguf.py), made from a
tiny minigraph model, for the tests that read "a file as llama.cpp writes it": the converter's
keys through gguf-py's add_* calls (no minigraph.hparams), a gpt2 tokenizer section, tensors by
llama.cpp's names, and a tied output head (the converter writes no output.weight for LFM2:
llama.cpp then multiplies by token_embd)."""
import numpy as np


def tie_output(model) -> None:
    """Make the model's output head its embedding, as a tied file has it."""
    model.output.set(model.tok_embd.numpy())


def write_lfm2_as_llama_cpp(model, path) -> str:
    """model: models.lfm.LFM2Model with a tied head (tie_output). Returns the path."""
    import gguf
    hp = model.hparams
    if not np.array_equal(model.output.numpy(), model.tok_embd.numpy()):
        raise ValueError("write_lfm2_as_llama_cpp: the model's output head is not tied (call tie_output)")
    w = gguf.GGUFWriter(str(path), "lfm2")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name("LFM2 tiny")
    w.add_context_length(hp["n_ctx_train"])
    w.add_embedding_length(hp["n_embd"])
    w.add_block_count(hp["n_layer"])
    w.add_head_count(hp["n_head"])
    w.add_head_count_kv(list(hp["head_count_kv"]))     # per block; 0 = short conv
    w.add_rope_freq_base(hp["rope_freq_base"])
    w.add_layer_norm_rms_eps(hp["eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(hp["n_vocab"])
    w.add_shortconv_l_cache(hp["l_cache"])
    w.add_feed_forward_length(hp["n_ff"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("lfm2")
    toks = [chr(0x41 + i) if i < 26 else f"t{i}" for i in range(hp["n_vocab"])]
    w.add_token_list(toks)
    w.add_token_types([gguf.TokenType.NORMAL] * len(toks))
    w.add_token_merges(["A B"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, t in model.gguf_tensors().items():
        if name != "output.weight":
            w.add_tensor(name, np.ascontiguousarray(t.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
