"""One call of the device program (docs/device.md): take in `.device/NAME`, run the stages that are due.

    python3 scripts/device_call.py NAME [--out DIR] [--budget SECONDS] [--tiny]

NAME is a call of the plan (call-1, call-2, ..., train, finish). Outputs go to --out (default $OUT): status.json,
log.txt, results.tar.xz and the new heads, rewritten after every stage. --budget is the call's own deadline in
seconds (keep it a minute under the tool's timeout); --tiny runs the stages at the rehearsal's scale (a CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the device runs this tree without installing it

from selfspec.device.program import Call, run_call  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="the call: call-1, call-2, ..., train, finish")
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT"), help="the output folder (default $OUT)")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds before the call's last output")
    parser.add_argument("--tiny", action="store_true", help="the rehearsal's scale, on a CPU")
    args = parser.parse_args(argv)
    if args.out is None:
        parser.exit(2, "device_call.py: error: no output folder: pass --out DIR or set $OUT\n")
    call = Call(REPO, args.name, Path(args.out), time.monotonic() + args.budget, args.tiny)
    return run_call(call)


if __name__ == "__main__":
    sys.exit(main())
