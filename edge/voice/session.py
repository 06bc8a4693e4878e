"""The voice loop: listen, recognize, ask the service, speak, and let the user barge in.

Threads (all of this process; the model runs in ``edge serve``):

* listen (the caller's): frames -> VAD -> end of utterance; speech onset while an answer
  is active is a barge-in: its audio stops and its request is cancelled at once;
* asr: frames of an utterance -> recognizer; partial hypotheses -> prefill worker;
  the final transcript starts a turn;
* prefill: the latest partial transcript as a ``max_tokens: 0`` request, so the final
  request finds its prefix (history + most of the user's words) already in the KV cache;
* respond (one per turn): the streamed answer -> phrases -> tts queue (or printed);
* tts: phrase -> speech -> player, whose output device clock marks what was heard.
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx
import numpy as np

from edge.serving.chat_client import CANCEL_TIMEOUT_S, ChatClient, ServiceError
from edge.voice.asr import Recognizer
from edge.voice.audio_io import FRAME_S, AudioSource
from edge.voice.phrases import PhraseCutter, has_words
from edge.voice.player import AudioSink, Player
from edge.voice.tts import Speech, Synthesizer
from edge.voice.tools import MAX_TOOL_ROUNDS, ToolHandler, run_calls
from edge.voice.turns import Turn
from edge.voice.vad import Endpointer, SileroVad

log = logging.getLogger("edge.voice")

CANCEL_ACK_WAIT_S = 2 * CANCEL_TIMEOUT_S + 1.0  # the cancel request's two attempts


@dataclass
class VoiceOptions:
    vad_threshold: float = 0.5
    silence_ms: float = 500.0  # trailing silence that ends an utterance
    min_speech_ms: float = 64.0  # speech needed to count as an onset (and a barge-in)
    preroll_ms: float = 320.0  # audio before the onset handed to the recognizer
    partial_ms: float = 300.0  # prefill a changed partial transcript this often; 0 = never
    barge_in: bool = True
    on_eof: str = "finish"  # end of input: "finish" the answer, or "cancel" it
    system: str | None = None
    params: dict[str, Any] = field(default_factory=dict)  # sampling fields of each request
    tool_handler: ToolHandler | None = None  # runs the model's tool calls (edge/voice/tools.py)
    first_phrase_chars: int = 24  # the first piece is short: it decides when the first sound comes
    phrase_chars: int = 160


class VoiceSession:
    def __init__(self, connect: Callable[[], ChatClient], source: AudioSource, vad: SileroVad,
                 recognizer: Recognizer, synthesizer: Synthesizer | None, player: Player | None,
                 sink: AudioSink | None, options: VoiceOptions, out: TextIO = sys.stdout,
                 json_out: TextIO | None = None) -> None:
        if options.on_eof not in ("finish", "cancel"):
            raise ValueError(f"on_eof must be 'finish' or 'cancel', got {options.on_eof!r}")
        if (synthesizer is None) != (player is None):
            raise ValueError("a synthesizer needs a player and the other way round")
        self.source, self.vad, self.recognizer = source, vad, recognizer
        self.synthesizer, self.player, self.sink = synthesizer, player, sink
        self.options, self.out, self.json_out = options, out, json_out
        # separate connections: a cancel never queues behind a prefill, and an interrupted
        # stream may still be ending while the next turn's stream starts
        self._control, self._prefiller = connect(), connect()
        self._streams = (connect(), connect())
        self.t0 = 0.0
        self._lock = threading.Lock()  # history, turns, the active turn
        self.history: list[dict] = []
        self.turns: list[Turn] = []
        self._active: Turn | None = None
        self._onsets = 0  # utterances begun (listen thread); a transcript older than the last waits for it
        self._carried = ""  # the words of utterances that the next one superseded
        self._print_lock = threading.Lock()
        self._asr_q: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._tts_q: queue.Queue[tuple[Turn, str | None] | None] = queue.Queue()
        self._prefill_cv = threading.Condition()
        self._prefill_next: list[dict] | None = None
        self._closing = threading.Event()
        self._audio_closed = threading.Event()
        self._responders: list[tuple[Turn, threading.Thread]] = []

    # -- the listen loop -----------------------------------------------------------------------

    def run(self) -> int:
        asr = threading.Thread(target=self._asr_loop, name="voice-asr", daemon=True)
        prefill = threading.Thread(target=self._prefill_loop, name="voice-prefill", daemon=True)
        tts = threading.Thread(target=self._tts_loop, name="voice-tts", daemon=True) if self.synthesizer else None
        for th in (asr, prefill, tts):
            if th is not None:
                th.start()
        self.t0 = time.monotonic() + 0.05  # source and sink share this clock origin
        if self.sink is not None:
            self.sink.start(self.t0)
        interrupted = False
        try:
            self._listen()
        except KeyboardInterrupt:
            interrupted = True
        finally:
            self._shutdown(asr, prefill, tts, interrupted)
        return 130 if interrupted else 0

    def _listen(self) -> None:
        o = self.options
        ep = Endpointer(o.vad_threshold, o.silence_ms, o.min_speech_ms)
        preroll: deque[np.ndarray] = deque(maxlen=round(o.preroll_ms / 1000 / FRAME_S) + ep.start_frames)
        last_t = self.t0
        for frame in self.source.frames(self.t0):
            last_t = frame.t
            event = ep.update(self.vad(frame.as_float()), frame.t)
            if event is None:
                if ep.in_speech:
                    self._asr_q.put(("audio", frame.pcm))
                else:
                    preroll.append(frame.pcm)
            elif event.kind == "start":
                with self._lock:  # before the barge-in: a turn that starts after this sees it (_start_turn)
                    self._onsets += 1
                    onset = self._onsets
                if o.barge_in:
                    self._interrupt("barge-in", onset=event.t, detected=frame.t)
                preroll.append(frame.pcm)
                self._asr_q.put(("start", (event.t, onset)))
                for pcm in preroll:
                    self._asr_q.put(("audio", pcm))
                preroll.clear()
            else:
                self._asr_q.put(("end", {"speech_end": event.t, "end_of_utterance": frame.t}))
        event = ep.end_now()
        if event is not None:
            self._asr_q.put(("end", {"speech_end": event.t, "end_of_utterance": last_t}))

    def _interrupt(self, why: str, onset: float | None = None, detected: float | None = None) -> None:
        """Stop the active answer: its audio now, its request on the service; the history
        keeps what was heard of it."""
        now = time.monotonic()
        with self._lock:
            turn = self._active
            if turn is None or turn.heard is not None:
                return
            self._active = None
            turn.interrupted_by = why
            if onset is not None:
                turn.mark("barge_onset", onset)
                turn.mark("barge_detected", detected)
            turn.cancelled.set()
            if self.player is not None:
                self.player.stop(turn, now)
            else:
                turn.mark("audio_stopped", now)
            turn.heard = turn.spoken_text()
            self.history += [{"role": "user", "content": turn.user_text},
                             {"role": "assistant", "content": turn.heard}]
        turn.mark("cancel_sent")
        turn.cancel_status = self._control.cancel_status(turn.request_id)
        turn.mark("cancel_acked")
        self._say(" [interrupted]\n")

    # -- recognition and partial prefill ---------------------------------------------------------

    def _asr_loop(self) -> None:
        rec, every = self.recognizer, self.options.partial_ms / 1000.0
        open_, marks, partials, last_hyp, last_t, onset = False, {}, [], "", 0.0, 0
        while True:
            kind, value = self._asr_q.get()
            if kind == "quit":
                return
            try:
                if kind == "start":
                    rec.start()
                    t, onset = value
                    open_, marks, partials, last_hyp, last_t = True, {"speech_start": t}, [], "", time.monotonic()
                elif kind == "audio" and open_:
                    rec.accept(value)
                    now = time.monotonic()
                    if every > 0 and now - last_t >= every and self._asr_q.empty():  # only when caught up
                        last_t = now
                        hyp = rec.partial()
                        if hyp and hyp != last_hyp:
                            last_hyp = hyp
                            partials.append(hyp)
                            self._prefill(hyp)
                elif kind == "end" and open_:
                    open_ = False
                    text = rec.finish().strip()
                    marks.update(value, transcript=time.monotonic())
                    if text:
                        self._start_turn(text, marks, partials, onset)
                    else:
                        self._say("[no words recognized]\n")
            except Exception:  # a recognizer failure loses this utterance, not the session
                log.exception("speech recognition failed")
                open_ = False

    def _messages(self, user_text: str) -> list[dict]:
        system = [{"role": "system", "content": self.options.system}] if self.options.system else []
        return system + self.history + [{"role": "user", "content": user_text}]

    def _prefill(self, partial: str) -> None:
        with self._lock:
            messages = self._messages(partial)
        with self._prefill_cv:
            self._prefill_next = messages  # only the latest partial matters
            self._prefill_cv.notify()

    def _prefill_loop(self) -> None:
        while True:
            with self._prefill_cv:
                while self._prefill_next is None and not self._closing.is_set():
                    self._prefill_cv.wait()
                if self._prefill_next is None:
                    return
                messages, self._prefill_next = self._prefill_next, None
            try:
                self._prefiller.prefill(messages)
            except (ServiceError, httpx.HTTPError) as exc:
                log.warning("partial-transcript prefill failed: %s", exc)

    # -- turns -----------------------------------------------------------------------------------

    def _start_turn(self, text: str, marks: dict[str, float], partials: list[str], onset: int = 0) -> None:
        # an answer to the first half of a sentence said with a pause in it gives way
        # to the answer to the whole (barge-in only sees onsets, not a continued utterance)
        self._interrupt("next utterance")
        with self._lock:  # one section with the listen thread's onset count (see _listen)
            if onset and self._onsets > onset:
                # The user spoke again before this transcript was final: its barge-in found
                # no turn to stop, so no answer to this utterance alone; its words open the next.
                self._carried = f"{self._carried} {text}".strip()
                turn = None
            else:
                text, self._carried = f"{self._carried} {text}".strip(), ""
                turn = Turn(len(self.turns) + 1, text, f"voice-{uuid.uuid4().hex}", marks, partials)
                messages = self._messages(text)
                turn.history_sent = [dict(m) for m in self.history]
                self.turns.append(turn)
                self._active = turn
        if turn is None:
            log.info("utterance %d: the next one began before its transcript was final; answering both together",
                     onset)
            self._say(f"you: {text} ...\n")
            return
        self._say(f"you: {text}\nedge: ")
        th = threading.Thread(target=self._respond, args=(turn, messages), name=f"voice-turn-{turn.index}",
                              daemon=True)
        self._responders.append((turn, th))
        th.start()

    def _respond(self, turn: Turn, messages: list[dict]) -> None:
        client = self._streams[turn.index % 2]
        cutter = PhraseCutter(self.options.first_phrase_chars, self.options.phrase_chars)
        turn.mark("request_sent")
        params = self.options.params
        for round_ in range(MAX_TOOL_ROUNDS + 1):
            start = len(turn.answer)
            self._stream_round(turn, client, cutter, messages, params)
            calls = client.last_tool_calls
            if (not calls or self.options.tool_handler is None or turn.error is not None
                    or turn.cancelled.is_set() or round_ == MAX_TOOL_ROUNDS):
                break
            for call in calls:
                fn = call.get("function", {})
                self._say(f"[tool call] {fn.get('name')}({fn.get('arguments', '')})\n")
            # The results go back; the next answer may call again, or speak.
            messages = messages + run_calls(self.options.tool_handler, "".join(turn.answer[start:]), calls)
            turn.tool_messages += messages[-len(calls) - 1:]
            params = {**params, "tool_choice": "auto"}
        turn.mark("request_ended" if turn.finish_reason == "cancelled" else "generation_done")
        if turn.error is None and not turn.cancelled.is_set():
            if self.synthesizer is not None:
                rest = cutter.flush()
                if rest:
                    self._tts_q.put((turn, rest))
                self._tts_q.put((turn, None))
                while not (turn.played_out.wait(0.05) or turn.cancelled.is_set() or self._audio_closed.is_set()):
                    pass
            self._say("\n")
        self._finish_turn(turn)

    def _stream_round(self, turn: Turn, client: ChatClient, cutter: PhraseCutter, messages: list[dict],
                      params: dict[str, Any]) -> None:
        """One request of the turn: its text spoken (or printed) as it streams."""
        stream = client.stream_chat(messages, params, turn.request_id)
        try:
            for delta in stream:
                now = time.monotonic()
                turn.mark("first_token", now)
                turn.token_times.append(now)
                turn.answer.append(delta)
                if turn.cancelled.is_set():
                    if "cancel_acked" in turn.marks and turn.cancel_status != 200:
                        break  # the cancel came before the service had the request: leaving cancels it
                    continue  # read on: the stream ends once the service has cancelled
                if self.synthesizer is None:
                    turn.add_spoken(delta)
                    self._say(delta)
                else:
                    for piece in cutter.feed(delta):
                        self._tts_q.put((turn, piece))
            turn.finish_reason, turn.usage = client.last_finish, client.last_usage
        except (ServiceError, httpx.HTTPError) as exc:
            turn.error = str(exc)
            self._say(f"\n[error: {exc}]\n")
        finally:
            stream.close()

    def _finish_turn(self, turn: Turn) -> None:
        if turn.cancelled.is_set():  # the output device marks it at its next block
            turn.wait_mark("audio_stopped", 1.0)
            # The stream can end before the cancel's own answer is back: the report
            # waits for it (cancel_status).
            turn.wait_mark("cancel_acked", CANCEL_ACK_WAIT_S)
        with self._lock:
            if self._active is turn:
                self._active = None
            if turn.heard is None and turn.error is None:
                turn.heard = "".join(turn.answer)  # played (or printed) to the end
                self.history += [{"role": "user", "content": turn.user_text}, *turn.tool_messages,
                                 {"role": "assistant", "content": turn.heard}]
        log.info("%s", turn.summary())
        if self.json_out is not None:
            with self._print_lock:
                print(json.dumps(turn.report(self.t0)), file=self.json_out, flush=True)

    def _tts_loop(self) -> None:
        assert self.synthesizer is not None and self.player is not None
        while (item := self._tts_q.get()) is not None:
            turn, piece = item
            if piece is None:
                self.player.end_turn(turn)
                continue
            if turn.cancelled.is_set():
                continue
            speech = Speech(piece, np.zeros(0, np.int16), self.player.sample_rate)
            if has_words(piece):
                try:
                    speech = self.synthesizer.synthesize(piece)
                except Exception:  # one unspeakable piece must not end the answer
                    log.exception("speech synthesis failed for %r", piece[:40])
            if self.player.enqueue(turn, speech):
                self._say(piece)

    def _say(self, text: str) -> None:
        with self._print_lock:
            self.out.write(text)
            self.out.flush()

    # -- the end -----------------------------------------------------------------------------------

    def _shutdown(self, asr: threading.Thread, prefill: threading.Thread, tts: threading.Thread | None,
                  interrupted: bool) -> None:
        self._asr_q.put(("quit", None))
        asr.join()  # the last utterance may still start a turn
        if interrupted or self.options.on_eof == "cancel":
            self._interrupt("interrupt" if interrupted else "end of input")
        for turn, th in list(self._responders):  # generation finishes (or ends cancelled)
            while th.is_alive() and not ({"generation_done", "request_ended"} & turn.marks.keys()):
                th.join(0.05)
        if tts is not None:
            self._tts_q.put(None)
            tts.join()
        if self.sink is not None:
            self.sink.close(drain=not interrupted)
        self._audio_closed.set()
        for _, th in self._responders:  # now only waiting for audio that the sink's close played
            th.join()
        self._closing.set()
        with self._prefill_cv:
            self._prefill_cv.notify()
        prefill.join()
        for client in (self._control, self._prefiller, *self._streams):
            client.close()
        self.recognizer.close()
        self.source.close()
