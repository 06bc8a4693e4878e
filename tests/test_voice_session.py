"""The voice session's races, with fake audio, VAD, recognizer and service (no models,
no timing assertions): an utterance whose transcript is still being finished when the
user speaks again is not answered alone, and a turn's report waits for its cancel."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Iterator

import numpy as np

from edge.voice.audio_io import FRAME, FRAME_S, Frame
from edge.voice.session import VoiceOptions, VoiceSession

SPEECH, SILENCE = 1, 0


class Script:
    """Frames of speech and silence as (kind, seconds) pieces, delivered without pacing;
    ``reached(i)`` is set once the listen loop has taken frame ``i``."""

    def __init__(self, pieces: list[tuple[int, float]]) -> None:
        self.kinds = [k for k, sec in pieces for _ in range(round(sec / FRAME_S))]
        self.taken = 0
        self.cv = threading.Condition()

    def frames(self, t0: float) -> Iterator[Frame]:
        for i, kind in enumerate(self.kinds):
            with self.cv:
                self.taken = i  # the previous frame has been handled
                self.cv.notify_all()
            yield Frame(np.full(FRAME, kind, np.int16), t0 + (i + 1) * FRAME_S)
            time.sleep(0.001)

    def wait_taken(self, i: int, timeout: float = 30.0) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: self.taken >= i, timeout), f"frame {i} not reached"

    def frame_of(self, seconds: float) -> int:
        return round(seconds / FRAME_S)

    def close(self) -> None:
        pass


class Vad:
    def __call__(self, x: np.ndarray) -> float:
        return 1.0 if x[0] > 0 else 0.0


class Recognizer:
    """Utterance n's transcript is ``words[n]``; ``hold[n]``, when given, runs first
    (a recognizer still finishing while the user speaks on)."""

    name = "fake"

    def __init__(self, words: list[str], hold: dict[int, object] | None = None) -> None:
        self.words, self.hold, self.n = words, hold or {}, -1

    def start(self) -> None:
        self.n += 1

    def accept(self, pcm: np.ndarray) -> None:
        pass

    def partial(self) -> str:
        return ""

    def finish(self) -> str:
        if self.n in self.hold:
            self.hold[self.n]()
        return self.words[self.n]

    def close(self) -> None:
        pass


class Service:
    """A chat service: answers "a " deltas until cancelled; records each request."""

    def __init__(self, cancel_delay_s: float = 0.0) -> None:
        self.requests: list[list[dict]] = []
        self.cancelled: set[str] = set()
        self.cancel_delay_s = cancel_delay_s
        self.lock = threading.Lock()

    def connect(self) -> Client:
        return Client(self)


class Client:
    def __init__(self, service: Service) -> None:
        self.service = service
        self.last_finish: str | None = None
        self.last_usage: dict | None = None

    def stream_chat(self, messages: list[dict], params: dict, request_id: str) -> Iterator[str]:
        with self.service.lock:
            self.service.requests.append(messages)

        def deltas() -> Iterator[str]:
            for _ in range(2000):
                if request_id in self.service.cancelled:
                    self.last_finish = "cancelled"
                    return
                yield "a "
                time.sleep(0.005)
            self.last_finish = "length"

        return deltas()

    def prefill(self, messages: list[dict]) -> dict:
        return {}

    def cancel_status(self, request_id: str) -> int:
        self.service.cancelled.add(request_id)  # the stream ends now...
        time.sleep(self.service.cancel_delay_s)  # ...the cancel's answer comes later
        return 200

    def close(self) -> None:
        pass


def run(script: Script, recognizer: Recognizer, service: Service) -> list[dict]:
    out = io.StringIO()
    options = VoiceOptions(silence_ms=300, min_speech_ms=64, partial_ms=0, on_eof="cancel")
    session = VoiceSession(service.connect, script, Vad(), recognizer, None, None, None, options,
                           out=io.StringIO(), json_out=out)
    assert session.run() == 0
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_speaking_on_before_the_transcript_is_final_answers_both_together() -> None:
    script = Script([(SILENCE, 0.3), (SPEECH, 0.6), (SILENCE, 0.5), (SPEECH, 0.6), (SILENCE, 0.8)])
    second_onset = script.frame_of(0.3 + 0.6 + 0.5) + 4  # past the 64 ms an onset needs
    # the first transcript is final only once the second utterance has begun
    recognizer = Recognizer(["what time is it", "in Tokyo"], hold={0: lambda: script.wait_taken(second_onset)})
    service = Service()
    turns = run(script, recognizer, service)
    assert [t["transcript"] for t in turns] == ["what time is it in Tokyo"]
    assert [m[-1]["content"] for m in service.requests] == ["what time is it in Tokyo"]  # nothing for the half


def test_a_barge_in_report_waits_for_the_cancel_answer() -> None:
    script = Script([(SILENCE, 0.3), (SPEECH, 0.5), (SILENCE, 1.2), (SPEECH, 0.5), (SILENCE, 0.6)])
    service = Service(cancel_delay_s=0.5)  # the stream ends well before the cancel's 200
    turns = run(script, Recognizer(["hello", "stop"]), service)
    assert [t["transcript"] for t in turns] == ["hello", "stop"]
    assert turns[0]["interrupted_by"] == "barge-in" and turns[0]["cancel_status"] == 200, turns[0]
    assert turns[1]["interrupted_by"] == "end of input" and turns[1]["cancel_status"] == 200, turns[1]


def test_a_cancel_that_beats_its_request_still_ends_the_answer() -> None:
    """The cancel reaches the service before the request does (404): the answer's
    stream is closed by the client instead of running to its end."""
    script = Script([(SILENCE, 0.3), (SPEECH, 0.5), (SILENCE, 1.0), (SPEECH, 0.5), (SILENCE, 0.6)])

    class Early(Service):
        def connect(self) -> Client:
            client = Client(self)

            def too_early(request_id: str) -> int:
                return 404  # not admitted yet: nothing to cancel

            client.cancel_status = too_early  # type: ignore[method-assign]
            return client

    turns = run(script, Recognizer(["hello", "stop"]), Early())
    assert [t["cancel_status"] for t in turns] == [404, 404]
    assert all(len(t["answer"]) < 2 * 2000 for t in turns), turns  # neither stream ran to its end
