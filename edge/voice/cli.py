"""``edge voice``: its options, and the glue that builds the session from them.

Only argparse at import time: ``edge --help`` must not load audio engines.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger("edge.voice")

DEFAULT_SYSTEM = "You are a voice assistant. Answer in short spoken sentences, without lists or markup."


def add_voice_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("audio in (default: the microphone)")
    g.add_argument("--input", metavar="FILE.wav|-", help="a WAV file, or - for raw 16-bit PCM on stdin; "
                   "played in at real time, the session ends with it")
    g.add_argument("--input-rate", type=int, default=16000, help="sample rate of PCM on stdin (default 16000)")
    g.add_argument("--input-channels", type=int, default=1, help="channels of PCM on stdin (default 1)")
    g.add_argument("--mic-device", help="PortAudio input device name or index")
    g = p.add_argument_group("audio out (default: the speaker)")
    g.add_argument("--output", metavar="FILE.wav", help="write what the speaker would play, silences included")
    g.add_argument("--speaker-device", help="PortAudio output device name or index")
    g.add_argument("--no-audio", action="store_true", help="print the answers instead of speaking them")
    g = p.add_argument_group("listening")
    g.add_argument("--vad-threshold", type=float, default=0.5, help="speech probability threshold (default 0.5)")
    g.add_argument("--silence-ms", type=float, default=500.0, help="trailing silence ending an utterance (default 500)")
    g.add_argument("--min-speech-ms", type=float, default=64.0,
                   help="speech needed for an onset, and so for a barge-in (default 64)")
    g.add_argument("--partial-ms", type=float, default=300.0,
                   help="prefill a changed partial transcript at most this often; 0 = never (default 300)")
    g.add_argument("--no-barge-in", action="store_true", help="speech during an answer does not interrupt it")
    g.add_argument("--on-eof", choices=("finish", "cancel"), default="finish",
                   help="when the input ends: let the answer finish, or cancel it (default finish)")
    g = p.add_argument_group("engines (defaults: pocketsphinx and espeak-ng, no download)")
    g.add_argument("--whisper-model", metavar="DIR", help="faster-whisper (CTranslate2) model directory")
    g.add_argument("--whisper-device", default="auto", help="cpu, cuda or auto (default auto)")
    g.add_argument("--whisper-compute-type", default="default", help="e.g. int8, float16 (default: the model's)")
    g.add_argument("--language", default="en", help="Whisper's language (default en)")
    g.add_argument("--piper-voice", metavar="FILE.onnx", help="Piper voice model (its .onnx.json beside it)")
    g.add_argument("--piper-speaker", type=int, help="speaker id of a multi-speaker Piper voice")
    g.add_argument("--piper-cuda", action="store_true", help="run Piper on the GPU (onnxruntime-gpu)")
    g.add_argument("--tts-voice", default="en-us", help="espeak-ng voice (default en-us)")
    g.add_argument("--tts-rate", type=int, default=175, help="espeak-ng words per minute (default 175)")
    g = p.add_argument_group("conversation")
    g.add_argument("--system", default=DEFAULT_SYSTEM, help="system prompt ('' for none)")
    g.add_argument("--json", action="store_true",
                   help="one JSON object per turn on stdout (transcript, answer, heard text, usage, timings); "
                        "the conversation text goes to stderr")
    g.add_argument("--tools", help="file of OpenAI tools (a JSON list, docs/examples/tools.json) the model may call")
    g.add_argument("--tool-handler", metavar="MODULE:FUNCTION",
                   help="runs each call as FUNCTION(name, arguments); its result goes back to the model, whose "
                        "answer is spoken (docs/structured.md)")
    g.add_argument("--tool-choice", choices=("auto", "required"), default=None,
                   help="with --tools: required makes the first answer of a turn a call (default auto)")


def run_voice(args: argparse.Namespace, connect: Callable[[], Any], params: dict[str, Any]) -> int:
    from edge.voice.player import Player, SpeakerSink, WavSink
    from edge.voice.session import VoiceOptions, VoiceSession
    from edge.voice.vad import SileroVad

    if not args.verbose:  # one line per HTTP request would drown the turns
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.no_audio and args.output:
        raise ValueError("--output and --no-audio exclude each other")
    handler = None
    if args.tool_handler:
        from edge.voice.tools import load_handler

        if "tools" not in params:
            raise ValueError("--tool-handler needs --tools FILE")
        handler = load_handler(args.tool_handler)
    source = _source(args)
    vad = SileroVad()
    recognizer = _recognizer(args)
    synthesizer = None if args.no_audio else _synthesizer(args)
    player = Player(synthesizer.sample_rate) if synthesizer is not None else None
    sink = None
    if player is not None:
        sink = WavSink(args.output, player) if args.output else SpeakerSink(player, _device(args.speaker_device))
    probe = connect()
    try:
        probe.wait_ready(args.wait, on_wait=lambda msg: print(msg, file=sys.stderr, flush=True))
    finally:
        probe.close()
    log.info("listening: VAD silero (%s), ASR %s, TTS %s, service %s", vad.model.name, recognizer.name,
             f"{synthesizer.name} {synthesizer.sample_rate} Hz" if synthesizer else "off (--no-audio)", probe.where)
    options = VoiceOptions(
        vad_threshold=args.vad_threshold, silence_ms=args.silence_ms, min_speech_ms=args.min_speech_ms,
        partial_ms=args.partial_ms, barge_in=not args.no_barge_in, on_eof=args.on_eof,
        system=args.system or None, params=params, tool_handler=handler,
    )
    session = VoiceSession(connect, source, vad, recognizer, synthesizer, player, sink, options,
                           out=sys.stderr if args.json else sys.stdout, json_out=sys.stdout if args.json else None)
    return session.run()


def _device(name: str | None) -> str | int | None:
    return int(name) if name is not None and name.isdigit() else name


def _source(args: argparse.Namespace):
    from edge.voice.audio_io import MicSource, PcmSource, WavSource

    if args.input == "-":
        return PcmSource(sys.stdin.buffer, args.input_rate, args.input_channels)
    if args.input:
        return WavSource(args.input)
    return MicSource(_device(args.mic_device))


def _recognizer(args: argparse.Namespace):
    import functools
    from pathlib import Path

    from edge.voice.asr import (
        PocketSphinxRecognizer,
        RecognizerProcess,
        WhisperRecognizer,
    )

    if args.whisper_model:
        if not Path(args.whisper_model).is_dir():
            raise ValueError(f"--whisper-model {args.whisper_model}: not a directory")
        return RecognizerProcess(functools.partial(WhisperRecognizer, args.whisper_model, args.whisper_device,
                                                   args.whisper_compute_type, args.language))
    return RecognizerProcess(PocketSphinxRecognizer)


def _synthesizer(args: argparse.Namespace):
    from edge.voice.tts import EspeakSynthesizer, PiperSynthesizer

    if args.piper_voice:
        return PiperSynthesizer(args.piper_voice, args.piper_speaker, args.piper_cuda)
    return EspeakSynthesizer(args.tts_voice, args.tts_rate)
