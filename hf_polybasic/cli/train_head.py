"""``hf-polybasic train-head``: `hf_polybasic.training.train_head` from the command line.

The model is a local directory or a Hub id (``AutoModelForCausalLM``/``AutoTokenizer``, as the HF cache
or the Hub gives them), a name of ``hf-polybasic models list`` (installed on first use), or ``tiny``: a
random 8-layer model and a character tokenizer from `hf_polybasic.testing` (seconds; the mechanics only).
"""

from __future__ import annotations

import argparse
import sys

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids, got {text!r}") from None


def add_train_head_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "train-head", help="distil an EAGLE-3 draft head for a causal LM from texts and its own answers to prompts; "
        "saved in speculators' format (draft_head, speculators and vLLM read it)")
    parser.add_argument("model", help="a model directory or Hub id, a name of `hf-polybasic models list`, or 'tiny'")
    parser.add_argument("--output", required=True, help="directory of the head (config.json, model.safetensors); its "
                        "training/ folder holds what an interrupted run resumes from")
    parser.add_argument("--texts", action="append", default=[], metavar="PATH",
                        help="a file or folder of text (.txt .md .rst .py; .jsonl: strings or {\"text\": ...}); "
                        "repeatable")
    parser.add_argument("--prompts", action="append", default=[], metavar="PATH",
                        help="a JSONL file of prompts (strings, or {\"prompt\"|\"messages\"|\"turns\": ...}; .txt: one "
                        "per line) the model answers, its answers then trained on (self-distillation); repeatable")
    parser.add_argument("--device", default="cpu", help="where the model runs and the head trains (cpu, cuda, ...)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="the model's dtype (the head trains "
                        "in fp32 whatever it is)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: --epochs over the windows)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4, help="windows per step")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per training window")
    parser.add_argument("--max-tokens", type=int, default=None, help="at most this many tokens (answers first)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--draft-vocab-size", type=int, default=None,
                        help="ids the head's output layer scores, the most frequent in the data (default: 32000, or "
                        "the whole vocabulary where smaller)")
    parser.add_argument("--aux-layers", type=_ints, default=None, metavar="I,J,K",
                        help="layers whose inputs the head reads (default: 2, L//2, L-3)")
    parser.add_argument("--num-layers", type=int, default=1, help="decoder layers of the head")
    parser.add_argument("--intermediate-size", type=int, default=None, help="its MLP width (default: the model's)")
    parser.add_argument("--answer-tokens", type=int, default=256, help="new tokens per answer to a prompt")
    parser.add_argument("--answer-batch-size", type=int, default=8, help="prompts answered per generate call")
    parser.add_argument("--answer-temperature", type=float, default=0.0, help="0: greedy answers")
    parser.add_argument("--passes", type=int, default=3, help="training-time-test passes per step")
    parser.add_argument("--train-lm-head", action="store_true", help="train the head's output layer too (default: "
                        "the model's own rows, frozen, as speculators trains)")
    parser.add_argument("--save-embeddings", action="store_true",
                        help="also write the model's embeddings into the checkpoint (as speculators' trainer does)")
    parser.add_argument("--save-dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-size", type=int, default=64, help="windows per feature shard on disk")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="stop training (with a checkpoint) after this long; run again to go on")
    parser.add_argument("--work-dir", default=None, help="default: OUTPUT/training")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--cache-dir", default=None, help="model cache for the names of `hf-polybasic models`")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(handler=run_from_args)
    return parser


def load_model(name: str, dtype: str, device: str, cache_dir=None):
    """``(model, tokenizer)`` for the command's ``model`` argument (see the module docstring)."""
    import torch

    torch_dtype = getattr(torch, DTYPES[dtype])
    if name == "tiny":
        from ..testing import make_target, make_tokenizer

        return make_target("llama", layers=8).to(device=device, dtype=torch_dtype), make_tokenizer()
    from . import models

    if name in models.available():
        from .loading import load

        model, tokenizer = load(name, torch.bfloat16 if dtype == "bf16" else torch.float32, cache_dir=cache_dir)
        return model.to(device=device, dtype=torch_dtype), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(name)


def run_from_args(args: argparse.Namespace) -> int:
    from ..training import train_head

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    settings = dict(steps=args.steps, epochs=args.epochs, batch_size=args.batch_size, seq_len=args.seq_len,
                    max_tokens=args.max_tokens, lr=args.lr, draft_vocab_size=args.draft_vocab_size,
                    aux_layers=args.aux_layers, num_layers=args.num_layers, intermediate_size=args.intermediate_size,
                    answer_tokens=args.answer_tokens, answer_batch_size=args.answer_batch_size,
                    answer_temperature=args.answer_temperature, passes=args.passes, train_lm_head=args.train_lm_head,
                    save_embeddings=args.save_embeddings, save_dtype=args.save_dtype, seed=args.seed,
                    shard_size=args.shard_size, checkpoint_every=args.checkpoint_every)
    try:
        model, tokenizer = load_model(args.model, args.dtype, args.device, args.cache_dir)
        result = train_head(model, tokenizer, args.output, texts=args.texts, prompts=args.prompts,
                            work_dir=args.work_dir, max_minutes=args.max_minutes, progress=not args.no_progress,
                            **settings)
    except ValueError as error:
        print(f"hf-polybasic train-head: error: {error}", file=sys.stderr)
        return 2
    last = result.losses[-10:]
    print(f"head: {result.directory} (speculators eagle3; draft vocabulary {result.draft_vocab_size}, reads the inputs "
          f"of layers {list(result.feature_layers)})")
    print(f"trained {result.steps} of {result.total_steps} steps on {result.windows} windows"
          f"{f' ({result.answers} answered prompts among them)' if result.answers else ''}; "
          f"loss of the last {len(last)} steps: {sum(last) / max(1, len(last)):.4f}"
          f"{'; stopped by --max-minutes: run the same command again to go on' if result.stopped_early else ''}")
    print("phases (s): " + ", ".join(f"{phase} {seconds:.1f}" for phase, seconds in result.timings.items()))
    print(f"use it: draft_head({str(result.directory)!r}, verifier=model)")
    return 0
