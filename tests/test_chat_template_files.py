"""Where a model directory keeps its chat template, read as transformers reads it: the
processor's files (processor_config.json, the legacy chat_template.json, chat_template.jinja
and additional_chat_templates/) for a vision-language model, the tokenizer's otherwise.
transformers' own loaders are the oracle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from edge.errors import ChatTemplateError
from edge.model.random_model import default_model_path
from edge.model.tokenizer import Tokenizer, TokenizerError

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def model_dir(tmp_path: Path, processor: bool, template_in_config: str | None = None) -> Path:
    """A directory with the embedded model's tokenizer, and a processor's config if asked."""
    d = tmp_path / "m"
    d.mkdir()
    src = default_model_path()
    shutil.copy(src / "tokenizer.json", d)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template_in_config is not None:
        config["chat_template"] = template_in_config
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    if processor:
        (d / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "Qwen2VLImageProcessor"}))
    return d


def processor_template(d: Path) -> str | dict | None:
    processor_dict, _ = transformers.ProcessorMixin.get_processor_dict(str(d))
    return processor_dict.get("chat_template")


def test_legacy_chat_template_json_alone(tmp_path: Path) -> None:
    d = model_dir(tmp_path, processor=True)
    (d / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert processor_template(d) == TEMPLATE
    tok = Tokenizer.from_pretrained(d)
    assert tok.chat_template == TEMPLATE
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi"


def test_processor_files_win_over_the_tokenizer_config(tmp_path: Path) -> None:
    d = model_dir(tmp_path, processor=True, template_in_config="{{ 'tokenizer' }}")
    (d / "chat_template.jinja").write_text("{{ 'jinja' }}")
    (d / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert processor_template(d) == TEMPLATE == Tokenizer.from_pretrained(d).chat_template  # json before jinja
    (d / "chat_template.json").unlink()
    assert processor_template(d) == "{{ 'jinja' }}" == Tokenizer.from_pretrained(d).chat_template
    (d / "processor_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert processor_template(d) == TEMPLATE == Tokenizer.from_pretrained(d).chat_template


def test_named_templates_pick_the_default(tmp_path: Path) -> None:
    d = model_dir(tmp_path, processor=True)
    (d / "chat_template.jinja").write_text(TEMPLATE)
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text("{{ 'tools' }}")
    assert processor_template(d) == {"default": TEMPLATE, "tool_use": "{{ 'tools' }}"}
    assert Tokenizer.from_pretrained(d).chat_template == TEMPLATE


def test_text_model_ignores_a_processor_file(tmp_path: Path) -> None:
    """Without a processor, transformers' tokenizer does not read chat_template.json."""
    d = model_dir(tmp_path, processor=False)
    (d / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert transformers.AutoTokenizer.from_pretrained(d).chat_template is None
    tok = Tokenizer.from_pretrained(d)
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("body", ["{", "[1]", '{"chat_template": 3}'])
def test_broken_chat_template_json_is_one_line(tmp_path: Path, body: str) -> None:
    d = model_dir(tmp_path, processor=True)
    (d / "chat_template.json").write_text(body)
    with pytest.raises(TokenizerError, match="chat_template.json") as info:
        Tokenizer.from_pretrained(d)
    assert "\n" not in str(info.value)


def test_vl_model_with_chat_template_json_renders_as_the_processor(tmp_path: Path) -> None:
    """The refusal the issue found: a Qwen-VL directory whose template is only in
    chat_template.json (as the published Qwen2.5-VL checkpoints ship it) now loads, and the
    prompt holding an image tokenizes as the HF processor's."""
    from PIL import Image

    from edge.model.vision.random_model import make_vl_model
    from edge.runtime.engine import Engine

    path = make_vl_model(tmp_path / "vl", "qwen2.5-vl-tiny")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "chat_template.json").write_text(json.dumps({"chat_template": config.pop("chat_template")}))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    image = Image.new("RGB", (56, 56), (200, 30, 30))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}]}]

    class ImageOnly(transformers.Qwen2_5_VLProcessor):  # its video processor needs torchvision
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    processor = ImageOnly(transformers.AutoImageProcessor.from_pretrained(path),
                          transformers.AutoTokenizer.from_pretrained(path), chat_template=processor_template(path))
    want = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    engine = Engine.from_pretrained(path, device="cpu", dtype="float32", max_seq_len=256)
    assert engine.chat_prompt(messages).ids == list(want["input_ids"][0])
