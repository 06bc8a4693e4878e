"""Reading a model directory's small files without trusting them to be files.

A FIFO named ``config.json`` blocks ``open()`` forever; ``/dev/zero`` (or a 10 GB file)
behind that name is read until memory runs out. Each file is checked to be a regular
file of bounded size (``stat`` follows symlinks, so a link to a device is refused too)
before it is opened; the error names the file, on one line.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

MAX_JSON_BYTES = 16 << 20  # config.json, tokenizer_config.json, ...: kilobytes in practice
MAX_TOKENIZER_BYTES = 256 << 20  # tokenizer.json: tens of MB for large vocabularies

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def check_regular(path: Path, error: type[Exception], max_bytes: int | None = None) -> int:
    """The size of ``path``; ``error`` when it is not a regular file or exceeds ``max_bytes``
    (FileNotFoundError when it does not exist)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except OSError as exc:
        raise error(f"cannot read {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        raise error(f"{path} is {kind}, not a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise error(f"{path} holds {st.st_size} bytes, more than the {max_bytes} such a file may")
    return st.st_size


def read_text(path: Path, error: type[Exception], max_bytes: int = MAX_JSON_BYTES) -> str:
    check_regular(path, error, max_bytes)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)  # the file may have grown since the check
        if len(data) > max_bytes:
            raise error(f"{path} holds more than the {max_bytes} bytes such a file may")
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"cannot read {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise error(f"cannot read {path}: {exc.strerror or exc}") from None


def read_json_object(path: Path, error: type[Exception], max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """The JSON object in ``path``; ``error`` (one line, naming the file) otherwise."""
    text = read_text(path, error, max_bytes)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise error(f"cannot parse {path}: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise error(f"{path} must hold a JSON object, not a JSON {_json_kind(data)}")
    return data


def _json_kind(value: Any) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(value), "null")
