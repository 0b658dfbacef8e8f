"""Training speed: tokens/s and model FLOPs utilisation (MFU) of `attnlab train`'s step, against a
baseline.

    .venv/bin/python benchmarks/train_speed.py            # both configs, every variant
    .venv/bin/python benchmarks/train_speed.py --configs nano --rounds 5

Design choices:
- Everything is measured in this one process: the machine's matmul peak (a float32 matmul, best of a
  few), a baseline (RecipeLoop: nanoGPT's model and train-step recipe in plain eager float32
  PyTorch, on the same tokens) and attnlab's Trainer.train_step in its variants (as
  shipped: fused AdamW + clipping; + torch.compile of the forward pass and loss; + bf16 autocast).
  Results are ratios to the baseline, because the machine is shared and absolute times move with its
  load.
- Variants are interleaved round by round (A B C D, A B C D, ...) and each reports its median step
  time, so a burst of load elsewhere hits every variant alike rather than one of them.
- FLOPs per token = 6·N + 12·n_layers·d_model·n_ctx (PaLM appendix B, as nanoGPT's estimate_mfu): N
  is the parameter count without the position table; the second term is attention's QKᵀ and AV.
- The two configs are the issue's: nanoGPT's CPU Shakespeare config (4 layers, 128 wide, block 64,
  batch 12) and a 6-layer, 384-wide model at block 256 (batch 4 here, to keep a step to seconds on 2
  cores).
- `--device cuda`: the baseline takes what nanoGPT's train.py does on a GPU (bf16 autocast where the
  GPU has it, fused AdamW); attnlab's step runs its `--dtype auto` (the same autocast), and the last
  variant is float32 instead of bf16. MFU is against the measured matmul peak of the dtype the step
  multiplies in.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_results_argument,
    benchmark_device,
    figure,
    machine_description,
    machine_line,
    median_time,
    synchronize,
    write_result,
)

from attnlab.training.config import build_config
from attnlab.training.trainer import Trainer

CONFIGS = {
    "nano": dict(preset="nano"),
    "6x384-block256": dict(
        preset="nano", n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=4
    ),
}


def measure_matmul_peak(
    n: int = 1024,
    repeats: int = 10,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> float:
    """Best matmul FLOP/s of this process on an n x n x n product (n 8192 on a GPU, to fill it)."""
    n = 8192 if torch.device(device).type == "cuda" else n
    a, b = (
        torch.randn(n, n, device=device, dtype=dtype),
        torch.randn(n, n, device=device, dtype=dtype),
    )
    a @ b
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def flops_per_token(trainer: Trainer) -> float:
    cfg = trainer.model_config
    n = trainer.raw_model.num_params()
    if trainer.raw_model.pos_embed is not None:
        n -= trainer.raw_model.pos_embed.weight.numel()
    return 6 * n + 12 * cfg.n_layers * cfg.d_model * cfg.n_ctx


class RecipeGPT(torch.nn.Module):
    """The baseline model: a GPT-2-style decoder in the plain-PyTorch form nanoGPT's model.py uses
    (one fused query/key/value Linear, torch's SDPA with is_causal, exact GELU, pre-norm LayerNorm,
    tied head, N(0, 0.02) init with the residual projections scaled by 1/sqrt(2 n_layer)), written
    here for the comparison."""

    def __init__(
        self, vocab: int, n_layer: int, n_head: int, n_embd: int, block_size: int, bias: bool
    ) -> None:
        super().__init__()
        nn = torch.nn
        self.n_head = n_head
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                dict(
                    ln_1=nn.LayerNorm(n_embd, bias=bias),
                    c_attn=nn.Linear(n_embd, 3 * n_embd, bias=bias),
                    c_proj=nn.Linear(n_embd, n_embd, bias=bias),
                    ln_2=nn.LayerNorm(n_embd, bias=bias),
                    c_fc=nn.Linear(n_embd, 4 * n_embd, bias=bias),
                    mlp_proj=nn.Linear(4 * n_embd, n_embd, bias=bias),
                )
            )
            for _ in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = (
                    0.02 / math.sqrt(2 * n_layer)
                    if name.endswith(("c_proj.weight", "mlp_proj.weight"))
                    else 0.02
                )
                torch.nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                torch.nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            q, k, v = b.c_attn(b.ln_1(x)).split(x.size(-1), dim=2)
            q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + b.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))
            x = x + b.mlp_proj(F.gelu(b.c_fc(b.ln_2(x))))
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class RecipeLoop:
    """The baseline loop: nanoGPT's train.py step, eager: batches gathered window by window from the
    memmap and stacked, forward, backward, clip_grad_norm_, AdamW with decay on dim >= 2 parameters,
    then `loss.item()` (its log line, every step at log_interval 1). On the CPU float32 and foreach
    AdamW, as nanoGPT runs there; on a GPU bf16 autocast (where supported), pinned batches and fused
    AdamW, as it runs there."""

    def __init__(self, trainer: Trainer) -> None:
        cfg = trainer.cfg
        torch.manual_seed(0)
        self.cfg, self.tokens, self.device = cfg, trainer.data.split("train"), trainer.device
        self.cuda = self.device.type == "cuda"
        self.model = RecipeGPT(
            trainer.tokenizer.vocab_size,
            cfg.n_layer,
            cfg.n_head,
            cfg.n_embd,
            cfg.block_size,
            cfg.bias,
        ).to(self.device)
        params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=cfg.learning_rate,
            betas=(cfg.beta1, cfg.beta2),
            fused=self.cuda or None,
        )
        bf16 = self.cuda and torch.cuda.is_bf16_supported()
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16 if bf16 else torch.float16)
            if self.cuda
            else None
        )

    def get_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.cfg.block_size
        ix = torch.randint(len(self.tokens) - T, (self.cfg.batch_size,))
        x = torch.stack([torch.from_numpy(self.tokens[i : i + T].astype(np.int64)) for i in ix])
        y = torch.stack(
            [torch.from_numpy(self.tokens[i + 1 : i + 1 + T].astype(np.int64)) for i in ix]
        )
        if self.cuda:
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(
                self.device, non_blocking=True
            )
        return x, y

    def train_step(self, it: int) -> float:
        x, y = self.get_batch()
        if self.autocast is not None:
            with self.autocast:
                loss = self.model(x, y)
        else:
            loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def make_variants(name: str, root: Path, device: torch.device) -> dict[str, object]:
    settings = CONFIGS[name]
    base = dict(settings)
    preset = base.pop("preset")

    def trainer(**extra) -> Trainer:
        out = root / f"{name}-{len(list(root.iterdir()))}"
        cfg = build_config(
            preset,
            overrides={**base, **extra, "out": str(out), "device": str(device), "max_iters": 10**6},
        )
        return Trainer(cfg, overwrite=True, progress=False)

    shipped = trainer()
    other = (
        ("+ float32 (--dtype float32)", "float32")
        if device.type == "cuda"
        else ("+ bf16 autocast", "bfloat16")
    )
    return {
        "baseline: nanoGPT recipe, plain PyTorch": RecipeLoop(shipped),
        "attnlab step (fused AdamW, clip)": shipped,
        "+ --compile (forward and loss, one graph)": trainer(compile=True),
        other[0]: trainer(dtype=other[1]),
    }


def step_dtype(variant) -> torch.dtype:
    """The dtype a variant's matmuls run in: its autocast dtype, else float32."""
    if isinstance(variant, Trainer):
        return variant.dtype if variant.dtype is not None else torch.float32
    return variant.autocast.fast_dtype if variant.autocast is not None else torch.float32


