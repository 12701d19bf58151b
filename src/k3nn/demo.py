"""``k3nn demo``: train a small K3-structured model on the Python standard library's own source, then generate
Python with and without DSpark speculative decoding.

Steps (each cached under ``--out``; a second run reuses what matches the requested settings):

1. corpus   the ``.py`` files of ``sysconfig.get_paths()["stdlib"]`` (no tests, no site-packages), split into
            train / held-out **by file** (a stable hash of the relative path);
2. tokenizer a byte-level BPE trained with ``tokenizers`` (``tokenizer.json`` beside the checkpoint);
3. target   KimiK3 (KDA + gated MLA, Block Attention Residuals, Stable LatentMoE with Quantile Balancing), eager
            backend, AdamW; held-out loss against the unigram baseline; loss curve as a PNG; ``save_pretrained``;
4. drafter  a DSpark drafter trained on the frozen target's hidden states (:class:`k3nn.spec.DSparkTrainer`);
5. generate greedy decoding from a prompt, plain and speculative (same tokens), tokens/s and acceptance length,
            plus the acceptance length on held-out files.

The pieces are functions so that ``examples/train_small.py`` and the tests can reuse them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F

__all__ = ["EOS", "MASK", "DemoSize", "SIZES", "Corpus", "load_corpus", "is_heldout", "train_tokenizer",
           "encode_docs", "unigram_loss", "eval_windows", "batches", "model_config",
           "train_model", "heldout_loss", "train_drafter", "timed_generate", "acceptance_on_heldout",
           "default_out_dir", "write_chat_template", "CHAT_TEMPLATE", "main"]

EOS, MASK = "<|endoftext|>", "<|mask|>"
DEFAULT_PROMPT = 'def read_lines(path):\n    """Return the lines of a text file."""\n'


# ------------------------------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class DemoSize:
    """Model and training shape of one ``--size`` choice."""

    vocab: int  # BPE vocabulary (including the two special tokens)
    hidden: int
    layers: int
    heads: int  # KDA and MLA heads (head dim 32)
    experts: int
    seq_len: int
    batch: int
    steps: int  # target optimizer steps
    drafter_steps: int
    gamma: int  # drafter block length (tokens drafted per step)
    lr: float
    corpus_mb: float  # training text read (MB); the model sees steps·batch·seq_len tokens of it
    distill: int = 512  # target continuations generated as drafter training data


SIZES = {
    # CI: seconds, learns nothing useful
    "toy": DemoSize(vocab=320, hidden=32, layers=2, heads=1, experts=4, seq_len=32, batch=2, steps=3,
                    drafter_steps=2, gamma=3, lr=3e-3, corpus_mb=0.2, distill=16),
    # the default: a few minutes on 2 CPU cores
    "small": DemoSize(vocab=2048, hidden=128, layers=4, heads=4, experts=8, seq_len=128, batch=16, steps=300,
                      drafter_steps=500, gamma=5, lr=6e-3, corpus_mb=4.0),
    # ~4x the compute of "small": better samples, ~20 min on 2 cores
    "base": DemoSize(vocab=4096, hidden=256, layers=8, heads=8, experts=16, seq_len=192, batch=16, steps=600,
                     drafter_steps=300, gamma=6, lr=2e-3, corpus_mb=8.0, distill=1024),
}


def model_config(size: DemoSize):
    """A K3-structured :class:`KimiK3Config` for ``size``: 3:1 KDA:MLA (gated, NoPE), AttnRes, a dense layer 0,
    Stable LatentMoE with SiTU experts after it."""
    from .config import KimiK3Config

    d, L, h = size.hidden, size.layers, size.heads
    mla = [i for i in range(L) if i % 4 == 3] or [L - 1]
    return KimiK3Config.small(
        vocab_size=size.vocab, hidden_size=d, num_hidden_layers=L, mla_layers=mla,
        kda_num_heads=h, kda_head_dim=32, num_attention_heads=h, q_lora_rank=d // 2, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, attn_res_block_size=2,
        intermediate_size=3 * d, num_experts=size.experts, num_experts_per_token=2, moe_intermediate_size=d,
        routed_expert_hidden_size=max(32, d // 2), max_position_embeddings=4096,
    )


# ------------------------------------------------------------------------------------------------ corpus
@dataclass
class Corpus:
    """The demo's text: ``train`` and ``heldout`` lists of (path relative to ``root``, file text), split by file."""

    root: Path
    train: list[tuple[str, str]]  # (relative path, text)
    heldout: list[tuple[str, str]]

    def describe(self) -> str:
        """One line: how many files and MB on each side, and the root."""
        mb = lambda docs: sum(len(t) for _, t in docs) / 1e6  # noqa: E731
        return (f"{len(self.train)} train files ({mb(self.train):.1f} MB), {len(self.heldout)} held-out files "
                f"({mb(self.heldout):.1f} MB) from {self.root}")


