"""Peak memory and time of attnlab's tools on a large GGUF file (issue 43: a 7-8B file on a 24 GB
machine), beside llama.cpp's llama-bench on the same file.

    python benchmarks/make_q4_k_m_file.py /tmp/llama8b.gguf --vocab .../ggml-vocab-llama-bpe.gguf
    python benchmarks/large_file_memory.py /tmp/llama8b.gguf --llama-cpp /tmp/lcp/build-avx512/bin
    python benchmarks/large_file_memory.py /tmp/llama8b.gguf --steps generate --update \
        --llama-cpp /tmp/lcp/build-avx512/bin    # re-time attnlab's pp/tg and llama.cpp's alone

Design choices:
- Each step runs in a process of its own (this script with --step), which loads the file and does
  that step only; its peak is the kernel's VmHWM of that process (resident memory, file pages and
  anonymous together), read at its end, and its time the step's own wall time (the load timed
  apart). So no step inherits another's pages, and the figures are what a user's process peaks at.
- Steps: load (attnlab.load as a user calls it: the memory check chooses the blocks); generate
  (a 512-token prompt and one token, an 8-token prompt and one token, then --new-tokens tokens
  from a one-token prompt: pp and tg as llama-bench counts them, the last generation moving and
  repacking the blocks); generate_chat (a chat's order, CHAT_TURNS: an 8-token prompt and 16
  tokens, then a 64-token prompt and 16 tokens: the decode step is built, the blocks moved and
  repacked, before any long prompt ran, the order in which a repack through a copy per matrix
  once left the repacked bytes resident a second time); each order's peak beside the file's size
  and the goal, the file plus GOAL_ABOVE_FILE (issue 43: load and generate within it);
  run_with_cache of a 512-token text with a names filter (every layer's residual stream, as a
  user calls it: the logits too); head_scores (attnlab.inspection.
  scores' defaults, the copying score from the weights included); patch_one_layer (layer 0's
  residual stream patched at each of 8 positions from a clean run, one forward pass of 8 rows, as
  the patching sweeps' fast path runs a layer); context (the explorer's whole-context
  view of a text of --context tokens, as POST /api/context makes it: the explorer's ContextStore
  with its budget keeps the layers that fit, then one head's overview of 1024 cells a side).
- `--update` starts from the record already in the results folder and replaces only the steps run
  (and llama.cpp's figures where --llama-cpp is given): a step can be re-timed alone. Each step
  says what measured it (`measured_by`: the command and attnlab's commit), since a record may then
  mix steps of several runs.
- The machine is shared and its load changes: the one-minute load average is written beside each
  step's figures; memory figures are the point of this benchmark, times are indications.
- llama-bench: `-p 512 -n 128 -t THREADS -o json` under /usr/bin/time -v (its peak resident set).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, command_line, write_result  # noqa: E402

STEPS = (
    "load",
    "generate",
    "generate_chat",
    "run_with_cache",
    "head_scores",
    "patch_one_layer",
    "context",
)
# generate_chat's turns: (prompt tokens, new tokens), one generate call each, in this order
CHAT_TURNS = ((8, 16), (64, 16))
# issue 43's goal for loading and generating: the file's size plus this many bytes
GOAL_ABOVE_FILE = 1.5e9


def status() -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(line.split()[1]) * 1024
    return out


def run_step(step: str, path: Path, tokens: int, context: int, new_tokens: int) -> dict:
    import torch

    import attnlab

    start = time.perf_counter()
    model = attnlab.load(path)
    figures = {"load_seconds": time.perf_counter() - start, "after_load": status()}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 100000, (1, tokens), generator=g)
    start = time.perf_counter()
    if step == "generate":
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1)
        figures["pp_seconds"] = time.perf_counter() - t0
        figures["pp_tokens"] = tokens
        figures["after_pp"] = status()
        # llama-bench's tg runs a warm-up first and times decode steps only: a one-step warm-up
        # (the decode step prepared), then new_tokens steps from a one-token prompt
        model.generate(ids[:, :8], max_new_tokens=1)
        t0 = time.perf_counter()
        model.generate(ids[:, :1], max_new_tokens=new_tokens)
        figures["tg_seconds"] = time.perf_counter() - t0
        figures["tg_tokens"] = new_tokens
    elif step == "generate_chat":
        figures["turns"] = []
        for prompt, new in CHAT_TURNS:
            t0 = time.perf_counter()
            model.generate(ids[:, :prompt], max_new_tokens=new)
            figures["turns"].append(
                {"prompt_tokens": prompt, "new_tokens": new,
                 "seconds": time.perf_counter() - t0, "after": status()}
            )  # fmt: skip
    elif step == "run_with_cache":
        with torch.no_grad():
            _, cache = model.run_with_cache(
                ids, names_filter=lambda name: name.endswith("hook_resid_post")
            )
        figures["cache_bytes"] = sum(t.numel() * t.element_size() for t in cache.values())
        figures["cache_tensors"] = len(cache)
    elif step == "head_scores":
        from attnlab.inspection.scores import head_scores

        scores = head_scores(model)
        figures["scores"] = sorted(scores.scores)
    elif step == "patch_one_layer":
        positions = 8
        clean, corrupted = ids[:, :positions], ids[:, positions : 2 * positions]
        name = "blocks.0.hook_resid_pre"
        with torch.no_grad():
            _, cache = model.run_with_cache(clean, names_filter=lambda n: n == name)
            clean_resid = cache[name]

            def patch(activation, hook):  # row p: position p from the clean run
                for p in range(positions):
                    activation[p, p] = clean_resid[0, p]
                return activation

            logits = model.run_with_hooks(
                corrupted.expand(positions, -1).contiguous(), fwd_hooks=[(name, patch)]
            )
        figures["patched_runs"] = int(logits.shape[0])
    elif step == "context":
        import threading
        from types import SimpleNamespace

        from attnlab.explorer import context as explorer_context

        long_ids = torch.randint(1000, 100000, (1, context), generator=g)
        # what the store reads of a ModelEntry: the served model, its name, lock and hooks
        entry = SimpleNamespace(model=model, name="8b", lock=threading.Lock(), hooks=[])
        store = explorer_context.ContextStore()
        figures["context_tokens"] = context
        figures["every_layer_bytes"] = explorer_context.context_bytes(entry, context)
        figures["explorer_budget_bytes"] = store.budget
        kept = store.create("8b", entry, long_ids, ["t"] * context, store.layers_in_view(
            entry, context
        ))  # fmt: skip
        figures["kept_layers"] = kept.layers
        figures["kept_bytes"] = kept.nbytes
        figures["pass_seconds"] = kept.seconds
        figures["after_pass"] = status()
        t0 = time.perf_counter()
        explorer_context.overview(kept, kept.layers[-1], 0, 1024)
        figures["overview_seconds"] = time.perf_counter() - t0
        figures["status"] = store.status()
    figures["step_seconds"] = time.perf_counter() - start
    figures["peak"] = status()
    return figures


def llama_bench(tools: Path, path: Path, threads: int) -> dict:
    command = [
        "/usr/bin/time",
        "-v",
        str(tools / "llama-bench"),
        "-m",
        str(path),
        "-p",
        "512",
        "-n",
        "128",
        "-t",
        str(threads),
        "-r",
        "1",
        "-o",
        "json",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    peak = next(
        (
            int(line.split(":")[1]) * 1024
            for line in done.stderr.splitlines()
            if "Maximum resident set size" in line
        ),
        None,
    )
    try:
        rows = json.loads(done.stdout)
    except json.JSONDecodeError:
        rows = done.stdout[-2000:] + done.stderr[-2000:]
    return {"command": " ".join(command), "peak_rss_bytes": peak, "results": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", type=Path)
    p.add_argument("--steps", default=",".join(STEPS))
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--llama-cpp", type=Path, default=None)
    p.add_argument("--results", type=Path, default=None, help="the folder of results records")
    p.add_argument(
        "--update", action="store_true", help="replace only these steps in the record there"
    )
    p.add_argument("--step", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.step:
        figures = run_step(args.step, args.file, args.tokens, args.context, args.new_tokens)
        print("FIGURES " + json.dumps(figures))
        return
    import torch

    import attnlab

    results = {
        "benchmark": "large_file_memory",
        "file": str(args.file),
        "file_bytes": args.file.stat().st_size,
        "machine": {
            "platform": platform.platform(),
            "cpu": next(
                (
                    line.split(":", 1)[1].strip()
                    for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")
                ),
                platform.processor(),
            ),
            "cores": os.cpu_count(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        },
        "versions": {"attnlab": attnlab.__version__, "torch": torch.__version__},
        "command": command_line(),
        "steps": {},
    }
    if args.update:  # the record there, its other steps and llama.cpp's figures kept
        found = sorted((args.results or RESULTS).glob("large_file_memory-*.json"))
        if found:
            record = json.loads(found[-1].read_text())
            old = record["details"]
            for figures in old["steps"].values():  # what measured each kept step
                figures.setdefault(
                    "measured_by", {"command": old["command"], "versions": record["versions"]}
                )
            results["steps"] = old["steps"]
            results["commands"] = [*old.get("commands", [old["command"]]), results["command"]]
            if "llama_cpp" in old:
                results["llama_cpp"] = old["llama_cpp"]
    for step in filter(None, args.steps.split(",")):
        load = os.getloadavg()[0]
        command = [sys.executable, __file__, str(args.file), "--step", step]
        command += ["--tokens", str(args.tokens), "--context", str(args.context)]
        command += ["--new-tokens", str(args.new_tokens)]
        done = subprocess.run(command, capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("FIGURES ")), None)
        figures = json.loads(line[8:]) if line else {"failed": done.stderr[-3000:]}
        figures["load_average_1min"] = load
        figures["measured_by"] = {"command": results["command"], "versions": git_version()}
        figures["warnings"] = [
            x for x in done.stderr.splitlines() if "SlowerPath" in x or "Warning" in x
        ][:5]
        results["steps"][step] = figures
        print(step, json.dumps(figures), flush=True)
        write(args.results, results)  # after each step: a run cut short keeps what it measured
    if args.llama_cpp:
        results["llama_cpp"] = {
            "load_average_1min": os.getloadavg()[0],
            **llama_bench(args.llama_cpp, args.file, torch.get_num_threads()),
        }
        print("llama.cpp", json.dumps(results["llama_cpp"]), flush=True)
    write(args.results, results)


GB = 1e9


def git_version() -> str:
    """The commit of this checkout, '+' where its files differ from it (as write_result says it)."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=here).returncode != 0
    except OSError:
        return "unknown"
    return commit + ("+" if dirty else "")


