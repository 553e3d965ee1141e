"""The device program: what a lent GPU machine runs, in a fixed sequence of calls (docs/device.md).

A lent machine gives 15 minutes in all, at most 10 a call and 64 MiB of working tree a call, no network and no
package index. `bundle` splits what the calls must carry (the model, the training data, the packages the machine
lacks) into per-call folders that fit beside the tracked tree; `program` is what every call runs: it takes in its
folder, then runs the stages that are due, each within a time budget it enforces itself, and writes what it has to
the call's output folder in priority order. `scripts/device_pack.py` and `scripts/device_call.py` are the commands.
"""
