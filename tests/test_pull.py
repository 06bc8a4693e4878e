"""`edge pull` without a network: huggingface_hub's snapshot_download is replaced by a fake
that records its arguments, so what is asked of the Hub (repository, directory, revision,
files), the resume after an interruption and each failure's one-line message are checked.
huggingface_hub's own file filter is the oracle for the files fetched."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from huggingface_hub import utils as hub_errors
from huggingface_hub.utils import filter_repo_objects

from edge.cli import main
from edge.model.hub import ALLOW_PATTERNS, CATALOGUE, PullError, recommended, resolve


class FakeHub:
    """snapshot_download: records each call, writes a config.json, or raises ``fail``."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.fail: list[BaseException] = []

    def __call__(self, repo_id: str, **kw: Any) -> str:
        self.calls.append({"repo_id": repo_id, **kw})
        local = Path(kw["local_dir"])
        local.mkdir(parents=True, exist_ok=True)
        (local / "model.safetensors.incomplete").write_bytes(b"x" * len(self.calls))  # what was there so far
        if self.fail:
            raise self.fail.pop(0)
        (local / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
        return str(local)


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeHub:
    fake = FakeHub()
    monkeypatch.setattr("huggingface_hub.snapshot_download", fake)
    monkeypatch.setenv("EDGE_CACHE_DIR", str(tmp_path / "cache"))
    return fake


def http_error(cls: type, status: int) -> Exception:
    response = SimpleNamespace(headers={}, request=None, status_code=status)
    return cls(f"{status} Client Error", response=response)


def test_catalogue_name_downloads_into_the_cache(hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pull", "qwen3-4b-awq"]) == 0
    out, err = capsys.readouterr()
    want = tmp_path / "cache" / "models" / "Qwen3-4B-AWQ"
    assert out.strip() == str(want)  # the directory alone on stdout: --model "$(edge pull ...)"
    assert f"edge generate --model {want}" in err
    (call,) = hub.calls
    assert call["repo_id"] == "Qwen/Qwen3-4B-AWQ" and Path(call["local_dir"]) == want
    assert call["revision"] is None and not call.get("force_download")


def test_repository_id_revision_and_directory(hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pull", "someone/Some-Model", "--revision", "v2", "--dir", str(tmp_path / "here")]) == 0
    (call,) = hub.calls
    assert (call["repo_id"], call["revision"], Path(call["local_dir"])) == ("someone/Some-Model", "v2", tmp_path / "here")


def test_an_interrupted_pull_resumes_into_the_same_directory(hub: FakeHub, capsys: pytest.CaptureFixture[str]) -> None:
    hub.fail.append(KeyboardInterrupt())
    assert main(["pull", "qwen3-1.7b"]) == 130
    assert "run the same command again to resume" in capsys.readouterr().err
    first = Path(hub.calls[0]["local_dir"])
    assert (first / "model.safetensors.incomplete").is_file()  # kept for the Hub's resume
    assert main(["pull", "qwen3-1.7b"]) == 0
    again = hub.calls[1]
    assert Path(again["local_dir"]) == first and not again.get("force_download")
    assert again["allow_patterns"] == hub.calls[0]["allow_patterns"]


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (lambda: http_error(hub_errors.RepositoryNotFoundError, 404), "no repository someone/Missing"),
        (lambda: http_error(hub_errors.GatedRepoError, 403), "is gated"),
        (lambda: http_error(hub_errors.RevisionNotFoundError, 404), "has no revision"),
        (lambda: hub_errors.LocalEntryNotFoundError("Connection refused"), "cannot reach the Hugging Face Hub"),
        (lambda: OSError(28, "No space left on device"), "No space left on device"),
    ],
)
def test_failures_are_one_line(hub: FakeHub, capsys: pytest.CaptureFixture[str], error: Any, words: str) -> None:
    hub.fail.append(error())
    assert main(["pull", "someone/Missing", "--revision", "x"]) == 2
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.startswith("edge: error:")]
    assert out == "" and len(lines) == 1 and words in lines[0], err


def test_a_repository_without_config_is_refused(hub: FakeHub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda repo_id, **kw: str(tmp_path))
    assert main(["pull", "someone/Dataset-Like"]) == 2


def test_names_and_ids() -> None:
    assert resolve("Qwen3-8B-AWQ".lower()) == "Qwen/Qwen3-8B-AWQ" and resolve("a/b") == "a/b"
    for bad in ("nope", "a/b/c", "/b", "a/"):
        with pytest.raises(PullError):
            resolve(bad)
    gib = 2**30
    assert [recommended(n * gib).name for n in (7, 15, 61)] == ["qwen3-1.7b", "qwen3-4b-awq", "qwen3-8b-awq"]
    assert all(c.repo.startswith("Qwen/") for c in CATALOGUE)


def test_only_the_files_the_engine_reads(capsys: pytest.CaptureFixture[str]) -> None:
    files = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
             "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "quant_config.json",
             "additional_chat_templates/tool_use.jinja", "README.md", "LICENSE", "pytorch_model.bin",
             "model.gguf", "onnx/model.onnx", "consolidated.pth", ".gitattributes"]
    chosen = set(filter_repo_objects(files, allow_patterns=ALLOW_PATTERNS))
    assert chosen == {f for f in files if f.endswith((".json", ".safetensors", ".jinja", ".txt"))}


def test_list_and_recommendation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pull"]) == 0
    out = capsys.readouterr().out
    assert all(c.name in out and c.repo in out for c in CATALOGUE)
    assert "recommended for this machine" in out