def figures_of(results: dict) -> list[dict]:
    """The record's figures: each step's peak resident memory and time; where llama-bench ran,
    attnlab's pp and tg rates beside its own (the step's raw figures stay in the details)."""
    figures = [
        {"name": "the file", "unit": "GB", "attnlab": results["file_bytes"] / GB,
         "anchor": None, "ratio": None},
        {"name": f"goal of load and generate: the file + {GOAL_ABOVE_FILE / GB:.1f} GB",
         "unit": "GB", "attnlab": (results["file_bytes"] + GOAL_ABOVE_FILE) / GB,
         "anchor": None, "ratio": None},
    ]  # fmt: skip
    for step, found in results["steps"].items():
        if "peak" not in found:
            continue
        figures.append(
            {"name": f"{step}: peak resident memory", "unit": "GB",
             "attnlab": found["peak"]["VmHWM"] / GB, "anchor": None, "ratio": None}
        )  # fmt: skip
        load = found.get("load_average_1min")  # the machine's, as the step began: times vary
        figures.append(
            {"name": f"{step}: time" + ("" if load is None else f" (load {load:.1f})"), "unit": "s",
             "attnlab": found["load_seconds" if step == "load" else "step_seconds"],
             "anchor": None, "ratio": None}
        )  # fmt: skip
        if "kept_layers" in found:  # the explorer's context: what its budget holds
            figures.append(
                {"name": f"{step}: layers kept at {found['context_tokens']} tokens", "unit":
                 "layers", "attnlab": len(found["kept_layers"]), "anchor": None, "ratio": None}
            )  # fmt: skip
            figures.append(
                {"name": f"{step}: queries and keys kept (budget "
                 f"{found['explorer_budget_bytes'] / GB:.2f} GB)", "unit": "GB",
                 "attnlab": found["kept_bytes"] / GB, "anchor": None, "ratio": None}
            )  # fmt: skip
    bench = results.get("llama_cpp", {}).get("results")
    generate = results["steps"].get("generate", {})
    if isinstance(bench, list) and "pp_seconds" in generate:
        for kind, key in (("pp", "n_prompt"), ("tg", "n_gen")):
            row = next((r for r in bench if r.get(key)), None)
            ours = generate[f"{kind}_tokens"] / generate[f"{kind}_seconds"]
            if row:
                name = f"{kind}{row[key]}"
                if generate[f"{kind}_tokens"] != row[key]:  # say when the counts differ
                    name += f" (attnlab: {generate[f'{kind}_tokens']} tokens)"
                figures.append(
                    {"name": name, "unit": "tok/s", "attnlab": ours,
                     "anchor": row["avg_ts"], "ratio": ours / row["avg_ts"]}
                )  # fmt: skip
    peak = results.get("llama_cpp", {}).get("peak_rss_bytes")
    if peak and "peak" in generate:  # llama-bench's pp512 + tg128 beside attnlab's generate step
        ours = generate["peak"]["VmHWM"]
        figures.append(
            {"name": "peak resident memory, generate beside llama-bench", "unit": "GB",
             "attnlab": ours / GB, "anchor": peak / GB, "ratio": peak / ours, "better": "lower"}
        )  # fmt: skip
    return figures


def write(folder: Path | None, results: dict) -> None:
    """The results record (benchmarks/_common.py, write_result), replaced after each step."""
    ran = isinstance(results.get("llama_cpp", {}).get("results"), list)
    write_result(
        folder or RESULTS,
        "large_file_memory",
        measures=(
            "Peak resident memory (VmHWM) and time of each of attnlab's tools on a GGUF file of "
            "Llama 3.1 8B's shape with random weights in Q4_K_M's mix, each step in a process of "
            "its own, beside llama-bench's pp512 and tg128 on the same file."
        ),
        setup="llama-3.1-8b-shape-q4_k_m",
        anchor="llama.cpp's llama-bench" if ran else None,
        anchor_version=None,
        figures=figures_of(results),
        command=results["command"],
        details=results,
    )


if __name__ == "__main__":
    main()
