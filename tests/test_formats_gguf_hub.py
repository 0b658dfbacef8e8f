"""A GGUF file of a Hugging Face Hub repository by name (attnlab.load("OWNER/REPO", file=...)),
through huggingface_hub's download code and the loopback Hub of tests/hub_server.py, in fresh
processes (huggingface_hub reads its environment when imported), as tests/test_formats_hub.py does
for safetensors repositories."""

from __future__ import annotations

import pytest
import torch
from gguf_files import Q, write_model
from hub_server import HubServer, Repo
from test_formats_hub import environment, run

import attnlab

pytestmark = pytest.mark.slow  # each case starts python

# The child saves the weights it loaded: equal to the local file's, bit for bit.
LOAD = """
import sys, torch, attnlab
torch.save(attnlab.load(sys.argv[2], file=sys.argv[3]).state_dict(), sys.argv[1])
"""


def test_a_gguf_file_by_repository_and_name_then_offline_from_the_cache(tmp_path):
    q8 = write_model(tmp_path / "tiny-Q8_0.gguf", "llama", matrix=Q.Q8_0)
    q4 = write_model(tmp_path / "tiny-Q4_K.gguf", "llama", matrix=Q.Q4_K, d_model=256, d_mlp=512)
    repo = Repo()
    repo.add_commit(
        {"tiny-Q8_0.gguf": q8.read_bytes(), "tiny-Q4_K.gguf": q4.read_bytes(), "README.md": b"#"},
        "main",
    )
    expected = attnlab.load(q8).state_dict()
    home, out = tmp_path / "hf", tmp_path / "logits.pt"
    with HubServer({"org/tiny-gguf": repo}) as hub:
        result = run(
            ["-c", LOAD, str(out), "org/tiny-gguf", "tiny-Q8_0.gguf"],
            environment(hub, home),
            tmp_path,
        )
        assert result.returncode == 0, result.stderr
        assert hub.downloads("org/tiny-gguf") == ["tiny-Q8_0.gguf"]  # only the file asked for
        torch.testing.assert_close(torch.load(out), expected, rtol=0, atol=0)
        missing = run(
            ["-c", LOAD, str(out), "org/tiny-gguf", "tiny-Q2_K.gguf"],
            environment(hub, home),
            tmp_path,
        )
        lines = missing.stderr.strip().splitlines()
        assert (
            "no file 'tiny-Q2_K.gguf' in the repository; its GGUF files are tiny-Q4_K.gguf, "
            "tiny-Q8_0.gguf" in lines[-1]
        )
    offline = run(
        ["-c", LOAD, str(out), "org/tiny-gguf", "tiny-Q8_0.gguf"],
        environment(hub, home, HF_HUB_OFFLINE="1"),
        tmp_path,
    )
    assert offline.returncode == 0, offline.stderr
    torch.testing.assert_close(torch.load(out), expected, rtol=0, atol=0)


def test_file_names_a_gguf_file(tmp_path):
    with pytest.raises(attnlab.UserError, match="names a GGUF file"):
        attnlab.load(tmp_path, file="model.safetensors")
    write_model(tmp_path / "m.gguf", "llama")
    assert attnlab.load(tmp_path, file="m.gguf").config.n_layers == 2
