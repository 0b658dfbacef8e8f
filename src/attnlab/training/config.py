"""The training config: one frozen dataclass, from which the command-line flags are generated.

Design choices:
- Field names are nanoGPT's (n_layer, n_embd, block_size, learning_rate, ...), so a nanoGPT user's
  flags and config files move over unchanged; `--n-embd` is the field `n_embd` with `_` -> `-`. The
  flags are generated from the fields (`add_flags`), so the two cannot drift.
- The model fields map onto attnlab.model.config.ModelConfig through MODEL_FIELDS (n_embd ->
  d_model, n_head -> n_heads, block_size -> n_ctx, pos -> positional, ...); the test suite checks
  that every target exists.
- Sources are layered: defaults < `--preset NAME` < `--config FILE` (TOML or JSON, same keys, `-` or
  `_`) < flags given on the command line. Only flags the user typed override (argparse.SUPPRESS
  defaults).
- The defaults are nanoGPT's documented CPU run (its README's "baby GPT on a MacBook"); the data
  default is the built-in corpus (attnlab.data), so `attnlab train` with no flags works offline.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..model.config import MLPS, NORMS, POSITIONS, PRESETS, ROPE_SCALINGS, ModelConfig, field_types

DTYPES = ("auto", "float32", "bfloat16", "float16")
TOKENIZERS = ("char", "bpe")
OPTIMIZERS = ("adamw", "muon")
MUON_DTYPES = ("auto", "bfloat16", "float32")
SCHEDULES = ("cosine", "wsd")


def _opt(
    default: Any, help: str, choices: tuple[str, ...] | None = None, group: str = "training"
) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "group": group})


@dataclass(frozen=True)
class TrainConfig:
    """One training run's settings, each field an `attnlab train` flag (nanoGPT's names) with its
    help beside it; `build_config` makes one from the defaults, a preset, a config file and
    flags. The command reference lists every flag."""

    # data and output
    data: str | None = _opt(
        None, "a text file or a folder of .txt files (default: the built-in corpus)", group="data"
    )
    tokenizer: str = _opt(
        "char", "character tokens, or byte-level BPE trained on the data", TOKENIZERS, "data"
    )
    vocab_size: int = _opt(2048, "BPE vocabulary size (with --tokenizer bpe)", group="data")
    out: str = _opt(
        "runs/train",
        "directory for the checkpoint, metrics.jsonl, loss.png and report.md",
        group="data",
    )
    window_stride: int = _opt(
        1,
        "start training windows only at multiples of this many tokens (data made of "
        "sequences of that length, e.g. the induction experiment's)",
        group="data",
    )
    snapshots: int = _opt(
        0,
        "keep this many evenly spaced float16 copies of the weights (step 0 to the end) in "
        "OUT/snapshots, "
        "for the explorer's step slider",
        group="data",
    )
    # model (nanoGPT's names; MODEL_FIELDS maps them onto ModelConfig)
    n_layer: int = _opt(4, "number of blocks (n_layers)", group="model")
    n_head: int = _opt(4, "attention heads per layer (n_heads)", group="model")
    n_embd: int = _opt(128, "width of the residual stream (d_model)", group="model")
    block_size: int = _opt(64, "context length trained on (n_ctx)", group="model")
    n_kv_head: int | None = _opt(
        None, "key/value heads: 1 = multi-query, < n_head = grouped-query", group="model"
    )
    d_mlp: int | None = _opt(None, "hidden width of the MLP (default 4 x n_embd)", group="model")
    pos: str = _opt("learned", "position encoding", POSITIONS, "model")
    norm: str = _opt("layernorm", "normalisation", NORMS, "model")
    mlp: str = _opt("gelu", "MLP activation", MLPS, "model")
    bias: bool = _opt(True, "biases in linear layers and norms", group="model")
    attn_only: bool = _opt(
        False, "no MLPs (attention-only models for circuit studies)", group="model"
    )
    sliding_window: int | None = _opt(
        None,
        "each token attends to itself and the N - 1 before it (Mistral); default: all",
        group="model",
    )
    rope_scaling: str = _opt(
        "none", "RoPE context extension (with --pos rope): linear or llama3", ROPE_SCALINGS, "model"
    )
    rope_scaling_factor: float = _opt(1.0, "factor of --rope-scaling", group="model")
    dropout: float = _opt(
        0.0, "dropout on embeddings, attention weights and residual branches", group="model"
    )
    qk_norm: bool = _opt(
        False, "RMSNorm on each head's queries and keys before the scores", group="model"
    )
    tie_embeddings: bool = _opt(
        True, "the LM head shares the token embedding's weight", group="model"
    )
    logit_softcap: float | None = _opt(
        None, "cap the logits smoothly at +-X: X*tanh(logits/X) (default: no cap)", group="model"
    )
    zero_init_projections: bool = _opt(
        False, "W_O and W_out start at zero: every block starts as the identity", group="model"
    )
    # optimisation
    optimizer: str = _opt(
        "adamw",
        "adamw for every weight, or muon for the blocks' matrices and adamw for the rest",
        OPTIMIZERS,
    )
    muon_ns_steps: int = _opt(
        5, "with --optimizer muon: Newton-Schulz iterations that orthogonalise each update"
    )
    muon_dtype: str = _opt(
        "auto",
        "with --optimizer muon: the dtype of the Newton-Schulz products; auto = bfloat16 where "
        "torch's bfloat16 products are at least as fast as float32's on this machine (measured "
        "once; attnlab doctor), else float32",
        MUON_DTYPES,
    )
    schedule: str = _opt(
        "cosine",
        "learning rate after warm-up: cosine decay, or wsd (stable, then a linear cool-down)",
        SCHEDULES,
    )
    cooldown_fraction: float = _opt(
        0.4, "with --schedule wsd: the last fraction of the run, decaying linearly to min_lr"
    )
    max_time: float | None = _opt(
        None,
        "stop after this many seconds of training, the schedule running on elapsed time "
        "instead of steps (default: none; --max-iters still caps the steps)",
    )
    batch_size: int = _opt(12, "sequences per micro-batch, per process")
    gradient_accumulation_steps: int | None = _opt(
        None,
        "micro-batches per optimizer step, over all processes together (default: one per process)",
    )
    max_iters: int = _opt(2000, "optimizer steps in total")
    learning_rate: float = _opt(1e-3, "peak learning rate")
    min_lr: float = _opt(1e-4, "learning rate at the end of the cosine decay")
    warmup_iters: int = _opt(100, "linear warmup steps")
    lr_decay_iters: int | None = _opt(
        None, "step at which the cosine reaches min_lr (default: max_iters)"
    )
    weight_decay: float = _opt(0.1, "AdamW weight decay, on weight matrices and embeddings only")
    beta1: float = _opt(0.9, "AdamW beta1")
    beta2: float = _opt(0.99, "AdamW beta2")
    grad_clip: float = _opt(1.0, "clip the gradient norm to this (0 = off)")
    eval_interval: int = _opt(
        250, "evaluate train/val loss and save a checkpoint every this many steps"
    )
    eval_iters: int = _opt(20, "batches per evaluation")
    target_loss: float | None = _opt(
        None, "record the elapsed time at which the val loss first reaches this (default: none)"
    )
    seed: int = _opt(1337, "seed of the initial weights, the batches and dropout")
    device: str = _opt(
        "auto", "auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps", group="system"
    )
    dtype: str = _opt(
        "auto",
        "autocast dtype: auto = bfloat16 on a GPU that has it, else float32",
        DTYPES,
        "system",
    )
    compile: bool = _opt(
        False,
        "torch.compile the forward pass and loss as one graph (compiled before the first step)",
        group="system",
    )

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "n_layer",
            "n_head",
            "n_embd",
            "block_size",
            "batch_size",
            "gradient_accumulation_steps",
            "max_iters",
            "eval_interval",
            "eval_iters",
            "window_stride",
            "muon_ns_steps",
        ):
            value = getattr(self, name)
            if value is None and name == "gradient_accumulation_steps":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UserError(f"--{flag_name(name)} must be a positive integer, got {value!r}")
        for name in (
            "snapshots",
            "warmup_iters",
            "seed",
            "learning_rate",
            "min_lr",
            "weight_decay",
            "grad_clip",
        ):
            if getattr(self, name) < 0:
                raise UserError(f"--{flag_name(name)} must be >= 0, got {getattr(self, name)}")
        if self.lr_decay_iters is not None and self.lr_decay_iters <= 0:
            raise UserError(
                f"--lr-decay-iters must be a positive integer, got {self.lr_decay_iters}"
            )
        if self.max_time is not None and not self.max_time > 0:
            raise UserError(f"--max-time must be a positive number of seconds, got {self.max_time}")
        if not 0 <= self.cooldown_fraction <= 1:
            raise UserError(f"--cooldown-fraction must be in [0, 1], got {self.cooldown_fraction}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise UserError(f"--{name} must be in [0, 1), got {getattr(self, name)}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise UserError(
                    f"--{flag_name(f.name)} must be one of {', '.join(choices)}; got "
                    f"{getattr(self, f.name)!r}"
                )
        try:
            self.model_config(d_vocab=1)
        except UserError as exc:
            raise UserError(
                f"{exc} (--n-embd is d_model, --n-head is n_heads, --n-kv-head is n_kv_heads)"
            ) from None

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters if self.lr_decay_iters is not None else self.max_iters

    def model_config(self, d_vocab: int) -> ModelConfig:
        """The ModelConfig these flags describe (pre-norm, as nanoGPT)."""
        return ModelConfig(
            d_vocab=d_vocab,
            **{target: getattr(self, name) for name, target in MODEL_FIELDS.items()},
        )

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# nanoGPT's name -> ModelConfig field
MODEL_FIELDS = {
    "n_layer": "n_layers",
    "n_head": "n_heads",
    "n_embd": "d_model",
    "block_size": "n_ctx",
    "n_kv_head": "n_kv_heads",
    "d_mlp": "d_mlp",
    "pos": "positional",
    "norm": "norm",
    "mlp": "mlp",
    "bias": "bias",
    "attn_only": "attn_only",
    "dropout": "dropout",
    "sliding_window": "sliding_window",
    "rope_scaling": "rope_scaling",
    "rope_scaling_factor": "rope_scaling_factor",
    "qk_norm": "qk_norm",
    "tie_embeddings": "tie_embeddings",
    "logit_softcap": "logit_softcap",
    "zero_init_projections": "zero_init_projections",
}
FLAG_OF_MODEL_FIELD = {target: name for name, target in MODEL_FIELDS.items()}  # the way back


def _from_model_preset(name: str) -> dict[str, Any]:
    """A model preset of attnlab.model.config.PRESETS in training-flag names (sizes live in one
    place)."""
    fields = {k: v for k, v in PRESETS[name].items() if k != "d_vocab"}
    assert set(fields) <= set(FLAG_OF_MODEL_FIELD), (
        f"preset {name} has fields without a training flag"
    )
    return {FLAG_OF_MODEL_FIELD[k]: v for k, v in fields.items()}


# The speedrun's recipe (modded-nanogpt's parts at CPU size; what each bought: benchmarks/README.md,
# "CPU speedrun").
SPEEDRUN_RECIPE: dict[str, Any] = {
    "pos": "rope",
    "norm": "rmsnorm",
    "bias": False,
    "mlp": "relu2",
    "qk_norm": True,
    "tie_embeddings": False,
    "zero_init_projections": True,
    "logit_softcap": 30.0,
    "optimizer": "muon",
    "muon_ns_steps": 4,
    "schedule": "wsd",
    "cooldown_fraction": 0.4,
    "learning_rate": 3e-3,
    "min_lr": 0.0,
}

# Named starting points; every value can still be overridden by --config and by flags.
TRAIN_PRESETS: dict[str, dict[str, Any]] = {
    # nanoGPT's CPU run (README: "baby GPT on a MacBook"): the defaults above, spelled out.
    "nano": {
        **_from_model_preset("nano"),
        "batch_size": 12,
        "max_iters": 2000,
        "lr_decay_iters": 2000,
        "dropout": 0.0,
        "learning_rate": 1e-3,
        "min_lr": 1e-4,
        "beta2": 0.99,
        "warmup_iters": 100,
        "eval_interval": 250,
        "eval_iters": 20,
    },
    # The recommended CPU run: same budget as "nano", modern parts (benchmarks/README.md, "Training
    # quality").
    "cpu": {
        **_from_model_preset("nano"),
        "pos": "rope",
        "norm": "rmsnorm",
        "mlp": "gelu",
        "bias": False,
        "batch_size": 12,
        "max_iters": 2000,
        "learning_rate": 2e-3,
        "min_lr": 2e-4,
        "beta2": 0.99,
        "warmup_iters": 100,
        "eval_interval": 250,
        "eval_iters": 20,
    },
    # The CPU speedrun (benchmarks/README.md, "CPU speedrun"): nanoGPT's README CPU loss, reached
    # in fewer steps of a modern recipe (its time beside nanoGPT's: docs/results.md, speedrun).
    "speedrun": {
        **_from_model_preset("nano"),
        **SPEEDRUN_RECIPE,
        "batch_size": 12,
        "max_iters": 280,
        "warmup_iters": 28,
        "eval_interval": 280,
        "eval_iters": 20,
        "target_loss": 1.886,
    },
    # nanoGPT's shakespeare_char GPU run.
    "shakespeare": {
        **_from_model_preset("shakespeare"),
        "batch_size": 64,
        "max_iters": 5000,
        "lr_decay_iters": 5000,
        "dropout": 0.2,
        "learning_rate": 1e-3,
        "min_lr": 1e-4,
        "beta2": 0.99,
        "warmup_iters": 100,
        "eval_interval": 250,
        "eval_iters": 200,
    },
    # An attention-only model for induction-head studies.
    "attn-only-2l": {
        **_from_model_preset("attn-only-2l"),
        "batch_size": 16,
        "max_iters": 2000,
        "learning_rate": 1e-3,
        "eval_interval": 250,
    },
    # `attnlab demo`: the speedrun's recipe on the built-in corpus, in few steps: a short demo.
    "demo": {
        **_from_model_preset("nano"),
        **SPEEDRUN_RECIPE,
        "block_size": 128,
        "batch_size": 12,
        "max_iters": 300,
        "warmup_iters": 30,
        "eval_interval": 100,
        "eval_iters": 10,
        "out": "runs/demo",
    },
}


def flag_name(name: str) -> str:
    return name.replace("_", "-")


_METAVARS = {int: "N", float: "X", str: "NAME", "data": "PATH", "out": "DIR"}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, grouped; defaults are SUPPRESS so only typed flags
    override."""
    types = field_types(TrainConfig)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(TrainConfig):
        group = f.metadata["group"]
        if group not in groups:
            groups[group] = parser.add_argument_group(f"{group} options")
        kind = types[f.name][0]
        help_text = (
            f.metadata["help"]
            if "default:" in f.metadata["help"]
            else f"{f.metadata['help']} (default: {f.default})"
        )
        if kind is bool:
            groups[group].add_argument(
                f"--{flag_name(f.name)}",
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            groups[group].add_argument(
                f"--{flag_name(f.name)}",
                type=kind,
                choices=f.metadata["choices"],
                default=argparse.SUPPRESS,
                help=help_text,
                metavar=None if f.metadata["choices"] else _METAVARS.get(f.name, _METAVARS[kind]),
            )


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Keys and values of a TOML or JSON config file (keys as in the flags, with '-' or '_')."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--config {path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import tomllib

            data = tomllib.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise UserError(
            f"--config {path}: cannot parse it ({exc}); use TOML (key = value) or a JSON object"
        ) from None
    if not isinstance(data, dict):
        raise UserError(
            f"--config {path}: expected a table of keys and values, got {type(data).__name__}"
        )
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _check_values(values: dict[str, Any], source: str) -> dict[str, Any]:
    types = field_types(TrainConfig)
    checked = {}
    for key, value in values.items():
        if key not in types:
            close = difflib.get_close_matches(key, types, n=2)
            hint = f"; did you mean {' or '.join(flag_name(c) for c in close)}?" if close else ""
            raise UserError(f"{source}: unknown key {flag_name(key)!r}{hint}")
        kind, nullable = types[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if (
            not (value is None and nullable)
            and not isinstance(value, kind)
            or (kind is int and isinstance(value, bool))
        ):
            raise UserError(f"{source}: {flag_name(key)} must be {kind.__name__}, got {value!r}")
        checked[key] = value
    return checked


def build_config(
    preset: str | None = None,
    config_file: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    base: dict[str, Any] | None = None,
) -> TrainConfig:
    """defaults < base (a resumed run's saved config) < preset < config file < overrides (typed
    flags)."""
    values: dict[str, Any] = dict(base or {})
    if preset is not None:
        if preset not in TRAIN_PRESETS:
            raise UserError(f"unknown preset {preset!r}; choose one of {', '.join(TRAIN_PRESETS)}")
        values.update(TRAIN_PRESETS[preset])
    if config_file is not None:
        values.update(_check_values(read_config_file(config_file), f"--config {config_file}"))
    values.update(_check_values(overrides or {}, "command line"))
    return TrainConfig(**values)
