"""What a long-lived process holds between requests stays bounded (selfspec/memory.py): oneDNN's kernel caches are
capped when a target is loaded (importing selfspec leaves the environment alone), and what a request freed goes back
to the system after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from selfspec import SelfSpec
from selfspec.memory import KERNEL_CACHE_ENTRIES, KERNEL_CACHE_VARIABLES

from .helpers import make_tiny_target

_KERNEL_CACHE_PROBE = """
import ctypes, sys
import psutil, torch
from selfspec.models import apply_environment_defaults
from selfspec.execution import pack_weight, packed_linear

apply_environment_defaults()  # as load_target does before it packs a target's weights

torch.set_num_threads(1)
libc, process = ctypes.CDLL("libc.so.6"), psutil.Process()
weights = [torch.randn(384, 256), torch.randn(256, 384)]
packed = [pack_weight(weight) for weight in weights]

def resident_mb():
    libc.malloc_trim(0)  # freed heap back to the system: what is left is held
    return process.memory_info().rss / 2**20

def run(rows):  # a new row count: oneDNN compiles kernels for each weight shape
    for weight, pack in zip(weights, packed):
        packed_linear(torch.randn(rows, weight.shape[1]), pack, None, weight.shape[0])

for rows in range(2, 202):  # 400 kernels: the caches (256 entries) are full well before the end
    run(rows)
middle = resident_mb()
for rows in range(202, 402):  # 400 more
    run(rows)
print(resident_mb() - middle)
"""


def test_the_kernel_caches_are_bounded_however_many_shapes_a_process_meets():
    """oneDNN keeps the kernels it compiles for each new row count (~0.6 MB a weight shape) in two caches; selfspec
    bounds both when it loads a target, so after they fill, 400 more new shapes add (almost) nothing. Without the bound
    (oneDNN's default of 1,024 entries each) the second half adds ~0.5 MB a shape, ~200 MB."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
    }
    result = subprocess.run(
        [sys.executable, "-c", _KERNEL_CACHE_PROBE], capture_output=True, text=True, env=env, check=True
    )
    grown_mb = float(result.stdout.strip().splitlines()[-1])
    assert grown_mb < 25, f"400 new shapes after the caches filled grew the process by {grown_mb:.0f} MB"


_ENVIRONMENT_PROBE = """
import json, os, sys
before = dict(os.environ)
import selfspec
imported = dict(os.environ)
selfspec.load_target(sys.argv[1])
print(json.dumps([imported == before, {k: v for k, v in os.environ.items() if before.get(k) != v}]))
"""


def test_selfspec_sets_its_environment_defaults_when_it_loads_a_target_not_on_import(tiny_checkpoint):
    names = ("HF_HUB_OFFLINE", *KERNEL_CACHE_VARIABLES)
    env = {key: value for key, value in os.environ.items() if key not in names}
    env["LRU_CACHE_CAPACITY"] = "64"  # a value the user set wins
    result = subprocess.run(
        [sys.executable, "-c", _ENVIRONMENT_PROBE, str(tiny_checkpoint)], capture_output=True, text=True, env=env
    )
    unchanged_on_import, set_on_load = json.loads(result.stdout.strip().splitlines()[-1])
    assert unchanged_on_import
    assert set_on_load == {"HF_HUB_OFFLINE": "1", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(KERNEL_CACHE_ENTRIES)}


_FRAGMENTED_PROBE = """
import psutil
from selfspec.memory import release_freed_memory

process = psutil.Process()
blocks = [bytearray(64 * 1024) for _ in range(3000)]  # ~190 MB from the C heap (below glibc's mmap threshold)
kept = blocks[::10]  # every tenth kept: the heap cannot shrink from its top
del blocks
before = process.memory_info().rss / 2**20
released = release_freed_memory()
print(released, before - process.memory_info().rss / 2**20)
"""


def test_freed_memory_goes_back_to_the_system():
    """A fragmented heap (every tenth block kept) holds what was freed until `release_freed_memory` returns it."""
    result = subprocess.run([sys.executable, "-c", _FRAGMENTED_PROBE], capture_output=True, text=True, check=True)
    released, returned_mb = result.stdout.split()
    assert released == "True" and float(returned_mb) > 100, result.stdout


def test_each_request_through_one_object_releases_what_it_freed(monkeypatch):
    calls = []
    monkeypatch.setattr("selfspec.api.release_freed_memory", lambda: calls.append(1) or True)
    spec = SelfSpec(make_tiny_target("llama"), drafter="ngram")
    for seed in range(3):
        spec.generate(input_ids=[1, 2, 3, 4], max_new_tokens=4, seed=seed)
    assert len(calls) == 3
