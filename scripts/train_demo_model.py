"""Train the demo model that ships inside kvserve (src/kvserve/assets/demo-model).

A small Llama trained on the Python standard library's sources (minus the held-out modules of
kvserve.eval.data) mixed with passkey documents (kvserve.eval.passkey), on the CPU with bf16
autocast and torch.compile:

    python scripts/train_demo_model.py --out src/kvserve/assets/demo-model --minutes 55

Steps: train a byte-level BPE tokenizer, tokenize the sources, train with AdamW (warmup, cosine
decay, gradient clipping) on random windows of the code, half of them starting with a passkey
document, save the checkpoint in bfloat16, then measure the final train and held-out losses and the
passkey accuracy into training_summary.json.

Passkey retrieval needs an induction circuit (find the earlier "The pass key is", copy what follows).
To help a small model form it in a short run, training starts on shorter sequences (128, 256, 512
tokens, at the same tokens per step) before the full context, and a passkey answer's tokens weigh
more in the loss (--answer-weight).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from kvserve.eval.data import held_out_files, read_source, training_files
from kvserve.eval.passkey import make_passkey_prompt

BOS, EOS = "<s>", "</s>"
PASSKEY_MIN_LEN = 96   # tokens; the shortest passkey document holds ~85


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument("--minutes", type=float, default=55.0, help="training-loop time budget (the schedule follows it)")
    p.add_argument("--steps", type=int, default=None, help="train exactly this many steps instead of --minutes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="sequences of --context tokens per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100, help="warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--passkey-frac", type=float, default=0.5, help="share of sequences that start with a passkey doc")
    p.add_argument("--answer-weight", type=float, default=10.0,
                   help="loss weight of a passkey document's answer tokens (the rest weigh 1)")
    p.add_argument("--short-contexts", default="128,256,512",
                   help="sequence lengths trained before --context, each for an equal share of --curriculum")
    p.add_argument("--curriculum", type=float, default=0.45,
                   help="share of training spent on --short-contexts (same tokens per step, more sequences)")
    p.add_argument("--eval-every", type=int, default=150)
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-compile", action="store_true")
    return p.parse_args()


# ---- tokenizer and data ----------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE; digits are split one by one (numbers copy digit by digit); encode adds BOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def save_tokenizer(tok: Tokenizer, out: Path, context: int) -> None:
    """tokenizer.json and a tokenizer_config.json naming PreTrainedTokenizerFast, which every
    transformers version's AutoTokenizer knows (5.x would write its own name, TokenizersBackend)."""
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                            model_max_length=context).save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def token_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """All texts as one array: BOS text EOS, BOS text EOS, ..."""
    eos = tok.token_to_id(EOS)
    return np.concatenate([np.array(e.ids + [eos], dtype=np.int32) for e in tok.encode_batch(texts)])


