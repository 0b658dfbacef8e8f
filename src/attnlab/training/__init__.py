"""Training GPT-style models on text, and sampling from them.

- config.py: TrainConfig (nanoGPT's names), presets, the generated command-line flags.
- data.py: text -> tokenizer -> memory-mapped token file -> random batches.
- trainer.py: the loop (AdamW, warmup + cosine, accumulation, evaluation, atomic checkpoints, DDP).
- cli.py: `attnlab train` and `attnlab sample`.
"""

from .config import TRAIN_PRESETS, TrainConfig, build_config
from .report import TrainResult
from .trainer import train

__all__ = ["TRAIN_PRESETS", "TrainConfig", "TrainResult", "build_config", "train"]
