"""Where the data-only profiles live (profiles/models, profiles/clusters, profiles/traces),
and reading a user's input file as text with one-line errors."""

from __future__ import annotations

from pathlib import Path

from planner.inputs.safe_read import MAX_TEXT_BYTES, read_input_bytes
from planner.specs import SpecError

PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"
MODELS_DIR = PROFILES_DIR / "models"
CLUSTERS_DIR = PROFILES_DIR / "clusters"
TRACES_DIR = PROFILES_DIR / "traces"


def read_text_file(path: str | Path, what: str, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of an input file; `what` names it in errors ("model config", "trace").

    Raises SpecError naming the path, what is wrong and the fix: a missing file, a
    directory, a FIFO, device or kernel file (planner/inputs/safe_read.py), a file larger
    than `max_bytes`, a file that cannot be read, or bytes that are not UTF-8 text.
    """
    p = Path(path)
    raw = read_input_bytes(p, what, max_bytes)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(
            f"{p}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
            f"a {what} is a text file"
        ) from None