@dataclass
class Batches:
    """Random windows of the code stream; a share of them start with a passkey document."""

    tok: Tokenizer
    stream: np.ndarray
    passkey_frac: float
    answer_weight: float
    seed: int

    def __post_init__(self) -> None:
        self.np_rng = np.random.default_rng(self.seed)
        self.rng = random.Random(self.seed)
        self.eos = self.tok.token_to_id(EOS)

    def count(self, text: str) -> int:
        return len(self.tok.encode(text).ids)

    def passkey_doc(self, length: int, depth: float) -> tuple[list[int], tuple[int, int]]:
        """BOS prompt " " key EOS in at most `length` tokens, and the answer's (" " key) token span."""
        prompt, key = make_passkey_prompt(length - 1, depth, rng=self.rng, count=self.count)
        ids = self.tok.encode(prompt + " " + key).ids
        return ids + [self.eos], (self.count(prompt), len(ids))

    def code(self, n: int) -> list[int]:
        start = int(self.np_rng.integers(0, len(self.stream) - n))
        return self.stream[start:start + n].tolist()

    def sequence(self, context: int, passkey: tuple[int, float] | None) -> tuple[list[int], tuple[int, int] | None]:
        """A passkey document of (length, depth) if given, then code up to `context` tokens; the answer's span."""
        doc, answer = self.passkey_doc(*passkey) if passkey else ([], None)
        return doc + self.code(context - len(doc)), answer

    def next(self, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [batch, context] and the loss weight of each next-token target [batch, context - 1]."""
        seqs, weights = [], torch.ones(batch, context - 1)
        for row in range(batch):
            passkey = None
            if self.rng.random() < self.passkey_frac:
                passkey = (self.rng.randint(PASSKEY_MIN_LEN, context), self.rng.random())
            seq, answer = self.sequence(context, passkey)
            seqs.append(seq)
            if answer:
                weights[row, answer[0] - 1:answer[1] - 1] = self.answer_weight
        return torch.tensor(seqs), weights


def windows(stream: np.ndarray, context: int, count: int | None = None) -> torch.Tensor:
    """Non-overlapping context-long windows of the stream; `count` of them evenly spaced if given."""
    all_windows = torch.from_numpy(stream[:len(stream) // context * context].astype(np.int64)).view(-1, context)
    if count is None or count >= len(all_windows):
        return all_windows
    return all_windows[torch.linspace(0, len(all_windows) - 1, count).long()]


def passkey_set(batches: Batches, context: int, n: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """n passkey sequences, 8 lengths from PASSKEY_MIN_LEN to the context, depths from 0 to 1; answer spans."""
    seqs, answers = [], []
    for i in range(n):
        length = PASSKEY_MIN_LEN + (context - PASSKEY_MIN_LEN) * (i % 8) // 7
        seq, answer = batches.sequence(context, (length, i / max(1, n - 1)))
        seqs.append(seq)
        answers.append(answer)
    return torch.tensor(seqs), answers


# ---- model and training ----------------------------------------------------------------------

def build_model(args: argparse.Namespace, tok: Tokenizer) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=args.context, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=True, bos_token_id=tok.token_to_id(BOS),
                      eos_token_id=tok.token_to_id(EOS))
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=True)


def lr_at(step: int, progress: float, args: argparse.Namespace) -> float:
    """Linear warmup over args.warmup steps, then cosine decay to min_lr_ratio as progress goes 0 -> 1."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def lm_loss(model, ids: torch.Tensor, autocast: bool = True) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return model(input_ids=ids, labels=ids).loss


def weighted_loss(model, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted next-token loss to train on, plain mean loss to report)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    return (nll * weights.flatten()).sum() / weights.sum(), nll.mean()


def context_at(progress: float, args: argparse.Namespace) -> int:
    """The curriculum: short sequences first, where attention has few places to look and retrieval
    (an induction circuit) forms much sooner, then longer ones up to the full context."""
    shorts = [int(c) for c in args.short_contexts.split(",") if c]
    if progress >= args.curriculum or not shorts:
        return args.context
    return shorts[int(progress / args.curriculum * len(shorts))]


@torch.no_grad()
def mean_loss(model, data: torch.Tensor, batch: int, autocast: bool = True) -> float:
    losses = [lm_loss(model, data[i:i + batch], autocast).item() for i in range(0, len(data), batch)]
    return float(np.mean(losses))


@torch.no_grad()
def passkey_accuracy(model, data: torch.Tensor, answers: list[tuple[int, int]], batch: int,
                     autocast: bool = True) -> float:
    """Share of sequences whose answer tokens (" " then the key's digits) are all the argmax.

    Teacher-forced, which equals greedy decoding whenever every answer token is right.
    """
    hits = []
    for i in range(0, len(data), batch):
        ids = data[i:i + batch]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            pred = model(input_ids=ids).logits.argmax(-1)
        for row, (start, end) in enumerate(answers[i:i + batch]):
            hits.append(bool((pred[row, start - 1:end - 1] == ids[row, start:end]).all()))
    return float(np.mean(hits))


def evaluate(model, held_out: torch.Tensor, pk: tuple[torch.Tensor, list[tuple[int, int]]], batch: int,
             autocast: bool = True) -> dict[str, float]:
    model.eval()
    result = {"held_out_loss": mean_loss(model, held_out, batch, autocast),
              "passkey_accuracy": passkey_accuracy(model, *pk, batch, autocast)}
    model.train()
    return result


def train(model, loss_fn, batches: Batches, evals: dict, args: argparse.Namespace) -> dict:
    """The training loop; returns what the summary records about it."""
    opt = make_optimizer(model, args)
    budget = args.minutes * 60
    history, recent, step, tokens = [], [], 0, 0
    start = time.time()
    bar = tqdm(total=args.steps, desc="train", mininterval=10, dynamic_ncols=True)
    while (step < args.steps) if args.steps else (time.time() - start < budget):
        progress = step / args.steps if args.steps else (time.time() - start) / budget
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, args)
        context = context_at(progress, args)
        loss, plain = loss_fn(model, *batches.next(args.batch * args.context // context, context))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step, tokens = step + 1, tokens + args.batch * args.context
        recent = (recent + [plain.item()])[-50:]
        bar.update(1)
        bar.set_postfix(loss=f"{recent[-1]:.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}",
                        tok_s=f"{tokens / (time.time() - start):.0f}")
        if step % args.eval_every == 0:
            result = evaluate(model, *evals["during"], args.batch)
            history.append({"step": step, "minutes": (time.time() - start) / 60,
                            "train_loss": float(np.mean(recent)), **result})
            tqdm.write(json.dumps(history[-1]))
    bar.close()
    seconds = time.time() - start
    return {"steps": step, "tokens": tokens, "train_seconds": seconds, "tokens_per_second": tokens / seconds,
            "train_loss_last50": float(np.mean(recent)), "history": history}


def main() -> None:
    args = parse_args()
    t0 = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    train_texts = [read_source(p) for p in training_files()]
    held_texts = [read_source(p) for p in held_out_files()]
    rng = random.Random(args.seed)
    passkey_texts = [make_passkey_prompt(2000, rng.random(), rng=rng)[0] for _ in range(64)]
    tok = train_tokenizer(train_texts + passkey_texts, args.vocab)
    save_tokenizer(tok, args.out, args.context)
    stream, held = token_stream(tok, train_texts), token_stream(tok, held_texts)
    print(f"tokenizer and data: {time.time() - t0:.0f}s; {len(train_texts)} training files, {len(stream)} tokens; "
          f"{len(held_texts)} held-out files, {len(held)} tokens", flush=True)

    batches = Batches(tok, stream, args.passkey_frac, args.answer_weight, args.seed)
    eval_batches = Batches(tok, stream, 1.0, args.answer_weight, args.seed + 1)
    evals = {"during": (windows(held, args.context, args.eval_windows),
                        passkey_set(eval_batches, args.context, args.eval_windows)),
             "final": (windows(held, args.context), passkey_set(eval_batches, args.context, 80))}
    model = build_model(args, tok)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters", flush=True)
    loss_fn = weighted_loss if args.no_compile else torch.compile(weighted_loss, dynamic=False)
    run = train(model, loss_fn, batches, evals, args)

    model.to(torch.bfloat16).save_pretrained(args.out)   # save first: the final eval may fail or be cut short
    summary = {"command": command_line(args), "seed": args.seed, "parameters": params,
               "python": platform.python_version(), "torch": torch.__version__,
               "config": {k: v for k, v in vars(args).items() if k != "out"}, **run}
    write_summary(args.out, summary)
    final = evaluate(model, *evals["final"], args.batch, autocast=False)
    train_windows = windows(stream, args.context, len(evals["final"][0]))
    summary.update({"final_train_loss": mean_loss(model.eval(), train_windows, args.batch, autocast=False),
                    "final_held_out_loss": final["held_out_loss"],
                    "final_passkey_accuracy": final["passkey_accuracy"],
                    "held_out_tokens_evaluated": int(evals["final"][0].numel()),
                    "wall_seconds": time.time() - t0})
    write_summary(args.out, summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=1), flush=True)


def command_line(args: argparse.Namespace) -> str:
    """The command run, its output directory written OUT: the summary ships with the model."""
    return " ".join("OUT" if Path(a) == args.out else a for a in sys.argv)


def write_summary(out: Path, summary: dict) -> None:
    (out / "training_summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
