"""`selfspec export` and `selfspec import`: trained drafters to and from the speculators library's format (what vLLM
loads). Each drafter that has such a format writes and reads its own (heads/eagle/eagle3.py, heads/dflash/interop.py,
over heads/speculators.py); this module picks the right one for a directory and refuses the rest with the reason."""

from __future__ import annotations

from pathlib import Path

from .errors import SelfspecError
from .heads import dflash
from .heads.artifacts import heads_kind
from .heads.eagle import eagle3
from .heads.speculators import check_directory
from .models import Target

EXCHANGERS = {"eagle3": eagle3, "dflash": dflash}  # drafter -> its module's export_heads / import_heads
_WHY_NOT = {
    "eagle": "`eagle` is EAGLE-1, which speculators does not define: train `eagle3`",
    "medusa": "speculators defines no Medusa format",
    "layerskip": "a layer-skip set is not a drafter model vLLM loads",
}


def exportable_kind(heads_dir: Path) -> str:
    """The drafter of a heads directory that can be exported, or a one-line error (no model needed: the CLI checks
    this before loading one)."""
    heads_dir = Path(heads_dir)
    if not heads_dir.exists():
        raise SelfspecError(f"heads directory '{heads_dir}' does not exist")
    kind = heads_kind(heads_dir)
    if kind not in EXCHANGERS:
        why = f": {_WHY_NOT[kind]}" if kind in _WHY_NOT else ""
        raise SelfspecError(
            f"'{heads_dir}' holds {kind or 'no'} heads: only {' and '.join(EXCHANGERS)} heads export "
            f"to the speculators format{why}"
        )
    return kind


def importable_kind(source: Path) -> str:
    """The drafter of a speculators directory selfspec imports, or a one-line error (no model needed)."""
    return check_directory(Path(source), tuple(EXCHANGERS))


def export_heads(target: Target, heads_dir: Path, out: Path, verifier: str, dtype: str = "bfloat16") -> Path:
    """Heads (selfspec's, or a speculators directory) -> a speculators directory for `verifier` at `out`."""
    kind = exportable_kind(heads_dir)
    return EXCHANGERS[kind].export_heads(target, Path(heads_dir), Path(out), verifier, dtype)


def import_heads(target: Target, source: Path, out: Path) -> tuple[str, Path]:
    """A speculators directory -> (its drafter, a heads directory at `out` fingerprinted to `target`)."""
    kind = importable_kind(source)
    return kind, EXCHANGERS[kind].import_heads(target, Path(source), Path(out))
