"""Models by Hugging Face Hub name, through huggingface_hub's real download code and a loopback Hub.

Every run is a fresh `python` process with HF_ENDPOINT pointing at tests/hub_server.py and HF_HOME
at a temporary folder, because huggingface_hub (like transformers) reads its environment when it is
imported:
this is how a user meets these settings. The tiny models are written by attnlab and checked against
the same weights read from a local directory, so "the download worked" means "the same numbers came
back".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from explorer_models import small_models
from hub_server import HubServer, Repo
from safetensors.torch import load_file, save_file

import attnlab
from attnlab.formats.hf import architectures

# each case starts python (torch, huggingface_hub): seconds, not milliseconds
pytestmark = pytest.mark.slow

SRC = str(Path(attnlab.__file__).resolve().parents[1])
TOKEN = "hf_loopbackSecret123"
IDS = [[5, 9, 2, 40, 7, 11]]
FETCHED = {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"}
# Printed by the child: logits of IDS for each "name@revision" given, saved with torch.save.
LOAD = (
    """
import sys, torch, attnlab
# the thread count of the test process (conftest), so the same sums in the same order
torch.set_num_threads(1)
out = {}
for spec in sys.argv[2:]:
    name, _, revision = spec.partition("@")
    model = attnlab.load(name, revision=revision or None)
    out[spec] = model(torch.tensor(%r))
torch.save(out, sys.argv[1])
"""
    % IDS
)


def hf_files(model, folder: Path) -> dict[str, bytes]:
    attnlab.save(model, folder, format="hf")
    return {path.name: path.read_bytes() for path in folder.iterdir()}


def shard(files: dict[str, bytes], folder: Path) -> dict[str, bytes]:
    """The same checkpoint as two shards and their index (what save_pretrained writes for big
    models)."""
    (folder / "whole.safetensors").write_bytes(files["model.safetensors"])
    tensors = load_file(folder / "whole.safetensors")
    names = sorted(tensors)
    weight_map = {}
    sharded = {k: v for k, v in files.items() if k != "model.safetensors"}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, folder / file, metadata={"format": "pt"})
        sharded[file] = (folder / file).read_bytes()
        weight_map.update({name: file for name in part})
    sharded["model.safetensors.index.json"] = json.dumps(
        {"metadata": {}, "weight_map": weight_map}
    ).encode()
    return sharded


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """Repositories like the Hub's: org/tiny (main and a training-checkpoint branch step1, plus
    files attnlab must not fetch), org/sharded, org/gated (needs TOKEN), org/pickled (.bin only),
    org/t5 (unsupported)."""
    root = tmp_path_factory.mktemp("hub")
    models = small_models(seed=1)
    main, step1 = models["gpt"], small_models(seed=2)["gpt"]
    files = hf_files(main, root / "main")
    unread = {
        "README.md": b"# tiny\n",
        "pytorch_model.bin": b"a pickle attnlab must not fetch",
        "onnx/model.onnx": b"not for attnlab",
        "vocab.json": b"{}",
    }
    tiny = Repo()
    tiny.add_commit({**files, **unread}, "main")
    tiny.add_commit(hf_files(step1, root / "step1"), "step1")
    gated = Repo(gated_token=TOKEN)
    gated.add_commit(files, "main")
    sharded = Repo()
    sharded.add_commit(shard(files, root), "main")
    pickled = Repo()
    pickled.add_commit(
        {"config.json": files["config.json"], "pytorch_model.bin": b"pickle"}, "main"
    )
    t5 = Repo()
    t5.add_commit(
        {
            "config.json": json.dumps({"model_type": "t5", "d_model": 8}).encode(),
            "model.safetensors": files["model.safetensors"],
        },
        "main",
    )
    repos = {
        "org/tiny": tiny,
        "org/gated": gated,
        "org/sharded": sharded,
        "org/pickled": pickled,
        "org/t5": t5,
    }
    expected = {
        "main": attnlab.load(root / "main")(torch.tensor(IDS)),
        "step1": attnlab.load(root / "step1")(torch.tensor(IDS)),
    }
    return repos, expected


@pytest.fixture
def hub(repos):
    with HubServer(repos[0]) as server:
        yield server


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )


def environment(hub: HubServer, home: Path, **extra: str) -> dict[str, str]:
    env = {
        key: value for key, value in os.environ.items() if not key.startswith(("HF_", "HUGGING"))
    }
    # src first, then what the run was given
    path = os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))
    env.update({"HF_ENDPOINT": hub.url, "HF_HOME": str(home), "PYTHONPATH": path, **extra})
    return env


def cli_error(hub: HubServer, tmp_path: Path, args: list[str], **extra: str) -> str:
    """Run `attnlab ARGS`, expecting a user error: exit 2 and exactly one line on stderr
    (returned)."""
    env = environment(hub, tmp_path / "hf", HF_HUB_DISABLE_PROGRESS_BARS="1", **extra)
    result = run(["-m", "attnlab", *args], env, tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stderr)
    assert TOKEN not in result.stdout + result.stderr
    return lines[0]


def test_load_by_name_and_revision_then_offline_from_the_shared_cache(repos, tmp_path):
    repos, expected = repos
    home, out = tmp_path / "hf", tmp_path / "logits.pt"
    with HubServer(repos) as hub:
        result = run(
            ["-c", LOAD, str(out), "org/tiny", "org/tiny@step1", "org/sharded"],
            environment(hub, home),
            tmp_path,
        )
    assert result.returncode == 0, result.stderr
    logits = torch.load(out)
    torch.testing.assert_close(logits["org/tiny"], expected["main"], rtol=0, atol=0)
    torch.testing.assert_close(logits["org/tiny@step1"], expected["step1"], rtol=0, atol=0)
    torch.testing.assert_close(logits["org/sharded"], expected["main"], rtol=0, atol=0)
    # the revision was honoured
    assert not torch.allclose(logits["org/tiny"], logits["org/tiny@step1"])

    # only the files attnlab reads, each once (README, the pickle, onnx/ and vocab.json stay on the
    # Hub) (step1's config and tokenizer are main's bytes: the cache keeps one blob, so only its
    # weights move again)
    tiny = hub.downloads("org/tiny")
    assert set(tiny) == FETCHED and tiny.count("model.safetensors") == 2, tiny
    assert sorted(hub.downloads("org/sharded")) == sorted(
        FETCHED - {"model.safetensors"}
        | {
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        }
    )
    assert not hub.unknown, hub.unknown
    # the standard cache layout, shared with transformers: refs/<branch> -> snapshots/<commit>/
    storage = home / "hub" / "models--org--tiny"
    for ref, sha in repos["org/tiny"].refs.items():
        assert (storage / "refs" / ref).read_text() == sha
        assert (storage / "snapshots" / sha / "model.safetensors").is_file()
    assert "Fetching" in result.stderr  # huggingface_hub's progress bar

    # The Hub is stopped: HF_HUB_OFFLINE=1 loads the same models from the cache, by name and
    # revision, and transformers finds attnlab's download in the same cache.
    offline = environment(hub, home, HF_HUB_OFFLINE="1")
    reference = (
        """