def is_heldout(relpath: str, fraction: float = 0.1) -> bool:
    """Stable per-file split: the same file lands on the same side on every machine and every run."""
    return zlib.crc32(relpath.encode()) % 1000 < fraction * 1000


def load_corpus(max_train_mb: float = 4.0, max_heldout_mb: float = 0.5, root: str | None = None) -> Corpus:
    """Python source of the standard library (tests, site-packages and vendored third-party code excluded),
    split by file. Files are read in a fixed (hash) order so a size cap still samples the whole library."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise SystemExit(f"the Python standard library source was not found at {base}: pass --corpus DIR "
                         "(any directory of .py files)")
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "_vendor"}
    files = [p for p in base.rglob("*.py") if not skip & set(p.relative_to(base).parts)]
    files.sort(key=lambda p: hashlib.sha1(str(p.relative_to(base)).encode()).hexdigest())
    train, held, n_train, n_held = [], [], 0, 0
    for p in files:
        rel = str(p.relative_to(base))
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < 200:
            continue
        text = text[:200_000]  # a few huge generated tables would dominate otherwise
        if is_heldout(rel):
            if n_held < max_heldout_mb * 1e6:
                held.append((rel, text))
                n_held += len(text)
        elif n_train < max_train_mb * 1e6:
            train.append((rel, text))
            n_train += len(text)
        if n_train >= max_train_mb * 1e6 and n_held >= max_heldout_mb * 1e6:
            break
    if not train or not held:
        raise SystemExit(f"too little Python source under {base} for a train/held-out split "
                         f"({len(train)} train, {len(held)} held-out files)")
    return Corpus(base, train, held)


# --------------------------------------------------------------------------------------------- tokenizer
def _need(module: str):
    try:
        return __import__(module)
    except ImportError:
        raise SystemExit(f"the demo needs `{module}`: pip install 'k3nn[demo]' (or: pip install {module})") from None


def train_tokenizer(texts: list[str], vocab_size: int, path: str | os.PathLike | None = None):
    """Byte-level BPE (GPT-2 style pre-tokenisation, no unknown tokens) with ``<|endoftext|>`` (document
    separator, eos) and ``<|mask|>`` (the drafter's mask token) as ids 0 and 1. Saved to ``path`` if given."""
    _need("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, MASK], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if path is not None:
        tok.save(str(path))
    return tok


# Each turn a Python comment line, the assistant's turns as code, the generation prompt "# assistant:" (the demo
# model writes Python).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'assistant' -%}\n"
    "{{ '# assistant:\\n' ~ (message['content'] or '') ~ '\\n' }}\n"
    "{%- else -%}\n"
    "{{ '# ' ~ message['role'] ~ ': ' ~ message['content'] | replace('\\n', '\\n# ') ~ '\\n' }}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{ '# assistant:\\n' }}\n"
    "{%- endif -%}"
)


def write_chat_template(model_dir: str | os.PathLike) -> Path:
    """Give a demo checkpoint :data:`CHAT_TEMPLATE` as the ``chat_template`` of its ``tokenizer_config.json`` (where
    transformers keeps it; ``k3nn serve`` renders it for ``/v1/chat/completions``), with ``eos_token``
    ``<|endoftext|>``. Entries an existing file already has are kept. Returns the file's path."""
    path = Path(model_dir) / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if "chat_template" in cfg and "eos_token" in cfg:
        return path
    cfg.setdefault("chat_template", CHAT_TEMPLATE)
    cfg.setdefault("eos_token", EOS)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def encode_docs(tok, texts: list[str]) -> torch.Tensor:
    """Documents → one int64 stream, each document followed by ``<|endoftext|>``."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def unigram_loss(train_ids: torch.Tensor, eval_targets: torch.Tensor, vocab: int) -> float:
    """Cross-entropy (nats/token) of ``eval_targets`` under the training set's token frequencies (add-one
    smoothing): what a model that ignores context can reach."""
    counts = torch.bincount(train_ids, minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return float(-logp[eval_targets.reshape(-1)].mean())


def eval_windows(stream: torch.Tensor, seq_len: int, n: int) -> torch.Tensor:
    """n evenly spaced [seq_len + 1] windows of a token stream (fixed, so every evaluation sees the same)."""
    n = max(1, min(n, (stream.numel() - 1) // (seq_len + 1)))
    starts = torch.linspace(0, stream.numel() - seq_len - 2, n).long()
    return torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()])


def batches(stream: torch.Tensor, seq_len: int, batch: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless random [batch, seq_len + 1] windows."""
    g = torch.Generator().manual_seed(seed)
    hi = stream.numel() - seq_len - 1
    while True:
        starts = torch.randint(0, hi, (batch,), generator=g)
        yield torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()])


