"""Open a GGUF file (llama.cpp's model format) with errors a user can act on.

The reading itself is llama.cpp's own Python package, `gguf` (`GGUFReader`, a memory map of the
file). Its errors on a damaged file are numpy's ("cannot reshape array of size 66784 into shape
(576,360)"); here every failure becomes a `GGUFError` that names the file and the offset, key or
tensor at fault. The engine's weights and the tokenizer (engine and gateway alike) both start
from `open_gguf`, so this module stays light: gguf and numpy, no torch.
"""
from __future__ import annotations

from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

MAGIC = b"GGUF"
_MISSING = object()


class GGUFError(ValueError):
    """The GGUF file is unreadable, incomplete, or not one this project can serve."""


class _CheckedReader(GGUFReader):
    """GGUFReader that checks each tensor's data lies inside the file before viewing it, so a
    truncated file names its first incomplete tensor instead of failing in numpy, and that
    slices the file as a plain array rather than as a `np.memmap`.

    Opening parses every metadata array an item at a time (SmolLM2's 49k-token vocabulary and
    its merges: ~250k slices), and a slice of a memmap costs several times one of a plain array
    (numpy's memmap re-wraps each: `__array_finalize__`). Views of the same mapped bytes either
    way; on one Zen 3 core opening SmolLM2's file took 3.4 s before, 1.1 s so."""

    @cached_property
    def _plain(self) -> np.ndarray:
        return self.data.view(np.ndarray)       # the memmap's bytes, sliced without its wrapper

    def _get(self, offset, dtype, count=1, override_order=None):
        count = int(count)
        values = self._plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return values.view(values.dtype.newbyteorder(order))

    def _build_tensors(self, start_offs, fields):
        size = len(self.data)
        for f in fields:
            _, name, _, dims, raw_type, offset = f.parts
            name = bytes(name).decode("utf-8", "replace")
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
            except (ValueError, KeyError):
                raise GGUFError(f"tensor {name}: unknown tensor type {int(raw_type[0])}") from None
            start = int(start_offs + offset[0])
            end = start + int(np.prod(dims)) * type_size // block
            if end > size:
                raise GGUFError(f"tensor {name}: data runs to byte {end:,} but the file ends at "
                                f"{size:,} (truncated?)")
        super()._build_tensors(start_offs, fields)


def open_gguf(path: str | Path) -> GGUFReader:
    """The file's reader; raises GGUFError (file, offset or tensor named) for a bad file.

    The last few readers are kept (opening parses every metadata array: ~1 s for a 49k-token
    vocabulary), so the engine's weights and tokenizer share one; a file changed on disk since
    is opened again."""
    path = Path(path)
    try:
        stat = path.resolve().stat()
    except OSError as e:
        raise GGUFError(f"{path}: {e.strerror or e}") from None
    return _open(path.resolve(), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=2)
def _open(path: Path, _mtime_ns: int, _size: int) -> GGUFReader:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise GGUFError(f"{path}: {e.strerror or e}") from None
    if head != MAGIC:
        raise GGUFError(f"{path} is not a GGUF file: bytes 0-3 are {head!r}, not {MAGIC!r}")
    try:
        return _CheckedReader(path)
    except GGUFError as e:
        raise GGUFError(f"{path}: {e}") from None
    except (ValueError, IndexError, KeyError, UnicodeDecodeError) as e:
        raise GGUFError(f"{path}: the GGUF header is corrupted or truncated ({e})") from None


def field(reader: GGUFReader, key: str, default=_MISSING):
    """Metadata value `key` as Python data (str, int, float, bool, or a list of them)."""
    f = reader.fields.get(key)
    if f is None:
        if default is _MISSING:
            raise GGUFError(f"{reader.data.filename}: metadata key {key} is missing")
        return default
    if f.types and f.types[0] == GGUFValueType.ARRAY:
        return list(f.contents())
    return f.contents()
