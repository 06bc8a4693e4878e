"""Audio out: a queue of synthesized pieces drained by an output clock.

:class:`Player` holds the pieces of the answers; the output device (a speaker callback,
or the clocked WAV writer) pulls ``fill(n)`` samples at a time, so the player always
knows how much of each piece was heard. ``stop(turn)`` drops the turn's audio at once
(barge-in): the next block the device pulls is silence, and the heard text of the piece
that was playing is cut at its last whole word.
"""

from __future__ import annotations

import threading
import time
import wave
from collections import deque
from pathlib import Path
from typing import Protocol

import numpy as np

from edge.voice.audio_io import float_to_int16, int16_to_float, resample
from edge.voice.phrases import spoken_prefix
from edge.voice.tts import Speech
from edge.voice.turns import Turn


class _Piece:
    __slots__ = ("played", "speech", "turn")

    def __init__(self, turn: Turn, speech: Speech) -> None:
        self.turn, self.speech, self.played = turn, speech, 0


class _End:
    __slots__ = ("turn",)

    def __init__(self, turn: Turn) -> None:
        self.turn = turn


class Player:
    def __init__(self, sample_rate: int) -> None:
        self.sample_rate = sample_rate
        self._lock = threading.Lock()
        self._items: deque[_Piece | _End] = deque()
        self._stopping: list[Turn] = []  # stopped while playing: the next fill is their first silence

    def enqueue(self, turn: Turn, speech: Speech) -> bool:
        """Queue a piece (its audio may be empty: text with nothing to say); False if the
        turn was cancelled meanwhile."""
        if speech.pcm.size and speech.sample_rate != self.sample_rate:
            pcm = float_to_int16(resample(int16_to_float(speech.pcm), speech.sample_rate, self.sample_rate))
            scale = pcm.size / max(1, speech.pcm.size)
            speech = Speech(speech.text, pcm, self.sample_rate,
                            tuple((c, int(s * scale)) for c, s in speech.word_starts))
        with self._lock:
            if turn.cancelled.is_set():
                return False
            self._items.append(_Piece(turn, speech))
            return True

    def end_turn(self, turn: Turn) -> None:
        """No more pieces for ``turn``: ``turn.played_out`` is set once the queue gets here."""
        with self._lock:
            if not turn.cancelled.is_set():
                self._items.append(_End(turn))

    def pending_samples(self) -> int:
        with self._lock:
            return sum(i.speech.pcm.size - i.played for i in self._items if isinstance(i, _Piece))

    def fill(self, n: int, now: float) -> np.ndarray:
        """The next ``n`` samples for the device; ``now``: when the first of them is heard."""
        out = np.zeros(n, dtype=np.int16)
        pos = 0
        with self._lock:
            for turn in self._stopping:
                turn.mark("audio_stopped", now)
            self._stopping.clear()
            while self._items and (pos < n or isinstance(self._items[0], _End)):
                head = self._items[0]
                if isinstance(head, _End):
                    head.turn.mark("played_out", now + pos / self.sample_rate)
                    head.turn.played_out.set()
                    self._items.popleft()
                    continue
                pcm = head.speech.pcm
                take = min(n - pos, pcm.size - head.played)
                if take > 0:
                    head.turn.mark("first_audio", now + pos / self.sample_rate)
                    out[pos:pos + take] = pcm[head.played:head.played + take]
                    head.played += take
                    pos += take
                if head.played >= pcm.size:
                    head.turn.add_spoken(head.speech.text)
                    self._items.popleft()
        return out

    def stop(self, turn: Turn, now: float | None = None) -> None:
        """Drop ``turn``'s audio now; its heard text ends at the last whole word played."""
        now = time.monotonic() if now is None else now
        with self._lock:
            playing = False
            keep: deque[_Piece | _End] = deque()
            for item in self._items:
                if item.turn is not turn:
                    keep.append(item)
                elif isinstance(item, _Piece) and item.played > 0:
                    s = item.speech
                    turn.add_spoken(spoken_prefix(s.text, s.pcm.size, item.played, s.word_starts))
                    playing = True
            self._items = keep
            if playing:
                self._stopping.append(turn)
            else:
                turn.mark("audio_stopped", now)


class AudioSink(Protocol):
    def start(self, t0: float) -> None: ...

    def close(self, drain: bool) -> None: ...


class WavSink:
    """What a speaker would have played, as a WAV timeline on the session clock: sample k
    is handed out at ``t0 + k / rate``, silences included, so the file lines up with the
    input and the turn marks. ``close(drain=True)`` appends what is still queued."""

    def __init__(self, path: str | Path, player: Player, block_ms: float = 10.0) -> None:
        self.player = player
        self.block = max(1, int(player.sample_rate * block_ms / 1000))
        self._wav = wave.open(str(path), "wb")  # noqa: SIM115 - open for the sink's life, closed by close()
        self._wav.setnchannels(1)
        self._wav.setsampwidth(2)
        self._wav.setframerate(player.sample_rate)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, t0: float) -> None:
        self._thread = threading.Thread(target=self._run, args=(t0,), name="voice-wav-out", daemon=True)
        self._thread.start()

    def _run(self, t0: float) -> None:
        j = 0
        while not self._stop.is_set():
            due = t0 + j * self.block / self.player.sample_rate
            wait = due - time.monotonic()
            if wait > 0 and self._stop.wait(wait):
                break
            self._wav.writeframes(self.player.fill(self.block, max(due, time.monotonic())).tobytes())
            j += 1

    def close(self, drain: bool) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if drain:
            self._wav.writeframes(self.player.fill(self.player.pending_samples(), time.monotonic()).tobytes())
        self._wav.close()


class SpeakerSink:
    """The sound card through PortAudio (sounddevice); marks include its output latency."""

    def __init__(self, player: Player, device: str | int | None = None) -> None:
        try:
            import sounddevice as sd
        except (ImportError, OSError) as exc:
            raise RuntimeError(f"the speaker needs sounddevice and PortAudio (pip install 'edge-llm[voice]'; "
                               f"apt install libportaudio2), or use --output FILE.wav / --no-audio: {exc}") from exc
        self.player = player
        self._stream = sd.OutputStream(device=device, samplerate=player.sample_rate, channels=1, dtype="int16",
                                       blocksize=player.sample_rate // 100, latency="low", callback=self._on_block)

    def _on_block(self, outdata: np.ndarray, frames: int, time_info, status) -> None:
        outdata[:, 0] = self.player.fill(frames, time.monotonic() + float(self._stream.latency))

    def start(self, t0: float) -> None:
        self._stream.start()

    def close(self, drain: bool) -> None:
        while drain and self.player.pending_samples() > 0:
            time.sleep(0.02)
        self._stream.stop()
        self._stream.close()
