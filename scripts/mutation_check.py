"""Mutation check: the test suite must FAIL for each known breakage of the exactness contract.

Each mutation below is a small source edit that breaks the contract the way a real bug
would (drop canonical rescoring, sum the canonical score in float32 or in another order,
reverse the tie-break, zero the tiled engine's margin, drop a tile, drop the quantized
rounding, lose bits of packed weights). For each, the package source (``src/``) is copied
to a temporary folder, the edit applied there (the pattern must occur: a mutation that no
longer applies is an error, so the list follows the code), and a fast subset of the suite runs against the copy with
``PYTHONPATH`` pointing at it. The check passes when the unmutated copy passes the subset
and every mutated one fails it.

Usage::

    PYTHONPATH=src python scripts/mutation_check.py [--only NAME] [--output FILE]

Exit status 0 when every mutation is caught, 1 otherwise. About 3 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEED = "20261126"  # fixed inputs: the check's output is reproducible


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to src/gpusparse
    old: str
    new: str
    tests: tuple[str, ...]  # the fast subset that must fail (pytest node ids or files)
    count: int = 1  # occurrences of ``old`` to replace (all must exist)
    also: tuple[tuple[str, str], ...] = ()  # further (old, new) edits of the same file, once each


# Triton's interpreter (the scatter and docpar engines on a CPU) is slow; the contract's
# arithmetic is shared by every engine and is caught through the others.
FAST = "not scatter and not docpar"
SEARCH = ("tests/test_search.py",)
TILED = ("tests/test_tiled.py",)

MUTATIONS = [
    Mutation(
        "drop canonical rescoring in select_exact_topk",
        "exact.py",
        "    if bool(unsure.any()):",
        "    if False:",
        SEARCH,
    ),
    Mutation(
        "sum the canonical score in float32",
        "exact.py",
        "index.scores[pos].to(torch.float64)",
        "index.scores[pos]",
        SEARCH,
        also=(
            ("qw = batch.padded_weights.to(torch.float64)", "qw = batch.padded_weights"),
            ("acc = torch.zeros(r.numel(), dtype=torch.float64", "acc = torch.zeros(r.numel(), dtype=torch.float32"),
        ),
    ),
    Mutation(
        "sum the canonical score in descending term order",
        "exact.py",
        "for j in range(width):",
        "for j in reversed(range(width)):",
        SEARCH,
    ),
    Mutation(
        "reverse the tie-break (higher document number first)",
        "topk.py",
        "(_ID_MASK - ids.to(torch.int64))",
        "ids.to(torch.int64)",
        SEARCH,
    ),
    Mutation(
        "zero the tiled engine's margin delta",
        "engines/tiled/fixed_point.py",
        "delta = xp.ceil(",
        "delta = 0 * xp.ceil(",
        TILED,
        count=2,
    ),
    Mutation(
        "drop the last tile of the search",
        "engines/tiled/waves.py",
        "        plan.append((done, n))",
        "        plan.append((done, n - (done + n == n_tiles)))",
        TILED,
    ),
    Mutation(
        "skip the last wave",
        "engines/tiled/waves.py",
        "        for first, n in plan:",
        "        for first, n in plan[:-1]:",
        TILED,
    ),
    Mutation(
        "drop the quantized rounding (truncate instead)",
        "quantize.py",
        "torch.round(values.to(torch.float64) / step)",
        "torch.floor(values.to(torch.float64) / step)",
        ("tests/test_quantize.py",),
    ),
    Mutation(
        "lose the low bits of packed float32 weights",
        "layout/packing.py",
        "(field & 0xFF).to(torch.uint8)",
        "(field & 0xF0).to(torch.uint8)",
        ("tests/test_packing.py",),
    ),
    Mutation(
        "the encoder's word cache takes texts with special tokens or control characters",
        "encode_wordpiece.py",
        "return text.isascii() and (self._suspect(text) is None or self._refuse(text) is None)",
        "return text.isascii()",
        ("tests/test_encode_wordpiece.py::test_word_cache_equals_the_rust_tokenizer",),
    ),
    Mutation(
        "the graphs' max pooling takes padding positions' own logits",
        "encode_graphs.py",
        "return (torch.where(pad[..., None], x[:, :1], x), *args[1:])",
        "return args",
        ("tests/test_encode_graphs.py::test_bucketed_forward_equals_eager",),
    ),
    Mutation(
        "a replay's vectors are not copied out before the next replay overwrites them",
        "encode_graphs.py",
        "return out[:b].clone()",
        "return out[:b]",
        ("tests/test_encode_graphs.py::test_capture_path_on_a_fake_cuda",),
    ),
    Mutation(
        "a search's results taken from a graph are the slot's buffers, which the next replay overwrites",
        "engines/tiled/graphs.py",
        "self._taken = [None if i == skip else t for i, t in enumerate(self._own_t)]",
        "self._taken = [None if i == skip else torch.from_numpy(h) for i, h in enumerate(slot.host_np)]",
        ("tests/test_tiled_graphs.py::test_results_in_memory_of_their_own_taken_before_the_wait",),
    ),
    Mutation(
        "a graph's repeat takes a batch of another query width",
        "engines/tiled/graphs.py",
        "if longest is None or query_width(longest) != entry.width:",
        "if longest is None:",
        ("tests/test_tiled_graphs.py::test_a_repeat_replays_its_own_shape_only",),
    ),
    Mutation(
        "a search's repeat leaves the rows its graph flagged unsearched",
        "search.py",
        "out = SearchResults(*complete_later(res)(), engine=self.engine.name)",
        "out = SearchResults(*res.host.take()[:2], engine=self.engine.name)",
        ("tests/test_search.py::test_a_search_repeats_its_one_batch_by_the_engines_repeat",),
    ),
    Mutation(
        "a search's repeat keeps its results without the score bound's proof",
        "search.py",
        "                if as_they_are(queries, src.quantization, *self.statistics, defer=self.defer):",
        "                if True:",
        ("tests/test_search.py::test_a_search_repeats_its_one_batch_by_the_engines_repeat",),
    ),
]


def mutated_tree(dest: Path, mutation: Mutation | None) -> Path:
    """A copy of ``src/`` under ``dest`` with ``mutation`` applied; returns the copy's ``src``."""
    src = dest / "src"
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    if mutation is not None:
        path = src / "gpusparse" / mutation.path
        text = path.read_text()
        found = text.count(mutation.old)
        if found != mutation.count:
            raise SystemExit(
                f"mutation {mutation.name!r}: expected {mutation.count} occurrence(s) of {mutation.old!r} in "
                f"src/gpusparse/{mutation.path}, found {found}: update scripts/mutation_check.py to the code"
            )
        text = text.replace(mutation.old, mutation.new)
        for old, new in mutation.also:
            if text.count(old) != 1:
                raise SystemExit(f"mutation {mutation.name!r}: {old!r} not found once in src/gpusparse/{mutation.path}")
            text = text.replace(old, new)
        path.write_text(text)
    return src


