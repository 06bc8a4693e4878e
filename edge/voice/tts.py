"""Text to speech behind one small interface.

* :class:`EspeakSynthesizer` (default): eSpeak NG, formant synthesis on the CPU in a few
  milliseconds a phrase. The library and its voice data come from the ``espeakng-loader``
  wheel (no apt needed); it is driven through pyttsx3's ctypes binding of the eSpeak NG C
  API, which also reports where each word starts in the audio (used to cut the history at
  the last word heard on barge-in).
* :class:`PiperSynthesizer`: a Piper voice model (``.onnx`` + ``.onnx.json``) the user
  gives, run by onnxruntime (CUDA provider when asked for and available).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Speech:
    text: str
    pcm: np.ndarray  # int16 mono
    sample_rate: int
    # (character offset in text, sample offset in pcm) of each word, when the engine says
    word_starts: tuple[tuple[int, int], ...] = field(default=())


class Synthesizer(Protocol):
    name: str
    sample_rate: int

    def synthesize(self, text: str) -> Speech: ...


class EspeakSynthesizer:
    """eSpeak NG is one library-wide state (one callback, one voice): make one per process."""

    name = "espeak-ng"

    def __init__(self, voice: str = "en-us", rate_wpm: int = 175) -> None:
        try:
            import espeakng_loader
        except ImportError as exc:
            raise RuntimeError("the default TTS needs espeakng-loader: pip install 'edge-llm[voice]'") from exc
        # Load the packaged library under its soname first, so that the binding's
        # dlopen("libespeak-ng.so.1") gets this copy whatever the system has.
        ctypes.CDLL(espeakng_loader.get_library_path(), mode=ctypes.RTLD_GLOBAL)
        try:
            from pyttsx3.drivers import _espeak as api
        except ImportError as exc:
            raise RuntimeError("the default TTS needs pyttsx3: pip install 'edge-llm[voice]'") from exc
        self._api = api
        rate = api.Initialize(api.AUDIO_OUTPUT_SYNCHRONOUS, 0, espeakng_loader.get_data_path().encode(), 0)
        if rate <= 0:
            raise RuntimeError(f"eSpeak NG failed to initialize (data: {espeakng_loader.get_data_path()})")
        self.sample_rate = int(rate)
        if api.SetVoiceByName(voice.encode()) != api.EE_OK:
            raise ValueError(f"eSpeak NG has no voice {voice!r} (try en-us, en-gb, de, fr, ...)")
        if not 80 <= rate_wpm <= 450:
            raise ValueError(f"speaking rate must be 80..450 words per minute, got {rate_wpm}")
        api.SetParameter(api.RATE, rate_wpm, 0)
        self._lock = threading.Lock()
        self._chunks: list[np.ndarray] = []
        self._words: list[tuple[int, int]] = []
        self._samples = 0
        api.SetSynthCallback(self._on_audio)

    def _on_audio(self, wav, n: int, events) -> int:
        i = 0
        while events[i].type != self._api.EVENT_LIST_TERMINATED:
            ev = events[i]
            if ev.type == self._api.EVENT_WORD:  # text_position is 1-based
                self._words.append((max(0, ev.text_position - 1), ev.sample))
            i += 1
        if wav and n > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        return 0  # go on

    def synthesize(self, text: str) -> Speech:
        with self._lock:
            self._chunks, self._words = [], []
            if self._api.Synth(text, flags=self._api.CHARS_UTF8) != self._api.EE_OK:
                raise RuntimeError(f"eSpeak NG could not synthesize {text[:40]!r}")
            self._api.Synchronize()
            pcm = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
            return Speech(text, pcm.astype(np.int16, copy=False), self.sample_rate, tuple(self._words))


class PiperSynthesizer:
    name = "piper"

    def __init__(self, model: str | Path, speaker: int | None = None, use_cuda: bool = False) -> None:
        model = Path(model)
        if not model.is_file() or not Path(f"{model}.json").is_file():
            raise ValueError(f"--piper-voice {model}: needs the voice's .onnx file and its .onnx.json beside it")
        try:
            from piper import PiperVoice, SynthesisConfig
        except ImportError as exc:
            raise RuntimeError("--piper-voice needs piper-tts >= 1.3: pip install 'edge-llm[piper]'") from exc
        self._voice = PiperVoice.load(model, use_cuda=use_cuda)
        self._config = SynthesisConfig(speaker_id=speaker)
        self.sample_rate = int(self._voice.config.sample_rate)

    def synthesize(self, text: str) -> Speech:
        chunks = [c.audio_int16_array for c in self._voice.synthesize(text, syn_config=self._config)]
        pcm = np.concatenate(chunks) if chunks else np.zeros(0, np.int16)
        return Speech(text, pcm.astype(np.int16, copy=False), self.sample_rate)
