"""Interop checks run by any Python with `transformers` installed (the pinned 5.x, or an older 4.x in its own
virtual environment), with this repository on PYTHONPATH. Called by tests/test_interop.py:

    check.py export  RUNS_JSON            run directories -> Hugging Face directories (our converter, this version)
    check.py read    DIRS_JSON OUT_JSON   Hugging Face directories -> tokens, logits, greedy generation (plain
                                          transformers: AutoModelForCausalLM, AutoTokenizer, generate())
    check.py llama   OUT_DIR OUT_JSON     Llama-family checkpoints as this transformers version writes them
                                          (their own special tokens, linear and llama3 rotary scaling), with
                                          what transformers computes on them

Every JSON holds plain lists, so the main test process compares them with its own results.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers

PROMPT = "the attention noise cancels"


def export(runs_json: str) -> None:
    from difftransformer.interop.convert import run_to_hf

    for item in json.loads(Path(runs_json).read_text()):
        run_to_hf(item["run"], item["out"])


@torch.no_grad()
def hf_outputs(hf_dir: str, tokens: list[int], new_tokens: int) -> dict:
    """What plain transformers makes of a directory: the prompt's ids, logits of ``tokens``, greedy generation
    with the directory's own generation config (so its end tokens)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    prompt = tokenizer(PROMPT, return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=new_tokens, do_sample=False)
    return {
        "version": transformers.__version__,
        "architecture": type(model).__name__,
        "tokenizer": type(tokenizer).__name__,
        "prompt_ids": prompt.input_ids[0].tolist(),
        "logits": model(torch.tensor([tokens])).logits[0].tolist(),
        "generated": out[0, prompt.input_ids.shape[1] :].tolist(),
    }


def read(dirs_json: str, out_json: str) -> None:
    spec = json.loads(Path(dirs_json).read_text())
    results = {name: hf_outputs(d, spec["tokens"], spec["new_tokens"]) for name, d in spec["dirs"].items()}
    Path(out_json).write_text(json.dumps(results))


LLAMAS = {
    # Llama 2 style: <s> ... </s>, a begin-of-text template, linear rotary scaling
    "llama2-linear": {
        "special": ["<unk>", "<s>", "</s>"],
        "bos": "<s>",
        "eos": ["</s>"],
        "rope_theta": 10000.0,
        "scaling": {"rope_type": "linear", "factor": 2.0},
    },
    # Llama 3 style: two end tokens in the generation config, a large base, llama3 scaling whose three frequency
    # bands are all present at head size 16
    "llama3-scaled": {
        "special": ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
        "bos": "<|begin_of_text|>",
        "eos": ["<|end_of_text|>", "<|eot_id|>"],
        "rope_theta": 500000.0,
        "scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
}


def llama_tokenizer(spec: dict):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=spec["special"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = "the attention noise cancels when two softmax maps are subtracted from each other " * 40
    tok.train_from_iterator([text], trainer=trainer)
    bos = spec["bos"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    return tok


def rope_kwargs(theta: float, scaling: dict) -> dict:
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {**scaling, "rope_theta": theta}}
    return {"rope_theta": theta, "rope_scaling": dict(scaling)}


@torch.no_grad()
def llama(out_dir: str, out_json: str) -> None:
    """Write each LLAMAS checkpoint with save_pretrained, its greedy generation planted to stop on its last end token
    after a few tokens (the output row of that token becomes 1.05 x the row of a token chosen at some step), and
    record what transformers computes on it."""
    results = {}
    for name, spec in LLAMAS.items():
        tok = llama_tokenizer(spec)
        ids = {t: tok.token_to_id(t) for t in spec["special"]}
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=tok.get_vocab_size(),
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            bos_token_id=ids[spec["bos"]],
            eos_token_id=[ids[t] for t in spec["eos"]] if len(spec["eos"]) > 1 else ids[spec["eos"][0]],
            tie_word_embeddings=False,
            **rope_kwargs(spec["rope_theta"], spec["scaling"]),
        )
        model = transformers.LlamaForCausalLM(config).eval()
        hf_tok = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token=spec["bos"],
            eos_token=spec["eos"][0],
            unk_token=spec["special"][0],
            model_input_names=["input_ids", "attention_mask"],  # as Llama's own tokenizer classes have
        )
        prompt = hf_tok(PROMPT, return_tensors="pt")
        start = prompt.input_ids.shape[1]
        free = model.generate(**prompt, max_new_tokens=16, do_sample=False, eos_token_id=None)[0, start:]
        end = ids[spec["eos"][-1]]
        for k in range(4, 16):  # the first step whose token, copied into the end token's row, stops after 3-11 tokens
            model.lm_head.weight[end] = 1.05 * model.lm_head.weight[int(free[k])]
            planted = model.generate(**prompt, max_new_tokens=24, do_sample=False)[0, start:]
            if 3 < len(planted) <= 12 and int(planted[-1]) == end:
                break
        else:
            raise AssertionError(f"{name}: no step makes the greedy generation stop early")
        path = Path(out_dir) / f"{name}-{transformers.__version__}"
        model.save_pretrained(path)
        hf_tok.save_pretrained(path)
        tokens = torch.arange(100) % tok.get_vocab_size()
        results[name] = {**hf_outputs(str(path), tokens.tolist(), 24), "dir": str(path), "tokens": tokens.tolist()}
    Path(out_json).write_text(json.dumps(results))


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"export": export, "read": read, "llama": llama}[command](*args)
