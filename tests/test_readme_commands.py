"""Every command block (```bash) of README.md and of the manual in docs/, run as written, so that
a page drifting from the code fails the suite.

How, per block (one test each, so that xdist spreads them):
- Each command runs through `bash -c` in a fresh folder, the block's commands in order (a later
  one may read what an earlier one wrote), with the virtual environment's bin/ first on PATH. It
  must exit 0 without a traceback. `attnlab explore` is a server: it runs until it prints its
  URL, the page and /api/models must answer, then it gets Ctrl-C (SIGINT to its process group,
  as a terminal sends it): exit 0 or 130, no traceback.
- Long runs are shortened by attnlab.env's variables, never by editing the text:
  ATTNLAB_MAX_STEPS caps every training run, ATTNLAB_MAX_NEW_TOKENS every sample, and
  ATTNLAB_PORT=0 gives the explorer a free port where the command names none. Hub names are served
  by the loopback Hub (hub_server.py), tiny random models of each name's architecture, through
  HF_ENDPOINT and an empty HF_HOME.
- What a reader has before a command, the test makes (`prepare`): input.txt (Tiny Shakespeare in
  the README; here lines of Romeo and Juliet); a run that a command reads and no earlier command
  of its block trains (trained by the README's own command that writes it); for a command run
  with HF_HUB_OFFLINE=1, its Hub models in the cache (fetched online first, as "from the cache"
  presumes).
- EXCLUDED lists the commands that cannot run here, each with its reason; a listed command that
  is no longer on any page fails the suite, so the list cannot outlive its reasons.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from explorer_models import char_tokenizer
from hub_server import HubServer, Repo

import attnlab
from attnlab.explorer.server import URL_LINE

ROOT = Path(attnlab.__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
REAL_DECODER = (
    "the real-decoder tutorial's findings on SmolLM2 (minutes of CPU, its pictures written into "
    "docs/): tests/test_inspection_real_decoder.py checks that these are the script's commands "
    "word for word and recomputes each finding with the function the command calls"
)

EXCLUDED = {
    "make demo": "the demo with its defaults: 300 steps, then the explorer on port 8000 until "
    "Ctrl-C; tests/test_training_demo.py runs the same `attnlab demo` as a process, "
    "shortened by its own flags, to its explorer in chromium and a Ctrl-C",
    "make test": "the whole suite, which this test is part of",
    "python docs/tutorials/induction_heads.py runs/induction/induction-2L "
    "--out docs/tutorials/induction-heads": "writes the tutorial's pictures into the repository; "
    "tests/test_inspection_attribution.py runs the same script on a tiny model into a temporary "
    "folder, and tests/test_docs.py runs the page's Python blocks",
    "python docs/tutorials/real_decoder.py --out docs/tutorials/real-decoder": REAL_DECODER,
    "attnlab heads smollm2 --json docs/tutorials/real-decoder/heads.json "
    "--png docs/tutorials/real-decoder/heads.png": REAL_DECODER,
    'attnlab attribute smollm2 --prompt "The capital of France is" --answer " Paris" '
    '--wrong " Rome" --png docs/tutorials/real-decoder/attribution.png '
    "--json docs/tutorials/real-decoder/attribution.json": REAL_DECODER,
    'attnlab patch smollm2 --clean "The capital of France is" --corrupted "The capital of Italy '
    'is" --answer " Paris" --wrong " Rome" --sweeps head-outputs '
    "--out docs/tutorials/real-decoder/patching": REAL_DECODER,
}
SHORTENED = {"ATTNLAB_MAX_STEPS": "3", "ATTNLAB_MAX_NEW_TOKENS": "8", "ATTNLAB_PORT": "0"}
# Tiny Shakespeare's stand-in, public-domain lines with every character the README's prompts use
ROMEO = """ROMEO:
But, soft! what light through yonder window breaks?
It is the east, and Juliet is the sun.

JULIET:
O Romeo, Romeo! wherefore art thou Romeo?
Deny thy father and refuse thy name;
Or, if thou wilt not, be but sworn my love,
And I'll no longer be a Capulet.

