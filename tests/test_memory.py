"""What a long-lived process holds between requests stays bounded (selfspec/memory.py): oneDNN's kernel caches are
capped when a target is loaded (importing selfspec leaves the environment alone), and what a request freed goes back
to the system after it."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
import torch

from selfspec import SelfSpec
from selfspec.memory import (
    HUGE_PAGE,
    KERNEL_CACHE_ENTRIES,
    KERNEL_CACHE_VARIABLES,
    POPULATE_BYTES,
    TENSOR_ALIGNMENT,
    into_huge_pages,
    populated_zeros,
)
from selfspec.models import load_target

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

for rows in range(2, 202):  # 400 kernels: the caches (KERNEL_CACHE_ENTRIES) are full well before the end
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


def _huge_pages_in(address: int) -> int | None:
    """AnonHugePages (kB) of the mapping of this process that holds `address`; None if no mapping does."""
    mapping = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: start-end perms offset dev inode [path]
                start, end = (int(part, 16) for part in fields[0].split("-"))
                mapping = start <= address < end
            elif mapping and fields[0] == "AnonHugePages:":
                return int(fields[1])
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_a_loaded_targets_weights_are_copied_into_one_mapping_on_huge_pages(tiny_checkpoint):
    target = load_target(str(tiny_checkpoint), path="stock")
    tensors = [*target.model.parameters(), *target.model.buffers()]
    addresses = sorted(tensor.data_ptr() for tensor in tensors)
    assert addresses[0] % HUGE_PAGE == 0  # the first tensor starts on a 2 MB boundary
    assert all(address % TENSOR_ALIGNMENT == 0 for address in addresses)
    # one mapping, tensors one after another: the span is the tensors' bytes and little more
    span = max(tensor.data_ptr() + tensor.numel() * tensor.element_size() for tensor in tensors) - addresses[0]
    assert span <= sum(tensor.numel() * tensor.element_size() + TENSOR_ALIGNMENT for tensor in tensors)
    tied = target.model.lm_head.weight.data_ptr() == target.model.get_input_embeddings().weight.data_ptr()
    assert tied == bool(target.model.config.tie_word_embeddings)  # tied weights stay tied, others apart
    enabled = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    if "[never]" not in enabled and span >= HUGE_PAGE:
        assert _huge_pages_in(addresses[0]) > 0


def test_copies_on_huge_pages_equal_the_originals_and_outlive_them():
    originals = [torch.randn(3, 5), torch.arange(7), torch.randn(4, 4).t(), torch.ones(2, dtype=torch.bfloat16)]
    expected = [tensor.clone() for tensor in originals]
    copies = into_huge_pages(originals)
    if copies is None:
        pytest.skip("no transparent huge pages on this system")
    del originals
    for copy, tensor in zip(copies, expected, strict=True):
        assert copy.dtype == tensor.dtype and copy.is_contiguous() and torch.equal(copy, tensor)
    copies[0].add_(1)  # the copies are writable, and their own memory
    assert torch.equal(copies[0], expected[0] + 1)


def _mapping_starts() -> set[int]:
    with open("/proc/self/maps") as maps:
        return {int(line.split("-", 1)[0], 16) for line in maps}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps and MAP_POPULATE are Linux's")
def test_large_zero_tensors_are_mappings_of_their_own_filled_in_at_once():
    """The batch engine's cache storage: zeros, writable, in a mapping of its own (its pages already resident) that is
    unmapped once the tensor and its views are gone; small ones are ordinary tensors."""
    like = torch.empty(0, dtype=torch.float64)
    shape = (3, 2, POPULATE_BYTES // 8 // 6 + 1)  # just over POPULATE_BYTES
    tensor = populated_zeros(shape, like)
    assert tensor.shape == shape and tensor.dtype == torch.float64 and not tensor.any()
    start = tensor.untyped_storage().data_ptr()
    assert start in _mapping_starts()
    view = tensor[1]
    del tensor
    view.fill_(2.0)  # the view keeps the mapping
    assert view.sum() == 2.0 * view.numel() and start in _mapping_starts()
    del view
    gc.collect()
    assert start not in _mapping_starts()
    small = populated_zeros((4, 4), like)
    assert small.shape == (4, 4) and not small.any() and small.untyped_storage().data_ptr() not in _mapping_starts()