import sys, torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(
    "org/tiny", revision="step1", dtype=torch.float32
)
torch.save(model(torch.tensor(%r)).logits, sys.argv[1])
"""
        % IDS
    )
    result = run(
        ["-c", LOAD, str(out), "org/tiny", "org/tiny@step1", "org/sharded"], offline, tmp_path
    )
    assert result.returncode == 0, result.stderr
    for spec, revision in (
        ("org/tiny", "main"),
        ("org/tiny@step1", "step1"),
        ("org/sharded", "main"),
    ):
        torch.testing.assert_close(torch.load(out)[spec], expected[revision], rtol=0, atol=0)
    result = run(["-c", reference, str(tmp_path / "theirs.pt")], offline, tmp_path)
    assert result.returncode == 0, result.stderr
    torch.testing.assert_close(
        torch.load(tmp_path / "theirs.pt"), expected["step1"], rtol=1e-4, atol=1e-5
    )
    # and the command line takes the name and --revision
    result = run(
        [
            "-m",
            "attnlab",
            "sample",
            "org/tiny",
            "--revision",
            "step1",
            "--prompt",
            "The",
            "--max-new-tokens",
            "4",
        ],
        offline,
        tmp_path,
    )
    assert result.returncode == 0 and result.stdout.startswith("The"), result.stderr


def test_a_token_from_the_environment_opens_a_gated_repository_and_is_never_printed(hub, tmp_path):
    env = environment(hub, tmp_path / "hf", HF_TOKEN=TOKEN)
    start = len(hub.requests)
    result = run(
        ["-m", "attnlab", "heads", "org/gated", "--batch", "1", "--repeats", "2"], env, tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert TOKEN not in result.stdout + result.stderr
    sent = {r.authorization for r in hub.requests[start:] if "/resolve/" in r.path}
    assert sent == {f"Bearer {TOKEN}"}


@pytest.mark.parametrize(
    "args, extra, message",
    [
        (
            ["org/gated"],
            {},
            "org/gated: a gated repository; accept its conditions at http://127.0.0.1",
        ),
        (["org/gated"], {"HF_TOKEN": "hf_wrong"}, "your Hugging Face token has no access to it"),
        (
            ["org/nothere"],
            {},
            "org/nothere: neither a local model directory nor a Hugging Face Hub repository",
        ),
        (["org/tiny", "--revision", "step9"], {}, "org/tiny: no revision 'step9' on the Hub"),
        (
            ["org/pickled"],
            {},
            "org/pickled: only pickled weights (pytorch_model.bin), no model.safetensors; attnlab "
            "never unpickles",
        ),
        (
            ["org/tiny"],
            {"HF_HUB_OFFLINE": "1"},
            "org/tiny: no such local directory, not in the Hugging Face cache",
        ),
        (["org/tiny"], {"HF_HOME": "/dev/null"}, "org/tiny: cannot write the Hugging Face cache"),
    ],
    ids=[
        "gated",
        "gated-wrong-token",
        "no-such-repo",
        "no-such-revision",
        "pickled",
        "offline-not-cached",
        "cache-not-writable",
    ],
)
def test_hub_errors_are_one_line(hub, tmp_path, args, extra, message):
    start = len(hub.requests)
    line = cli_error(hub, tmp_path, ["sample", *args], **extra)
    assert line.startswith("attnlab sample: error: ") and message in line, line
    assert not [
        path for path in hub.downloads(args[0], start) if path.endswith((".bin", ".safetensors"))
    ]
    if extra.get("HF_HUB_OFFLINE"):
        assert "HF_HUB_OFFLINE=1" in line and len(hub.requests) == start  # offline: not one request


@pytest.mark.parametrize(
    "name, reason",
    [
        ("runs/x", "./runs is a folder here, so the name is read as a path in it"),
        # a Hub id, but the user has a folder of that name: theirs wins
        ("org/tiny", "./org is a folder here"),
        ("runs/x/", "spelled as a path"),
        ("./runs/x", "spelled as a path"),
    ],
    ids=[
        "first-part-is-a-folder",
        "hub-id-shadowed-by-a-folder",
        "trailing-separator",
        "dot-slash",
    ],
)
def test_a_mistyped_local_path_is_one_line_and_asks_nothing_of_the_hub(hub, tmp_path, name, reason):
    """runs/x with ./runs there is a local path missing its last part, not the Hub's owner "runs":
    one line, no request."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "org").mkdir()
    start = len(hub.requests)
    line = cli_error(hub, tmp_path, ["sample", name])
    assert (
        line.startswith(f"attnlab sample: error: {name}: no such model directory (")
        and reason in line
    ), line
    assert "check the path" in line
    assert hub.requests[start:] == []