# --------------------------------------------------------------------------------------------- training
def _progress(iterable, desc: str, total: int, quiet: bool):
    from tqdm.auto import tqdm

    off = quiet or os.environ.get("K3NN_DISABLE_PROGRESS_BARS", "") not in ("", "0")
    return tqdm(iterable, desc=desc, total=total, disable=True if off else None, dynamic_ncols=True,
                leave=False, file=sys.stderr)


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, batch: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over held-out windows [N, T + 1]."""
    was = model.training
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch]
        logits = model(w[:, :-1]).logits
        tot += float(F.cross_entropy(logits.flatten(0, 1).float(), w[:, 1:].reshape(-1), reduction="sum"))
        n += w[:, 1:].numel()
    model.train(was)
    return tot / n


def _lr(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train_model(model, stream: torch.Tensor, size: DemoSize, steps: int, heldout: torch.Tensor,
                eval_every: int = 50, seed: int = 0, quiet: bool = False, log=print) -> dict:
    """AdamW with warmup + cosine decay, gradient clipping, Quantile Balancing of the MoE router biases after
    every step. Returns the history: ``train`` [(step, loss)], ``heldout`` [(step, loss)], ``seconds``."""
    from .layers.moe import MoE
    from .training import QuantileBalancer

    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": other, "weight_decay": 0.0}],
                            lr=size.lr, betas=(0.9, 0.95))
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    qb = QuantileBalancer(moe) if moe and model.config.num_experts_per_token < model.config.num_experts else None
    hist: dict = {"train": [], "heldout": [], "seconds": 0.0}
    model.train()
    t0 = time.perf_counter()
    data = batches(stream, size.seq_len, size.batch, seed)
    ema = None
    bar = _progress(range(steps), "train target", steps, quiet)
    try:
        for step in bar:
            for gr in opt.param_groups:
                gr["lr"] = _lr(step, steps, size.lr, warmup=max(1, min(30, steps // 10)))
            x = next(data)
            logits = model(x[:, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            if qb is not None:
                qb.step()
            v = loss.item()
            if not math.isfinite(v):
                raise RuntimeError(f"training diverged at step {step} (loss {v}); try a lower --lr")
            hist["train"].append((step + 1, v))
            ema = v if ema is None else 0.95 * ema + 0.05 * v
            bar.set_postfix(loss=f"{ema:.3f}")
            if (step + 1) % eval_every == 0 or step + 1 == steps:
                h = heldout_loss(model, heldout)
                hist["heldout"].append((step + 1, h))
                log(f"  step {step + 1:>4}/{steps}  train {ema:.3f}  held-out {h:.3f}  "
                    f"({time.perf_counter() - t0:.0f}s)")
    finally:
        if qb is not None:
            qb.detach()
        bar.close()
    hist["seconds"] = time.perf_counter() - t0
    model.eval()
    return hist


@torch.no_grad()
def target_continuations(model, stream: torch.Tensor, n: int, prompt_len: int, new_tokens: int,
                         seed: int = 0, batch: int = 16) -> torch.Tensor:
    """Self-distillation data for the drafter: the target's own continuations of random training prompts, half
    greedy and half sampled at T = 1 → [n, prompt_len + new_tokens]. A drafter trained only on human text meets
    unfamiliar contexts once the target writes (greedy decoding of a small model repeats itself)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(max(1, math.ceil(n / batch))):
        starts = torch.randint(0, stream.numel() - prompt_len - 1, (batch,), generator=g)
        prompts = torch.stack([stream[s:s + prompt_len] for s in starts.tolist()])
        kw = dict(SAMPLING, seed=seed + i) if i % 2 else {"do_sample": False}
        out.append(model.generate(prompts, max_new_tokens=new_tokens, **kw))
    return torch.cat(out)[:n]