def run_tests(src: Path, tests: tuple[str, ...]) -> tuple[int, float, str]:
    """Run ``tests`` against the package in ``src``: (pytest's exit status, seconds, last line)."""
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{ROOT / 'bench'}", "GPUSPARSE_TEST_SEED": SEED}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    probe = subprocess.run(
        [sys.executable, "-c", "import gpusparse; print(gpusparse.__file__)"], env=env, capture_output=True, text=True
    )
    if not probe.stdout.startswith(str(src)):
        raise SystemExit(f"the tests would import gpusparse from {probe.stdout.strip() or probe.stderr}, not {src}")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not slow", "-k", FAST, *tests],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return proc.returncode, time.perf_counter() - t0, lines[-1] if lines else proc.stderr.strip()[-200:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run only the mutations whose name contains this")
    parser.add_argument("--output", type=Path, help="also write the report to this file")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if args.only is None or args.only in m.name]
    out: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        out.append(line)

    say(f"mutation check of {ROOT.name} ({len(chosen)} mutations, GPUSPARSE_TEST_SEED={SEED})")
    ok = True
    subsets = sorted({t for m in chosen for t in m.tests})
    with tempfile.TemporaryDirectory(prefix="gpusparse-mutation-") as tmp:
        src = mutated_tree(Path(tmp) / "baseline", None)
        rc, secs, last = run_tests(src, tuple(subsets))
        say(f"baseline (no mutation): pytest exit {rc} in {secs:.0f} s: {last}")
        if rc != 0:
            say("FAILED: the unmutated tree must pass the subset")
            ok = False
        for m in chosen:
            src = mutated_tree(Path(tmp) / f"m{chosen.index(m)}", m)
            rc, secs, last = run_tests(src, m.tests)
            caught = rc == 1  # 1: tests failed (2-5 would be an interrupted or broken run)
            ok &= caught
            verdict = "caught" if caught else "NOT CAUGHT"
            say(f"{verdict:10} {m.name} [{m.path}; {' '.join(m.tests)}]: pytest exit {rc} in {secs:.0f} s: {last}")
    say("mutation check: every mutation caught" if ok else "mutation check: FAILED")
    if args.output is not None:
        args.output.write_text("\n".join(out) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
