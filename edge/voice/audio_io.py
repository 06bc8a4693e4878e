"""Audio in: 16 kHz mono frames from a microphone, a WAV file or raw PCM on stdin.

Everything downstream (VAD, ASR) sees :class:`Frame` objects of ``FRAME`` int16 samples
at ``SAMPLE_RATE``. Other rates and channel counts are mixed down and resampled with
soxr (streaming, so microphone blocks join without edge artefacts).

File and stdin sources are paced at real time against a clock origin shared with the
output sink, as a microphone would deliver them: barge-in and the timings then mean the
same thing for a recording as for a live speaker.
"""

from __future__ import annotations

import queue
import struct
import time
import wave
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import numpy as np

SAMPLE_RATE = 16_000
FRAME = 512  # Silero VAD's window at 16 kHz: 32 ms
FRAME_S = FRAME / SAMPLE_RATE


@dataclass(frozen=True)
class Frame:
    pcm: np.ndarray  # int16, FRAME samples at SAMPLE_RATE
    t: float  # time.monotonic() when its last sample was captured

    def as_float(self) -> np.ndarray:
        return int16_to_float(self.pcm)


def int16_to_float(pcm: np.ndarray) -> np.ndarray:
    return pcm.astype(np.float32) / 32768.0


def float_to_int16(x: np.ndarray) -> np.ndarray:
    return (np.clip(x, -1.0, 32767 / 32768) * 32768.0).round().astype(np.int16)


def to_mono(x: np.ndarray) -> np.ndarray:
    """[samples] or [samples, channels] -> [samples] float32 (channels averaged)."""
    x = np.asarray(x, dtype=np.float32)
    return x if x.ndim == 1 else x.mean(axis=1, dtype=np.float32)


def _soxr():
    try:
        import soxr
    except ImportError as exc:
        raise RuntimeError("resampling needs soxr: pip install 'edge-llm[voice]'") from exc
    return soxr


