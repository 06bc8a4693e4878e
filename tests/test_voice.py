"""``edge voice`` parts: phrase cutting, heard-text truncation, resampling, VAD endpointing,
the player's barge-in stop, the recognizer process, and the command's input errors.

Oracles: sentences built here (the cutter must give them back), analytic sine waves
(resampling), eSpeak NG's own word timings (truncation), and speech placed at known
times in silence (VAD).
"""

from __future__ import annotations

import functools
import itertools
import math
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.voice.audio_io import (
    FRAME,
    SAMPLE_RATE,
    Framer,
    StreamResampler,
    float_to_int16,
    int16_to_float,
    WavSource,
    read_wav,
    resample,
)
from edge.voice.phrases import PhraseCutter, spoken_prefix, word_starts_by_length
from edge.voice.player import Player
from edge.voice.tts import Speech
from edge.voice.turns import Turn
from edge.voice.vad import Endpointer, SileroVad

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def espeak():
    from edge.voice.tts import EspeakSynthesizer

    return EspeakSynthesizer()


# -- phrase cutting --------------------------------------------------------------------------------

WORD = st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=8)
SENTENCE = st.tuples(st.lists(WORD, min_size=1, max_size=5), st.sampled_from(".!?")).map(
    lambda t: " ".join(t[0]) + t[1])


def cut_all(cutter: PhraseCutter, chunks: list[str]) -> list[str]:
    pieces = [p for c in chunks for p in cutter.feed(c)]
    rest = cutter.flush()
    return pieces + ([rest] if rest else [])


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@given(st.lists(SENTENCE, min_size=1, max_size=6), st.lists(st.integers(0, 10_000), max_size=12))
@settings(max_examples=150, deadline=None)
def test_short_sentences_come_back_one_piece_each(sentences: list[str], cuts: list[int]) -> None:
    text = " ".join(sentences)  # every sentence is under both limits: no forced cut
    pieces = cut_all(PhraseCutter(first_max_chars=60, max_chars=60, min_chars=60), split_at(text, cuts))
    assert pieces == [sentences[0]] + [" " + s for s in sentences[1:]]


@given(st.text(alphabet=st.sampled_from(list("ab .,;!?\n3\"'。，")), max_size=300),
       st.lists(st.integers(0, 10_000), max_size=20))
@settings(max_examples=300, deadline=None)
def test_pieces_rejoin_respect_limits_and_ignore_chunking(text: str, cuts: list[int]) -> None:
    make = functools.partial(PhraseCutter, first_max_chars=16, max_chars=40, min_chars=6)
    pieces = cut_all(make(), split_at(text, cuts))
    assert "".join(pieces) == text
    assert pieces == cut_all(make(), [text])  # streaming token by token changes nothing
    assert all(pieces) and (not pieces or len(pieces[0]) <= 16) and all(len(p) <= 40 for p in pieces[1:])


def test_cut_examples() -> None:
    c = PhraseCutter(first_max_chars=24, max_chars=60, min_chars=8)
    assert c.feed("Sure") == [] and c.feed("! The") == ["Sure!"]
    assert c.feed(" value is 3.14 today, and") == [" The value is 3.14 today,"]
    assert c.feed(" it rises") == [] and c.flush() == " and it rises"
    first = PhraseCutter(first_max_chars=22).feed("aaaa bbbb cccc dddd eeee ffff")
    assert first == ["aaaa bbbb cccc dddd"]  # a long first piece ends at a word
    assert PhraseCutter(first_max_chars=12).feed("abcdefghijklmnop") == ["abcdefghijkl"]


# -- what was heard --------------------------------------------------------------------------------

def test_spoken_prefix_follows_espeak_word_timings(espeak) -> None:
    text = "one two three four five six"
    s = espeak.synthesize(text)
    starts = s.word_starts
    assert [text[c:].split()[0] for c, _ in starts] == text.split()  # espeak's own alignment
    for k in range(1, len(starts)):  # just as word k begins, words 0..k-1 were heard
        assert spoken_prefix(text, s.pcm.size, starts[k][1], starts) == " ".join(text.split()[:k])
        assert spoken_prefix(text, s.pcm.size, starts[k][1] - 1, starts) == " ".join(text.split()[:k - 1])
    assert spoken_prefix(text, s.pcm.size, s.pcm.size, starts) == text
    assert spoken_prefix(text, s.pcm.size, 0, starts) == ""


def test_spoken_prefix_without_timings_goes_by_length() -> None:
    text = "aaaa bbbb cccc dddd"
    starts = word_starts_by_length(text, 1900)
    assert [c for c, _ in starts] == [0, 5, 10, 15] and [s for _, s in starts] == [0, 500, 1000, 1500]
    assert spoken_prefix(text, 1900, 1200) == "aaaa bbbb"