def test_unsupported_model_type_lists_the_architecture_table_before_fetching_weights(hub, tmp_path):
    start = len(hub.requests)
    line = cli_error(hub, tmp_path, ["heads", "org/t5", "--revision", "main"])
    assert (
        f"model_type 't5' is not supported; attnlab reads {', '.join(architectures())}" in line
    ), line
    assert hub.downloads("org/t5", start) == ["config.json"]


def test_every_model_command_takes_a_hub_name_and_revision():
    from attnlab.cli import build_parser

    parser = build_parser()
    for argv in (
        ["explore", "gpt2"],
        ["export-html", "gpt2", "--text", "x", "-o", "x.html"],
        ["sample", "gpt2"],
        ["heads", "gpt2"],
        ["compare", "gpt2"],
        ["experiment", "coreference", "--model", "gpt2"],
    ):
        args = parser.parse_args([*argv, "--revision", "step3000"])
        assert args.revision == "step3000", argv


def tiny_pythia(folder: Path, seed: int = 0) -> dict[str, bytes]:
    """A GPT-NeoX checkpoint as transformers writes it (tiny, random, `seed`) with a character
    tokenizer: its files."""
    import transformers
    from explorer_models import char_tokenizer

    torch.manual_seed(seed)
    tokenizer = char_tokenizer()
    pythia = transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(
            vocab_size=tokenizer.vocab_size + 4,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            rotary_pct=0.25,
            use_parallel_residual=True,
        )
    )
    # sharper patterns than the near-uniform initialisation, so the steps differ visibly
    with torch.no_grad():
        for layer in pythia.gpt_neox.layers:
            layer.attention.query_key_value.weight.mul_(8)
    pythia.save_pretrained(folder)
    tokenizer.save(folder / "tokenizer.json")
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_explore_a_pythia_checkpoint_by_hub_name_and_revision(tmp_path):
    """`attnlab explore EleutherAI/pythia-70m --revision step3000` as a user with a network runs it:
    a GPT-NeoX checkpoint as transformers writes it (tiny, random) on a training-step branch of the
    loopback Hub."""
    import urllib.request

    from attnlab.explorer.testing import explorer_process

    repo = Repo()
    repo.add_commit(tiny_pythia(tmp_path / "pythia"), "step3000")
    with HubServer({"EleutherAI/pythia-70m": repo}) as hub:
        with explorer_process(
            "EleutherAI/pythia-70m",
            "--revision",
            "step3000",
            env=environment(hub, tmp_path / "hf"),
            cwd=tmp_path,
        ) as (_, url):
            with urllib.request.urlopen(url + "api/models", timeout=60) as response:
                (model,) = json.load(response)
        assert model["name"] == "pythia-70m", model
    assert "model.safetensors" in hub.downloads("EleutherAI/pythia-70m")


