"""llama.cpp's logits as an anchor: quantized copies of a GGUF file made by llama.cpp's own
`llama-quantize`, run by llama.cpp (benchmarks/anchors/llama_logits.c on libllama) and by attnlab
on the same token ids, compared per position (top-1 agreement, KL divergence).

llama.cpp is never a dependency of attnlab: the anchor is compiled here on demand with the system's
C compiler against a llama.cpp build folder (the `bin/` with libllama.so, llama-quantize and
llama-tokenize) and the headers of its sources (include/llama.h, ggml/include/), found through the
build's CMakeCache.txt or given as the sources' folder.

Design choices:
- One decode of the whole text as one batch, float32 KV cache, flash attention off (the C file
  says why): the difference between llama.cpp's logits and attnlab's on a quantized file is then
  the file's blocks read two ways and llama.cpp's activations, which it quantizes to 8 bits (Q8_0
  for Q8_0/Q4_0/Q5_0 weights, Q8_K for the K-quants) before each quantized product. attnlab
  dequantizes the weights and multiplies float32 activations (`dequantized`); with keep_blocks=True
  its decode step multiplies the blocks in C with 8-bit activations as llama.cpp does (`blocks`,
  attnlab.generate.kernel_decoder.step_logits, one position at a time).
- The f32 file itself is a row too: its KL is the floor of the comparison (the same weights, two
  float32 programs), against which the quantized rows' KL is read.
- Per position t: top-1 agreement is whether argmax of the two logits rows is the same token, KL
  is KL(p_llama.cpp || p_attnlab) = sum_v p(v) (log p(v) - log q(v)) in float64 from the
  log-softmax of each; a format's figures are the share of positions that agree and the mean and
  max of the KL over positions.
- The text is a fixed paragraph of English prose tokenized by the file's own tokenizer
  (llama-tokenize, with the file's BOS), cut to fit the models' context.
- Bounds (BOUNDS): a quantized copy's mean KL is bounded relative to llama.cpp's own KLs, not
  absolutely: what the KL measures is 8-bit rounding of the activations (llama.cpp's; on the
  blocks' path attnlab's too), whose size is that of the weights' rounding in the Q8_0 copy and far
  below the 4-bit ones', and which scales with the model as those do (a model whose logits are
  scaled down to near uniform, Granite's and Command-R's, has them all tiny). So the KL is at most
  the format's own (llama.cpp's copy against its f32 file) and at most twice the Q8_0 copy's own
  (two 8-bit roundings; where the Q8_0 copy was compared first), the second the tighter for 4 bits.
- llama-quantize picks a fallback type for a tensor whose rows are not a whole number of its
  blocks (the K-quants' 256 values; the random models' rows are multiples of 256 so that Q4_K_M
  is Q4_K and Q6_K); what it wrote is read back from the quantized file (gguf-py's reader) and
  recorded as a count per tensor type.
- llama.cpp runs with its extra weight buffers (repacked layouts, AMX tiles) as it does by
  default; a build that dies of SIGILL or SIGSEGV with them is run again without them, and the
  row's llama_cpp_system says so (a native build's AMX tiles on this session's machine).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from _llama_cpp import quantize as run_quantize
from _llama_cpp import tokenize

ANCHOR = Path(__file__).resolve().parent / "anchors" / "llama_logits.c"
# the quantized copies compared, as llama-quantize names them
FORMATS = ("Q8_0", "Q4_0", "Q4_K_M")
# f32: (least share of positions whose top-1 agrees, largest mean KL over positions): the same
# float32 weights in two programs, apart by float32 rounding (logits within 1e-6 relative give a
# KL of that order squared). A quantized copy: (least top-1 share, largest mean KL as a multiple of
# the format's own mean KL, as a multiple of the Q8_0 copy's own): the same blocks, with the
# activations quantized to 8 bits at every product (llama.cpp's; on the blocks' path attnlab's
# too), a noise of the size of the Q8_0 copy's own weight rounding (so within the format's own KL
# for Q8_0, far within it for 4 bits); the random models' top two logits are often near a tie,
# which that noise flips (llama.cpp's own copies flip more: the record's format_cost), hence a
# top-1 bound below 1; a block read wrongly moves the KL past these
BOUNDS = {"F32": (0.99, 1e-6), "quantized": (0.8, 1.0, 2.0)}
# the text every comparison runs (Dickens, A Tale of Two Cities, 1859: public domain)
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the winter "
    "of despair, we had everything before us, we had nothing before us, we were all going direct "
    "to Heaven, we were all going direct the other way - in short, the period was so far like the "
    "present period, that some of its noisiest authorities insisted on its being received, for "
    "good or for evil, in the superlative degree of comparison only. There were a king with a "
    "large jaw and a queen with a plain face, on the throne of England; there were a king with a "
    "large jaw and a queen with a fair face, on the throne of France. In both countries it was "
    "clearer than crystal to the lords of the State preserves of loaves and fishes, that things "
    "in general were settled for ever."
)
TOKENS = 200  # the ids compared: the text's first 200 (the random models' context is 256)
THREADS = 2


class MissingBuild(Exception):
    """No llama.cpp build the anchor can be compiled against: the message says what to pass."""


@dataclass(frozen=True)
class Build:
    """A llama.cpp build: `binaries` holds libllama.so, llama-quantize and llama-tokenize;
    `includes` the folders of llama.h and ggml.h."""

    binaries: Path
    includes: tuple[Path, Path]


def _sources_of(binaries: Path) -> Path | None:
    """The sources a CMake build folder was configured from (CMakeCache.txt beside or above the
    bin folder: CMAKE_HOME_DIRECTORY)."""
    for folder in (binaries, binaries.parent):
        cache = folder / "CMakeCache.txt"
        if cache.is_file():
            for line in cache.read_text(encoding="utf-8", errors="replace").splitlines():
                if line.startswith("CMAKE_HOME_DIRECTORY:"):
                    return Path(line.split("=", 1)[1])
    return None


def find_build(binaries: str | Path | None, sources: str | Path | None = None) -> Build:
    """The build in `binaries` (or $ATTNLAB_LLAMA_CPP), with the headers of `sources` (a llama.cpp
    tree) or of the sources its CMakeCache.txt names; MissingBuild says what to pass."""
    given = binaries or os.environ.get("ATTNLAB_LLAMA_CPP")
    if not given:
        raise MissingBuild(
            "no llama.cpp build: give --bin BUILD/bin (or set ATTNLAB_LLAMA_CPP), a folder with "
            "libllama.so, llama-quantize and llama-tokenize"
        )
    folder = Path(given)
    missing = [
        name
        for name in ("libllama.so", "llama-quantize", "llama-tokenize")
        if not (folder / name).is_file()
    ]
    if missing:
        raise MissingBuild(
            f"{folder} has no {', '.join(missing)}: give --bin the bin folder of a llama.cpp build "
            "with the targets llama-quantize and llama-tokenize (libllama.so is built with them)"
        )
    for tree in (sources, _sources_of(folder)):
        if tree and (Path(tree) / "include" / "llama.h").is_file():
            return Build(folder, (Path(tree) / "include", Path(tree) / "ggml" / "include"))
    raise MissingBuild(
        f"no llama.h for the build in {folder}: give --llama-cpp the llama.cpp sources it was "
        "built from (a tree with include/llama.h and ggml/include/ggml.h)"
    )


def compile_anchor(build: Build) -> Path:
    """benchmarks/anchors/llama_logits.c compiled against `build` (cc, linked to its libllama.so
    with an rpath to it), kept in attnlab's cache under a key of the source, the headers and the
    library; the compiler's error in one line if it fails."""
    from attnlab.env import cache_root

    library = build.binaries / "libllama.so"
    key = hashlib.sha256()
    key.update(ANCHOR.read_bytes())
    key.update((build.includes[0] / "llama.h").read_bytes())
    key.update(f"{library.resolve()} {library.stat().st_mtime_ns}".encode())
    program = cache_root() / "anchors" / f"llama_logits-{key.hexdigest()[:16]}"
    if program.is_file():
        return program
    program.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CC", "cc")
    partial = program.with_suffix(f".{os.getpid()}")
    done = subprocess.run(
        [
            compiler,
            "-O2",
            "-std=c11",
            *(f"-I{folder}" for folder in build.includes),
            str(ANCHOR),
            f"-L{build.binaries}",
            "-lllama",
            f"-Wl,-rpath,{build.binaries.resolve()}",
            "-o",
            str(partial),
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        first = (done.stderr.strip().splitlines() or ["(no message)"])[0]
        raise MissingBuild(f"{compiler} could not build {ANCHOR.name} against {build}: {first}")
    partial.replace(program)
    return program


def llama_logits(program: Path, model_file: Path, ids: list[int]) -> tuple[np.ndarray, str]:
    """llama.cpp's logits (T, V) after each of `ids` on `model_file`, and how llama.cpp ran: its
    system information line, and "extra buffers off" where the build died of a signal (SIGILL,
    SIGSEGV) with its extra weight buffers and was run again without them (a native build's AMX
    tiles die so on this session's machine: llama-bench's pp512 too)."""
    with tempfile.TemporaryDirectory() as work:
        ids_file, out = Path(work) / "ids.txt", Path(work) / "logits.npy"
        ids_file.write_text(" ".join(map(str, ids)), encoding="utf-8")
        run = [str(program), str(model_file), str(ids_file), str(out), str(THREADS)]
        done = subprocess.run([*run, "1"], capture_output=True, text=True)
        how = ""
        if done.returncode in (-signal.SIGILL, -signal.SIGSEGV):
            died = signal.Signals(-done.returncode).name
            done = subprocess.run([*run, "0"], capture_output=True, text=True)
            how = f" (extra buffers off: {died} with them)"
        if done.returncode:
            raise RuntimeError(
                f"llama_logits failed on {model_file.name} (exit {done.returncode}): "
                f"{done.stderr.strip()[-2000:]}"
            )
        return np.load(out), done.stdout.strip().splitlines()[-1] + how


def text_ids(build: Build, model_file: Path, count: int = TOKENS) -> list[int]:
    """The first `count` ids of TEXT by the file's own tokenizer (llama-tokenize, with its BOS)."""
    with tempfile.TemporaryDirectory() as work:
        text_file = Path(work) / "text.txt"
        text_file.write_text(TEXT, encoding="utf-8")
        ids = tokenize(build.binaries, model_file, text_file)
    if len(ids) < count:
        raise RuntimeError(f"the text is {len(ids)} tokens long in {model_file.name}, not {count}")
    return ids[:count]


def quantize(build: Build, source: Path, target: Path, kind: str) -> dict[str, int]:
    """`llama-quantize SOURCE TARGET KIND`; the number of tensors of each type it wrote (its
    fallbacks included)."""
    from gguf import GGUFReader

    run_quantize(build.binaries, source, target, kind)
    types = Counter(tensor.tensor_type.name for tensor in GGUFReader(target).tensors)
    return dict(sorted(types.items()))


def agreement(ours: np.ndarray, theirs: np.ndarray) -> dict:
    """Top-1 agreement and KL(theirs || ours) per position of two (T, V) logits arrays: the share
    of positions whose argmax is the same, and the mean and max of the KL over positions."""
    ours64, theirs64 = ours.astype(np.float64), theirs.astype(np.float64)
    log_q = ours64 - _logsumexp(ours64)
    log_p = theirs64 - _logsumexp(theirs64)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)  # [pos]
    same = ours.argmax(-1) == theirs.argmax(-1)
    return {"top1": float(same.mean()), "kl_mean": float(kl.mean()), "kl_max": float(kl.max())}


def disagreeing_margin(ours: np.ndarray, theirs: np.ndarray) -> float:
    """The largest gap between llama.cpp's two highest logits at a position whose top-1 differs
    (0 where none does): how near a tie the positions that disagree are."""
    top_two = np.sort(theirs, -1)[:, -2:]
    margin = top_two[:, 1] - top_two[:, 0]
    differ = ours.argmax(-1) != theirs.argmax(-1)
    return float(margin[differ].max()) if differ.any() else 0.0


def _logsumexp(x: np.ndarray) -> np.ndarray:
    top = x.max(-1, keepdims=True)
    return top + np.log(np.exp(x - top).sum(-1, keepdims=True))


def within(
    kind: str, found: dict, format_kl: float | None = None, q8_0_kl: float | None = None
) -> bool:
    """Whether `found` (agreement's figures) is within kind's BOUNDS; a quantized copy's KL bounds
    are relative to `format_kl`, the format's own mean KL (None, not measured: not within), and to
    `q8_0_kl`, the Q8_0 copy's own (None, not measured in this run: that bound not applied)."""
    if kind == "F32":
        least_top1, most_kl = BOUNDS["F32"]
    elif format_kl is None:
        return False
    else:
        least_top1, of_format, of_q8_0 = BOUNDS["quantized"]
        most_kl = of_format * format_kl
        if q8_0_kl is not None:
            most_kl = min(most_kl, of_q8_0 * q8_0_kl)
    return found["top1"] >= least_top1 and found["kl_mean"] <= most_kl


def attnlab_logits(model_file: Path, ids: list[int], keep_blocks: bool) -> tuple[np.ndarray, str]:
    """attnlab's logits (T, V) on `ids`, and the path that computed them: dequantized, the model's
    forward on float32 weights; keep_blocks, the decode step on the file's blocks with 8-bit
    activations (step_logits), or the forward (which dequantizes) where that step does not cover
    the model, said in the path."""
    import torch

    import attnlab
    from attnlab.generate.kernel_decoder import KernelDecoder, step_logits

    model = attnlab.load(str(model_file), keep_blocks=keep_blocks)
    batch = torch.tensor([ids])
    with torch.no_grad():
        if not keep_blocks:
            return model(batch)[0].numpy(), "forward, float32 weights"
        reason = KernelDecoder.unsupported(model)
        if reason is None:
            return step_logits(model, batch)[0].numpy(), "C decode step on the blocks"
        return model(batch)[0].numpy(), f"forward (the C step does not run: {reason})"


def compare_formats(
    build: Build,
    program: Path,
    f32_file: Path,
    work: Path,
    formats=FORMATS,
    tokens: int = TOKENS,
    paths=("dequantized", "blocks"),
) -> list[dict]:
    """For the f32 file and each format's copy of it: what llama-quantize wrote, attnlab's
    agreement with llama.cpp (dequantized and with the blocks kept), and the format's own cost,
    llama.cpp's logits on the copy against its logits on the f32 file (what llama-perplexity
    --kl-divergence measures), the scale the agreement is read against (rows for the results
    record)."""
    ids = text_ids(build, f32_file, tokens)
    rows, f32_logits, q8_0_kl = [], None, None
    for kind in ("F32", *formats):
        path = f32_file
        row: dict = {"format": kind, "tokens": len(ids)}
        if kind != "F32":
            path = work / f"{f32_file.stem}-{kind}.gguf"
            row["tensor_types"] = quantize(build, f32_file, path, kind)
        try:
            theirs, system = llama_logits(program, path, ids)
        except RuntimeError as exc:
            rows.append({**row, "error": str(exc).splitlines()[0]})
            continue
        row["llama_cpp_system"] = system
        if kind == "F32":
            f32_logits = theirs
        elif f32_logits is not None:
            row["format_cost"] = agreement(theirs, f32_logits)
            if kind == "Q8_0":  # the size of an 8-bit rounding in this model
                q8_0_kl = row["format_cost"]["kl_mean"]
        for name, keep in (("dequantized", False), ("blocks", True)):
            if name not in paths or (kind == "F32" and keep):
                continue  # no blocks in a float file
            try:
                ours, how = attnlab_logits(path, ids, keep)
            except Exception as exc:  # a refusal (UserError) or a failure: the row says which
                row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
                continue
            found = agreement(ours, theirs)
            found["disagreeing_margin_max"] = disagreeing_margin(ours, theirs)
            cost = row.get("format_cost", {}).get("kl_mean")
            ok = within(kind, found, cost, q8_0_kl)
            row[name] = {**found, "path": how, "within_bounds": ok}
        rows.append(row)
    return rows
