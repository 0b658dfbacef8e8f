"""Random tiny Hugging Face models as the format tests build them (tests/test_formats_hf.py,
tests/test_formats_moe.py): transformers' init, then every norm weight moved away from 1 and every
bias away from 0, so that a mapping mistake shows in the outputs, saved with save_pretrained.
"""

from __future__ import annotations

import torch


def perturb(model):
    """Move every norm weight away from 1 and every bias away from 0 (N(0, 0.3) added), so that a
    mapping mistake shows; the model in eval mode."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or "ln" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def save_random(model, directory, **save_kwargs):
    """`model` perturbed and saved into `directory` (save_pretrained's `save_kwargs`: shards)."""
    perturb(model).save_pretrained(directory, **save_kwargs)
    return model
