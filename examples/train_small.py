"""Train a small K3-structured model on the Python standard library's source, on CPU, in a few minutes.

    python examples/train_small.py --out runs/small --steps 300
    k3nn generate --model runs/small --offline --prompt "def parse(" --max-new-tokens 64

The loop is written out here so you can change it; ``k3nn demo`` runs the same steps (plus a DSpark drafter
and speculative decoding) with caching, through the helpers of :mod:`k3nn.demo` used below.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from k3nn import KimiK3
from k3nn.cli import add_threads_argument
from k3nn.demo import (EOS, SIZES, batches, encode_docs, eval_windows, heldout_loss,
                       load_corpus, model_config, train_tokenizer, unigram_loss)
from k3nn.layers.moe import MoE
from k3nn.training import QuantileBalancer
from k3nn.utils import configure_threads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/small"))
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    add_threads_argument(p)
    args = p.parse_args()
    configure_threads(args.threads)  # an entry point sets threads; the library itself never does
    size = SIZES[args.size]
    steps, lr = args.steps or size.steps, args.lr or size.lr
    torch.manual_seed(0)

    # data: train / held-out split by file; a byte-level BPE trained on the train files
    corpus = load_corpus(size.corpus_mb)
    print(corpus.describe())
    args.out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer([t for _, t in corpus.train], size.vocab, args.out / "tokenizer.json")
    train_ids = encode_docs(tok, [t for _, t in corpus.train])
    held = eval_windows(encode_docs(tok, [t for _, t in corpus.heldout]), size.seq_len, 32)
    print(f"unigram baseline on held-out: {unigram_loss(train_ids, held[:, 1:], tok.get_vocab_size()):.3f} nats")

    # model: KDA + gated MLA (3:1), Attention Residuals, Stable LatentMoE; eager kernels on CPU
    cfg = model_config(size).replace(vocab_size=tok.get_vocab_size(), eos_token_id=tok.token_to_id(EOS))
    model = KimiK3(cfg, backend="eager", seed=0)
    print(f"{model.num_parameters() / 1e6:.2f}M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    qb = QuantileBalancer(m for m in model.modules() if isinstance(m, MoE))  # router biases, no aux loss
    data = batches(train_ids, size.seq_len, size.batch, seed=0)

    bar = tqdm(range(steps))
    for step in bar:
        frac = step / max(1, steps - 1)
        for g in opt.param_groups:  # linear warmup, cosine decay to 10%
            g["lr"] = lr * min(1.0, (step + 1) / 30) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        x = next(data)  # [batch, seq_len + 1]
        loss = F.cross_entropy(model(x[:, :-1]).logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        qb.step()  # new router biases from this step's routing (quantile balancing)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % 100 == 0 or step + 1 == steps:
            bar.write(f"step {step + 1}: held-out loss {heldout_loss(model, held):.3f}")

    model.save_pretrained(args.out)  # config.json + safetensors; tokenizer.json is already there
    print(f"saved {args.out}; try: k3nn generate --model {args.out} --offline --prompt 'import os'")


if __name__ == "__main__":
    main()
