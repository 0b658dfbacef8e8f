"""`attnlab explore` / `attnlab export-html` and `attnlab.show`: model discovery, one-line errors, a
self-contained page."""

from __future__ import annotations

import json
import os
import re
import socket
import sys

import pytest
from explorer_models import TEXT, small_models

import attnlab
from attnlab.cli import main
from attnlab.explorer.cli import bind, newest_run
from attnlab.explorer.export import _round as export_round
from attnlab.explorer.export import export_data, request_key
from attnlab.explorer.service import Explorer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny-gpt"
    attnlab.save(small_models()["gpt"], path)
    return path


def test_a_port_in_use_is_one_clear_line(model_dir, capsys):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        code = main(["explore", str(model_dir), "--port", str(port)])
    finally:
        taken.close()
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert (
        len(err.splitlines()) == 1
        and f"port {port}" in err
        and "in use" in err
        and f"--port {port + 1}" in err
    )


def test_bind_defaults_to_this_machine_only(monkeypatch):
    sock = bind("127.0.0.1", 0)
    try:
        assert sock.getsockname()[0] == "127.0.0.1"
    finally:
        sock.close()
    from attnlab.cli import build_parser
    from attnlab.env import explorer_port

    monkeypatch.delenv("ATTNLAB_PORT", raising=False)
    args = build_parser().parse_args(["explore"])
    assert args.host == "127.0.0.1" and explorer_port(args.port) == 8000 and args.models == []


def test_newest_run_picks_the_most_recently_written_checkpoint(tmp_path, model_dir):
    runs = tmp_path / "runs"
    model = attnlab.load(model_dir)
    old, new = attnlab.save(model, runs / "old"), attnlab.save(model, runs / "nested" / "new")
    (runs / "not-a-model").mkdir()
    (runs / "not-a-model" / "config.json").write_text("{}")
    os.utime(old / "model.safetensors", (1_000, 1_000))
    os.utime(new / "model.safetensors", (2_000, 2_000))
    assert newest_run(runs) == new
    os.utime(old / "model.safetensors", (3_000, 3_000))
    assert newest_run(runs) == old
    assert newest_run(tmp_path / "missing") is None


def test_with_no_model_it_serves_the_newest_run_and_minilm(
    tmp_path, model_dir, monkeypatch, capsys
):
    from attnlab import workbench
    from attnlab.explorer import cli

    monkeypatch.chdir(tmp_path)
    attnlab.save(attnlab.load(model_dir), tmp_path / "runs" / "shakespeare")
    models = cli.default_models()
    assert list(models) == ["shakespeare", "minilm"] and not models["minilm"].config.causal
    # neither a run nor MiniLM: one line that says what to do
    (tmp_path / "runs" / "shakespeare" / "config.json").unlink()

    def no_minilm(path):
        raise attnlab.UserError(f"{path}: no such model directory")

    monkeypatch.setattr(workbench, "load", no_minilm)  # the explorer loads through it
    assert main(["explore"]) == 2
    captured = capsys.readouterr()
    assert "minilm is not available" in captured.out
    assert len(captured.err.strip().splitlines()) == 1 and "no model to explore" in captured.err


@pytest.mark.slow
def test_explore_prints_its_url_and_serves_the_models_given(model_dir, tmp_path):
    import urllib.request

    from attnlab.explorer.cli import explorer_process

    with explorer_process(str(model_dir), cwd=tmp_path) as (_, url):
        with urllib.request.urlopen(url + "api/models", timeout=60) as response:
            assert [m["name"] for m in json.load(response)] == ["tiny-gpt"]
        with urllib.request.urlopen(url, timeout=60) as response:
            assert b"attnlab explorer" in response.read()


