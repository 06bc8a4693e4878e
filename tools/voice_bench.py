"""Measure ``edge voice`` on a spoken conversation synthesized here with espeak-ng.

    python tools/voice_bench.py --url http://127.0.0.1:8000 [--runs 3] [--out DIR] [-- EDGE VOICE ARGS]

Builds the input WAV (a question, then a second utterance spoken over the first answer,
which barges in), runs ``edge voice --input IN.wav --output OUT.wav --json`` against the
running service, and prints each turn's latencies and barge-in figures, then medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge.voice.audio_io import write_wav
from edge.voice.tts import EspeakSynthesizer

QUESTION = "Hello robot, what is the weather like today?"
BARGE_IN = "Stop. Tell me a story about the paged cache instead."
# (silence before it in seconds, text): the gap lets the first answer start playing
CONVERSATION = ((0.5, QUESTION), (3.0, BARGE_IN))


def make_conversation_wav(path: str | Path, parts=CONVERSATION, tail_s: float = 2.5,
                          rate_wpm: int = 175) -> list[tuple[float, float]]:
    """Write the utterances with silences between them; their (start, end) times in seconds."""
    synth = EspeakSynthesizer(rate_wpm=rate_wpm)
    rate, chunks, spans, t = synth.sample_rate, [], [], 0.0
    for gap, text in parts:
        chunks.append(np.zeros(int(gap * rate), np.int16))
        t += gap
        pcm = synth.synthesize(text).pcm
        chunks.append(pcm)
        spans.append((t, t + pcm.size / rate))
        t += pcm.size / rate
    chunks.append(np.zeros(int(tail_s * rate), np.int16))
    write_wav(path, np.concatenate(chunks), rate)
    return spans


def run_voice(where: list[str], wav: Path, out_wav: Path, extra: list[str], env: dict | None = None,
              timeout: float = 180.0) -> tuple[list[dict], str]:
    cmd = [sys.executable, "-m", "edge.cli", "voice", *where, "--input", str(wav), "--output", str(out_wav),
           "--json", *extra]
    p = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"edge voice exited {p.returncode}:\n{p.stderr[-4000:]}")
    return [json.loads(line) for line in p.stdout.splitlines() if line.strip()], p.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--uds")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", help="keep the WAVs here (default: a temporary directory)")
    ap.add_argument("voice_args", nargs=argparse.REMAINDER, help="after --: more edge voice arguments")
    args = ap.parse_args()
    extra = [a for a in args.voice_args if a != "--"] or [
        "--max-tokens", "1000", "--ignore-eos", "--temperature", "1", "--on-eof", "cancel"]
    where = ["--uds", args.uds] if args.uds else ["--url", args.url]
    out = Path(args.out or tempfile.mkdtemp(prefix="voice-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    wav = out / "conversation.wav"
    print(f"utterances (s): {make_conversation_wav(wav)}  ->  {wav}")
    table: dict[str, list[float]] = {}
    for run in range(args.runs):
        turns, _ = run_voice(where, wav, out / f"answer-{run}.wav", extra + ["--seed", str(run)])
        for t in turns:
            figures = {**t["latency_ms"], **{f"barge_in.{k}": v for k, v in (t.get("barge_in_ms") or {}).items()}}
            if t.get("request_ended_in_decode_steps") is not None:
                figures["barge_in.request_ended_in_decode_steps"] = t["request_ended_in_decode_steps"]
            print(json.dumps({"run": run, "turn": t["turn"], "transcript": t["transcript"],
                              "interrupted_by": t["interrupted_by"], "cached_tokens": (t["usage"] or {}).get(
                                  "prompt_tokens_details", {}).get("cached_tokens"), **figures}))
            for k, v in figures.items():
                if v is not None:
                    table.setdefault(f"turn{t['turn']}.{k}", []).append(v)
    print("\nmedians over runs:")
    for k, vs in table.items():
        print(f"  {k:50s} {statistics.median(vs):8.1f}   (n={len(vs)}, min {min(vs):.1f}, max {max(vs):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
