"""The `edge` command and the verification script, run as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_generate_json_with_no_model_argument() -> None:
    r = run("-m", "edge.cli", "generate", "--prompt", "Hello", "--max-tokens", "12", "--kv", "paged", "--page-size", "8", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 12
    assert out["finish_reason"] == "length"
    assert set(out) >= {"token_ids", "text", "finish_reason", "ttft_ms", "decode_tok_s"}


def test_generate_same_tokens_for_contiguous_and_paged() -> None:
    outs = []
    for kv in ("contiguous", "paged"):
        r = run("-m", "edge.cli", "generate", "--prompt-ids", "5,6,7,8,9", "--max-tokens", "20", "--kv", kv, "--ignore-eos", "--json")
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout)["token_ids"])
    assert outs[0] == outs[1]


def test_missing_model_directory_is_a_clear_error() -> None:
    r = run("-m", "edge.cli", "generate", "--model", "/nonexistent/model", "--max-tokens", "2")
    assert r.returncode == 2
    assert "does not exist" in r.stderr


def test_verify_options_and_help() -> None:
    """`edge verify` takes the script's options (they were once all "unrecognized")."""
    for cmd in (("-m", "edge.cli", "verify", "--help"), ("tools/verify_paged.py", "--help")):
        r = run(*cmd)
        assert r.returncode == 0, r.stderr
        assert all(opt in r.stdout for opt in ("--quantize", "--json", "--model", "--min-tokens")), r.stdout
    r = run("-m", "edge.cli", "verify", "--quantize", "int3")
    assert r.returncode == 2 and "invalid choice: 'int3'" in r.stderr, r.stderr


