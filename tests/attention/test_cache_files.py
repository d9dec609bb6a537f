"""Many processes, one cache (`FOCUS_HF_CACHE`): processes that start together with an empty cache build the C kernels
once and keep every crossover any of them stores; a reader never sees part of a file; a damaged or foreign file in
the cache is built or measured again, with a warning - never trusted, never crashed on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import focus_hf.attention.crossover as crossover
from focus_hf.attention.cpu import build, native

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = 4


def compiler_wrapper(folder: Path, log: Path) -> Path:
    """A C compiler that notes each call in `log`, then runs the real one at -O0 (what is tested is who builds, not
    the build; -O3 takes most of a minute of CPU per build)."""
    real = build.compiler()
    if real is None:
        pytest.fail("these tests need a C compiler (cc on the PATH)")
    wrapper = folder / "cc"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'echo "$PPID $*" >> {log}\n'  # the process that runs the compiler, then what it asks
        'for a in "$@"; do shift; [ "$a" = -O3 ] && a=-O0; set -- "$@" "$a"; done\n'
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def start_together(code: str, count: int, env: dict, go: Path) -> list[subprocess.Popen]:
    """`count` Python processes running `code` once the file `go` exists (they start up first, then all at once)."""
    waiting = f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.01)\n"
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", waiting + code, str(number)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for number in range(count)
    ]
    go.touch()
    return processes


def finished(processes: list[subprocess.Popen], timeout: float = 600) -> list[str]:
    outputs = []
    for process in processes:
        out, err = process.communicate(timeout=timeout)
        assert process.returncode == 0, err[-3000:]
        outputs.append(out)
    return outputs


def environment(cache: Path, **extra: str) -> dict:
    env = {name: value for name, value in os.environ.items() if name != "FOCUS_HF_NATIVE"}
    return dict(env, FOCUS_HF_CACHE=str(cache), PYTHONPATH=str(ROOT), **extra)


# Loads the kernels (building them where the cache has none) and prints one call's result.
KERNEL_USER = """
import torch
from focus_hf.attention.cpu import native, native_decode
kernels = native.native_kernels()
assert kernels is not None, "no kernels"
query, keys = torch.ones(4, 32), torch.linspace(-1, 1, 2 * 70 * 32).reshape(2, 70, 32)
print(kernels.build_id, float(native_decode.attend_runs(query, [(keys, keys)], 0.2).sum()))
"""


def test_processes_starting_together_on_an_empty_cache_build_the_kernels_once(tmp_path):
    log = tmp_path / "compiler.log"
    cc = compiler_wrapper(tmp_path, log)
    cache = tmp_path / "cache"
    env = environment(cache, CC=str(cc))
    outputs = finished(start_together(KERNEL_USER, PROCESSES, env, tmp_path / "go"))
    assert len(set(outputs)) == 1  # the same build, the same result, in every process
    calls = log.read_text().splitlines()
    builders = {call.split()[0] for call in calls}
    # one build: a compile per source and one link, all from one process (the others waited for it)
    assert len(calls) == len(build.SOURCES) + 1 and len(builders) == 1, calls
    (library,) = (cache / "kernels").glob("*.so")
    assert sorted(path.name for path in library.parent.iterdir()) == sorted(kept_with(library))
    assert build.intact(library)


def kept_with(library: Path) -> list[str]:
    """What the cache holds for one build: the library, its digest and its lock file (no temporary file)."""
    return [library.name, library.name + ".lock", library.name + ".sha256"]


def built_once(tmp_path: Path) -> tuple[Path, dict]:
    """The kernels built into a cache of their own by another process: the library's path, and the environment that
    finds it."""
    cc = compiler_wrapper(tmp_path, tmp_path / "compiler.log")
    env = environment(tmp_path / "cache", CC=str(cc))
    finished([subprocess.Popen([sys.executable, "-c", KERNEL_USER], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)])  # fmt: skip
    (library,) = (tmp_path / "cache" / "kernels").glob("*.so")
    return library, env


@pytest.mark.parametrize("damage", ["truncated", "foreign"])
def test_a_damaged_or_foreign_library_in_the_cache_is_built_again_with_a_warning(tmp_path, monkeypatch, damage):
    library, env = built_once(tmp_path)
    if damage == "truncated":  # loaded as it is, it would stop the process (a bus error)
        library.write_bytes(library.read_bytes()[:4096])
    else:  # a sound shared library, but not the kernels: none of their functions
        source = tmp_path / "other.c"
        source.write_text("int focus_something_else(void) { return 1; }\n")
        subprocess.run([build.compiler(), "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    for name in ("CC", "FOCUS_HF_CACHE"):
        monkeypatch.setenv(name, env[name])
    native.built_kernels.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="not the library built there.*building them again"):
            kernels = native.native_kernels()
        assert kernels is not None and kernels.build_id == library.stem
        rebuilt = library.read_bytes()
    finally:
        native.built_kernels.cache_clear()
    assert rebuilt[:4] == b"\x7fELF" and len(rebuilt) > 4096
    assert sorted(path.name for path in library.parent.iterdir()) == sorted(kept_with(library))
    # and another process loads the rebuilt library without a word
    result = subprocess.run([sys.executable, "-W", "error", "-c", KERNEL_USER], env=env, cwd=ROOT, capture_output=True,
                            text=True)  # fmt: skip
    assert result.returncode == 0 and "could not" not in result.stderr, result.stderr


# Stores 10 crossovers of shapes of its own, each after re-reading the file.
CROSSOVER_WRITER = """
import sys
from dataclasses import replace
import torch
import focus_hf.attention.crossover as crossover
number = int(sys.argv[1])
query, key = torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 8, 16)
shape = crossover.make_shape(query, key, 1, 8, 128, "shared")
for index in range(10):
    crossover.write_entry(replace(shape, window=1000 * number + index), {"dense_below": 512, "timings": []})
