"""Voice activity: Silero VAD (ONNX, run by onnxruntime) and the end-of-utterance rule.

The model is the ``silero_vad.onnx`` file shipped inside the ``silero-vad`` package. It is
located through the package's installed-file metadata, so its torch-based Python code is
never imported (it pulls torch and sets torch's thread count at import).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal

import numpy as np

from edge.voice.audio_io import FRAME, SAMPLE_RATE

CONTEXT = 64  # samples of the previous frame the model sees at 16 kHz


def packaged_silero_model() -> Path:
    try:
        dist = metadata.distribution("silero-vad")
    except metadata.PackageNotFoundError:
        raise RuntimeError("Silero VAD is not installed: pip install 'edge-llm[voice]'") from None
    path = Path(str(dist.locate_file("silero_vad/data/silero_vad.onnx")))
    if not path.is_file():
        raise RuntimeError(f"silero-vad {dist.version} does not ship silero_vad/data/silero_vad.onnx")
    return path


class SileroVad:
    """Speech probability of each 512-sample frame at 16 kHz (32 ms), with the model's
    recurrent state carried across frames."""

    def __init__(self, model: str | Path | None = None, threads: int = 1) -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise RuntimeError("Silero VAD needs onnxruntime: pip install 'edge-llm[voice]'") from exc
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads  # one 32 ms frame is far too small to split
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        self.model = Path(model) if model else packaged_silero_model()
        self._session = ort.InferenceSession(str(self.model), sess_options=opts, providers=["CPUExecutionProvider"])
        self._sr = np.array(SAMPLE_RATE, dtype=np.int64)
        self.reset()

    def reset(self) -> None:
        self._state = np.zeros((2, 1, 128), dtype=np.float32)
        self._context = np.zeros((1, CONTEXT), dtype=np.float32)

    def __call__(self, frame: np.ndarray) -> float:
        """``frame``: FRAME float32 samples in [-1, 1]."""
        if frame.shape != (FRAME,):
            raise ValueError(f"VAD frames are {FRAME} samples, got {frame.shape}")
        x = np.concatenate([self._context, frame.astype(np.float32, copy=False)[None]], axis=1)
        prob, self._state = self._session.run(None, {"input": x, "state": self._state, "sr": self._sr})
        self._context = x[:, -CONTEXT:]
        return float(prob.reshape(-1)[0])


@dataclass(frozen=True)
class VadEvent:
    kind: Literal["start", "end"]
    t: float  # start: capture time of the first speech frame; end: of the last one


class Endpointer:
    """Speech starts after ``min_speech_ms`` of frames at or above ``threshold``; the
    utterance ends after ``silence_ms`` of frames below ``threshold - hysteresis``
    (Silero's own hysteresis rule), measured in audio time, not wall time."""

    def __init__(self, threshold: float = 0.5, silence_ms: float = 500.0, min_speech_ms: float = 64.0,
                 hysteresis: float = 0.15, frame_ms: float = 1000.0 * FRAME / SAMPLE_RATE) -> None:
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"VAD threshold must be in (0, 1), got {threshold}")
        if silence_ms <= 0 or min_speech_ms < 0:
            raise ValueError(f"silence_ms must be > 0 and min_speech_ms >= 0, got {silence_ms}, {min_speech_ms}")
        self.threshold = threshold
        self.low = max(0.01, threshold - hysteresis)
        self.start_frames = max(1, round(min_speech_ms / frame_ms))
        self.end_frames = max(1, round(silence_ms / frame_ms))
        self.in_speech = False
        self._run = 0  # consecutive frames voting for a change of state
        self._first_t = 0.0  # first frame of the current speech run
        self._last_speech_t = 0.0

    def update(self, prob: float, t: float) -> VadEvent | None:
        if not self.in_speech:
            if prob >= self.threshold:
                if self._run == 0:
                    self._first_t = t
                self._run += 1
                if self._run >= self.start_frames:
                    self.in_speech, self._run, self._last_speech_t = True, 0, t
                    return VadEvent("start", self._first_t)
            else:
                self._run = 0
            return None
        if prob >= self.low:
            self._run, self._last_speech_t = 0, t
            return None
        self._run += 1
        if self._run >= self.end_frames:
            self.in_speech, self._run = False, 0
            return VadEvent("end", self._last_speech_t)
        return None

    def end_now(self) -> VadEvent | None:
        """The input ended: close an utterance still open."""
        if not self.in_speech:
            return None
        self.in_speech, self._run = False, 0
        return VadEvent("end", self._last_speech_t)
