"""One exchange: the user's utterance, the streamed answer, what was heard, and when.

Marks are ``time.monotonic()`` values, first write wins. Audio marks use the capture
time of the frame concerned (input) and the time a sample was handed to the output
device (output), so they measure what a listener experiences.
"""

from __future__ import annotations

import threading
import time
from typing import Any

# (name, from mark, to mark) of each reported interval, in milliseconds
LATENCIES = (
    ("speech_end_to_transcript", "speech_end", "transcript"),
    ("transcript_to_request", "transcript", "request_sent"),
    ("request_to_first_token", "request_sent", "first_token"),
    ("first_token_to_first_audio", "first_token", "first_audio"),
    ("transcript_to_first_audio", "transcript", "first_audio"),
    ("speech_end_to_first_audio", "speech_end", "first_audio"),
)
BARGE_IN = (
    ("onset_to_detected", "barge_onset", "barge_detected"),
    ("onset_to_audio_stopped", "barge_onset", "audio_stopped"),
    ("onset_to_cancel_sent", "barge_onset", "cancel_sent"),
    ("cancel_sent_to_acked", "cancel_sent", "cancel_acked"),
    ("cancel_sent_to_request_ended", "cancel_sent", "request_ended"),
    ("cancel_acked_to_request_ended", "cancel_acked", "request_ended"),  # after the service has the cancel
)


class Turn:
    def __init__(self, index: int, user_text: str, request_id: str, marks: dict[str, float],
                 partials: list[str] | None = None) -> None:
        self.index, self.user_text, self.request_id = index, user_text, request_id
        self.marks = dict(marks)
        self.partials = list(partials or [])  # partial transcripts sent as prefill-only requests
        self._lock = threading.Condition()
        self.cancelled = threading.Event()  # barge-in, end of input or Ctrl-C: stop everything
        self.played_out = threading.Event()  # the last piece of the answer was played
        self.answer: list[str] = []  # text deltas as generated
        self.spoken: list[str] = []  # pieces heard to the end (or printed, without audio)
        self.token_times: list[float] = []
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.error: str | None = None
        self.interrupted_by: str | None = None
        self.cancel_status: int | None = None
        self.heard: str | None = None  # the assistant message kept in the history
        self.history_sent: list[dict] = []  # the earlier messages the request carried
        self.tool_messages: list[dict] = []  # the calls the model made and their results

    def mark(self, name: str, t: float | None = None) -> None:
        with self._lock:
            self.marks.setdefault(name, time.monotonic() if t is None else t)
            self._lock.notify_all()

    def wait_mark(self, name: str, timeout: float) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: name in self.marks, timeout)

    def add_spoken(self, text: str) -> None:
        with self._lock:
            self.spoken.append(text)

    def spoken_text(self) -> str:
        with self._lock:
            return "".join(self.spoken)

    def decode_step_ms(self) -> float | None:
        """Mean time per generated token over the stream (client-side gaps between deltas
        understate it: deltas that arrive together show no gap)."""
        tokens = (self.usage or {}).get("completion_tokens") or len(self.token_times)
        if len(self.token_times) < 2 or tokens < 2:
            return None
        return round(1000.0 * (self.token_times[-1] - self.token_times[0]) / (tokens - 1), 2)

    def _ms(self, a: str, b: str) -> float | None:
        if a in self.marks and b in self.marks:
            return round(1000.0 * (self.marks[b] - self.marks[a]), 1)
        return None

    def report(self, t0: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "turn": self.index,
            "request_id": self.request_id,
            "transcript": self.user_text,
            "partials": self.partials,
            "answer": "".join(self.answer),
            "heard": self.heard,
            "history_sent": self.history_sent,
            "interrupted_by": self.interrupted_by,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "latency_ms": {name: self._ms(a, b) for name, a, b in LATENCIES},
            "marks_s": {k: round(v - t0, 4) for k, v in sorted(self.marks.items(), key=lambda kv: kv[1])},
        }
        if self.error:
            out["error"] = self.error
        if self.interrupted_by:
            step = self.decode_step_ms()
            ended = self._ms("cancel_acked", "request_ended")
            out["barge_in_ms"] = {name: self._ms(a, b) for name, a, b in BARGE_IN}
            out["barge_in_ms"]["decode_step"] = step
            out["cancel_status"] = self.cancel_status
            out["request_ended_in_decode_steps"] = round(ended / step, 2) if ended is not None and step else None
        return out

    def summary(self) -> str:
        lat = {name: self._ms(a, b) for name, a, b in LATENCIES}
        parts = [f"turn {self.index}"] + [f"{k} {v:.0f} ms" for k, v in lat.items() if v is not None]
        if self.interrupted_by:
            parts += [f"interrupted ({self.interrupted_by})"] + [
                f"{name} {v:.0f} ms" for name, a, b in BARGE_IN if (v := self._ms(a, b)) is not None]
        return ", ".join(parts)