def batch_time(trainer: Trainer, repeats: int = 50) -> float:
    """Median seconds to sample and gather one step's batches (and move them to the device): what a
    step waits for its data, since attnlab gathers in the training process itself, with no loader
    workers."""
    return median_time(lambda: list(trainer.micro_batches(0)), repeats, device=trainer.device)


def run(
    name: str,
    rounds: int,
    steps: int,
    peaks: dict[torch.dtype, float],
    root: Path,
    device: torch.device,
) -> tuple[list[dict], str]:
    """The table rows of one config, and a line on how long a step waits for its data."""
    variants = make_variants(name, root, device)
    some_trainer = next(v for v in variants.values() if isinstance(v, Trainer))
    per_token = flops_per_token(some_trainer)
    cfg = some_trainer.cfg
    tokens_per_step = cfg.batch_size * cfg.block_size * some_trainer.accum_total
    for variant in variants.values():  # warm-up (compilation happens here)
        for it in range(2):
            variant.train_step(it)
    times: dict[str, list[float]] = {label: [] for label in variants}
    for r in range(rounds):
        for label, variant in variants.items():
            synchronize(device)
            t0 = time.perf_counter()
            for it in range(steps):
                variant.train_step(2 + r * steps + it)
            synchronize(device)
            times[label].append((time.perf_counter() - t0) / steps)
    base = statistics.median(times[next(iter(variants))])
    rows = []
    for label, variant in variants.items():
        step = statistics.median(times[label])
        tokens_per_s = tokens_per_step / step
        peak = peaks.get(step_dtype(variant), peaks[torch.float32])
        rows.append(
            dict(
                config=name,
                variant=label,
                step_ms=1000 * step,
                tokens_per_s=tokens_per_s,
                mfu=tokens_per_s * per_token / peak,
                speedup=base / step,
            )
        )
    data_s = batch_time(some_trainer)
    return rows, (
        f"{name}: sampling and gathering a step's batches takes {data_s * 1e6:.0f} µs, "
        f"{data_s / statistics.median(times[rows[1]['variant']]):.2%} of attnlab's step"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per variant")
    parser.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    add_results_argument(parser)
    args = parser.parse_args()
    device = benchmark_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    peaks = {torch.float32: measure_matmul_peak(device=device)}
    if device.type == "cuda":  # the CPU's MFU stays against float32: it has no bf16 matrix units
        peaks[torch.bfloat16] = measure_matmul_peak(device=device, dtype=torch.bfloat16)
    peak = peaks[torch.float32]
    print(
        f"# Training speed\n{machine_line(device)}\nmeasured matmul peak: "
        + ", ".join(
            f"{str(dt).removeprefix('torch.')} {p / 1e9:,.1f} GFLOP/s" for dt, p in peaks.items()
        )
    )
    print("| config | variant | ms/step | tokens/s | MFU | vs baseline |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    notes: list[str] = []
    machine = machine_description(device, matmul_flops=peak)
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            steps = args.steps if name == "nano" else max(1, args.steps // 3)
            rows, note = run(name, args.rounds, steps, peaks, Path(tmp), device)
            for row in rows:
                print(
                    f"| {row['config']} | {row['variant']} | {row['step_ms']:.0f} | "
                    f"{row['tokens_per_s']:,.0f} | "
                    f"{100 * row['mfu']:.1f}% | {row['speedup']:.2f}x |",
                    flush=True,
                )
            notes.append(note)
            baseline = rows[0]  # RecipeLoop: nanoGPT's recipe in plain PyTorch
            figures += [
                figure(
                    f"{name}, {row['variant']}",
                    "tok/s",
                    row["tokens_per_s"],
                    baseline["tokens_per_s"],
                )
                for row in rows[1:]
            ]
    print("\n".join(notes))
    write_result(
        args.results,
        "train_speed",
        measures="Training tokens per second of `attnlab train`'s step in its variants, against "
        "nanoGPT's model and train step in plain eager PyTorch (RecipeLoop) on the same tokens, "
        "in interleaved rounds in one process.",
        anchor="nanoGPT's recipe in eager PyTorch",
        anchor_version=torch.__version__,
        figures=figures,
        setup=f"{', '.join(args.configs)}, {torch.get_num_threads()} threads",
        machine=machine,
    )
    peak_after = measure_matmul_peak(device=device)
    print(
        f"float32 matmul peak measured again at the end: {peak_after / 1e9:.1f} GFLOP/s (load "
        "drift check; "
        f"{peak / 1e9:.1f} at the start)"
    )


if __name__ == "__main__":
    main()