def test_player_stop_cuts_the_heard_text_and_silences_the_next_block(espeak) -> None:
    turn, other = Turn(1, "hi", "r1", {}), Turn(2, "later", "r2", {})
    player = Player(espeak.sample_rate)
    first, second = espeak.synthesize("Hello there."), espeak.synthesize(" One two three four.")
    assert player.enqueue(turn, first) and player.enqueue(turn, second)
    player.end_turn(turn)
    # play the first piece and the second up to the middle of its third word
    third = second.word_starts[2][1]
    played = player.fill(first.pcm.size + third + 50, now=10.0)
    assert np.array_equal(played, np.concatenate([first.pcm, second.pcm[:third + 50]]))
    assert turn.marks["first_audio"] == 10.0
    turn.cancelled.set()
    player.stop(turn, now=11.0)
    assert turn.spoken_text() == "Hello there. One two"
    assert not player.enqueue(turn, espeak.synthesize("more"))  # a cancelled turn queues nothing
    assert player.enqueue(other, Speech("x", np.full(10, 7, np.int16), espeak.sample_rate))
    out = player.fill(20, now=11.004)
    assert turn.marks["audio_stopped"] == 11.004 and "played_out" not in turn.marks
    assert np.array_equal(out, np.r_[np.full(10, 7), np.zeros(10)].astype(np.int16))


# -- resampling and WAV in -----------------------------------------------------------------------


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_resample_matches_the_analytic_sine(rate: int) -> None:
    f, n = 440.0, rate  # one second of a tone well inside both bands
    x = np.sin(2 * np.pi * f * np.arange(n) / rate).astype(np.float32)
    y = resample(x, rate, SAMPLE_RATE)
    assert abs(y.size - SAMPLE_RATE) <= 1
    want = np.sin(2 * np.pi * f * np.arange(y.size) / SAMPLE_RATE)
    inner = slice(800, y.size - 800)  # the filter's start-up and tail
    assert np.max(np.abs(y[inner] - want[inner])) < 2e-3
    # streaming in microphone-sized blocks gives the same samples
    stream = StreamResampler(rate, SAMPLE_RATE)
    blocks = [stream(x[i:i + 441]) for i in range(0, n, 441)] + [stream(np.zeros(0, np.float32), last=True)]
    z = np.concatenate(blocks)
    assert z.size == y.size and np.allclose(z, y, atol=1e-5)


