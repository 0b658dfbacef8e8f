"""The training loop: clipping, accumulation, evaluation, checkpoints, DDP.

Design choices:
- nanoGPT's loop: the schedule and optimizers of attnlab.training.schedule, gradient clipping,
  gradient accumulation; the device and process group of attnlab.training.distributed; metrics, the
  loss plot and report.md written by attnlab.training.report.
- The randomness of step `it` (which windows it trains on, its dropout masks) is seeded from (seed,
  it) and the rank, so a checkpoint's data position and RNG state are its step number: `--resume`
  continues bit for bit as if never stopped, and a run with N processes sees exactly the batch of
  one process.
- Evaluation uses the same fixed eval_iters batches every time (seeded once per split), so
  successive evaluations differ only by what the model learned, not by which batches were drawn.
  Its passes need no gradients and run in the C kernels' layers (attnlab.generate.fast_layers.
  inference_layers), which the plain model's forward never enters by itself.
- A checkpoint is one folder that commits whole or not at all (attnlab.training.checkpoint):
  `train_state.pt` (model, optimizer, step, configs; torch.save of tensors and plain values, read
  back with torch.load(weights_only=True), so nothing arbitrary is ever unpickled) is what --resume
  reads; the native model files beside it are what `attnlab sample`, `attnlab.load` and the explorer
  read, linked into --out. `--resume auto` resumes when there is a checkpoint and starts fresh when
  there is none (an elastic job's restart), and on a finished run (--max-iters or --max-time
  reached) says so in one line and trains
  nothing (a restart after the end is not a mistake); a damaged newest checkpoint falls back to the
  one before.
- Ctrl-C sets a flag (a second Ctrl-C interrupts at once); the loop sees it between steps, saves,
  and returns. A non-finite loss stops the run before the optimizer step, so the last checkpoint
  stays good.
- Distributed: under torchrun (RANK/WORLD_SIZE set) the model is wrapped in DistributedDataParallel,
  with gloo on CPU and nccl on GPU; every rank draws the same global batch and keeps its own rows
  (without --gradient-accumulation-steps, one micro-batch per process per step); accumulation
  micro-steps skip the gradient all-reduce (`no_sync`) except the last; only rank 0 writes files.
- `--compile` compiles embedding, blocks, head and loss as one graph (`forward_loss`); compiling the
  blocks alone gained nothing on the CPUs measured. It is off by default: its compilation, paid
  once at the start, cancels the faster steps on short runs.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..compiling import compile_function
from ..env import capped
from ..errors import UserError
from ..files import ManifestFolder, atomic_write, atomic_write_text
from ..formats.native import save_native
from ..generate.fast_layers import inference_layers
from ..model.transformer import Transformer, next_token_loss
from ..tokenizer import Tokenizer
from .checkpoint import (
    STATE_FILE,
    TRAIN_JSON,
    Checkpoint,
    find_checkpoint,
    has_checkpoint,
    remove_checkpoints,
    state_bytes,
    write_checkpoint,
)
from .config import FLAG_OF_MODEL_FIELD, TrainConfig, flag_name
from .data import TokenData, prepare_data
from .distributed import resolve_dtype, setup_distributed
from .report import (
    METRICS_FILE,
    TrainResult,
    first_reaching,
    read_metrics,
    write_loss_plot,
    write_report,
)
from .schedule import NewtonSchulzChoice, learning_rate_at, make_optimizer, newton_schulz_dtype
from .snapshots import list_snapshots, save_snapshot, snapshot_steps

# what --compile uses (tests swap in "aot_eager", which traces the same graph quickly)
COMPILE_BACKEND = "inductor"
_EVAL_SEED_OFFSET = 7919  # eval batches come from their own seed, apart from every training step's


def _step_seed(seed: int, it: int, stream: int) -> int:
    """A distinct 63-bit seed per (run seed, step, stream); stream -1 is the data, r >= 0 rank r's
    dropout."""
    return (seed * 1_000_003 + it * 1_009 + stream + 1) % (2**63 - 1)


class RunComplete(Exception):
    """--resume auto found the run finished already (its --max-iters or --max-time reached): not a
    mistake but what a job restarted after its end meets, so `train` reports it and trains
    nothing."""

    def __init__(self, out: Path, step: int, why: str) -> None:
        super().__init__(f"the run in {out} is complete: it {why}; nothing to train")
        self.out, self.step = out, step


class Trainer:
    """One training run: builds the data, model and optimizer from a TrainConfig, then `run()`s
    it."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        resume: bool | str = False,
        overwrite: bool = False,
        progress: bool = True,
        checkpoint: Checkpoint | None = None,
        evaluation_lines: bool = True,
        on_snapshot: Callable[[int, torch.nn.Module], None] | None = None,
    ) -> None:
        """resume: True (a checkpoint must be there) or "auto" (resume if there is one, else start
        fresh);
        checkpoint: the one to resume from when the caller has found it already (the command line
        has);
        progress: the progress bar on stderr; evaluation_lines: with it, a line per evaluation
        (`attnlab train`'s log; the experiments, which train many small models, keep the bar alone);
        on_snapshot: called
        with (step, model) after each snapshot is written, on the model's own weights (float32 where
        the snapshot
        file holds float16: the induction experiment measures there). The model is in training mode;
        leave it so."""
        self.dist, self.device = setup_distributed(cfg.device)
        # ATTNLAB_MAX_STEPS (attnlab.env): a short run of the same command, its schedule over its
        # steps, each evaluation on at most as many batches
        steps = capped(cfg.max_iters, "ATTNLAB_MAX_STEPS", "training steps", self.dist.is_main)
        if steps != cfg.max_iters:
            cfg = replace(cfg, max_iters=steps, eval_iters=min(cfg.eval_iters, steps))
        self.cfg, self.progress, self.evaluation_lines = cfg, progress, evaluation_lines
        self.on_snapshot = on_snapshot
        self.out = Path(cfg.out)
        # micro-batches per step, all ranks
        self.accum_total = cfg.gradient_accumulation_steps or self.dist.world
        if self.accum_total % self.dist.world:
            raise UserError(
                f"--gradient-accumulation-steps ({cfg.gradient_accumulation_steps}) counts "
                "micro-batches over all "
                f"{self.dist.world} processes, so it must be a multiple of {self.dist.world} (or "
                "leave it out: "
                "one micro-batch per process)"
            )
        self.accum = self.accum_total // self.dist.world  # micro-batches per process
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        checkpoint, state = self._check_out_dir(resume, overwrite, checkpoint)
        self.tokenizer, self.data = self._prepare_data(checkpoint)
        self.data.check_block_size(cfg.block_size)
        self.model_config = cfg.model_config(d_vocab=self.tokenizer.vocab_size)
        if state is not None:
            self._check_same_model(state)
        # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
        torch.manual_seed(cfg.seed)
        self.raw_model = Transformer(self.model_config).to(self.device)
        self.raw_model.tokenizer = self.tokenizer
        # Muon's Newton-Schulz dtype: one choice for every rank (rank 0's), said once
        self.newton_schulz = self._newton_schulz() if cfg.optimizer == "muon" else None
        if self.newton_schulz is not None and self.evaluation_lines and self.dist.is_main:
            print(self.newton_schulz.line(), file=sys.stderr, flush=True)
        self.optimizer = make_optimizer(self.raw_model, cfg, self.device, self.newton_schulz)
        self.scaler = (
            torch.amp.GradScaler(self.device.type) if self.dtype == torch.float16 else None
        )
        self.iter, self.elapsed_before, self.last_saved = 0, 0.0, None
        if state is not None:
            self.raw_model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if self.scaler is not None and state.get("grad_scaler"):
                self.scaler.load_state_dict(state["grad_scaler"])
            self.iter, self.elapsed_before, self.last_saved = (
                state["iter"],
                state["elapsed_s"],
                state["iter"],
            )
        self.model: torch.nn.Module = self.raw_model
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(
                self.raw_model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
            )
        self.loss_fn = self.forward_loss
        # one graph for embedding, blocks, head and loss; compiled on the first step
        if cfg.compile:
            self.loss_fn = compile_function(self.forward_loss, COMPILE_BACKEND)
        self.stop_requested = False
        self.session_start: float | None = None  # perf_counter() when run() began
        # the learning rate the last train_step gave the optimizer (what is logged)
        self.lr: float | None = None

    def elapsed_s(self) -> float:
        """Wall time of the run so far, over every session of it (what --max-time counts)."""
        now = time.perf_counter() - self.session_start if self.session_start is not None else 0.0
        return self.elapsed_before + now

    def time_is_up(self) -> bool:
        return self.cfg.max_time is not None and self.elapsed_s() >= self.cfg.max_time

    # Setup
    # ------------------------------------------------------------------------------------------
    def _check_out_dir(
        self, resume: bool | str, overwrite: bool, checkpoint: Checkpoint | None
    ) -> tuple[Checkpoint | None, dict | None]:
        if self.out.exists() and not self.out.is_dir():
            raise UserError(f"--out {self.out}: a file, not a folder; give a directory for the run")
        if resume and checkpoint is None:
            checkpoint = find_checkpoint(
                self.out, required=resume != "auto", announce=self.dist.is_main
            )
        if checkpoint is not None:
            state_path = checkpoint.path / STATE_FILE
            try:
                state = torch.load(state_path, map_location="cpu", weights_only=True)
            except Exception as exc:  # torch raises several types for a torn or foreign file
                raise UserError(
                    f"--resume: {state_path} is not a readable checkpoint "
                    f"({str(exc).splitlines()[0]}); "
                    "it may be corrupt: start fresh with --overwrite"
                ) from None
            finished = self._finished_at(state)
            # an elastic restart after the end: nothing to do
            if finished is not None and resume == "auto":
                raise RunComplete(self.out, state["iter"], finished[0])
            if finished is not None:
                why, flag = finished
                raise UserError(
                    f"--resume: the run in {self.out} {why}; raise {flag} to train further"
                )
            return checkpoint, state
        if has_checkpoint(self.out) and not overwrite and resume != "auto":
            raise UserError(
                f"{self.out} already holds a training checkpoint; continue it with --resume, "
                "start over with --overwrite, or choose another --out"
            )
        if self.dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            if overwrite:
                remove_checkpoints(self.out)
            (self.out / METRICS_FILE).unlink(missing_ok=True)
            # a fresh run's slider must not show an older run
            for path in list_snapshots(self.out).values():
                path.unlink()
        self._barrier()  # no rank looks at the folder before rank 0 has cleared it
        return None, None

    def _finished_at(self, state: dict[str, Any]) -> tuple[str, str] | None:
        """Why a checkpoint's run is over (its step count or time budget reached) and the flag that
        would take it further, or None if it is not over."""
        if state["iter"] >= self.cfg.max_iters:
            return (
                f"is at step {state['iter']} and --max-iters is {self.cfg.max_iters}",
                "--max-iters",
            )
        if self.cfg.max_time is not None and state["elapsed_s"] >= self.cfg.max_time:
            return (
                f"has trained {state['elapsed_s']:.1f} s and --max-time is {self.cfg.max_time:g}",
                "--max-time",
            )
        return None

    def _prepare_data(self, checkpoint: Checkpoint | None) -> tuple[Tokenizer, TokenData]:
        cfg = self.cfg
        saved_tokenizer = self.out / "tokenizer.json"
        tokenizer = (
            Tokenizer.from_file(checkpoint.path / "tokenizer.json")
            if checkpoint is not None
            else None
        )
        if self.dist.is_main:
            tokenizer, data = prepare_data(
                cfg.data, cfg.tokenizer, cfg.vocab_size, self.out, tokenizer
            )
            atomic_write(saved_tokenizer, tokenizer.save)
        self._barrier()
        # rank 0 wrote the tokenizer and token file; read them, never rewrite
        if not self.dist.is_main:
            tokenizer = Tokenizer.from_file(saved_tokenizer)
            data = TokenData.open(self.out)
        return tokenizer, data

    def _check_same_model(self, state: dict[str, Any]) -> None:
        saved = state["model_config"]
        now = self.model_config.to_dict()
        differ = [k for k in now if k != "extra" and saved.get(k) != now[k]]
        if differ:
            shown = ", ".join(
                f"--{flag_name(FLAG_OF_MODEL_FIELD.get(k, k))} {saved.get(k)} -> {now[k]}"
                for k in differ[:4]
            )
            raise UserError(
                f"--resume: the checkpoint in {self.out} has a different model shape ({shown}); "
                "resume with the checkpoint's settings, or train the new shape into another --out"
            )

    def _newton_schulz(self) -> NewtonSchulzChoice:
        """newton_schulz_dtype's choice, made by rank 0 and given to every rank: replicas whose
        updates were rounded differently would drift apart."""
        choice = newton_schulz_dtype(self.cfg, self.device) if self.dist.is_main else None
        if self.dist.enabled:
            import torch.distributed as dist

            shared = [choice]
            dist.broadcast_object_list(shared, src=0)
            choice = shared[0]
        return choice

    def _barrier(self) -> None:
        if self.dist.enabled:
            import torch.distributed as dist

            dist.barrier()

    # One step
    # ---------------------------------------------------------------------------------------
    def _autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def _batches(self, split: str, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data.get_batch(split, offsets, self.cfg.block_size)
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(
                self.device, non_blocking=True
            )
        return x.to(self.device), y.to(self.device)

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The training loss of one micro-batch. Compiled, the token-id range check (a host read) is
        left
        out of the graph: the ids come from the run's own tokenizer, so they are in range by
        construction."""
        return next_token_loss(self.model(x, check_inputs=not self.cfg.compile), y)

    def micro_batches(self, it: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (x, y) micro-batches of step `it`, gathered one at a time as the step asks
        for them."""
        cfg, rank, world = self.cfg, self.dist.rank, self.dist.world
        # same windows on every rank
        generator = torch.Generator().manual_seed(_step_seed(cfg.seed, it, -1))
        offsets = self.data.sample_offsets(
            "train", self.accum_total * cfg.batch_size, cfg.block_size, generator, cfg.window_stride
        )
        # (accum, B): this rank's rows
        offsets = offsets.view(self.accum_total, cfg.batch_size)[rank::world]
        for rows in offsets:
            yield self._batches("train", rows)

    def train_step(self, it: int) -> float:
        """One optimizer step at step `it`; returns the mean training loss over the global batch.
        The learning rate it sets is kept in `self.lr`: under --max-time it depends on the time the
        step starts, so the log must report this value, not one recomputed later."""
        cfg, world = self.cfg, self.dist.world
        torch.manual_seed(_step_seed(cfg.seed, it, self.dist.rank))  # this step's dropout masks
        self.lr = learning_rate_at(it, cfg, self.elapsed_s())
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        total = torch.zeros((), device=self.device)
        for micro, (x, y) in enumerate(self.micro_batches(it)):
            last = micro == self.accum - 1
            sync = (
                contextlib.nullcontext() if last or not self.dist.enabled else self.model.no_sync()
            )
            with sync:
                with self._autocast():
                    loss = self.loss_fn(x, y) / self.accum
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            total += loss.detach()
        flags = torch.stack([total, torch.tensor(float(self.stop_requested), device=self.device)])
        if self.dist.enabled:  # the global mean loss, and whether any rank saw Ctrl-C
            import torch.distributed as dist

            dist.all_reduce(flags)
            flags[0] /= world
        loss_value, self.stop_requested = float(flags[0]), bool(flags[1] > 0)
        if not math.isfinite(loss_value):
            self.optimizer.zero_grad(set_to_none=True)
            return loss_value
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), cfg.grad_clip, foreach=True)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_value

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss over the same eval_iters batches of each split (shared out over the ranks)."""
        cfg = self.cfg
        self.raw_model.eval()
        losses = {}
        for index, split in enumerate(("train", "val")):
            generator = torch.Generator().manual_seed(cfg.seed + _EVAL_SEED_OFFSET + index)
            offsets = self.data.sample_offsets(
                split, cfg.eval_iters * cfg.batch_size, cfg.block_size, generator, cfg.window_stride
            )
            offsets = offsets.view(cfg.eval_iters, cfg.batch_size)
            total = torch.zeros((), device=self.device, dtype=torch.float64)
            for k in range(self.dist.rank, cfg.eval_iters, self.dist.world):
                x, y = self._batches(split, offsets[k])
                # the evaluation's passes in the C kernels' layers (inference_layers)
                with self._autocast(), inference_layers(self.raw_model, x):
                    total += next_token_loss(self.raw_model(x), y).double()
            if self.dist.enabled:
                import torch.distributed as dist

                dist.all_reduce(total)
            losses[split] = float(total) / cfg.eval_iters
        self.raw_model.train()
        return losses

    def full_val_loss(self, batch_size: int = 64) -> float:
        """The loss over the whole validation split, every token once (whole_split_loss)."""
        with self._autocast():
            loss = whole_split_loss(
                self.raw_model, self.data.split("val"), self.cfg.block_size, batch_size
            )
        self.raw_model.train()
        return loss

    # Files
    # ------------------------------------------------------------------------------------------
    def save_checkpoint(self, elapsed_s: float) -> None:
        """One checkpoint folder (train_state.pt for --resume, the native model for sampling,
        train.json), committed whole by attnlab.training.checkpoint.write_checkpoint. Rank 0
        only."""
        if self.dist.is_main:
            state = {
                # the data position and RNG state: step `iter` is seeded from (seed, iter)
                "iter": self.iter,
                "elapsed_s": elapsed_s,
                "model": self.raw_model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": {
                    "name": f"warmup_{self.cfg.schedule}",
                    "iter": self.iter,
                    "elapsed_s": elapsed_s,
                    "warmup_iters": self.cfg.warmup_iters,
                    "decay_iters": self.cfg.decay_iters,
                    "max_time": self.cfg.max_time,
                    "cooldown_fraction": self.cfg.cooldown_fraction,
                    "learning_rate": self.cfg.learning_rate,
                    "min_lr": self.cfg.min_lr,
                },
                "grad_scaler": self.scaler.state_dict() if self.scaler is not None else {},
                "model_config": self.model_config.to_dict(),
                "train_config": self.cfg.to_dict(),
            }

            def write(files: ManifestFolder) -> None:
                files.write(STATE_FILE, state_bytes(state))
                save_native(self.raw_model, files)
                files.write(
                    TRAIN_JSON,
                    json.dumps({"iter": self.iter, "config": self.cfg.to_dict()}, indent=2) + "\n",
                )

            write_checkpoint(self.out, self.iter, write)
        self.last_saved = self.iter

    def _log_metrics(self, record: dict[str, Any]) -> None:
        if self.dist.is_main:
            with open(self.out / METRICS_FILE, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def _trim_metrics(self) -> None:
        """On resume, forget evaluations after the checkpoint (a killed run may have logged past
        it)."""
        path = self.out / METRICS_FILE
        if self.dist.is_main and path.is_file():
            kept = [
                line
                for line in path.read_text().splitlines()
                if line.strip() and json.loads(line)["iter"] <= self.iter
            ]
            atomic_write_text(path, "".join(line + "\n" for line in kept))

    # The loop
    # ---------------------------------------------------------------------------------------
    def _kept(self) -> str:
        if self.last_saved is None:
            return "no checkpoint had been saved yet"
        return f"the last good checkpoint (step {self.last_saved}) is kept in {self.out}"

    def _on_sigint(self, signum, frame) -> None:
        if self.stop_requested:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.stop_requested = True

    def _snapshot(self) -> None:
        save_snapshot(self.raw_model, self.out, self.iter)
        if self.on_snapshot is not None:
            self.on_snapshot(self.iter, self.raw_model)

    def run(self) -> TrainResult:
        cfg = self.cfg
        result = TrainResult(out=self.out, iters=self.iter)
        self._trim_metrics()
        previous_handler = None
        if threading.current_thread() is threading.main_thread():
            previous_handler = signal.signal(signal.SIGINT, self._on_sigint)
        from tqdm.auto import tqdm

        bar = tqdm(
            total=cfg.max_iters,
            initial=self.iter,
            disable=not (self.progress and self.dist.is_main),
            unit="it",
            dynamic_ncols=True,
            file=sys.stderr,
            desc="train",
        )
        tokens_per_step = self.accum_total * cfg.batch_size * cfg.block_size
        self.session_start, cpu_start = time.perf_counter(), time.process_time()
        step_time, steps = 0.0, 0
        snapshot_at = (
            set(snapshot_steps(cfg.max_iters, cfg.snapshots)) if self.dist.is_main else set()
        )
        if self.iter in snapshot_at:  # step 0: the initial weights
            self._snapshot()
        self.raw_model.train()
        reached = (
            first_reaching(read_metrics(self.out), cfg.target_loss) if self.dist.is_main else None
        )
        last = self.iter >= cfg.max_iters or self.time_is_up()
        try:
            while not last:
                if self.stop_requested:
                    result.interrupted = True
                    break
                t0 = time.perf_counter()
                loss = self.train_step(self.iter)
                if not math.isfinite(loss):
                    raise UserError(
                        f"the training loss became {loss} at step {self.iter + 1}; stopped, and "
                        f"{self._kept()}; lower --learning-rate or raise --warmup-iters, then "
                        "--resume"
                    )
                step_time += time.perf_counter() - t0
                steps += 1
                self.iter += 1
                result.losses[self.iter] = loss
                if self.iter in snapshot_at:
                    self._snapshot()
                tokens_per_s = steps * tokens_per_step / step_time
                bar.update(1)
                last = self.iter == cfg.max_iters or self.time_is_up()
                if steps % 10 == 1 or last:
                    bar.set_postfix(
                        loss=f"{loss:.4f}",
                        lr=f"{self.lr:.2e}",
                        tok_s=f"{tokens_per_s:,.0f}",
                        refresh=False,
                    )
                if self.iter % cfg.eval_interval == 0 or last:
                    losses = self.evaluate()
                    if last and self.dist.is_main:  # the run's result: every validation token, once
                        losses["val_full"] = self.full_val_loss()
                    elapsed = self.elapsed_s()
                    result.train_loss, result.val_loss = losses["train"], losses["val"]
                    result.val_loss_full = losses.get("val_full")
                    if not all(math.isfinite(v) for v in losses.values()):
                        raise UserError(
                            f"the evaluation loss became {losses} at step {self.iter}; stopped "
                            "without "
                            f"saving, and {self._kept()}; lower --learning-rate, then --resume"
                        )
                    record = {
                        "iter": self.iter,
                        "train_loss": losses["train"],
                        "val_loss": losses["val"],
                        "lr": self.lr,
                        "tokens_per_s": tokens_per_s,
                        "tokens": self.iter * tokens_per_step,
                        "elapsed_s": elapsed,
                        # CPU seconds of this process (all its threads), this session: on a
                        # crowded machine it says what the run cost when the wall time cannot
                        "cpu_s": time.process_time() - cpu_start,
                    }
                    if "val_full" in losses:
                        record["val_loss_full"] = losses["val_full"]
                    if reached is None and first_reaching([record], cfg.target_loss) is not None:
                        # the first evaluation at or below --target-loss, with its time
                        reached = record
                        record.update(target_loss=cfg.target_loss, target_reached_s=elapsed)
                    self._log_metrics(record)
                    self.save_checkpoint(elapsed)
                    if self.progress and self.evaluation_lines and self.dist.is_main:
                        full = (
                            f", whole val split {losses['val_full']:.4f}"
                            if "val_full" in losses
                            else ""
                        )
                        bar.write(
                            f"step {self.iter}: train loss {losses['train']:.4f}, val loss "
                            f"{losses['val']:.4f}{full}",
                            file=sys.stderr,
                        )
            if result.interrupted and self.last_saved != self.iter:
                self.save_checkpoint(self.elapsed_s())
        finally:
            bar.close()
            if previous_handler is not None:
                signal.signal(signal.SIGINT, previous_handler)
        result.iters = self.iter
        result.tokens_per_s = steps * tokens_per_step / step_time if step_time else 0.0
        result.elapsed_s = self.elapsed_s()
        if self.dist.is_main:
            write_loss_plot(self.out)
            write_report(self, result)
        return result


def train(
    cfg: TrainConfig,
    *,
    resume: bool | str = False,
    overwrite: bool = False,
    progress: bool = True,
    checkpoint: Checkpoint | None = None,
) -> TrainResult:
    """Train as `cfg` says, into cfg.out; see Trainer. Under torchrun, leaves the process group when
    done."""
    finished = False
    try:
        result = Trainer(
            cfg, resume=resume, overwrite=overwrite, progress=progress, checkpoint=checkpoint
        ).run()
        finished = True
        return result
    except RunComplete as done:
        records = read_metrics(done.out)
        return TrainResult(
            out=done.out,
            iters=done.step,
            complete=str(done),
            val_loss=records[-1]["val_loss"] if records else None,
        )
    finally:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                if finished:
                    # every rank tears down together: a rank that destroyed its group while rank 0
                    # was still writing the last checkpoint aborted in gloo's threads ("terminate
                    # called without an active exception", exit -6) now and then
                    dist.barrier()
                dist.destroy_process_group()


@torch.no_grad()
def whole_split_loss(
    model: torch.nn.Module, tokens, block_size: int, batch_size: int = 64
) -> float:
    """Mean next-token loss over a whole token split, every token scored once (all but the first,
    which nothing precedes): the split cut into consecutive block_size windows, the last one
    shorter. Unlike the eval_iters random batches of Trainer.evaluate (standard error ~0.01 at
    nanoGPT's 20 x 12 x 64), it has no sampling noise. Leaves the model in eval mode."""
    val = torch.from_numpy(tokens.astype("int64"))
    device = next(model.parameters()).device
    T, n = block_size, len(val) - 1  # n tokens to predict
    rows = n // T
    # (windows, T), y shifted by one
    x, y = val[: rows * T].view(rows, T), val[1 : rows * T + 1].view(rows, T)
    batches = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, rows, batch_size)]
    if n % T:  # the last, shorter window
        batches.append((val[rows * T : -1][None], val[rows * T + 1 :][None]))
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    for x, y in batches:
        x = x.to(device)
        with inference_layers(model, x):  # in the C kernels' layers
            total += next_token_loss(model(x), y.to(device), reduction="sum").double().cpu()
    return float(total) / n
