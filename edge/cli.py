"""The ``edge`` command: generate, chat, voice, info, verify, pull, monitor, serve."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from edge.runtime.budget import parse_kv_dtype
from edge.runtime.memory_plan import EXIT_DOES_NOT_FIT, DoesNotFit
from edge.settings import from_environment, non_negative_float, positive_int, power_of_two

if TYPE_CHECKING:
    from edge.serving.chat_client import ChatClient, InProcessService
    from edge.model.vision.runtime import MultimodalPrompt

DEFAULT_PROMPT = "The robot on the kiosk said hello and explained how the paged cache works:"


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _checked(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse type from a parser that raises ValueError with a message."""

    def check(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    check.__name__ = parse.__name__
    return check


def _in_range(low: float, high: float, low_open: bool = False) -> Callable[[str], object]:
    def in_range(text: str) -> float:
        v = float(text)
        if not (math.isfinite(v) and (low < v if low_open else low <= v) and v <= high):
            raise ValueError(f"must be in {'(' if low_open else '['}{low:g}, {high:g}], got {text}")
        return v

    return _checked(in_range)


def _non_negative_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise ValueError(f"must be >= 0, got {v}")
    return v


POSITIVE_INT = _checked(positive_int)


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face model directory (default: the embedded random model)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--kv", choices=("paged", "contiguous"), default="paged", help="KV-cache backend")
    p.add_argument("--page-size", type=_checked(power_of_two), default=16, help="tokens per KV block (power of two)")
    p.add_argument("--max-seq-len", type=POSITIVE_INT, help="context length (default: min(model max, 4096))")
    p.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly on the GPU")
    p.add_argument(
        "--kernels",
        choices=("auto", "cuda", "reference"),
        default=os.environ.get("EDGE_KERNELS", "auto"),
        help="auto: the CUDA kernels on a GPU, which must load (else an error naming the fix); "
        "reference: the slow torch reference, chosen explicitly (env EDGE_KERNELS)",
    )
    p.add_argument(
        "--quantize", choices=("int8", "int4"), help="quantize a float checkpoint while loading: int8 (q8_0) or int4 (RTN)"
    )
    p.add_argument(
        "--quant-lm-head", choices=("auto", "float", "int8", "int4"), default="auto", help=LM_HEAD_HELP,
    )
    p.add_argument(
        "--quant-embedding", choices=("auto", "float", "int8"), default="auto", help=EMBEDDING_HELP,
    )
    p.add_argument("--torch-threads", type=POSITIVE_INT, help=THREADS_HELP)
    p.add_argument("--kv-blocks", type=POSITIVE_INT, help="KV pool size in blocks (default: from the memory budget)")
    p.add_argument("--kv-memory", type=_byte_size, help="KV pool size in bytes, e.g. 2GiB, 512MiB (default: budget)")
    p.add_argument(
        "--kv-dtype", type=_checked(parse_kv_dtype),
        help="how K/V rows are held: auto (the model's dtype) or int8 (about twice the tokens in the same "
        "memory; env EDGE_KV_DTYPE)",
    )
    p.add_argument(
        "--memory-utilization", type=_in_range(0, 1, low_open=True), default=0.9,
        help="fraction of available memory to use (default 0.9)"
    )
    p.add_argument("--memory-reserve", type=_reserve_size, help=RESERVE_HELP)
    p.add_argument("--skip-weight-check", action="store_true", help="load weights holding NaN or infinity anyway")


LM_HEAD_HELP = ("how an int4 model holds its lm_head: auto (as published; int8 rows only where only that fits), "
                "float, int8, int4")
EMBEDDING_HELP = "how an int4 model holds its embedding: auto (as published; int8 rows only where only that fits), float, int8"
THREADS_HELP = "torch's CPU threads (default: 2 on a GPU; on the CPU all cores but 2, left to the voice front-end)"
RESERVE_HELP = "memory kept free for the OS and other processes on an integrated GPU, e.g. 2GiB, 0 (default 1.5GiB)"


def _byte_size(text: str) -> int:
    from edge.runtime.budget import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _reserve_size(text: str) -> int:
    from edge.runtime.budget import parse_reserve

    try:
        return parse_reserve(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _service_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="service URL (default: $EDGE_URL or http://127.0.0.1:8000)")
    p.add_argument("--uds", help="service Unix socket (instead of --url)")
    p.add_argument("--api-key-file", help="file holding the bearer key (default: $EDGE_API_KEY)")
    p.add_argument("--in-process", action="store_true", help="start the service inside this process")
    p.add_argument("--wait", type=_checked(non_negative_float), default=120.0,
                   help="seconds to wait for the service to be ready")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    # The ranges of SamplingParams.validate, checked here so that nothing loads first.
    p.add_argument("--max-tokens", type=_checked(_non_negative_int), default=64)
    p.add_argument("--temperature", type=_in_range(0, 100), default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=_checked(_non_negative_int), default=0)
    p.add_argument("--top-p", type=_in_range(0, 1, low_open=True), default=1.0)
    p.add_argument("--repetition-penalty", type=_in_range(0, 10, low_open=True), default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def check_engine_args(model: str | None, device: str | None, dtype: str | None) -> None:
    """Model directory, device and dtype, checked before anything loads."""
    from edge.model.validate import check_device_and_dtype, model_directory

    if model is not None:
        model_directory(model)
    check_device_and_dtype(device, dtype)


def load_engine(args: argparse.Namespace):  # noqa: ANN201 - keeps torch out of `edge --help`
    from edge.runtime.engine import Engine, default_device
    from edge.runtime.threads import apply_threads
    from edge.serving.service import torch_device_type

    check_engine_args(args.model, args.device, args.dtype)
    apply_threads(torch_device_type(args.device, default_device), args.torch_threads)
    return Engine.from_pretrained(
        args.model,
        device=args.device,
        dtype=args.dtype,
        kv_cache=args.kv,
        page_size=args.page_size,
        max_seq_len=args.max_seq_len,
        cuda_graph=False if args.no_cuda_graph else None,
        kernels=args.kernels,
        quantize=args.quantize,
        quant_lm_head=args.quant_lm_head,
        quant_embedding=args.quant_embedding,
        kv_blocks=args.kv_blocks,
        kv_memory=args.kv_memory,
        kv_dtype=args.kv_dtype or from_environment("kv_dtype") or "auto",
        memory_utilization=args.memory_utilization,
        memory_reserve=args.memory_reserve,
        check_weights=not args.skip_weight_check,
    )


def sampling_params(args: argparse.Namespace):  # noqa: ANN201
    from edge.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids takes comma-separated token ids, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise ValueError(f"--prompt-ids takes non-negative token ids, got {text!r}")
    return ids


def cmd_generate(args: argparse.Namespace) -> int:
    """One request through the scheduler the service runs, in this process."""
    from edge.scheduling import Scheduler

    prompt: str | list[int] | None = None  # None: the chat template places --image
    if args.image:
        if args.prompt_ids:
            raise ValueError("--image takes --prompt text (the chat template places the image), not --prompt-ids")
        missing = next((p for p in args.image if not Path(p).is_file()), None)
        if missing is not None:
            raise FileNotFoundError(f"--image {missing}: no such file")
    elif args.prompt_ids:
        prompt = _prompt_ids(args.prompt_ids)
    else:
        prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    params = sampling_params(args)
    params.validate()
    engine = load_engine(args)
    if args.image:
        # One user message: the images, then the text, through the chat template.
        content: list[dict] = [{"type": "image", "image": path} for path in args.image]
        content.append({"type": "text", "text": args.prompt if args.prompt is not None else "Describe this image."})
        prompt_ids: list[int] | MultimodalPrompt = engine.chat_prompt([{"role": "user", "content": content}])
    else:
        assert prompt is not None
        prompt_ids = engine.encode(prompt)
    structured = None
    if args.json_schema or args.tools:
        from edge.structured.local import prepare, read_structured

        if not isinstance(prompt, str):
            raise ValueError("--json-schema / --tools take --prompt text, not --prompt-ids or --image")
        req = read_structured(args.json_schema, args.tools, args.tool_choice)
        # Tools are offered through the chat template, as a chat request would.
        chat = bool(args.tools) and engine.tokenizer is not None and bool(engine.tokenizer.chat_template)
        structured = prepare(engine, req, prompt, chat)
        prompt_ids = structured.prompt_ids
    sched = Scheduler(engine, queue_size=1)
    sched.start()
    try:
        handle = sched.submit(prompt_ids, params, grammar=structured.grammar if structured else None)
        if args.json:
            r = handle.result()
            out = {
                "token_ids": r.token_ids,
                "text": r.text,
                "finish_reason": r.finish_reason,
                "ttft_ms": r.usage.ttft_ms,
                "decode_tok_s": r.usage.decode_tok_s,
                "usage": r.usage.as_dict(),
            }
            if structured is not None and structured.request.calls_tools:
                parsed = structured.parse(r.text)
                out |= {"content": parsed.content, "tool_calls": [c.as_dict() for c in parsed.tool_calls]}
            if r.message:
                out["message"] = r.message
            print(json.dumps(out))
            return 0
        if isinstance(prompt, str) and structured is None:
            print(prompt, end="", flush=True)
        final = None
        text = ""
        for chunk in handle:
            print(chunk.text, end="", flush=True)
            text += chunk.text
            final = chunk
    finally:
        sched.stop()
    if structured is not None and structured.request.calls_tools:
        for call in structured.parse(text).tool_calls:
            print(f"\n[tool call] {call.name}({call.arguments})", file=sys.stderr)
    u = final.usage if final else None
    if u is not None:
        tps = f"{u.decode_tok_s:.1f} tok/s" if u.decode_tok_s else "n/a"
        message = f" ({final.message})" if final.message else ""
        print(
            f"\n[{final.finish_reason}] {u.completion_tokens} tokens, TTFT {u.ttft_ms or 0:.1f} ms, decode {tps}{message}",
            file=sys.stderr,
        )
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    info: dict = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {
            "name": props.name,
            "capability": f"sm_{props.major}{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "integrated": bool(getattr(props, "is_integrated", False)),
            "bf16": torch.cuda.is_bf16_supported(),
        }
    from edge.runtime.platform_info import probe_platform

    info["platform"] = probe_platform().as_dict()
    info["model"] = load_engine(args).info()
    try:
        from edge.monitor import Monitor

        info["monitor"] = Monitor().describe()
    except Exception as exc:  # monitoring is informative here, never fatal
        info["monitor"] = {"error": str(exc)}
    print(json.dumps(info, indent=2))
    return 0


def _chat_params(args: argparse.Namespace) -> dict:
    params = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "repetition_penalty": args.repetition_penalty,
        "ignore_eos": args.ignore_eos,
    }
    if args.seed is not None:
        params["seed"] = args.seed
    if args.stop:
        params["stop"] = args.stop
    if getattr(args, "tools", None):
        data = json.loads(Path(args.tools).read_text(encoding="utf-8"))
        params["tools"] = data.get("tools") if isinstance(data, dict) else data
        if getattr(args, "tool_choice", None):
            params["tool_choice"] = args.tool_choice
    return params


def _open_service(args: argparse.Namespace) -> tuple[Callable[[], ChatClient], InProcessService | None]:
    """The service a front-end talks to: --url/--uds, or started here with --in-process."""
    from edge.serving.chat_client import ChatClient, InProcessService

    if not args.verbose:  # one INFO line per HTTP request would land inside the conversation
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
    api_key = os.environ.get("EDGE_API_KEY")
    if args.api_key_file:
        from edge.settings import read_api_key

        api_key = read_api_key(args.api_key_file)
    if not args.in_process:
        url = args.url or os.environ.get("EDGE_URL")
        return (lambda: ChatClient(url=url, uds=args.uds, api_key=api_key)), None
    from edge.settings import Settings

    check_engine_args(args.model, args.device, args.dtype)
    logging.getLogger().setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    local = InProcessService(
        Settings(
            model=args.model, device=args.device, dtype=args.dtype, page_size=args.page_size,
            max_seq_len=args.max_seq_len, cuda_graph=False if args.no_cuda_graph else None,
            skip_weight_check=getattr(args, "skip_weight_check", False),
            kv_dtype=args.kv_dtype or from_environment("kv_dtype") or "auto",
            log_level="debug" if args.verbose else "warning",
        )
    )
    return (lambda: ChatClient(uds=local.uds, api_key=api_key)), local


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive front-end for the service (see edge.serving.chat_client)."""
    from edge.serving.chat_client import ServiceError, run_chat

    connect, local = _open_service(args)
    client = connect()
    try:
        client.wait_ready(args.wait, on_wait=lambda msg: print(msg, file=sys.stderr, flush=True))
        return run_chat(client, _chat_params(args))
    except ServiceError as exc:
        print(f"edge: error: {exc.message}", file=sys.stderr)
        return 1
    finally:
        client.close()
        if local is not None:
            local.stop()


def cmd_voice(args: argparse.Namespace) -> int:
    """Voice front-end for the service (see edge.voice)."""
    from edge.serving.chat_client import ServiceError
    from edge.voice.cli import run_voice

    connect, local = _open_service(args)
    try:
        return run_voice(args, connect, _chat_params(args))
    except ServiceError as exc:
        print(f"edge: error: {exc.message}", file=sys.stderr)
        return 1
    finally:
        if local is not None:
            local.stop()


def cmd_serve(args: argparse.Namespace) -> int:
    from edge.settings import export_file_vars, resolve

    cli = {k: getattr(args, k, None) for k in (
        "model", "model_name", "host", "port", "uds", "api_key_file", "queue_size", "device", "dtype", "kernels",
        "page_size", "max_seq_len", "kv_blocks", "kv_memory", "kv_dtype", "memory_reserve", "prefill_chunk",
        "prefill_budget_ms", "speculative", "draft_model", "config", "log_level", "grammar_time_limit_s", "quantize",
        "quant_lm_head", "quant_embedding", "torch_threads")}
    cli["skip_weight_check"] = args.skip_weight_check or None
    settings, file_vars = resolve(cli)
    # The fit check first: before torch is imported, a model that cannot fit is refused in one line.
    from edge.runtime.memory_plan import fit_settings

    if settings.model is not None:
        from edge.model.validate import model_directory

        model_directory(settings.model)
    try:
        fit_settings(settings)
    except DoesNotFit:
        raise
    except ValueError as exc:  # a broken checkpoint, found before loading: the service's load-failure line
        logging.getLogger("edge.serving.service").error("model load failed: %s", exc)
        return 1
    check_engine_args(settings.model, settings.device, settings.dtype)
    export_file_vars(file_vars)
    if not args.verbose:
        logging.getLogger().setLevel(settings.log_level.upper())
    from edge.serving.server import serve

    return serve(settings)


def cmd_plan(args: argparse.Namespace) -> int:
    """What a model needs in memory and whether it fits here or on a board; nothing loads."""
    from edge.runtime import memory_plan as mp
    from edge.runtime.boards import BOARDS, board

    ckpts = [mp.Checkpoint.from_dir(model_directory_arg(args.model))] if args.model else []
    if args.preset:
        from edge.model.random_model import model_config

        ckpts += [mp.Checkpoint.from_config(model_config(preset=name), name) for name in args.preset]
    if not ckpts:
        raise ValueError("edge plan needs --model DIR or --preset NAME")
    boards = list(BOARDS.values()) if args.board == "all" else [board(args.board)] if args.board else []
    if args.table:
        print(mp.board_table(ckpts, boards or list(BOARDS.values()), args.max_seq_len, args.page_size))
        return 0
    plans = []
    for ckpt in ckpts:
        for b in boards or [None]:
            kind = "integrated" if b is not None else mp.memory_kind(args.device)
            memory = mp.board_memory(b) if b is not None else mp.probe(kind)
            opts = dict(kind=kind, memory=memory, board=b, dtype=args.dtype, max_seq_len=args.max_seq_len,
                        page_size=args.page_size, kv_dtype=args.kv_dtype, reserve=args.memory_reserve)
            p = mp.plan(ckpt, quantize=args.quantize, lm_head=args.quant_lm_head, embedding=args.quant_embedding,
                        **opts)
            plans.append(mp.resolve(p, ckpt, args.quant_lm_head, args.quant_embedding, quantize=args.quantize,
                                    **opts))
    if args.json:
        print(json.dumps([p.as_dict() for p in plans] if len(plans) > 1 else plans[0].as_dict(), indent=2))
    else:
        print("\n\n".join(p.describe() for p in plans))
    return 0


def model_directory_arg(path: str) -> Path:
    from edge.model.validate import model_directory

    return model_directory(path)


def cmd_verify(args: argparse.Namespace) -> int:
    from edge.runtime.verify import run as verify_run

    return verify_run(args)


def cmd_pull(args: argparse.Namespace) -> int:
    """Download a checkpoint from the Hugging Face Hub (edge.model.hub); its directory on stdout."""
    from edge.model.hub import CATALOGUE, default_directory, pull, recommended, resolve
    from edge.model.random_model import cache_dir

    if args.model is None:
        from edge.runtime.budget import fmt_bytes, host_memory

        width = max(len(c.name) for c in CATALOGUE)
        print("checkpoints (edge pull NAME, or any Hugging Face repository id owner/name):")
        for c in CATALOGUE:
            print(f"  {c.name:<{width}}  {c.repo:<28} {c.format}; for {c.boards}")
        total = host_memory()[0]
        print(f"recommended for this machine ({fmt_bytes(total)} of memory): edge pull {recommended(total).name}")
        return 0
    repo = resolve(args.model)
    directory = Path(args.dir).expanduser() if args.dir else default_directory(repo, cache_dir() / "models")
    print(f"edge: downloading {repo} into {directory} (if interrupted, the same command resumes)", file=sys.stderr)
    try:
        path = pull(repo, directory, args.revision)
    except KeyboardInterrupt:
        print("\nedge: pull interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    print(f"edge: ready: edge generate --model {path}", file=sys.stderr)
    print(path)
    return 0


def cmd_monitor(args: argparse.Namespace) -> int:
    from edge.monitor import run_monitor_cli

    return run_monitor_cli(args.period, args.count, args.json, args.source, args.sysfs_root)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("edge-llm")
    except PackageNotFoundError:  # run from a source tree that pip did not install
        from edge import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="edge", description="LLM inference for NVIDIA Jetson Orin")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"edge {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate from a prompt (default: the embedded model)")
    _engine_args(g)
    _sampling_args(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument(
        "--image", action="append", default=[], help="image file for a vision-language model (repeatable); "
        "the prompt then goes through the chat template as one user message: the images, then the text"
    )
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--json-schema", help="JSON Schema file the output must follow (docs/structured.md)")
    g.add_argument("--tools", help="file of OpenAI tools (a JSON list): the prompt goes through the chat template "
                   "with them and the model may call them")
    g.add_argument("--tool-choice", help="with --tools: auto (default), required, none or a tool's name")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with the service (or --in-process)")
    _service_args(c)
    _engine_args(c)
    _sampling_args(c)
    c.add_argument("--tools", help="file of OpenAI tools (a JSON list) offered to the model; its calls are shown")
    c.set_defaults(func=cmd_chat, max_tokens=256)

    # argparse only: the audio engines load when the command runs
    from edge.voice.cli import add_voice_args

    vo = sub.add_parser("voice", help="talk to the service: listen, transcribe, speak the answer, barge in")
    _service_args(vo)
    _engine_args(vo)
    _sampling_args(vo)
    add_voice_args(vo)
    vo.set_defaults(func=cmd_voice, max_tokens=128)

    s = sub.add_parser("serve", help="run the HTTP service (OpenAI-compatible API, /health, /metrics)",
                       description="Settings: command line > environment (EDGE_*) > --config file > defaults.")
    s.add_argument("--model", help="model directory [EDGE_MODEL] (default: the embedded random model)")
    s.add_argument("--model-name", help="model id served in the API [EDGE_MODEL_NAME] (default: directory name)")
    s.add_argument("--host", help="TCP address [EDGE_HOST] (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="TCP port [EDGE_PORT] (default 8000)")
    s.add_argument("--uds", help="listen on this Unix socket instead of TCP [EDGE_UDS]")
    s.add_argument("--api-key-file", help="require 'Authorization: Bearer <key in file>' [EDGE_API_KEY_FILE]")
    s.add_argument("--queue-size", type=int, help="waiting requests before 429 [EDGE_QUEUE_SIZE] (default 8)")
    s.add_argument("--device", help="cpu or cuda [EDGE_DEVICE]")
    s.add_argument("--dtype", help="float32, bfloat16 or float16 [EDGE_DTYPE]")
    s.add_argument("--kernels", choices=("auto", "cuda", "reference"),
                   help="auto: the CUDA kernels on a GPU, which must load; reference: the slow torch path, "
                   "chosen explicitly [EDGE_KERNELS]")
    s.add_argument("--page-size", type=int, help="tokens per KV block [EDGE_PAGE_SIZE] (default 16)")
    s.add_argument("--max-seq-len", type=int, help="context length [EDGE_MAX_SEQ_LEN]")
    s.add_argument("--kv-blocks", type=int, help="KV block pool size [EDGE_KV_BLOCKS]")
    s.add_argument("--kv-memory", type=_byte_size, help="KV pool size in bytes, e.g. 2GiB [EDGE_KV_MEMORY]")
    s.add_argument("--kv-dtype", help="K/V rows: auto (the model's dtype) or int8 [EDGE_KV_DTYPE] (default auto)")
    s.add_argument("--memory-reserve", type=_reserve_size, help=f"{RESERVE_HELP} [EDGE_MEMORY_RESERVE]")
    s.add_argument("--prefill-chunk", type=int, help="largest background prefill chunk in tokens [EDGE_PREFILL_CHUNK]")
    s.add_argument("--prefill-budget-ms", help="time one background prefill chunk may take [EDGE_PREFILL_BUDGET_MS] "
                   "(default: twice the active conversation's inter-token latency, measured)")
    s.add_argument("--speculative", help="speculative decoding of requests that do not choose: ngram[:K], "
                   "draft[:K] or off [EDGE_SPECULATIVE] (default off)")
    s.add_argument("--draft-model", help="draft model directory (same tokenizer) for speculative method "
                   "'draft' [EDGE_DRAFT_MODEL]")
    s.add_argument("--grammar-time-limit-s", help="seconds a request's response format / tools may take to compile "
                   "into a grammar before a 400 [EDGE_GRAMMAR_TIME_LIMIT_S] (default 10)")
    s.add_argument("--log-level", help="debug, info, warning, error [EDGE_LOG_LEVEL] (default info)")
    s.add_argument("--skip-weight-check", action="store_true",
                   help="load weights holding NaN or infinity anyway [EDGE_SKIP_WEIGHT_CHECK]")
    s.add_argument("--quantize", choices=("int8", "int4"),
                   help="quantize a float checkpoint while loading: int8 (q8_0) or int4 (RTN) [EDGE_QUANTIZE]")
    s.add_argument("--quant-lm-head", choices=("auto", "float", "int8", "int4"),
                   help=f"{LM_HEAD_HELP} [EDGE_QUANT_LM_HEAD]")
    s.add_argument("--quant-embedding", choices=("auto", "float", "int8"), help=f"{EMBEDDING_HELP} [EDGE_QUANT_EMBEDDING]")
    s.add_argument("--torch-threads", type=POSITIVE_INT, help=f"{THREADS_HELP} [EDGE_TORCH_THREADS]")
    s.add_argument("--config", help="KEY=VALUE environment file, as systemd's EnvironmentFile [EDGE_CONFIG]")
    s.set_defaults(func=cmd_serve)

    pl = sub.add_parser("plan", help="what a model needs in memory, by part, and whether it fits (loads nothing)",
                        description="Weights by part, KV bytes per token for each KV dtype, activations, the "
                        "contexts that fit and what is left for the OS and the voice front-end: here (probed) or "
                        "on a board.")
    pl.add_argument("--model", help="model directory (config.json and safetensors headers are read)")
    pl.add_argument("--preset", action="append", default=[], help="a preset's shape instead (qwen3-1.7b, qwen3-4b, "
                    "qwen3-8b, ...; repeatable): no files needed")
    from edge.runtime.boards import BOARDS

    pl.add_argument("--board", choices=(*BOARDS, "all"), help="plan for this board's memory instead of this machine's")
    pl.add_argument("--device", help="cpu or cuda (default: what this machine has)")
    pl.add_argument("--dtype", help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on GPU)")
    pl.add_argument("--quantize", choices=("int8", "int4"), help="quantize a float checkpoint while loading")
    pl.add_argument("--quant-lm-head", choices=("auto", "float", "int8", "int4"), default="auto", help=LM_HEAD_HELP)
    pl.add_argument("--quant-embedding", choices=("auto", "float", "int8"), default="auto", help=EMBEDDING_HELP)
    pl.add_argument("--max-seq-len", type=POSITIVE_INT, help="context length (default: min(model max, 4096))")
    pl.add_argument("--page-size", type=_checked(power_of_two), default=16, help="tokens per KV block")
    pl.add_argument("--kv-dtype", choices=("auto", "int8"), help="how K/V rows are held: auto (the model's dtype) or "
                    "int8 (codes and a float32 scale a row)")
    pl.add_argument("--memory-reserve", type=_reserve_size, help=RESERVE_HELP)
    pl.add_argument("--json", action="store_true", help="print JSON")
    pl.add_argument("--table", action="store_true", help="a markdown table: each model in bf16, int8 and int4 on "
                    "each board (docs/orin.md)")
    pl.set_defaults(func=cmd_plan)

    i = sub.add_parser("info", help="device, dtype support and model summary as JSON")
    _engine_args(i)
    i.set_defaults(func=cmd_info)

    from edge.runtime.verify_args import DESCRIPTION as VERIFY_DESCRIPTION, add_verify_args

    v = sub.add_parser("verify", help="diff contiguous and paged KV paths token by token",
                       description=VERIFY_DESCRIPTION)
    add_verify_args(v)
    v.set_defaults(func=cmd_verify)

    pl = sub.add_parser("pull", help="download a checkpoint from the Hugging Face Hub (no argument: the list, "
                        "and the one recommended for this board)")
    pl.add_argument("model", nargs="?", help="a name from the list (e.g. qwen3-4b-awq) or a repository id owner/name")
    pl.add_argument("--dir", help="directory to download into (default: the cache, ~/.cache/edge/models/NAME)")
    pl.add_argument("--revision", help="branch, tag or commit (default: main)")
    pl.set_defaults(func=cmd_pull)

    m = sub.add_parser("monitor", help="print live temperature and power samples")
    m.add_argument("--period", type=_in_range(0, 3600, low_open=True), default=1.0, help="seconds between samples")
    m.add_argument("--count", type=POSITIVE_INT, help="stop after N samples")
    m.add_argument("--json", action="store_true", help="JSON lines")
    m.add_argument("--source", choices=("jtop", "sysfs", "nvml", "none"), help="force a source")
    m.add_argument("--sysfs-root", help="sysfs root (default /sys or $EDGE_SYSFS_ROOT)")
    m.set_defaults(func=cmd_monitor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        return 130
    except DoesNotFit as exc:
        print(f"edge: error: {exc}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"edge: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