def train_drafter(model, stream: torch.Tensor, size: DemoSize, steps: int, seed: int = 0, quiet: bool = False,
                  log=print, mask_token_id: int | None = None, distill_sequences: int = 512,
                  distill_fraction: float = 0.75):
    """A DSpark drafter (1 layer, block γ = ``size.gamma``) trained on the frozen target, on a mix of training
    text and the target's own continuations (``distill_fraction`` of each batch; see
    :func:`target_continuations`). Returns (drafter, history [(step, loss, tau)])."""
    from .layers.dspark import DSparkConfig, DSparkDrafter
    from .spec import DSparkTrainer

    dcfg = DSparkConfig.for_target(model.config, num_layers=1, num_heads=max(1, size.heads // 2),
                                   block_size=size.gamma, markov_rank=32, mask_token_id=mask_token_id)
    drafter = DSparkDrafter(dcfg, target=model)
    opt = torch.optim.AdamW(drafter.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.0)
    trainer = DSparkTrainer(model, drafter, opt, num_anchors=max(4, size.seq_len // 8), seed=seed)
    bsz = max(1, size.batch // 2)
    n_gen = int(round(bsz * distill_fraction)) if distill_sequences > 0 else 0
    t0 = time.perf_counter()
    if n_gen:
        prompt = max(4, size.seq_len // 4)
        gen = target_continuations(model, stream, distill_sequences, prompt, size.seq_len - prompt, seed + 2)
        log(f"  {gen.shape[0]} target continuations ({gen.shape[1] - prompt} tokens each, half greedy, half "
            f"sampled) as self-distillation data ({time.perf_counter() - t0:.0f}s)")
    pick = torch.Generator().manual_seed(seed + 3)
    data = batches(stream, size.seq_len, bsz - n_gen, seed + 1) if bsz > n_gen else None
    hist = []
    bar = _progress(range(steps), "train drafter", steps, quiet)
    tau_ema = None
    try:
        with warnings.catch_warnings():
            # DSparkTrainer.step converts its (grad-carrying) loss parts to floats: harmless, and noisy here
            warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad=True to a scalar")
            for step in bar:
                for gr in opt.param_groups:
                    gr["lr"] = _lr(step, steps, 2e-3, warmup=max(1, min(20, steps // 10)))
                x = next(data)[:, :-1] if data is not None else None
                if n_gen:
                    g = gen[torch.randint(0, gen.shape[0], (n_gen,), generator=pick)]
                    x = g if x is None else torch.cat([x, g])
                parts = trainer.step(x)
                tau = float(parts["tau"])
                tau_ema = tau if tau_ema is None else 0.95 * tau_ema + 0.05 * tau
                hist.append((step + 1, float(parts["loss"]), tau))
                bar.set_postfix(tau=f"{tau_ema:.2f}")
                if (step + 1) % 50 == 0 or step + 1 == steps:
                    log(f"  step {step + 1:>4}/{steps}  loss {parts['loss']:.3f}  expected acceptance "
                        f"{tau_ema:.2f}  ({time.perf_counter() - t0:.0f}s)")
    finally:
        bar.close()
    for p in model.parameters():
        p.requires_grad_(True)  # DSparkTrainer froze the target
    drafter.eval()
    return drafter, hist


# ------------------------------------------------------------------------------------------- generation
SAMPLING = {"do_sample": True, "temperature": 1.0}  # the DSpark papers' acceptance numbers are at T = 1


@torch.no_grad()
def timed_generate(model, ids: list[int], n: int, drafter=None, sample: bool = False,
                   seed: int = 0) -> tuple[list[int], float]:
    """Greedy (or T = 1 sampled) generation of n tokens → (new ids, seconds)."""
    x = torch.tensor([ids])
    kw = dict(SAMPLING, seed=seed) if sample else {"do_sample": False}
    if drafter is not None:
        kw.update(drafter=drafter, num_assistant_tokens=drafter.config.block_size)
    t = time.perf_counter()
    out = model.generate(x, max_new_tokens=n, **kw)
    return out[0, len(ids):].tolist(), time.perf_counter() - t


@torch.no_grad()
def acceptance_on_heldout(model, drafter, tok, docs: list[tuple[str, str]], n_prompts: int = 6,
                          prompt_tokens: int = 48, new_tokens: int = 48, sample: bool = False) -> dict:
    """Speculative decoding (greedy, or T = 1 sampling) from the starts of held-out files: acceptance length
    (tokens per target forward, bonus included) and per-position conditional acceptance over all rounds."""
    accepted = rounds = 0
    per_pos_a, per_pos_t = None, None
    for i, (_, text) in enumerate(docs[:n_prompts]):
        ids = tok.encode(text).ids[:prompt_tokens]
        timed_generate(model, ids, new_tokens, drafter, sample=sample, seed=i)
        s = drafter.last_stats
        accepted += s.accepted
        rounds += s.row_rounds
        per_pos_a = s.position_accepted if per_pos_a is None else [a + b for a, b in zip(per_pos_a, s.position_accepted)]
        per_pos_t = s.position_tried if per_pos_t is None else [a + b for a, b in zip(per_pos_t, s.position_tried)]
    return {"acceptance_length": (accepted + rounds) / max(1, rounds), "rounds": rounds,
            "position_acceptance": [a / t if t else float("nan") for a, t in zip(per_pos_a or [], per_pos_t or [])]}


# ---------------------------------------------------------------------------------------------- outputs
def plot_curves(path: Path, hist: dict, unigram: float, drafter_hist: list | None = None) -> bool:
    """Loss curve PNG (train loss, held-out points, unigram baseline; drafter τ in a second panel)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = 2 if drafter_hist else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4), squeeze=False)
    ax = axes[0][0]
    s, v = zip(*hist["train"])
    ax.plot(s, v, lw=0.6, alpha=0.35, color="C0")
    w = max(1, len(v) // 30)
    sm = [sum(v[max(0, i - w):i + 1]) / len(v[max(0, i - w):i + 1]) for i in range(len(v))]
    ax.plot(s, sm, color="C0", label="train")
    if hist["heldout"]:
        hs, hv = zip(*hist["heldout"])
        ax.plot(hs, hv, "o-", color="C1", label="held-out files")
    ax.axhline(unigram, ls="--", color="gray", label=f"unigram baseline ({unigram:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title("KimiK3 (KDA + MLA, AttnRes, LatentMoE) on Python stdlib")
    ax.legend()
    ax.grid(alpha=0.3)
    if drafter_hist:
        ax = axes[0][1]
        ds, _, dt = zip(*drafter_hist)
        w = max(1, len(dt) // 20)
        ax.plot(ds, [sum(dt[max(0, i - w):i + 1]) / len(dt[max(0, i - w):i + 1]) for i in range(len(dt))], color="C2")
        ax.set_xlabel("step")
        ax.set_ylabel("expected acceptance length (train)")
        ax.set_title("DSpark drafter")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def default_out_dir() -> Path:
    """Where ``k3nn demo`` writes by default: ``$K3NN_HOME/demo``, else ``$XDG_CACHE_HOME/k3nn/demo``, else
    ``~/.cache/k3nn/demo``."""
    base = os.environ.get("K3NN_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                       os.path.expanduser("~/.cache"), "k3nn")
    return Path(base) / "demo"


def _settings(args: argparse.Namespace, size: DemoSize) -> dict:
    return {"size": args.size, "steps": args.steps, "seed": args.seed, "shape": dataclasses.asdict(size),
            "python": sys.version.split()[0]}


def machine_info() -> dict:
    """What the demo's timings depend on: CPU model, cores (all / usable by this process), torch threads, load
    average at the start, OS, Python / torch / k3nn versions, and the checkout's commit when there is one."""
    import platform
    import subprocess

    from . import __version__
    from .utils import _usable_cores

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                                capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    try:
        load = round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        load = None
    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": _usable_cores(),
            "threads": torch.get_num_threads(), "load_average_1min": load,
            "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "torch": torch.__version__, "k3nn": __version__, "commit": commit}


def _out_arg(value: str) -> Path:
    p = Path(value).expanduser()
    if p.exists() and not p.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r} exists and is not a directory")
    return p


def build_parser() -> argparse.ArgumentParser:
    from .cli_args import ArgumentParser, add_threads_argument, directory_arg, int_arg, nonempty_arg

    p = ArgumentParser(
        prog="k3nn demo",
        description="Train a small Kimi K3-structured model (KDA + gated MLA, Attention Residuals, Stable\n"
                    "LatentMoE with Quantile Balancing) on the Python standard library's source, train a DSpark\n"
                    "drafter for it, then generate Python with and without speculative decoding. CPU only, a few\n"
                    "minutes; the trained checkpoint is cached and reused by the next run.",
        epilog="examples:\n"
               "  k3nn demo                      train (or reuse) the small model, then generate\n"
               "  k3nn demo --steps 600 --retrain  train longer\n"
               "  k3nn demo --size toy --out /tmp/k3nn-toy   smoke run in seconds\n"
               "afterwards:\n"
               "  k3nn generate --model OUT/model --drafter OUT/drafter --offline --prompt 'def parse('\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="small",
                   help="model and data shape: toy (smoke test, seconds), small (default: 1.8M params, a few minutes), "
                        "base (8 layers, ~4x the compute)")
    p.add_argument("--steps", type=int_arg(1), default=None, metavar="N",
                   help="target training steps, >= 1 (default: 300 for small)")
    p.add_argument("--drafter-steps", type=int_arg(0), default=None, metavar="N",
                   help="drafter training steps (default: 500 for small; 0: no drafter, no speculative decoding)")
    p.add_argument("--out", type=_out_arg, default=None,
                   help="where model/, drafter/, loss.png and results.json go (default: ~/.cache/k3nn/demo, "
                        "or $K3NN_HOME/demo)")
    reuse = p.add_mutually_exclusive_group()
    reuse.add_argument("--retrain", action="store_true", help="train again even if a checkpoint trained with the same settings is cached")
    reuse.add_argument("--reuse", action="store_true",
                       help="use the cached checkpoint whatever settings it was trained with (error if there is none)")
    p.add_argument("--prompt", type=nonempty_arg, default=DEFAULT_PROMPT, help="prompt for the generation step (default: a function "
                   "signature and docstring)")
    p.add_argument("--max-new-tokens", type=int_arg(1), default=96, metavar="N",
                   help="tokens generated from the prompt (default: 96)")
    p.add_argument("--seed", type=int_arg(0, 2**63 - 1), default=0,
                   help="seed for initialisation and data order (default: 0)")
    add_threads_argument(p)
    p.add_argument("--corpus", type=directory_arg, default=None, help="directory of .py files to train on (default: this Python's standard library)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return p


# ------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """``k3nn demo`` (``argv``: its arguments, see ``k3nn demo --help``): train or reuse the model and the drafter,
    generate, print the figures and write ``results.json`` (the figures, the machine, the seconds) beside them.
    Returns 0; a user error is a ``SystemExit`` with a message (``k3nn demo`` prints it as one line)."""
    args = build_parser().parse_args(argv)
    size = SIZES[args.size]
    steps = size.steps if args.steps is None else args.steps
    dsteps = size.drafter_steps if args.drafter_steps is None else args.drafter_steps
    args.steps = steps
    out = Path(args.out) if args.out is not None else default_out_dir()
    mdir, ddir = out / "model", out / "drafter"
    _need("tokenizers")
    from .utils import configure_threads

    try:
        configure_threads(args.threads)
    except ValueError as e:  # a malformed OMP_NUM_THREADS
        build_parser().error(str(e))
    machine = machine_info()

    from . import KimiK3, __version__
    from .tokenizer import load_tokenizer

    T0 = time.perf_counter()
    say = lambda *a: print(*a, flush=True)  # noqa: E731
    figures: list[str] = []  # the summary lines, kept in results.json (the README shows them)

    def fig(line: str) -> None:
        figures.append(line)
        say(line)
    say(f"k3nn {__version__} demo | torch {torch.__version__} | {torch.get_num_threads()} CPU thread(s) | "
        f"size {args.size} | out {out}")

    # -- 1. corpus
    t = time.perf_counter()
    corpus = load_corpus(size.corpus_mb, max_heldout_mb=min(0.5, size.corpus_mb / 4), root=args.corpus)
    say(f"[1/5] corpus: {corpus.describe()} ({time.perf_counter() - t:.1f}s)")

    settings = _settings(args, size)
    meta_path = mdir / "demo.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    reuse = meta is not None and not args.retrain and (args.reuse or meta.get("settings") == settings)
    if args.reuse and meta is None:
        raise SystemExit(f"--reuse: no cached checkpoint in {mdir}; run without --reuse to train one")

    # -- 2. tokenizer
    t = time.perf_counter()
    from tokenizers import Tokenizer

    if reuse:
        tok = Tokenizer.from_file(str(mdir / "tokenizer.json"))
        say(f"[2/5] tokenizer: cached {mdir / 'tokenizer.json'} (vocab {tok.get_vocab_size()})")
    else:
        mdir.mkdir(parents=True, exist_ok=True)
        tok = train_tokenizer([t_ for _, t_ in corpus.train], size.vocab)
        say(f"[2/5] tokenizer: byte-level BPE, vocab {tok.get_vocab_size()}, trained on the train files "
            f"({time.perf_counter() - t:.1f}s)")
    train_ids = encode_docs(tok, [t_ for _, t_ in corpus.train])
    held_ids = encode_docs(tok, [t_ for _, t_ in corpus.heldout])
    n_eval = 32 if args.size != "toy" else 4
    held_w = eval_windows(held_ids, size.seq_len, n_eval)
    vocab = tok.get_vocab_size()
    uni = unigram_loss(train_ids, held_w[:, 1:], vocab)
    chars = sum(len(t_) for _, t_ in corpus.train)
    say(f"      {train_ids.numel():,} train tokens ({chars / train_ids.numel():.2f} chars/token), "
        f"{held_ids.numel():,} held-out tokens; unigram baseline on held-out: {uni:.3f} nats/token")

    # -- 3. target
    if reuse:
        model = KimiK3.from_pretrained(mdir, backend="eager").eval()
        hist = meta["history"]
        say(f"[3/5] target: cached {mdir} ({model.num_parameters() / 1e6:.2f}M params, trained "
            f"{meta['settings']['steps']} steps in {hist['seconds']:.0f}s)")
    else:
        cfg = model_config(size).replace(vocab_size=vocab, eos_token_id=tok.token_to_id(EOS))
        cfg.validate()
        model = KimiK3(cfg, backend="eager", seed=args.seed)
        n_tok = steps * size.batch * size.seq_len
        say(f"[3/5] target: KimiK3 {model.num_parameters() / 1e6:.2f}M params ({cfg.num_hidden_layers} layers: "
            f"KDA {cfg.kda_layers}, MLA {cfg.mla_layers}; AttnRes; LatentMoE {cfg.num_experts} experts top-"
            f"{cfg.num_experts_per_token} + QB), {steps} steps x {size.batch} x {size.seq_len} = {n_tok:,} tokens")
        say(f"      held-out loss before training: {heldout_loss(model, held_w):.3f}")
        hist = train_model(model, train_ids, size, steps, held_w, eval_every=max(1, min(50, steps)),
                           seed=args.seed, quiet=args.quiet, log=say)
        hist["heldout_final"] = hist["heldout"][-1][1]
        # tokenizer.json + tokenizer_config.json (AutoTokenizer loads the directory; the demo's chat template)
        model.save_pretrained(mdir, tokenizer=tok, chat_template=CHAT_TEMPLATE)
        meta = {"settings": settings, "history": hist, "unigram": uni}
        meta_path.write_text(json.dumps(meta))
        if ddir.exists():  # a drafter trained for another target is stale
            for f in ddir.iterdir():
                f.unlink()
        say(f"      saved {mdir} (config.json, safetensors, tokenizer.json, tokenizer_config.json) in "
            f"{hist['seconds']:.0f}s of training")
    write_chat_template(mdir)  # so that `k3nn serve --model <out>/model` can chat
    held = heldout_loss(model, held_w)
    fig(f"      held-out loss {held:.3f} nats/token vs unigram {uni:.3f} "
        f"(perplexity {math.exp(held):.1f} vs {math.exp(uni):.1f})")

    # -- 4. drafter
    drafter, dhist = None, None
    if dsteps > 0:
        from .layers.dspark import DSparkDrafter

        dmeta_path = ddir / "demo.json"
        dmeta = json.loads(dmeta_path.read_text()) if dmeta_path.is_file() else None
        dsettings = {"steps": dsteps, "gamma": size.gamma, "distill": size.distill, "target": settings}
        if dmeta is not None and reuse and (args.reuse or dmeta.get("settings") == dsettings):
            drafter = DSparkDrafter.from_pretrained(ddir, target=model).eval()
            dhist = dmeta["history"]
            say(f"[4/5] drafter: cached {ddir} (DSpark, γ={drafter.config.block_size})")
        else:
            t = time.perf_counter()
            say(f"[4/5] drafter: DSpark, 1 layer, γ={size.gamma}, {dsteps} steps on the frozen target")
            drafter, dhist = train_drafter(model, train_ids, size, dsteps, seed=args.seed, quiet=args.quiet,
                                           log=say, mask_token_id=tok.token_to_id(MASK),
                                           distill_sequences=size.distill)
            say(f"      conditioned on target layer(s) {drafter.target_layers}; "
                f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M params (embedding and lm_head shared)")
            drafter.save_pretrained(ddir)
            dmeta_path.write_text(json.dumps({"settings": dsettings, "history": dhist}))
            say(f"      saved {ddir} ({time.perf_counter() - t:.0f}s)")
    else:
        say("[4/5] drafter: skipped (--drafter-steps 0): generation runs without speculative decoding")
    if plot_curves(out / "loss.png", hist, uni, dhist):
        say(f"      loss curve: {out / 'loss.png'}")
    else:
        say("      (no loss curve: matplotlib is not installed; pip install 'k3nn[demo]')")

    # -- 5. generation
    ktok = load_tokenizer(mdir, vocab)
    ids = ktok.encode(args.prompt)
    if not ids:
        raise SystemExit("--prompt is empty")
    say(f"[5/5] generate: {args.max_new_tokens} new tokens, eager backend on CPU")
    timed_generate(model, ids, 4)  # warm-up
    plain, dt_plain = timed_generate(model, ids, args.max_new_tokens)
    rule = "-" * 100
    say(f"greedy:\n{rule}\n{args.prompt}{ktok.decode(plain)}\n{rule}")
    results = {"heldout_loss": held, "unigram_loss": uni, "train_seconds": hist["seconds"],
               "plain_tokens_per_s": len(plain) / dt_plain, "prompt": args.prompt,
               "greedy_text": ktok.decode(plain)}
    fig(f"plain greedy:          {len(plain) / dt_plain:6.1f} tokens/s")
    if drafter is not None:
        spec, dt_spec = timed_generate(model, ids, args.max_new_tokens, drafter=drafter)
        st = drafter.last_stats
        same = spec == plain
        fig(f"speculative greedy:    {len(spec) / dt_spec:6.1f} tokens/s ({dt_plain / dt_spec:.2f}x), acceptance length "
            f"{st.acceptance_length:.2f} (γ={st.gamma}); output "
            f"{'identical to plain greedy' if same else 'DIFFERS from plain greedy'}")
        _, dt_ps = timed_generate(model, ids, args.max_new_tokens, sample=True, seed=args.seed)
        samp, dt_ss = timed_generate(model, ids, args.max_new_tokens, drafter=drafter, sample=True, seed=args.seed)
        st_s = drafter.last_stats
        fig(f"plain sampled (T=1):   {args.max_new_tokens / dt_ps:6.1f} tokens/s")
        fig(f"speculative sampled:   {len(samp) / dt_ss:6.1f} tokens/s ({dt_ps / dt_ss:.2f}x), acceptance length "
            f"{st_s.acceptance_length:.2f} (lossless rejection sampling: same distribution as plain sampling)")
        say(f"sampled (T=1, speculative):\n{rule}\n{args.prompt}{ktok.decode(samp)}\n{rule}")
        n_p = 6 if args.size != "toy" else 1
        n_new = 48 if args.size != "toy" else 8
        acc_g = acceptance_on_heldout(model, drafter, tok, corpus.heldout, n_p, new_tokens=n_new)
        acc_s = acceptance_on_heldout(model, drafter, tok, corpus.heldout, n_p, new_tokens=n_new, sample=True)
        fmt = lambda acc: " ".join("-" if p != p else f"{p:.2f}" for p in acc["position_acceptance"])  # noqa: E731
        head = f"held-out files ({n_p} prompts x {n_new} tokens): acceptance length "
        fig(f"{head}greedy {acc_g['acceptance_length']:.2f} (per position {fmt(acc_g)}),")
        fig(f"{' ' * len(head)}T=1 sampling {acc_s['acceptance_length']:.2f} (per position {fmt(acc_s)})")
        results.update(spec_tokens_per_s=len(spec) / dt_spec, speedup_greedy=dt_plain / dt_spec,
                       speedup_sampled=dt_ps / dt_ss, acceptance_length_prompt=st.acceptance_length,
                       identical=same, acceptance_length_heldout_greedy=acc_g["acceptance_length"],
                       acceptance_length_heldout_sampled=acc_s["acceptance_length"],
                       position_acceptance_heldout_greedy=[p if p == p else None for p in acc_g["position_acceptance"]],
                       position_acceptance_heldout_sampled=[p if p == p else None for p in acc_s["position_acceptance"]],
                       sampled_text=ktok.decode(samp))
    else:
        say("speculative decoding: not run (no drafter)")
    total = time.perf_counter() - T0
    try:  # what other processes did while the demo ran (the start value is in machine_info)
        machine["load_average_1min_end"] = round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        pass
    results.update(figures=figures, total_seconds=total, reused_checkpoint=reuse, settings=settings,
                   date=time.strftime("%Y-%m-%d %H:%M:%S %z"), machine=machine)
    (out / "results.json").write_text(json.dumps(results, indent=2, ensure_ascii=False))
    say(f"done in {total:.0f}s. Try: k3nn generate --model {mdir} --offline "
        f"--prompt 'import os' --max-new-tokens 64")
    return 0


if __name__ == "__main__":
    sys.exit(main())