def test_edge_verify_exits_zero() -> None:
    # 12 tokens a case (the CPU default is 24): every case and mode still compared, in half the decode steps.
    r = run("-m", "edge.cli", "verify", "--json", "--min-tokens", "12", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["ok"]
    cases = {row["case"] for row in report["rows"]}
    assert {"shorter-than-page", "exactly-one-page", "several-pages", "long-decode", "multi-turn"} <= cases
    # The vision-language model's prompts hold an image (qwen3-vl-tiny on the CPU).
    image_rows = [row for row in report["rows"] if row["case"].startswith("image")]
    assert {row["case"] for row in image_rows} == {"image", "image-multi-turn"}
    assert all(row["model"].startswith("qwen3-vl-tiny") and row["compared"] >= 12 for row in image_rows)
    assert all(row["mismatch_at"] is None for row in report["rows"])


def test_cuda_without_usable_kernels_stops_with_one_line_naming_the_fix() -> None:
    """On a CUDA device whose kernels cannot load (simulated: no usable GPU here), the
    backend does not fall back to the slow reference: it stops with one line naming
    what is missing and the fix. (`edge generate --device cuda` where torch sees no GPU
    at all stops before this, naming --device cpu: tests/test_validate.py.)"""
    import pytest
    import torch

    from edge.model.config import ModelConfig
    from edge.model.random_model import default_model_path
    from edge.runtime.backend import BackendUnavailable, select_backend

    if torch.cuda.is_available():
        pytest.skip("a usable GPU is present: the failure cannot be simulated this way")
    cfg = ModelConfig.from_pretrained(default_model_path())
    with pytest.raises(BackendUnavailable) as info:
        select_backend(cfg, torch.device("cuda"), torch.bfloat16, kernels="auto")
    line = str(info.value)
    assert line.startswith("CUDA kernels cannot be used") and "\n" not in line
    assert "--kernels reference" in line and "pip install" in line


def test_explicit_reference_choice_is_not_an_error(tmp_path: Path) -> None:
    """The operator may choose the reference explicitly; the backend then says so."""
    from edge.runtime.backend import select_backend
    from edge.model.config import ModelConfig
    from edge.model.random_model import default_model_path

    cfg = ModelConfig.from_pretrained(default_model_path())
    b = select_backend(cfg, __import__("torch").device("cuda"), __import__("torch").bfloat16, kernels="reference")
    assert b.kind == "reference" and b.graph is None
    assert any("chosen by the operator" in n for n in b.planned_reference)
    assert b.describe()["attention"] == "reference (torch)"


BAD_FLAGS = [
    (("serve", "--queue-size", "0"), "--queue-size"),
    (("serve", "--port", "99999"), "--port"),
    (("serve", "--page-size", "12"), "power of two"),
    (("serve", "--model", "README.md"), "expects a model directory"),
    (("serve", "--dtype", "int3"), "unsupported dtype"),
    (("generate", "--page-size", "3"), "power of two"),
    (("generate", "--max-seq-len", "0"), "positive integer"),
    (("generate", "--temperature", "-1"), "--temperature"),
    (("generate", "--top-p", "1.5"), "--top-p"),
    (("generate", "--memory-utilization", "2"), "--memory-utilization"),
    (("generate", "--prompt-ids", "1,x,3"), "--prompt-ids"),
    (("generate", "--device", "tpu"), "unknown device"),
    (("chat", "--in-process", "--kv-blocks", "-4"), "positive integer"),
    (("info", "--model", "/nonexistent/model"), "does not exist"),
]


def test_bad_flags_fail_before_loading_in_one_line() -> None:
    for args, needle in BAD_FLAGS:
        r = run("-m", "edge.cli", *args, timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], (args, r.stderr)
        assert "KV budget" not in r.stderr and "loading model" not in r.stderr  # nothing was loaded


def test_generate_goes_through_the_scheduler(monkeypatch, capsys) -> None:
    """`edge generate` drives the scheduler the service runs, never Engine.stream/generate."""
    from edge import cli
    from edge.runtime.engine import Engine
    from edge.scheduling import Scheduler

    def refuse(*_args, **_kwargs):
        raise AssertionError("edge generate must not call Engine.stream/generate")

    monkeypatch.setattr(Engine, "stream", refuse)
    monkeypatch.setattr(Engine, "generate", refuse)
    handles = []
    real_submit = Scheduler.submit

    def submit(self, *args, **kwargs):
        handles.append(real_submit(self, *args, **kwargs))
        return handles[-1]

    monkeypatch.setattr(Scheduler, "submit", submit)
    assert cli.main(["generate", "--prompt-ids", "5,6,7", "--max-tokens", "6", "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(handles) == 1 and handles[0].finished
    assert out["token_ids"] == handles[0].result(1).token_ids and len(out["token_ids"]) == 6
    assert out["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 6


def test_image_for_a_text_model_is_one_line(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """`edge generate --image` on the embedded text model: one line, not the template's TypeError."""
    from PIL import Image

    from edge.cli import main

    image = tmp_path / "green.png"
    Image.new("RGB", (32, 32), (10, 200, 10)).save(image)
    assert main(["generate", "--image", str(image), "--max-tokens", "2"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("edge:")]
    assert err and "is not a vision-language model: it takes no images" in err[0], err


def test_image_part_for_a_text_model_is_a_400() -> None:
    """The API: an image_url part sent to a text model is a 400 naming the part, before any template runs."""
    import pytest

    from edge.model.random_model import default_model_path
    from edge.runtime.engine import Engine
    from edge.serving.errors import BadRequest
    from edge.serving.prompts import encode_request
    from edge.serving.schema import ChatCompletionRequest, parse_request

    engine = Engine.from_pretrained(default_model_path(), device="cpu", max_seq_len=256)
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "text", "text": "What is it?"}]}]}
    req = parse_request(json.dumps(body).encode(), ChatCompletionRequest)
    with pytest.raises(BadRequest) as info:
        encode_request(engine, req, "chat")
    assert "\n" not in str(info.value) and "image" in str(info.value), info.value
    with pytest.raises(ValueError, match="not a vision-language model"):
        engine.chat_prompt([{"role": "user", "content": [{"type": "image", "image": b"x"}, {"type": "text", "text": "hi"}]}])


def test_generate_at_the_end_of_the_context_counts_as_the_server(capsys) -> None:  # noqa: ANN001
    """Prompt and completion fill the context at most, in `edge generate`, the Python API
    and the server alike (the CLI once emitted one token more than the server)."""
    from edge.cli import main
    from edge.runtime.engine import Engine
    from edge.sampling import SamplingParams
    from edge.scheduling import Scheduler
    from edge.serving.schema import CompletionRequest, parse_request, sampling_params

    ctx, prompt = 32, list(range(5, 35))  # 30 tokens: room for 2
    body = json.dumps({"prompt": prompt, "max_tokens": 10}).encode()
    server = sampling_params(parse_request(body, CompletionRequest), len(prompt), ctx).max_tokens
    engine = Engine.from_pretrained(device="cpu", max_seq_len=ctx)
    api = engine.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True))
    sched = Scheduler(engine, queue_size=1)
    sched.start()
    try:
        scheduled = sched.submit(prompt, SamplingParams(max_tokens=10, ignore_eos=True)).result(timeout=120)
    finally:
        sched.stop()
    assert main(["generate", "--max-seq-len", str(ctx), "--prompt-ids", ",".join(map(str, prompt)),
                 "--max-tokens", "10", "--ignore-eos", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert server == 2
    assert len(api.token_ids) == len(scheduled.token_ids) == len(cli["token_ids"]) == server
    assert cli["finish_reason"] == "length" and "message" not in cli


def test_version() -> None:
    from edge import __version__

    r = run("-m", "edge.cli", "--version")
    assert r.returncode == 0 and r.stdout.strip() == f"edge {__version__}", (r.stdout, r.stderr)