def test_a_missing_model_directory_is_one_line(tmp_path, capsys):
    assert main(["explore", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nowhere" in err


def test_export_html_writes_one_self_contained_page(model_dir, tmp_path, capsys):
    out = tmp_path / "view.html"
    assert (
        main(["export-html", str(model_dir), "--text", TEXT, "-o", str(out), "--view", "matrix"])
        == 0
    )
    assert str(out) in capsys.readouterr().out
    page = out.read_text(encoding="utf-8")
    assert "window.ATTNLAB_EXPORT" in page and "/static/" not in page
    # nothing is fetched from anywhere: no external script, style, image or link
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert not re.search(r"@import|url\(\s*['\"]?https?:", page)
    data = json.loads(
        page.split("window.ATTNLAB_EXPORT = ", 1)[1].split(";</script>", 1)[0].replace("<\\/", "</")
    )
    assert data["view"] == "matrix" and data["text"] == TEXT


def test_export_holds_every_request_the_page_makes_by_default():
    model = small_models()["gpt"]
    data = export_data(model, TEXT, name="gpt")
    keys = set(data["responses"])
    base = {"model": "gpt", "text": TEXT}
    cfg = model.config
    for layer in range(cfg.n_layers):
        for head in range(cfg.n_heads):
            assert (
                request_key(
                    "/api/pattern", {**base, "layer": layer, "head": head, "encoding": "f32"}
                )
                in keys
            )
            assert request_key("/api/projection", {**base, "layer": layer, "head": head}) in keys
        assert request_key("/api/trace", {**base, "layer": layer, "token": len(TEXT) - 1}) in keys
    assert (
        request_key("/api/next", {**base, "temperature": 1, "top_k": None, "top_p": None, "k": 10})
        in keys
    )
    assert "/api/models/gpt/head-scores" in keys
    # core.js's requestKey: JSON.stringify of sorted [key, value] pairs, no spaces, non-ASCII as is
    assert (
        request_key("/api/run", {"text": "é\n", "model": "m"})
        == '/api/run [["model","m"],["text","é\\n"]]'
    )


def test_export_shares_one_forward_pass_per_layer_and_matches_the_server(monkeypatch):
    model = small_models()["gpt"]
    cfg = model.config
    served = Explorer({"gpt": model})
    expected = {
        (layer, head): (
            served.pattern("gpt", TEXT, layer, head, "f32"),
            served.projection("gpt", TEXT, layer, head),
        )
        for layer in range(cfg.n_layers)
        for head in range(cfg.n_heads)
    }
    passes = []
    original = type(model).run_with_cache
    monkeypatch.setattr(
        type(model),
        "run_with_cache",
        lambda self, *a, **k: passes.append(k.get("stop_at_layer")) or original(self, *a, **k),
    )
    data = export_data(model, TEXT, name="gpt")
    per_layer = [p for p in passes if p is not None]
    # one pass per layer
    assert cfg.n_heads > 1 and sorted(per_layer) == [layer + 1 for layer in range(cfg.n_layers)]
    base = {"model": "gpt", "text": TEXT}
    for (layer, head), (pattern, projection) in expected.items():
        where = {**base, "layer": layer, "head": head}
        got = data["responses"][request_key("/api/pattern", {**where, "encoding": "f32"})]
        assert (
            got["pattern"] == export_round(pattern)["pattern"]
            and got["raw"] == export_round(pattern)["raw"]
        )
        assert data["responses"][request_key("/api/projection", where)] == export_round(projection)
    trace = served.trace("gpt", TEXT, cfg.n_layers - 1, 3)
    assert data["responses"][
        request_key("/api/trace", {**base, "layer": cfg.n_layers - 1, "token": 3})
    ] == export_round(trace)


def test_export_refuses_long_texts_with_the_limit(model_dir, tmp_path, capsys):
    assert (
        main(["export-html", str(model_dir), "--text", "x" * 129, "-o", str(tmp_path / "x.html")])
        == 2
    )
    err = capsys.readouterr().err
    assert "129 tokens" in err and "128" in err
    assert not (tmp_path / "x.html").exists()


def test_export_to_a_directory_is_one_line(model_dir, tmp_path, capsys):
    assert main(["export-html", str(model_dir), "--text", TEXT, "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a directory" in err and "view.html" in err


def test_show_returns_an_iframe_without_ipython(monkeypatch):
    monkeypatch.setitem(sys.modules, "IPython", None)  # as if IPython were not installed
    monkeypatch.setitem(sys.modules, "IPython.display", None)
    frame = attnlab.show(small_models()["bert"], "it was tired", view="heads")
    assert (
        isinstance(frame, str) and frame.startswith("<iframe srcdoc=") and "ATTNLAB_EXPORT" in frame
    )
    # the page is escaped inside srcdoc
    assert "<script" not in frame.split("srcdoc=", 1)[1].split('"', 2)[1][:200]
    with pytest.raises(attnlab.UserError, match="unknown view"):
        attnlab.show(small_models()["bert"], "hi", view="nope")


@pytest.mark.parametrize(
    "host, token_needed",
    [
        ("0.0.0.0", True),
        ("192.168.1.5", True),
        ("127.0.0.1", False),
        ("localhost", False),
        ("::1", False),
    ],
)
def test_a_host_beyond_this_machine_warns_and_requires_the_printed_token(
    model_dir, monkeypatch, capsys, host, token_needed
):
    """Like Jupyter: listening on the network prints a warning and a URL carrying a token; the API
    needs that token."""
    import uvicorn
    from fastapi.testclient import TestClient

    from attnlab.explorer import cli

    served = {}
    monkeypatch.setattr(
        uvicorn.Server, "run", lambda self, sockets: served.update(app=self.config.app)
    )
    real_bind = cli.bind
    # tests never listen beyond loopback
    monkeypatch.setattr(cli, "bind", lambda _host, port: real_bind("127.0.0.1", port))
    assert main(["explore", str(model_dir), "--host", host, "--port", "0"]) == 0
    out = capsys.readouterr().out
    url = re.search(r"at (http://\S+)", out).group(1)
    app = served["app"]
    name = "[::1]" if host == "::1" else host
    client = TestClient(app, base_url=f"http://{name}:8000")
    if not token_needed:
        assert "warning" not in out and "token" not in url
        assert client.get("/api/models").status_code == 200
        return
    assert "warning" in out and "other machines" in out
    token = re.search(r"\?token=([0-9a-f]+)$", url).group(1)
    assert len(token) >= 32
    assert client.get("/api/models").status_code == 403
    assert client.get(f"/api/models?token={token}").status_code == 200
    assert client.get("/api/models", headers={"Authorization": f"token {token}"}).status_code == 200
    if host == "0.0.0.0":  # any Host (the token is the defence there), and a fresh token each start
        assert (
            client.get(
                f"/api/models?token={token}", headers={"Host": "my-laptop.lan:8000"}
            ).status_code
            == 200
        )
        assert main(["explore", str(model_dir), "--host", host, "--port", "0"]) == 0
        assert token not in capsys.readouterr().out
    else:  # a named address: its own name and the loopback names, nothing else (DNS rebinding)
        assert (
            client.get(
                f"/api/models?token={token}", headers={"Host": "attacker.example"}
            ).status_code
            == 400
        )


def test_a_queue_under_one_is_one_line(model_dir, capsys):
    assert main(["explore", str(model_dir), "--queue", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--queue must be at least 1, got 0" in err


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["--revisions", "step10,main"],
            "--revisions 'main': the step slider takes training-step revisions named stepN",
        ),
        (["--revisions", "step10,step10"], "--revisions lists step 10 twice"),
        (["--revisions", "step10", "--revision", "step20"], "give one of the two"),
        (["--revisions", ","], "--revisions lists the steps to load"),
    ],
    ids=["not-a-step", "twice", "with-revision", "empty"],
)
def test_bad_revisions_are_one_line_before_anything_loads(args, words, capsys):
    """The Hub names here are never looked up: each mistake is caught before a model loads (tested
    offline)."""
    assert main(["explore", "EleutherAI/pythia-70m", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


def test_revisions_of_a_local_model_are_one_line(model_dir, capsys):
    assert main(["explore", str(model_dir), "--revisions", "all"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "this is a local model" in err and "snapshots" in err, err


def test_revisions_of_a_mistyped_local_path_say_why_it_is_not_a_hub_id(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    # no request: the name reads as a path
    assert main(["explore", "runs/x", "--revisions", "all"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1
        and "does not exist here" in err
        and "./runs is a folder here" in err
    ), err


def exported(path) -> dict:
    page = path.read_text(encoding="utf-8")
    return json.loads(
        page.split("window.ATTNLAB_EXPORT = ", 1)[1].split(";</script>", 1)[0].replace("<\\/", "</")
    )


def test_export_html_knocks_out_heads_from_the_command_line(model_dir, tmp_path):
    """export-html --ablate L.H,... --ablation mean: the page holds the ablated model's responses,
    as attnlab.show's."""
    out = tmp_path / "knockout.html"
    args = [
        "export-html",
        str(model_dir),
        "--text",
        TEXT,
        "-o",
        str(out),
        "--view",
        "next",
        "--ablate",
        "1.2, 1.0",
    ]
    assert main([*args, "--ablation", "mean"]) == 0
    data = exported(out)
    assert (
        data["ablate"] == [[1, 2], [1, 0]] and data["ablation"] == "mean" and data["view"] == "next"
    )
    model = attnlab.load(model_dir)
    mean = export_data(model, TEXT, name="tiny-gpt", ablate=[(1, 2), (1, 0)], ablation="mean")
    timeless = lambda responses: {
        k: {f: v for f, v in r.items() if f != "cost"} for k, r in responses.items()
    }  # noqa: E731
    # the server's time aside
    assert timeless(data["responses"]) == timeless(json.loads(json.dumps(mean["responses"])))
    assert main(args) == 0  # zero ablation is the default, and another model
    zero = exported(out)["responses"]
    key = request_key(
        "/api/knockout",
        {"model": "tiny-gpt", "text": TEXT, "ablate": [[1, 2], [1, 0]], "ablation": "zero"},
    )
    assert (
        zero[key]["loss_after"] != mean["responses"][key.replace('"zero"', '"mean"')]["loss_after"]
    )


def test_export_with_ablate_runs_the_next_token_pass_once_for_the_top_10_and_top_50(monkeypatch):
    """The ablated model's top 10 (the next-token view) and top 50 (its before / after columns) come
    from one forward pass, the intact model's top 50 from another: 2 passes where there were 3; the
    top 10 is the server's answer to the same request."""
    from attnlab.explorer.models import Variant

    model = small_models()["gpt"]
    passes, per_call = [], []
    next_token = Explorer.next_token

    def counted(self, *args, **kwargs):
        before = len(passes)
        answer = next_token(self, *args, **kwargs)
        per_call.append(len(passes) - before)
        return answer

    monkeypatch.setattr(Explorer, "next_token", counted)
    handle = model.register_forward_hook(lambda *args: passes.append(1))
    try:
        data = export_data(model, TEXT, name="gpt", ablate=[(1, 2)])
    finally:
        handle.remove()
    # the ablated top 50 (and top 10 from it), then the intact top 50
    assert per_call == [1, 1], per_call
    body = {
        "model": "gpt",
        "text": TEXT,
        "ablate": [[1, 2]],
        "ablation": "zero",
        "temperature": 1,
        "top_k": None,
        "top_p": None,
    }
    server = Explorer({"gpt": model})
    for k in (10, 50):
        answer = next_token(server, "gpt", TEXT, k=k, variant=Variant(((1, 2),), "zero"))
        assert data["responses"][request_key("/api/next", {**body, "k": k})] == export_round(
            answer
        ), k


@pytest.mark.parametrize(
    "heads, words",
    [
        ("1-2", "--ablate '1-2': give heads as LAYER.HEAD"),
        ("9.0", "layer 9 is out of range"),
        ("1.2,1.2", "listed twice"),
    ],
    ids=["spelling", "out-of-range", "twice"],
)
def test_export_html_bad_heads_are_one_line(model_dir, tmp_path, capsys, heads, words):
    out = tmp_path / "x.html"
    assert (
        main(["export-html", str(model_dir), "--text", TEXT, "-o", str(out), "--ablate", heads])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and not out.exists(), err