ROMEO:
I will, my love; I would I were thy bird.

PARIS:
These times of woe afford no time to woo.
"""


@dataclass(frozen=True)
class Block:
    page: str  # README.md or docs/...
    section: str  # the heading above it
    line: int  # where the block starts in the page
    commands: tuple[str, ...]  # without their comments

    @property
    def name(self) -> str:
        slug = lambda text: re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
        return f"{slug(self.page.removesuffix('.md'))}-line{self.line}-{slug(self.section)}"


def page_blocks(page: str, text: str) -> list[Block]:
    blocks = []
    for match in re.finditer(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        before = text[: match.start()]
        headings = re.findall(r"^#+ (.+)$", before, flags=re.M)
        commands = []
        for line in match.group(1).replace("\\\n", " ").splitlines():
            if shlex.split(line, comments=True):  # neither blank nor a comment
                commands.append(line.split("  #")[0].strip())  # its comment is two spaces away
        section = headings[-1] if headings else "top"
        blocks.append(Block(page, section, before.count("\n") + 1, tuple(commands)))
    return blocks


BLOCKS = [
    block
    for path in PAGES
    for block in page_blocks(str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"))
]
RUNNABLE = [b for b in BLOCKS if any(c not in EXCLUDED for c in b.commands)]


def test_the_pages_have_command_blocks_and_every_exclusion_is_still_in_them():
    commands = [c for block in BLOCKS for c in block.commands]
    assert len(RUNNABLE) >= 5, [b.name for b in BLOCKS]
    assert any(b.page == "README.md" for b in RUNNABLE), "the README has no command block"
    missing = [c for c in EXCLUDED if c not in commands]
    assert not missing, f"EXCLUDED lists commands no page has any more: {missing}"


def words(command: str) -> list[str]:
    return [w for w in shlex.split(command, comments=True) if not re.match(r"^[A-Z_]+=", w)]


def hub_names(command: str) -> list[str]:
    """The Hub repositories a command names (positional arguments spelled as a repository id)."""
    from attnlab.formats.hub import is_repo_id

    args = words(command)[2:]
    names = []
    for i, arg in enumerate(args):
        if arg.startswith("-") or (i and args[i - 1].startswith("-") and "=" not in args[i - 1]):
            continue
        if arg in HUB_MODELS or (is_repo_id(arg) and "/" in arg and not Path(arg).exists()):
            names.append(arg)
    return names


# Tiny random models under the names the README uses, of each name's architecture
HUB_MODELS = {
    "gpt2": dict(preset="nano", n_layers=2, n_heads=4, d_model=32, n_ctx=128, mlp="gelu_tanh"),
    "EleutherAI/pythia-70m": dict(
        preset="nano",
        n_layers=2,
        n_heads=4,
        d_model=32,
        n_ctx=128,
        positional="rope",
        rotary_fraction=0.25,
        parallel_residual=True,
        mlp="gelu",
        tie_embeddings=False,
    ),
    "HuggingFaceTB/SmolLM2-135M": dict(
        preset="llama-tiny", n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, d_mlp=64
    ),
}
HUB_MODELS["EleutherAI/pythia-160m"] = HUB_MODELS["EleutherAI/pythia-70m"]
REVISIONS = {"EleutherAI/pythia-160m": "step143000"}  # besides main


@pytest.fixture(scope="module")
def hub_repos(tmp_path_factory) -> dict[str, Repo]:
    import torch

    root = tmp_path_factory.mktemp("hub")
    repos = {}
    for i, (name, spec) in enumerate(HUB_MODELS.items()):
        spec = dict(spec)
        torch.manual_seed(i)
        config = attnlab.preset(spec.pop("preset"), d_vocab=char_tokenizer().vocab_size, **spec)
        model = attnlab.Transformer(config).eval()
        model.tokenizer = char_tokenizer()
        folder = attnlab.save(model, root / name, format="hf")
        repo = Repo()
        repo.add_commit(
            {p.name: p.read_bytes() for p in folder.iterdir()},
            "main",
            *([REVISIONS[name]] if name in REVISIONS else []),
        )
        repos[name] = repo
    return repos


def environment(hub: HubServer, folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING", "ATTNLAB_"))}
    env.update(
        SHORTENED,
        HF_ENDPOINT=hub.url,
        HF_HOME=str(folder / ".hf"),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    )
    return env


def prepare(block: Block, folder: Path, env: dict[str, str]) -> None:
    """What a reader has before running the block (the module docstring's PREREQUISITES)."""
    (folder / "input.txt").write_text(ROMEO * 60, encoding="utf-8")
    every = [c for b in BLOCKS for c in b.commands]
    for i, command in enumerate(block.commands):
        for run in re.findall(r"\b(runs/\w+)\b", command):
            written = any(f"--out {run}" in earlier for earlier in block.commands[: i + 1])
            if not written and not (folder / run).exists():
                makers = [
                    c for c in every if f"--out {run}" in c and words(c)[:2] == ["attnlab", "train"]
                ]
                assert makers, f"{command!r} reads {run}, which no `attnlab train` here writes"
                run_to_end(makers[0], env, folder)
        if command.startswith("HF_HUB_OFFLINE=1 "):
            for name in hub_names(command):
                code = f"import attnlab; attnlab.load({name!r})"
                subprocess.run(
                    [sys.executable, "-c", code],
                    env=env,
                    cwd=folder,
                    check=True,
                    capture_output=True,
                    timeout=300,
                )


def run_to_end(command: str, env: dict[str, str], folder: Path) -> None:
    result = subprocess.run(
        ["bash", "-c", command], env=env, cwd=folder, capture_output=True, text=True, timeout=600
    )
    shown = (
        f"$ {command}\n(exit {result.returncode})\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    assert result.returncode == 0, shown
    assert "Traceback" not in result.stdout + result.stderr, shown


def run_server(command: str, env: dict[str, str], folder: Path) -> None:
    """Start the explorer as `command` says, check that its page and API answer, then Ctrl-C it.
    A port the command names that another program holds is waited for (up to a minute)."""
    deadline = time.monotonic() + 60
    while True:
        process = subprocess.Popen(
            ["bash", "-c", command],
            env=env,
            cwd=folder,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            printed, url = [], None
            for line in process.stdout:
                printed.append(line)
                if found := URL_LINE.match(line.rstrip("\n")):
                    url = found.group(1)
                    break
            if url is None:
                process.wait(timeout=60)
                errors = process.stderr.read()
                if "already in use" in errors and time.monotonic() < deadline:
                    time.sleep(2)
                    continue
                pytest.fail(
                    f"$ {command}\nended (exit {process.returncode}) before serving:\n"
                    f"{''.join(printed)}\n{errors}"
                )
            with urllib.request.urlopen(url, timeout=60) as page:
                assert page.status == 200 and b"<html" in page.read().lower()
            with urllib.request.urlopen(url + "api/models", timeout=60) as answer:
                served = [m["name"] for m in json.loads(answer.read())]
            assert served and all(name in printed[-1] for name in served), (served, printed[-1])
            os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in the terminal
            rest, errors = process.communicate(timeout=60)
            shown = f"$ {command}\n(exit {process.returncode})\n{rest}\n{errors}"
            assert process.returncode in (0, 130), shown
            assert "Traceback" not in rest + errors, shown
            return
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            process.stdout.close()
            process.stderr.close()


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.name for b in RUNNABLE])
def test_block_runs_as_written(block, hub_repos, tmp_path):
    with HubServer(hub_repos) as hub:
        env = environment(hub, tmp_path)
        prepare(block, tmp_path, env)
        for command in block.commands:
            if command in EXCLUDED:
                continue
            if words(command)[:2] == ["attnlab", "explore"]:
                run_server(command, env, tmp_path)
            else:
                run_to_end(command, env, tmp_path)