def test_explore_pythia_training_revisions_on_the_step_slider(tmp_path):
    """`attnlab explore EleutherAI/pythia-70m --revisions all`: the repository's stepN branches
    (listed by list_repo_refs) are the step slider; each step's pattern is that revision's, fetched
    once, when first asked for."""
    import urllib.request

    from explorer_models import TEXT

    from attnlab.explorer.testing import explorer_process

    repo, expected = Repo(), {}
    for step in (0, 10, 20):
        folder = tmp_path / f"step{step}"
        repo.add_commit(tiny_pythia(folder, seed=step), f"step{step}")
        model = attnlab.load(folder)
        _, cache = model.run_with_cache(
            torch.tensor([model.tokenizer.encode(TEXT)]), names_filter="blocks.1.attn.hook_pattern"
        )
        expected[step] = cache["blocks.1.attn.hook_pattern"][0, 0]
    # not a step: not on the slider
    repo.add_commit(hf_files(small_models(seed=3)["gpt"], tmp_path / "main"), "main")
    repo.tags["v1.0"] = repo.refs["main"]

    def post(url: str, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.load(response)

    def weights_fetched(since: int = 0) -> int:
        return hub.downloads("EleutherAI/pythia-70m", since).count("model.safetensors")

    with HubServer({"EleutherAI/pythia-70m": repo}) as hub:
        env = environment(hub, tmp_path / "hf", HF_HUB_DISABLE_PROGRESS_BARS="1")
        with explorer_process(
            "EleutherAI/pythia-70m", "--revisions", "all", env=env, cwd=tmp_path
        ) as (_, url):
            with urllib.request.urlopen(url + "api/models", timeout=60) as response:
                (model,) = json.load(response)
            assert model["steps"] == [0, 10, 20], model
            # the last step, which the page opens on; the others when asked for
            assert weights_fetched() == 1
            shown = {}
            for step in (20, 0, 10, 0):
                start, first = len(hub.requests), step != 20 and step not in shown
                answer = post(
                    url,
                    "api/pattern",
                    {"model": "pythia-70m", "text": TEXT, "layer": 1, "head": 0, "step": step},
                )
                shown[step] = torch.tensor(answer["pattern"])
                torch.testing.assert_close(shown[step], expected[step], rtol=0, atol=1e-6)
                # fetched the first time its step is asked for, then kept
                assert weights_fetched(start) == first
            assert weights_fetched() == 3  # each revision's weights once
            assert (shown[0] - shown[20]).abs().max() > 1e-2  # the matrix changes with the step
            with urllib.request.urlopen(
                url + "api/models/pythia-70m/training", timeout=120
            ) as response:
                training = json.load(response)
            assert (
                training["lazy"]
                and training["score_steps"] == [0, 10, 20]
                and training["metrics"] == []
            )
            assert training["revisions"] == {"0": "step0", "10": "step10", "20": "step20"}
        # named revisions: just those steps, in step order
        with explorer_process(
            "EleutherAI/pythia-70m", "--revisions", "step20,step0", env=env, cwd=tmp_path
        ) as (_, url):
            with urllib.request.urlopen(url + "api/models", timeout=60) as response:
                (model,) = json.load(response)
            assert model["steps"] == [0, 20], model
        assert not hub.unknown, hub.unknown
        # offline, the Hub cannot list the revisions: one line that says to name them
        line = cli_error(
            hub,
            tmp_path,
            ["explore", "EleutherAI/pythia-70m", "--revisions", "all"],
            HF_HUB_OFFLINE="1",
        )
        assert (
            "listing its revisions needs the Hugging Face Hub" in line
            and "--revisions step1000,step2000" in line
        ), line
