#!/usr/bin/env python3
"""Write the README's sample inputs: examples/question.wav (a spoken question, 16 kHz mono,
by eSpeak NG: pip install -e ".[voice]") and examples/table.png (a drawn picture).

python tools/make_examples.py [OUT_DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("edge") is None:
    # Run from a checkout without installing the package.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

QUESTION = "What is the weather like?"  # pocketsphinx hears every word of it as eSpeak says it
# Silence around the words: the listener hears the start, and 0.8 s at the end closes the utterance.
LEAD_S, TAIL_S = 0.3, 0.8


def write_question(path: Path) -> None:
    from edge.voice.audio_io import SAMPLE_RATE, resample, write_wav
    from edge.voice.tts import EspeakSynthesizer

    speech = EspeakSynthesizer("en-us", 140).synthesize(QUESTION)
    x = resample(speech.pcm.astype(np.float32) / 32768.0, speech.sample_rate, SAMPLE_RATE)
    pad = lambda s: np.zeros(int(s * SAMPLE_RATE), np.float32)  # noqa: E731
    x = np.concatenate([pad(LEAD_S), x, pad(TAIL_S)])
    write_wav(path, np.clip(np.round(x * 32767.0), -32768, 32767).astype(np.int16), SAMPLE_RATE)


def write_picture(path: Path) -> None:
    """A red apple and a blue mug on a wooden table under a window: plain shapes a
    vision-language model can name."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (320, 240), (225, 232, 240))
    d = ImageDraw.Draw(img)
    d.rectangle((20, 20, 140, 110), fill=(150, 200, 245), outline=(90, 90, 90), width=4)  # window
    d.line((80, 20, 80, 110), fill=(90, 90, 90), width=3)
    d.rectangle((0, 160, 320, 240), fill=(150, 100, 55))  # table top
    d.line((0, 160, 320, 160), fill=(110, 70, 35), width=3)
    d.ellipse((60, 115, 130, 185), fill=(205, 30, 35))  # apple
    d.line((95, 117, 100, 100), fill=(90, 60, 20), width=4)
    d.ellipse((100, 98, 122, 110), fill=(60, 150, 50))  # leaf
    d.rectangle((190, 105, 250, 180), fill=(40, 80, 200))  # mug
    d.arc((235, 118, 275, 160), start=-90, end=90, fill=(40, 80, 200), width=8)
    img.save(path, optimize=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", nargs="?", type=Path, default=Path(__file__).resolve().parent.parent / "examples")
    args = p.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_question(args.out_dir / "question.wav")
    write_picture(args.out_dir / "table.png")
    for name in ("question.wav", "table.png"):
        print(args.out_dir / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
