"""Hook points: named places in the forward pass where an activation can be read or replaced.

Design choices:
- As in TransformerLens, a hook point is an identity module, and its name is its module path
  (`blocks.0.attn.hook_pattern`), so the names need no table and can never drift from the code.
- Hooks are plain torch forward hooks on those modules: a hook function gets `(activation, hook)`
  and
  returns None (read) or a tensor (replace). `hook.name` is the full name.
- `HookedModule` gives any module `hooks(...)`, `run_with_hooks` and `run_with_cache`; with no hook
  attached, nothing but an identity call happens at each point.
- An unknown name raises a UserError that suggests the nearest valid names.
- A hook point made with `on_demand=True` (attention's `hook_result`) is computed only when hooked,
  so `run_with_cache()` without a names_filter leaves it out, unless
  `model.set_use_attn_result(True)` (TransformerLens's switch); naming it in names_filter always
  caches it.
- The cache is attnlab.lens.cache.ActivationCache (TransformerLens's keys and residual-stream
  views). Its hooks run after every hook the caller attached, so it holds what flows on, edits
  included.
- A hook function marked with `reads` (run_with_cache's store) promises to return None and edit
  nothing; where every hook at a point is so marked (`HookPoint.only_read`), the fast layers may
  compute the steps after it in the same C call before calling the hooks (the attention's scores,
  pattern and z; SwiGLU's gate and product), with the same values. Any other hook keeps the steps
  apart, so an edit always flows on.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Union

import torch
from torch import nn

from ..errors import UserError
from ..memory import recycled
from .cache import ActivationCache

HookFn = Callable[[torch.Tensor, "HookPoint"], Union[torch.Tensor, None]]
NamesFilter = Union[None, str, Iterable[str], Callable[[str], bool]]


class HookPoint(nn.Module):
    """An identity function with a name, at which hooks read or replace the activation."""

    def __init__(self, on_demand: bool = False) -> None:
        super().__init__()
        self.name: str = ""  # set by HookedModule.setup_hooks to the module path
        # computed only when hooked: run_with_cache() leaves it out unless named
        self.on_demand = on_demand

    @property
    def has_hooks(self) -> bool:
        return bool(self._forward_hooks)

    @property
    def only_read(self) -> bool:
        """Whether every hook here only reads (marked with `reads`, as run_with_cache's store):
        a fast path may then compute past this point before calling them."""
        return all(getattr(hook, "reads_only", False) for hook in self._forward_hooks.values())

    def add_hook(self, fn: HookFn) -> torch.utils.hooks.RemovableHandle:
        def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
            return fn(output, module)

        hook.reads_only = getattr(fn, "reads_only", False)  # type: ignore[attr-defined]
        return self.register_forward_hook(hook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return self.name


def reads(fn: HookFn) -> HookFn:
    """Mark a hook function that only reads its activation: returns None and changes nothing in
    it or elsewhere in the model. Where every hook at a point is so marked, a fused kernel may
    compute the steps after that point before calling them (the attention's scores, pattern and z
    in one pass under run_with_cache); the values they see are the same."""
    fn.reads_only = True  # type: ignore[attr-defined]
    return fn


def _matcher(names_filter: NamesFilter) -> Callable[[str], bool]:
    if names_filter is None:
        return lambda name: True
    if isinstance(names_filter, str):
        return lambda name: name == names_filter
    if callable(names_filter):
        return names_filter
    wanted = set(names_filter)
    return lambda name: name in wanted


class HookedModule(nn.Module):
    """Base for models with hook points: names them and runs with hooks or a cache."""

    # TransformerLens's switch: cache every on-demand hook (hook_result) by default
    use_attn_result = False

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Whether `run_with_cache()` caches `blocks.L.attn.hook_result` (each head's output in
        d_model), which is otherwise computed only when named: TransformerLens's switch."""
        self.use_attn_result = use_attn_result

    def setup_hooks(self) -> None:
        """Name every HookPoint by its module path; call at the end of the root module's
        `__init__`."""
        self.hook_dict: dict[str, HookPoint] = {}
        for name, module in self.named_modules():
            if isinstance(module, HookPoint):
                module.name = name
                self.hook_dict[name] = module

    def hook_names(self) -> list[str]:
        return list(self.hook_dict)

    def _resolve(self, name: str) -> HookPoint:
        if name in self.hook_dict:
            return self.hook_dict[name]
        close = difflib.get_close_matches(name, self.hook_dict, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see model.hook_names()"
        raise UserError(f"unknown hook name {name!r}{hint}")

    def check_names(self, names_filter: NamesFilter) -> None:
        """Raise on explicit names that don't exist (callables are not checked)."""
        if isinstance(names_filter, str):
            self._resolve(names_filter)
        elif names_filter is not None and not callable(names_filter):
            for name in names_filter:
                self._resolve(name)

    @contextlib.contextmanager
    def hooks(
        self, fwd_hooks: Iterable[tuple[str | Callable[[str], bool], HookFn]] = ()
    ) -> Iterator["HookedModule"]:
        """Attach `(name or name-predicate, fn)` hooks for the duration of a `with` block."""
        handles = []
        try:
            for name, fn in fwd_hooks:
                if callable(name):
                    points = [p for n, p in self.hook_dict.items() if name(n)]
                else:
                    points = [self._resolve(name)]
                handles += [p.add_hook(fn) for p in points]
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def run_with_hooks(
        self, *args: Any, fwd_hooks: Iterable[tuple[str, HookFn]] = (), **kwargs: Any
    ) -> Any:
        """Run forward with hooks attached; they are removed afterwards, even on error."""
        with self.hooks(fwd_hooks):
            return self(*args, **kwargs)

    def run_with_cache(
        self,
        *args: Any,
        names_filter: NamesFilter = None,
        fwd_hooks: Iterable[tuple[str, HookFn]] = (),
        **kwargs: Any,
    ) -> tuple[Any, ActivationCache]:
        """Run forward and return `(output, cache)`; the cache holds only the names that
        `names_filter` asks for."""
        self.check_names(names_filter)
        match = _matcher(names_filter)
        if names_filter is None and not self.use_attn_result:
            match = lambda name: not self.hook_dict[name].on_demand  # noqa: E731
        cache: dict[str, torch.Tensor] = {}

        @reads
        def store(tensor: torch.Tensor, hook: HookPoint) -> None:
            cache[hook.name] = tensor.detach()

        hooks = [(name, store) for name in self.hook_dict if match(name)]
        # the caller's hooks first, so an activation one of them edits is cached as edited (what
        # flows on), as TransformerLens caches it; the cache written on the pages of the last one
        # dropped (attnlab.memory)
        with recycled():
            output = self.run_with_hooks(*args, fwd_hooks=[*fwd_hooks, *hooks], **kwargs)
        return output, ActivationCache(cache, self)