def resample(x: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """Mono float32 audio at ``rate_in`` -> ``rate_out`` (soxr, high quality)."""
    x = np.asarray(x, dtype=np.float32)
    if rate_in == rate_out or x.size == 0:
        return x
    return _soxr().resample(x, rate_in, rate_out, quality="HQ").astype(np.float32, copy=False)


class StreamResampler:
    """Block-by-block resampling that equals resampling the whole signal at once."""

    def __init__(self, rate_in: int, rate_out: int) -> None:
        self.rate_in, self.rate_out = rate_in, rate_out
        self._stream = None if rate_in == rate_out else _soxr().ResampleStream(
            rate_in, rate_out, 1, dtype="float32", quality="HQ")

    def __call__(self, x: np.ndarray, last: bool = False) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if self._stream is None:
            return x
        return self._stream.resample_chunk(x, last=last)


class Framer:
    """Collects 16 kHz float samples and hands out whole int16 frames."""

    def __init__(self) -> None:
        self._buf = np.zeros(0, dtype=np.float32)

    def push(self, x: np.ndarray, final: bool = False) -> list[np.ndarray]:
        self._buf = np.concatenate([self._buf, x])
        if final and self._buf.size % FRAME:
            self._buf = np.concatenate([self._buf, np.zeros(FRAME - self._buf.size % FRAME, np.float32)])
        n = self._buf.size // FRAME
        frames = [float_to_int16(self._buf[i * FRAME:(i + 1) * FRAME]) for i in range(n)]
        self._buf = self._buf[n * FRAME:]
        return frames


MAX_RATE = 384_000  # the highest rate audio interfaces record at
MAX_CHANNELS = 64
MAX_READ_SECONDS = 600.0  # read_wav's whole-file limit; WavSource streams any length
WAV_BLOCK_S = 0.1  # WavSource reads this much at a time


def open_wav(path: str | Path) -> wave.Wave_read:
    """A PCM WAV file, opened with its header checked: ValueError (one line naming the
    file and what is wrong) for anything but 8/16/32-bit PCM at a plausible rate."""
    try:
        w = wave.open(str(path), "rb")
    except (wave.Error, EOFError, struct.error) as exc:
        why = str(exc) or "the file ends inside its header"
        raise ValueError(f"{path}: not a PCM WAV file ({why}); convert it, e.g. sox in.x -b 16 out.wav") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: a directory, not a WAV file") from None
    rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
    problem = None
    if not 1 <= rate <= MAX_RATE:
        problem = f"its header says {rate} Hz; a WAV file's rate is 1..{MAX_RATE} Hz"
    elif not 1 <= channels <= MAX_CHANNELS:
        problem = f"its header says {channels} channels"
    elif width not in (1, 2, 4):
        problem = f"{8 * width}-bit samples are not supported (use 8, 16 or 32-bit PCM)"
    if problem is not None:
        w.close()
        raise ValueError(f"{path}: {problem}")
    return w


def _pcm_to_float(raw: bytes, width: int, channels: int) -> np.ndarray:
    """Interleaved PCM -> mono float32 (whole frames only)."""
    raw = raw[:len(raw) - len(raw) % (width * channels)]
    if width == 1:
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    else:
        x = np.frombuffer(raw, "<i4").astype(np.float32) / 2147483648.0
    return to_mono(x.reshape(-1, channels))


def read_wav(path: str | Path, max_seconds: float = MAX_READ_SECONDS) -> tuple[np.ndarray, int]:
    """A short PCM WAV file as mono float32 and its sample rate (longer than
    ``max_seconds``: ValueError; :class:`WavSource` streams long recordings)."""
    with open_wav(path) as w:
        rate, width, channels, n = w.getframerate(), w.getsampwidth(), w.getnchannels(), w.getnframes()
        if n / rate > max_seconds:
            raise ValueError(f"{path}: {n / rate:.0f} s of audio, more than {max_seconds:.0f} s to read at once")
        return _pcm_to_float(w.readframes(n), width, channels), rate


def write_wav(path: str | Path, pcm: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.asarray(pcm, dtype="<i2").tobytes())


class AudioSource(Protocol):
    def frames(self, t0: float) -> Iterator[Frame]:
        """Frames as they are captured; ``t0`` is the session's clock origin."""
        ...

    def close(self) -> None: ...


def paced(frames: Iterator[np.ndarray], t0: float) -> Iterator[Frame]:
    """Release frame i at t0 + (i+1) * FRAME_S, as a microphone would: real time, no drift."""
    for i, pcm in enumerate(frames):
        due = t0 + (i + 1) * FRAME_S
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        yield Frame(pcm, due)


class WavSource:
    """A WAV file (any rate, any channel count) played in at real time, read
    ``WAV_BLOCK_S`` at a time: an hour-long recording costs no more memory than a second."""

    def __init__(self, path: str | Path) -> None:
        self.path = path
        with open_wav(path) as w:  # refused here, before the session starts
            self.rate = w.getframerate()
            self.seconds = w.getnframes() / self.rate

    def _blocks(self) -> Iterator[np.ndarray]:
        resampler, framer = StreamResampler(self.rate, SAMPLE_RATE), Framer()
        with open_wav(self.path) as w:
            width, channels = w.getsampwidth(), w.getnchannels()
            block = max(1, int(self.rate * WAV_BLOCK_S))
            while raw := w.readframes(block):
                yield from framer.push(resampler(_pcm_to_float(raw, width, channels)))
        yield from framer.push(resampler(np.zeros(0, np.float32), last=True), final=True)

    def frames(self, t0: float) -> Iterator[Frame]:
        return paced(self._blocks(), t0)

    def close(self) -> None:
        pass


class PcmSource:
    """Raw little-endian int16 PCM from a stream (stdin), paced at real time."""

    def __init__(self, stream: BinaryIO, rate: int = SAMPLE_RATE, channels: int = 1) -> None:
        if rate <= 0 or channels <= 0:
            raise ValueError(f"bad PCM format: rate {rate}, channels {channels}")
        self.stream, self.rate, self.channels = stream, rate, channels

    def _blocks(self) -> Iterator[np.ndarray]:
        resampler, framer = StreamResampler(self.rate, SAMPLE_RATE), Framer()
        block_bytes = 2 * self.channels * max(1, self.rate // 50)  # 20 ms reads
        tail = b""
        while True:
            data = self.stream.read(block_bytes)
            if not data:
                break
            data, tail = tail + data, b""
            cut = len(data) - len(data) % (2 * self.channels)
            data, tail = data[:cut], data[cut:]
            x = to_mono(np.frombuffer(data, "<i2").reshape(-1, self.channels).astype(np.float32) / 32768.0)
            yield from framer.push(resampler(x))
        yield from framer.push(resampler(np.zeros(0, np.float32), last=True), final=True)

    def frames(self, t0: float) -> Iterator[Frame]:
        return paced(self._blocks(), t0)

    def close(self) -> None:
        pass


class MicSource:
    """A microphone through PortAudio (sounddevice), at the device's own rate."""

    def __init__(self, device: str | int | None = None, rate: int | None = None) -> None:
        try:
            import sounddevice as sd
        except (ImportError, OSError) as exc:  # OSError: the PortAudio library itself is missing
            raise RuntimeError(f"the microphone needs sounddevice and PortAudio "
                               f"(pip install 'edge-llm[voice]'; apt install libportaudio2): {exc}") from exc
        info = sd.query_devices(device, "input")
        self.rate = int(rate or info["default_samplerate"])
        self._blocks: queue.Queue[tuple[np.ndarray, float] | None] = queue.Queue()
        self._stream = sd.InputStream(device=device, samplerate=self.rate, channels=1, dtype="float32",
                                      blocksize=self.rate // 50, latency="low", callback=self._on_block)

    def _on_block(self, indata: np.ndarray, frames: int, time_info, status) -> None:
        self._blocks.put((indata[:, 0].copy(), time.monotonic()))

    def frames(self, t0: float) -> Iterator[Frame]:
        resampler, framer = StreamResampler(self.rate, SAMPLE_RATE), Framer()
        self._stream.start()
        while True:
            item = self._blocks.get()
            if item is None:
                return
            block, t = item
            for pcm in framer.push(resampler(block)):
                yield Frame(pcm, t)

    def close(self) -> None:
        self._stream.stop()
        self._stream.close()
        self._blocks.put(None)
