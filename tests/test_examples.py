"""The sample inputs shipped in examples/ (used by the README's `edge voice --input` and
`--image` lines): small, readable by the engine, what tools/make_examples.py writes, and
the question is heard as asked by the default recognizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
LIMIT = 200 * 1024


def test_question_wav_is_heard_as_asked() -> None:
    pytest.importorskip("pocketsphinx")
    from edge.voice.asr import PocketSphinxRecognizer
    from edge.voice.audio_io import read_wav

    path = EXAMPLES / "question.wav"
    assert path.stat().st_size < LIMIT
    x, rate = read_wav(path)
    assert rate == 16_000 and 1.0 < x.size / rate < 5.0
    r = PocketSphinxRecognizer()
    r.start()
    r.accept(np.round(x * 32767).astype(np.int16))
    assert r.finish() == "what is the weather like"


def test_table_png_is_an_image_the_model_takes() -> None:
    from edge.model.vision.preprocess import ImageLimits, decode_image

    path = EXAMPLES / "table.png"
    assert path.stat().st_size < LIMIT
    image = decode_image(path.read_bytes(), ImageLimits())
    assert image.size == (320, 240)


def test_examples_are_what_the_tool_writes(tmp_path: Path) -> None:
    pytest.importorskip("espeakng_loader")
    import subprocess
    import sys

    # Its own process, as it is run: eSpeak NG is one library-wide state that other tests'
    # synthesizers in this process would have left behind.
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_examples.py"), str(tmp_path)], cwd=ROOT,
                   check=True, timeout=300)
    for name in ("question.wav", "table.png"):
        assert (tmp_path / name).read_bytes() == (EXAMPLES / name).read_bytes(), name


def test_readme_uses_them() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "--input examples/question.wav" in readme and "--image examples/table.png" in readme