"""


def test_processes_storing_crossovers_at_once_keep_every_entry_and_readers_never_see_part_of_the_file(tmp_path):
    cache = tmp_path / "cache"
    path = cache / crossover.CACHE_FILE
    env = environment(cache, FOCUS_HF_NATIVE="0")  # no kernels to build: the shapes name the torch path
    processes = start_together(CROSSOVER_WRITER, PROCESSES, env, tmp_path / "go")
    reads = 0
    while any(process.poll() is None for process in processes):
        if path.exists():
            data = json.loads(path.read_text())  # a half-written file would not parse
            assert data["version"] == crossover.CACHE_VERSION
            reads += 1
    finished(processes)
    entries = crossover.read_cache(path)
    windows = sorted(entry["shape"]["window"] for entry in entries.values())
    assert windows == sorted(1000 * number + index for number in range(PROCESSES) for index in range(10))
    assert reads > 0
    assert sorted(p.name for p in cache.iterdir()) == [crossover.CACHE_FILE, crossover.CACHE_FILE + ".lock"]


@pytest.mark.parametrize(
    "content, why",
    [
        ("{not json", "is not JSON"),
        ('["a", "list"]', "is not a crossover cache"),
        ('{"somebody": "else"}', "is not a crossover cache"),
        (
            json.dumps({"version": crossover.CACHE_VERSION, "entries": {"k": {"dense_below": "512"}}}),
            "1 of its entries are not crossover measurements",
        ),
        (
            json.dumps(
                {"version": crossover.CACHE_VERSION, "entries": {"k": {"dense_below": 5, "timings": [{"x": 1}]}}}
            ),
            "1 of its entries are not crossover measurements",
        ),
    ],
)
def test_a_corrupt_or_foreign_crossover_cache_is_warned_of_and_replaced(tmp_path, monkeypatch, content, why):
    monkeypatch.setattr(crossover, "_warned_unusable", set())
    path = tmp_path / crossover.CACHE_FILE
    path.write_text(content)
    with pytest.warns(RuntimeWarning, match=why):
        assert crossover.read_cache(path) == {}
    shape = crossover.make_shape(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), 1, 4, 16, "decode")
    crossover.write_entry(shape, {"dense_below": 64}, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert crossover.read_cache(path)[shape.key]["dense_below"] == 64


def test_an_older_crossover_cache_is_measured_again_without_a_warning(tmp_path):
    path = tmp_path / crossover.CACHE_FILE
    path.write_text(json.dumps({"version": crossover.CACHE_VERSION - 1, "entries": {"k": {"dense_below": 5}}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert crossover.read_cache(path) == {}
