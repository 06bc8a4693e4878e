"""Speech recognition behind one small interface.

* :class:`PocketSphinxRecognizer` (default): CMU PocketSphinx with the US-English model
  that its wheel ships; incremental, so partial hypotheses cost almost nothing. CPU.
* :class:`WhisperRecognizer`: faster-whisper (CTranslate2) on a model directory the user
  gives; re-decodes the utterance so far for a partial, so partials are rate-limited by
  the caller. GPU when CTranslate2 was built with CUDA, else CPU int8.

:class:`RecognizerProcess` runs either in a child process: PocketSphinx holds the GIL
through each decoding call, which would stall the voice-activity loop (and so barge-in)
by up to hundreds of milliseconds; a process also gives the recognizer a core of its own.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Protocol

import numpy as np

from edge.voice.audio_io import SAMPLE_RATE, int16_to_float


class Recognizer(Protocol):
    name: str

    def start(self) -> None:
        """A new utterance begins."""

    def accept(self, pcm: np.ndarray) -> None:
        """More int16 samples at 16 kHz."""

    def partial(self) -> str:
        """The best hypothesis so far ('' if none)."""

    def finish(self) -> str:
        """End the utterance; its final transcript."""

    def close(self) -> None: ...


class PocketSphinxRecognizer:
    name = "pocketsphinx"

    def __init__(self, **config: object) -> None:
        try:
            from pocketsphinx import Decoder
        except ImportError as exc:
            raise RuntimeError("the default recognizer needs pocketsphinx: pip install 'edge-llm[voice]'") from exc
        self._decoder = Decoder(samprate=SAMPLE_RATE, loglevel="FATAL", **config)
        self._open = False

    def start(self) -> None:
        if self._open:
            self._decoder.end_utt()
        self._decoder.start_utt()
        self._open = True

    def accept(self, pcm: np.ndarray) -> None:
        self._decoder.process_raw(np.ascontiguousarray(pcm, dtype="<i2").tobytes(), False, False)

    def partial(self) -> str:
        hyp = self._decoder.hyp()
        return hyp.hypstr.strip() if hyp is not None else ""

    def finish(self) -> str:
        if not self._open:
            return ""
        self._decoder.end_utt()
        self._open = False
        return self.partial()

    def close(self) -> None:
        pass


class WhisperRecognizer:
    name = "faster-whisper"

    def __init__(self, model_dir: str | Path, device: str = "auto", compute_type: str = "default",
                 language: str | None = "en", beam_size: int = 1) -> None:
        if not Path(model_dir).is_dir():
            raise ValueError(f"--whisper-model {model_dir}: not a directory (a CTranslate2 Whisper model, "
                             f"e.g. from ct2-transformers-converter)")
        try:
            from faster_whisper import WhisperModel
        except ImportError as exc:
            raise RuntimeError("--whisper-model needs faster-whisper: pip install 'edge-llm[whisper]'") from exc
        self._model = WhisperModel(str(model_dir), device=device, compute_type=compute_type)
        self.language, self.beam_size = language, beam_size
        self._chunks: list[np.ndarray] = []

    def start(self) -> None:
        self._chunks = []

    def accept(self, pcm: np.ndarray) -> None:
        self._chunks.append(np.asarray(pcm, dtype=np.int16))

    def partial(self) -> str:
        return self._transcribe() if self._chunks else ""

    def finish(self) -> str:
        text = self.partial()
        self._chunks = []
        return text

    def close(self) -> None:
        pass

    def _transcribe(self) -> str:
        audio = int16_to_float(np.concatenate(self._chunks))
        segments, _ = self._model.transcribe(audio, language=self.language, beam_size=self.beam_size,
                                             vad_filter=False, condition_on_previous_text=False,
                                             without_timestamps=True)
        return " ".join(s.text.strip() for s in segments).strip()


class RecognizerProcess:
    """A recognizer built by ``factory`` (picklable: a class or functools.partial) in a
    spawned child process. Audio is sent without waiting; ``partial`` and ``finish``
    wait for the child to catch up."""

    def __init__(self, factory: Callable[[], Recognizer], start_timeout: float = 120.0) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(factory, child), name="edge-voice-asr", daemon=True)
        self._proc.start()
        child.close()
        if not self._conn.poll(start_timeout):
            self._proc.kill()
            raise RuntimeError(f"the speech recognizer did not start in {start_timeout:.0f} s")
        kind, value = self._conn.recv()
        if kind == "error":
            self._proc.join(5.0)
            raise RuntimeError(value)
        self.name = value

    def start(self) -> None:
        self._conn.send(("start", None))

    def accept(self, pcm: np.ndarray) -> None:
        self._conn.send(("audio", np.ascontiguousarray(pcm, dtype=np.int16).tobytes()))

    def partial(self) -> str:
        return self._ask("partial")

    def finish(self) -> str:
        return self._ask("finish")

    def _ask(self, kind: str) -> str:
        self._conn.send((kind, None))
        status, value = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"speech recognizer: {value}")
        return value

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("quit", None))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(5.0)
            if self._proc.is_alive():
                self._proc.kill()
        self._conn.close()


def _serve(factory: Callable[[], Recognizer], conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes us
    try:
        rec = factory()
    except Exception as exc:  # noqa: BLE001 - sent back: the parent raises it with the cause
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", rec.name))
    while True:
        try:
            kind, value = conn.recv()
        except EOFError:  # the parent is gone
            return
        try:
            if kind == "quit":
                return
            if kind == "start":
                rec.start()
            elif kind == "audio":
                rec.accept(np.frombuffer(value, dtype=np.int16))
            elif kind == "partial":
                conn.send(("ok", rec.partial()))
            elif kind == "finish":
                conn.send(("ok", rec.finish()))
        except Exception as exc:  # noqa: BLE001 - answered to the parent, which raises it
            if kind in ("partial", "finish"):
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
