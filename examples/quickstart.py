"""The README's five-minute tour, runnable: load, generate, swap a backend, one layer in your own model,
speculative decoding, the engine, the multimodal model.

    python examples/quickstart.py                 # uses the demo's checkpoint if `k3nn demo` has run
    python examples/quickstart.py --model DIR     # any k3nn / Kimi Linear checkpoint directory or hub id
    python examples/quickstart.py --threads 1     # CPU threads (default auto: $OMP_NUM_THREADS, else idle cores)

Without a trained checkpoint it builds ``KimiK3Config.tiny()`` with random weights (the text is noise, the API
is the same).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import k3nn
from k3nn import KimiK3, KimiK3Config
from k3nn.cli import add_threads_argument
from k3nn.demo import default_out_dir
from k3nn.tokenizer import load_tokenizer
from k3nn.utils import configure_threads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(default_out_dir() / "model"), help="checkpoint directory or hub id")
    p.add_argument("--drafter", default=str(default_out_dir() / "drafter"), help="DSpark drafter directory")
    add_threads_argument(p)
    args = p.parse_args()
    configure_threads(args.threads)  # an entry point sets threads; the library itself never does

    # 1. load ---------------------------------------------------------------------------------------------
    if os.path.isdir(args.model):
        model = KimiK3.from_pretrained(args.model).eval()  # + dtype=, device="cuda", backend=, revision=
        tok = load_tokenizer(args.model, model.config.vocab_size)  # the checkpoint's tokenizer.json
    else:
        print(f"{args.model} not found (run `k3nn demo` first): using a random tiny model")
        model = KimiK3(KimiK3Config.tiny(), seed=0).eval()
        tok = load_tokenizer(None, model.config.vocab_size)  # bytes as ids
    print(f"{model.num_parameters() / 1e6:.2f}M parameters, layers: KDA {model.config.kda_layers}, "
          f"MLA {model.config.mla_layers}")

    # 2. generate ------------------------------------------------------------------------------------------
    ids = torch.tensor([tok.encode("def parse_args(argv):\n")])
    out = model.generate(ids, max_new_tokens=40)  # greedy; do_sample=True, top_p=0.9, seed=0 to sample
    print(tok.decode(out[0].tolist()))

    # 3. swap a backend ------------------------------------------------------------------------------------
    with k3nn.backend("eager"):  # "eager" | "triton" | "cuda" | "auto"
        ref = model(ids).logits
    print("kda_chunk backends here:", k3nn.available_backends()["kda_chunk"])
    if torch.cuda.is_available():
        gpu = KimiK3.from_pretrained(args.model, device="cuda", dtype=torch.bfloat16, backend="triton") \
            if os.path.isdir(args.model) else model.to("cuda")
        err = (gpu(ids.cuda()).logits.float().cpu() - ref).abs().max()
        print(f"triton vs eager: max |Δlogit| = {float(err):.3f} (bf16)")

    # 4. one layer in your own model -----------------------------------------------------------------------
    from k3nn.layers.kda import KimiDeltaAttention

    class TinyLM(torch.nn.Module):
        def __init__(self, cfg: KimiK3Config):
            super().__init__()
            self.emb = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.mix = KimiDeltaAttention(cfg)  # x [B, T, d] -> [B, T, d]
            self.head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size)

        def forward(self, x):
            h = self.emb(x)
            return self.head(h + self.mix(h))

    lm = TinyLM(KimiK3Config.tiny())
    loss = torch.nn.functional.cross_entropy(lm(ids[:, :-1] % 256).flatten(0, 1), (ids[:, 1:] % 256).flatten())
    loss.backward()  # KDA trains (eager autograd; the Triton chunk kernel has a backward too)
    print(f"TinyLM with a KDA mixer: loss {loss.item():.3f}, grads flow")

    # 5. speculative decoding --------------------------------------------------------------------------------
    from k3nn.layers.dspark import DSparkConfig, DSparkDrafter

    if os.path.isdir(args.drafter) and os.path.isdir(args.model):
        drafter = DSparkDrafter.from_pretrained(args.drafter, target=model).eval()
    else:  # an untrained drafter: correct output, low acceptance
        drafter = DSparkDrafter(DSparkConfig.for_target(model.config, num_layers=1, block_size=4), target=model)
    t = time.perf_counter()
    spec = model.generate(ids, max_new_tokens=40, drafter=drafter, num_assistant_tokens=drafter.config.block_size)
    st = drafter.last_stats
    print(f"speculative: identical to greedy: {torch.equal(spec, out)}, acceptance length "
          f"{st.acceptance_length:.2f}, {40 / (time.perf_counter() - t):.0f} tokens/s")

    # 6. the engine: continuous batching over a paged hybrid cache with prefix reuse -------------------------
    from k3nn.engine import Engine

    engine = Engine(model, max_num_seqs=4, num_pages=64)
    prompts = ["import os\n", "class Config:\n", "def main():\n", "import os\nimport sys\n"]
    outs = engine.generate([tok.encode(s) for s in prompts], max_new_tokens=16)
    for s, o in zip(prompts, outs):
        print(repr(s), "->", repr(tok.decode(o)))
    m = engine.metrics()
    print(f"engine: {m['generated_tokens']} tokens, {m['throughput_tok_s']:.0f} tokens/s, "
          f"prefix-cache hit rate {m.get('cache_hit_rate', 0):.2f}")

    # 7. the engine with the drafter, sampling parameters and streaming ----------------------------------------
    from k3nn.engine import SamplingParams

    engine = Engine(model, max_num_seqs=4, num_pages=64, drafter=drafter, tokenizer=tok)
    print(f"engine warmup: {engine.warmup(prompt_len=16, batch_sizes=[1, 2]):.1f} s")
    engine.add_request(tok.encode("def f(x):"), SamplingParams(max_new_tokens=24, do_sample=True, temperature=0.7,
                                                                stop=["\n\n"], repetition_penalty=1.1, logprobs=2,
                                                                n=2, seed=0), num_speculative_tokens=4)
    for o in engine.stream():
        if o.finished:
            print(o.request_id, o.finish_reason, repr(o.text))
    m = engine.metrics()
    print(f"engine with drafts: acceptance length {m['spec_acceptance_length']:.2f}, "
          f"{m['preemptions']} preemptions")

    # 8. the multimodal model: a KimiK3 beside the MoonViT vision tower ----------------------------------------
    from k3nn import KimiK3ForConditionalGeneration, MultimodalConfig
    from k3nn.vision import num_image_tokens

    mcfg = MultimodalConfig.tiny()  # a Kimi K2.5 / K3 checkpoint: KimiK3ForConditionalGeneration.from_pretrained(dir)
    mm = KimiK3ForConditionalGeneration(mcfg, seed=0).eval()
    v = mcfg.vision_config
    grid = torch.tensor([[1, 4, 4]])  # one image: (frames, rows, columns) of patches
    pixels = torch.randn(16, v.num_channels, v.patch_size, v.patch_size)  # [patches, C, p, p], as the processor's
    n = num_image_tokens(grid, v.merge_kernel_size)[0]  # each 2x2 block of patches is one text position
    ids = torch.tensor([[5, 6] + [mcfg.image_token_id] * n + [7]])
    out = mm.generate(ids, pixel_values=pixels, image_grid_thw=grid, max_new_tokens=8)
    print(f"multimodal: {n} image tokens in the prompt, {out.shape[1] - ids.shape[1]} new tokens")


if __name__ == "__main__":
    main()