def test_read_wav_mixes_down_and_frames_pad(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    stereo = (rng.uniform(-0.5, 0.5, size=(1000, 2)) * 32767).astype("<i2")
    path = tmp_path / "st.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(2), w.setsampwidth(2), w.setframerate(44100)
        w.writeframes(stereo.tobytes())
    x, rate = read_wav(path)
    assert rate == 44100 and np.allclose(x, stereo.astype(np.float32).mean(axis=1) / 32768, atol=1e-6)
    frames = Framer().push(x, final=True)
    assert [f.size for f in frames] == [FRAME] * math.ceil(1000 / FRAME)
    assert np.array_equal(np.concatenate(frames)[:1000], float_to_int16(x))
    (tmp_path / "bad.wav").write_bytes(b"RIFF0000WAVEjunk")
    with pytest.raises(ValueError, match="not a PCM WAV"):
        read_wav(tmp_path / "bad.wav")


def _wav_with_rate(path: Path, rate: int, seconds: float = 0.1, channels: int = 1) -> Path:
    """A 16-bit WAV whose header claims ``rate`` (patched in: the wave module refuses to write 0)."""
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(b"\0\0" * channels * int(16000 * seconds))
    data = bytearray(path.read_bytes())
    data[24:28] = rate.to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(("make", "match"), [
    (lambda d: _wav_with_rate(d / "zero.wav", 0), "says 0 Hz"),
    (lambda d: _wav_with_rate(d / "huge.wav", 4_000_000_000), "says 4000000000 Hz"),
    (lambda d: (d / "junk.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt garbage") and d / "junk.wav",
     "not a PCM WAV file (the file ends inside its header)"),
    (lambda d: (d / "dir.wav").mkdir() or d / "dir.wav", "a directory"),
])
def test_bad_wav_headers_get_one_clear_line(tmp_path: Path, make, match: str) -> None:
    path = make(tmp_path)
    for read in (read_wav, WavSource):
        with pytest.raises(ValueError) as exc:
            read(path)
        assert match in str(exc.value) and "\n" not in str(exc.value)


def test_wav_source_streams_what_the_whole_file_gives(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    stereo = (rng.uniform(-0.5, 0.5, size=(3 * 44100 + 17, 2)) * 32767).astype("<i2")
    path = tmp_path / "st.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(2), w.setsampwidth(2), w.setframerate(44100)
        w.writeframes(stereo.tobytes())
    x, rate = read_wav(path)
    whole = Framer().push(resample(x, rate, SAMPLE_RATE), final=True)
    streamed = list(WavSource(path)._blocks())
    assert len(streamed) == len(whole)
    assert max(np.max(np.abs(a.astype(np.int32) - b)) for a, b in zip(streamed, whole)) <= 2


def test_an_hour_of_wav_is_not_loaded_whole(tmp_path: Path) -> None:
    import tracemalloc

    path = _wav_with_rate(tmp_path / "hour.wav", 48_000, seconds=0.01, channels=2)
    data = bytearray(path.read_bytes())
    size = 3600 * 48_000 * 4  # an hour of 48 kHz stereo: 660 MiB, left sparse on disk
    data[4:8] = (36 + size).to_bytes(4, "little")  # the RIFF chunk's length
    data[40:44] = size.to_bytes(4, "little")  # the data chunk's
    path.write_bytes(bytes(data))
    with path.open("r+b") as f:
        f.truncate(44 + size)
    with pytest.raises(ValueError, match="more than 600 s"):
        read_wav(path)
    source = WavSource(path)
    assert source.seconds == pytest.approx(3600, rel=1e-3)
    tracemalloc.start()
    frames = list(itertools.islice(source._blocks(), 200))  # 6.4 s
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(frames) == 200 and peak < 8 << 20, peak


# -- voice activity -------------------------------------------------------------------------------

def test_endpointer_rules() -> None:
    ep = Endpointer(threshold=0.5, silence_ms=96, min_speech_ms=64, frame_ms=32)
    probs = [0.1, 0.9, 0.2, 0.9, 0.9, 0.4, 0.3, 0.2, 0.1, 0.1, 0.1]  # a blip, speech, a dip, silence
    events = [(i, e) for i, p in enumerate(probs) if (e := ep.update(p, float(i)))]
    # one frame above threshold is a blip; 0.4 is above threshold - 0.15: still speech
    assert [(i, e.kind, e.t) for i, e in events] == [(4, "start", 3.0), (8, "end", 5.0)]
    assert ep.end_now() is None


def test_silero_finds_the_utterance_and_its_end(espeak) -> None:
    speech = resample(int16_to_float(espeak.synthesize("Please tell me about the weather tomorrow.").pcm),
                      espeak.sample_rate, SAMPLE_RATE)
    voiced = np.nonzero(np.abs(speech) > 0.02)[0]
    lead, tail = 1.0, 1.5
    x = np.concatenate([np.zeros(int(lead * SAMPLE_RATE), np.float32), speech,
                        np.zeros(int(tail * SAMPLE_RATE), np.float32)])
    on, off = lead + voiced[0] / SAMPLE_RATE, lead + voiced[-1] / SAMPLE_RATE
    vad, ep = SileroVad(), Endpointer(silence_ms=400)
    events = []
    for i, frame in enumerate(Framer().push(x, final=True)):
        t = (i + 1) * FRAME / SAMPLE_RATE  # end of the frame, in audio seconds
        if (e := ep.update(vad(int16_to_float(frame)), t)) is not None:
            events.append((e, t))
    assert [e.kind for e, _ in events] == ["start", "end"], events
    (start, _), (end, detected) = events
    assert on - 0.05 <= start.t <= on + 0.25
    assert off - 0.3 <= end.t <= off + 0.1
    assert detected - end.t == pytest.approx(0.4, abs=0.033)  # the trailing silence, to a frame


# -- the recognizer process and the command's errors -----------------------------------------------

def test_recognizer_process_reports_the_childs_error(tmp_path: Path) -> None:
    from edge.voice.asr import RecognizerProcess, WhisperRecognizer

    with pytest.raises(RuntimeError, match="ValueError: --whisper-model .*not a directory"):
        RecognizerProcess(functools.partial(WhisperRecognizer, str(tmp_path / "none")))


@pytest.mark.parametrize("argv, message", [
    (["--no-audio", "--output", "x.wav", "--input", "in.wav"], "--output and --no-audio exclude each other"),
    (["--input", "missing.wav", "--no-audio"], "missing.wav"),
])
def test_voice_command_input_errors(tmp_path: Path, argv: list[str], message: str) -> None:
    p = subprocess.run([sys.executable, "-m", "edge.cli", "voice", "--url", "http://127.0.0.1:9", *argv],
                       check=False, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 2 and message in p.stderr and p.stderr.count("\n") <= 2, p.stderr
