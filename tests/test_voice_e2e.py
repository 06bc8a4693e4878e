"""``edge voice`` end to end: a spoken conversation synthesized here (espeak-ng) is played
into the voice process through its WAV input, against a real ``edge serve`` subprocess
with the embedded model. The second utterance is spoken over the first answer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from test_server_support import ServerProc, server_env, slots_idle

from edge.voice.audio_io import read_wav

ROOT = Path(__file__).resolve().parent.parent
CANCELLED = 'edge_requests_finished_total{endpoint="/v1/chat/completions",reason="cancelled"}'
USED = 'edge_kv_blocks{state="used"}'


def _bench_tool():
    spec = importlib.util.spec_from_file_location("voice_bench", ROOT / "tools" / "voice_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = ServerProc(tmp_path_factory.mktemp("voice-srv"))
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_voice_conversation_with_barge_in(server: ServerProc, tmp_path: Path) -> None:
    bench = _bench_tool()
    wav, out = tmp_path / "conversation.wav", tmp_path / "answer.wav"
    # 4 s after the question: time for its answer to start playing on a busy 2-core runner
    (q_start, q_end), (b_start, _) = bench.make_conversation_wav(
        wav, parts=((0.5, bench.QUESTION), (4.0, bench.BARGE_IN)))
    before = server.metrics()
    # a long answer (ignore_eos): still generating when the second utterance barges in
    # (3000 tokens: ~20 s at this server's CPU speed, far past the barge-in at 4 s however
    # fast or loaded the runner is); the second answer is cancelled when the input ends
    turns, log = bench.run_voice(["--url", server.base_url], wav, out,
                                 ["--max-tokens", "3000", "--ignore-eos", "--temperature", "1", "--seed", "0",
                                  "--on-eof", "cancel"], env=server_env())
    assert len(turns) == 2, log
    first, second = turns
    m1, m2 = first["marks_s"], second["marks_s"]

    # turn 1: heard, answered aloud, then interrupted by the second utterance
    assert first["transcript"].strip(), log
    assert q_start - 0.1 < m1["speech_start"] < q_start + 0.4 and m1["speech_end"] < q_end + 0.2
    assert first["interrupted_by"] == "barge-in"
    assert m1["first_audio"] < m1["barge_onset"], "the answer was not playing yet when the user spoke again"
    assert b_start - 0.1 < m1["barge_onset"] < b_start + 0.4
    assert m1["barge_onset"] <= m1["audio_stopped"] < m1["barge_onset"] + 1.0  # docs/voice.md has the figures
    # the service cancelled the request it was still generating
    assert first["cancel_status"] == 200 and first["finish_reason"] == "cancelled", log
    assert first["usage"]["completion_tokens"] < 3000
    assert m1["cancel_sent"] <= m1["request_ended"]
    # the history keeps what was heard: a strict prefix of the generated answer
    assert first["heard"] and first["answer"].startswith(first["heard"].rstrip())
    assert len(first["heard"]) < len(first["answer"])

    # turn 2: the barge-in utterance itself, prefilled while spoken, served from the cache
    assert second["transcript"].strip(), log
    assert m2["speech_start"] == m1["barge_onset"]
    assert second["history_sent"] == [{"role": "user", "content": first["transcript"]},
                                      {"role": "assistant", "content": first["heard"]}]
    assert second["partials"], "no partial transcript was prefilled"
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert "first_audio" in m2 and second["interrupted_by"] == "end of input"

    # the output timeline: sound while answer 1 played, silence from the barge-in to answer 2
    x, rate = read_wav(out)

    def seg(a: float, b: float) -> np.ndarray:
        return x[int(a * rate):int(b * rate)]

    assert not seg(0.0, m1["first_audio"] - 0.02).any()
    playing = seg(m1["first_audio"], m1["barge_onset"])
    assert playing.size and np.sqrt(np.mean(playing ** 2)) > 0.01
    assert not seg(m1["audio_stopped"] + 0.011, m2["first_audio"] - 0.011).any()
    assert np.sqrt(np.mean(seg(m2["first_audio"], m2["audio_stopped"]) ** 2)) > 0.01

    # the service counted both cancellations, and every KV block came back
    after = server.wait_for(lambda m: m.get(CANCELLED, 0) >= before.get(CANCELLED, 0) + 2 and slots_idle(m)
                            and m.get(USED, -1) == 0, what="both answers cancelled and their KV blocks freed")
    assert after[USED] == 0 and before.get(USED, 0) == 0
